"""onnxruntime's own cost of model-local functions, on models built with onnx.helper only.

    python bench/ort_function_overhead.py [--blocks 12] [--repeat 15]

No onnx_modular, no torch: the same computation (``blocks`` blocks of ``Add``/``Mul``/``Relu``
on a [4, 64] tensor, each with its own weights) written four ways, all with the same nodes once
inlined:

- flat: one graph;
- functions: one function per block (depth 1), called ``blocks`` times;
- nested: each block calls three one-op functions (depth 2), as modules nest;
- nested, inlined offline: the nested model inlined by ``onnx.inliner`` (= flat, renamed);

and, with a ``Reshape`` to a constant shape at the end of every block, that constant as a flat
initializer, as a ``Constant`` node in the function body, or lifted to an input every call passes
from one initializer (what onnx_modular's ``FoldWeightsPass`` writes).

Session creation is measured in CPU time of this process (``time.process_time``; one intra-op
thread, files alternated, medians), which a loaded machine inflates far less than wall time,
at onnxruntime's default optimization level and with optimizations disabled. The difference
between "nested" and its inlined copy is what onnxruntime spends on the calls themselves.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

DOMAIN = "pkg.bench"
OPS = ("Add", "Mul", "Relu")


def _weights(blocks: int) -> list[onnx.TensorProto]:
    rng = np.random.default_rng(0)
    return [
        numpy_helper.from_array(rng.standard_normal((4, 64)).astype(np.float32), f"b{b}.{op}")
        for b in range(blocks)
        for op in OPS[:2]
    ]


def _block_nodes(x: str, y: str, prefix: str, b: int) -> list[onnx.NodeProto]:
    return [
        helper.make_node("Add", [x, f"b{b}.Add"], [f"{prefix}a"]),
        helper.make_node("Mul", [f"{prefix}a", f"b{b}.Mul"], [f"{prefix}m"]),
        helper.make_node("Relu", [f"{prefix}m"], [y]),
    ]


def _model(nodes, blocks: int, functions=()) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
        [helper.make_tensor_value_info(f"y{blocks - 1}", TensorProto.FLOAT, [4, 64])], _weights(blocks),
    )
    opsets = [helper.make_opsetid("", 18)] + ([helper.make_opsetid(DOMAIN, 1)] if functions else [])
    return helper.make_model(graph, opset_imports=opsets, functions=list(functions), ir_version=10)


def flat(blocks: int) -> onnx.ModelProto:
    nodes, x = [], "x"
    for b in range(blocks):
        nodes += _block_nodes(x, f"y{b}", f"h{b}.", b)
        x = f"y{b}"
    return _model(nodes, blocks)


def functions(blocks: int) -> onnx.ModelProto:
    body = [
        helper.make_node("Add", ["x", "wa"], ["a"]),
        helper.make_node("Mul", ["a", "wm"], ["m"]),
        helper.make_node("Relu", ["m"], ["y"]),
    ]
    block = helper.make_function(DOMAIN, "Block", ["x", "wa", "wm"], ["y"], body, [helper.make_opsetid("", 18)])
    nodes = [
        helper.make_node("Block", ["x" if b == 0 else f"y{b - 1}", f"b{b}.Add", f"b{b}.Mul"], [f"y{b}"], domain=DOMAIN)
        for b in range(blocks)
    ]
    return _model(nodes, blocks, [block])


def nested(blocks: int) -> onnx.ModelProto:
    one_op = [
        helper.make_function(DOMAIN, "AddW", ["x", "w"], ["y"], [helper.make_node("Add", ["x", "w"], ["y"])], [helper.make_opsetid("", 18)]),
        helper.make_function(DOMAIN, "MulW", ["x", "w"], ["y"], [helper.make_node("Mul", ["x", "w"], ["y"])], [helper.make_opsetid("", 18)]),
        helper.make_function(DOMAIN, "Act", ["x"], ["y"], [helper.make_node("Relu", ["x"], ["y"])], [helper.make_opsetid("", 18)]),
    ]
    body = [
        helper.make_node("AddW", ["x", "wa"], ["a"], domain=DOMAIN),
        helper.make_node("MulW", ["a", "wm"], ["m"], domain=DOMAIN),
        helper.make_node("Act", ["m"], ["y"], domain=DOMAIN),
    ]
    block = helper.make_function(
        DOMAIN, "Block", ["x", "wa", "wm"], ["y"], body, [helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)]
    )
    nodes = [
        helper.make_node("Block", ["x" if b == 0 else f"y{b - 1}", f"b{b}.Add", f"b{b}.Mul"], [f"y{b}"], domain=DOMAIN)
        for b in range(blocks)
    ]
    return _model(nodes, blocks, [*one_op, block])


def _reshaping(blocks: int, where: str) -> onnx.ModelProto:
    """Each block ends in a ``Reshape`` to its own shape ([4, 64]) read from a constant that is a
    shared initializer (``flat``), a ``Constant`` in the function body (``body``), or an input
    every call passes from one shared initializer (``lifted``): what a per-call constant costs."""
    shape = numpy_helper.from_array(np.array([4, 64], np.int64), "shape")
    nodes = []
    if where == "flat":
        x = "x"
        for b in range(blocks):
            nodes += _block_nodes(x, f"r{b}", f"h{b}.", b)
            nodes.append(helper.make_node("Reshape", [f"r{b}", "shape"], [f"y{b}"]))
            x = f"y{b}"
        model = _model(nodes, blocks)
        model.graph.initializer.append(shape)
        return model
    body = [
        helper.make_node("Add", ["x", "wa"], ["a"]),
        helper.make_node("Mul", ["a", "wm"], ["m"]),
        helper.make_node("Relu", ["m"], ["r"]),
        helper.make_node("Reshape", ["r", "shape"], ["y"]),
    ]
    inputs = ["x", "wa", "wm"]
    if where == "body":
        body.insert(0, helper.make_node("Constant", [], ["shape"], value=numpy_helper.from_array(np.array([4, 64], np.int64))))
    else:
        inputs.append("shape")
    block = helper.make_function(DOMAIN, "Block", inputs, ["y"], body, [helper.make_opsetid("", 18)])
    nodes = [
        helper.make_node(
            "Block", ["x" if b == 0 else f"y{b - 1}", f"b{b}.Add", f"b{b}.Mul"] + (["shape"] if where == "lifted" else []),
            [f"y{b}"], domain=DOMAIN,
        )
        for b in range(blocks)
    ]
    model = _model(nodes, blocks, [block])
    if where == "lifted":
        model.graph.initializer.append(shape)
    return model


def cpu_seconds(path: pathlib.Path, level: ort.GraphOptimizationLevel) -> float:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.graph_optimization_level = level
    start = time.process_time()
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=15)
    options = parser.parse_args()
    models = {
        "flat": flat(options.blocks),
        "functions (depth 1)": functions(options.blocks),
        "nested (depth 2)": nested(options.blocks),
    }
    models["nested, inlined offline"] = onnx.inliner.inline_local_functions(models["nested (depth 2)"])
    models["flat + Reshape"] = _reshaping(options.blocks, "flat")
    models["functions + Reshape, Constant in the body"] = _reshaping(options.blocks, "body")
    models["functions + Reshape, constant lifted to an input"] = _reshaping(options.blocks, "lifted")
    x = np.ones((4, 64), np.float32)
    levels = {"default": ort.GraphOptimizationLevel.ORT_ENABLE_ALL, "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name, model in models.items():
            onnx.checker.check_model(model, full_check=True)
            paths[name] = pathlib.Path(tmp) / f"{len(paths)}.onnx"
            onnx.save(model, paths[name])
        reference = ort.InferenceSession(str(paths["flat"]), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        for path in paths.values():  # every file computes the same thing
            out = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
            np.testing.assert_array_equal(out, reference)
        times = {(level, name): [] for level in levels for name in paths}
        for _ in range(options.repeat):
            for level, value in levels.items():
                for name, path in paths.items():
                    times[(level, name)].append(cpu_seconds(path, value))
    med = {key: statistics.median(v) for key, v in times.items()}
    calls = {"flat": 0, "functions (depth 1)": options.blocks, "nested (depth 2)": 4 * options.blocks, "nested, inlined offline": 0}
    calls.update({name: options.blocks for name in paths if name.startswith("functions + Reshape")}, **{"flat + Reshape": 0})
    print(f"onnxruntime {ort.__version__}; {options.blocks} blocks of 3 ops; CPU ms of session creation, medians of {options.repeat}")
    print("| model | call sites | session, default opt (ms) | ratio | session, opt disabled (ms) | ratio | per call site, disabled (µs) |")
    print("|---|---|---|---|---|---|---|")
    for name in paths:
        base = "flat + Reshape" if "Reshape" in name else "flat"
        per_call = (med[("disabled", name)] - med[("disabled", base)]) / calls[name] * 1e6 if calls[name] else 0.0
        print(
            f"| {name} | {calls[name]} | {med[('default', name)] * 1e3:.2f} | {med[('default', name)] / med[('default', base)]:.2f} | "
            f"{med[('disabled', name)] * 1e3:.2f} | {med[('disabled', name)] / med[('disabled', base)]:.2f} | "
            f"{per_call:.0f} |"
        )


if __name__ == "__main__":
    main()
