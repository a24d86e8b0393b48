"""Decode speed of a mixture-of-experts decoder through ``optimize``: the fused float file (experts in
``com.microsoft.MoE``) against its ``--quantize int4`` file (``QMoE``, accuracy level 4), and the
unfused export, with greedy tokens compared (issue 66: int4 at most 0.7x the float file).

A random-weight Mixtral (transformers' config; default hidden 512, 8 experts, top-2, intermediate
1408, 4 layers, vocab 32,000) is saved, exported with ``export --task causal-lm-with-past`` and
optimized twice into ``--folder`` (kept: a second run reuses the files); then
``bench_decode.py`` times the files (one intra-op thread, files alternating run by run, medians).

    python bench/bench_moe.py --folder /tmp/moe_bench --rounds 5 --runs 20 --greedy 24

The machine is shared: read the ratios, not the milliseconds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _build(folder: str, args: argparse.Namespace) -> None:
    import torch
    import transformers

    from onnx_modular.cli import main

    checkpoint, exported = os.path.join(folder, "ckpt"), os.path.join(folder, "m.onnx")
    if not os.path.exists(checkpoint):
        torch.manual_seed(0)
        config = transformers.MixtralConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048, num_local_experts=args.experts,
            num_experts_per_tok=args.top_k)
        transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(checkpoint)
    if not os.path.exists(exported):
        assert main(["export", checkpoint, "--task", "causal-lm-with-past", "-o", exported, "--io-names", "optimum",
                     "--no-verify"]) == 0
    for name, extra in (("opt.onnx", []), ("int4.onnx", ["--quantize", "int4"])):
        target = os.path.join(folder, name)
        if not os.path.exists(target):
            assert main(["optimize", exported, "-o", target, *extra]) == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", required=True, help="where the checkpoint and the files are written (reused when there)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--past", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--greedy", type=int, default=24)
    parser.add_argument("--no-unfused", action="store_true", help="time only the fused float and int4 files")
    args = parser.parse_args()
    os.makedirs(args.folder, exist_ok=True)
    _build(args.folder, args)
    files = [f"float={os.path.join(args.folder, 'opt.onnx')}", f"int4={os.path.join(args.folder, 'int4.onnx')}"]
    if not args.no_unfused:
        files.append(f"unfused={os.path.join(args.folder, 'm.onnx')}")
    command = [sys.executable, os.path.join(HERE, "bench_decode.py"), *files, "--past", *map(str, args.past),
               "--rounds", str(args.rounds), "--runs", str(args.runs), "--vocab", str(args.vocab), "--prefill", "0",
               "--greedy", str(args.greedy), "--checkpoint", os.path.join(args.folder, "ckpt")]
    subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
