"""SetDefaultOpsetPass: one default-domain version in the model and every body that uses it."""

from __future__ import annotations

import onnx_ir as ir
from pass_helpers import check

from onnx_modular.passes.export.default_opset import SetDefaultOpsetPass

MODEL = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[2] x) => (float[2] y) {
  h = pkg.test.F(x)
  y = Relu(h)
}
<domain: "pkg.test", opset_import: ["" : 18]>
F (p) => (q) { q = Neg(p) }
<domain: "pkg.test", opset_import: ["pkg.test" : 1]>
G (p) => (q) { q = pkg.test.F(p) }
"""


def test_every_body_using_the_default_domain_imports_the_version():
    model = ir.from_onnx_text(MODEL)
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        node.version = 18  # as torch's translator leaves them
    assert SetDefaultOpsetPass(23)(model).modified
    assert model.opset_imports[""] == 23
    functions = {f.name: f for f in model.functions.values()}
    assert functions["F"].opset_imports[""] == 23
    assert "" not in functions["G"].opset_imports  # G calls F only: no default-domain import
    assert all(node.version is None for node in model.graph if node.domain == "")
    check(model)


def test_already_set_is_not_modified():
    model = ir.from_onnx_text(MODEL)
    SetDefaultOpsetPass(18)(model)
    assert not SetDefaultOpsetPass(18)(model).modified
