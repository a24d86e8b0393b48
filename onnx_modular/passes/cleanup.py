"""Graph cleanup that keeps functions: onnx_ir's unused-removal passes plus opset imports.

Nothing here inlines. ``optimize_functions`` runs onnxscript's optimizer with
``inline=False``, which folds constants and simplifies inside each function body
while keeping the hierarchy.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from onnx_modular import _torch_compat

__all__ = ["remove_unused", "fix_opset_imports", "optimize_functions"]


def remove_unused(model: ir.Model) -> bool:
    """Remove unused nodes, initializers (tied weights leave one behind), functions and opsets."""
    result = ir.passes.Sequential(
        common_passes.RemoveUnusedNodesPass(),
        common_passes.RemoveUnusedFunctionsPass(),
        common_passes.RemoveUnusedOpsetsPass(),
    )(model)
    return result.modified


def fix_opset_imports(model: ir.Model) -> None:
    """Every domain used in a graph or function gets an import there and in the model."""
    _torch_compat.add_opset_imports(model)


def optimize_functions(model: ir.Model) -> None:
    """onnxscript's optimizer on every body, without flattening the hierarchy."""
    import onnxscript.optimizer

    onnxscript.optimizer.optimize_ir(model, inline=False)
