"""Small helpers over onnx protos shared by the file tools (no torch)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

import onnx

from onnx_modular.format.metadata import subgraphs
from onnx_modular.format.text import shown

#: ``(domain, name, overload)``, as ``onnx_ir.OperatorIdentifier``.
FunctionId = tuple[str, str, str]


def function_label(function_id: FunctionId) -> str:
    domain, name, overload = (shown(part) for part in function_id)
    label = f"{domain}:{name}" if domain else name
    return f"{label}:{overload}" if overload else label


def is_standard_domain(domain: str) -> bool:
    """Domains whose operators come from a schema, not from a local function."""
    return domain in ("", "ai.onnx") or domain.startswith(("ai.onnx.", "com.microsoft"))




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


def node_id(node: onnx.NodeProto) -> FunctionId:
    return (node.domain, node.op_type, node.overload)


def function_id(function: onnx.FunctionProto) -> FunctionId:
    return (function.domain, function.name, function.overload)


def all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Initializers (subgraphs included) and tensor attributes, in the graph and in functions."""
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        yield from graph.initializer
        for node in graph.node:
            graphs.extend(subgraphs(node))
    nodes = list(all_nodes(model.graph.node))
    for function in model.functions:
        nodes.extend(all_nodes(function.node))
    for node in nodes:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR:
                yield attribute.t
            elif attribute.type == onnx.AttributeProto.TENSORS:
                yield from attribute.tensors


def uses_external_data(model: onnx.ModelProto) -> bool:
    return any(onnx.external_data_helper.uses_external_data(tensor) for tensor in all_tensors(model))


def numel(dims: Sequence[int]) -> int:
    return math.prod(int(d) for d in dims)
