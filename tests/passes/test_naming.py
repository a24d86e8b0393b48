"""NameFunctionsPass on hand-written models: names in execution order, doc strings, metadata, requires()."""

from __future__ import annotations

import json

import onnx_ir as ir
import pytest
from pass_helpers import call_tree

from onnx_modular.format import metadata
from onnx_modular.passes.export.naming import MAX_LISTED_PATHS, NameFunctionsPass

# Definitions in an order unlike execution: the encoder's Linear runs first.
MODEL = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[2] x) => (float[2] y) {
  a = pkg.test.Linear__call9(x)
  b = pkg.test.Linear__call2(a)
  c = pkg.test.Linear__call2(b)
  y = pkg.test.Norm__call4(c)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Linear__call2 (p) => (q) { q = Relu(p) }
<domain: "pkg.test", opset_import: ["" : 18]>
Norm__call4 (p) => (q) { q = Neg(p) }
<domain: "pkg.test", opset_import: ["" : 18]>
Linear__call9 (p) => (q) { q = Abs(p) }
"""


def _model():
    model = ir.from_onnx_text(MODEL)
    tree = call_tree(("enc", "Linear"), ("dec.0", "Linear"), ("dec.1", "Linear"), ("norm", "Norm"))
    serves = {"Linear__call9": ["enc"], "Linear__call2": ["dec.1", "dec.0"], "Norm__call4": ["norm"]}
    for function in model.functions.values():
        function.meta[metadata.CALLS] = [tree[key] for key in serves[function.name]]
    return model, tree


def test_names_follow_execution_order():
    model, tree = _model()
    assert NameFunctionsPass(tree)(model).modified
    assert [name for _, name, _ in model.functions] == ["Linear_2", "Norm", "Linear"]
    assert [node.op_type for node in model.graph] == ["Linear", "Linear_2", "Linear_2", "Norm"]
    assert [tree[key].function for key in ("enc", "dec.0", "dec.1", "norm")] == [
        ("pkg.test", "Linear"), ("pkg.test", "Linear_2"), ("pkg.test", "Linear_2"), ("pkg.test", "Norm")
    ]
    shared = model.functions[("pkg.test", "Linear_2", "")]
    assert shared.meta[metadata.CALLS] == [tree["dec.0"], tree["dec.1"]]  # sorted by execution order
    assert shared.graph.name == "Linear_2"


def test_doc_string_and_metadata():
    model, tree = _model()
    model.functions[("pkg.test", "Norm__call4", "")].meta[metadata.SIGNATURE_NOTES] = ["unbound_input_0: why"]
    NameFunctionsPass(tree)(model)
    shared = model.functions[("pkg.test", "Linear_2", "")]
    props = shared.metadata_props
    assert props[metadata.CLASS] == "testpkg.layers.Linear"
    assert (props[metadata.PACKAGE], props[metadata.PACKAGE_VERSION]) == ("testpkg", "1.0")
    assert json.loads(props[metadata.MODULE_PATHS]) == ["dec.0", "dec.1"]
    assert props[metadata.CALL_COUNT] == "2"
    assert props[metadata.SOURCE] == tree["dec.0"].source
    assert shared.doc_string.splitlines() == [
        "Linear_2: testpkg.layers.Linear",
        "package: testpkg 1.0",
        f"source: {tree['dec.0'].source}",
        "2 calls: dec.0, dec.1",
    ]
    norm = model.functions[("pkg.test", "Norm", "")]
    assert norm.doc_string.splitlines()[-2:] == ["names not from forward():", "  unbound_input_0: why"]


def test_call_nodes_keep_only_class_keys_that_differ_from_their_function():
    model, tree = _model()
    for node in model.graph:  # as OutlineModuleCallsPass writes them: every call's own keys
        call = {"Linear__call9": tree["enc"], "Linear__call2": tree["dec.0"], "Norm__call4": tree["norm"]}[node.op_type]
        node.metadata_props.update(call.metadata())
    odd = list(model.graph)[2]  # dec.1: a subclass whose body is identical (shares dec.0's)
    odd.metadata_props[metadata.CLASS] = "testpkg.layers.FancyLinear"
    NameFunctionsPass(tree)(model)
    for node in model.graph:
        function = model.functions[node.op_identifier()]
        kept = set(metadata.FUNCTION_ONLY_KEYS) & set(node.metadata_props)
        assert kept == ({metadata.CLASS} if node is odd else set()), node.name
        assert metadata.SOURCE in node.metadata_props  # Netron's node panel shows it
        props = metadata.call_props(node, function)
        assert props[metadata.PACKAGE] == "testpkg" and props[metadata.MODULE_PATH] == node.metadata_props[metadata.MODULE_PATH]
    assert metadata.call_props(odd, model.functions[odd.op_identifier()])[metadata.CLASS] == "testpkg.layers.FancyLinear"
    assert metadata.call_props(list(model.graph)[1], model.functions[odd.op_identifier()])[metadata.CLASS] == "testpkg.layers.Linear"


def test_long_call_lists_are_shortened():
    keys = [f"h.{i}" for i in range(MAX_LISTED_PATHS + 3)]
    tree = call_tree(*[(key, "Block") for key in keys])
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
        main (float[2] x) => (float[2] y) { y = pkg.test.Block__call1(x) }
        <domain: "pkg.test", opset_import: ["" : 18]>
        Block__call1 (p) => (q) { q = Relu(p) }
    """)
    (function,) = model.functions.values()
    function.meta[metadata.CALLS] = [tree[key] for key in keys]
    NameFunctionsPass(tree)(model)
    assert f"{len(keys)} calls: h.0, h.1," in function.doc_string
    assert function.doc_string.endswith("h.7, ... (3 more)")
    assert len(json.loads(function.metadata_props[metadata.MODULE_PATHS])) == len(keys)


def test_requires_calls_of_the_given_tree():
    model, _ = _model()
    other_tree = call_tree(("enc", "Linear"))
    with pytest.raises(ir.passes.PreconditionError, match="dec.1"):
        NameFunctionsPass(other_tree)(model)
