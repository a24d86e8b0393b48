"""ONNX IR pass: inline torch's helper functions before module functions exist."""

from __future__ import annotations

import json

import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from onnx_modular.format import metadata

__all__ = ["InlineHelperFunctionsPass"]


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
        ours = [f.name for f in model.functions.values() if metadata.CALLS in f.meta]
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
            if metadata.STACK in node.meta:
                node.metadata_props[metadata.INLINED_STACK] = json.dumps(node.meta[metadata.STACK])
        modified = common_passes.InlinePass()(model).modified
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            stack = node.metadata_props.pop(metadata.INLINED_STACK, None)
            if stack is not None and node.graph is model.graph:
                node.meta[metadata.STACK] = tuple(json.loads(stack))
        return ir.passes.PassResult(model, modified=modified)
