"""ONNX IR pass: GELU bodies into onnxruntime's fused activations, in place.

onnxscript's ``GeluErfFusion``/``erfgelu`` rules (``onnxscript.rewriter.ort_fusions``) match
``0.5 * x * (1 + erf(x / sqrt(2)))`` on flat graphs, where the constants are ``Constant`` nodes.
In a modular file they are formal inputs of the activation's function (lifted constants), so this
pass writes the same patterns with onnxscript's pattern language and reads the constants through
the call sites (:func:`onnx_modular.passes.fusions.base.constant_of`), as the RMS norm step does:

- ``x * (0.5 * (erf(x / sqrt(2)) + 1))`` (transformers' ``GELUActivation``, BERT, ViT; any order
  of the products) -> ``com.microsoft.Gelu``;
- ``x * sigmoid(alpha * x)`` (``QuickGELUActivation``, CLIP) -> ``com.microsoft.QuickGelu(alpha)``;
- ``x * (0.5 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3))))`` and ``(0.5 * x) * (1 + tanh(...))``
  (transformers' ``GELUTanh``/``PytorchGELUTanh``, Gemma, Gemma2; ``NewGELUActivation``, Phi, GPT-2)
  -> ``com.microsoft.FastGelu``.

onnxruntime's own GELU fusion does not match transformers' association of the products
(``x * (0.5 * (1 + erf))``), so without this step the five ops run apart; with it, onnxruntime
also folds the preceding bias ``Add`` into ``BiasGelu`` once it inlines the calls.

Example::

    FuseActivationPass()(model)
"""

from __future__ import annotations

import math

import onnx_ir as ir
from onnxscript.rewriter import pattern

from onnx_modular.passes.fusions import base as _fusion

__all__ = ["FuseActivationPass"]


class _ErfGelu(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, model: ir.Model, inner_half: bool):
        super().__init__(name, remove_nodes=True)
        self._model = model
        self._inner_half = inner_half

    def pattern(self, op, x, root, one, half):
        plus_one = op.Add(op.Erf(op.Div(x, root)), one)
        if self._inner_half:  # x * (0.5 * (erf + 1)): transformers' GELUActivation
            return op.Mul(x, op.Mul(half, plus_one))
        return op.Mul(half, op.Mul(x, plus_one))  # 0.5 * (x * (erf + 1))

    def check(self, context, x, root, one, half, **_) -> pattern.MatchResult:
        return _constants(self._model, ((root, math.sqrt(2.0), "the divisor"), (one, 1.0, "the addend"),
                                        (half, 0.5, "the factor")))

    def rewrite(self, op, x, **_):
        return op.Gelu(x, _domain="com.microsoft")


def _constants(model: ir.Model, expected) -> pattern.MatchResult:
    """Each ``(value, number, what)``: the value always holds that number (relative 1e-6), else the
    match fails naming it."""
    result = pattern.MatchResult()
    for value, number_expected, what in expected:
        number = _fusion.scalar_of(model, value)
        if number is None or not math.isclose(number, number_expected, rel_tol=1e-6):
            return result.fail(f"{what} is not {number_expected}", value)
    return result


class _TanhGelu(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, model: ir.Model, inner_half: bool):
        super().__init__(name, remove_nodes=True)
        self._model = model
        self._inner_half = inner_half

    def pattern(self, op, x, three, cubic, root, one, half):
        plus_one = op.Add(op.Tanh(op.Mul(root, op.Add(x, op.Mul(cubic, op.Pow(x, three))))), one)
        if self._inner_half:  # x * (0.5 * (tanh + 1)): GELUTanh
            return op.Mul(x, op.Mul(half, plus_one))
        return op.Mul(op.Mul(half, x), plus_one)  # (0.5 * x) * (1 + tanh): NewGELUActivation

    def check(self, context, x, three, cubic, root, one, half, **_) -> pattern.MatchResult:
        return _constants(self._model, ((three, 3.0, "the exponent"), (cubic, 0.044715, "the cubic factor"),
                                        (root, math.sqrt(2.0 / math.pi), "the factor inside tanh"),
                                        (one, 1.0, "the addend"), (half, 0.5, "the factor")))

    def rewrite(self, op, x, **_):
        return op.FastGelu(x, _domain="com.microsoft")


class _QuickGelu(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, model: ir.Model):
        super().__init__(name, remove_nodes=True)
        self._model = model
        self._alpha = 1.0

    def pattern(self, op, x, alpha):
        return op.Mul(x, op.Sigmoid(op.Mul(x, alpha)))

    def check(self, context, x, alpha, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        number = _fusion.scalar_of(self._model, alpha)
        if number is None:
            return result.fail("the sigmoid's factor is not one constant at every call", alpha)
        self._alpha = number
        return result

    def rewrite(self, op, x, **_):
        return op.QuickGelu(x, alpha=self._alpha, _domain="com.microsoft")


class FuseActivationPass(_fusion.FusionPass):
    """Every body computing an erf GELU, a tanh GELU or a quick GELU (float32) becomes the fused op."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        rules = pattern.RewriteRuleSet(
            [_ErfGelu.rule(f"ErfGelu{i}", model=model, inner_half=inner) for i, inner in enumerate((True, False))]
            + [_TanhGelu.rule(f"TanhGelu{i}", model=model, inner_half=inner) for i, inner in enumerate((True, False))]
            + [_QuickGelu.rule("QuickGelu", model=model)],
            commute=True,
        )
        self.reset()
        for key, function in model.functions.items():
            if not self.applies_to(key):
                continue
            if not any(node.op_type in ("Erf", "Sigmoid", "Tanh") for node in function):
                continue
            if _fusion.apply_rules(rules, model, function):
                function.opset_imports.setdefault("com.microsoft", 1)
                self.fused.append(key)
                self.ops[key] = next((f"com.microsoft.{n.op_type}" for n in function if n.domain == "com.microsoft"), "")
        if self.fused:
            model.opset_imports.setdefault("com.microsoft", 1)
        return ir.passes.PassResult(model, modified=bool(self.fused))
