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




def inline_functions(model: onnx.ModelProto, function_ids: Sequence[tuple[str, str]] | None = None) -> onnx.ModelProto:
    """``onnx.inliner`` on ``model``: every local function, or those of ``function_ids``.

    Works around an onnx.inliner bug first: an initializer of an If/Loop/Scan body inside a
    function, read by that body's outputs, is renamed in the initializer list and under another
    name in the outputs (``row_result__1`` / ``row_result__1_0``), so onnxruntime rejects the copy
    ("Graph output (row_result__1_0) does not exist", likely onnx/onnx#5816, closed unfixed). Such
    initializers (onnxscript's optimizer makes them from folded branch constants) become
    ``Constant`` nodes of their body, which the inliner renames consistently; the values are the same.
    ``model`` itself is rewritten so (its bodies' initializers become ``Constant`` nodes).
    """
    import onnx.inliner

    bodies = [g for n in all_nodes(model.graph.node) for g in subgraphs(n)]
    bodies += [g for f in model.functions for n in all_nodes(f.node) for g in subgraphs(n)]
    for graph in bodies:
        constants = [
            onnx.helper.make_node("Constant", [], [tensor.name], value=tensor) for tensor in graph.initializer
        ]
        if constants:
            nodes = constants + list(graph.node)
            del graph.initializer[:]
            del graph.node[:]
            graph.node.extend(nodes)
    if function_ids is None:
        return onnx.inliner.inline_local_functions(model)
    return onnx.inliner.inline_selected_functions(model, list(function_ids))


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
