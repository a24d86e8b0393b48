"""ONNX IR pass: onnxscript's standard-op fusions inside every body, hierarchy kept."""

from __future__ import annotations

import onnx_ir as ir

from onnx_modular.passes.functions import bodies

__all__ = ["FuseStandardOpsPass"]


class FuseStandardOpsPass(ir.passes.InPlacePass):
    """onnxscript's ONNX fusions (``onnxscript.rewriter.onnx_fusions``) inside every body.

    At opset 23 they turn hand-written RMS norms (transformers' ``LlamaRMSNorm`` and the
    like: ``pow``, ``mean``, ``rsqrt``) into one ``RMSNormalization``, which torch's translator
    emits only for ``F.rms_norm``. The rules check the input dtype, which a function's formal
    inputs lack (ONNX functions are untyped): each formal input gets, for the time of the
    rewrite, the dtype all its callers pass (none when they disagree). ``self.counts`` holds
    the fusion counts of the last run. Other opsets: nothing to do (the fusions target 23).

    Example::

        FuseStandardOpsPass()(model)   # at opset 23: RMSNormalization for hand-written norms
    """

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from onnxscript.rewriter import onnx_fusions

        self.counts = {}
        if model.opset_imports.get("") != 23:
            return ir.passes.PassResult(model, modified=False)
        typed = _type_formal_inputs(model)
        try:
            self.counts = dict(onnx_fusions.fuse(model))
        finally:
            for value in typed:
                value.type = None
        return ir.passes.PassResult(model, modified=any(self.counts.values()))


def _type_formal_inputs(model: ir.Model) -> list[ir.Value]:
    """Give function formal inputs their callers' common dtype, outermost functions first."""
    typed: list[ir.Value] = []
    for _ in range(len(model.functions) + 1):  # a fixpoint is reached within the nesting depth
        seen: dict[int, set] = {}
        formals: dict[int, ir.Value] = {}
        for body in bodies(model):
            for node in ir.traversal.RecursiveGraphIterator(body):
                function = model.functions.get(node.op_identifier())
                if function is None:
                    continue
                for formal, actual in zip(function.inputs, node.inputs):
                    formals[id(formal)] = formal
                    seen.setdefault(id(formal), set()).add(actual.type if actual is not None else None)
        changed = False
        for key, types in seen.items():
            formal = formals[key]
            if formal.type is None and len(types) == 1 and None not in types:
                formal.type = next(iter(types))
                typed.append(formal)
                changed = True
        if not changed:
            break
    return typed
