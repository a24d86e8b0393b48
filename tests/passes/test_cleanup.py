"""Cleanup helpers on hand-written models: helper inlining with stacks, unused removal, optimizer."""

from __future__ import annotations

import onnx_ir as ir
import pytest
from pass_helpers import call_tree, check

from onnx_modular.passes import cleanup
from onnx_modular.passes._functions import CALLS_KEY
from onnx_modular.format import metadata

HELPER = """
<ir_version: 10, opset_import: ["" : 18, "pkg.torch.onnx" : 1]>
main (float[4] x) => (float[2] y) {
  h = pkg.torch.onnx.aten_getitem(x)
  y = Relu(h)
}
<domain: "pkg.torch.onnx", opset_import: ["" : 18]>
aten_getitem (p) => (q) {
  n = Constant<value=int64 {2}>()
  s = SplitToSequence(p, n)
  i = Constant<value=int64 {0}>()
  q = SequenceAt(s, i)
}
"""


def test_helper_functions_are_inlined_keeping_the_module_stack():
    model = ir.from_onnx_text(HELPER)
    model.graph.node(0).meta[metadata.STACK] = ("block",)
    assert cleanup.InlineHelperFunctionsPass()(model).modified
    assert not model.functions
    ops = [node.op_type for node in model.graph]
    assert ops == ["Constant", "SplitToSequence", "Constant", "SequenceAt", "Relu"]
    assert [node.meta.get(metadata.STACK) for node in model.graph][:4] == [("block",)] * 4
    assert all(not key.startswith("pkg.onnx_modular.internal") for node in model.graph for key in node.metadata_props)
    check(model)


def test_helper_inlining_requires_no_module_functions():
    model = ir.from_onnx_text(HELPER)
    (function,) = model.functions.values()
    function.meta[CALLS_KEY] = [call_tree(("block", "Block"))["block"]]
    with pytest.raises(ir.passes.PreconditionError, match="aten_getitem"):
        cleanup.InlineHelperFunctionsPass()(model)


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
    assert cleanup.remove_unused(model)
    assert [node.op_type for node in model.graph] == ["Relu"]
    assert not model.graph.initializers and not model.functions
    assert "pkg.test" not in model.opset_imports


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
    cleanup.optimize_functions(model)
    # two calls of one module on the same input stay two calls (no CSE across calls)
    assert [node.op_type for node in model.graph] == ["F", "F", "Add"]
    (function,) = model.functions.values()
    assert [node.op_type for node in function] == ["Constant", "Mul"]  # 1 + 1 folded
    check(model)
