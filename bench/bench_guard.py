"""The accuracy guard's cost: per-token decode of the guarded int4 file against the unguarded one
(every MatMulNBits at accuracy level 4, int8 compute) and the level-0 one (float compute), the same
int4 weights in all three.

A Llama of about 125M parameters (the size of ``bench_decode.py``'s; random weights) with massive
activations in one MLP (``--massive-layer``: a few channels of its down_proj input 1,000x the
others, the up_proj rows scaled up and the down_proj columns down, so float32 output is unchanged:
what onnxruntime #29849 reports of Qwen3-0.6B and Phi-3.5-mini) is exported, then

    onnx-modular optimize m.onnx -o m.q4.onnx --quantize int4

writes the guarded file; the unguarded and the level-0 files are that file with every
``MatMulNBits`` at level 4 or at level 0 (``accuracy_level`` attributes only). Then
``bench_decode.py`` compares their greedy tokens with the level-0 file's and times the guarded and
the level-0 file each against the unguarded one, two files at a time (one intra-op thread, the
files taking turns run by run, medians).

    python bench/bench_guard.py [--layers 12] [--massive-layer 6] [--rounds 5] [--keep DIR]

The machine is shared: read the ratios, not the milliseconds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import onnx

HERE = os.path.dirname(os.path.abspath(__file__))


def _checkpoint(folder: str, layers: int, massive_layer: int | None) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if massive_layer is not None:
        mlp = model.model.layers[massive_layer].mlp
        channels = list(range(5, 2048, 256))  # one in every 8th block of 32: 8 channels
        with torch.no_grad():
            mlp.up_proj.weight[channels] *= 1000.0
            mlp.down_proj.weight[:, channels] /= 1000.0
    model.save_pretrained(folder)


def _with_level(path: str, output: str, level: int) -> None:
    from onnx_modular.files.optimize.accuracy_guard import set_accuracy_level

    onnx.save(set_accuracy_level(onnx.load(path, load_external_data=False), level), output)  # beside path: its data file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--massive-layer", type=int, default=6, help="-1: none (a normal model)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--greedy", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=128, help="0: no prefill case")
    parser.add_argument("--keep", default=None, metavar="DIR", help="build the files in DIR and keep them (reused when there)")
    args = parser.parse_args()

    from onnx_modular import optimize
    from onnx_modular.cli import main as cli

    folder = args.keep or tempfile.mkdtemp(prefix="bench_guard-")
    os.makedirs(folder, exist_ok=True)
    ckpt, exported = os.path.join(folder, "ckpt"), os.path.join(folder, "m.onnx")
    guarded = os.path.join(folder, "m.q4.onnx")
    if not os.path.exists(exported):
        _checkpoint(ckpt, args.layers, None if args.massive_layer < 0 else args.massive_layer)
        assert cli(["export", ckpt, "--task", "causal-lm-with-past", "--io-names", "optimum", "-o", exported,
                    "--no-verify"]) == 0
    if not os.path.exists(guarded):
        start = time.perf_counter()
        report = optimize(exported, guarded, max_positions=2048, quantize="int4")
        seconds = time.perf_counter() - start
        print(report.quantization.text())
        print(f"optimize --quantize int4 (fusion verified, quantized, guarded): {seconds:.1f} s")
    unguarded, level0 = os.path.join(folder, "m.q4.level4.onnx"), os.path.join(folder, "m.q4.level0.onnx")
    _with_level(guarded, unguarded, 4)
    _with_level(guarded, level0, 0)
    decode = [sys.executable, os.path.join(HERE, "bench_decode.py")]
    # greedy tokens against the level-0 file's; then the times, as ratios to the unguarded file's
    subprocess.run([*decode, f"level0={level0}", f"unguarded={unguarded}", f"guarded={guarded}", "--rounds", "0",
                    "--greedy", str(args.greedy)], check=True)
    # two files at a time: with three taking turns (order reversed every turn), the middle one
    # always ran second and came out 2-20% faster on this machine whichever file it was
    for other in (f"guarded={guarded}", f"level0={level0}"):
        subprocess.run([*decode, f"unguarded={unguarded}", other, "--past", "16", "64", "--prefill", str(args.prefill),
                        "--rounds", str(args.rounds), "--runs", str(args.runs)], check=True)

if __name__ == "__main__":
    main()
