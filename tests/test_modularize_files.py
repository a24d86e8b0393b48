"""``modularize``: the module hierarchy of a flat ONNX file, rebuilt from what the file carries.

GPT-2 exported flat by ``torch.onnx.export(dynamo=True)`` (torch's ``name_scopes``), the same
graph renamed by scope as TorchScript-era exporters name nodes (no torch metadata), small graphs
written from ONNX text for bad input, and architectures of the transformers sweep's sample whose
modularized call tree must match ``export_modular``'s. Every written file was compared with the
flat one in onnxruntime inside ``modularize`` (atol 1e-6); the tests compare again themselves.
"""

from __future__ import annotations

import ast
import contextlib
import io
import warnings

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

from onnx_modular.calls.tree import function_tree
from onnx_modular.cli import main
from onnx_modular.errors import InvalidInputError, InvalidModelFileError
from onnx_modular.files.modularize.tool import modularize
from onnx_modular.format import metadata
from onnx_modular.runtime.inputs import random_inputs
from onnx_modular.storage.load import load_model_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TORCH_KEYS = (metadata.NAME_SCOPES, metadata.CLASS_HIERARCHY, metadata.NAMESPACE,
              "pkg.torch.onnx.stack_trace", "pkg.torch.onnx.fx_node")


def run(path, feeds):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_same_outputs(flat, modular):
    feeds = random_inputs(onnx.load(str(flat), load_external_data=False), seed=3)
    for expected, got in zip(run(flat, feeds), run(modular, feeds), strict=True):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def gpt2_flat(tmp_path_factory):
    """GPT-2 (2 layers) exported flat by torch's dynamo exporter, weights in external data."""
    folder = tmp_path_factory.mktemp("gpt2")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    path = folder / "gpt2.flat.onnx"
    torch.onnx.export(model, (torch.randint(0, 64, (1, 8)),), str(path), dynamo=True, verbose=False)
    return path


@pytest.fixture(scope="module")
def gpt2_modular(gpt2_flat, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt2_modular") / "gpt2.onnx"
    return modularize(gpt2_flat, out), out


def _scope_named(flat_path, out_path, mangle=()):
    """The graph with torch's metadata removed and nodes named by scope, TorchScript style
    (``/transformer/h.0/attn/c_attn/MatMul``); names in ``mangle`` only look like scopes."""
    model = onnx.load(str(flat_path), load_external_data=False)
    counts: dict[str, int] = {}
    for node in model.graph.node:
        props = metadata.props(node)
        paths = ast.literal_eval(props[metadata.NAME_SCOPES])[1:-1] if metadata.NAME_SCOPES in props else []
        parts, parent = [], ""
        for path in paths:
            parts.append(path[len(parent) + 1:] if parent else path)
            parent = path
        base = "/" + "/".join([*parts, node.op_type])
        index = counts.get(base, 0)
        counts[base] = index + 1
        node.name = base if index == 0 else f"{base}_{index}"
        if node.name in mangle:
            node.name = "/not a scope" + node.name
        kept = [p for p in node.metadata_props if p.key not in TORCH_KEYS]
        del node.metadata_props[:]
        node.metadata_props.extend(kept)
    onnx.save(model, str(out_path))  # external data references kept: same folder as the flat file
    return model


# -- GPT-2 from torch's dynamo exporter --------------------------------------------------------


def test_gpt2_from_torch_metadata(gpt2_flat, gpt2_modular):
    report, out = gpt2_modular
    assert report.source == "torch name_scopes"
    model = load_model_file(out)
    functions = {f.name: f for f in model.functions}
    block = functions["GPT2Block"]
    assert block.domain == "pkg.transformers"  # package from the class's module path; version unknown
    assert metadata.props(block)[metadata.CLASS] == "transformers.models.gpt2.modeling_gpt2.GPT2Block"
    assert metadata.props(block)[metadata.PACKAGE_VERSION] == metadata.UNKNOWN_PACKAGE
    assert metadata.module_paths(block) == ["transformer.h.0", "transformer.h.1"]
    assert functions["LayerNorm"].domain.startswith("pkg.torch.")  # torch's own classes: the producer's version
    tree = function_tree(model)
    blocks = [call for call in tree.walk() if call.function and call.function[1] == "GPT2Block"]
    assert [call.call_name for call in blocks] == ["transformer.h.0", "transformer.h.1"]
    assert tree.max_depth >= 3 and report.max_depth == tree.max_depth
    assert {c.call_name for c in tree.walk() if c.function} >= {"transformer", "lm_head", "transformer.h.1.attn.c_attn"}
    assert metadata.props(model)[metadata.MODULARIZED_FROM] == "torch name_scopes"
    # torch's integer/boolean constants are listed as ours are (not weights); folded weights are not
    lifted = metadata.lifted_constants(model)
    assert lifted and not {name for name in lifted if name.endswith((".weight", ".bias"))}
    assert tree.find("transformer.h.0.mlp.act").parameters == 0
    assert tree.find("lm_head").parameters == 32 * 64
    assert report.nodes_in_calls + report.nodes_in_parent == report.nodes
    assert report.nodes_in_calls > 0.9 * report.nodes and report.parity.ok
    assert_same_outputs(gpt2_flat, out)


def test_weights_stay_external_and_the_flat_file_untouched(gpt2_flat, gpt2_modular):
    _, out = gpt2_modular
    stored = onnx.load(str(out), load_external_data=False)
    flat = onnx.load(str(gpt2_flat), load_external_data=False)
    external = {t.name for t in flat.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    assert external and external == {
        t.name for t in stored.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
    }
    block = next(f for f in stored.functions if f.name == "GPT2Block")
    assert any(name.endswith("weight") for name in block.input)  # weights are passed into the calls
    assert not flat.functions and (gpt2_flat.parent / "gpt2.flat.onnx.data").exists()


def test_depth_and_classes_choose_the_calls(gpt2_flat, tmp_path):
    report = modularize(gpt2_flat, tmp_path / "d2.onnx", modules=2)
    assert not report.absorbed
    tree = function_tree(load_model_file(tmp_path / "d2.onnx"))
    assert tree.max_depth == 2 and {c.function[1] for c in tree.walk() if c.function} == {"GPT2Model", "GPT2Block", "Embedding", "Embedding_2", "LayerNorm", "Linear"}
    assert report.parity.ok
    modularize(gpt2_flat, tmp_path / "blocks.onnx", modules=["GPT2Block"])
    model = load_model_file(tmp_path / "blocks.onnx")
    assert [f.name for f in model.functions] == ["GPT2Block"]
    assert_same_outputs(gpt2_flat, tmp_path / "blocks.onnx")
    with pytest.raises(InvalidInputError, match="NoSuchBlock"):
        modularize(gpt2_flat, tmp_path / "none.onnx", modules=["NoSuchBlock"])
    assert not (tmp_path / "none.onnx").exists()


def test_profile_and_extract_work_on_the_result(gpt2_modular, tmp_path):
    from onnx_modular import extract, profile

    _, out = gpt2_modular
    timing = profile(out, runs=2, warmup=1)
    assert {"transformer.h.0", "transformer.h.1", "lm_head"} <= set(timing.times)
    extraction = extract(out, "GPT2Block", tmp_path / "blocks", with_data=True)
    assert len(extraction.models) == 1 and extraction.models[0].call_names == ["transformer.h.0", "transformer.h.1"]


def test_diff_works_on_the_result(gpt2_flat, gpt2_modular, tmp_path):
    """Two modularizations of one flat file compare `same` call by call with drift 0; a weight of
    one block changed in the flat file before modularizing shows up in that block's call."""
    from onnx_modular import diff

    _, out = gpt2_modular
    again = tmp_path / "again.onnx"
    modularize(gpt2_flat, again)
    same = diff(out, again)
    assert not same.differs and all(c.change == "same" for c in same.root.walk())
    compared = [c for c in same.calls() if c.max_abs is not None]
    assert len(compared) > 10 and all(c.max_abs == 0.0 for c in compared)

    folder = tmp_path / "edited"
    folder.mkdir()
    flat = onnx.load(str(gpt2_flat))  # weights read: the test model is tiny
    weight = next(t for t in flat.graph.initializer if "h.1.mlp.c_fc.weight" in t.name)
    array = onnx.numpy_helper.to_array(weight).copy()
    array[0, 0] += 1.0
    weight.CopyFrom(onnx.numpy_helper.from_array(array, weight.name))
    onnx.save(flat, str(folder / "flat.onnx"), save_as_external_data=True, location="flat.onnx.data")
    modularize(folder / "flat.onnx", folder / "m.onnx")
    changed = diff(out, folder / "m.onnx")
    assert changed.differs
    assert changed["transformer.h.1.mlp"].change == "changed" and changed["transformer.h.0"].change == "same"
    assert changed.first_drift is not None and changed.first_drift.path.startswith("transformer.h.1")


def test_cli(gpt2_flat, tmp_path):
    out = tmp_path / "cli.onnx"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(["modularize", str(gpt2_flat), "-o", str(out), "--classes", "GPT2*"]) == 0
    assert "went into calls" in stdout.getvalue() and "PASS" in stdout.getvalue()
    assert {f.name for f in load_model_file(out).functions} == {"GPT2Model", "GPT2Block", "GPT2Attention", "GPT2MLP"}
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert main(["modularize", str(out), "-o", str(tmp_path / "again.onnx")]) == 2  # modular already
    assert not (tmp_path / "again.onnx").exists()


# -- scope names (TorchScript-era exporters) ---------------------------------------------------


def test_scope_names_share_a_block_function(gpt2_flat, tmp_path):
    named = gpt2_flat.parent / "scoped.onnx"  # beside the flat file's external data
    _scope_named(gpt2_flat, named)
    report = modularize(named, tmp_path / "m.onnx")
    assert report.source == "scope names"
    model = load_model_file(tmp_path / "m.onnx")
    tree = function_tree(model)
    blocks = [call for call in tree.walk() if call.module_path in ("transformer.h.0", "transformer.h.1")]
    assert len(blocks) == 2 and blocks[0].function == blocks[1].function == ("pkg.unknown", "h")
    assert tree.max_depth >= 3
    # q/k/v style identical bodies are shared whatever their names: c_fc and c_attn differ in shape,
    # the two layer norms of a block do not
    ln = [call.function for call in tree.walk() if call.module_path.endswith((".ln_1", ".ln_2"))]
    assert len(set(ln)) == 1 and len(ln) == 4
    assert metadata.props(next(f for f in model.functions if f.name == "h"))[metadata.CLASS] == ""
    assert_same_outputs(named, tmp_path / "m.onnx")


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act = torch.nn.Linear(8, 8), torch.nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x)) + x


class _Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(), _Block()])
        self.seq = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.seq(x)


class _Scoped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model, self.head = _Inner(), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.model(x))


def test_torchscript_export(tmp_path):
    """torch's TorchScript exporter (``dynamo=False``) names nodes ``/model/layers.0/fc/Gemm`` and
    ``/model/seq/seq.0/Gemm`` (an item of a called Sequential): the module paths come back, and the
    layers share one body although the file declares no intermediate shapes."""
    torch.manual_seed(0)
    model = _Scoped().eval()
    path = tmp_path / "ts.onnx"
    with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter is deprecated
        torch.onnx.export(model, (torch.randn(2, 8),), str(path), dynamo=False, input_names=["x"])
    assert "/model/seq/seq.0/Gemm" in {n.name for n in onnx.load(str(path)).graph.node}
    report = modularize(path, tmp_path / "m.onnx")
    assert report.source == "scope names"
    tree = function_tree(load_model_file(tmp_path / "m.onnx"))
    called = {name for name, module in model.named_modules() if name and not isinstance(module, torch.nn.ModuleList)}
    assert {c.call_name for c in tree.walk() if c.function} == called
    layers = [c.function for c in tree.walk() if c.module_path in ("model.layers.0", "model.layers.1")]
    assert layers[0] == layers[1] == ("pkg.unknown", "layers")
    assert_same_outputs(path, tmp_path / "m.onnx")
    from onnx_modular import extract, profile

    assert called <= set(profile(tmp_path / "m.onnx", runs=1, warmup=0).times)
    assert extract(tmp_path / "m.onnx", "model.layers.1", tmp_path / "x", with_data=True).models[0].data_sets


def test_names_that_only_look_like_scopes_are_placed_by_the_data_flow(gpt2_flat, tmp_path):
    """A name with a space is no TorchScript scope: the node has none, and as export places such
    a node, it joins the call whose nodes surround it (it reads from them and feeds them)."""
    named = gpt2_flat.parent / "mangled.onnx"
    _scope_named(gpt2_flat, named, mangle=("/transformer/Add",))
    report = modularize(named, tmp_path / "m.onnx")
    assert report.unscoped_total == 1 and report.unscoped == 0 and report.parity.ok
    assert "1 node without a scope went into the call" in str(report)
    assert_same_outputs(named, tmp_path / "m.onnx")


# -- bad input, from ONNX text (no torch) ------------------------------------------------------


def _text_model(names: list[str], tmp_path, props: dict | None = None):
    """x -> Add -> Mul -> Add -> y with the given node names (scopes)."""
    nodes = [
        oh.make_node("Add", ["x", "x"], ["a1"], name=names[0]),
        oh.make_node("Mul", ["a1", "a1"], ["b1"], name=names[1]),
        oh.make_node("Add", ["a1", "b1"], ["y"], name=names[2]),
    ]
    for node in nodes:
        for key, value in (props or {}).items():
            node.metadata_props.add(key=key, value=value)
    graph = oh.make_graph(
        nodes, "g", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)
    path = tmp_path / "flat.onnx"
    onnx.save(model, str(path))
    return path


def test_no_scope_information_is_a_clear_error(tmp_path):
    path = _text_model(["add", "mul", "add_1"], tmp_path)
    with pytest.raises(InvalidModelFileError, match="no module scopes") as error:
        modularize(path, tmp_path / "m.onnx")
    assert "name_scopes" in str(error.value) and error.value.hint
    assert list(tmp_path.iterdir()) == [path]  # nothing written


def test_interleaved_scopes_are_made_convex(tmp_path):
    """``a``'s nodes surround ``b``'s, which reads ``a`` and feeds it: outlining ``b`` apart would
    make a cycle, so ``b``'s node joins ``a`` (as export handles non-contiguous calls)."""
    path = _text_model(["/a/Add", "/b/Mul", "/a/Add_1"], tmp_path)
    report = modularize(path, tmp_path / "m.onnx")
    model = load_model_file(tmp_path / "m.onnx")
    assert [f.name for f in model.functions] == ["a"] and len(model.functions[0].node) == 3
    assert report.parity.ok and report.nodes_in_calls == 3
    assert report.absorbed == ["b"] and "its nodes inside another call" in str(report) and "b" in str(report)
    assert_same_outputs(path, tmp_path / "m.onnx")


def test_unscoped_nodes_after_a_call_stay_in_the_main_graph(tmp_path):
    path = _text_model(["/a/Add", "/a/Mul", "Add_1"], tmp_path)
    report = modularize(path, tmp_path / "m.onnx")
    model = load_model_file(tmp_path / "m.onnx")
    assert [n.op_type for n in model.graph.node] == ["a", "Add"]
    assert (report.nodes_in_calls, report.nodes_in_parent, report.unscoped) == (2, 1, 1)
    assert "1 stayed in the main graph (1 of them for lack of a scope)" in str(report)
    assert_same_outputs(path, tmp_path / "m.onnx")


def test_namespace_only(tmp_path):
    """Only the ``namespace`` chain (Model Explorer's key): classes known from it."""
    namespace = ": pkg.Root/block: mylib.layers.Block/add: aten.add.Tensor"
    path = _text_model(["n0", "n1", "n2"], tmp_path, {metadata.NAMESPACE: namespace})
    report = modularize(path, tmp_path / "m.onnx")
    model = load_model_file(tmp_path / "m.onnx")
    assert report.source == "namespace"
    assert [(f.domain, f.name) for f in model.functions] == [("pkg.mylib", "Block")]
    assert metadata.props(model.functions[0])[metadata.PACKAGE] == "mylib"


def test_cli_options(tmp_path):
    path = _text_model(["/a/Add", "/a/b/Mul", "/a/Add_1"], tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["modularize", str(path), "-o", str(tmp_path / "m.onnx"), "--no-verify", "--depth", "1"]) == 0
        assert main(["modularize", str(path), "-o", str(tmp_path / "x.onnx"), "--depth", "1", "--classes", "a"]) == 2
    assert "Parity" not in out.getvalue() and "1 module call, 1 function" in out.getvalue()
    assert [f.name for f in load_model_file(tmp_path / "m.onnx").functions] == ["a"]
    assert not (tmp_path / "x.onnx").exists()
    assert_same_outputs(path, tmp_path / "m.onnx")


def test_bad_options(tmp_path):
    path = _text_model(["/a/Add", "/a/Mul", "/a/Add_1"], tmp_path)
    with pytest.raises(InvalidInputError, match="depth"):
        modularize(path, tmp_path / "m.onnx", modules=0)
    with pytest.raises(InvalidInputError, match="input file"):
        modularize(path, path)
    assert not (tmp_path / "m.onnx").exists()


# -- architectures of the sweep's sample: the same tree as export_modular's --------------------


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llama", "bert", "vit"])
def test_sample_tree_matches_export_modular(model_type, tmp_path):
    from catalogue import building, jobs

    from onnx_modular import export_modular, extract, profile

    base = {m: c for m, c, _ in jobs.architectures(heads=False)}
    model, inputs, _ = building.build(model_type, base[model_type])
    flat = tmp_path / "flat.onnx"
    torch.onnx.export(model, (), str(flat), kwargs=inputs, dynamo=True, verbose=False)
    ours = export_modular(model, (), kwargs=inputs)
    report = modularize(flat, tmp_path / "m.onnx")
    assert report.parity.ok
    tree = function_tree(load_model_file(tmp_path / "m.onnx"))
    rebuilt = {(c.call_name, c.qualified_class) for c in tree.walk() if c.function and not c.is_root}
    exported = {(c.call_name, c.qualified_class) for c in ours.hierarchy.calls_with_functions()}
    assert rebuilt and rebuilt <= exported
    # What is missing has no node left in torch's file: its optimizer folded the call into
    # initializers (Llama's rotary_emb, whose inputs are all constant at a static shape).
    scoped = {path for node in onnx.load(str(flat), load_external_data=False).graph.node
              for path in ast.literal_eval(metadata.props(node).get(metadata.NAME_SCOPES, "[]"))}
    assert not {path for path, _ in exported - rebuilt} & scoped
    assert set(profile(tmp_path / "m.onnx", runs=1, warmup=0).times) >= {name for name, _ in rebuilt}
    first = min(rebuilt)[0]
    assert extract(tmp_path / "m.onnx", first, tmp_path / "x").models
