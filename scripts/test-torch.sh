#!/usr/bin/env bash
# Runs the test suite against another torch release in its own virtual environment:
#   bash scripts/test-torch.sh 2.15.0 [pytest arguments...]
# The venv lives in .venv-torch-<version> (git-ignored) and is reused on later runs. torch comes from
# the package registry (on PyPI, Linux x86-64 wheels are CUDA builds: ~4 GB of downloads; they run on
# CPU). The system interpreter and the default set-up (scripts/setup.sh, torch 2.13.0) are untouched.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: bash scripts/test-torch.sh <torch version> [pytest arguments...]" >&2
  exit 2
fi
version="$1"
shift
venv=".venv-torch-${version}"
if [ ! -x "${venv}/bin/python" ]; then
  python3 -m venv "${venv}"
fi
"${venv}/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
# torch first and pinned, so that resolving the package cannot pick another torch.
"${venv}/bin/python" -m pip install --quiet --disable-pip-version-check "torch==${version}"
"${venv}/bin/python" -m pip install --quiet --disable-pip-version-check ".[test]" "torch==${version}"
# Run the worktree's sources, not the copy installed into the venv.
PYTHONPATH="$PWD" "${venv}/bin/python" -m pytest -q -p no:cacheprovider "$@"
