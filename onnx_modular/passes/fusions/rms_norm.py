"""ONNX IR pass: RMS norm bodies into onnxruntime's ``SimplifiedLayerNormalization``, in place.

onnxscript's ``RmsNormFusion`` (``onnxscript.rewriter.ort_fusions.rms_normalization``) matches
``x * reciprocal(sqrt(mean(x**2) + eps)) * weight`` on flat graphs, where the exponent and the
epsilon are ``Constant`` nodes and every value has a type. In a modular file they are formal inputs
of the norm's function (lifted constants) and body values have no types, so this pass writes the
same pattern with onnxscript's pattern language but reads the constants through the call sites
(:func:`onnx_modular.passes.fusions.base.constant_of`). ``SimplifiedLayerNormalization`` is registered
by onnxruntime in the ONNX domain (``""``, since version 1), as onnxscript's rule emits it.

Example::

    FuseRMSNormPass()(model)
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from onnx_modular.passes.fusions import base as _fusion

__all__ = ["FuseRMSNormPass"]


class _RMSNorm(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, model: ir.Model, weight_first: bool):
        super().__init__(name, remove_nodes=True)
        self._model = model
        self._weight_first = weight_first
        self._epsilon = 0.0

    def pattern(self, op, x, weight, exponent, axes, epsilon):
        mean = op.ReduceMean(op.Pow(x, exponent), axes, keepdims=1)
        normalized = op.Mul(x, op.Reciprocal(op.Sqrt(op.Add(mean, epsilon))))
        return op.Mul(weight, normalized) if self._weight_first else op.Mul(normalized, weight)

    def check(self, context, x, weight, exponent, axes, epsilon, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if _fusion.scalar_of(self._model, exponent) != 2.0:
            return result.fail("the power is not a constant 2", exponent)
        axes_tensor = _fusion.constant_of(self._model, axes)
        if axes_tensor is None or axes_tensor.numpy().reshape(-1).tolist() != [-1]:
            return result.fail("the mean is not over the last axis alone", axes)
        eps = _fusion.scalar_of(self._model, epsilon)
        if eps is None:
            return result.fail("the epsilon is not one constant at every call", epsilon)
        self._epsilon = eps
        return result

    def rewrite(self, op, x, weight, **_):
        return op.SimplifiedLayerNormalization(x, weight, axis=-1, epsilon=self._epsilon, stash_type=1)


class FuseRMSNormPass(_fusion.FusionPass):
    """Every body computing an RMS norm (float32 throughout) becomes one ``SimplifiedLayerNormalization``."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        rules = pattern.RewriteRuleSet(
            [_RMSNorm.rule(f"RMSNorm{i}", model=model, weight_first=first) for i, first in enumerate((True, False))]
        )
        self.reset()
        for key, function in model.functions.items():
            if not self.applies_to(key):
                continue
            if not any(node.op_type == "ReduceMean" for node in function):
                continue
            if _fusion.apply_rules(rules, model, function):
                self.fused.append(key)
        return ir.passes.PassResult(model, modified=bool(self.fused))


