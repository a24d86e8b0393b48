"""The readers of torch's scope metadata (onnx_modular.format.scopes) on the strings torch writes and
on broken ones: what each reader makes of them, and that none raises on what a file holds."""

from __future__ import annotations

import pytest

from onnx_modular.format import metadata, scopes

# As torch's dynamo exporter writes them on a node of ``h.0.mlp.c_fc`` (root first, FX node last).
TORCH = {
    metadata.NAME_SCOPES: "['', 'h.0', 'h.0.mlp', 'h.0.mlp.c_fc', 'addmm']",
    metadata.CLASS_HIERARCHY: "['GPT2Model', 'gpt2.GPT2Block', 'gpt2.GPT2MLP', 'pytorch_utils.Conv1D', 'aten.addmm.default']",
    metadata.NAMESPACE: ": GPT2Model/h.0: gpt2.GPT2Block/h.0.mlp: gpt2.GPT2MLP/h.0.mlp.c_fc: pytorch_utils.Conv1D/addmm: aten.addmm",
}


def test_torch_scopes_drop_the_root_and_the_fx_node():
    assert scopes.torch_scopes(TORCH) == (
        ("h.0", "gpt2.GPT2Block"), ("h.0.mlp", "gpt2.GPT2MLP"), ("h.0.mlp.c_fc", "pytorch_utils.Conv1D"),
    )
    assert scopes.namespace_scopes(TORCH) == scopes.torch_scopes(TORCH)


def test_enclosing_modules_are_the_scopes_above_a_path():
    assert scopes.enclosing_modules(TORCH, "h.0.mlp.c_fc") == [("h.0", "gpt2.GPT2Block"), ("h.0.mlp", "gpt2.GPT2MLP")]
    assert scopes.enclosing_modules(TORCH, "h.1") == []


def test_namespace_classes_keep_every_segment():
    classes = scopes.namespace_classes(TORCH[metadata.NAMESPACE])
    assert classes[""] == "GPT2Model" and classes["h.0.mlp"] == "gpt2.GPT2MLP" and classes["addmm"] == "aten.addmm"


@pytest.mark.parametrize("text", ["", "not python", "{[1]: 2}", "{{1}}", "(" * 500 + ")" * 500, "7", "['a', 1]"])
def test_broken_lists_read_as_none(text):
    props = {metadata.NAME_SCOPES: text, metadata.CLASS_HIERARCHY: text}
    assert scopes.string_list(text) is None
    assert scopes.torch_scopes(props) is None
    assert scopes.enclosing_modules(props, "a.b") == []


def test_the_lenient_reader_skips_items_the_strict_one_refuses():
    props = {metadata.NAME_SCOPES: "['', 'a', 3, 'a.b.c']", metadata.CLASS_HIERARCHY: "['M', None, 'B', 'C']"}
    assert scopes.torch_scopes(props) is None  # modularize: the node carries no readable scopes
    assert scopes.enclosing_modules(props, "a.b") == [("a", "")]  # diff: what is readable


def test_namespace_with_a_broken_segment_reads_as_none():
    assert scopes.namespace_scopes({metadata.NAMESPACE: ": M/h.0 gpt2.Block/add: aten.add"}) is None
    assert scopes.namespace_scopes({metadata.NAMESPACE: "no root/add: aten.add"}) is None


@pytest.mark.parametrize(
    ("name", "weights", "expected"),
    [
        ("/model/layers.0/self_attn/q_proj/MatMul", frozenset(),
         (("model", ""), ("model.layers.0", ""), ("model.layers.0.self_attn", ""), ("model.layers.0.self_attn.q_proj", ""))),
        ("/model/seq/seq.0/Gemm", frozenset(), (("model", ""), ("model.seq", ""), ("model.seq.0", ""))),
        ("/model/seq/seq.0/Gemm", frozenset({"model.seq.seq.0.weight"}),
         (("model", ""), ("model.seq", ""), ("model.seq.seq.0", ""))),
        ("/MatMul", frozenset(), ()),
        ("MatMul_3", frozenset(), None),
        ("/model/a b/MatMul", frozenset(), None),
    ],
)
def test_torchscript_scope_names(name, weights, expected):
    assert scopes.name_scopes(name, weights) == expected
