"""passes/export/pipeline.py: the pass lists of each stage, and typed errors passing through PassManager."""

from __future__ import annotations

import onnx_ir as ir
import pytest
from pass_helpers import call_tree

from onnx_modular.errors import InvalidInputError
from onnx_modular.passes.export import pipeline
from onnx_modular.passes.export.opset_conversion import ConvertOpsetPass
from onnx_modular.passes.function_order import SortFunctionsPass


def _names(passes):
    return [type(p).__name__ for p in passes]


def test_optimize_list_runs_unused_removal_only_after_passes_that_leave_garbage():
    tree = call_tree(("block", "Block"))
    on = _names(pipeline.optimize_passes(tree=tree, opset=18, target_opset=17, optimize=True))
    assert on == [
        "RemoveUnusedPass", "FoldStaticShapesPass", "OptimizeFunctionsPass", "FuseStandardOpsPass", "RecordNoOpCallsPass", "RemoveUnusedPass",
        "AddOpsetImportsPass", "ConvertOpsetPass", "FoldWeightsPass", "StripConstantMetadataPass", "RemoveUnusedPass",
        "AddOpsetImportsPass", "RelativeStackTracesPass", "SortFunctionsPass",
    ]
    off = _names(pipeline.optimize_passes(tree=tree, opset=18, target_opset=18, optimize=False))
    assert off == [
        "RecordNoOpCallsPass", "RemoveUnusedPass", "AddOpsetImportsPass", "ConvertOpsetPass", "RelativeStackTracesPass",
        "SortFunctionsPass",
    ]


def test_modularize_and_translated_lists():
    tree = call_tree(("block", "Block"))
    names = _names(pipeline.modularize_passes(stacks={}, selected=set(), tree=tree, signatures={}, dedupe=False))
    assert names == [
        "AnnotateStacksPass", "InlineHelperFunctionsPass", "RemoveUnusedPass", "OutlineModuleCallsPass", "NameFunctionsPass",
    ]
    names = _names(pipeline.translated_passes(axis_names={}, input_names=["x"], output_names=["y"], opset=18))
    assert names == [
        "RenameDynamicAxesPass", "NameGraphInputsOutputsPass", "FixSpecializedDimsPass", "SetDefaultOpsetPass",
    ]


def test_a_typed_error_of_a_pass_is_raised_as_itself():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18]>
        main (float[2] x) => (float[2] y) { y = Relu(x) }
    """)
    with pytest.raises(InvalidInputError, match="possible opsets"):
        pipeline.run([ConvertOpsetPass(3)], model)


class _BrokenPass(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        raise KeyError("no such value")


def test_errors_name_the_failing_pass():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18]>
        main (float[2] x) => (float[2] y) { y = Relu(x) }
    """)
    with pytest.raises(KeyError) as error:  # the pass's own exception, as itself
        pipeline.run([SortFunctionsPass(), _BrokenPass()], model)
    assert error.value.pass_name == "_BrokenPass"
    assert any("_BrokenPass" in note for note in error.value.__notes__)
    with pytest.raises(InvalidInputError) as typed:
        pipeline.run([SortFunctionsPass(), ConvertOpsetPass(3)], model)
    assert typed.value.pass_name == "ConvertOpsetPass"


def test_the_stage_error_says_which_pass_failed():
    torch = pytest.importorskip("torch")  # skipped in the torch-free run of the pass tests
    from onnx_modular.capture.diagnostics import stage_error

    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 18]>
        main (float[2] x) => (float[2] y) { y = Relu(x) }
    """)
    with pytest.raises(KeyError) as error:
        pipeline.run([_BrokenPass()], model)
    for stage in ("optimize", "modularize"):
        message = str(stage_error(stage, error.value, torch.nn.Identity()))
        assert "failed in _BrokenPass: KeyError" in message
