"""StripConstantMetadataPass: body constants lose torch's debug metadata, computing nodes keep it."""

from __future__ import annotations

import onnx_ir as ir

from onnx_modular.passes.export.constant_metadata import StripConstantMetadataPass

MODEL = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[2] x) => (float[2] y) {
  c = Constant <value = float[2] {1.0, 2.0}> ()
  s = Add(x, c)
  y = pkg.test.Scale(s)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Scale (input) => (output) {
  two = Constant <value = float {2.0}> ()
  output = Mul(input, two)
}"""


def test_constants_in_bodies_lose_their_metadata():
    model = ir.from_onnx_text(MODEL)
    for node in (*model.graph, *next(iter(model.functions.values()))):
        node.metadata_props["pkg.torch.onnx.stack_trace"] = "File model.py, line 1"
    assert StripConstantMetadataPass()(model).modified
    scale = next(iter(model.functions.values()))
    assert {node.op_type: dict(node.metadata_props) for node in scale} == {
        "Constant": {},
        "Mul": {"pkg.torch.onnx.stack_trace": "File model.py, line 1"},
    }
    # the main graph is left alone (its constants are the optimizer's to lift)
    assert all(node.metadata_props for node in model.graph)
    assert not StripConstantMetadataPass()(model).modified
