"""Deduplication and cleanup on a 12-layer GPT-2 (d=256), against torch.onnx.export(dynamo=True).

    python bench/bench_dedupe.py [--layers 12] [--width 256] [--sessions 5] [--runs 50]

All models are exported and measured in this one run. For each variant it prints:
function definitions, block calls, node count (main graph + all bodies), graph bytes
without weights, onnxruntime session-creation time and run latency (medians), each
as a ratio to the flat torch.onnx.export model, and the max abs diff against torch.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile

import _common
import models
import torch

from onnx_modular import export_modular, files


def node_count(path) -> int:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return len(proto.graph.node) + sum(len(f.node) for f in proto.functions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--sessions", type=int, default=5)
    parser.add_argument("--runs", type=int, default=50)
    options = parser.parse_args()

    model, args, _ = models.gpt2(n_layer=options.layers, d=options.width)
    with torch.no_grad():
        expected = model(*args).last_hidden_state.numpy()
    variants = {
        "modular, no dedupe, no optimize": dict(dedupe=False, optimize=False),
        "modular, dedupe, no optimize": dict(dedupe=True, optimize=False),
        "modular, dedupe + optimize(inline=False) (default)": dict(dedupe=True, optimize=True),
        "modular (default), blocks only (modules=1)": dict(modules=1),
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        paths = {"torch.onnx.export (flat)": tmp / "flat.onnx"}
        _common.flat_export(model, args, None, paths["torch.onnx.export (flat)"])
        for label, kw in variants.items():
            paths[label] = tmp / f"{len(paths)}.onnx"
            export_modular(model, args, paths[label], verify=False, **kw)
        # the deployment route: inline the default export back to flat and optimize it
        label = "modular (default) -> onnx-modular inline --optimize"
        paths[label] = tmp / "deploy.onnx"
        files.inline_file(paths["modular, dedupe + optimize(inline=False) (default)"], paths[label], optimize=True)

        # Sessions are created round-robin so that machine noise hits every variant alike.
        session_times: dict[str, list[float]] = {label: [] for label in paths}
        for _ in range(options.sessions):
            for label, path in paths.items():
                session_times[label].append(_common.median_time(lambda path=path: _common.ort_session(path), 1)[0])
        rows = {}
        for label, path in paths.items():
            session = _common.ort_session(path)
            session_time = statistics.median(session_times[label])
            feeds = _common.feeds_for(session, args)
            latency = _common.run_latency(session, feeds, options.runs)
            diff = _common.max_abs(session.run(None, feeds)[0], expected)
            rows[label] = (node_count(path), _common.graph_bytes(path), session_time, latency, diff, path)

        flat = rows["torch.onnx.export (flat)"]
        print(f"GPT-2, {options.layers} layers, d={options.width}; medians of {options.sessions} sessions / {options.runs} runs\n")
        print("| model | function definitions | nodes | graph bytes (no weights) | bytes ratio | session create (s) | ratio | run latency (ms) | ratio | max abs diff vs torch |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        import onnx

        for label, (nodes, size, session_time, latency, diff, path) in rows.items():
            definitions = len(onnx.load(str(path), load_external_data=False).functions)
            print(
                f"| {label} | {definitions} | {nodes} | {size} | {size / flat[1]:.3f} | {session_time:.3f} | "
                f"{session_time / flat[2]:.2f} | {latency * 1000:.2f} | {latency / flat[3]:.3f} | {diff:.1e} |"
            )


if __name__ == "__main__":
    main()
