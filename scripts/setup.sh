#!/usr/bin/env bash
# Installs onnx_modular and its test dependencies. Idempotent: quick when already installed.
# torch is pinned and installed first: an unpinned torch would pull the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python3 -m pip install --quiet --disable-pip-version-check -e ".[test]"
