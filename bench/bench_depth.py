"""How onnx_modular's cost grows with depth, and its share of the export time.

    python bench/bench_depth.py [--layers 2,6,12,24,48] [--width 128] [--repeat 5]

For GPT-2-shaped models of each depth, in one process run: median export wall time of
onnx_modular (verify=False) and of torch.onnx.export(dynamo=True), their ratio, the time
spent in onnx_modular's own passes (the "modularize" stage: call tree, outlining, dedupe,
naming, cleanup; onnxscript's optimizer is timed apart, as torch.onnx.export runs one too)
and its share of the export, and that time per layer (flat per-layer
cost means linear growth). Also session-creation and run-latency ratios in onnxruntime.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import _common
import models

from onnx_modular import export_modular


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", default="2,6,12,24,48")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--runs", type=int, default=30)
    options = parser.parse_args()
    print("| layers | modular export (s) | flat export (s) | ratio | our passes (s) | share | passes per layer (ms) | optimizer (s) | session ratio | latency ratio | bytes ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for layers in [int(n) for n in options.layers.split(",")]:
        model, args, _ = models.gpt2(n_layer=layers, d=options.width)
        with tempfile.TemporaryDirectory() as tmp:
            tmp = pathlib.Path(tmp)
            modular_times, pass_times, flat_times, optimizer_times = [], [], [], []
            for _ in range(options.repeat):
                start = time.perf_counter()
                result = export_modular(model, args, tmp / "m.onnx", verify=False)
                modular_times.append(time.perf_counter() - start)
                pass_times.append(result.timings["modularize"])
                optimizer_times.append(result.timings.get("optimize", 0.0))
                start = time.perf_counter()
                _common.flat_export(model, args, None, tmp / "flat.onnx")
                flat_times.append(time.perf_counter() - start)
            sessions = {}
            for label in ("m", "flat"):
                path = tmp / f"{label}.onnx"
                session_time, session = _common.median_time(lambda path=path: _common.ort_session(path), options.repeat)
                latency = _common.run_latency(session, _common.feeds_for(session, args), options.runs)
                sessions[label] = (session_time, latency, _common.graph_bytes(path))
            modular, flat, passes, optimizer = (
                statistics.median(x) for x in (modular_times, flat_times, pass_times, optimizer_times)
            )
            print(
                f"| {layers} | {modular:.2f} | {flat:.2f} | {modular / flat:.2f} | {passes:.3f} | {passes / modular:.1%} | "
                f"{passes / layers * 1000:.1f} | {optimizer:.3f} | {sessions['m'][0] / sessions['flat'][0]:.2f} | "
                f"{sessions['m'][1] / sessions['flat'][1]:.3f} | {sessions['m'][2] / sessions['flat'][2]:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
