"""The pass lists of an export, run declaratively with onnx_ir's ``PassManager``.

Every IR rewrite of ``export_modular`` is a pass of this package; this module only says which
run, in which order, with which (plain, torch-free) data. Three lists, one per stage:

    translated   RenameDynamicAxes, [AttachWeights], NameGraphInputsOutputs, SetDefaultOpset
    modularize   AnnotateStacks, InlineHelperFunctions, RemoveUnused, OutlineModuleCalls,
                 [DeduplicateFunctions], NameFunctions
    optimize     [RemoveUnused, FoldStaticShapes, OptimizeFunctions, FuseStandardOps], RecordNoOpCalls, RemoveUnused,
                 AddOpsetImports, ConvertOpset, [FoldWeights, StripConstantMetadata, RemoveUnused],
                 SortFunctions

``RemoveUnusedPass`` runs only after a pass that leaves something unused behind (helper
inlining; deduplication, before the optimizer would fold dead copies; dropped no-op calls;
the weight fold), and the default-domain version is set once, right after translation (the
conversion below 18 sets the target's itself).

Example::

    from onnx_modular.passes.export import pipeline

    pipeline.run(pipeline.optimize_passes(tree=tree, opset=18, target_opset=17, optimize=True), model)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import onnx_ir as ir

from onnx_modular.passes.export.constant_metadata import StripConstantMetadataPass
from onnx_modular.passes.export.dedupe import DeduplicateFunctionsPass
from onnx_modular.passes.export.default_opset import SetDefaultOpsetPass
from onnx_modular.passes.export.dynamic_axes import RenameDynamicAxesPass
from onnx_modular.passes.export.fold_weights import FoldWeightsPass
from onnx_modular.passes.export.inline_helpers import InlineHelperFunctionsPass
from onnx_modular.passes.export.io_names import NameGraphInputsOutputsPass
from onnx_modular.passes.export.module_stacks import AnnotateStacksPass
from onnx_modular.passes.export.naming import NameFunctionsPass
from onnx_modular.passes.export.no_op_calls import RecordNoOpCallsPass
from onnx_modular.passes.export.opset_conversion import ConvertOpsetPass
from onnx_modular.passes.export.opset_imports import AddOpsetImportsPass
from onnx_modular.passes.export.optimize_functions import OptimizeFunctionsPass
from onnx_modular.passes.export.outline_calls import OutlineModuleCallsPass
from onnx_modular.passes.export.relative_paths import RelativeStackTracesPass
from onnx_modular.passes.export.remove_unused import RemoveUnusedPass
from onnx_modular.passes.export.specialized_dims import FixSpecializedDimsPass
from onnx_modular.passes.export.standard_ops import FuseStandardOpsPass
from onnx_modular.passes.export.static_shapes import FoldStaticShapesPass
from onnx_modular.passes.function_order import SortFunctionsPass

if TYPE_CHECKING:
    from onnx_modular.format.calltree import CallTree, ModuleCall
    from onnx_modular.passes.export.signatures import CallSignature

__all__ = ["translated_passes", "modularize_passes", "optimize_passes", "run"]

#: What onnx_ir wraps a pass's own exception in.
_WRAPPERS = (ir.passes.PassError, ir.passes.PreconditionError, ir.passes.PostconditionError)


def translated_passes(
    *,
    axis_names: Mapping[str, str],
    input_names: Sequence[str],
    output_names: Sequence[str],
    opset: int,
    weights: ir.passes.PassBase | None = None,
) -> list[ir.passes.PassBase]:
    """What the translator's flat model needs first: axis names, weights, I/O names, one opset.

    ``weights`` (an :class:`~onnx_modular.passes.export.attach_weights.AttachWeightsPass`) runs
    before any pass renames an initializer.
    """
    return [
        RenameDynamicAxesPass(axis_names),
        *([weights] if weights is not None else []),
        NameGraphInputsOutputsPass(input_names, output_names),
        FixSpecializedDimsPass(warn=True),  # after the names: the warning names the input
        SetDefaultOpsetPass(opset),
    ]


def modularize_passes(
    *,
    stacks: Mapping[ir.Node, tuple[str, ...]],
    selected: Collection[str],
    tree: CallTree,
    signatures: Mapping[str, CallSignature],
    value_of: Callable[[str], Any] | None = None,
    dedupe: bool = True,
    domain_of: Callable[[ModuleCall], str] | None = None,
) -> list[ir.passes.PassBase]:
    """Flat model -> nested module-call functions, shared where identical, named.

    ``domain_of``: a call's function domain (default ``pkg.<package>.<version>``).
    """
    return [
        AnnotateStacksPass(stacks, selected),
        InlineHelperFunctionsPass(),
        RemoveUnusedPass(),
        OutlineModuleCallsPass(tree, signatures, value_of=value_of, domain_of=domain_of),
        *([DeduplicateFunctionsPass()] if dedupe else []),
        NameFunctionsPass(tree),
    ]


def optimize_passes(*, tree: CallTree, opset: int, target_opset: int, optimize: bool = True) -> list[ir.passes.PassBase]:
    """Simplify every body (hierarchy kept), record no-op calls, convert the opset, fold weights.

    ``Shape`` of what every call of a body fixes becomes a constant before the optimizer, which
    then folds the shape arithmetic built on it, as it does in a flat graph.

    No-op calls are recorded before the weight fold, so that a call whose computation is
    folded into stored weights (rotary tables) stays a call; the fold runs after the
    conversion, which needs the bodies' constant inputs (axes) in place to turn them into
    attributes.
    """
    return [
        *([RemoveUnusedPass(), FoldStaticShapesPass(), OptimizeFunctionsPass(), FuseStandardOpsPass()] if optimize else []),
        RecordNoOpCallsPass(tree),
        RemoveUnusedPass(),
        AddOpsetImportsPass(opset),
        ConvertOpsetPass(target_opset),  # converts only below the translated opset (18)
        # imports again after the fold: it moves weight-only nodes into callers, which may not have
        # imported their domain yet (a decoder layer that only made calls got an Unsqueeze: ZayaModel)
        *([FoldWeightsPass(), StripConstantMetadataPass(), RemoveUnusedPass(), AddOpsetImportsPass(opset)] if optimize else []),
        RelativeStackTracesPass(),  # no absolute folder of the exporting machine in the file
        SortFunctionsPass(),  # callee-first in memory too (every save sorts again: storage/save.py)
    ]


def run(passes: Sequence[ir.passes.PassBase], model: ir.Model) -> ir.passes.PassResult:
    """Run ``passes`` in order on ``model`` (in place) with onnx_ir's ``PassManager``.

    onnx_ir wraps what a pass raises in ``PassError``s (one per level); the pass's own
    exception is raised instead, so that a typed error (an opset the converter cannot
    reach, a weight the checkpoint lacks) reaches the caller as itself. It names the pass
    that failed: ``error.pass_name`` (``"ConvertOpsetPass"``) and a note in its traceback;
    the export's stage error (:func:`onnx_modular.capture.diagnostics.stage_error`) says it.
    """
    passes = list(passes)
    try:
        return ir.passes.PassManager(passes)(model)
    except _WRAPPERS as e:
        cause: BaseException = e
        while isinstance(cause, _WRAPPERS) and cause.__cause__ is not None:
            cause = cause.__cause__
        name = _failing_pass(e, passes)
        if name is not None and not hasattr(cause, "pass_name"):
            cause.pass_name = name
            cause.add_note(f"(in the {name} pass of onnx_modular.passes)")
        if cause is e:
            raise
        raise cause from cause.__cause__


def _failing_pass(error: BaseException, passes: Sequence[ir.passes.PassBase]) -> str | None:
    """The class name of the pass that raised ``error``: onnx_ir's innermost ``PassError`` quotes it
    (``An error occurred when running the '<pass>' pass ...``)."""
    quoted = {f"'{item}' pass": type(item).__name__ for item in passes}
    name = None
    while error is not None:
        message = str(error) if isinstance(error, _WRAPPERS) else ""
        name = next((n for text, n in quoted.items() if text in message), name)
        error = error.__cause__
    return name
