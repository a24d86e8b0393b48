"""Store ``Linear`` weights pre-transposed across function calls: :class:`FoldWeightsPass`
restricted to ``Transpose`` (the special case it generalizes; see ``fold_weights.py``)."""

from __future__ import annotations

from onnx_modular.passes.fold_weights import FoldWeightsPass

__all__ = ["FoldWeightTransposesPass"]


class FoldWeightTransposesPass(FoldWeightsPass):
    """Fold only ``Transpose(weight)``: bodies become ``MatMul(input, weight.T)``.

    Example::

        FoldWeightTransposesPass()(model)
    """

    def __init__(self):
        super().__init__(ops={"Transpose"})
