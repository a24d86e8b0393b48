"""ONNX IR pass: mark each main-graph node with the selected module calls it ran under."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import onnx_ir as ir

from onnx_modular.format import metadata

__all__ = ["AnnotateStacksPass"]


class AnnotateStacksPass(ir.passes.InPlacePass):
    """Set ``node.meta[metadata.STACK]``: the selected module-call keys each node ran under.

    Plain data in, from the capture side: ``stacks`` maps a main-graph node to the call keys
    of its FX node's ``nn_module_stack`` (outermost first); ``selected`` holds the call keys
    that become functions (the ``modules=`` option). Nodes absent from ``stacks`` ran under
    the root only. :class:`~onnx_modular.passes.export.outline_calls.OutlineModuleCallsPass` reads it.

    Example::

        AnnotateStacksPass({node: ("L__self___h_0",)}, selected={"L__self___h_0"})(model)
    """

    def __init__(self, stacks: Mapping[ir.Node, tuple[str, ...]], selected: Collection[str]):
        super().__init__()
        self.stacks = stacks
        self.selected = selected

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        for node in model.graph:
            node.meta[metadata.STACK] = tuple(key for key in self.stacks.get(node, ()) if key in self.selected)
        return ir.passes.PassResult(model, modified=True)
