"""DeduplicateFunctionsPass on hand-written models: bottom-up merging, call redirection, requires()."""

from __future__ import annotations

import onnx_ir as ir
import pytest
from pass_helpers import call_tree

from onnx_modular.format import metadata
from onnx_modular.passes.export.dedupe import DeduplicateFunctionsPass, function_fingerprint

# Two blocks whose bodies differ only in value names and in which (equal) Act function they call,
# a third Act with another op, and two identical torch helpers (not module functions).
MODEL = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1, "pkg.torch.onnx" : 1]>
main (float[2] x) => (float[2] y) {
  a = pkg.test.Block__call1(x)
  b = pkg.test.Block__call3(a)
  c = pkg.test.Act__call5(b)
  d = pkg.torch.onnx.helper_1(c)
  y = pkg.torch.onnx.helper_2(d)
}
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Block__call1 (h) => (o) { t = pkg.test.Act__call2(h)  o = Neg(t) }
<domain: "pkg.test", opset_import: ["" : 18]>
Act__call2 (u) => (v) { v = Relu(u) }
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Block__call3 (h2) => (o2) { t2 = pkg.test.Act__call4(h2)  o2 = Neg(t2) }
<domain: "pkg.test", opset_import: ["" : 18]>
Act__call4 (p) => (q) { q = Relu(p) }
<domain: "pkg.test", opset_import: ["" : 18]>
Act__call5 (p) => (q) { q = Sigmoid(p) }
<domain: "pkg.torch.onnx", opset_import: ["" : 18]>
helper_1 (p) => (q) { q = Abs(p) }
<domain: "pkg.torch.onnx", opset_import: ["" : 18]>
helper_2 (p) => (q) { q = Abs(p) }
"""

CALLS = {"Block__call1": "h.0", "Act__call2": "h.0.act", "Block__call3": "h.1", "Act__call4": "h.1.act", "Act__call5": "act"}


def _model():
    model = ir.from_onnx_text(MODEL)
    tree = call_tree(("h.0", "Block"), ("h.0.act", "Act"), ("h.1", "Block"), ("h.1.act", "Act"), ("act", "Act"))
    for function in model.functions.values():
        if function.name in CALLS:
            call = tree[CALLS[function.name]]
            call.function = (function.domain, function.name)
            function.meta[metadata.CALLS] = [call]
    return model, tree


def test_identical_calls_share_one_function_at_every_level():
    model, tree = _model()
    assert DeduplicateFunctionsPass()(model).modified
    names = sorted(name for _, name, _ in model.functions)
    assert names == ["Act__call2", "Act__call5", "Block__call1", "helper_1", "helper_2"]
    assert [node.op_type for node in model.graph] == ["Block__call1", "Block__call1", "Act__call5", "helper_1", "helper_2"]
    block = model.functions[("pkg.test", "Block__call1", "")]
    assert block.meta[metadata.CALLS] == [tree["h.0"], tree["h.1"]]
    assert model.functions[("pkg.test", "Act__call2", "")].meta[metadata.CALLS] == [tree["h.0.act"], tree["h.1.act"]]
    assert tree["h.1"].function == ("pkg.test", "Block__call1")
    assert tree["h.1.act"].function == ("pkg.test", "Act__call2")
    assert tree["act"].function == ("pkg.test", "Act__call5")


def test_nothing_to_merge_reports_no_change():
    model, _ = _model()
    DeduplicateFunctionsPass()(model)
    assert not DeduplicateFunctionsPass()(model).modified


def test_fingerprint_ignores_names_but_not_ops_or_attributes():
    model, _ = _model()
    functions = {name: f for (_, name, _), f in model.functions.items()}
    assert function_fingerprint(functions["Act__call2"]) == function_fingerprint(functions["Act__call4"])
    assert function_fingerprint(functions["Act__call2"]) != function_fingerprint(functions["Act__call5"])
    other = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
        main (float[2] x) => (float[2] y) { y = pkg.test.F(x) }
        <domain: "pkg.test", opset_import: ["" : 18]>
        F (p) => (q) { q = LeakyRelu<alpha=0.2>(p) }
        <domain: "pkg.test", opset_import: ["" : 18]>
        G (p) => (q) { q = LeakyRelu<alpha=0.3>(p) }
    """)
    f, g = other.functions.values()
    assert function_fingerprint(f) != function_fingerprint(g)


def test_requires_no_recursion():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
        main (float[2] x) => (float[2] y) { y = pkg.test.F(x) }
        <domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
        F (p) => (q) { q = pkg.test.G(p) }
        <domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
        G (p) => (q) { q = pkg.test.F(p) }
    """)
    with pytest.raises(ir.passes.PreconditionError, match="pkg.test:F -> pkg.test:G -> pkg.test:F"):
        DeduplicateFunctionsPass()(model)


def _layers(shapes: dict[str, list]) -> tuple[ir.Model, object]:
    """Two Layer bodies (Add of two inputs) whose formal inputs get the given symbolic shapes."""
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
        main (float[2,4] x, float[2,4] y) => (float[2,4] z) {
          a = pkg.test.Layer__call1(x, y)
          z = pkg.test.Layer__call2(a, y)
        }
        <domain: "pkg.test", opset_import: ["" : 18]>
        Layer__call1 (h, p) => (o) { o = Add(h, p) }
        <domain: "pkg.test", opset_import: ["" : 18]>
        Layer__call2 (h, p) => (o) { o = Add(h, p) }
    """)
    tree = call_tree(("layers.0", "Layer"), ("layers.1", "Layer"))
    for function in model.functions.values():
        call = tree["layers.0" if function.name.endswith("1") else "layers.1"]
        call.function = (function.domain, function.name)
        function.meta[metadata.CALLS] = [call]
        for value, dims in zip([*function.inputs, *function.outputs], shapes[function.name]):
            value.shape = ir.Shape(dims)
    return model, tree


def test_symbolic_dims_compare_up_to_renaming_and_differing_ones_become_anonymous():
    # torch gives each layer's cache length its own symbol (Dim.AUTO): s54 in one layer, s60 in
    # the other; the batch symbol is shared. The bodies are the same computation.
    model, tree = _layers({
        "Layer__call1": [["batch", "s54"], ["batch", "s54"], ["batch", "s54"]],
        "Layer__call2": [["batch", "s60"], ["batch", "s60"], ["batch", "s60"]],
    })
    assert DeduplicateFunctionsPass()(model).modified
    (layer,) = model.functions.values()
    assert layer.meta[metadata.CALLS] == [tree["layers.0"], tree["layers.1"]]
    for value in [*layer.inputs, *layer.outputs]:
        batch, length = value.shape
        assert str(batch) == "batch"  # the same in both callers: kept
        assert length.value is None  # s54 for one caller, s60 for the other: anonymous


def test_symbolic_dims_with_another_equality_structure_stay_apart():
    # (s, s) against (s1, s2): one body's inputs are known equal in length, the other's are not.
    model, _ = _layers({
        "Layer__call1": [["s", 4], ["s", 4], ["s", 4]],
        "Layer__call2": [["s1", 4], ["s2", 4], ["s1", 4]],
    })
    assert not DeduplicateFunctionsPass()(model).modified
    assert len(model.functions) == 2


def test_commutative_operands_in_either_order_compare_equal():
    # torch writes a sum of two sizes as Add(a, b) in one layer and Add(b, a) in another (sympy
    # orders the terms by symbol); Sub is not commutative and stays apart.
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
        main (int64 a, int64 b) => (int64 y, int64 z, int64 w) {
          y = pkg.test.F(a, b)
          z = pkg.test.G(a, b)
          w = pkg.test.H(a, b)
        }
        <domain: "pkg.test", opset_import: ["" : 18]>
        F (p, q) => (r) { r = Add(p, q) }
        <domain: "pkg.test", opset_import: ["" : 18]>
        G (p, q) => (r) { r = Add(q, p) }
        <domain: "pkg.test", opset_import: ["" : 18]>
        H (p, q) => (r) { r = Sub(q, p) }
    """)
    f, g, h = model.functions.values()
    assert function_fingerprint(f) == function_fingerprint(g)
    assert function_fingerprint(f) != function_fingerprint(h)
