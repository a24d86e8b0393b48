"""OutlineModuleCallsPass on hand-written flat models: nesting, formal names, order, requires()."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from pass_helpers import DOMAIN, call_tree, check, set_stacks, signature_names

from onnx_modular.format import metadata
from onnx_modular.passes.export.outline_calls import (
    CallSignature,
    OutlineModuleCallsPass,
    TensorSpec,
)

F = ir.DataType.FLOAT


def spec(name: str, shape: tuple[int, ...], value=None, dtype=F) -> TensorSpec:
    return TensorSpec(name, dtype, shape, value)


def outline(model, tree, signatures=None, value_of=None):
    result = OutlineModuleCallsPass(tree, signatures, value_of=value_of)(model)
    assert result.modified
    return {call.key: model.functions[(*call.function, "")] for call in tree.walk() if call.function}


def run(model: ir.Model, **inputs) -> list[np.ndarray]:
    proto = ir.serde.serialize_model(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, inputs)


LINEAR_IN_BLOCK = """
<ir_version: 10, opset_import: ["" : 18]>
main (float[2,4] x) => (float[2,4] y) <float[4,4] w = {1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16}, float[4] b = {1,1,1,1}> {
  h = MatMul(x, w)
  a = Add(h, b)
  r = Relu(a)
  y = Sigmoid(r)
}
"""


def _linear_in_block() -> ir.Model:
    model = ir.from_onnx_text(LINEAR_IN_BLOCK)
    model.graph.initializers["w"].name = "block.fc.weight"
    model.graph.initializers["b"].name = "block.fc.bias"
    set_stacks(model, {"h": ("block", "block.fc"), "a": ("block", "block.fc"), "r": ("block",)})
    return model


def test_nested_functions_named_from_forward():
    model = _linear_in_block()
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    (expected,) = run(model, x=x)
    tree = call_tree(("block", "Block"), ("block.fc", "Linear"))
    signatures = {
        ("block", 0): CallSignature([spec("hidden_states", (2, 4))], [spec("output", (2, 4))]),
        ("block.fc", 0): CallSignature([spec("input", (2, 4))], [spec("output", (2, 4))]),
    }
    functions = outline(model, tree, signatures)

    assert len(model.functions) == 2
    block, linear = functions["block"], functions["block.fc"]
    assert block.domain == linear.domain == DOMAIN
    # weights by their path relative to the module; the block passes its own on to the linear
    assert signature_names(block) == (["hidden_states", "fc.weight", "fc.bias"], ["output"])
    assert signature_names(linear) == (["input", "weight", "bias"], ["output"])
    assert [node.op_type for node in model.graph] == [block.name, "Sigmoid"]
    assert [node.op_type for node in block] == [linear.name, "Relu"]
    assert [node.op_type for node in linear] == ["MatMul", "Add"]
    # call nodes: named by the path relative to the enclosing function, with call metadata
    outer_call = model.graph.node(0)
    inner_call = block.graph.node(0)
    assert (outer_call.name, inner_call.name) == ("block", "fc")
    assert inner_call.metadata_props[metadata.MODULE_PATH] == "block.fc"
    assert [v.name for v in outer_call.inputs] == ["x", "block.fc.weight", "block.fc.bias"]
    assert outer_call.outputs[0].name == "r"  # the caller's value keeps its graph-unique name
    assert [call.num_nodes for call in tree.walk()] == [0, 2, 2]
    assert block.meta[metadata.CALLS] == [tree["block"]] and block.meta[metadata.SIGNATURE_NOTES] == []
    check(model)
    np.testing.assert_allclose(run(model, x=x)[0], expected, rtol=1e-6)


def test_graph_output_made_inside_a_call_keeps_its_name():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18]>
        main (float[2,4] x) => (float[2,4] logits) { h = Relu(x)  logits = Neg(h) }
    """)
    set_stacks(model, {"h": ("head",), "logits": ("head",)})
    tree = call_tree(("head", "Head"))
    functions = outline(model, tree, {("head", 0): CallSignature([spec("x", (2, 4))], [spec("output", (2, 4))])})
    assert signature_names(functions["head"]) == (["x"], ["output"])
    assert [v.name for v in model.graph.outputs] == ["logits"]
    check(model)


EQUAL_SHAPES = """
<ir_version: 10, opset_import: ["" : 18]>
main (float[2,3] p, float[2,3] q) => (float[2,3] y, float[2,3] z) {
  s = Sub(q, p)
  t = Add(q, p)
  y = Relu(t)
  z = Relu(s)
}
"""


def _equal_shapes():
    model = ir.from_onnx_text(EQUAL_SHAPES)
    set_stacks(model, {"s": ("pair",), "t": ("pair",)})
    rng = np.random.default_rng(0)
    p, q = (rng.standard_normal((2, 3)).astype(np.float32) for _ in range(2))
    # forward(self, a, b) called as pair(p, q), returning (q + p, q - p); the body reads q first
    # and computes the difference first, so only values can tell the names apart.
    signature = CallSignature(
        [spec("a", (2, 3), p), spec("b", (2, 3), q)], [spec("output_0", (2, 3), q + p), spec("output_1", (2, 3), q - p)]
    )
    values = {"p": p, "q": q, "s": q - p, "t": q + p}
    return model, signature, values


def test_equal_shapes_resolved_by_value():
    model, signature, values = _equal_shapes()
    tree = call_tree(("pair", "Pair"))
    functions = outline(model, tree, {("pair", 0): signature}, value_of=values.get)
    pair = functions["pair"]
    assert signature_names(pair) == (["a", "b"], ["output_0", "output_1"])
    call_node = model.graph.node(0)
    assert [v.name for v in call_node.inputs] == ["p", "q"]  # forward() order, not first-use order
    assert [v.name for v in call_node.outputs] == ["t", "s"]  # forward()'s return order
    assert pair.meta[metadata.SIGNATURE_NOTES] == []
    check(model)
    y, z = run(model, p=values["p"], q=values["q"])
    np.testing.assert_allclose(y, np.maximum(values["t"], 0), rtol=1e-6)
    np.testing.assert_allclose(z, np.maximum(values["s"], 0), rtol=1e-6)


def test_equal_shapes_without_values_are_not_guessed():
    model, signature, _ = _equal_shapes()
    tree = call_tree(("pair", "Pair"))
    pair = outline(model, tree, {("pair", 0): signature})["pair"]  # no value_of
    assert signature_names(pair) == (
        ["unbound_input_0", "unbound_input_1"],
        ["unbound_output_0", "unbound_output_1"],
    )
    notes = pair.meta[metadata.SIGNATURE_NOTES]
    assert notes[0].startswith("unbound_input_0: one of a, b ")
    assert notes[2].startswith("unbound_output_0: one of output_0, output_1 ")
    check(model)


def test_unbound_inputs_outputs_and_sizes_are_described():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18]>
        main (float[2,3] x, float[1,3] mask, int64[] n) => (float[2,3] y, float[2,1] z) {
          m = Mul(x, mask)
          nf = Cast<to=1>(n)
          y = Add(m, nf)
          axes = Constant<value=int64[1] {1}>()
          side = ReduceSum<keepdims=1>(m, axes)
          z = Neg(side)
        }
    """)
    model.graph.inputs[2].shape = ir.Shape([])  # a symbolic size: an INT64 scalar
    side = model.graph.node(4).outputs[0]
    side.type, side.shape = ir.TensorType(F), ir.Shape([2, 1])  # as torch's translator records
    set_stacks(model, {"m": ("layer",), "nf": ("layer",), "y": ("layer",), "axes": ("layer",), "side": ("layer",)})
    tree = call_tree(("layer", "Layer"))
    signature = CallSignature([spec("hidden_states", (2, 3))], [spec("output", (2, 3))], absent=("attention_mask",))
    layer = outline(model, tree, {("layer", 0): signature})["layer"]
    assert signature_names(layer) == (["hidden_states", "unbound_input_0", "size_0"], ["output", "unbound_output_0"])
    notes = layer.meta[metadata.SIGNATURE_NOTES]
    assert len(notes) == 3
    assert notes[0].startswith("unbound_input_0: not a tensor that forward() received")
    assert "None for attention_mask" in notes[0]
    assert notes[1].startswith("size_0: symbolic sizes")
    assert notes[2].startswith("unbound_output_0: computed in this call and read outside it, but not returned")
    check(model)


def test_call_not_seen_in_eager_mode():
    model = _linear_in_block()
    tree = call_tree(("block", "Block"), ("block.fc", "Linear"))
    functions = outline(model, tree)  # no signatures at all
    assert signature_names(functions["block.fc"]) == (["unbound_input_0", "weight", "bias"], ["unbound_output_0"])
    assert all("not observed in eager mode" in note for note in functions["block.fc"].meta[metadata.SIGNATURE_NOTES])


def test_body_values_make_way_for_formal_names():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18]>
        main (float[2] x) => (float[2] y) { output = Relu(x)  hidden_states = Neg(output)  y = Abs(hidden_states) }
    """)
    set_stacks(model, {"output": ("m",), "hidden_states": ("m",), "y": ("m",)})
    tree = call_tree(("m", "M"))
    sig = CallSignature([spec("hidden_states", (2,))], [spec("output", (2,))])
    function = outline(model, tree, {("m", 0): sig})["m"]
    assert signature_names(function) == (["hidden_states"], ["output"])
    body_names = [v.name for node in function for v in node.outputs]
    assert len(set(body_names)) == 3 and body_names[-1] == "output"
    assert [v.name for v in model.graph.outputs] == ["y"]
    check(model)


def test_shared_constant_is_cloned_per_call():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18]>
        main (float[2] x) => (float[2] y) {
          c = Constant<value=float[2] {1, 2}>()
          a = Add(x, c)
          y = Mul(a, c)
        }
    """)
    set_stacks(model, {"a": ("l1",), "y": ("l2",)})
    tree = call_tree(("l1", "Add1"), ("l2", "Mul2"))
    sigs = {(key, 0): CallSignature([spec("input", (2,))], [spec("output", (2,))]) for key in ("l1", "l2")}
    functions = outline(model, tree, sigs)
    for function in functions.values():
        assert signature_names(function) == (["input"], ["output"])  # the constant is no input
        assert [node.op_type for node in function][0] == "Constant"
    assert [node.op_type for node in model.graph] == [functions["l1"].name, functions["l2"].name]
    check(model)
    np.testing.assert_allclose(run(model, x=np.array([1, 1], np.float32))[0], [2, 6])


def test_interleaved_node_is_absorbed_to_stay_acyclic():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18]>
        main (float[2] x) => (float[2] y) { a = Relu(x)  b = Neg(a)  y = Add(a, b) }
    """)
    # b runs at the root between two nodes of one call, reading from and feeding it
    set_stacks(model, {"a": ("m",), "y": ("m",)})
    function = outline(model, call_tree(("m", "M")))["m"]
    assert [node.op_type for node in function] == ["Relu", "Neg", "Add"]
    assert len(model.graph) == 1
    check(model)


def test_call_absorbed_entirely_by_another_gets_no_function():
    """``n``'s only node runs between two nodes of ``m``, reading from and feeding it: ``m``
    absorbs it, and ``n`` (whose group was computed before) is left without nodes, not an error.
    Flat files of other exporters (``modularize``) place scopes like this."""
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18]>
        main (float[2] x) => (float[2] y) { a = Relu(x)  b = Neg(a)  y = Add(a, b) }
    """)
    set_stacks(model, {"a": ("m",), "b": ("n",), "y": ("m",)})
    tree = call_tree(("m", "M"), ("n", "N"))
    functions = outline(model, tree)
    assert list(functions) == ["m"] and [node.op_type for node in functions["m"]] == ["Relu", "Neg", "Add"]
    assert tree["n"].function is None
    check(model)
    np.testing.assert_allclose(run(model, x=np.array([1, -1], np.float32))[0], [0, 0])


def test_requires_known_calls_and_sorted_graph():
    model = _linear_in_block()
    with pytest.raises(ir.passes.PreconditionError, match="block.fc"):
        OutlineModuleCallsPass(call_tree(("block", "Block")))(model)

    model = _linear_in_block()
    sigmoid = model.graph.node(3)
    model.graph.remove(sigmoid)
    model.graph.insert_before(model.graph.node(0), sigmoid)
    with pytest.raises(ir.passes.PreconditionError, match="not topologically sorted"):
        OutlineModuleCallsPass(call_tree(("block", "Block"), ("block.fc", "Linear")))(model)
