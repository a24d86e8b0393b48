#!/usr/bin/env bash
# The demo: export a small random-weight GPT-2, print the function tree and the parity report,
# and write out/gpt2_modular.onnx.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh hf   # the package and transformers; not the test extras
echo "demo: exporting a small random-weight GPT-2 (about a minute)"
mkdir -p out
python3 -m onnx_modular export onnx_modular.hf.demo:gpt2 -o out/gpt2_modular.onnx
