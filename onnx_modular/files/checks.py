"""Structure checks of a loaded ONNX model: sizes, missing or duplicate functions, recursion, depth."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import onnx

from onnx_modular.errors import InvalidModelFileError
from onnx_modular.files._proto import (
    FunctionId,
    all_nodes,
    function_id,
    function_label,
    is_standard_domain,
    node_id,
    subgraphs,
)

__all__ = ["MAX_DIMENSION", "MAX_NESTING", "check_model_structure"]

#: Larger declared dimensions are refused: no real tensor has 2**40 elements along one axis,
#: and anything that tried to allocate it would exhaust memory.
MAX_DIMENSION = 2**40
#: Deepest nesting of function calls accepted (real models nest fewer than 20 levels).
MAX_NESTING = 200



def _check_dimensions(where: str, dims: Iterable[int], name: str) -> None:
    for dim in dims:
        if dim > MAX_DIMENSION:
            raise InvalidModelFileError(
                f"{where} {name!r} declares a dimension of {dim} (more than 2**40); "
                "refusing to use a model whose tensors could never be allocated."
            )


def _declared_dims(value: onnx.ValueInfoProto) -> list[int]:
    if not (value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape")):
        return []
    return [d.dim_value for d in value.type.tensor_type.shape.dim if d.HasField("dim_value")]


def _check_value_infos(graph: onnx.GraphProto, where: str) -> None:
    for kind, values in (("input", graph.input), ("output", graph.output), ("value", graph.value_info)):
        for value in values:
            _check_dimensions(f"{where} {kind}", _declared_dims(value), value.name)
    for tensor in graph.initializer:
        _check_dimensions(f"{where} initializer", tensor.dims, tensor.name)
    for sparse in graph.sparse_initializer:
        _check_dimensions(f"{where} sparse initializer", sparse.dims, sparse.values.name)


def check_model_structure(model: onnx.ModelProto, *, name: str = "the model") -> None:
    """Refuse models that cannot be inspected or run safely.

    Checked, in this order, each failing fast with a message naming the culprit:

    - every graph input, output, value and initializer declares dimensions <= 2**40;
    - no two local functions share one ``(domain, name, overload)``;
    - no node of a custom domain calls a function the model does not define (a domain
      counts as custom when it is ``pkg.*`` or when some local function lives in it;
      the standard ``""``, ``ai.onnx*`` and ``com.microsoft*`` domains are not checked);
    - functions do not call each other recursively (ONNX forbids it; inliners and
      runtimes would loop forever);
    - calls nest at most :data:`MAX_NESTING` levels deep.

    Raises:
        InvalidModelFileError: On the first problem found.
    """
    graphs = [(model.graph, f"{name}: graph")]
    while graphs:
        graph, where = graphs.pop()
        _check_value_infos(graph, where)
        for node in graph.node:
            for subgraph in subgraphs(node):
                graphs.append((subgraph, f"{name}: subgraph of node {node.name!r}"))
    for function in model.functions:
        label = function_label(function_id(function))
        for node in all_nodes(function.node):
            for subgraph in subgraphs(node):
                _check_value_infos(subgraph, f"{name}: function {label}: subgraph")
        for value in function.value_info:
            _check_dimensions(f"{name}: function {label} value", _declared_dims(value), value.name)

    functions: dict[FunctionId, onnx.FunctionProto] = {}
    for function in model.functions:
        fid = function_id(function)
        if fid in functions:
            raise InvalidModelFileError(f"{name}: the function {function_label(fid)} is defined twice.")
        functions[fid] = function
    custom_domains = {domain for domain, _, _ in functions}

    def check_calls(nodes: Iterable[onnx.NodeProto], where: str) -> set[FunctionId]:
        called = set()
        for node in all_nodes(nodes):
            nid = node_id(node)
            if nid in functions:
                called.add(nid)
            elif not is_standard_domain(node.domain) and (
                node.domain.startswith("pkg.") or node.domain in custom_domains
            ):
                raise InvalidModelFileError(
                    f"{name}: node {node.name!r} in {where} calls the function {function_label(nid)}, "
                    "which the model does not define (the file may be truncated, or its functions were removed)."
                )
        return called

    check_calls(model.graph.node, "the main graph")
    callees = {
        fid: check_calls(function.node, f"function {function_label(fid)}")
        for fid, function in functions.items()
    }
    depth = _nesting_depths(callees, name)
    deepest = max(depth.values(), default=0)
    if deepest > MAX_NESTING:
        raise InvalidModelFileError(
            f"{name}: function calls nest {deepest} levels deep (more than {MAX_NESTING}); refusing to inspect it."
        )


def _nesting_depths(callees: Mapping[FunctionId, set[FunctionId]], name: str) -> dict[FunctionId, int]:
    """Depth of each function's call tree (1 = calls nothing); raises on a cycle.

    Iterative depth-first search, so deep chains cannot overflow Python's stack.
    """
    depth: dict[FunctionId, int] = {}
    on_path: dict[FunctionId, int] = {}
    for start in sorted(callees):
        if start in depth:
            continue
        path = [start]
        on_path[start] = 0
        stack = [iter(sorted(callees[start]))]
        while stack:
            callee = next(stack[-1], None)
            if callee is None:
                stack.pop()
                done = path.pop()
                del on_path[done]
                depth[done] = 1 + max((depth[c] for c in callees[done]), default=0)
                continue
            if callee in on_path:
                cycle = path[on_path[callee] :] + [callee]
                raise InvalidModelFileError(
                    f"{name}: functions call each other recursively: "
                    + " -> ".join(function_label(f) for f in cycle)
                    + ". ONNX functions cannot be recursive."
                )
            if callee in depth:
                continue
            on_path[callee] = len(path)
            path.append(callee)
            stack.append(iter(sorted(callees[callee])))
    return depth
