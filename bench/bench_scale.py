"""Billion-parameter scale: a Llama-shaped model (TinyLlama-1.1B shape, random init), external data.

    python bench/bench_scale.py [--layers 22] [--hidden 2048] [--intermediate 5632] [--out DIR]

Each measurement runs in its own process so that peak RSS (ru_maxrss) is its own:
1. onnx_modular export (verify=False, external data), 2. torch.onnx.export(dynamo=True) of
the same model, 3. onnxruntime session creation and one run of the modular file, compared
with torch. Prints wall times, peak RSS and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent


def build(options):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=options["hidden"], intermediate_size=options["intermediate"],
        num_hidden_layers=options["layers"], num_attention_heads=32, num_key_value_heads=4,
        max_position_embeddings=2048, use_cache=False,
    )
    with torch.device("cpu"):
        model = transformers.LlamaModel(config).eval()
    return model, (torch.randint(0, 32000, (1, 16)),)


def child(task: str, options: dict) -> dict:
    import resource
    import time

    import torch

    sys.path.insert(0, str(HERE))
    import _common

    model, args = build(options)
    params = sum(p.numel() for p in model.parameters())
    out = pathlib.Path(options["out"])
    result: dict = {"task": task, "params": params}
    start = time.perf_counter()
    if task == "modular":
        from onnx_modular import export_modular

        export_modular(model, args, out / "modular.onnx", external_data=True, verify=False)
    elif task == "flat":
        with _common.quiet():
            torch.onnx.export(model, args, str(out / "flat.onnx"), dynamo=True, external_data=True)
    elif task in ("run", "run_flat"):
        import numpy as np

        with torch.no_grad():
            expected = model(*args).last_hidden_state.numpy()
        created = time.perf_counter()
        session = _common.ort_session(out / ("modular.onnx" if task == "run" else "flat.onnx"))
        result["session_s"] = time.perf_counter() - created
        ran = time.perf_counter()
        actual = session.run(None, _common.feeds_for(session, args))[0]
        result["run_s"] = time.perf_counter() - ran
        result["max_abs"] = float(np.max(np.abs(actual - expected)))
        result["functions"] = len(
            __import__("onnx").load(str(out / ("modular.onnx" if task == "run" else "flat.onnx")), load_external_data=False).functions
        )
    result["wall_s"] = time.perf_counter() - start
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--out", default=None)
    parser.add_argument("--tasks", default="modular,flat,run,run_flat", help="which measurements to make")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        print(json.dumps(child(options.child, json.loads(os.environ["BENCH_OPTIONS"]))))
        return
    out = pathlib.Path(options.out or tempfile.mkdtemp(prefix="bench_scale-"))
    out.mkdir(parents=True, exist_ok=True)
    shared = {"layers": options.layers, "hidden": options.hidden, "intermediate": options.intermediate, "out": str(out)}
    results = {}
    tasks = options.tasks.split(",")
    for task in tasks:
        env = {**os.environ, "BENCH_OPTIONS": json.dumps(shared)}
        proc = subprocess.run([sys.executable, __file__, "--child", task], env=env, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            results[task] = {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
        else:
            results[task] = json.loads(lines[-1])
        print(task, results[task], flush=True)
    modular, flat = results.get("modular", {"error": "skipped"}), results.get("flat", {"error": "skipped"})
    run, run_flat = results.get("run", {"error": "skipped"}), results.get("run_flat", {"error": "skipped"})
    sizes = {p.name: p.stat().st_size for p in out.iterdir()}
    params = next((r["params"] for r in results.values() if "params" in r), 0)
    print(f"\nLlama-shaped, {params / 1e9:.2f}B parameters, {options.layers} layers; files: {sizes}")
    if "error" not in modular and "error" not in flat:
        print(f"export wall: modular {modular['wall_s']:.1f}s, flat {flat['wall_s']:.1f}s, ratio {modular['wall_s'] / flat['wall_s']:.2f}")
        print(f"peak RSS: modular {modular['peak_rss_gb']:.2f} GB, flat {flat['peak_rss_gb']:.2f} GB, ratio {modular['peak_rss_gb'] / flat['peak_rss_gb']:.2f}")
    if "error" not in run:
        print(f"onnxruntime: session {run['session_s']:.1f}s, run {run['run_s']:.2f}s, max abs vs torch {run['max_abs']:.1e}, "
              f"{run['functions']} functions, peak RSS {run['peak_rss_gb']:.2f} GB")
    if "error" not in run and "error" not in run_flat:
        print(f"onnxruntime flat: session {run_flat['session_s']:.1f}s, run {run_flat['run_s']:.2f}s; "
              f"ratios modular/flat: session {run['session_s'] / run_flat['session_s']:.2f}, run {run['run_s'] / run_flat['run_s']:.2f}")


if __name__ == "__main__":
    main()
