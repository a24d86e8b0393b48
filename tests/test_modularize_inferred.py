"""``modularize`` on files that record no scopes: calls inferred from repeated blocks.

GPT-2 and BERT (3 layers) exported flat by torch and stripped of every name, metadata entry, doc
string and weight name (``files/strip.py``): one function called once per layer, its body as large
as torch's layer (0.8-1.25x), outputs equal to the stripped file's. Then torch-free graphs written
from ONNX text: a small residual stack, a file with scope names on some nodes only, a graph that
does not repeat (the message), and hostile graphs (a long chain of one op, a long graph of no
repeat) whose search stays bounded.
"""

from __future__ import annotations

import ast
import json

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnx_modular.calls import inferred
from onnx_modular.calls.tree import function_tree
from onnx_modular.cli import main
from onnx_modular.errors import InvalidModelFileError
from onnx_modular.files.modularize.tool import INFERRED_SOURCE, modularize
from onnx_modular.files.strip import strip_names
from onnx_modular.format import metadata
from onnx_modular.runtime.inputs import random_inputs


def run(path, feeds):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def assert_same_outputs(flat, modular):
    feeds = random_inputs(onnx.load(str(flat), load_external_data=False), seed=3)
    for expected, got in zip(run(flat, feeds), run(modular, feeds), strict=True):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


def functions(path) -> dict[str, onnx.FunctionProto]:
    return {f.name: f for f in onnx.load(str(path), load_external_data=False).functions}


def props(proto) -> dict[str, str]:
    return {p.key: p.value for p in proto.metadata_props}


def expanded_size(name: str, by_name: dict[str, onnx.FunctionProto]) -> int:
    """Nodes of a function with its calls expanded."""
    return sum(expanded_size(n.op_type, by_name) if n.op_type in by_name else 1 for n in by_name[name].node)


# -- torch's files, stripped ------------------------------------------------------------------------


def _export(tmp_path_factory, name, build, vocab=64):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp(name)
    torch.manual_seed(0)
    model = build().eval()
    flat = folder / "flat.onnx"
    torch.onnx.export(model, (torch.randint(0, vocab, (1, 8)),), str(flat), dynamo=True, verbose=False)
    stripped = strip_names(flat, folder / "stripped.onnx")
    report = modularize(stripped, folder / "inferred.onnx")
    return flat, stripped, report


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    import transformers

    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, use_cache=False)
    return _export(tmp_path_factory, "gpt2", lambda: transformers.GPT2LMHeadModel(config))


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    import transformers

    config = transformers.BertConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=64)
    return _export(tmp_path_factory, "bert", lambda: transformers.BertModel(config))


def _layer_nodes(flat, prefix: str) -> int:
    """Nodes torch put under layer 0 (``prefix`` + ``0``), by its own scopes."""
    model = onnx.load(str(flat), load_external_data=False)
    count = 0
    for node in model.graph.node:
        text = props(node).get(metadata.NAME_SCOPES)
        count += bool(text) and f"{prefix}0" in ast.literal_eval(text)
    return count


@pytest.mark.parametrize("case, prefix", [("gpt2", "transformer.h."), ("bert", "encoder.layer.")])
def test_stripped_file_gets_one_function_per_layer(case, prefix, request):
    flat, stripped, report = request.getfixturevalue(case)
    stripped_model = onnx.load(str(stripped), load_external_data=False)
    assert not any(n.name or n.metadata_props for n in stripped_model.graph.node)  # nothing to read
    assert not any(i.name.startswith(("transformer", "encoder", "h.")) for i in stripped_model.graph.initializer)
    assert report.source == INFERRED_SOURCE
    assert [(r.count, [p for _, _, p in r.parts]) for r in report.inferred.regions] == [(3, ["attention", "mlp"])]

    by_name = functions(report.path)
    block = by_name["Block"]
    assert props(block)[metadata.CALL_COUNT] == "3"
    assert json.loads(props(block)[metadata.MODULE_PATHS]) == ["block.0", "block.1", "block.2"]
    assert props(block)[metadata.CLASS] == "Block" and props(block)[metadata.INFERRED] == "structure"
    assert props(by_name["Attention"])[metadata.CLASS] == "Block.Attention"
    ratio = expanded_size("Block", by_name) / _layer_nodes(flat, prefix)
    assert 0.8 <= ratio <= 1.25, ratio
    model = onnx.load(str(report.path), load_external_data=False)
    assert props(model)[metadata.MODULARIZED_FROM] == INFERRED_SOURCE
    calls = [n for n in model.graph.node if n.domain == "pkg.inferred"]
    assert [props(n)[metadata.MODULE_PATH] for n in calls] == ["stem", "block.0", "block.1", "block.2", "head"]
    assert all(props(n)[metadata.INFERRED] == "structure" for n in calls)
    assert_same_outputs(stripped, report.path)


def test_scopes_win_unless_asked(gpt2, tmp_path):
    flat, _, _ = gpt2
    assert modularize(flat, tmp_path / "recorded.onnx", verify=False).inferred is None
    report = modularize(flat, tmp_path / "always.onnx", infer="always", verify=False)
    assert report.source == INFERRED_SOURCE and report.inferred.regions[0].count == 3


def test_always_on_a_file_with_scopes_and_no_repeat(tmp_path):
    nodes = [oh.make_node(op, [f"t{i}" if i else "x"], [f"t{i + 1}"], name=f"/m{i}/{op}")
             for i, op in enumerate(["Relu", "Tanh", "Sigmoid", "Neg", "Abs", "Exp", "Sin", "Cos"])]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                          [oh.make_tensor_value_info("t8", onnx.TensorProto.FLOAT, [2])])
    path = tmp_path / "named.onnx"
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)]), str(path))
    with pytest.raises(InvalidModelFileError, match="infer='always' finds no call") as error:
        modularize(path, tmp_path / "m.onnx", infer="always")
    assert "infer='auto'" in error.value.hint
    assert modularize(path, tmp_path / "m.onnx").source == "scope names"


# -- ONNX text, no torch ------------------------------------------------------------------------------


def _stack(layers: int, *, names: bool = False, hidden: int = 8, gated: bool = False) -> onnx.ModelProto:
    """A pre-norm residual stack: stem (MatMul, Tanh), ``layers`` x (LayerNorm, MatMul, Relu,
    MatMul, Add), head (LayerNorm, MatMul). ``names``: the stem and head named by scope.
    ``gated``: the MLP is gated (LayerNorm, MatMul, Relu, MatMul, Mul, MatMul, Add): two branches."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def weight(*shape):
        name = f"w{len(inits)}"
        inits.append(onnx.numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name))
        return name

    def op(op_type, inputs, scope=None, **attrs):
        out = f"t{len(nodes)}"
        name = f"/{scope}/{op_type}_{len(nodes)}" if names and scope else ""
        nodes.append(oh.make_node(op_type, inputs, [out], name=name, **attrs))
        return out

    x = op("Tanh", [op("MatMul", ["x", weight(4, hidden)], "stem")], "stem")
    for _ in range(layers):
        a = op("LayerNormalization", [x, weight(hidden), weight(hidden)], axis=-1)
        h = op("Relu", [op("MatMul", [a, weight(hidden, 2 * hidden)])])
        if gated:
            h = op("Mul", [h, op("MatMul", [a, weight(hidden, 2 * hidden)])])
        h = op("MatMul", [h, weight(2 * hidden, hidden)])
        x = op("Add", [x, h])
    y = op("MatMul", [op("LayerNormalization", [x, weight(hidden), weight(hidden)], "head", axis=-1),
                      weight(hidden, 3)], "head")
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
                          [oh.make_tensor_value_info(y, onnx.TensorProto.FLOAT, [2, 3])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    return onnx.shape_inference.infer_shapes(model)


def test_residual_stack_from_onnx_text(tmp_path):
    path = tmp_path / "stack.onnx"
    onnx.save(_stack(4), str(path))
    report = modularize(path, tmp_path / "m.onnx")
    region = report.inferred.regions[0]
    assert (region.length, region.count) == (5, 4)  # LayerNorm .. residual Add, not another window
    by_name = functions(report.path)
    assert sorted(by_name) == ["Block", "Head", "Stem"]
    assert props(by_name["Block"])[metadata.CALL_COUNT] == "4"
    assert [n.op_type for n in by_name["Block"].node] == ["LayerNormalization", "MatMul", "Relu", "MatMul", "Add"]
    assert report.nodes_in_parent == 0 and report.nodes_in_calls == 24  # every node in a call
    # The file tools read the inferred calls as any module call (tree: the file's call tree).
    tree = function_tree(onnx.load(str(report.path)))
    assert [(c.call_name, c.class_name, c.num_nodes) for c in tree.root.children] == [
        ("stem", "Stem", 2), *((f"block.{i}", "Block", 5) for i in range(4)), ("head", "Head", 2)]
    assert_same_outputs(path, report.path)


def _resorted(model: onnx.ModelProto, seed: int) -> onnx.ModelProto:
    """The same graph in another topological order (a random pick among the ready nodes), as a
    graph tool that sorts again leaves it: the layers' nodes interleave."""
    rng = np.random.default_rng(seed)
    nodes = list(model.graph.node)
    made = {name: i for i, node in enumerate(nodes) for name in node.output}
    needs = [{made[name] for name in node.input if name in made} for node in nodes]
    readers = [[] for _ in nodes]
    for i, inputs in enumerate(needs):
        for j in inputs:
            readers[j].append(i)
    waiting = [len(inputs) for inputs in needs]
    ready, order = [i for i, count in enumerate(waiting) if count == 0], []
    while ready:
        i = ready.pop(int(rng.integers(len(ready))))
        order.append(nodes[i])
        for j in readers[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.append(j)
    del model.graph.node[:]
    model.graph.node.extend(order)
    return model


def test_resorted_file_gives_the_same_blocks(tmp_path):
    path = tmp_path / "resorted.onnx"
    model = _resorted(_stack(4, gated=True), seed=1)
    ops = [n.op_type for n in model.graph.node]
    assert len({tuple(ops[2 + 7 * i : 9 + 7 * i]) for i in range(4)}) > 1  # the layers' orders differ
    onnx.save(model, str(path))
    report = modularize(path, tmp_path / "m.onnx")
    assert [(r.length, r.count) for r in report.inferred.regions] == [(7, 4)]
    assert props(functions(report.path)["Block"])[metadata.CALL_COUNT] == "4"
    assert_same_outputs(path, report.path)


def test_cli_infer_option(tmp_path, capsys):
    path = tmp_path / "stack.onnx"
    onnx.save(_stack(3), str(path))
    assert main(["modularize", str(path), "-o", str(tmp_path / "never.onnx"), "--infer", "never"]) == 2
    assert "carries no module scopes" in capsys.readouterr().err and not (tmp_path / "never.onnx").exists()
    assert main(["modularize", str(path), "-o", str(tmp_path / "m.onnx")]) == 0
    assert "inferred: 3 copies of a 5-node block (block.0 ... block.2)" in capsys.readouterr().out


def test_recorded_scopes_kept_and_the_rest_inferred(tmp_path):
    path = tmp_path / "mixed.onnx"
    onnx.save(_stack(6, names=True), str(path))
    report = modularize(path, tmp_path / "m.onnx")
    assert report.source == "scope names"
    paths = [call.module_path for call in report.tree.root.children]
    assert paths == ["stem", *(f"block.{i}" for i in range(6)), "head"]
    model = onnx.load(str(report.path), load_external_data=False)
    assert props(model)[metadata.MODULARIZED_FROM] == f"scope names + {INFERRED_SOURCE}"
    kinds = {props(n)[metadata.MODULE_PATH]: props(n).get(metadata.INFERRED) for n in model.graph.node}
    assert kinds["stem"] is None and kinds["block.0"] == "structure"
    assert_same_outputs(path, report.path)


def test_nothing_repeats_says_so(tmp_path):
    ops = ["Relu", "Tanh", "Sigmoid", "Neg", "Abs", "Exp", "Softsign", "Sin", "Cos", "Floor"]
    nodes = [oh.make_node(op, [f"t{i}" if i else "x"], [f"t{i + 1}"]) for i, op in enumerate(ops)]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                          [oh.make_tensor_value_info(f"t{len(ops)}", onnx.TensorProto.FLOAT, [2])])
    path = tmp_path / "plain.onnx"
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)]), str(path))
    with pytest.raises(InvalidModelFileError, match="no block of 4 nodes or more repeats") as error:
        modularize(path, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()
    with pytest.raises(InvalidModelFileError, match="carries no module scopes"):
        modularize(path, tmp_path / "m.onnx", infer="never")
    assert "export_modular" in error.value.hint


def _chain(ops: list[str]) -> ir.Model:
    nodes = [oh.make_node(op, [f"t{i}" if i else "x"], [f"t{i + 1}"]) for i, op in enumerate(ops)]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                          [oh.make_tensor_value_info(f"t{len(ops)}", onnx.TensorProto.FLOAT, [2])])
    return ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(
        oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])))


def test_hostile_graphs_stay_bounded():
    # 6,000 copies of one op, then of a 2-op pattern: repeats of fewer than 4 nodes are no blocks.
    assert inferred.infer_calls(_chain(["Relu"] * 6000)).regions == []
    assert inferred.infer_calls(_chain(["Relu", "Neg"] * 3000)).regions == []
    # 6,000 nodes that never repeat a 4-node block (a random walk over 5 ops).
    rng = np.random.default_rng(0)
    ops = ["Relu", "Tanh", "Sigmoid", "Neg", "Abs"]
    walk = [ops[i] for i in rng.integers(0, 5, 6000)]
    found = inferred.infer_calls(_chain(walk))
    # Random 4-grams recur, but only at scattered places: few short regions, at most the cap.
    assert len(found.regions) <= inferred._MAX_REGIONS
    assert all(r.length * r.count < 200 for r in found.regions)
    # A 5-op pattern 1,200 times: one region, blocks of 5 (the period, not a multiple).
    found = inferred.infer_calls(_chain(["Relu", "Tanh", "Neg", "Abs", "Sigmoid"] * 1200))
    assert [(r.length, r.count) for r in found.regions] == [(5, 1200)]
