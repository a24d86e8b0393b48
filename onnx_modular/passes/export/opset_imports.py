"""ONNX IR pass: every domain a body uses is imported there (and by the model)."""

from __future__ import annotations

import onnx_ir as ir

from onnx_modular.passes.functions import bodies

__all__ = ["AddOpsetImportsPass"]


class AddOpsetImportsPass(ir.passes.InPlacePass):
    """Import every domain where it is used: in the main graph, in each function, and in the model.

    As torch's exporter does (``_ir_passes.add_opset_imports``): a domain keeps the version a
    body already imports, else its nodes' version, else 1 (custom function domains); every
    function's imports are repeated on the model (onnxruntime reads them there after inlining).
    The default domain gets the model's version (``default_version`` when the model has none):
    a model with no op at all (``return x``) still has to import it.

    Example::

        AddOpsetImportsPass(18)(model)
    """

    def __init__(self, default_version: int):
        super().__init__()
        self.default_version = default_version

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        before = _imports(model)
        model.opset_imports.setdefault("", self.default_version)
        default = model.opset_imports[""]
        for body in bodies(model):
            for node in ir.traversal.RecursiveGraphIterator(body):
                _add(body.opset_imports, node.domain, default if node.domain in ("", "ai.onnx") else node.version)
            if body is not model.graph:
                for domain, version in body.opset_imports.items():
                    _add(model.opset_imports, domain, version)
        for domain, version in model.graph.opset_imports.items():
            _add(model.opset_imports, domain, version)
        return ir.passes.PassResult(model, modified=_imports(model) != before)


def _add(imports: dict[str, int], domain: str, version: int | None) -> None:
    if imports.get(domain, 1) != 1:
        return  # already imported at a known version
    imports[domain] = 1 if version is None else version


def _imports(model: ir.Model) -> list[dict[str, int]]:
    return [dict(body.opset_imports) for body in [model, *bodies(model)]]
