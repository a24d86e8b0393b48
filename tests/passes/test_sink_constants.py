"""SinkLiftedConstantsPass on hand-written models: lifted constants back in the bodies that use them."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx.parser
import onnx.reference
import onnx_ir as ir

from onnx_modular.format import metadata
from onnx_modular.passes.export.sink_constants import SinkLiftedConstantsPass
from onnx_modular.passes.function_order import sort_functions_proto

# What FoldWeightsPass writes: the main graph holds the lifted shape and scale, passed through
# Block into Inner; w is a weight (not lifted), and Other receives two different scales.
MODEL = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[2,3] x) => (float[6] a, float[6] y, float[2,3] z) <int64[1] const_int64_6 = {6}, float const_float_2 = {2.0}, float const_float_3 = {3.0}, float[2,3] w = {1,2,3,4,5,6}> {
  a = pkg.test.Block(x, w, const_int64_6, const_float_2)
  b = pkg.test.Other(x, const_float_2)
  y = pkg.test.Block(b, w, const_int64_6, const_float_2)
  z = pkg.test.Other(b, const_float_3)
}
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Block (h, weight, shape, scale) => (o) { s = Mul(h, weight)  t = pkg.test.Inner(s, shape, scale)  o = Reshape(t, shape) }
<domain: "pkg.test", opset_import: ["" : 18]>
Inner (u, shape, scale) => (v) { r = Reshape(u, shape)  m = Mul(r, scale)  v = Reshape(m, shape) }
<domain: "pkg.test", opset_import: ["" : 18]>
Other (u, scale) => (v) { v = Mul(u, scale) }
"""


def _model() -> ir.Model:
    model = ir.from_proto(onnx.parser.parse_model(MODEL))
    model.metadata_props[metadata.LIFTED_CONSTANTS] = json.dumps(["const_float_2", "const_float_3", "const_int64_6"])
    return model


def _run(model: ir.Model, x: np.ndarray) -> list[np.ndarray]:
    proto = ir.to_proto(model)
    sort_functions_proto(proto)  # the reference evaluator resolves functions in file order
    return onnx.reference.ReferenceEvaluator(proto).run(None, {"x": x})


def test_constants_given_the_same_at_every_call_move_into_the_bodies_and_values_stay():
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2
    model = _model()
    expected = _run(model, x)
    assert SinkLiftedConstantsPass()(model).modified
    block, inner, other = (model.functions[("pkg.test", name, "")] for name in ("Block", "Inner", "Other"))
    assert [v.name for v in block.inputs] == ["h", "weight"]  # the weight stays a formal input
    assert [v.name for v in inner.inputs] == ["u"]
    assert [v.name for v in other.inputs] == ["u", "scale"]  # two different scales: stays
    # one Constant per use, so that Netron draws each inside the node that reads it
    constants = [n for n in inner if n.op_type == "Constant"]
    assert len(constants) == 3 and all(len(c.outputs[0].uses()) == 1 for c in constants)
    assert not any(n.op_type == "Constant" for n in model.graph)
    assert sorted(model.graph.initializers) == ["const_float_2", "const_float_3", "w"]
    assert json.loads(model.metadata_props[metadata.LIFTED_CONSTANTS]) == ["const_float_2", "const_float_3"]
    for got, want in zip(_run(model, x), expected):
        np.testing.assert_array_equal(got, want)
    onnx.checker.check_model(ir.to_proto(model), full_check=True)


def test_a_file_without_lifted_constants_is_left_alone():
    model = ir.from_proto(onnx.parser.parse_model(MODEL))  # no lifted_constants metadata: weights only
    assert not SinkLiftedConstantsPass()(model).modified
    assert len(model.functions[("pkg.test", "Block", "")].inputs) == 4
