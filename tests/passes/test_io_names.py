"""NameGraphInputsOutputsPass on hand-written models: names, prefixes, pass-through outputs."""

from __future__ import annotations

import onnx_ir as ir
from pass_helpers import check

from onnx_modular.passes.export.io_names import NameGraphInputsOutputsPass


def _names(values) -> list[str]:
    return [value.name for value in values]


def test_inputs_and_outputs_take_the_given_names():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18]>
        main (int64[2,3] arg0, float[2,3] arg1) => (float[2,3] linear_3, float[2,3] add_1) {
          c = Cast<to=1>(arg0)  linear_3 = Add(c, arg1)  add_1 = Mul(linear_3, arg1)
        }
    """)
    assert NameGraphInputsOutputsPass(["input_ids", "mask"], ["logits", "hidden"])(model).modified
    assert _names(model.graph.inputs) == ["input_ids", "mask"]
    assert _names(model.graph.outputs) == ["logits", "hidden"]
    check(model)


def test_name_in_both_lists_gets_prefixes_and_pass_through_gets_identity():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18]>
        main (float[2] x, float[2] cache) => (float[2] y, float[2] cache) { y = Relu(x) }
    """)
    NameGraphInputsOutputsPass(["x", "past"], ["y", "past"])(model)
    assert _names(model.graph.inputs) == ["x", "input.past"]
    assert _names(model.graph.outputs) == ["y", "output.past"]
    identity = model.graph.outputs[1].producer()
    assert identity.op_type == "Identity" and identity.inputs[0] is model.graph.inputs[1]
    check(model)


def test_inner_value_moves_but_initializer_keeps_its_name():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18]>
        main (float[2] x) => (float[2] y, float[2] z) <float[2] weight = {1, 2}> {
          logits = Relu(x)  y = Add(logits, weight)  z = Neg(y)
        }
    """)
    NameGraphInputsOutputsPass(["x"], ["logits", "weight"])(model)
    assert _names(model.graph.outputs)[0] == "logits"
    assert model.graph.node(0).outputs[0].name == "logits__1"  # the inner value made way
    assert _names(model.graph.outputs)[1] == "weight__1"  # the weight is looked up by its name
    assert list(model.graph.initializers) == ["weight"]
    check(model)


def test_count_mismatch_leaves_the_graph_alone():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18]>
        main (float[2] x) => (float[2] y) { y = Relu(x) }
    """)
    assert not NameGraphInputsOutputsPass(["a", "b"], ["y"])(model).modified
    assert _names(model.graph.inputs) == ["x"]
