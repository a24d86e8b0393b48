"""ONNX IR pass: one default-domain opset version, imported by the model and every body."""

from __future__ import annotations

import onnx_ir as ir

from onnx_modular.passes.functions import bodies

__all__ = ["SetDefaultOpsetPass"]


class SetDefaultOpsetPass(ir.passes.InPlacePass):
    """Import ``version`` of the default domain in the model, the main graph and every function
    that uses it; default-domain nodes drop their own version (the body's import says it).

    For a model whose nodes were written at ``version`` already: torch's translator at that
    opset labels its imports with its library's opset (18), whatever it translated at.

    Example::

        SetDefaultOpsetPass(23)(model)
    """

    def __init__(self, version: int):
        super().__init__()
        self.version = version

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        version = self.version
        modified = model.opset_imports.get("") != version
        model.opset_imports[""] = version
        for body in bodies(model):
            nodes = list(ir.traversal.RecursiveGraphIterator(body))
            if body is model.graph or any(node.domain in ("", "ai.onnx") for node in nodes):
                modified |= body.opset_imports.pop("ai.onnx", None) is not None or body.opset_imports.get("") != version
                body.opset_imports[""] = version
            for node in nodes:
                if node.domain in ("", "ai.onnx") and node.version is not None:
                    node.version = None
                    modified = True
        return ir.passes.PassResult(model, modified=modified)
