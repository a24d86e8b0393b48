"""onnxruntime session creation and run latency: the modular file against torch's flat file.

    python bench/bench_runtime.py [--sessions 9] [--runs 300] [--models gpt2-12,gpt2-48,llama,recurrent]

For each model, both files are written in this run (torch.onnx.export(dynamo=True) and
onnx_modular's default export) and measured with one intra-op thread: sessions created
alternately (the order flips each round), medians of ``--sessions``; each round's two live
sessions then run alternately, ``--runs`` / ``--sessions`` times each, and the latency is the
median of all runs (at least ``--runs``) over all sessions: one session's latency moves by a few
percent with where its buffers land, so a single pair of sessions is not enough. Also printed, because they do not depend on
the machine's load: graph bytes without weights, nodes in the file, and the nodes and
initializers onnxruntime runs after its optimizations (``optimized_model_filepath``), and
whether one run executes the same kernels in the same order (onnxruntime's profiler).

Models: GPT-2 (12 and 48 layers, d=256), a Llama-shaped model of 98 M parameters (8 layers,
hidden 1024) and a recurrent model (2-layer nn.LSTM, nn.GRU, Linear head) on two shapes
(input (2, 16, 32), hidden 64; input (2, 5, 8), hidden 32), random weights perturbed so that
no two tensors are equal (``trained_like``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

import _common
import models
import numpy as np
import onnx
import onnxruntime as ort
import torch

from onnx_modular import export_modular


def llama_100m():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=8000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, use_cache=False,
    )
    return transformers.LlamaModel(config).eval(), (torch.randint(0, 8000, (1, 32)),), {}


def trained_like(build):
    """Perturb every parameter: random init gives equal tensors (every LayerNorm weight is ones,
    every bias zeros), which torch's flat optimizer merges into one initializer (GPT-2 12 layers:
    72 initializers instead of 168) and onnx_modular does not; no checkpoint has them."""

    def build_perturbed():
        model, args, kwargs = build()
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)
        return model, args, kwargs

    return build_perturbed


def recurrent_small():
    """The recurrent model on a short sequence of few features (issue 24's shape)."""
    torch.manual_seed(0)
    return models.Recurrent(features=8, hidden=32).eval(), (torch.randn(2, 5, 8),), {}


MODELS = {
    "gpt2-12": ("GPT-2, 12 layers, d=256", lambda: models.gpt2(n_layer=12, d=256)),
    "gpt2-48": ("GPT-2, 48 layers, d=256", lambda: models.gpt2(n_layer=48, d=256)),
    "llama": ("Llama-shaped, 8 layers, hidden 1024 (98 M)", llama_100m),
    "recurrent": ("LSTM (2 layers) + GRU + Linear", models.recurrent),
    "recurrent-small": ("LSTM (2 layers) + GRU + Linear, input (2, 5, 8), hidden 32", recurrent_small),
}


def session_options(level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.graph_optimization_level = level
    return options


def create(path: pathlib.Path) -> tuple[tuple[float, float], ort.InferenceSession]:
    """((wall seconds, CPU seconds of this thread), session)."""
    options = session_options()
    start, cpu = time.perf_counter(), time.thread_time()
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return (time.perf_counter() - start, time.thread_time() - cpu), session


def run(session: ort.InferenceSession, feeds: dict) -> tuple[float, float]:
    start, cpu = time.perf_counter(), time.thread_time()
    session.run(None, feeds)
    return time.perf_counter() - start, time.thread_time() - cpu


def file_nodes(path: pathlib.Path) -> int:
    proto = onnx.load(str(path), load_external_data=False)
    return len(proto.graph.node) + sum(len(f.node) for f in proto.functions)


def optimized_counts(path: pathlib.Path, tmp: pathlib.Path) -> tuple[int, int]:
    """(nodes, initializers) of the graph onnxruntime runs, after inlining and optimizing."""
    options = session_options()
    options.optimized_model_filepath = str(tmp / f"{path.stem}.optimized.onnx")
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", f"{path.stem}.optimized.data")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    proto = onnx.load(options.optimized_model_filepath, load_external_data=False)
    return len(proto.graph.node), len(proto.graph.initializer)


def kernel_sequence(path: pathlib.Path, args, tmp: pathlib.Path) -> list[str]:
    """The op types of the kernels one run executes, in order (onnxruntime's profiler)."""
    options = session_options()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp / f"{path.stem}.profile")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    session.run(None, _common.feeds_for(session, args))
    with open(session.end_profiling()) as f:
        events = json.load(f)
    return [e["args"]["op_name"] for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]


def measure(key: str, sessions: int, runs: int, tmp: pathlib.Path) -> dict:
    label, build = MODELS[key]
    model, args, kwargs = trained_like(build)()
    paths = {"flat": tmp / f"{key}-flat.onnx", "modular": tmp / f"{key}-modular.onnx"}
    _common.flat_export(model, args, kwargs, paths["flat"])
    export_modular(model, args, paths["modular"], kwargs=kwargs, verify=False)
    with torch.no_grad():
        expected = model(*args, **kwargs)
    expected = expected[0] if isinstance(expected, tuple) else getattr(expected, "last_hidden_state", expected)
    created = {name: [] for name in paths}
    latency = {name: [] for name in paths}
    diffs = {}
    per_session = -(-runs // sessions)
    for round_ in range(sessions):
        # Where a session's buffers land moves its latency by a few percent: every round creates
        # new sessions (the creation order flips each round) and alternates runs between them.
        order = list(paths) if round_ % 2 == 0 else list(reversed(paths))
        live = {}
        for name in order:
            seconds, live[name] = create(paths[name])
            created[name].append(seconds)
        feeds = {name: _common.feeds_for(session, args) for name, session in live.items()}
        for name in order:
            outputs = live[name].run(None, feeds[name])  # warm-up
            diffs.setdefault(name, _common.max_abs(outputs[0], expected.numpy()))
        for _ in range(per_session):
            for name in order:
                latency[name].append(run(live[name], feeds[name]))
        del live
    row = {"label": label, "params": sum(p.numel() for p in model.parameters()), "diff": diffs}
    row["same_kernels"] = kernel_sequence(paths["flat"], args, tmp) == kernel_sequence(paths["modular"], args, tmp)
    for name, path in paths.items():
        row[name] = {
            "session": statistics.median(wall for wall, _ in created[name]),
            "session_cpu": statistics.median(cpu for _, cpu in created[name]),
            "latency": statistics.median(wall for wall, _ in latency[name]),
            "latency_cpu": statistics.median(cpu for _, cpu in latency[name]),
            "bytes": _common.graph_bytes(path),
            "nodes": file_nodes(path),
            "optimized": optimized_counts(path, tmp),
        }
    for path in tmp.iterdir():
        path.unlink()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=9)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--models", default=",".join(MODELS))
    options = parser.parse_args()
    print(f"onnxruntime {ort.__version__}, one intra-op thread; medians of {options.sessions} sessions "
          f"and {options.runs} runs, files alternated")
    print("Wall time, and in brackets CPU time of the calling thread (less sensitive to other load).")
    print("| model | session flat (ms) | session modular (ms) | ratio | latency flat (ms) | latency modular (ms) | ratio "
          "| graph bytes ratio | nodes in file (flat / modular) | nodes / initializers onnxruntime runs (flat; modular) "
          "| same kernels, same order | max abs diff vs torch (flat / modular) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for key in options.models.split(","):
            r = measure(key, options.sessions, options.runs, pathlib.Path(tmp))
            flat, modular = r["flat"], r["modular"]
            print(
                f"| {r['label']} | {flat['session'] * 1e3:.1f} ({flat['session_cpu'] * 1e3:.1f}) | "
                f"{modular['session'] * 1e3:.1f} ({modular['session_cpu'] * 1e3:.1f}) | "
                f"{modular['session'] / flat['session']:.2f} ({modular['session_cpu'] / flat['session_cpu']:.2f}) | "
                f"{flat['latency'] * 1e3:.2f} ({flat['latency_cpu'] * 1e3:.2f}) | "
                f"{modular['latency'] * 1e3:.2f} ({modular['latency_cpu'] * 1e3:.2f}) | "
                f"{modular['latency'] / flat['latency']:.3f} ({modular['latency_cpu'] / flat['latency_cpu']:.3f}) | "
                f"{modular['bytes'] / flat['bytes']:.2f} | {flat['nodes']} / {modular['nodes']} | "
                f"{flat['optimized'][0]} / {flat['optimized'][1]}; {modular['optimized'][0]} / {modular['optimized'][1]} | "
                f"{'yes' if r['same_kernels'] else 'no'} | {r['diff']['flat']:.1e} / {r['diff']['modular']:.1e} |",
                flush=True,
            )


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
