"""The cost of `onnx_modular.profile` against the plain runs it measures, on GPT-2 (12 layers).

    python bench/bench_profile.py [--layers 12] [--hidden 256] [--seq 64] [--runs 20] [--warmup 2] [--repeat 5]

The baseline is what a user pays without the profile: one onnxruntime session of the modular file
and the same number of runs (warm-up included). `profile` adds the tagged flat copy, onnxruntime's
profiler and its optimized-graph dump, and the attribution. Both with one intra-op thread, measured
alternately in the same process, medians over `--repeat`. The target (issue 22) is a ratio <= 3.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import _common  # noqa: F401  (sys.path for the tests' models, quiet logging)
import numpy as np
import onnxruntime as ort
import torch

import onnx_modular
from onnx_modular import export_modular


def build(layers: int, hidden: int, seq: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 64), vocab_size=1000, n_positions=max(64, seq),
        use_cache=False, bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2Model(config).eval(), (torch.randint(0, 1000, (1, seq)),)


def plain(path: pathlib.Path, feeds: dict, runs: int) -> float:
    start = time.perf_counter()
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    for _ in range(runs):
        session.run(None, feeds)
    return time.perf_counter() - start


def profiled(path: pathlib.Path, feeds: dict, runs: int, warmup: int):
    start = time.perf_counter()
    report = onnx_modular.profile(path, feeds, runs=runs, warmup=warmup, threads=1)
    return time.perf_counter() - start, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    model, inputs = build(args.layers, args.hidden, args.seq)
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "gpt2.onnx"
        export_modular(model, inputs, path)
        feeds = {"input_ids": inputs[0].numpy()}
        plain(path, feeds, 2)  # load the libraries once before timing
        plain_times, profile_times, report = [], [], None
        for _ in range(args.repeat):  # alternating
            plain_times.append(plain(path, feeds, args.warmup + args.runs))
            seconds, report = profiled(path, feeds, args.runs, args.warmup)
            profile_times.append(seconds)
    base, cost = statistics.median(plain_times), statistics.median(profile_times)
    blocks = [item for item in report.calls() if item.label == "GPT2Block"]
    print(f"GPT-2 {args.layers} layers, hidden {args.hidden}, sequence {args.seq}; {args.runs} runs after {args.warmup} "
          f"warm-up, 1 intra-op thread, medians of {args.repeat} alternating measurements")
    print(f"  plain: session + {args.warmup + args.runs} runs   {base:8.3f} s")
    print(f"  onnx_modular.profile               {cost:8.3f} s")
    print(f"  ratio                               {cost / base:8.2f}x  (target <= 3)")
    print(f"  kernels per run {report.total_us / 1e3:.2f} ms (sum of kernel medians), profiled run {report.median_run_us / 1e3:.2f} ms; "
          f"{len(report.kernels)} kernels, {report.counts['fused']} fused, {report.counts['crossing']} across modules; "
          f"{len(blocks)} GPT2Block calls, {min(b.inclusive_us for b in blocks) / 1e3:.3f} to "
          f"{max(b.inclusive_us for b in blocks) / 1e3:.3f} ms each")
    print(f"  plain times {np.round(plain_times, 3).tolist()}, profile times {np.round(profile_times, 3).tolist()}")


if __name__ == "__main__":
    main()
