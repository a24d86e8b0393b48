"""RecordNoOpCallsPass: a body of only Identity is dropped and recorded in its callers' metadata."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from pass_helpers import PACKAGE, call_tree, check

from onnx_modular.format import metadata
from onnx_modular.passes.export.no_op_calls import RecordNoOpCallsPass

# main calls block (Dropout, then Scale, then a Relu) and then a Dropout of its own, whose
# output is the graph output. Dropout's body is only Identity; Scale's computes a Mul.
MODEL = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[3] x) => (float[3] y) {
  h = pkg.test.Block(x)
  y = pkg.test.Dropout(h)
}
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Block (input) => (output) {
  a = pkg.test.Dropout(input)
  b = pkg.test.Scale(a)
  output = Relu(b)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Scale (input) => (output) {
  output = Mul(input, input)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Dropout (input) => (output) {
  kept = Identity(input)
  output = Identity(kept)
}"""


def _model_and_tree():
    model = ir.from_onnx_text(MODEL)
    for function in model.functions.values():
        function.metadata_props[metadata.CLASS] = f"{PACKAGE}.layers.{function.name}"
    names = {"Block": "block", "Dropout": "drop", "Scale": "scale"}
    for node in model.graph:
        node.name = names[node.op_type]
    for function in model.functions.values():
        for node in function:
            if node.domain == "pkg.test":
                node.name = names[node.op_type]
    tree = call_tree(("block", "Block"), ("block.drop", "Dropout"), ("block.scale", "Scale"), ("drop", "Dropout"))
    for call in tree.walk():
        if not call.is_root:
            call.function = ("pkg.test", call.qualified_class.rsplit(".", 1)[1])
    return model, tree


def _no_op_calls(body) -> list:
    return json.loads(body.metadata_props.get(metadata.NO_OP_CALLS, "[]"))


def test_identity_body_is_dropped_and_recorded_with_its_position():
    model, tree = _model_and_tree()
    assert RecordNoOpCallsPass(tree)(model).modified
    names = {f.name for f in model.functions.values()}
    assert names == {"Block", "Scale"}  # Dropout computed nothing: no function left
    assert tree.find("drop").function is None and tree.find("block.drop").function is None
    assert tree.find("block.scale").function == ("pkg.test", "Scale")
    # Each caller records the calls it made: name relative to the body, class, and how many
    # calls with functions it made before (Block: before Scale; main: after Block).
    block = next(f for f in model.functions.values() if f.name == "Block")
    assert _no_op_calls(block) == [["drop", f"{PACKAGE}.layers.Dropout", 0, "block.drop", -1]]
    assert _no_op_calls(model.graph) == [["drop", f"{PACKAGE}.layers.Dropout", 1, "drop", -1]]
    assert [entry.position for entry in metadata.no_op_calls(model.graph)] == [1]
    # Bodies with real ops stay; Scale records nothing.
    scale = next(f for f in model.functions.values() if f.name == "Scale")
    assert [node.op_type for node in scale] == ["Mul"] and metadata.NO_OP_CALLS not in scale.metadata_props
    assert [node.op_type for node in block] == ["Scale", "Relu"]  # the Dropout call's input wired through
    # The main graph output keeps its name: the value Block computes takes it (no Identity).
    assert [value.name for value in model.graph.outputs] == ["y"]
    assert [node.op_type for node in model.graph] == ["Block"]
    assert model.graph.outputs[0].producer().op_type == "Block"
    check(model)
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([-2.0, 0.5, 3.0], dtype=np.float32)
    (y,) = session.run(["y"], {"x": x})
    np.testing.assert_allclose(y, np.maximum(x * x, 0))
    # Idempotent: nothing left to drop; the records stay.
    RecordNoOpCallsPass(tree)(model)
    assert {f.name for f in model.functions.values()} == {"Block", "Scale"}
    assert _no_op_calls(model.graph) == [["drop", f"{PACKAGE}.layers.Dropout", 1, "drop", -1]]


def test_nothing_to_drop_leaves_the_model_unchanged():
    model, tree = _model_and_tree()
    dropout = next(f for f in model.functions.values() if f.name == "Dropout")
    node = next(iter(dropout))
    node.op_type = "Neg"  # a real op: Dropout now computes something
    assert not RecordNoOpCallsPass(tree)(model).modified
    assert {f.name for f in model.functions.values()} == {"Block", "Scale", "Dropout"}
    assert metadata.NO_OP_CALLS not in model.graph.metadata_props
    assert [node.op_type for node in model.graph] == ["Block", "Dropout"]


def test_output_that_is_an_input_keeps_an_identity():
    """A body returning a dropped call of its own input: the output needs a node of its own."""
    text = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[3] x) => (float[3] y, float[3] z) {
  y = pkg.test.Wrap(x)
  z = pkg.test.Dropout(x)
}
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Wrap (input) => (output) {
  output = pkg.test.Dropout(input)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Dropout (input) => (output) {
  output = Identity(input)
}"""
    model = ir.from_onnx_text(text)
    for function in model.functions.values():
        function.metadata_props[metadata.CLASS] = f"{PACKAGE}.layers.{function.name}"
    for node in model.graph:
        node.name = {"Wrap": "wrap", "Dropout": "drop"}[node.op_type]
    wrap = next(f for f in model.functions.values() if f.name == "Wrap")
    next(iter(wrap)).name = "drop"
    tree = call_tree(("wrap", "Wrap"), ("wrap.drop", "Dropout"), ("drop", "Dropout"))
    for call in tree.walk():
        if not call.is_root:
            call.function = ("pkg.test", call.qualified_class.rsplit(".", 1)[1])
    assert RecordNoOpCallsPass(tree)(model).modified
    assert [node.op_type for node in wrap] == ["Identity"] and [v.name for v in wrap.outputs] == ["output"]
    assert [node.op_type for node in model.graph] == ["Wrap", "Identity"]
    assert [value.name for value in model.graph.outputs] == ["y", "z"]
    check(model)
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([-2.0, 0.5, 3.0], dtype=np.float32)
    for result in session.run(["y", "z"], {"x": x}):
        np.testing.assert_array_equal(result, x)
