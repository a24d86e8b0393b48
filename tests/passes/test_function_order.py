"""SortFunctionsPass and sort_functions_proto on hand-written models: callee-first order, which
onnx's ReferenceEvaluator needs (it resolves functions in file order)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnx.reference
import onnx_ir as ir
import pytest

from onnx_modular.passes.function_order import (
    SortFunctionsPass,
    callee_first,
    is_callee_first,
    sort_functions_proto,
)

# Stored caller-first, as the outliner creates them: Block calls Attn and Act, Attn calls Act;
# Orphan is called by nobody and calls Leaf, which comes after it.
MODEL = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[2] x) => (float[2] y) {
  a = pkg.test.Block(x)
  y = pkg.test.Block(a)
}
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Orphan (p) => (q) { q = pkg.test.Leaf(p) }
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Block (h) => (o) { t = pkg.test.Attn(h)  u = pkg.test.Act(t)  o = Neg(u) }
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Attn (h) => (o) { t = pkg.test.Act(h)  o = Abs(t) }
<domain: "pkg.test", opset_import: ["" : 18]>
Act (u) => (v) { v = Relu(u) }
<domain: "pkg.test", opset_import: ["" : 18]>
Leaf (u) => (v) { v = Sigmoid(u) }
"""

EXPECTED = ["Act", "Attn", "Block", "Leaf", "Orphan"]


def _names(model: onnx.ModelProto) -> list[str]:
    return [f.name for f in model.functions]


def test_the_pass_stores_callees_first_and_the_reference_evaluator_then_runs_the_file():
    proto = onnx.parser.parse_model(MODEL)
    assert not is_callee_first(proto)
    with pytest.raises(Exception, match="is unknown"):  # what the issue reported, on the hand-made file
        onnx.reference.ReferenceEvaluator(proto)
    model = ir.from_proto(proto)
    assert SortFunctionsPass()(model).modified
    sorted_proto = ir.to_proto(model)
    assert _names(sorted_proto) == EXPECTED
    assert is_callee_first(sorted_proto)
    x = np.array([-1.0, 2.0], np.float32)
    (y,) = onnx.reference.ReferenceEvaluator(sorted_proto).run(None, {"x": -x})

    def block(h):  # Neg(Act(Attn(h))), Attn = Abs(Act(h)), Act = Relu
        return -np.maximum(np.abs(np.maximum(h, 0)), 0)

    np.testing.assert_allclose(y, block(block(-x)))
    assert not SortFunctionsPass()(model).modified  # already in order: nothing to do


def test_the_proto_variant_gives_the_same_order_in_place():
    proto = onnx.parser.parse_model(MODEL)
    assert sort_functions_proto(proto)
    assert _names(proto) == EXPECTED
    assert not sort_functions_proto(proto)


def test_calls_inside_subgraphs_count():
    proto = onnx.parser.parse_model("""
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (bool c, float[2] x) => (float[2] y) { y = pkg.test.Outer(c, x) }
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Outer (c, x) => (y) {
  y = If(c) <then_branch = g1 () => (float[2] a) { a = pkg.test.Inner(x) },
             else_branch = g2 () => (float[2] b) { b = Neg(x) }>
}
<domain: "pkg.test", opset_import: ["" : 18]>
Inner (u) => (v) { v = Relu(u) }
""")
    assert sort_functions_proto(proto)
    assert _names(proto) == ["Inner", "Outer"]


def test_callee_first_breaks_cycles_and_survives_deep_chains():
    assert callee_first(["a"], ["a", "b"], {"a": ["b"], "b": ["a"]}.__getitem__) == ["b", "a"]
    depth = 5000  # deeper than Python's recursion limit
    chain = {f"f{i}": [f"f{i + 1}"] if i + 1 < depth else [] for i in range(depth)}
    order = callee_first(["f0"], list(chain), chain.__getitem__)
    assert order == [f"f{i}" for i in reversed(range(depth))]
