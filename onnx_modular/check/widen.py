"""Widen one float dtype to another everywhere in a model: how a bfloat16 file is verified.

onnxruntime's CPU provider has no bfloat16 kernels for the common ops (``MatMul``, ``Add``): a
bfloat16 file does not even load there. Its computation is checked on a widened copy instead:
every bfloat16 weight, constant, graph input and output, value type and ``Cast``/``dtype``
target becomes float32, so the copy computes what PyTorch computes in float32 on the same
(bfloat16-rounded) weights. The widening is exact: every bfloat16 value is a float32 value.
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["WidenFloatPass"]

#: Integer attributes that name an element type (``Cast.to``, ``EyeLike.dtype``, ...).
_TYPE_ATTRIBUTES = frozenset({"to", "dtype", "output_dtype"})


class WidenFloatPass(ir.passes.InPlacePass):
    """Replace the element type ``source`` by ``target`` in the graph and every function.

    Example::

        WidenFloatPass()(model)   # bfloat16 -> float32
    """

    def __init__(
        self, source: ir.DataType = ir.DataType.BFLOAT16, target: ir.DataType = ir.DataType.FLOAT,
        *, initializers: bool = True,
    ):
        super().__init__()
        self.source = source
        self.target = target
        #: ``False``: the graph's initializers (values and types) are left as they are, unread: the
        #: block-wise check widens one block's weights at a time (:mod:`onnx_modular.check.blockwise`).
        self.initializers = initializers

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for value in model.graph.initializers.values() if self.initializers else ():
            tensor = value.const_value
            if tensor is not None and tensor.dtype == self.source:
                value.const_value = ir.tensor(tensor.numpy().astype(self.target.numpy()), name=tensor.name)
                modified = True
        for graph in (model.graph, *model.functions.values()):
            values = list(graph.inputs) + list(graph.outputs)
            if isinstance(graph, ir.Graph) and self.initializers:
                values += list(graph.initializers.values())
            for node in ir.traversal.RecursiveGraphIterator(graph):
                values += list(node.outputs)
                modified |= self._widen_attributes(node)
            for value in values:
                modified |= self._widen_value(value)
        return ir.passes.PassResult(model, modified=modified)

    def _widen_value(self, value: ir.Value) -> bool:
        if value.type is not None and getattr(value.type, "dtype", None) == self.source:
            value.type = ir.TensorType(self.target)
            return True
        return False

    def _widen_attributes(self, node: ir.Node) -> bool:
        changed = False
        for name, attr in list(node.attributes.items()):
            if attr.is_ref():
                continue
            if attr.type == ir.AttributeType.INT and name in _TYPE_ATTRIBUTES and attr.value == self.source:
                node.attributes[name] = ir.AttrInt64(name, int(self.target))
                changed = True
            elif attr.type == ir.AttributeType.TENSOR and attr.value.dtype == self.source:
                node.attributes[name] = ir.AttrTensor(name, ir.tensor(attr.value.numpy().astype(self.target.numpy())))
                changed = True
        return changed
