"""onnxruntime run latency at opsets 18 and 23: onnx_modular against torch.onnx.export (flat).

    python bench/bench_opsets.py [--seq 128 512] [--rounds 40] [--layers 4]

A Llama-shaped model (hidden 256, 8 heads, 4 KV heads, 4 layers, random weights) is exported
four ways in the same run: torch.onnx.export(dynamo=True, opset_version=18 / 23) and
export_modular(opset_version=18 / 23). Each file gets an onnxruntime session with one intra-op
thread; runs alternate between the four files (round-robin, one run each per round) so that
machine load hits all of them alike, and the medians are compared. Goal (issue 14):
modular@23 <= 0.80x flat@18 at sequence 512, and <= 1.01x flat at the same opset.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import _common
import numpy as np
import onnxruntime as ort
import torch

from onnx_modular import export_modular


def build(layers: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, use_cache=False, max_position_embeddings=1024,
    )
    return transformers.LlamaModel(config).eval()


def session(path: pathlib.Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def export_all(model, input_ids, tmp: pathlib.Path) -> dict[str, pathlib.Path]:
    paths = {}
    for version in (18, 23):
        flat = tmp / f"flat{version}.onnx"
        with _common.quiet():
            torch.onnx.export(model, (input_ids,), str(flat), dynamo=True, verbose=False, opset_version=version)
        paths[f"torch flat@{version}"] = flat
        modular = tmp / f"modular{version}.onnx"
        export_modular(model, (input_ids,), modular, opset_version=version)
        paths[f"modular@{version}"] = modular
    return paths


def measure(paths: dict[str, pathlib.Path], input_ids: torch.Tensor, rounds: int, expected) -> dict[str, float]:
    sessions = {name: session(path) for name, path in paths.items()}
    feeds = {name: {s.get_inputs()[0].name: input_ids.numpy()} for name, s in sessions.items()}
    for name, s in sessions.items():  # warm-up, and a parity check of every file
        (out,) = s.run(None, feeds[name])[:1]
        err = _common.max_abs(out, expected)
        if err > 1e-3:
            raise SystemExit(f"{name}: max abs difference {err:.2e} against PyTorch")
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for i in range(rounds):
        order = list(sessions) if i % 2 == 0 else list(reversed(sessions))
        for name in order:
            start = time.perf_counter()
            sessions[name].run(None, feeds[name])
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}, times


def spread(values: list[float]) -> float:
    """Half the interquartile range, relative to the median: the noise of one file's runs."""
    q1, _, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / 2 / statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    model = build(args.layers)
    print(f"Llama hidden 256, 8 heads / 4 KV heads, {args.layers} layers; onnxruntime {ort.__version__}, "
          f"torch {torch.__version__}; 1 intra-op thread, {args.rounds} alternating rounds, medians")
    for seq in args.seq:
        torch.manual_seed(1)
        input_ids = torch.randint(0, 8000, (1, seq))
        with torch.no_grad():
            expected = model(input_ids).last_hidden_state.numpy()
        with tempfile.TemporaryDirectory(prefix="bench_opsets-") as tmp:
            paths = export_all(model, input_ids, pathlib.Path(tmp))
            medians, times = measure(paths, input_ids, args.rounds, expected)
        base = medians["torch flat@18"]
        print(f"\nsequence {seq}")
        print(f"{'file':<16}{'median ms':>10}{'vs flat@18':>12}{'vs flat same opset':>20}{'noise (IQR/2)':>15}")
        for name, value in medians.items():
            same = medians[f"torch flat@{name.rsplit('@', 1)[1]}"]
            print(f"{name:<16}{value * 1e3:>10.2f}{value / base:>11.2f}x{value / same:>19.3f}x{spread(times[name]):>14.1%}")
        # Paired ratio: round-by-round, so load shifts cancel.
        paired = [m / f for m, f in zip(times["modular@23"], times["torch flat@23"])]
        print(f"modular@23 / flat@23, median of per-round ratios: {np.median(paired):.3f}")


if __name__ == "__main__":
    main()
