#!/usr/bin/env bash
# Runs the tests that use transformers against another transformers release in its own virtual
# environment (the admitted releases are onnx_modular.hf.versions.TESTED):
#   bash scripts/test-transformers.sh 5.24.0 [pytest arguments...]
# The venv (.venv-transformers-<version>, git-ignored) sees the system site-packages (torch 2.13.0
# and the rest of the default set-up) and adds only that transformers release; the default set-up
# is untouched. Without pytest arguments it runs the transformers tests and the sweep's sample.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: bash scripts/test-transformers.sh <transformers version> [pytest arguments...]" >&2
  exit 2
fi
version="$1"
shift
venv=".venv-transformers-${version}"
if [ ! -x "${venv}/bin/python" ]; then
  echo "creating ${venv} (system site-packages + transformers ${version})"
  python3 -m venv --system-site-packages "${venv}"
fi
"${venv}/bin/python" -m pip install --quiet --disable-pip-version-check "transformers==${version}"
if [ $# -eq 0 ]; then
  set -- tests/test_hf.py tests/test_hf_command.py tests/test_hf_streaming.py tests/test_kv_cache.py tests/test_sweep.py
fi
# Run the worktree's sources, not an installed copy.
PYTHONPATH="$PWD" "${venv}/bin/python" -m pytest -q -p no:cacheprovider "$@"
