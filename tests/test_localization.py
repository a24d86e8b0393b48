"""Per-module parity finds planted faults, and reports none on correct models.

Faults are planted in the saved ONNX file (the PyTorch model is untouched): a weight
scaled by 1.5 for one call, or a constant changed inside a shared function body.
Tolerances are the per-dtype defaults (float32 atol=1e-4 rtol=1e-3; float16 1e-2).
"""

from __future__ import annotations

import json

import models
import numpy as np
import onnx_ir as ir
import pytest
import torch
from helpers import expanded_calls

from onnx_modular import ExecutionProviderError, export_modular, localize, verify
from onnx_modular.format import metadata


def plant_weight_fault(source, destination, initializer: str, factor: float = 1.5):
    model = ir.load(str(source))
    if initializer not in model.graph.initializers:  # stored pre-transposed (FoldWeightsPass)
        initializer += ".T"
    value = model.graph.initializers[initializer]
    value.const_value = ir.tensor(value.const_value.numpy() * factor, name=initializer)
    ir.save(model, str(destination))


def plant_constant_fault(source, destination, function_name: str):
    """Change the first float constant a function body reads (every call of it): the constants
    are lifted to formal inputs, so the body scales its first float one by 1.5."""
    model = ir.load(str(source))
    function = next(f for f in model.functions.values() if f.name == function_name)
    for node in function:
        for index, value in enumerate(node.inputs):
            if value in function.inputs and value.name.startswith("const_float"):
                scale = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(1.5, np.float32))})
                scaled = ir.node("Mul", [value, scale.outputs[0]])
                function.insert_before(node, [scale, scaled])
                node.replace_input_with(index, scaled.outputs[0])
                ir.save(model, str(destination))
                return
    raise AssertionError(f"no float constant in {function_name}")


@pytest.fixture(scope="module")
def gpt2_file(tmp_path_factory):
    model, args, _ = models.gpt2(n_layer=2)
    path = tmp_path_factory.mktemp("gpt2") / "gpt2.onnx"
    result = export_modular(model, args, path)
    return model, args, path, result


def test_correct_model_has_no_fault(gpt2_file):
    model, args, path, result = gpt2_file
    report = localize(path, model, args)
    assert report.ok and report.first_failure is None
    # Every call of the expanded hierarchy is observed exactly once.
    outlined = [call.call_name for call in result.hierarchy.walk() if call.function is not None]
    assert sorted(m.call_name for m in report.modules) == sorted(outlined)
    assert len(report.modules) == len(expanded_calls(result.model))
    assert all(m.outputs_compared >= 1 for m in report.modules)
    assert max(m.max_abs for m in report.modules) < 1e-4
    assert set(report.by_depth()) == {1, 2, 3}


def test_localize_and_verify_run_on_the_execution_provider_given(gpt2_file):
    """One session path (runtime/sessions.py): the provider reaches localization's and verify's sessions."""
    model, args, path, _ = gpt2_file
    with pytest.raises(ExecutionProviderError, match="no-such-provider"):
        localize(path, model, args, execution_provider="no-such-provider")
    with pytest.raises(ExecutionProviderError, match="no-such-provider"):
        verify(path, model, args, execution_provider="no-such-provider")
    report = localize(path, model, args, execution_provider="cpu")
    assert report.ok and all(m.kind == "call" and m.tolerance is not None for m in report.modules)


def test_weight_fault_deep_in_second_block(gpt2_file, tmp_path):
    model, args, path, _ = gpt2_file
    plant_weight_fault(path, tmp_path / "bad.onnx", "h.1.attn.c_attn.weight")
    report = localize(tmp_path / "bad.onnx", model, args)
    first = report.first_failure
    assert first.call_name == "h.1.attn.c_attn" and first.depth == 3 and first.function == "Conv1D"
    # Everything before it, including the same function in block 0, is fine.
    before = report.modules[: report.modules.index(first)]
    assert before and all(m.ok for m in before)
    assert report.modules[[m.call_name for m in report.modules].index("h.0.attn.c_attn")].ok


def test_fault_inside_a_deduplicated_function(gpt2_file, tmp_path):
    model, args, path, result = gpt2_file
    act = next(f for f in result.functions if f.name == "NewGELUActivation")
    assert act.metadata_props[metadata.CALL_COUNT] == "2"
    plant_constant_fault(path, tmp_path / "bad.onnx", "NewGELUActivation")
    report = localize(tmp_path / "bad.onnx", model, args)
    assert report.first_failure.call_name == "h.0.mlp.act"
    by_name = {m.call_name: m for m in report.modules}
    assert not by_name["h.1.mlp.act"].ok  # the shared body is wrong for both calls
    assert by_name["h.0.mlp.c_fc"].ok


def test_fault_in_the_second_call_of_a_module_called_twice(tmp_path):
    torch.manual_seed(0)
    model = models.SameInstanceTwice().eval()
    x = torch.randn(2, 4)
    path = tmp_path / "twice.onnx"
    export_modular(model, (x,), path)
    # Feed a perturbed weight to the second call only.
    onnx_model = ir.load(str(path))
    second = next(node for node in onnx_model.graph if node.name == "shared@1")
    index = [v.name for v in second.inputs].index("shared.linear.weight")
    original = onnx_model.graph.initializers["shared.linear.weight"]
    perturbed = ir.Value(name="perturbed_weight", type=original.type, shape=original.shape,
                         const_value=ir.tensor(original.const_value.numpy() * 1.5, name="perturbed_weight"))
    onnx_model.graph.register_initializer(perturbed)
    second.replace_input_with(index, perturbed)
    ir.save(onnx_model, str(tmp_path / "bad.onnx"))
    report = localize(tmp_path / "bad.onnx", model, (x,))
    names = [m.call_name for m in report.modules]
    assert names == ["shared.linear", "shared", "shared.linear@1", "shared@1"]
    assert report.first_failure.call_name == "shared.linear@1"
    assert report.modules[0].ok and report.modules[1].ok


@pytest.mark.parametrize(
    "factory, initializer, expected",
    [
        (models.llama, "layers.1.mlp.down_proj.weight", "layers.1.mlp.down_proj"),
        (models.vit, "layers.0.attention.q_proj.weight", "layers.0.attention.q_proj"),
    ],
)
def test_planted_faults_in_llama_and_vit(factory, initializer, expected, tmp_path):
    model, args, _ = factory()
    path = tmp_path / "m.onnx"
    export_modular(model, args, path)
    assert localize(path, model, args).ok
    plant_weight_fault(path, tmp_path / "bad.onnx", initializer)
    report = localize(tmp_path / "bad.onnx", model, args)
    assert report.first_failure.call_name == expected


def test_report_formats(gpt2_file, tmp_path):
    model, args, path, _ = gpt2_file
    plant_weight_fault(path, tmp_path / "bad.onnx", "h.0.mlp.c_fc.weight")
    report = localize(tmp_path / "bad.onnx", model, args)
    text = str(report)
    assert "h.0.mlp.c_fc" in text and "first to drift" in text
    data = json.loads(report.to_json())
    assert data["first_failure"] == "h.0.mlp.c_fc" and data["ok"] is False
    page = report.save_html(tmp_path / "report.html").read_text()
    assert page.startswith("<!doctype html>") and "<svg" in page and "first module to drift: h.0.mlp.c_fc" in page


def test_float16_drift_is_reported_within_half_precision_tolerance(tmp_path):
    model, args, _ = models.llama()
    model = model.half()
    path = tmp_path / "fp16.onnx"
    result = export_modular(model, args, path)
    assert result.report.outputs[0].dtype == "float16"
    assert result.report.outputs[0].tolerance.atol == 1e-2
    report = localize(path, model, args)
    assert report.ok
    # Half precision drifts measurably, unlike float32; the report shows where.
    assert 1e-5 < max(m.max_abs for m in report.modules) < 1e-2
    plant_weight_fault(path, tmp_path / "bad.onnx", "layers.0.self_attn.v_proj.weight", factor=2.0)
    bad = localize(tmp_path / "bad.onnx", model, args)
    assert bad.first_failure.call_name == "layers.0.self_attn.v_proj"


def test_standalone_verify_runs_dynamic_models_at_several_shapes(tmp_path):
    model, args, _ = models.gpt2(n_layer=1)
    dims = ({0: torch.export.Dim("batch", max=8), 1: torch.export.Dim("seq", min=2, max=32)},)
    path = tmp_path / "dyn.onnx"
    export_modular(model, args, path, dynamic_shapes=dims)
    report = verify(path, model)
    assert report.ok, str(report)
    assert [check.shapes["input_ids"] for check in report.checks] == [[2, 2], [3, 3]]
    assert all(check.modules is not None and check.modules.ok for check in report.checks)
    custom = verify(path, model, shapes=[{"batch": 4, "seq": 7}], localize_modules=False)
    assert custom.checks[0].shapes["input_ids"] == [4, 7] and custom.checks[0].modules is None
    # Without the PyTorch model, only modular vs flat is checked.
    alone = verify(path)
    assert alone.checks[0].reference is None and alone.checks[0].modular_vs_flat_max_abs < 1e-5
