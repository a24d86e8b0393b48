"""Modular and flat files beyond onnxruntime (docs/compatibility.md is measured by these tests).

Four small models (one with a KV cache) are exported once with ``flat_file=True``; both files
are run in onnx's ``ReferenceEvaluator`` and in OpenVINO (``pip install openvino``, f32
inference precision) and compared with onnxruntime on the modular file. OpenVINO's ONNX front end does not expand
model-local functions: the modular file is refused, the flat copy runs. The flat copy's nodes
carry the namespace of their own call, which Model Explorer's ONNX adapter nests by.
"""

from __future__ import annotations

import json
import os

import models
import numpy as np
import onnx
import onnx.inliner
import onnx.parser
import onnx.reference
import pytest

from onnx_modular import export_modular
from onnx_modular.calls.flat import inline_model
from onnx_modular.capture.tensors import flatten_inputs
from onnx_modular.errors import InvalidInputError, SaveError
from onnx_modular.files.inline import inline_file
from onnx_modular.format import metadata
from onnx_modular.passes.function_order import is_callee_first
from onnx_modular.runtime import sessions as runtime
from onnx_modular.storage import save

# ReferenceEvaluator and OpenVINO (f32) against onnxruntime: measured <= 8.4e-7 on these models.
ATOL, RTOL = 1e-5, 1e-4
MODELS = ["gpt2", "llama", "resnet", "llama_kv"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (modular path, flat path, feeds, onnxruntime outputs of the modular file, result)."""
    folder = tmp_path_factory.mktemp("compat")
    made = {}
    for name in MODELS:
        model, args, kwargs = getattr(models, name)()
        result = export_modular(model, args, folder / f"{name}.onnx", kwargs=kwargs, flat_file=True)
        inputs = [v.name for v in onnx.load(str(result.path), load_external_data=False).graph.input]
        feeds = {key: tensor.numpy() for key, tensor in zip(inputs, flatten_inputs(args, kwargs))}
        _, expected = runtime.run(result.path, feeds)
        made[name] = (result.path, result.flat_path, feeds, expected, result)
    return made


def _close(actual, expected) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, atol=ATOL, rtol=RTOL)


# -- the files -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_both_files_are_written_verified_and_functions_stored_callee_first(exported, name):
    path, flat_path, _, _, result = exported[name]
    assert flat_path == path.with_name(f"{name}.flat.onnx") and flat_path.is_file()
    assert result.report.ok and result.flat_report.ok
    assert result.flat_report.outputs[0].modular_max_abs <= 1e-5  # the flat copy against PyTorch
    modular, flat = onnx.load(str(path)), onnx.load(str(flat_path))
    assert len(modular.functions) >= 3 and is_callee_first(modular)
    assert not flat.functions and not any(n.domain.startswith("pkg.") for n in flat.graph.node)
    onnx.checker.check_model(str(flat_path), full_check=True)


def test_inline_of_selected_functions_stays_callee_first(exported, tmp_path):
    path = exported["gpt2"][0]
    kept = inline_file(path, tmp_path / "noattn.onnx", only=["Conv1D", "Conv1D_2", "Conv1D_3", "Conv1D_4"])
    assert {f.name for f in kept.functions} >= {"GPT2Block", "GPT2Attention"}
    assert is_callee_first(onnx.load(str(tmp_path / "noattn.onnx")))


# -- onnx's reference evaluator and OpenVINO -----------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("which", ["modular", "flat"])
def test_reference_evaluator_runs_both_files(exported, name, which):
    path, flat_path, feeds, expected, _ = exported[name]
    evaluator = onnx.reference.ReferenceEvaluator(str(path if which == "modular" else flat_path))
    _close(evaluator.run(None, feeds), expected)


@pytest.mark.parametrize("name", MODELS)
def test_openvino_runs_the_flat_file_and_refuses_the_modular_one(exported, name):
    import openvino as ov  # in the test extra: CI runs both files in it
    path, flat_path, feeds, expected, _ = exported[name]
    core = ov.Core()
    compiled = core.compile_model(core.read_model(str(flat_path)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    outputs = compiled(feeds)
    _close([outputs[output] for output in compiled.outputs], expected)
    with pytest.raises(RuntimeError, match="pkg\\."):  # "No conversion rule found for operations: pkg.torch..."
        core.read_model(str(path))


# -- metadata of the flat copy (Model Explorer) ------------------------------------------------


def _namespace_layer(node: onnx.NodeProto, depth: int = 1) -> str | None:
    namespace = metadata.props(node).get(metadata.NAMESPACE)
    segments = namespace.split("/") if namespace else []
    return segments[depth].split(": ")[0] if len(segments) > depth else None


def test_flat_nodes_carry_their_own_call_in_namespace_and_module_path(exported):
    path, flat_path, _, _, _ = exported["gpt2"]
    flat = onnx.load(str(flat_path), load_external_data=False)
    layers = [_namespace_layer(node) for node in flat.graph.node]
    assert layers.count("h.0") == layers.count("h.1") > 20
    for node in flat.graph.node:
        props = metadata.props(node)
        layer = _namespace_layer(node)
        if layer in ("h.0", "h.1"):
            # onnx_modular's keys of the innermost call, resolved for this call
            assert props[metadata.MODULE_PATH].split(".")[:2] == layer.split(".")
            assert props[metadata.PACKAGE] in ("torch", "transformers")
            if "pkg.torch.onnx.name_scopes" in props:  # torch's list follows the namespace segment by segment
                scopes = eval(props["pkg.torch.onnx.name_scopes"])
                assert scopes == [s.split(": ")[0] for s in props[metadata.NAMESPACE].split("/")]
    # onnx.inliner alone labels both blocks' nodes h.0 (the body was recorded for the first call)
    plain = onnx.inliner.inline_local_functions(onnx.load(str(path), load_external_data=False))
    assert [_namespace_layer(node) for node in plain.graph.node].count("h.1") == 0


def test_model_explorer_nests_the_flat_copy_by_call(exported):
    from model_explorer_onnx import main as adapter  # in the test extra
    _, flat_path, _, _, _ = exported["gpt2"]
    graphs = adapter.ONNXAdapter().convert(str(flat_path), {})["graphs"]
    assert len(graphs) == 1  # no function graphs: one nested view
    layers = [node.namespace.split("/")[2].split(": ")[0] for node in graphs[0].nodes if node.namespace.count("/") >= 2]
    assert layers.count("h.0") == layers.count("h.1") > 20


def _block_model() -> onnx.ModelProto:
    """Two calls of one Block (recorded for h.0) calling Act; hand-made, no torch."""
    model = onnx.parser.parse_model("""
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[2] x) => (float[2] y) { a = pkg.test.Block(x)  y = pkg.test.Block(a) }
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Block (h) => (o) { t = pkg.test.Act(h)  o = Neg(t)  }
<domain: "pkg.test", opset_import: ["" : 18]>
Act (u) => (v) { v = Relu(u) }
""")
    block, act = model.functions
    block.metadata_props.add(key=metadata.MODULE_PATHS, value=json.dumps(["h.0", "h.1"]))
    act.metadata_props.add(key=metadata.MODULE_PATHS, value=json.dumps(["h.0.act", "h.1.act"]))
    for node, path in zip(model.graph.node, ("h.0", "h.1")):
        node.name = path
        node.metadata_props.add(key=metadata.NAMESPACE, value=f": M/{path}: Block")
        node.metadata_props.add(key=metadata.MODULE_PATH, value=path)
        node.metadata_props.add(key=metadata.CLASS, value="test.Block")
    call, neg = block.node
    call.name = "act"
    call.metadata_props.add(key=metadata.NAMESPACE, value=": M/h.0: Block/h.0.act: Act")
    call.metadata_props.add(key=metadata.MODULE_PATH, value="h.0.act")
    call.metadata_props.add(key=metadata.CLASS, value="test.Act")
    neg.metadata_props.add(key=metadata.NAMESPACE, value=": M/h.0: Block/neg: aten.neg")
    act.node[0].metadata_props.add(key=metadata.NAMESPACE, value=": M/h.0: Block/h.0.act: Act/relu: aten.relu")
    return model


def test_inline_model_rebases_namespaces_per_call_without_torch():
    flat = inline_model(_block_model())
    labelled = [(n.op_type, metadata.props(n)[metadata.NAMESPACE], metadata.props(n)[metadata.MODULE_PATH]) for n in flat.graph.node]
    assert labelled == [
        ("Relu", ": M/h.0: Block/h.0.act: Act/relu: aten.relu", "h.0.act"),
        ("Neg", ": M/h.0: Block/neg: aten.neg", "h.0"),
        ("Relu", ": M/h.1: Block/h.1.act: Act/relu: aten.relu", "h.1.act"),
        ("Neg", ": M/h.1: Block/neg: aten.neg", "h.1"),
    ]
    x = np.array([-1.0, 2.0], np.float32)
    _close(onnx.reference.ReferenceEvaluator(flat).run(None, {"x": x}), [-np.maximum(-np.maximum(x, 0), 0)])


# -- the option and the paired write ---------------------------------------------------------------


def test_flat_file_option_errors_come_before_the_export(tmp_path):
    model, args, _ = models.resnet()
    with pytest.raises(InvalidInputError, match="no file f"):
        export_modular(model, args, flat_file=True)
    with pytest.raises(InvalidInputError, match="own path"):
        export_modular(model, args, tmp_path / "m.onnx", flat_file=tmp_path / "m.onnx")
    with pytest.raises(InvalidInputError, match="streaming"):
        export_modular(model, args, tmp_path / "m.onnx", flat_file=True, weights=model.state_dict())
    with pytest.raises(SaveError, match="does not exist"):
        export_modular(model, args, tmp_path / "m.onnx", flat_file=tmp_path / "missing" / "m.flat.onnx")
    assert os.listdir(tmp_path) == []


def test_atomic_writes_puts_back_the_first_file_when_the_second_cannot_be_moved(tmp_path):
    first, second = tmp_path / "m.onnx", tmp_path / "m.flat.onnx"
    first.write_bytes(b"old model")
    with pytest.raises(SaveError, match="Moving"):
        with save.atomic_writes([first, second]) as (a, b):
            a.model_path.write_bytes(b"new model")
            b.model_path.write_bytes(b"new flat")
            second.mkdir()  # the second move now fails (a non-empty folder is in the way)
            (second / "keep").write_bytes(b"")
    assert first.read_bytes() == b"old model"
    assert sorted(os.listdir(tmp_path)) == ["m.flat.onnx", "m.onnx"]  # no temporary folder, no lock left
    with save.atomic_writes([first, tmp_path / "ok.flat.onnx"]) as (a, b):
        a.model_path.write_bytes(b"new model")
        b.model_path.write_bytes(b"new flat")
    assert first.read_bytes() == b"new model" and (tmp_path / "ok.flat.onnx").read_bytes() == b"new flat"


def test_cli_flat_file_writes_and_reports_both_files(tmp_path, capsys):
    from onnx_modular.cli import main

    code = main(["export", "models:resnet", "-o", str(tmp_path / "r.onnx"), "--flat-file", "--json", "-"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["ok"]
    assert summary["flat_path"] == str(tmp_path / "r.flat.onnx") and summary["flat_report"]["ok"]
    assert not onnx.load(summary["flat_path"]).functions
