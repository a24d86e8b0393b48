"""The call tree of an ONNX file, and the counts ``result.hierarchy`` takes from the final model.

Works on any model whose local functions call each other; files written by onnx_modular
add module paths, classes and the module calls that produced no ops (docs/metadata.md).
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx
import onnx_ir as ir

from onnx_modular.errors import InvalidModelFileError
from onnx_modular.format import metadata
from onnx_modular.format.calltree import CallTree, ModuleCall
from onnx_modular.format.scopes import namespace_classes
from onnx_modular.storage.checks import (
    MAX_EXPANDED_CALLS,
    check_model_structure,
    max_expanded_calls,
)
from onnx_modular.storage.proto import FunctionId, all_nodes, function_id, node_id, numel

__all__ = [
    "MAX_TREE_CALLS",
    "function_tree",
    "module_path_tree",
    "node_call",
    "weight_sources",
    "call_weights",
    "count_from_model",
    "count_from_ir",
]

#: Largest number of calls the expanded tree may hold (a function called from a function
#: called N times counts N times): the limit onnxruntime and inlining get
#: (:data:`~onnx_modular.storage.checks.MAX_EXPANDED_CALLS`). Guards against exponential expansion
#: of shared bodies, and keeps a printed tree readable (building and printing 20,000 calls
#: takes about 1.5 s).
MAX_TREE_CALLS = MAX_EXPANDED_CALLS


def _call_counts(model: onnx.ModelProto, functions: Mapping[FunctionId, onnx.FunctionProto]) -> dict[FunctionId, int]:
    """Calls per function over the whole model, without expanding the tree.

    Main-graph calls count once, calls inside a body once per call of that body. Processing
    callers before callees (the function call graph is acyclic) makes each count final when used.
    """
    sites: dict[FunctionId, list[FunctionId]] = {f: [] for f in functions}
    for fid, function in functions.items():
        for node in all_nodes(function.node):
            if node_id(node) in functions:
                sites[fid].append(node_id(node))
    count = dict.fromkeys(functions, 0)
    for node in all_nodes(model.graph.node):
        if node_id(node) in functions:
            count[node_id(node)] += 1
    for fid in _callers_first(sites):
        for callee in sites[fid]:
            count[callee] += count[fid]
    return count


def _callers_first(sites: Mapping[FunctionId, list[FunctionId]]) -> list[FunctionId]:
    """Functions ordered so that every caller comes before its callees (Kahn's algorithm)."""
    indegree = dict.fromkeys(sites, 0)
    for callees in sites.values():
        for callee in set(callees):
            indegree[callee] += 1
    ready = sorted(f for f, count in indegree.items() if count == 0)
    order = []
    while ready:
        fid = ready.pop()
        order.append(fid)
        for callee in sorted(set(sites[fid])):
            indegree[callee] -= 1
            if indegree[callee] == 0:
                ready.append(callee)
    return order


def function_tree(model: onnx.ModelProto, *, max_calls: int | None = None) -> CallTree:
    """Build the call hierarchy of a model's local functions.

    The root is the main graph; its children are the nodes that call a local function
    (in execution order, If/Loop subgraphs included), and so on into each function body.
    A function body shared by several calls is expanded under each of them. Module calls
    that produced no ops (recorded by onnx_modular) appear as calls without a function.

    Args:
        model: Any ONNX model (it is checked with :func:`check_model_structure`).
        max_calls: Refuse models whose expanded tree would hold more calls (default
            :data:`MAX_TREE_CALLS`, or ``ONNX_MODULAR_MAX_EXPANDED_CALLS`` when set).

    Raises:
        InvalidModelFileError: The structure is unusable (see :func:`check_model_structure`),
            or the tree would hold more than ``max_calls`` calls.

    Example::

        tree = function_tree(load_model_file("gpt2.onnx"))
        print(tree.format(max_depth=2))
        print(tree.to_json())
    """
    check_model_structure(model)
    functions = {function_id(f): f for f in model.functions}
    call_count = _call_counts(model, functions)
    total = sum(call_count.values())
    max_calls = max_expanded_calls() if max_calls is None else max_calls
    if total > max_calls:
        raise InvalidModelFileError(
            f"The call hierarchy expands to {total} calls (more than {max_calls}); refusing to build the tree "
            "(a few functions calling each other many times over: a call-expansion bomb; if the model is "
            f"genuine, raise the limit with the environment variable ONNX_MODULAR_MAX_EXPANDED_CALLS={total})."
        )
    # Parameters are weight elements: the constants lifted out of bodies (shapes, scalars) are not.
    lifted = metadata.lifted_constants(model)
    sizes = {tensor.name: 0 if tensor.name in lifted else numel(tensor.dims) for tensor in model.graph.initializer}
    sizes.update({sparse.values.name: numel(sparse.dims) for sparse in model.graph.sparse_initializer})
    root = ModuleCall(
        key="",
        module_path="",
        node_name=model.graph.name or "main_graph",
        num_nodes=len(model.graph.node),
        parameters=sum(sizes.values()),
    )
    # A scope maps a body's value names to the main-graph initializer they carry. ONNX names
    # are unique across nested scopes, so subgraphs of a body share its scope.
    top_scope: dict[str, str] = {name: name for name in sizes}
    scopes: dict[int, dict[str, str]] = {}
    tree_node: dict[int, ModuleCall] = {}
    for call in metadata.expanded_calls(model, module_calls_only=False, include_no_ops=True):
        parent = root if call.caller is None else tree_node[id(call.caller)]
        path, index = metadata.split_call_name(call.call_name)
        if call.function is None:  # a module call without ops, recorded by its body
            child = ModuleCall(call.call_name, path, index, call.no_op.qualified_class, parent=parent,
                               node_name=call.no_op.name, call_count=0)
            parent.children.append(child)
            tree_node[id(call)] = child
            continue
        scope = top_scope if call.caller is None else scopes[id(call.caller)]
        node, function = call.node, call.function
        weights = {scope[name] for name in node.input if name in scope}
        node_props = metadata.call_props(node, function)
        child = ModuleCall(
            key=call.call_name,
            module_path=path,
            call_index=index,
            qualified_class=node_props.get(metadata.CLASS, ""),
            package=node_props.get(metadata.PACKAGE, ""),
            version=node_props.get(metadata.PACKAGE_VERSION, ""),
            source=node_props.get(metadata.SOURCE),
            parent=parent,
            function=(function.domain, function.name),
            overload=function.overload,
            num_nodes=len(function.node),
            parameters=sum(sizes[w] for w in weights),
            call_count=call_count[function_id(function)],
            node_name=node.name,
        )
        parent.children.append(child)
        tree_node[id(call)] = child
        # Formal inputs carry the caller's actual values into the body.
        scopes[id(call)] = {
            formal: scope[actual] for formal, actual in zip(function.input, node.input) if actual in scope
        }
    return CallTree(root)


def weight_sources(model: onnx.ModelProto) -> dict[str, dict[str, str]]:
    """Per call name, the formal inputs of the call's body that receive a main-graph initializer
    (``{formal: initializer}``), followed through its callers' formal inputs, as the tree counts
    parameters; ``""`` (the main graph) maps each initializer to itself.

    A body shared by ``h.0`` and ``h.1`` gives each call its own weights: what ``diff`` hashes
    to tell two calls of one function apart. Values computed on the way are not weights.
    """
    produced = {name for node in all_nodes(model.graph.node) for name in node.output}
    names = [tensor.name for tensor in model.graph.initializer]
    names += [sparse.values.name for sparse in model.graph.sparse_initializer]
    top = {name: name for name in names if name not in produced}
    sources: dict[str, dict[str, str]] = {"": top}
    scopes: dict[int, dict[str, str]] = {}
    for call in metadata.expanded_calls(model, module_calls_only=False):
        scope = top if call.caller is None else scopes[id(call.caller)]
        scopes[id(call)] = {
            formal: scope[actual] for formal, actual in zip(call.function.input, call.node.input) if actual in scope
        }
        sources[call.call_name] = scopes[id(call)]
    return sources


def call_weights(model: onnx.ModelProto) -> dict[str, set[str]]:
    """The main-graph initializers that reach each call (by call name), followed through the
    formal inputs of its callers: what the call's ``parameters`` in :func:`function_tree` count,
    by name (a caller's set holds its callees'). :func:`weight_sources` without the formals."""
    return {name: set(sources.values()) for name, sources in weight_sources(model).items() if name}


def count_from_model(tree: CallTree, model: onnx.ModelProto) -> None:
    """Set each call's counts (nodes, parameters, calls, node name, function) from the final model.

    ``result.hierarchy`` is built before the optimizer runs; this makes its numbers the ones
    ``onnx-modular tree`` shows for the saved file. Calls are matched by call name and function.
    """
    file_tree = function_tree(model, max_calls=2**62)
    by_name = {call.call_name: call for call in file_tree.walk() if not call.is_root}
    tree.root.num_nodes = file_tree.root.num_nodes
    tree.root.parameters = file_tree.root.parameters
    tree.root.node_name = file_tree.root.node_name
    for call in tree.walk():
        if call.is_root:
            continue
        found = by_name.get(call.call_name)
        if found is None or found.function is None or found.function[1] != (call.function or ("", ""))[1]:
            continue  # not matched by name (torch numbered an instance's calls differently): keep as built
        call.function, call.overload = found.function, found.overload
        call.num_nodes, call.parameters = found.num_nodes, found.parameters
        call.call_count, call.node_name = found.call_count, found.node_name


def count_from_ir(tree: CallTree, model: ir.Model) -> None:
    """:func:`count_from_model` on the final in-memory model, without reading its weights.

    The model is serialized once with every initializer's value replaced, for the time of the
    serialization, by an external-data reference of the same dtype and shape (parameters count
    by shape); streamed or lazily loaded weights are never read, and no file is parsed.
    """
    originals: dict[ir.Value, ir.TensorProtocol] = {}
    try:
        for value in model.graph.initializers.values():
            tensor = value.const_value
            if tensor is None:
                continue
            originals[value] = tensor
            value.const_value = ir.ExternalTensor(
                "weights", 0, 0, tensor.dtype, shape=ir.Shape(tensor.shape), name=value.name or tensor.name
            )
        proto = ir.serde.serialize_model(model)
    finally:
        for value, tensor in originals.items():
            value.const_value = tensor
    count_from_model(tree, proto)


def node_call(node: onnx.NodeProto) -> str | None:
    """The call a node of a flat file came from, by its ``pkg.onnx_modular.module_path`` and
    ``call_index`` metadata (``h.0.attn``, ``shared@1``); ``None`` when it carries none."""
    props = {entry.key: entry.value for entry in node.metadata_props}
    path = props.get(metadata.MODULE_PATH)
    if path is None:
        return None
    index = props.get(metadata.CALL_INDEX, "0")
    return metadata.call_name(path, int(index) if index.isdigit() else 0)


def module_path_tree(model: onnx.ModelProto) -> CallTree | None:
    """The call tree a flat file's nodes record (the flat copy, ``inline``): one call per distinct
    :func:`node_call` of the main graph's nodes, in the order the nodes come, nested as torch's
    ``namespace`` of the node nests them (a module with no node of its own, ``h.0`` around
    ``h.0.attn``, is added with its class from there; without a namespace, under the longest
    path prefix already seen). ``None`` when no node carries a module path. Module calls that
    ran no op are not in it: nothing in the graph ran for them."""
    root = ModuleCall(key="", module_path="", node_name=model.graph.name or "main_graph")
    made: dict[str, ModuleCall] = {"": root}

    def add(key: str, parent: ModuleCall, qualified_class: str) -> ModuleCall:
        path, index = metadata.split_call_name(key)
        call = ModuleCall(key, path, index, qualified_class, parent=parent, call_count=1)
        parent.children.append(call)
        made[key] = call
        return call

    for node in all_nodes(model.graph.node):
        key = node_call(node)
        if key is None:
            root.num_nodes += 1
            continue
        if key not in made:
            props = {entry.key: entry.value for entry in node.metadata_props}
            scopes = namespace_classes(props.get(metadata.NAMESPACE, ""))
            path = metadata.split_call_name(key)[0]
            if scopes:
                ancestors = [scope for scope in scopes if scope and path.startswith(scope + ".")]
            else:
                parts = path.split(".")
                ancestors = [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in made]
            parent = root
            for scope in ancestors:
                parent = made.get(scope) or add(scope, parent, scopes.get(scope, ""))
            add(key, parent, props.get(metadata.CLASS, "") or scopes.get(path, ""))
        made[key].num_nodes += 1
    return CallTree(root) if len(made) > 1 else None
