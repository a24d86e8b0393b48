"""Turn ``Shape`` and ``Size`` of statically shaped values in function bodies into constants.

In a flat graph every value has the shape torch's exporter recorded, so onnxscript's constant
folder replaces ``Shape(x)`` by a constant and folds what is computed from it (the
``Shape``/``Slice``/``Mul``/``Concat`` chain torch's ``LSTM`` translation builds to reshape
each layer's output to ``[seq, batch, hidden]``). In a function body the formal inputs carry
no type, so shape inference inside the body stops at them and the chain stays, at every call,
in the file and in every session onnxruntime creates (a two-layer ``LSTM`` body kept 24 nodes
where the flat graph keeps 5).

When every call of a function passes arguments of one static dtype and shape for each formal
input, the body is typed by onnx's shape inference from those types, and each ``Shape`` (or
``Size``) whose input gets a static shape is replaced by a ``Constant`` holding it; its output
keeps its name, dtype and shape. The constant folder (``OptimizeFunctionsPass``, onnxscript's) then folds
the chain, and ``FoldWeightsPass`` lifts what is left. A body whose calls disagree (one module
called with two sequence lengths), or that a call with dynamic dimensions reaches, is left
alone. Callers are typed before the functions they call, so shapes flow down nested calls.
The inferred shapes are used only for this decision: the body's other values keep the types
they had (none are added to the file).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_modular.passes.export._node_eval import infer_shapes as _infer_shapes

__all__ = ["FoldStaticShapesPass"]

_Type = tuple[ir.DataType, tuple[int, ...]]


class FoldStaticShapesPass(ir.passes.InPlacePass):
    """Replace ``Shape``/``Size`` of values whose shape all call sites fix by constants.

    Example::

        FoldStaticShapesPass()(model)
        OptimizeFunctionsPass()(model)  # folds the Slice/Concat chains built on them
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        opset = model.opset_imports.get("", None) or model.opset_imports.get("ai.onnx")
        if opset is None:
            return ir.passes.PassResult(model, modified=False)
        known: dict[ir.Value, _Type] = {}  # inferred types of values inside bodies (not stored)
        calls = _calls(model)
        modified = False
        for function in _callers_first(model):
            types = _agreed_input_types(function, calls.get(function.identifier(), []), known)
            if types is None:
                continue
            inferred = _infer_body(function, types, opset)
            known.update(inferred)
            modified |= _replace_shape_nodes(function, inferred)
        return ir.passes.PassResult(model, modified=modified)


def _static_type(value: ir.Value, known: dict[ir.Value, _Type]) -> _Type | None:
    if value in known:
        return known[value]
    if value.dtype is None or value.shape is None or not all(isinstance(d, int) for d in value.shape.dims):
        return None
    return value.dtype, tuple(value.shape.dims)


def _calls(model: ir.Model) -> dict[ir.OperatorIdentifier, list[ir.Node]]:
    found: dict[ir.OperatorIdentifier, list[ir.Node]] = {}
    for container in (model.graph, *model.functions.values()):
        for node in ir.traversal.RecursiveGraphIterator(container):
            if node.op_identifier() in model.functions:
                found.setdefault(node.op_identifier(), []).append(node)
    return found


def _callers_first(model: ir.Model) -> list[ir.Function]:
    """Functions ordered so that every function comes after all functions calling it."""
    callees: dict[ir.OperatorIdentifier, set[ir.OperatorIdentifier]] = {}
    for key, function in model.functions.items():
        callees[key] = {
            n.op_identifier() for n in ir.traversal.RecursiveGraphIterator(function) if n.op_identifier() in model.functions
        }
    callers = {key: sum(key in inner for inner in callees.values()) for key in model.functions}
    ready = [key for key, count in callers.items() if count == 0]
    order = []
    while ready:
        key = ready.pop(0)
        order.append(model.functions[key])
        for callee in callees[key]:
            callers[callee] -= 1
            if callers[callee] == 0:
                ready.append(callee)
    return order  # a cycle (invalid ONNX) leaves its functions out


def _agreed_input_types(function: ir.Function, calls: list[ir.Node], known: dict[ir.Value, _Type]) -> list[_Type] | None:
    if not calls:
        return None
    agreed: list[_Type] = []
    for index in range(len(function.inputs)):
        types = set()
        for call in calls:
            argument = call.inputs[index] if index < len(call.inputs) else None
            types.add(None if argument is None else _static_type(argument, known))
        if len(types) != 1 or None in types:
            return None
        agreed.append(types.pop())
    return agreed


def _infer_body(function: ir.Function, types: list[_Type], opset: int) -> dict[ir.Value, _Type]:
    """The static types onnx's shape inference gives the body's values, the body left as it was."""
    values = list(function.inputs) + [out for node in function for out in node.outputs]
    saved = [(v, v.type, v.shape) for v in values]
    try:
        for formal, (dtype, dims) in zip(function.inputs, types):
            formal.dtype, formal.shape = dtype, ir.Shape(dims)
        _infer_shapes(_standard_nodes(function), list(function.inputs), opset)
        return {
            v: (v.dtype, tuple(v.shape.dims))
            for v in values
            if v.dtype is not None and v.shape is not None and all(isinstance(d, int) for d in v.shape.dims)
        }
    finally:
        for value, type_, shape in saved:
            value.type, value.shape = type_, shape


def _standard_nodes(function: ir.Function) -> list[ir.Node]:
    """The body's ONNX-domain nodes computed from its inputs through such nodes only (calls of
    other functions, which onnx's inference cannot see into here, cut what follows them)."""
    available = set(function.inputs)
    nodes = []
    for node in function:
        standard = node.domain in ("", "ai.onnx") and not any(
            attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for attr in node.attributes.values()
        )
        if standard and all(v is None or v in available for v in node.inputs):
            nodes.append(node)
            available.update(node.outputs)
    return nodes


def _replace_shape_nodes(function: ir.Function, inferred: dict[ir.Value, _Type]) -> bool:
    modified = False
    for node in list(function):
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("Shape", "Size") or not node.inputs:
            continue
        source = node.inputs[0]
        dims = inferred.get(source, (None, None))[1] if source is not None else None
        if dims is None:
            continue
        if node.op_type == "Size":
            array = np.array(int(np.prod(dims, dtype=np.int64)), dtype=np.int64)
        else:
            start, end = _shape_range(node, len(dims))
            array = np.array(dims[start:end], dtype=np.int64)
        old = node.outputs[0]
        constant = ir.node("Constant", [], attributes={"value": ir.tensor(array)}, name=node.name)
        new = constant.outputs[0]
        new.name, new.dtype, new.shape = old.name, ir.DataType.INT64, ir.Shape(array.shape)
        new.metadata_props.update(old.metadata_props)
        constant.metadata_props.update(node.metadata_props)
        function.insert_before(node, constant)
        old.name = None
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)  # a body output too
        function.remove(node, safe=True)
        modified = True
    return modified


def _shape_range(node: ir.Node, rank: int) -> tuple[int, int]:
    """``Shape``'s ``start``/``end`` attributes, clamped as the operator defines them."""
    start = node.attributes.get_int("start", 0)
    end = node.attributes.get_int("end", rank)

    def clamp(i: int) -> int:
        return min(max(i + rank if i < 0 else i, 0), rank)

    return clamp(start), clamp(end)
