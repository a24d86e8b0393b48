#!/usr/bin/env bash
# Installs onnx_modular and its test dependencies. Idempotent: quick when already installed.
# torch is pinned and installed first, from torch's own CPU wheel index: PyPI's torch wheel for
# Linux is the CUDA build, with several GB of CUDA packages. A torch 2.13.0 already installed (a
# CPU wheel from a local wheel folder, say) is kept, and the index is not contacted.
# TORCH_INDEX_URL chooses another index (https://download.pytorch.org/whl/cu128 for CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c 'import sys, torch; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check "torch==2.13.0" \
        --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
fi
python3 -m pip install --quiet --disable-pip-version-check -e ".[test]"
