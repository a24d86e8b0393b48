"""Walking the bodies of a ``ModelProto`` (its main graph and its functions) for the proto passes
:mod:`~onnx_modular.passes.precision.casts` and :mod:`~onnx_modular.passes.precision.quantize_weights`: who
calls a function, who reads a value, what types a body declares, fresh value names, opset imports.

The one home of the proto walks ``function_id``, ``node_id``, ``all_nodes``, ``body_names`` and
``unique_name``: :mod:`onnx_modular.storage.proto` and :mod:`onnx_modular.calls.targets` use these
(``passes/`` sits below both folders, so the walks live here).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import onnx

from onnx_modular.format.metadata import subgraphs

#: A body: the main graph or a function.
Body = onnx.GraphProto | onnx.FunctionProto
#: ``(domain, name, overload)``, as ``onnx_ir.OperatorIdentifier``.
FunctionId = tuple[str, str, str]


def node_id(node: onnx.NodeProto) -> FunctionId:
    """The function a node calls (when it calls one)."""
    return (node.domain, node.op_type, node.overload)


def function_id(function: onnx.FunctionProto) -> FunctionId:
    return (function.domain, function.name, function.overload)


def all_nodes(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.NodeProto]:
    """The nodes and, depth first, the nodes of their If/Loop/Scan subgraphs."""
    stack = [iter(nodes)]
    while stack:
        node = next(stack[-1], None)
        if node is None:
            stack.pop()
            continue
        yield node
        for graph in subgraphs(node):
            stack.append(iter(graph.node))


def call_sites(model: onnx.ModelProto, fid: FunctionId) -> Iterable[tuple[Any, onnx.NodeProto]]:
    """(body, node) of every top-level node of the model that calls function ``fid``."""
    for body in [model.graph, *model.functions]:
        for node in body.node:
            if node_id(node) == fid:
                yield body, node


def uses(body: Body, name: str) -> list[tuple[onnx.NodeProto, int]]:
    """(node, input index) of every top-level node of ``body`` reading ``name``; a subgraph's
    read counts as its node's, with index -1."""
    found = []
    for node in body.node:
        for index, value in enumerate(node.input):
            if value == name:
                found.append((node, index))
        for sub in all_nodes([node]):
            if sub is not node and name in sub.input:
                found.append((node, -1))
                break
    return found


def declared_types(body: Body, opset: int | None = None) -> dict[str, int]:
    """Element types a body declares (value_info, graph inputs/outputs, initializers); with the
    default domain's ``opset``, also those onnx's node inference finds for the outputs of standard
    ops that declare none (a value a pass added: an ``Expand`` between two typed values)."""
    types: dict[str, int] = {}
    values = list(body.value_info)
    if isinstance(body, onnx.GraphProto):
        values += [*body.input, *body.output]
        types.update({t.name: t.data_type for t in body.initializer})
    for value in values:
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            types[value.name] = value.type.tensor_type.elem_type
    if opset is not None:
        _infer_undeclared(body, types, opset)
    return types


def _infer_undeclared(body: Body, types: dict[str, int], opset: int) -> None:
    """``types`` completed, in node order, by ``onnx.shape_inference.infer_node_outputs`` for the
    standard ops (no subgraphs) whose inputs are all typed and some output is not."""
    import onnx.defs
    import onnx.shape_inference

    imports = [onnx.helper.make_opsetid("", opset)]
    for node in body.node:
        if (node.domain not in ("", "ai.onnx") or all(not o or o in types for o in node.output)
                or any(i and i not in types for i in node.input) or any(subgraphs(node))):
            continue
        try:
            schema = onnx.defs.get_schema(node.op_type, opset, "")
            inputs = {i: onnx.helper.make_tensor_type_proto(types[i], None) for i in node.input if i}
            found = onnx.shape_inference.infer_node_outputs(schema, node, inputs, opset_imports=imports)
        except Exception:  # onnx's inference errors have no common type: the value stays untyped
            continue
        for name, proto in found.items():
            if name not in types and proto.HasField("tensor_type") and proto.tensor_type.elem_type:
                types[name] = proto.tensor_type.elem_type


def ensure_default_opset(model: onnx.ModelProto, body: Body) -> None:
    """A function that gets standard ops imports the default domain (at the model's version)."""
    if isinstance(body, onnx.FunctionProto) and not any(o.domain in ("", "ai.onnx") for o in body.opset_import):
        default = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)
        body.opset_import.add(domain="", version=default)


def ensure_opset(model: onnx.ModelProto, body: Body, domain: str, version: int = 1) -> None:
    """The model and ``body`` import ``domain``."""
    if not any(o.domain == domain for o in model.opset_import):
        model.opset_import.add(domain=domain, version=version)
    if isinstance(body, onnx.FunctionProto) and not any(o.domain == domain for o in body.opset_import):
        body.opset_import.add(domain=domain, version=version)


def body_names(body: Body) -> set[str]:
    """Every value name a body uses (inputs, outputs, node inputs and outputs, subgraphs included)."""
    if isinstance(body, onnx.FunctionProto):
        names = set(body.input) | set(body.output)
    else:
        names = {v.name for v in body.input} | {v.name for v in body.output} | {t.name for t in body.initializer}
    for node in all_nodes(body.node):
        names.update(node.input)
        names.update(node.output)
    return names


def unique_name(name: str, taken: set[str]) -> str:
    """``name``, or ``name_1``, ``name_2``, ... not in ``taken``; the result is added to ``taken``."""
    candidate, suffix = name, 1
    while candidate in taken:
        candidate, suffix = f"{name}_{suffix}", suffix + 1
    taken.add(candidate)
    return candidate
