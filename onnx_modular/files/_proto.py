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


def all_graphs(model: onnx.ModelProto) -> Iterator[onnx.GraphProto]:
    """The main graph and every subgraph (If/Loop/Scan bodies) at any depth, in the main graph
    and in local functions."""
    pending = [model.graph]
    for function in model.functions:
        for node in function.node:
            pending.extend(subgraphs(node))
    while pending:
        graph = pending.pop()
        yield graph
        for node in graph.node:
            pending.extend(subgraphs(node))


def _sparse(sparse: onnx.SparseTensorProto) -> Iterator[onnx.TensorProto]:
    yield sparse.values
    yield sparse.indices


def all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor a file can hold, wherever it sits: initializers and sparse initializers
    (values and indices) of every graph and subgraph, and tensor and sparse-tensor attributes
    (``Constant``'s ``value``/``sparse_value``) of every node, in the graph, in functions and
    in their subgraphs at any depth. The one list every external-data check walks."""
    graphs = list(all_graphs(model))
    for graph in graphs:
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield from _sparse(sparse)
    nodes = [node for graph in graphs for node in graph.node]
    nodes += [node for function in model.functions for node in function.node]
    for node in nodes:  # nodes of subgraphs are in their graph's list
        for attribute in node.attribute:  # by field, not by declared type: onnx's loader does the same
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("sparse_tensor"):
                yield from _sparse(attribute.sparse_tensor)
            for sparse in attribute.sparse_tensors:
                yield from _sparse(sparse)


def uses_external_data(model: onnx.ModelProto) -> bool:
    return any(onnx.external_data_helper.uses_external_data(tensor) for tensor in all_tensors(model))


def numel(dims: Sequence[int]) -> int:
    return math.prod(int(d) for d in dims)
