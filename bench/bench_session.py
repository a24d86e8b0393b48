"""onnxruntime session creation and run latency on a Llama-shaped model, with the weight fold.

    python bench/bench_session.py [--layers 8] [--hidden 1024] [--repeat 7]

Three files of the same model: torch.onnx.export(dynamo=True) (flat), onnx_modular (default),
and onnx_modular without FoldWeightsPass (the Linear bodies transpose their weight, so
onnxruntime folds every transpose while loading). Sessions are created round-robin, at
onnxruntime's default optimization level and with optimizations disabled, which separates
onnxruntime's function inlining from its graph optimizations. Prints medians and ratios to flat.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import _common
import onnx_ir as ir
import onnxruntime as ort
import torch

from onnx_modular import export_modular
from onnx_modular.passes.export import fold_weights


def build(layers: int, hidden: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=8000, hidden_size=hidden, intermediate_size=int(hidden * 2.75), num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, use_cache=False,
    )
    return transformers.LlamaModel(config).eval(), (torch.randint(0, 8000, (1, 32)),)


def export_without_fold(model, args, path) -> None:
    original = fold_weights.FoldWeightsPass.call
    fold_weights.FoldWeightsPass.call = lambda self, m: ir.passes.PassResult(m, modified=False)
    try:
        export_modular(model, args, path, verify=False, external_data=True)
    finally:
        fold_weights.FoldWeightsPass.call = original


def create(path, level) -> tuple[float, ort.InferenceSession]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = level
    start = time.perf_counter()
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return time.perf_counter() - start, session


def optimized_graph(path, tmp) -> tuple[int, int]:
    """(nodes, initializers) of the graph onnxruntime runs, after inlining and its optimizations."""
    import onnx

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(tmp / f"{path.stem}.ort.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    proto = onnx.load(options.optimized_model_filepath, load_external_data=False)
    return len(proto.graph.node), len(proto.graph.initializer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=7)
    options = parser.parse_args()
    model, args = build(options.layers, options.hidden)
    params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        files = {"flat": tmp / "flat.onnx", "modular": tmp / "modular.onnx", "modular, no fold": tmp / "nofold.onnx"}
        _common.flat_export(model, args, {}, files["flat"])
        export_modular(model, args, files["modular"], verify=False, external_data=True)
        export_without_fold(model, args, files["modular, no fold"])
        feeds = {"input_ids": args[0].numpy()}
        levels = {"default": ort.GraphOptimizationLevel.ORT_ENABLE_ALL, "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}
        print(f"Llama-shaped, {options.layers} layers, hidden {options.hidden}, {params / 1e6:.0f} M parameters; medians of {options.repeat}")
        print("| file | session, default opt (s) | ratio | session, opt disabled (s) | ratio | run latency (ms) | ratio | nodes / initializers onnxruntime runs |")
        print("|---|---|---|---|---|---|---|---|")
        sessions = {level: {name: [] for name in files} for level in levels}
        latency = {name: [] for name in files}
        for _ in range(options.repeat):
            for name, path in files.items():
                for level, value in levels.items():
                    seconds, session = create(path, value)
                    sessions[level][name].append(seconds)
                    if level == "default":
                        latency[name].append(_common.run_latency(session, feeds, 5))
        med = {level: {n: statistics.median(v) for n, v in d.items()} for level, d in sessions.items()}
        lat = {n: statistics.median(v) for n, v in latency.items()}
        for name in files:
            print(
                f"| {name} | {med['default'][name]:.3f} | {med['default'][name] / med['default']['flat']:.2f} | "
                f"{med['disabled'][name]:.3f} | {med['disabled'][name] / med['disabled']['flat']:.2f} | "
                f"{lat[name] * 1000:.1f} | {lat[name] / lat['flat']:.3f} | "
                "{} / {} |".format(*optimized_graph(files[name], tmp))
            )


if __name__ == "__main__":
    main()
