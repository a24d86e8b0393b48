"""InlineHelperFunctionsPass on hand-written models: helpers inlined, module stacks kept."""

from __future__ import annotations

import onnx_ir as ir
import pytest
from pass_helpers import call_tree, check

from onnx_modular.format import metadata
from onnx_modular.passes.export.inline_helpers import InlineHelperFunctionsPass

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
    assert InlineHelperFunctionsPass()(model).modified
    assert not model.functions
    ops = [node.op_type for node in model.graph]
    assert ops == ["Constant", "SplitToSequence", "Constant", "SequenceAt", "Relu"]
    assert [node.meta.get(metadata.STACK) for node in model.graph][:4] == [("block",)] * 4
    assert all(not key.startswith(metadata.PREFIX + "internal") for node in model.graph for key in node.metadata_props)
    check(model)


def test_helper_inlining_requires_no_module_functions():
    model = ir.from_onnx_text(HELPER)
    (function,) = model.functions.values()
    function.meta[metadata.CALLS] = [call_tree(("block", "Block"))["block"]]
    with pytest.raises(ir.passes.PreconditionError, match="aten_getitem"):
        InlineHelperFunctionsPass()(model)
