"""ONNX IR pass: a residual ``Add`` feeding a fused RMS norm call into ``SkipSimplifiedLayerNormalization``.

Runs after :class:`~onnx_modular.passes.fuse_rms_norm.FuseRMSNormPass`. In a decoder layer's body
the residual sum ``h + attention(...)`` is both the next norm's input and the next residual; when
the norm is a call of a function whose body is one ``SimplifiedLayerNormalization``, the add and
the call become one ``com.microsoft.SkipSimplifiedLayerNormalization`` whose fourth output is the
sum (as onnxruntime-genai's builder writes it). The norm call leaves the hierarchy: the fused
node carries its module path in ``pkg.onnx_modular.fused_from``. Norm calls without a visible
add before them in the same body (the first norm of a layer, the final norm) stay calls.

Example::

    FuseSkipNormPass()(model)
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_modular.format import metadata
from onnx_modular.passes import _fusion

__all__ = ["FuseSkipNormPass"]


def _lone_norm(function: ir.Function) -> tuple[int, int, float] | None:
    """(x index, weight index, epsilon) when ``function`` is one SimplifiedLayerNormalization of two formals."""
    nodes = list(function)
    if len(nodes) != 1 or nodes[0].op_type != "SimplifiedLayerNormalization" or nodes[0].domain not in ("", "ai.onnx"):
        return None
    node = nodes[0]
    if len(function.outputs) != 1 or function.outputs[0] is not node.outputs[0] or len(node.inputs) != 2:
        return None
    formals = list(function.inputs)
    if node.inputs[0] not in formals or node.inputs[1] not in formals:
        return None
    axis = node.attributes.get_int("axis", -1)
    if axis != -1:
        return None
    return formals.index(node.inputs[0]), formals.index(node.inputs[1]), node.attributes.get_float("epsilon", 1e-5)


class FuseSkipNormPass(ir.passes.InPlacePass):
    """``Add(a, b)`` then a lone-norm call on the sum: one ``SkipSimplifiedLayerNormalization``."""

    def __init__(self, functions: set[ir.OperatorIdentifier] | None = None):
        super().__init__()
        self.functions = functions  # bodies to rewrite (None: all)
        self.fused: list[ir.OperatorIdentifier] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        norms = {key: found for key, function in model.functions.items() if (found := _lone_norm(function))}
        self.fused = []
        for key, function in model.functions.items():
            if self.functions is not None and key not in self.functions:
                continue
            count = sum(self._fuse(function, call, norms[call.op_identifier()]) for call in list(function)
                        if call.op_identifier() in norms)
            if count:
                function.opset_imports.setdefault("com.microsoft", 1)
                self.fused.append(key)
        if self.fused:
            model.opset_imports.setdefault("com.microsoft", 1)
        return ir.passes.PassResult(model, modified=bool(self.fused))

    @staticmethod
    def _fuse(function: ir.Function, call: ir.Node, norm: tuple[int, int, float]) -> bool:
        x_index, weight_index, epsilon = norm
        if max(x_index, weight_index) >= len(call.inputs):
            return False
        add = call.inputs[x_index].producer() if call.inputs[x_index] is not None else None
        if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx") or add.graph is not call.graph:
            return False
        fused = ir.node(
            "SkipSimplifiedLayerNormalization",
            [add.inputs[0], add.inputs[1], call.inputs[weight_index]],
            attributes={"epsilon": epsilon},
            domain="com.microsoft",
            num_outputs=4,
            name=f"{call.name or 'norm'}.skip",
        )
        for output, suffix in zip(fused.outputs, ("", "_mean", "_inv_std_var", "_sum")):
            output.name = f"{call.outputs[0].name}{suffix}"
        fused.metadata_props[_fusion.FUSED_FROM_KEY] = call.metadata_props.get(metadata.MODULE_PATH) or call.name or call.op_type
        call.graph.insert_before(add, fused)
        sum_value, normed = add.outputs[0], call.outputs[0]
        sum_name, normed_name = sum_value.name, normed.name
        ir.convenience.replace_all_uses_with([sum_value, normed], [fused.outputs[3], fused.outputs[0]])
        for old, new in ((sum_value, fused.outputs[3]), (normed, fused.outputs[0])):
            for index, output in enumerate(function.outputs):
                if output is old:
                    function.outputs[index] = new
        call.graph.remove([call, add], safe=False)
        fused.outputs[3].name, fused.outputs[0].name = sum_name, normed_name
        return True
