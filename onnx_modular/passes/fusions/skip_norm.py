"""ONNX IR pass: a residual ``Add`` feeding a norm call into ``SkipSimplifiedLayerNormalization``
(or, ``layer_norm=True``, a ``LayerNormalization`` call into ``SkipLayerNormalization``).

Runs after :class:`~onnx_modular.passes.fusions.rms_norm.FuseRMSNormPass`. In a decoder layer's body
the residual sum ``h + attention(...)`` is both the next norm's input and the next residual; when
the norm is a call of a function whose body is one ``SimplifiedLayerNormalization``, the add and
the call become one ``com.microsoft.SkipSimplifiedLayerNormalization`` whose fourth output is the
sum (as onnxruntime-genai's builder writes it). The norm call leaves the hierarchy: the fused
node carries its module path in ``pkg.onnx_modular.fused_from``. Norm calls without a visible
add before them in the same body (the first norm of a layer, the final norm) stay calls.

With ``layer_norm=True`` the same is done for calls of a function whose body is one
``LayerNormalization`` (``torch.nn.LayerNorm``: BERT's ``BertSelfOutput`` and ``BertOutput``,
``dense -> LayerNorm(hidden + input)``; ViT's and CLIP's residual before ``layernorm_after``):
``com.microsoft.SkipLayerNormalization(a, b, gamma, beta)``, the sum again its fourth output.

Example::

    FuseSkipNormPass()(model)
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_modular.format import metadata
from onnx_modular.passes.fusions import base as _fusion

__all__ = ["FuseSkipNormPass"]


#: norm op -> (its inputs besides x, the fused op)
_KINDS = {
    "SimplifiedLayerNormalization": (1, "SkipSimplifiedLayerNormalization"),
    "LayerNormalization": (2, "SkipLayerNormalization"),
}


def _lone_norm(function: ir.Function, op_type: str) -> tuple[list[int], float] | None:
    """(formal indices of x, weight (and bias), epsilon) when ``function`` is one ``op_type`` node of formals."""
    nodes = list(function)
    if len(nodes) != 1 or nodes[0].op_type != op_type or nodes[0].domain not in ("", "ai.onnx"):
        return None
    node = nodes[0]
    if len(function.outputs) != 1 or function.outputs[0] is not node.outputs[0]:
        return None
    if not 2 <= len(node.inputs) <= 1 + _KINDS[op_type][0] or any(v is None for v in node.inputs):
        return None
    formals = list(function.inputs)
    if any(v not in formals for v in node.inputs):
        return None
    axis = node.attributes.get_int("axis", -1)
    if axis != -1 or node.attributes.get_int("stash_type", 1) != 1:
        return None
    return [formals.index(v) for v in node.inputs], node.attributes.get_float("epsilon", 1e-5)


class FuseSkipNormPass(_fusion.FusionPass):
    """``Add(a, b)`` then a lone-norm call on the sum: one ``SkipSimplifiedLayerNormalization``
    (``layer_norm=True``: a lone ``LayerNormalization`` call, one ``SkipLayerNormalization``)."""

    def __init__(self, functions: set[ir.OperatorIdentifier] | None = None, layer_norm: bool = False):
        super().__init__(functions)
        self.norm_op = "LayerNormalization" if layer_norm else "SimplifiedLayerNormalization"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        norms = {key: found for key, function in model.functions.items() if (found := _lone_norm(function, self.norm_op))}
        self.reset()
        for key, function in model.functions.items():
            if not self.applies_to(key):
                continue
            count = sum(self._fuse(function, call, norms[call.op_identifier()], _KINDS[self.norm_op][1]) for call in list(function)
                        if call.op_identifier() in norms)
            if count:
                function.opset_imports.setdefault("com.microsoft", 1)
                self.fused.append(key)
        if self.fused:
            model.opset_imports.setdefault("com.microsoft", 1)
        return ir.passes.PassResult(model, modified=bool(self.fused))

    @staticmethod
    def _fuse(function: ir.Function, call: ir.Node, norm: tuple[list[int], float], fused_op: str) -> bool:
        indices, epsilon = norm
        if max(indices) >= len(call.inputs):
            return False
        x_index = indices[0]
        add = call.inputs[x_index].producer() if call.inputs[x_index] is not None else None
        if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx") or add.graph is not call.graph:
            return False
        fused = ir.node(
            fused_op,
            [add.inputs[0], add.inputs[1], *(call.inputs[i] for i in indices[1:])],
            attributes={"epsilon": epsilon},
            domain="com.microsoft",
            num_outputs=4,
            name=f"{call.name or 'norm'}.skip",
        )
        for output, suffix in zip(fused.outputs, ("", None, None, "_sum")):  # mean, inv_std_var: not computed
            output.name = "" if suffix is None else f"{call.outputs[0].name}{suffix}"
        fused.metadata_props[_fusion.FUSED_FROM_KEY] = call.metadata_props.get(metadata.MODULE_PATH) or call.name or call.op_type
        call.graph.insert_before(add, fused)
        sum_value, normed = add.outputs[0], call.outputs[0]
        sum_name, normed_name = sum_value.name, normed.name
        ir.convenience.replace_all_uses_with([sum_value, normed], [fused.outputs[3], fused.outputs[0]],
                                             replace_graph_outputs=True)  # BertSelfOutput returns the norm
        call.graph.remove([call, add], safe=False)
        fused.outputs[3].name, fused.outputs[0].name = sum_name, normed_name
        return True
