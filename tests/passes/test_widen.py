"""WidenFloatPass: every bfloat16 weight, constant, value type and cast target becomes float32,
and the widened model computes what float32 arithmetic on the bfloat16 values computes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from onnx_modular.check.widen import WidenFloatPass

# The text format takes bfloat16 values as their bits: w = {0.5, 1.5, -2.25}, c = {1.0, 2.0, 3.0}.
MODEL = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (bfloat16[2, 3] x) => (bfloat16[2, 3] y, float[2, 3] z) <bfloat16[3] w = {16128, 16320, 49168}> {
  c = Constant <value = bfloat16[3] {16256, 16384, 16448}> ()
  s = Add(x, w)
  t = pkg.test.Scale(s, c)
  y = Cast <to = 16> (t)
  z = Cast <to = 1> (t)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Scale (input, factor) => (output) {
  shape = Shape(input)
  zero = ConstantOfShape <value = bfloat16[1] {0}> (shape)
  product = Mul(input, factor)
  output = Add(product, zero)
}"""


def _types(model: ir.Model) -> set[ir.DataType]:
    values = [*model.graph.inputs, *model.graph.outputs, *model.graph.initializers.values()]
    for graph in (model.graph, *model.functions.values()):
        values += [v for node in ir.traversal.RecursiveGraphIterator(graph) for v in node.outputs]
    return {v.type.dtype for v in values if v.type is not None}


def test_bfloat16_becomes_float32_everywhere():
    model = ir.from_onnx_text(MODEL)
    onnx.shape_inference.infer_shapes(ir.to_proto(model), strict_mode=True)
    assert WidenFloatPass()(model).modified
    assert ir.DataType.BFLOAT16 not in _types(model)
    casts = [node.attributes["to"].value for node in model.graph if node.op_type == "Cast"]
    assert casts == [ir.DataType.FLOAT, ir.DataType.FLOAT]
    assert model.graph.initializers["w"].const_value.dtype == ir.DataType.FLOAT
    assert not WidenFloatPass()(model).modified


def test_widened_model_runs_and_is_exact():
    model = ir.from_onnx_text(MODEL)
    WidenFloatPass()(model)
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    x = np.array([[1.0, -2.0, 0.25], [3.5, 0.0, -1.0]], dtype=ml_dtypes.bfloat16)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    y, z = session.run(None, {"x": x.astype(np.float32)})
    w = np.array([0.5, 1.5, -2.25], dtype=np.float32)
    expected = (x.astype(np.float32) + w) * np.array([1.0, 2.0, 3.0], dtype=np.float32)
    np.testing.assert_array_equal(y, expected)  # these values are exact in float32
    np.testing.assert_array_equal(z, expected)
