"""Tokens per second through onnxruntime-genai's ``Generator``: our ``export --genai`` folder against
the folder of genai's model builder, on the same weights.

    python bench/bench_genai.py [--layers 12] [--hidden 768] [--new 64] [--rounds 7]

A Llama of about 110M parameters (hidden 768, 12 layers, 12 heads, 4 KV heads, vocab 32000,
random weights) is saved with ``save_pretrained`` (and a small offline BPE tokenizer), then
exported: ``onnx_modular.hf.genai.export_genai`` (modular, float32, checked through genai
against ``generate``), the same file optimized into a folder (``write_genai_folder(..., optimize=True)``:
GroupQueryAttention in the bodies, the shared cache buffer) and ``python -m onnxruntime_genai.models.builder -i CKPT -o OUT -p fp32 -e
cpu`` (flat, fused GroupQueryAttention). Both configs get ``intra_op_num_threads: 1``. Each round
runs both folders one after the other (alternating which goes first): a prompt of 16 tokens, then
``--new`` greedy tokens (``min_length`` = ``max_length``, so neither stops early); the prefill and
the decode are timed apart. Prints medians and the ratio ours / builder.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnxruntime_genai as og
import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))


def checkpoint(folder: pathlib.Path, layers: int, hidden: int) -> None:
    from test_genai import _tokenizer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=4, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, architectures=["LlamaForCausalLM"],
    )
    model = transformers.LlamaForCausalLM(config).eval()
    print(f"Llama: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters", flush=True)
    model.save_pretrained(folder)
    _tokenizer(folder)


def one_thread(folder: pathlib.Path) -> None:
    path = folder / "genai_config.json"
    config = json.loads(path.read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = 1
    path.write_text(json.dumps(config, indent=4))


def run(model: og.Model, prompt: np.ndarray, new: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens per second)."""
    params = og.GeneratorParams(model)
    length = prompt.shape[1] + new
    params.set_search_options(do_sample=False, max_length=length, min_length=length)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(prompt)  # runs the prompt
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    steps = 0
    while not generator.is_done():
        generator.generate_next_token()
        steps += 1
    return prefill, steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    from onnx_modular.hf.genai import export_genai, write_genai_folder

    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        checkpoint(root / "ckpt", args.layers, args.hidden)
        start = time.perf_counter()
        ours = export_genai(root / "ckpt", root / "ours", intra_op_threads=1)
        print(f"ours: exported in {time.perf_counter() - start:.0f}s; {ours.check}", flush=True)
        start = time.perf_counter()
        fused = write_genai_folder(root / "ours" / "model.onnx", root / "ckpt", root / "ours_opt", optimize=True, intra_op_threads=1)
        print(f"ours optimized: in {time.perf_counter() - start:.0f}s; {fused.check}", flush=True)
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(root / "ckpt"), "-o", str(root / "builder"),
             "-p", "fp32", "-e", "cpu"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        one_thread(root / "builder")
        print(f"builder: built in {time.perf_counter() - start:.0f}s", flush=True)
        models = {name: og.Model(str(root / name)) for name in ("ours", "ours_opt", "builder")}
        prompt = np.arange(10, 26, dtype=np.int32)[None, :]
        for model in models.values():
            run(model, prompt, 4)  # warm-up
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
        for index in range(args.rounds):
            order = list(models)[index % len(models):] + list(models)[: index % len(models)]  # each goes first in turn
            for name in order:
                results[name].append(run(models[name], prompt, args.new))
        medians = {
            name: (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)) for name, runs in results.items()
        }
        for name, (prefill, rate) in medians.items():
            print(f"{name:8} prefill {prefill * 1e3:7.1f} ms   decode {rate:7.1f} tokens/s")
        for name in ("ours", "ours_opt"):
            print(
                f"{name} / builder: decode tokens/s {medians[name][1] / medians['builder'][1]:.2f}x, "
                f"prefill time {medians[name][0] / medians['builder'][0]:.2f}x "
                f"({args.rounds} rotating rounds, {args.new} new tokens after 16, 1 intra-op thread, medians)"
            )


if __name__ == "__main__":
    main()
