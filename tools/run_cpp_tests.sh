#!/usr/bin/env bash
# Builds and runs the C++ tier test (tests/cpp/test_tiers.cpp) with ctest: natively (every
# tier this CPU runs, e.g. avx512, avx2, generic on x86-64), then cross-built for aarch64 with
# tools/aarch64-linux-gnu.cmake and run under qemu-user (neon, generic).
#
#   tools/run_cpp_tests.sh [--native-only | --cross-only]
#
# Needs cmake (>= 3.21) and a C++17 compiler; the cross half needs g++-aarch64-linux-gnu and
# qemu-user (Debian packages; .ci/run installs them) and is skipped, with a note, without them.
# Build trees: $ATTNFAST_CPP_BUILD_DIR (default build-cpp/) /native and /arm64.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${ATTNFAST_CPP_BUILD_DIR:-$root/build-cpp}"
jobs="${ATTNFAST_CPP_JOBS:-2}"
mode="${1:-all}"

generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi

run() {  # run <build dir> <extra cmake args...>
    local dir="$1"; shift
    cmake -S "$root" -B "$dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DATTNFAST_BUILD_TESTS=ON "$@" >"$dir.configure.log" 2>&1 \
        || { cat "$dir.configure.log"; return 1; }
    cmake --build "$dir" -j "$jobs" --target test_tiers >"$dir.build.log" 2>&1 \
        || { tail -n 60 "$dir.build.log"; echo "build FAILED in $dir (full log: $dir.build.log)"; return 1; }
    local log="$dir.ctest.log" ok=1
    ctest --test-dir "$dir" -V -j "$jobs" >"$log" 2>&1 || ok=0
    grep -E "^[0-9]+: (attnfast|tier|SUMMARY|PASS|FAIL|  )|tests passed|Total Test time" "$log" || true
    [ "$ok" = 1 ] || { echo "ctest FAILED in $dir (full log: $log)"; return 1; }
}

mkdir -p "$build"
status=0
if [ "$mode" != "--cross-only" ]; then
    echo "== native ($(uname -m))"
    SECONDS=0
    run "$build/native" || status=1
    echo "== native: ${SECONDS}s"
fi
if [ "$mode" != "--native-only" ]; then
    if command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 && command -v qemu-aarch64 >/dev/null 2>&1; then
        echo "== aarch64 (cross-built, under qemu-aarch64)"
        SECONDS=0
        # One test per tier, run side by side: emulated, the two take ~9 minutes each.
        run "$build/arm64" -DCMAKE_TOOLCHAIN_FILE="$root/tools/aarch64-linux-gnu.cmake" \
            "-DATTNFAST_TEST_TIERS=neon;generic" || status=1
        echo "== aarch64: ${SECONDS}s"
    else
        echo "== aarch64 skipped: needs aarch64-linux-gnu-g++ and qemu-aarch64 (apt-get install g++-aarch64-linux-gnu qemu-user)"
    fi
fi
exit $status
