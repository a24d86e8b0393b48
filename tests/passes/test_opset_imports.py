"""AddOpsetImportsPass: every domain imported where it is used, the default at the model's version."""

from __future__ import annotations

import onnx_ir as ir

from onnx_modular.passes.export.opset_imports import AddOpsetImportsPass


def test_bodies_and_model_import_what_they_use():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 23]>
        main (float[2] x) => (float[2] y) {
          h = pkg.test.F(x)
          y = Relu(h)
        }
        <domain: "pkg.test", opset_import: ["pkg.test" : 1]>
        F (p) => (q) { q = com.microsoft.Gelu(p) }
    """)
    (function,) = model.functions.values()
    function.opset_imports.clear()
    model.opset_imports.pop("pkg.test", None)
    assert AddOpsetImportsPass(18)(model).modified
    assert model.opset_imports[""] == 23  # the model's version wins over the default given
    assert function.opset_imports == {"com.microsoft": 1}
    assert model.opset_imports["pkg.test"] == 1 and model.opset_imports["com.microsoft"] == 1


def test_a_model_without_ops_still_imports_the_default_domain():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18]>
        main (float[2] x) => (float[2] x) {}
    """)
    model.opset_imports.clear()
    AddOpsetImportsPass(18)(model)
    assert model.opset_imports == {"": 18}
