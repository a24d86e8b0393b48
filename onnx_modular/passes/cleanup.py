"""Graph cleanup that keeps functions: helper inlining, onnx_ir's unused removal, the optimizer.

Only torch's helper functions are inlined, before module functions exist.
``optimize_functions`` runs onnxscript's optimizer with ``inline=False``, which folds
constants and simplifies inside each function body while keeping the hierarchy.
"""

from __future__ import annotations

import json

import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from onnx_modular.passes._functions import CALLS_KEY
from onnx_modular.passes.modularize import STACK_KEY

_TEMP_STACK_PROP = "pkg.onnx_modular.internal.stack"

__all__ = ["InlineHelperFunctionsPass", "inline_helper_functions", "remove_unused", "optimize_functions"]


class InlineHelperFunctionsPass(ir.passes.InPlacePass):
    """Inline the functions torch's translator emits (torchlib helpers such as
    ``aten_getitem``, ``torch.cond`` branches), before any module function exists.

    They are implementation details, not modules: left as calls, they hide
    ``SplitToSequence -> SequenceAt`` chains from the optimizer (which folds them into
    ``Split`` once it sees them) and add call overhead in onnxruntime. The module-call
    stack of a main-graph call node (``meta["onnx_modular.stack"]``) is carried onto the
    inlined nodes.

    Example::

        InlineHelperFunctionsPass()(model)  # before OutlineModuleCallsPass
    """

    def requires(self, model: ir.Model) -> None:
        # onnx_ir's InlinePass inlines every function: module functions would be flattened too.
        ours = [f.name for f in model.functions.values() if CALLS_KEY in f.meta]
        if ours:
            raise ir.passes.PreconditionError(
                f"Module-call functions exist already ({', '.join(ours[:5])}); helper functions are "
                "inlined before OutlineModuleCallsPass, which would otherwise be undone."
            )

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if not model.functions:
            return ir.passes.PassResult(model, modified=False)
        # onnx_ir's inliner copies the call node's metadata_props onto the inlined nodes, but
        # not its ``meta``: carry the module-call stack across in a temporary property.
        for node in model.graph:
            if STACK_KEY in node.meta:
                node.metadata_props[_TEMP_STACK_PROP] = json.dumps(node.meta[STACK_KEY])
        modified = common_passes.InlinePass()(model).modified
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            stack = node.metadata_props.pop(_TEMP_STACK_PROP, None)
            if stack is not None and node.graph is model.graph:
                node.meta[STACK_KEY] = tuple(json.loads(stack))
        return ir.passes.PassResult(model, modified=modified)


def inline_helper_functions(model: ir.Model) -> bool:
    """:class:`InlineHelperFunctionsPass` on ``model``; True if anything was inlined."""
    return InlineHelperFunctionsPass()(model).modified


def remove_unused(model: ir.Model) -> bool:
    """Remove unused nodes, initializers (tied weights leave one behind), functions and opsets."""
    result = ir.passes.Sequential(
        common_passes.RemoveUnusedNodesPass(),
        common_passes.RemoveUnusedFunctionsPass(),
        common_passes.RemoveUnusedOpsetsPass(),
    )(model)
    return result.modified


def optimize_functions(model: ir.Model, iterations: int = 2) -> None:
    """onnxscript's constant folding and default rewrite rules on every body, without flattening.

    This is ``onnxscript.optimizer.optimize_ir(model, inline=False)`` minus three of its
    final passes, which would change the model's structure rather than simplify it.
    ``CommonSubexpressionEliminationPass`` treats function calls as pure expressions and
    merges two calls of one module on the same input (``linear(x) + linear(x)``) into one,
    losing a module call from the hierarchy.
    ``DeduplicateInitializersPass`` merges weights that merely have equal values (the
    LayerNorm weights of two random-init blocks, every zero bias of one size), so a
    block would read another block's weights; ``LiftConstantsToInitializersPass``
    turns folded constants into initializers that then look like parameters.
    """
    import onnxscript.optimizer
    import onnxscript.rewriter

    for _ in range(iterations):
        before = _node_count(model)
        onnxscript.optimizer.fold_constants(model)
        onnxscript.rewriter.rewrite(model)
        remove_unused(model)
        if _node_count(model) == before:
            break


def _node_count(model: ir.Model) -> int:
    return len(model.graph) + sum(len(function) for function in model.functions.values())
