"""RenameDynamicAxesPass: symbols renamed everywhere, in expressions too, longest first."""

from __future__ import annotations

import onnx_ir as ir

from onnx_modular.passes.export.dynamic_axes import RenameDynamicAxesPass


def test_symbols_and_expressions_are_renamed():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18]>
        main (float[s1, s11] x) => (float[s1, s11] y) {
          y = Relu(x)
        }
    """)
    (node,) = model.graph
    node.outputs[0].shape = ir.Shape(["s1", "s11 + s1"])
    assert RenameDynamicAxesPass({"s1": "batch", "s11": "past"})(model).modified
    assert [d.value for d in model.graph.inputs[0].shape] == ["batch", "past"]
    # A sum of names is spelled one way (terms sorted): "s1 + s11" from another layer reads the same.
    assert [d.value for d in node.outputs[0].shape] == ["batch", "batch + past"]


def test_no_mapping_changes_nothing():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18]>
        main (float[s1] x) => (float[s1] y) { y = Relu(x) }
    """)
    assert not RenameDynamicAxesPass({})(model).modified
    assert model.graph.inputs[0].shape[0].value == "s1"
