"""ONNX IR pass: onnxscript's optimizer on every body, without inlining (the hierarchy is kept)."""

from __future__ import annotations

import onnx_ir as ir

from onnx_modular.passes.export.remove_unused import RemoveUnusedPass

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

    Runs fold + rewrite + unused removal as onnxscript's ``optimize_ir`` does: one onnx_ir
    ``PassManager`` of ``iterations`` steps that stops early once a step changes nothing.

    Example::

        OptimizeFunctionsPass()(model)
    """

    def __init__(self, iterations: int = 2):
        super().__init__()
        self.iterations = iterations

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        import onnx_ir.passes.common as common_passes
        from onnxscript import rewriter
        from onnxscript.optimizer import constant_folding

        steps = ir.passes.PassManager(
            [
                constant_folding.FoldConstantsPass(  # as onnxscript.optimizer.fold_constants(model)
                    shape_inference=False,
                    input_size_limit=constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                    output_size_limit=constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
                ),
                rewriter.RewritePass(rewriter._DEFAULT_REWRITE_RULES),  # as onnxscript.rewriter.rewrite(model)
                common_passes.RemoveUnusedNodesPass(),
                common_passes.RemoveUnusedFunctionsPass(),
                common_passes.RemoveUnusedOpsetsPass(),
                RemoveUnusedPass(),
            ],
            steps=self.iterations,
            early_stop=True,
        )
        return ir.passes.PassResult(model, modified=steps(model).modified)
