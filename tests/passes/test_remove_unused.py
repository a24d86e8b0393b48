"""RemoveUnusedPass: unused nodes, initializers, functions and opset imports go."""

from __future__ import annotations

import onnx_ir as ir

from onnx_modular.passes.export.remove_unused import RemoveUnusedPass


def test_remove_unused_drops_nodes_initializers_functions_and_opsets():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
        main (float[2] x) => (float[2] y) <float[2] tied = {1, 2}> {
          unused = pkg.test.F(x)
          y = Relu(x)
        }
        <domain: "pkg.test", opset_import: ["" : 18]>
        F (p) => (q) { q = Neg(p) }
    """)
    assert RemoveUnusedPass()(model).modified
    assert [node.op_type for node in model.graph] == ["Relu"]
    assert not model.graph.initializers and not model.functions
    assert "pkg.test" not in model.opset_imports
