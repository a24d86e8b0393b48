#!/usr/bin/env bash
# Installs onnx_modular with one set of extras: `bash scripts/setup.sh hf` (what the demo needs:
# the package and transformers) or `bash scripts/setup.sh test` (the test dependencies too:
# pytest, ruff, OpenVINO, Model Explorer's adapter, selenium; about 2 GB). Idempotent: quick when
# already installed. It installs into the `python3` first on PATH: activate a virtual environment
# first (README, "Quick start").
# torch is pinned and installed first: an unpinned torch would pull the CUDA build. On this
# project's machines `pip install torch==2.13.0` finds the CPU wheel in a local wheel folder; on an
# ordinary machine PyPI's Linux wheel is the CUDA build (several GB of CUDA packages), so set
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu (torch's own CPU wheel index) first.
# transformers is pinned for both extras to the release the tests use (5.23.0), so the demo and the
# tests see the same release (its KV cache input names differ between 5.23 and 5.24); the `hf` extra
# itself admits 5.23 and 5.24 (`bash scripts/test-transformers.sh 5.24.0` tests 5.24).
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-test}"
case "${extra}" in
  hf|test) ;;
  *) echo "usage: bash scripts/setup.sh [hf|test]" >&2; exit 2 ;;
esac
echo "setup: torch 2.13.0 (CPU) into $(command -v python3)"
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    python3 -m pip install --quiet --disable-pip-version-check "torch==2.13.0" --index-url "${TORCH_INDEX_URL}"
else
    python3 -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
transformers="5.23.0"
echo "setup: onnx_modular and its '${extra}' extra (pip install -e \".[${extra}]\" transformers==${transformers})"
python3 -m pip install --quiet --disable-pip-version-check -e ".[${extra}]" "transformers==${transformers}"
