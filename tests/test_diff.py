"""``diff`` (onnx_modular.files.diff.tool) on a real 2-layer GPT-2: two exports, an edited MLP put back
with ``replace``, a planted precision loss, external data, the command line and bad input.

Module-scoped files: one GPT-2 exported twice, its edit and its planted copy; each test reads them.
"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper
import pytest
import torch
from helpers import DOMAIN_TRANSFORMERS
from models import gpt2

from onnx_modular import diff, export_modular
from onnx_modular.cli import main
from onnx_modular.errors import InvalidInputError, InvalidModelFileError
from onnx_modular.files import function_tree, load_model_file
from onnx_modular.files.diff.tool import tensor_digest
from onnx_modular.files.extract import extract
from onnx_modular.files.inline import inline_file
from onnx_modular.files.replace import replace
from onnx_modular.format import metadata

PLANTED = "h.1.attn.c_attn"  # the module whose weights lose precision in the planted copy


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("diff")
    model, args, _ = gpt2(n_layer=2)
    export_modular(model, args, folder / "gpt2.onnx")
    export_modular(model, args, folder / "again.onnx")  # the same model exported a second time
    # The MLP of block 1 extracted, its output doubled, and put back as h.1.mlp's own body.
    block = extract(folder / "gpt2.onnx", "h.1.mlp", folder / "mlp").models[0].path
    edited = onnx.load(block)
    out = edited.graph.output[0].name
    (last,) = [node for node in edited.graph.node if out in node.output]
    last.output[list(last.output).index(out)] = out + ".unscaled"
    edited.graph.node.append(oh.make_node("Mul", [out + ".unscaled", "two"], [out], name="scale"))
    edited.graph.initializer.append(onnx.numpy_helper.from_array(np.array(2.0, np.float32), "two"))
    onnx.save(edited, folder / "mlp_edited.onnx")
    replace(folder / "gpt2.onnx", "h.1.mlp", folder / "mlp_edited.onnx", folder / "edited.onnx")
    # A precision loss planted in one module: its weight rounded to float16 and back.
    planted = onnx.load(folder / "gpt2.onnx")
    (weight,) = [t for t in planted.graph.initializer if t.name == PLANTED + ".weight"]
    rounded = onnx.numpy_helper.to_array(weight).astype(np.float16).astype(np.float32)
    weight.CopyFrom(onnx.numpy_helper.from_array(rounded, weight.name))
    onnx.save(planted, folder / "planted.onnx")
    # A float16 copy: every weight at float16's precision, and a coarser loss planted in one module
    # (its weight keeps 3 of float16's 10 mantissa bits).
    half = onnx.load(folder / "gpt2.onnx")
    for tensor in half.graph.initializer:
        if tensor.name.endswith((".weight", ".bias")):
            values = onnx.numpy_helper.to_array(tensor).astype(np.float16)
            if tensor.name == PLANTED + ".weight":
                values = (values.view(np.uint16) & np.uint16(0xFF80)).view(np.float16)
            tensor.CopyFrom(onnx.numpy_helper.from_array(values.astype(np.float32), tensor.name))
    onnx.save(half, folder / "half.onnx")
    return folder


def test_two_exports_of_the_same_model_are_the_same(files):
    result = diff(files / "gpt2.onnx", files / "again.onnx")
    calls = result.calls()
    expected = [c.call_name for c in function_tree(load_model_file(files / "gpt2.onnx")).walk() if not c.is_root]
    assert [c.path for c in calls] == expected  # every call of the tree, in its order
    assert all(c.change == "same" for c in result.root.walk())
    compared = [c for c in calls if c.max_abs is not None]
    assert len(compared) == sum(1 for c in calls if c.a.function is not None) > 20
    assert all(c.max_abs == 0.0 and c.max_rel == 0.0 for c in compared)
    assert result.root.max_abs == 0.0
    assert result.first_drift is None and result.ranked() == []
    assert not result.differs


def test_another_package_version_with_the_same_bodies_is_the_same(files, tmp_path):
    """Two exports by two versions of transformers (the domain and version renamed): same, drift 0,
    the versions said."""
    model = onnx.load(files / "gpt2.onnx")
    old, new = DOMAIN_TRANSFORMERS, "pkg.transformers.99.0.0"
    nodes = [*model.graph.node, *(node for function in model.functions for node in function.node)]
    opsets = [*model.opset_import, *(opset for function in model.functions for opset in function.opset_import)]
    for item in [*nodes, *opsets, *model.functions]:
        item.domain = new if item.domain == old else item.domain
    for function in model.functions:
        for entry in function.metadata_props:
            if entry.key == metadata.PACKAGE_VERSION and function.domain == new:
                entry.value = "99.0.0"
    onnx.save(model, tmp_path / "later.onnx")
    result = diff(files / "gpt2.onnx", tmp_path / "later.onnx")
    assert not result.differs and result.root.max_abs == 0.0
    assert result["h.0"].function_b == new + ":GPT2Block" and result["h.0"].function_a == old + ":GPT2Block"
    assert result.versions() == {"transformers": (old.removeprefix("pkg.transformers."), "99.0.0")}
    assert "classes from other package versions: transformers" in result.format()


def test_edited_mlp_is_changed_its_callers_only_below(files):
    result = diff(files / "gpt2.onnx", files / "edited.onnx")
    mlp = result["h.1.mlp"]
    assert (mlp.change, mlp.changed_in) == ("changed", "own")
    assert "nodes added: 1 Mul" in mlp.what and "weights read 0 -> 1" in mlp.what
    assert mlp.function_a.endswith(":GPT2MLP") and mlp.function_b.endswith(":GPT2MLP_2")
    assert mlp.max_abs > 1e-3
    for above in (result["h.1"], result.root):  # changed only in structure below them
        assert (above.change, above.changed_in) == ("changed", "below")
        assert not any(text.startswith(("nodes", "weight", "attributes", "opset")) for text in above.what)
    assert "calls below changed: h.1.mlp" in result["h.1"].what
    for call in result.calls():
        if call.path.startswith("h.0") or call.path in ("wte", "wpe", "drop"):
            assert call.change == "same" and call.max_abs in (0.0, None), call.path
    for inside in ("h.1.mlp.c_fc", "h.1.mlp.act", "h.1.mlp.c_proj", "h.1.ln_1", "h.1.attn"):  # before the edit
        assert result[inside].change == "same" and result[inside].max_abs == 0.0
    assert result["ln_f"].change == "same" and result["ln_f"].max_abs > 0  # same module, fed the drift
    assert result.first_drift is mlp and result.ranked()[0] is mlp
    assert result.counts() == {"same": 26, "changed": 1, "changed below": 1, "added": 0, "removed": 0}
    assert result.differs


def test_planted_precision_loss_is_ranked_first(files):
    result = diff(files / "gpt2.onnx", files / "planted.onnx")
    planted = result[PLANTED]
    assert (planted.change, planted.changed_in) == ("changed", "own")
    assert planted.what == [f"weight values: {PLANTED}.weight"]
    assert result.ranked()[0] is planted and planted.added_drift == planted.scaled_drift > 0
    assert result.first_drift is planted
    later = [c for c in result.calls() if c.order is not None and c.order > planted.order and c.max_abs]
    assert len(later) > 5  # the drift travels on; the ranking still names where it was made
    assert all(c.max_abs == 0.0 for c in result.calls() if c.order is not None and c.order < planted.order)


def test_float16_copy_ranking_names_the_planted_module(files):
    """Every call of a float16 copy drifts; the calls ranked by the drift they add name the module
    where more precision was lost, though the drift appears first elsewhere."""
    result = diff(files / "gpt2.onnx", files / "half.onnx")
    changed = {c.path for c in result.calls() if c.changed_in == "own"}
    assert {"wte", "wpe", "h.0.attn.c_attn", PLANTED, "h.1.mlp.c_proj"} <= changed  # LayerNorms: 1s and 0s
    assert all(c.what[0].startswith("weight values: ") for c in result.calls() if c.changed_in == "own")
    assert all(c.max_abs > 0 for c in result.calls() if c.max_abs is not None)
    assert result.first_drift.path == "wte"  # the first call, at float16's precision
    ranked = result.ranked()
    assert ranked[0].path == PLANTED
    assert ranked[0].added_drift > 10 * max(c.added_drift for c in ranked if not c.path.startswith("h.1.attn"))
    assert "1. " + PLANTED in result.format()


def test_float_inputs_are_cast_for_a_copy_that_takes_float16(tmp_path):
    """A copy whose input is float16 (cast back inside) gets the same values cast to float16."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    export_modular(model, (torch.randn(2, 8),), tmp_path / "small.onnx")
    half = onnx.load(tmp_path / "small.onnx")
    name = half.graph.input[0].name
    half.graph.input[0].type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    for node in half.graph.node:
        node.input[:] = [name + ".float" if value == name else value for value in node.input]
    half.graph.node.insert(0, oh.make_node("Cast", [name], [name + ".float"], to=onnx.TensorProto.FLOAT))
    onnx.save(half, tmp_path / "half_input.onnx")
    result = diff(tmp_path / "small.onnx", tmp_path / "half_input.onnx")
    assert result.cast == {name: "float16"} and result.inputs[name]["dtype"] == "float32"
    assert result.root.changed_in == "own" and result.root.what == ["nodes added: 1 Cast"]
    assert [c.change for c in result.calls()] == ["same"] * 3
    assert result.first_drift.path == "0" and 0 < result["0"].max_abs < 1e-2  # float16's rounding of x
    assert f"cast for B: {name} to float16" in result.format()


def test_external_data_is_hashed_in_place(files, tmp_path):
    """Weights in external data are hashed from their byte range, as inline ones are."""
    for name in ("gpt2", "planted"):
        onnx.save(onnx.load(files / f"{name}.onnx"), tmp_path / f"{name}.onnx", save_as_external_data=True,
                  location=f"{name}.onnx.data", size_threshold=1024)
    same = diff(files / "gpt2.onnx", tmp_path / "gpt2.onnx")
    assert not same.differs
    changed = diff(tmp_path / "gpt2.onnx", tmp_path / "planted.onnx")
    assert [c.path for c in changed.calls() if c.changed_in == "own"] == [PLANTED]
    assert changed.ranked()[0].path == PLANTED
    inline = {t.name: t for t in onnx.load(files / "gpt2.onnx").graph.initializer}
    external = onnx.load(tmp_path / "gpt2.onnx", load_external_data=False)
    (tensor,) = [t for t in external.graph.initializer if t.name == "h.0.mlp.c_fc.weight"]
    assert onnx.external_data_helper.uses_external_data(tensor)
    assert tensor_digest(tensor, tmp_path) == tensor_digest(inline[tensor.name], files)


def test_attribute_and_opset_changes_in_shared_bodies(files, tmp_path):
    """An attribute changed in GPT2Attention's one body, GPT2Block's opset raised: both calls of
    each changed, with what."""
    model = onnx.load(files / "gpt2.onnx")
    (attention,) = [f for f in model.functions if f.name == "GPT2Attention"]
    (softmax,) = [n for n in attention.node if n.op_type == "Softmax"]
    (axis,) = [a for a in softmax.attribute if a.name == "axis"]
    axis.i = -2
    (block,) = [f for f in model.functions if f.name == "GPT2Block"]
    (default,) = [o for o in block.opset_import if o.domain == ""]
    default.version += 1  # its own nodes (the residual Adds) now read at the next opset
    onnx.save(model, tmp_path / "axis.onnx")
    result = diff(files / "gpt2.onnx", tmp_path / "axis.onnx", numerics=False)
    own = [c.path for c in result.calls() if c.changed_in == "own"]
    assert own == ["h.0", "h.0.attn", "h.1", "h.1.attn"]
    assert result["h.0.attn"].what == ["attributes of Softmax"]
    assert result["h.1"].what == [f"opset ai.onnx {default.version - 1} -> {default.version}",
                                  "calls below changed: h.1.attn"]
    assert result.root.max_abs is None and result.inputs == {}


def test_profile_times_each_call_in_both(files):
    result = diff(files / "gpt2.onnx", files / "again.onnx", profile=True, runs=2)
    timed = [c for c in result.calls() if c.time_a_us and c.time_b_us]
    assert {"h.0", "h.1", "h.0.attn"} <= {c.path for c in timed}
    assert all(c.time_ratio == c.time_b_us / c.time_a_us for c in timed)
    assert result.root.time_a_us >= result["h.0"].time_a_us
    assert result.settings["runs"] == 2 and result.settings["rounds"] == 2 and result.settings["threads"] == 1
    assert "B/A" in result.format()


def test_added_and_removed_calls_and_escaped_views(files, tmp_path):
    """A call whose class differs is removed from A and added in B; names are escaped everywhere."""
    model = onnx.load(files / "gpt2.onnx")
    (function,) = [f for f in model.functions if f.name == "NewGELUActivation"]
    for entry in function.metadata_props:
        if entry.key == metadata.CLASS:
            entry.value = "<b>Gelu</b>\x1b[31m"
    onnx.save(model, tmp_path / "renamed.onnx")
    result = diff(files / "gpt2.onnx", tmp_path / "renamed.onnx")
    mlp = result["h.0.mlp"]
    verdicts = [(c.path, c.change) for c in mlp.children]
    assert ("h.0.mlp.act", "removed") in verdicts and ("h.0.mlp.act", "added") in verdicts
    assert mlp.changed_in == "own"  # it calls another class now
    page = result.html()
    assert "&lt;b&gt;Gelu&lt;/b&gt;\\x1b[31m" in page
    assert "<b>Gelu" not in page and "<script" not in page and "\x1b" not in page
    assert "\x1b" not in result.format() and "\\x1b[31m" in result.format()
    records = json.loads(result.to_json())
    assert {r["change"] for r in records} == {"same", "changed", "added", "removed"}


def test_flat_copies_are_compared_by_module_metadata(files, tmp_path):
    """Files without functions (flat copies, their nodes labelled by module) are compared by module."""
    inline_file(files / "gpt2.onnx", tmp_path / "flat.onnx")
    inline_file(files / "edited.onnx", tmp_path / "edited_flat.onnx")
    same = diff(files / "gpt2.onnx", tmp_path / "flat.onnx")  # a modular file against its flat copy
    assert same.by_module and not same.differs and same.root.max_abs == 0.0
    paths = {c.path for c in same.calls()}
    assert {"h.0", "h.0.mlp", "h.0.mlp.c_fc", "h.1.attn.c_attn", "ln_f"} <= paths  # h.0.mlp has no nodes of its own
    result = diff(tmp_path / "flat.onnx", tmp_path / "edited_flat.onnx")
    assert result.by_module and result.note
    mlp = result["h.1.mlp"]
    assert (mlp.change, mlp.changed_in) == ("changed", "own") and "nodes added: 1 Mul" in mlp.what
    assert [c.path for c in result.calls() if c.change != "same"] == ["h.1", "h.1.mlp"]
    assert result["h.1"].changed_in == "below" and result["h.0.mlp"].change == "same"
    assert result.root.max_abs > 1e-3 and all(c.max_abs is None for c in result.calls())
    planted = diff(tmp_path / "flat.onnx", files / "planted.onnx")
    assert [c.path for c in planted.calls() if c.changed_in == "own"] == [PLANTED]
    assert "modules: " in planted.format() and "calls' outputs not compared" in planted.format()


def _cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["diff", *map(str, argv)])
    return code, out.getvalue(), err.getvalue()


def test_cli_exit_codes_json_and_html(files, tmp_path):
    code, out, _ = _cli(files / "gpt2.onnx", files / "again.onnx", "--depth", "1")
    assert code == 0 and "verdict: no difference" in out and "h.0.attn" not in out
    np.savez(tmp_path / "x.npz", input_ids=np.arange(16, dtype=np.int64).reshape(2, 8) % 100)
    code, out, err = _cli(files / "gpt2.onnx", files / "edited.onnx", "--inputs", tmp_path / "x.npz",
                          "--json", tmp_path / "d.json", "--html", tmp_path / "d.html")
    assert code == 1 and "first drift at h.1.mlp" in out and "(random" not in out
    assert "Wrote" in err
    records = json.loads((tmp_path / "d.json").read_text())
    assert isinstance(records, list) and records[0]["path"] == "" and records[0]["added_drift"] == 0.0  # ln_f's
    mlp = next(r for r in records if r["path"] == "h.1.mlp")
    assert {"path", "class", "change", "max_abs", "max_rel", "time_a_ms", "time_b_ms", "time_ratio"} <= set(mlp)
    assert mlp["change"] == "changed" and mlp["class"].endswith("GPT2MLP") and mlp["max_abs"] > 0
    assert mlp["added_drift"] == mlp["scaled_drift"] > 0 and mlp["first_drift"] is True
    page = (tmp_path / "d.html").read_text()
    assert page.count("GPT2MLP_2") >= 1 and "A: call" in page and "B: call" in page
    code, out, _ = _cli(files / "gpt2.onnx", files / "planted.onnx", "--json", "-", "--structure-only")
    assert code == 1 and json.loads(out)[0]["max_abs"] is None


def test_bad_input_is_typed_and_exits_2(files, tmp_path):
    (tmp_path / "notes.onnx").write_text("not a model")
    with pytest.raises(InvalidModelFileError, match="not an ONNX model file"):
        diff(files / "gpt2.onnx", tmp_path / "notes.onnx")
    flat = oh.make_model(
        oh.make_graph([oh.make_node("Relu", ["x"], ["y"])], "g",
                      [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                      [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])]),
        opset_imports=[oh.make_opsetid("", 18)],
    )
    onnx.save(flat, tmp_path / "flat.onnx")
    with pytest.raises(InvalidInputError, match="no local functions, and its nodes carry no module paths") as error:
        diff(files / "gpt2.onnx", tmp_path / "flat.onnx")
    assert error.value.hint
    renamed = onnx.load(files / "gpt2.onnx")
    renamed.graph.input[0].name = "ids"
    for node in renamed.graph.node:
        node.input[:] = ["ids" if name == "input_ids" else name for name in node.input]
    onnx.save(renamed, tmp_path / "renamed.onnx")
    with pytest.raises(InvalidInputError, match=r"only .*gpt2.onnx' takes \['input_ids'\].*takes \['ids'\]"):
        diff(files / "gpt2.onnx", tmp_path / "renamed.onnx")
    retyped = onnx.load(files / "gpt2.onnx")
    retyped.graph.input[0].type.tensor_type.elem_type = onnx.TensorProto.INT32
    onnx.save(retyped, tmp_path / "retyped.onnx")
    with pytest.raises(InvalidInputError, match="input 'input_ids' differs.*int64.*int32"):
        diff(files / "gpt2.onnx", tmp_path / "retyped.onnx")
    np.savez(tmp_path / "wrong.npz", tokens=np.zeros((2, 8), np.int64))
    with pytest.raises(InvalidInputError, match="missing"):
        diff(files / "gpt2.onnx", files / "again.onnx", inputs=tmp_path / "wrong.npz")
    assert _cli(files / "gpt2.onnx", tmp_path / "flat.onnx")[0] == 2
    code, _, err = _cli(files / "gpt2.onnx", tmp_path / "renamed.onnx", "--html", tmp_path / "never.html")
    assert code == 2 and "error:" in err and not (tmp_path / "never.html").exists()


class _GatedConv(torch.nn.Module):
    """Wav2Vec2-BERT's convolution module in small: a GLU whose output a Pad reads."""

    def __init__(self):
        super().__init__()
        self.pointwise = torch.nn.Conv1d(4, 8, 1)
        self.glu = torch.nn.GLU(dim=1)
        self.depthwise = torch.nn.Conv1d(4, 4, 3, groups=4)

    def forward(self, x):
        return self.depthwise(torch.nn.functional.pad(self.glu(self.pointwise(x)), (2, 0)))


def test_call_outputs_of_a_call_whose_output_a_later_node_reads(tmp_path):
    """onnxruntime's EliminateIdentity would drop the probe on the GLU's output (read by the Pad too) and
    leave the Pad without its input: the instrumented copy keeps its probes and runs."""
    from onnx_modular.calls.capture import call_outputs

    model = torch.nn.Sequential(_GatedConv(), _GatedConv()).eval()
    x = torch.randn(2, 4, 16)
    export_modular(model, (x,), tmp_path / "gated.onnx")
    outputs, calls = call_outputs(onnx.load(tmp_path / "gated.onnx"), [x.numpy()])
    with torch.no_grad():
        np.testing.assert_allclose(next(iter(outputs.values())), model(x).numpy(), atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(_calls_by(calls)["0.glu"][0], model[0].glu(model[0].pointwise(x)).numpy(), atol=1e-5)
    assert diff(tmp_path / "gated.onnx", tmp_path / "gated.onnx").root.change == "same"


def _calls_by(calls):
    return {c.call_name: c.outputs for c in calls}
