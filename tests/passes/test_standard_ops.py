"""FuseStandardOpsPass: onnxscript's fusions inside function bodies, at opset 23 only."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from onnx_modular.passes.export.optimize_functions import OptimizeFunctionsPass
from onnx_modular.passes.export.standard_ops import FuseStandardOpsPass

RMS_NORM = """
<ir_version: 10, opset_import: ["" : {opset}, "pkg.test" : 1]>
main (float[2, 8] x, float[8] weight) => (float[2, 8] y) {{
  y = pkg.test.RMSNorm(x, weight)
}}
<domain: "pkg.test", opset_import: ["" : {opset}]>
RMSNorm (x, weight) => (y) {{
  two = Constant <value = float {{2}}> ()
  eps = Constant <value = float {{1e-6}}> ()
  axes = Constant <value_ints = [-1]> ()
  square = Pow(x, two)
  mean = ReduceMean <keepdims = 1, noop_with_empty_axes = 0> (square, axes)  # both written, as torchlib does
  shifted = Add(mean, eps)
  root = Sqrt(shifted)
  inverse = Reciprocal(root)
  normalized = Mul(x, inverse)
  y = Mul(weight, normalized)
}}
"""


def _ops(model: ir.Model) -> list[str]:
    (function,) = model.functions.values()
    return [node.op_type for node in function]


def test_a_hand_written_rms_norm_becomes_one_op_inside_its_function():
    model = ir.from_onnx_text(RMS_NORM.format(opset=23))
    before = ir.to_proto(model).SerializeToString()
    OptimizeFunctionsPass()(model)  # as in the pipeline: constants known before the fusions
    fuse = FuseStandardOpsPass()
    assert fuse(model).modified and fuse.counts
    assert "RMSNormalization" in _ops(model) and "Pow" not in _ops(model)
    assert [node.op_type for node in model.graph] == ["RMSNorm"]  # the call stays a call
    (function,) = model.functions.values()
    assert all(value.type is None for value in function.inputs)  # formal inputs untyped again
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    feeds = {"x": x, "weight": np.linspace(0.5, 1.5, 8, dtype=np.float32)}
    expected = ort.InferenceSession(before).run(None, feeds)[0]
    actual = ort.InferenceSession(ir.to_proto(model).SerializeToString()).run(None, feeds)[0]
    np.testing.assert_allclose(actual, expected, atol=1e-5, rtol=1e-4)


def test_other_opsets_are_left_alone():
    model = ir.from_onnx_text(RMS_NORM.format(opset=18))
    assert not FuseStandardOpsPass()(model).modified
    assert "Pow" in _ops(model)
