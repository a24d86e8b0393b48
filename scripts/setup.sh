#!/usr/bin/env bash
# Installs onnx_modular and its test dependencies. Idempotent: quick when already installed.
# torch is pinned and installed first: an unpinned torch would pull the CUDA build. On this
# project's machines `pip install torch==2.13.0` finds the CPU wheel in a local wheel folder; on an
# ordinary machine PyPI's Linux wheel is the CUDA build (several GB of CUDA packages), so set
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu (torch's own CPU wheel index) first.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    python3 -m pip install --quiet --disable-pip-version-check "torch==2.13.0" --index-url "${TORCH_INDEX_URL}"
else
    python3 -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
python3 -m pip install --quiet --disable-pip-version-check -e ".[test]"
