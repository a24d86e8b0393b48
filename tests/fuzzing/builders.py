"""What the file fuzzer's generators share: the seed exports (:func:`make_seeds`), writing a case
and its promises (:func:`_write`, :func:`_checks`, :func:`_fingerprint`), and models built with
``onnx.helper`` (:func:`bomb`, :func:`block_model`, :func:`loop_model`, :func:`chain_of_calls`,
:func:`_model`), which the hostile-file tests also build from.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random
import subprocess
import sys
import textwrap
from collections.abc import Callable

import numpy
import onnx
from onnx import TensorProto, helper

#: A generator's promises about its case, checked after the commands (``case/.checks.json``):
#: ``keep`` files that must stay byte-identical (or stay FIFOs), ``inputs`` an .npz for verify,
#: ``optimize`` to run ``inline --optimize``.
CHECKS_FILE = ".checks.json"
DOMAIN = "pkg.fuzz"

# -- seeds: real exports ----------------------------------------------------------------

_SEED_SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn
    from onnx_modular import export_modular

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.proj = nn.Linear(8, 8)
        def forward(self, x):
            return x + torch.tanh(self.proj(self.norm(x)))

    class Net(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.blocks = nn.ModuleList([Block() for _ in range(2)])
            self.head = nn.Linear(8, width)
        def forward(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(x).softmax(-1)

    torch.manual_seed(0)
    folder = sys.argv[1]
    ids = torch.randint(0, 16, (2, 5))
    export_modular(Net(8).eval(), (ids,), folder + "/small.onnx")
    export_modular(Net(64).eval(), (ids,), folder + "/external/ext.onnx", external_data=True)
    """
)


def make_seeds(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """Export the seed models once (a subprocess: torch is needed only here)."""
    seeds = {"small": folder / "small.onnx", "external": folder / "external" / "ext.onnx"}
    if all(path.exists() for path in seeds.values()):
        return seeds
    (folder / "external").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", _SEED_SCRIPT, str(folder)], check=True, env=env, capture_output=True)
    return seeds


# -- case generators: each writes into ``case`` and returns the model file name ---------------

Generator = Callable[[random.Random, pathlib.Path, dict], str]


def _write(case: pathlib.Path, data: bytes, name: str = "m.onnx") -> str:
    (case / name).write_bytes(data)
    return name


def _seed_bytes(rng: random.Random, seeds: dict) -> bytes:
    return seeds["small"].read_bytes()


# -- issue 25: hidden external data, names for the terminal, npz inputs, destinations ------


def _checks(case: pathlib.Path, **checks) -> None:
    (case / CHECKS_FILE).write_text(json.dumps(checks))


def _fingerprint(path: pathlib.Path) -> str:
    if path.is_fifo():
        return "fifo"
    if not path.exists():
        return "missing"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _external_ref(tensor: onnx.TensorProto, location: str) -> None:
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    del tensor.external_data[:]
    tensor.external_data.add(key="location", value=location)


_TERMINAL = ["\x1b[2J\x1b[H", "\x1b]0;owned\x07", "\u202eevil", "PASS\x1b[1A\x1b[2K", "\u2066x\u2069"]


# -- generated function graphs ----------------------------------------------------------


def _opsets():
    return [helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)]


def _model(nodes, functions, inputs=None, outputs=None):
    inputs = inputs or [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])]
    outputs = outputs or [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])]
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    model = helper.make_model(graph, opset_imports=_opsets(), functions=functions)
    model.ir_version = 10
    return model


def _call(name, inputs, outputs):
    return helper.make_node(name, inputs, outputs, domain=DOMAIN)


def bomb(depth: int = 24, fanout: int = 2, via_if: bool = False) -> onnx.ModelProto:
    """``f0`` is one Relu; ``f{i}`` calls ``f{i-1}`` ``fanout`` times (or in both If branches)."""
    functions = [helper.make_function(DOMAIN, "f0", ["a"], ["b"], [helper.make_node("Relu", ["a"], ["b"])], _opsets())]
    for level in range(1, depth):
        below = f"f{level - 1}"
        if via_if:
            def branch(tag, below=below):  # bound now: each level calls the one below it
                nodes = [_call(below, ["a"], [f"{tag}0"]), _call(below, [f"{tag}0"], [f"{tag}1"])]
                return helper.make_graph(nodes, tag, [], [helper.make_tensor_value_info(f"{tag}1", TensorProto.FLOAT, None)])

            nodes = [
                helper.make_node("ReduceSum", ["a"], ["s"], keepdims=0),
                helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("z", TensorProto.FLOAT, [], [0.0])),
                helper.make_node("Greater", ["s", "zero"], ["c"]),
                helper.make_node("If", ["c"], ["b"], then_branch=branch("t"), else_branch=branch("e")),
            ]
        else:
            nodes, current = [], "a"
            for i in range(fanout):
                out = "b" if i == fanout - 1 else f"t{i}"
                nodes.append(_call(below, [current], [out]))
                current = out
        functions.append(helper.make_function(DOMAIN, f"f{level}", ["a"], ["b"], nodes, _opsets()))
    return _model([_call(f"f{depth - 1}", ["x"], ["y"])], functions)


# -- issue 38: the new surfaces (profile, extract, replace, the flat copy, the output folder, view) --

_BLOCK = "pkg.fuzz.block"


def block_model(function_name: str = "Blk", call_name: str = "/blk", weight: str = "w") -> onnx.ModelProto:
    """One call of ``function_name`` (``b = a + w``) on a 2x3 input; ``w`` a 2x3 initializer."""
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(_BLOCK, 1)]
    body = helper.make_function(_BLOCK, function_name, ["a", "w"], ["b"], [helper.make_node("Add", ["a", "w"], ["b"])], opsets[:1])
    call = helper.make_node(function_name, ["x", weight], ["y"], domain=_BLOCK, name=call_name)
    value = numpy.arange(6, dtype=numpy.float32).reshape(2, 3)
    graph = helper.make_graph(
        [call], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [onnx.numpy_helper.from_array(value, weight)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=opsets, functions=[body])
    model.ir_version = 10
    return model


def save_external(model: onnx.ModelProto, path: pathlib.Path, location: str) -> None:
    """``model`` at ``path`` with every initializer in the data file ``location`` (beside it)."""
    onnx.save(model, str(path), save_as_external_data=True, location=location, size_threshold=0)


def loop_model(trips: int, condition: bool = False) -> onnx.ModelProto:
    """A ``Loop`` of ``trips`` iterations adding 1 to the input (``condition``: a run-time condition)."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c2"]), helper.make_node("Add", ["v", "one"], ["v2"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("c2", TensorProto.BOOL, []), helper.make_tensor_value_info("v2", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])],
    )  # fmt: skip
    nodes = [helper.make_node("Loop", ["M", "go" if condition else "", "x"], ["y"], body=body, name="loop")]
    if condition:
        nodes.insert(0, helper.make_node("Greater", ["s", "zero"], ["go"]))
        nodes.insert(0, helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor("M", TensorProto.INT64, [], [trips]), helper.make_tensor("zero", TensorProto.FLOAT, [], [1e9])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


def chain_of_calls(calls: int) -> onnx.ModelProto:
    """``calls`` calls of one function ``Blk`` in a row in the main graph (a class of many calls)."""
    model = block_model()
    domain = model.graph.node[0].domain
    del model.graph.node[:]
    current = "x"
    for index in range(calls):
        output = "y" if index == calls - 1 else f"t{index}"
        model.graph.node.append(helper.make_node("Blk", [current, "w"], [output], domain=domain, name=f"/blk{index}"))
        current = output
    return model
