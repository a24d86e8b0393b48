"""FoldWeightsPass on hand-written models (no torch): weight-only computations of function
bodies are folded across one or more call levels into lazily computed initializers."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common  # ir.passes.common below
import onnxruntime as ort
import pytest

from onnx_modular.format import metadata
from onnx_modular.passes.export.fold_weights import INPUT_SIZE_LIMIT, FoldWeightsPass

HEADER = '<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>'
LINEAR = """
<domain: "pkg.test", opset_import: ["" : 18]>
Linear (input, weight) => (output) {
  t = Transpose <perm = [1, 0]> (weight)
  output = MatMul(input, t)
}"""


def _model(text: str, **arrays: np.ndarray) -> ir.Model:
    """The model of ``text`` with ``arrays`` as float initializers (declared after the outputs)."""
    declared = ", ".join(f"float[{','.join(map(str, a.shape))}] {name} = {{{', '.join(['0'] * a.size)}}}" for name, a in arrays.items())
    text = re.sub(r"(main \([^)]*\) => \([^)]*\))", lambda m: f"{m.group(1)} <{declared}>", text, count=1)
    model = ir.from_onnx_text(text)
    for name, array in arrays.items():
        model.graph.initializers[name].const_value = ir.tensor(array, name=name)
    return model


def _run(model: ir.Model, **feeds: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _function(model: ir.Model, name: str) -> ir.Function:
    return next(f for f in model.functions.values() if f.name == name)


def _ops(function: ir.Function) -> list[str]:
    return [node.op_type for node in function]


def test_transpose_is_folded_through_two_call_levels():
    text = HEADER + """
main (float[2,3] x) => (float[2,3] y) {
  h = pkg.test.Block(x, w1)
  y = pkg.test.Block2(h, w2)
}
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Block (a, wa) => (b) { l = pkg.test.Linear(a, wa)  b = Relu(l) }
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Block2 (a, wa) => (b) { b = pkg.test.Linear(a, wa) }""" + LINEAR
    rng = np.random.default_rng(0)
    w1, w2, x = rng.standard_normal((3, 3), np.float32), rng.standard_normal((3, 3), np.float32), rng.standard_normal((2, 3), np.float32)
    model = _model(text, w1=w1, w2=w2)
    expected = _run(model, x=x)

    assert FoldWeightsPass()(model).modified
    assert _ops(_function(model, "Linear")) == ["MatMul"]
    assert [v.name for v in _function(model, "Linear").inputs] == ["input", "weight.T"]
    assert [v.name for v in _function(model, "Block").inputs] == ["a", "wa.T"]
    assert set(model.graph.initializers) >= {"w1.T", "w2.T"}
    assert not [node for node in model.graph if node.op_type == "Transpose"]
    folded = model.graph.initializers["w2.T"].const_value
    assert isinstance(folded, ir.LazyTensor) and list(folded.shape) == [3, 3]
    np.testing.assert_array_equal(folded.numpy(), w2.T)
    ir.passes.common.RemoveUnusedNodesPass()(model)
    assert "w1" not in model.graph.initializers  # nothing reads the untransposed weight any more
    np.testing.assert_allclose(_run(model, x=x)[0], expected[0], rtol=1e-6)


def test_gate_reordering_with_body_constants_is_folded():
    """LSTM-style: Slice the weights into gates (Constant starts/ends), Concat in another order."""
    text = HEADER + """
main (float[2,4] x) => (float[2,8] y) { y = pkg.test.Gates(x, w, b1, b2) }
<domain: "pkg.test", opset_import: ["" : 18]>
Gates (input, weight, bias_ih, bias_hh) => (output) {
  s0 = Constant <value = int64[1] {0}> ()
  s4 = Constant <value = int64[1] {4}> ()
  s8 = Constant <value = int64[1] {8}> ()
  axis = Constant <value = int64[1] {0}> ()
  top = Slice(weight, s0, s4, axis)
  bottom = Slice(weight, s4, s8, axis)
  reordered = Concat <axis = 0> (bottom, top)
  wt = Transpose <perm = [1, 0]> (reordered)
  bias = Add(bias_ih, bias_hh)
  mm = MatMul(input, wt)
  output = Add(mm, bias)
}"""
    rng = np.random.default_rng(1)
    arrays = {"w": rng.standard_normal((8, 4), np.float32), "b1": rng.standard_normal(8, np.float32), "b2": rng.standard_normal(8, np.float32)}
    x = rng.standard_normal((2, 4), np.float32)
    model = _model(text, **arrays)
    expected = _run(model, x=x)

    FoldWeightsPass()(model)
    gates = _function(model, "Gates")
    assert _ops(gates) == ["MatMul", "Add"]  # Slices, Concat, Transpose, bias Add and Constants gone
    assert [v.name for v in gates.inputs] == ["input", "weight.folded", "bias_ih+bias_hh.folded"]
    folded = model.graph.initializers["w.folded"].const_value.numpy()
    np.testing.assert_array_equal(folded, np.concatenate([arrays["w"][4:], arrays["w"][:4]]).T)
    np.testing.assert_allclose(model.graph.initializers["b1+b2.folded"].const_value.numpy(), arrays["b1"] + arrays["b2"])
    np.testing.assert_allclose(_run(model, x=x)[0], expected[0], rtol=1e-6)


def test_calls_sharing_a_weight_share_the_folded_initializer():
    text = HEADER + """
main (float[2,3] x) => (float[2,3] y) {
  a = pkg.test.Linear(x, w)
  y = pkg.test.Linear(a, w)
}""" + LINEAR
    model = _model(text, w=np.arange(9, dtype=np.float32).reshape(3, 3))
    FoldWeightsPass()(model)
    calls = [node for node in model.graph if node.op_type == "Linear"]
    assert calls[0].inputs[1] is calls[1].inputs[1] and calls[0].inputs[1].name == "w.T"
    assert [v.name for v in model.graph.initializers.values() if v.name.endswith(".T")] == ["w.T"]


def _tied_model(rows: int) -> tuple[ir.Model, np.ndarray]:
    """Linear transposes ``w``; the main graph also reads it untransposed (Gather: a tied embedding)."""
    text = HEADER + f"""
main (float[2,8] x, int64[2] ids) => (float[2,{rows}] y, float[2,8] e) {{
  y = pkg.test.Linear(x, w)
  e = Gather(w, ids)
}}""" + LINEAR
    w = np.random.default_rng(2).standard_normal((rows, 8), np.float32)
    return _model(text, w=w), w


def test_large_weight_read_elsewhere_is_left_alone():
    rows = INPUT_SIZE_LIMIT // 8 + 1
    model, _ = _tied_model(rows)
    assert not FoldWeightsPass()(model).modified
    assert _ops(_function(model, "Linear")) == ["Transpose", "MatMul"]


def test_small_weight_read_elsewhere_is_folded_as_a_copy():
    """onnxscript's folder folds nodes with inputs up to its size limit whatever else reads them."""
    model, w = _tied_model(16)
    FoldWeightsPass()(model)
    assert _ops(_function(model, "Linear")) == ["MatMul"]
    assert {"w", "w.T"} <= set(model.graph.initializers)
    np.testing.assert_array_equal(model.graph.initializers["w.T"].const_value.numpy(), w.T)


def test_not_folded_when_a_call_passes_a_computed_value():
    text = HEADER + """
main (float[3,3] x) => (float[3,3] y) {
  a = pkg.test.Linear(x, w)
  z = Relu(x)
  y = pkg.test.Linear(a, z)
}""" + LINEAR
    model = _model(text, w=np.eye(3, dtype=np.float32))
    assert not FoldWeightsPass()(model).modified
    assert _ops(_function(model, "Linear")) == ["Transpose", "MatMul"]


def test_weights_are_read_only_when_the_folded_value_is():
    text = HEADER + """
main (float[2,3] x) => (float[2,3] y) { y = pkg.test.Linear(x, w) }""" + LINEAR
    w = np.arange(9, dtype=np.float32).reshape(3, 3)
    reads = []

    def read() -> ir.Tensor:
        reads.append(1)
        return ir.tensor(w)

    model = _model(text, w=w)
    model.graph.initializers["w"].const_value = ir.LazyTensor(read, dtype=ir.DataType.FLOAT, shape=ir.Shape([3, 3]), name="w")
    FoldWeightsPass()(model)
    assert reads == []  # the pass itself reads no weight
    np.testing.assert_array_equal(model.graph.initializers["w.T"].const_value.numpy(), w.T)
    assert reads == [1]


def test_transposes_only():
    text = HEADER + """
main (float[2,4] x) => (float[2,4] y) { y = pkg.test.Scaled(x, w) }
<domain: "pkg.test", opset_import: ["" : 18]>
Scaled (input, weight) => (output) {
  two = Constant <value = float {2.0}> ()
  t = Transpose <perm = [1, 0]> (weight)
  s = Mul(t, two)
  output = MatMul(input, s)
}"""
    model = _model(text, w=np.ones((4, 4), np.float32))
    FoldWeightsPass(ops={"Transpose"})(model)  # only the transposes
    assert _ops(_function(model, "Scaled")) == ["Constant", "Mul", "MatMul"]
    FoldWeightsPass()(model)
    assert _ops(_function(model, "Scaled")) == ["MatMul"]


def test_requires_rejects_attribute_parameters():
    text = HEADER + """
main (float[2,2] x) => (float[2,2] y) { y = pkg.test.F <p = [1, 0]> (x) }
<domain: "pkg.test", opset_import: ["" : 18]>
F <p> (input) => (output) { output = Transpose <perm: ints = @p> (input) }"""
    model = ir.from_onnx_text(text)
    with pytest.raises(ir.passes.PreconditionError, match="attribute parameters"):
        FoldWeightsPass()(model)


CONSTANTS = HEADER + """
main (float[2,4] x) => (float[8] y) {
  h = pkg.test.Block(x)
  g = pkg.test.Block(h)
  y = pkg.test.Flatten(g)
}
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Block (input) => (output) {
  half = Constant <value = float {0.5}> ()
  scaled = Mul(input, half)
  output = pkg.test.Flatten2d(scaled)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Flatten2d (input) => (output) {
  shape = Constant <value = int64[2] {2, 4}> ()
  output = Reshape(input, shape)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Flatten (input) => (output) {
  again = Constant <value = float {0.5}> ()
  shape = Constant <value = int64[1] {8}> ()
  flat = Reshape(input, shape)
  output = Add(flat, again)
}"""


def test_body_constants_are_lifted_to_shared_initializers():
    """Every Constant of every body becomes a formal input named after its value; the main graph
    holds one initializer per distinct value (0.5 twice in two functions: one initializer)."""
    model = ir.from_onnx_text(CONSTANTS)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    expected = _run(model, x=x)

    assert FoldWeightsPass()(model).modified
    for function in model.functions.values():
        assert "Constant" not in _ops(function), function.name
    assert [v.name for v in _function(model, "Flatten2d").inputs] == ["input", "const_int64_2_4"]
    assert [v.name for v in _function(model, "Block").inputs] == ["input", "const_float_0.5", "const_int64_2_4"]
    assert [v.name for v in _function(model, "Flatten").inputs] == ["input", "const_float_0.5", "const_int64_8"]
    lifted = ["const_float_0.5", "const_int64_2_4", "const_int64_8"]
    assert sorted(model.graph.initializers) == lifted
    assert sorted(json.loads(model.metadata_props[metadata.LIFTED_CONSTANTS])) == lifted
    calls = [node for node in model.graph if node.domain == "pkg.test"]
    half = model.graph.initializers["const_float_0.5"]
    assert all(half in node.inputs for node in calls)  # one initializer for every call
    np.testing.assert_array_equal(model.graph.initializers["const_int64_2_4"].const_value.numpy(), [2, 4])
    np.testing.assert_array_equal(_run(model, x=x)[0], expected[0])
    assert not FoldWeightsPass()(model).modified  # nothing left to lift


def test_constants_stay_with_transposes_only_or_when_returned():
    model = ir.from_onnx_text(CONSTANTS)
    assert not FoldWeightsPass(ops={"Transpose"})(model).modified  # lifts no constants
    assert not FoldWeightsPass(constants=False)(model).modified
    text = HEADER + """
main (float[2] x) => (float[2] y, float[2] c) { y, c = pkg.test.Pair(x) }
<domain: "pkg.test", opset_import: ["" : 18]>
Pair (input) => (output, constant) {
  constant = Constant <value = float[2] {1, 2}> ()
  output = Add(input, constant)
}"""
    model = ir.from_onnx_text(text)
    FoldWeightsPass()(model)
    assert _ops(_function(model, "Pair")) == ["Constant", "Add"]  # a body output stays in the body
    np.testing.assert_array_equal(_run(model, x=np.zeros(2, np.float32))[1], [1, 2])


def test_equal_constants_lifted_from_different_depths():
    """Inner's constant reaches Mid in round 1 and leaves it in round 2; Leaf's equal constant
    reaches Mid in round 3 and must not reuse the copy that left (T5's stacks did)."""
    text = HEADER + """
main (float[8] x) => (float[2,4] y) { y = pkg.test.Mid(x) }
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Mid (a) => (out) { b = pkg.test.Inner(a)  flat = Flatten <axis = 0> (b)  c = Reshape(flat, back)  back = Constant <value = int64[1] {8}> ()  out = pkg.test.Deep(c) }
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Deep (a) => (out) { out = pkg.test.Deeper(a) }
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Deeper (a) => (out) { out = pkg.test.Leaf(a) }
<domain: "pkg.test", opset_import: ["" : 18]>
Inner (a) => (out) { s = Constant <value = int64[2] {2, 4}> ()  out = Reshape(a, s) }
<domain: "pkg.test", opset_import: ["" : 18]>
Leaf (a) => (out) { s = Constant <value = int64[2] {2, 4}> ()  out = Reshape(a, s) }"""
    text = text.replace("c = Reshape(flat, back)  back = Constant <value = int64[1] {8}> ()", "back = Constant <value = int64[1] {8}> ()  c = Reshape(flat, back)")
    model = ir.from_onnx_text(text)
    x = np.arange(8, dtype=np.float32)
    expected = _run(model, x=x)
    FoldWeightsPass()(model)
    assert sorted(model.graph.initializers) == ["const_int64_2_4", "const_int64_8"]
    ir.passes.common.CheckerPass(full_check=True)(model)  # every body topologically sorted
    np.testing.assert_array_equal(_run(model, x=x)[0], expected[0])


def test_scalar_fold_keeps_its_shape():
    # spectral norm's sigma, u . (W v): two 1-D MatMuls give a scalar (shape ()), which a folded
    # value must keep exactly (it came back as (1,) and failed the save, issue 21)
    text = HEADER + """
main (float[2,3] x) => (float[2,3] y) { y = pkg.test.Norm(x, w, u, v) }
<domain: "pkg.test", opset_import: ["" : 18]>
Norm (input, weight, u, v) => (output) {
  wv = MatMul(weight, v)
  sigma = MatMul(u, wv)
  output = Div(input, sigma)
}"""
    rng = np.random.default_rng(0)
    arrays = {"w": rng.standard_normal((3, 3), np.float32), "u": rng.standard_normal(3, np.float32), "v": rng.standard_normal(3, np.float32)}
    x = rng.standard_normal((2, 3), np.float32)
    model = _model(text, **arrays)
    expected = _run(model, x=x)

    assert FoldWeightsPass()(model).modified
    assert _ops(_function(model, "Norm")) == ["Div"]
    (folded,) = [v for name, v in model.graph.initializers.items() if name.endswith(".folded")]
    assert folded.shape == ir.Shape([]) and folded.const_value.numpy().shape == ()
    proto = ir.to_proto(model)  # serializes the folded tensor
    assert next(d for d in proto.graph.initializer if d.name == folded.name).dims == []
    np.testing.assert_allclose(_run(model, x=x)[0], expected[0], rtol=1e-6)


def test_value_not_computable_with_its_shape_is_not_folded(monkeypatch):
    # when the computed tensor has another shape than the value it would replace (here a shape
    # declared wrong on purpose after onnx's inference), the value is not folded: its nodes stay
    # in the main graph, reading the weights, and the model still serializes and runs
    from onnx_modular.passes.export import fold_weights

    infer = fold_weights._infer_shapes

    def wrong_shapes(nodes, inputs, opset):
        infer(nodes, inputs, opset)
        for node in nodes:
            if node.op_type == "Transpose":
                node.outputs[0].shape = ir.Shape([9])

    monkeypatch.setattr(fold_weights, "_infer_shapes", wrong_shapes)
    text = HEADER + """
main (float[2,3] x) => (float[2,3] y) { y = pkg.test.Linear(x, w) }""" + LINEAR
    w = np.arange(9, dtype=np.float32).reshape(3, 3)
    x = np.ones((2, 3), np.float32)
    model = _model(text, w=w)
    expected = _run(model, x=x)
    FoldWeightsPass()(model)
    assert set(model.graph.initializers) == {"w"}
    assert [node.op_type for node in model.graph] == ["Transpose", "Linear"]
    model.graph.node(0).outputs[0].shape = ir.Shape([3, 3])  # the wrong shape was ours
    np.testing.assert_allclose(_run(model, x=x)[0], expected[0])


def test_evaluator_rejects_a_result_of_another_shape():
    from onnx_modular.passes.export._node_eval import FoldedShapeError, evaluator

    source = ir.Value(name="w", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([3]))
    source.const_value = ir.tensor(np.ones(3, np.float32))
    node = ir.Node("", "ReduceSum", [source], attributes=[ir.AttrInt64("keepdims", 1)])
    node.outputs[0].dtype, node.outputs[0].shape = ir.DataType.FLOAT, ir.Shape([])  # keepdims gives (1,)
    with pytest.raises(FoldedShapeError, match=r"\(1,\), expected FLOAT \(\)"):
        evaluator(node.outputs[0], [source], 18)()
    node.outputs[0].shape = ir.Shape([1])
    assert evaluator(node.outputs[0], [source], 18)().numpy().shape == (1,)
