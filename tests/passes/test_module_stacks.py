"""AnnotateStacksPass: each main-graph node keeps the selected calls of its stack, in order."""

from __future__ import annotations

import onnx_ir as ir

from onnx_modular.format import metadata
from onnx_modular.passes.export.module_stacks import AnnotateStacksPass


def test_only_selected_calls_stay_on_the_stack():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18]>
        main (float[2] x) => (float[2] y) {
          a = Relu(x)
          b = Neg(a)
          y = Abs(b)
        }
    """)
    relu, neg, abs_ = model.graph
    stacks = {relu: ("block", "block.mlp"), neg: ("block", "block.attn")}
    AnnotateStacksPass(stacks, selected={"block", "block.mlp"})(model)
    assert relu.meta[metadata.STACK] == ("block", "block.mlp")
    assert neg.meta[metadata.STACK] == ("block",)
    assert abs_.meta[metadata.STACK] == ()  # ran under the root only
