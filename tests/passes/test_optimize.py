"""OptimizeFunctionsPass: onnxscript's folding inside bodies, every call kept."""

from __future__ import annotations

import onnx_ir as ir
from pass_helpers import check

from onnx_modular.passes.export.optimize_functions import OptimizeFunctionsPass


def test_optimizer_folds_inside_bodies_and_keeps_every_call():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
        main (float[2] x) => (float[2] y) {
          a = pkg.test.F(x)
          b = pkg.test.F(x)
          y = Add(a, b)
        }
        <domain: "pkg.test", opset_import: ["" : 18]>
        F (p) => (q) {
          one = Constant<value=float {1}>()
          two = Add(one, one)
          q = Mul(p, two)
        }
    """)
    assert OptimizeFunctionsPass()(model).modified
    # two calls of one module on the same input stay two calls (no CSE across calls)
    assert [node.op_type for node in model.graph] == ["F", "F", "Add"]
    (function,) = model.functions.values()
    assert [node.op_type for node in function] == ["Constant", "Mul"]  # 1 + 1 folded
    check(model)
