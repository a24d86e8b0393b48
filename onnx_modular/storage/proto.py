"""Small helpers over onnx protos shared by the file tools (no torch)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import onnx

from onnx_modular.format.metadata import subgraphs
from onnx_modular.format.text import shown
from onnx_modular.passes.proto_bodies import FunctionId, all_nodes, function_id, node_id  # the one home of these walks


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

    bodies = [(n, g) for n in all_nodes(model.graph.node) for g in subgraphs(n)]
    bodies += [(n, g) for f in model.functions for n in all_nodes(f.node) for g in subgraphs(n)]
    for owner, graph in bodies:
        constants = []
        for tensor in graph.initializer:
            constant = onnx.helper.make_node("Constant", [], [tensor.name], name=f"{tensor.name}_constant", value=tensor)
            constant.metadata_props.extend(owner.metadata_props)  # the module (and tags) of the node that owns the body
            constants.append(constant)
        if constants:
            nodes = constants + list(graph.node)
            del graph.initializer[:]
            del graph.node[:]
            graph.node.extend(nodes)
    if function_ids is None:
        return onnx.inliner.inline_local_functions(model)
    return onnx.inliner.inline_selected_functions(model, list(function_ids))





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


def declare_function_types(model: onnx.ModelProto) -> list[str]:
    """Give the local functions that declare no types of their values (no ``value_info``) the types
    onnx's inference finds at their first call: each body is inferred as a graph whose inputs have
    the types of that call's arguments (the model's other functions available to it), callers
    first. Tools that read a body's declared types (``convert``) then see every function alike.
    Functions that declare types, or that inference cannot type, are left as they are.

    Returns:
        The names of the functions given types.
    """
    import onnx.shape_inference

    functions = {function_id(f): f for f in model.functions}
    if not any(not f.value_info for f in functions.values()):
        return []
    done: set[FunctionId] = set()
    typed: list[str] = []

    def types_of(graph: onnx.GraphProto) -> dict[str, onnx.TypeProto]:
        probe = onnx.helper.make_model(graph, opset_imports=list(model.opset_import), functions=list(model.functions))
        probe.ir_version = model.ir_version
        try:
            inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=False).graph
        except Exception:
            return {}
        known = {v.name: v.type for v in (*inferred.input, *inferred.output, *inferred.value_info)}
        known.update({t.name: onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims)) for t in inferred.initializer})
        return known

    def visit(nodes, known: dict[str, onnx.TypeProto]) -> None:
        for node in nodes:
            fid = node_id(node)
            function = functions.get(fid)
            if function is None or fid in done:
                continue
            done.add(fid)
            if function.value_info or not all(value in known for value in node.input if value):
                continue
            inputs = [onnx.helper.make_value_info(formal, known[actual]) for formal, actual in zip(function.input, node.input) if actual]
            body = onnx.helper.make_graph(list(function.node), "probe", inputs, [onnx.helper.make_value_info(o, onnx.TypeProto()) for o in function.output])
            inner = types_of(body)
            values = [onnx.helper.make_value_info(name, kind) for name, kind in inner.items()
                      if kind.HasField("tensor_type") and kind.tensor_type.elem_type]  # fmt: skip
            if values:
                function.value_info.extend(values)
                typed.append(function.name)
            visit(function.node, inner)

    visit(model.graph.node, types_of(model.graph))
    return typed
