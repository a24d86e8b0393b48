"""FoldStaticShapesPass on hand-written models (no torch): ``Shape``/``Size`` of values whose
shape every call fixes become constants, which onnxscript's folder then folds."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import onnxscript.optimizer

from onnx_modular.passes.export.static_shapes import FoldStaticShapesPass

HEADER = '<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>'
# torch's LSTM translation reshapes each layer's [seq, dirs, batch, hidden] output to
# [seq, batch, dirs * hidden] through this chain.
MERGE = """
<domain: "pkg.test", opset_import: ["" : 18]>
Merge (x) => (y) {
  t = Transpose <perm = [0, 2, 1, 3]> (x)
  s = Shape(t)
  zero = Constant <value_ints = [0]> ()
  one = Constant <value_ints = [1]> ()
  two = Constant <value_ints = [2]> ()
  four = Constant <value_ints = [4]> ()
  head = Slice(s, zero, two)
  tail = Slice(s, two, four)
  n = ReduceProd <keepdims = 1> (tail)
  shape = Concat <axis = 0> (head, n)
  y = Reshape(t, shape)
}"""


def _function(model: ir.Model, name: str) -> ir.Function:
    return next(f for f in model.functions.values() if f.name == name)


def _ops(function: ir.Function) -> list[str]:
    return [node.op_type for node in function]


def _run(model: ir.Model, **feeds: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_shape_chain_becomes_a_constant_and_folds():
    model = ir.from_onnx_text(HEADER + """
main (float[5,1,2,3] x) => (float[5,2,3] y) {
  y = pkg.test.Merge(x)
}""" + MERGE)
    x = np.random.default_rng(0).standard_normal((5, 1, 2, 3)).astype(np.float32)
    (before,) = _run(model, x=x)
    body = _function(model, "Merge")
    shape_output = next(n for n in body if n.op_type == "Shape").outputs[0]
    name, dtype, shape = shape_output.name, shape_output.dtype, shape_output.shape

    assert FoldStaticShapesPass()(model).modified
    assert "Shape" not in _ops(body)
    constant = next(n for n in body if n.outputs[0].name == name)
    assert constant.op_type == "Constant"
    assert constant.attributes["value"].as_tensor().numpy().tolist() == [5, 2, 1, 3]
    # the replaced value keeps its name, dtype and shape
    assert (constant.outputs[0].dtype, constant.outputs[0].shape) == (dtype, shape) or shape is None
    assert constant.outputs[0].dtype == ir.DataType.INT64 and list(constant.outputs[0].shape) == [4]
    # the body's other values got no types from the inference
    assert all(v.shape is None for n in body if n.op_type in ("Slice", "Concat", "ReduceProd") for v in n.outputs)
    np.testing.assert_array_equal(_run(model, x=x)[0], before)

    onnxscript.optimizer.fold_constants(model)
    ir.passes.common.RemoveUnusedNodesPass()(model)
    assert _ops(body) == ["Transpose", "Constant", "Reshape"]
    np.testing.assert_array_equal(_run(model, x=x)[0], before)


def test_calls_that_disagree_leave_the_body_alone():
    model = ir.from_onnx_text(HEADER + """
main (float[5,1,2,3] x, float[7,1,2,3] z) => (float[5,2,3] y, float[7,2,3] w) {
  y = pkg.test.Merge(x)
  w = pkg.test.Merge(z)
}""" + MERGE)
    assert not FoldStaticShapesPass()(model).modified
    assert "Shape" in _ops(_function(model, "Merge"))


def test_dynamic_dimension_leaves_the_body_alone():
    model = ir.from_onnx_text(HEADER + """
main (float[seq,1,2,3] x) => (float[seq,2,3] y) {
  y = pkg.test.Merge(x)
}""" + MERGE)
    assert not FoldStaticShapesPass()(model).modified


def test_nested_calls_shape_attributes_and_size():
    model = ir.from_onnx_text(HEADER + """
main (float[4,6] x) => (int64[1] a, int64 n, float[4,6] y) {
  a, n, y = pkg.test.Outer(x)
}
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Outer (x) => (a, n, y) {
  t = Transpose <perm = [1, 0]> (x)
  a, n = pkg.test.Inner(t)
  y = Identity(x)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Inner (t) => (a, n) {
  a = Shape <start = -1> (t)
  n = Size(t)
}""")
    x = np.zeros((4, 6), np.float32)
    before = _run(model, x=x)
    assert FoldStaticShapesPass()(model).modified
    inner = _function(model, "Inner")
    assert _ops(inner) == ["Constant", "Constant"]
    assert [o.name for o in inner.outputs] == ["a", "n"]
    values = [n.attributes["value"].as_tensor().numpy().tolist() for n in inner]
    assert values == [[4], 24]  # Inner's input is Outer's transpose: [6, 4]
    after = _run(model, x=x)
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)
    # Outer's formal input is typed from main's call, but Outer computes no shape itself
    assert "Shape" not in _ops(_function(model, "Outer"))
