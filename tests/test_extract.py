"""``extract`` and ``replace`` (onnx_modular.files.extract / .replace) on a real 2-layer GPT-2.

One export per module; the extracted models are checked with onnx's own test-case reader and
onnxruntime, the data sets against the PyTorch weights, the replaced files against the original.
"""

from __future__ import annotations

import contextlib
import io
import json
import pathlib

import numpy as np
import onnx
import onnx.backend.test.loader
import onnx.helper as oh
import onnx.numpy_helper
import onnx.parser
import onnxruntime as ort
import pytest
from models import gpt2

from onnx_modular import export_modular
from onnx_modular.calls.capture import call_values as capture
from onnx_modular.cli import main
from onnx_modular.errors import InvalidInputError, InvalidModelFileError
from onnx_modular.files import function_tree, load_model_file
from onnx_modular.files.extract import extract
from onnx_modular.files.replace import replace
from onnx_modular.format import metadata

ATOL, RTOL = 1e-4, 1e-3  # float32 verification tolerance
MASK = "unbound_input_0.folded"  # the causal mask torch folded to a constant; the block receives it


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model, args, _ = gpt2(n_layer=2)
    path = tmp_path_factory.mktemp("gpt2") / "gpt2.onnx"
    export_modular(model, args, path)
    return model, args, path


@pytest.fixture(scope="module")
def blocks(exported, tmp_path_factory):
    """``extract GPT2Block --with-data``."""
    _, _, path = exported
    out = tmp_path_factory.mktemp("blocks") / "blocks"
    return extract(path, "GPT2Block", out, with_data=True)


def read_case(case: pathlib.Path) -> list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    """(inputs, outputs) by name of each data set, read with onnx.numpy_helper."""
    sets = []
    for folder in sorted(case.glob("test_data_set_*")):
        sets.append((_arrays(folder, "input"), _arrays(folder, "output")))
    return sets


def _arrays(folder: pathlib.Path, prefix: str) -> dict[str, np.ndarray]:
    tensors = []
    for file in sorted(folder.glob(f"{prefix}_*.pb"), key=lambda p: int(p.stem.split("_")[1])):
        tensor = onnx.TensorProto()
        tensor.ParseFromString(file.read_bytes())
        tensors.append(tensor)
    return {t.name: onnx.numpy_helper.to_array(t) for t in tensors}


def tree_shape(path) -> list[tuple[str, str, int]]:
    return [(c.call_name, c.qualified_class, c.depth) for c in function_tree(load_model_file(path)).walk()]


def test_extract_class_gives_one_model_and_one_data_set_per_call(exported, blocks):
    torch_model, _, _ = exported
    assert len(blocks.models) == 1
    extracted = blocks.models[0]
    assert extracted.call_names == ["h.0", "h.1"]
    assert [d.call_name for d in extracted.data_sets] == ["h.0", "h.1"]
    assert all(max(d.max_abs.values()) <= ATOL for d in extracted.data_sets)

    # onnx's own reader finds the test case in the output folder (its "kind" folder).
    cases = onnx.backend.test.loader.load_model_tests(data_dir=str(blocks.output.parent), kind=blocks.output.name)
    assert [c.name for c in cases] == ["GPT2Block"]
    case = pathlib.Path(cases[0].model_dir)
    model = onnx.load(case / "model.onnx")
    onnx.checker.check_model(model, full_check=True)

    # The initializers: exactly the block's parameters, plus the constants the calls receive.
    lifted = set(json.loads(metadata.props(model)[metadata.LIFTED_CONSTANTS]))
    names = [t.name for t in model.graph.initializer]
    parameters = dict(torch_model.h[0].named_parameters())
    weights = [n for n in names if n not in lifted and n != MASK]
    assert len(weights) == len(parameters) == 12
    assert set(weights) == set(parameters)
    # They differ between h.0 and h.1, so they are also graph inputs; everything else is constant.
    assert [v.name for v in model.graph.input] == ["hidden_states", *parameters]
    props = metadata.props(model)
    assert props[metadata.CLASS] == "transformers.models.gpt2.modeling_gpt2.GPT2Block"
    assert props[metadata.PACKAGE] == "transformers"
    assert json.loads(props[metadata.MODULE_PATHS]) == ["h.0", "h.1"]
    assert props[metadata.EXTRACTED_FROM].endswith("gpt2.onnx")
    assert {f.name for f in model.functions} >= {"GPT2Attention", "GPT2MLP", "LayerNorm"}

    # onnxruntime reproduces both calls from the files alone.
    data = read_case(case)
    assert len(data) == 2
    session = ort.InferenceSession(str(case / "model.onnx"), providers=["CPUExecutionProvider"])
    for (inputs, outputs), layer in zip(data, torch_model.h):
        np.testing.assert_array_equal(inputs["attn.c_attn.weight"], layer.attn.c_attn.weight.detach().numpy())
        got = session.run(None, inputs)
        for value, (name, expected) in zip(got, outputs.items()):
            assert name == "output"
            np.testing.assert_allclose(value, expected, atol=ATOL, rtol=RTOL)
    # h.1 receives what h.0 returns.
    np.testing.assert_array_equal(data[1][0]["hidden_states"], data[0][1]["output"])


def test_extract_one_path(exported, tmp_path):
    torch_model, _, path = exported
    (tmp_path / "attn").mkdir()  # an existing empty folder is filled
    result = extract(path, "h.1.attn", tmp_path / "attn", with_data=True)
    (only,) = result.models
    assert only.path == tmp_path / "attn" / "h.1.attn" / "model.onnx"
    model = onnx.load(only.path)
    # One call: its weights are plain initializers (constants), only the activation is an input.
    assert [v.name for v in model.graph.input] == ["hidden_states"]
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_array_equal(weights["c_proj.bias"], torch_model.h[1].attn.c_proj.bias.detach().numpy())
    # Nested calls are named after the call extracted, not the body's first caller.
    assert [c.call_name for c in function_tree(model).walk()][1:] == [
        "h.1.attn.c_attn", "h.1.attn.c_proj", "h.1.attn.resid_dropout"
    ]
    assert "hidden_states: float[2, 8, 64] (static in the body: fixed by the call site at export)" in model.doc_string
    (data,) = read_case(only.path.parent)
    got = ort.InferenceSession(str(only.path), providers=["CPUExecutionProvider"]).run(None, data[0])
    np.testing.assert_allclose(got[0], data[1]["output_0"], atol=ATOL, rtol=RTOL)


def test_replace_unchanged_block_is_a_round_trip(exported, blocks, tmp_path):
    _, _, path = exported
    block = blocks.models[0].path
    same = replace(path, "GPT2Block", block, tmp_path / "class.onnx")
    assert same.call_names == ["h.0", "h.1"] and same.weights == []
    assert max(same.max_abs.values()) == 0.0
    assert tree_shape(tmp_path / "class.onnx") == tree_shape(path)
    def functions(p):
        return sorted(f.name for f in load_model_file(p).functions)

    assert functions(tmp_path / "class.onnx") == functions(path)

    # A block at another opset is converted to the model's.
    import onnx_ir as ir

    from onnx_modular.passes.export.opset_conversion import ConvertOpsetPass

    newer = ir.load(block)
    ConvertOpsetPass(21)(newer)
    ir.save(newer, tmp_path / "block21.onnx")
    converted = replace(path, "GPT2Block", tmp_path / "block21.onnx", tmp_path / "from21.onnx")
    assert max(converted.max_abs.values()) == 0.0
    assert {o.domain: o.version for o in onnx.load(tmp_path / "from21.onnx").opset_import}[""] == 18

    # One path: h.1 gets a function of its own; the same calls, classes and numbers.
    one = replace(path, "h.1", block, tmp_path / "h1.onnx")
    assert one.functions[0].endswith(":GPT2Block_2")  # numbered as the exporter numbers a class's functions
    assert max(one.max_abs.values()) <= 1e-6
    assert tree_shape(tmp_path / "h1.onnx") == tree_shape(path)


def test_external_data_and_unsorted_blocks(exported, tmp_path):
    """A source with external data: the call's weights are read from it; a block whose nodes are
    out of order is sorted."""
    torch_model, _, path = exported
    source = tmp_path / "ext" / "gpt2.onnx"
    source.parent.mkdir()
    onnx.save(onnx.load(path), source, save_as_external_data=True, location="gpt2.onnx.data", size_threshold=1024)
    result = extract(source, "h.0.mlp", tmp_path / "mlp", with_data=True)
    model = onnx.load(result.models[0].path)
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_array_equal(weights["c_fc.weight"], torch_model.h[0].mlp.c_fc.weight.detach().numpy())
    assert result.models[0].data_sets[0].max_abs == {"output": 0.0}

    shuffled = onnx.load(result.models[0].path)
    nodes = list(shuffled.graph.node)[::-1]
    del shuffled.graph.node[:]
    shuffled.graph.node.extend(nodes)
    onnx.save(shuffled, tmp_path / "shuffled.onnx")
    same = replace(source, "h.0.mlp", tmp_path / "shuffled.onnx", tmp_path / "new.onnx")
    assert max(same.max_abs.values()) == 0.0


def _scaled_mlp_block(source: pathlib.Path, destination: pathlib.Path) -> None:
    """The extracted GPT2Block with its MLP's output multiplied by 2."""
    model = onnx.load(source)
    (mlp,) = [n for n in model.graph.node if n.op_type == "GPT2MLP"]
    original = mlp.output[0]
    mlp.output[0] = original + ".unscaled"
    position = list(model.graph.node).index(mlp) + 1
    model.graph.node.insert(position, oh.make_node("Mul", [mlp.output[0], "two"], [original], name="scale_mlp"))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(2.0, np.float32), "two"))
    onnx.save(model, destination)


def test_edit_changes_the_output_only_through_the_replaced_calls(exported, blocks, tmp_path):
    _, args, path = exported
    block = tmp_path / "scaled.onnx"
    _scaled_mlp_block(blocks.models[0].path, block)
    feeds = {"input_ids": args[0].numpy()}
    original = load_model_file(path, load_external_data=True)
    before = capture(original, path, {"h.0": [0], "h.1": [0]}, feeds)

    one = replace(path, "h.1", block, tmp_path / "h1.onnx", inputs=feeds)
    assert one.weights == ["h.1.two"] and max(one.max_abs.values()) > 1e-2
    after = capture(load_model_file(tmp_path / "h1.onnx"), tmp_path / "h1.onnx", {"h.0": [0], "h.1": [0]}, feeds)
    np.testing.assert_array_equal(after["h.0"][1][0], before["h.0"][1][0])  # h.0 untouched
    np.testing.assert_array_equal(after["h.1"][0][0], before["h.1"][0][0])  # h.1 receives the same
    assert not np.allclose(after["h.1"][1][0], before["h.1"][1][0], atol=1e-2)
    # ... and returns what the edited block computes from that input with h.1's weights.
    inputs, _ = read_case(blocks.models[0].path.parent)[1]  # h.1's weights (and other inputs)
    inputs["hidden_states"] = before["h.1"][0][0]
    expected = ort.InferenceSession(str(block), providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    np.testing.assert_allclose(after["h.1"][1][0], expected, atol=ATOL, rtol=RTOL)

    every = replace(path, "GPT2Block", block, tmp_path / "class.onnx", inputs=feeds)
    assert every.weights == ["GPT2Block.two"]
    after = capture(load_model_file(tmp_path / "class.onnx"), tmp_path / "class.onnx", {"h.0": [0]}, feeds)
    assert not np.allclose(after["h.0"][1][0], before["h.0"][1][0], atol=1e-2)  # h.0 changes too
    assert max(every.max_abs.values()) != max(one.max_abs.values())


def test_bad_inputs_are_typed_errors_and_write_nothing(exported, blocks, tmp_path):
    _, _, path = exported
    with pytest.raises(InvalidInputError, match="closest names: GPT2Block"):
        extract(path, "GPT2Blok", tmp_path / "a")
    with pytest.raises(InvalidInputError, match="h.1.attn"):
        extract(path, "h.1.atn", tmp_path / "a")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(InvalidInputError, match="exists and is not empty"):
        extract(path, "GPT2Block", full)
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    assert not (tmp_path / "a").exists()

    # A call of a function the file no longer holds.
    broken = onnx.load(path)
    kept = [f for f in broken.functions if f.name != "GPT2MLP"]
    del broken.functions[:]
    broken.functions.extend(kept)
    onnx.save(broken, tmp_path / "broken.onnx")
    with pytest.raises(InvalidModelFileError, match="GPT2MLP"):
        extract(tmp_path / "broken.onnx", "h.0.mlp", tmp_path / "b")

    block = blocks.models[0].path
    new = tmp_path / "new.onnx"
    wrong = onnx.load(block)
    wrong.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    onnx.save(wrong, tmp_path / "wrong.onnx")
    with pytest.raises(InvalidInputError, match="its output 'output' is FLOAT16, rank 3; GPT2Block returns FLOAT, rank 3"):
        replace(path, "GPT2Block", tmp_path / "wrong.onnx", new)
    wrong = onnx.load(block)
    wrong.graph.input[0].name = "x"
    onnx.save(wrong, tmp_path / "renamed.onnx")
    with pytest.raises(InvalidInputError, match="its input 'x' is not an input of GPT2Block"):
        replace(path, "h.0", tmp_path / "renamed.onnx", new)

    with pytest.raises(InvalidInputError, match="calls GPT2MLP itself"):  # a GPT2Block block fits GPT2MLP's names
        replace(path, "GPT2MLP", block, new)

    cyclic = onnx.load(block)
    first, last = cyclic.graph.node[0], cyclic.graph.node[len(cyclic.graph.node) - 1]
    first.input[0] = last.output[0]  # the first node reads the block's output
    onnx.save(cyclic, tmp_path / "cyclic.onnx")
    with pytest.raises(InvalidModelFileError, match="its nodes form a cycle"):  # refused as the block file is read
        replace(path, "GPT2Block", tmp_path / "cyclic.onnx", new)

    old = onnx.load(block)
    for entry in old.opset_import:
        if entry.domain == "":
            entry.version = 7
    onnx.save(old, tmp_path / "old.onnx")
    with pytest.raises(InvalidInputError, match="opset 7"):
        replace(path, "GPT2Block", tmp_path / "old.onnx", new)
    assert not new.exists()


def test_cli_extract_and_replace(exported, tmp_path):
    _, args, path = exported
    np.savez(tmp_path / "x.npz", input_ids=args[0].numpy())

    def run(*argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in argv])
        return code, out.getvalue(), err.getvalue()

    code, out, err = run("extract", path, "h.0.mlp", "-o", tmp_path / "mlp", "--with-data", "--inputs", tmp_path / "x.npz")
    assert code == 0, err
    assert "test_data_set_0: call h.0.mlp, max abs difference 0" in out
    block = tmp_path / "mlp" / "h.0.mlp" / "model.onnx"
    code, out, err = run("replace", path, "h.0.mlp", block, "-o", tmp_path / "new.onnx")
    assert code == 0, err
    assert "max abs difference 0" in out
    code, _, err = run("extract", path, "GPT2Blok", "-o", tmp_path / "x")
    assert code == 2 and "closest names: GPT2Block" in err


NOISY = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
noisy (float[2, 3] x) => (float[2, 3] y) {
    y = pkg.test.Noise (x)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Noise (x) => (y) {
    r = RandomUniformLike (x)
    y = Add (x, r)
}
"""


def test_data_the_extracted_model_cannot_reproduce_is_a_typed_error(tmp_path):
    """A body that draws random numbers gives other outputs on every run: the check at extraction
    catches it, and nothing is written (a file of another tool: no torch, no metadata)."""
    from onnx_modular.errors import ParityError

    noisy = onnx.parser.parse_model(NOISY)
    noisy.graph.node[0].name = "noise"
    onnx.save(noisy, tmp_path / "noisy.onnx")
    with pytest.raises(ParityError, match="does not reproduce the output 'y' of the call noise") as error:
        extract(tmp_path / "noisy.onnx", "Noise", tmp_path / "out", with_data=True)
    assert error.value.module_path == "noise"
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["noisy.onnx"]  # no temporary folder left
    result = extract(tmp_path / "noisy.onnx", "noise", tmp_path / "out")  # without data: the model alone
    model = onnx.load(result.models[0].path)
    assert [n.op_type for n in model.graph.node] == ["RandomUniformLike", "Add"]
    assert [v.name for v in model.graph.input] == ["x"] and not model.graph.initializer


def test_a_class_with_several_functions(exported, tmp_path):
    """Conv1D has four functions (the shapes differ): four models, each with its two calls' data;
    the values of calls made inside bodies of calls only (GPT2MLP) are captured too. One block for
    the whole class fits only the function it came from: a typed error, nothing written."""
    _, _, path = exported
    result = extract(path, "Conv1D", tmp_path / "conv", with_data=True)
    assert [m.path.parent.name for m in result.models] == ["Conv1D", "Conv1D_2", "Conv1D_3", "Conv1D_4"]
    assert [m.call_names for m in result.models][2] == ["h.0.mlp.c_fc", "h.1.mlp.c_fc"]
    assert all(len(m.data_sets) == 2 and max(d.max_abs["output"] for d in m.data_sets) <= ATOL for m in result.models)
    # the block's fixed dims contradict Conv1D_2's declared ones: refused before anything is built
    with pytest.raises(InvalidInputError, match=r"does not fit Conv1D_2: 'weight' declares dimension 1 as 192"):
        replace(path, "Conv1D", result.models[0].path, tmp_path / "new.onnx")
    assert not (tmp_path / "new.onnx").exists()
    same = replace(path, "Conv1D_3", result.models[2].path, tmp_path / "new.onnx")
    assert same.call_names == ["h.0.mlp.c_fc", "h.1.mlp.c_fc"] and max(same.max_abs.values()) == 0.0
