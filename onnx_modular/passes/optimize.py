"""ONNX IR pass: onnxscript's optimizer on every body, without inlining (the hierarchy is kept)."""

from __future__ import annotations

import onnx_ir as ir

from onnx_modular.passes.remove_unused import RemoveUnusedPass

__all__ = ["OptimizeFunctionsPass"]


class OptimizeFunctionsPass(ir.passes.InPlacePass):
    """onnxscript's constant folding and default rewrite rules on every body, without flattening.

    This is ``onnxscript.optimizer.optimize_ir(model, inline=False)`` minus three of its
    final passes, which would change the model's structure rather than simplify it.
    ``CommonSubexpressionEliminationPass`` treats function calls as pure expressions and
    merges two calls of one module on the same input (``linear(x) + linear(x)``) into one,
    losing a module call from the hierarchy.
    ``DeduplicateInitializersPass`` merges weights that merely have equal values (the
    LayerNorm weights of two random-init blocks, every zero bias of one size), so a
    block would read another block's weights; ``LiftConstantsToInitializersPass``
    turns folded constants into initializers that then look like parameters.

    Runs fold + rewrite + unused removal up to ``iterations`` times, until the node count
    stops changing.

    Example::

        OptimizeFunctionsPass()(model)
    """

    def __init__(self, iterations: int = 2):
        super().__init__()
        self.iterations = iterations

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        import onnxscript.optimizer
        import onnxscript.rewriter

        start = _node_count(model)
        for _ in range(self.iterations):
            before = _node_count(model)
            onnxscript.optimizer.fold_constants(model)
            onnxscript.rewriter.rewrite(model)
            RemoveUnusedPass()(model)
            if _node_count(model) == before:
                break
        return ir.passes.PassResult(model, modified=_node_count(model) != start)


def _node_count(model: ir.Model) -> int:
    return len(model.graph) + sum(len(function) for function in model.functions.values())
