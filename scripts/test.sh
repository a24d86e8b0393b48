#!/usr/bin/env bash
# Installs what the tests need (Python packages; Debian's Chromium for the Netron browser test)
# and runs the default test suite. Extra arguments go to pytest (e.g. --runslow).
# Chromium (about 290 MB, installed system-wide with apt-get, only when run as root) is for one test:
# tests/test_netron_browser.py opens `onnx-modular view` in a headless browser. Without it that test
# is skipped; ONNX_MODULAR_NO_CHROMIUM=1 skips the install.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
if [ "${ONNX_MODULAR_NO_CHROMIUM:-0}" = "1" ]; then
  echo "test: ONNX_MODULAR_NO_CHROMIUM=1: no Chromium install; the Netron browser test is skipped unless Chromium is there"
elif ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "test: installing Debian's chromium and chromium-driver (about 290 MB) for the Netron browser test"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
    || echo "warning: Chromium could not be installed; the Netron browser test will be skipped" >&2
fi
echo "ruff: checking onnx_modular/, tests/, scripts/ and bench/ (rules in pyproject.toml)"
python3 -m ruff check onnx_modular tests scripts bench
# One worker per core, at most 4 (each holds a torch and its models: about 2-3 GB), each test file
# on one worker (module-scoped fixtures are built once); TEST_WORKERS=0 runs in this process.
workers="${TEST_WORKERS:-$(python3 -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
if [ "${workers}" -gt 1 ]; then
  parallel=(-n "${workers}" --dist loadfile)
else
  parallel=()
fi
echo "test: running the test suite (pytest -q ${parallel[*]} $*)"
python3 -m pytest -q "${parallel[@]}" "$@"
