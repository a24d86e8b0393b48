"""ONNX IR pass: onnx_ir's unused removal (nodes, initializers, functions, opset imports) as one pass."""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common_passes

__all__ = ["RemoveUnusedPass"]


class RemoveUnusedPass(ir.passes.Sequential):
    """Remove unused nodes, initializers (tied weights leave one behind), functions and opsets.

    The pipeline runs it after the passes that leave something unused behind (helper
    inlining, deduplication, the optimizer's folds, dropped no-op calls, the weight fold).

    Example::

        RemoveUnusedPass()(model)
    """

    def __init__(self):
        super().__init__(
            common_passes.RemoveUnusedNodesPass(),
            common_passes.RemoveUnusedFunctionsPass(),
            common_passes.RemoveUnusedOpsetsPass(),
        )
