"""Helpers that read the structure of an exported modular model."""

from __future__ import annotations

import onnx
import onnx_ir as ir

DOMAIN_TORCH = "pkg.torch.2.13.0"
DOMAIN_TRANSFORMERS = "pkg.transformers.5.23.0"

CALL_METADATA_KEYS = {
    "pkg.onnx_modular.module_path",
    "pkg.onnx_modular.call_index",
    "pkg.onnx_modular.class",
    "pkg.onnx_modular.package",
    "pkg.onnx_modular.package_version",
    "namespace",
}


def functions_by_name(model: ir.Model) -> dict[str, ir.Function]:
    return {f.name: f for f in model.functions.values()}


def is_call(node: ir.Node, model: ir.Model) -> bool:
    """A call of a module-call function (torch's own helper functions excluded)."""
    function = model.functions.get(node.op_identifier())
    return function is not None and "pkg.onnx_modular.class" in function.metadata_props


def expanded_calls(model: ir.Model) -> list[tuple[str, str, int]]:
    """Every module call reachable from the main graph, expanded through shared bodies.

    Returns (call name, function name, depth) in execution order. A function
    shared by N calls is walked N times, so this counts calls, not definitions. Call
    nodes inside a body are named relative to it (``attn`` in ``GPT2Block``); the call name
    is resolved through the caller (``h.1.attn``), unless the node already holds its full
    module path (an instance reached through another attribute).
    """
    calls = []

    def without_index(name):  # "shared@1" -> "shared"
        base, _, index = name.rpartition("@")
        return base if base and index.isdigit() else name

    def resolve(node, caller):
        if caller is None or without_index(node.name) == node.metadata_props.get("pkg.onnx_modular.module_path"):
            return node.name
        return f"{without_index(caller)}.{node.name}"

    def walk(nodes, depth, caller):
        for node in nodes:
            function = model.functions.get(node.op_identifier())
            if function is not None and is_call(node, model):
                name = resolve(node, caller)
                calls.append((name, function.name, depth))
                walk(function, depth + 1, name)
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.GRAPH:
                    walk(attr.value, depth, caller)

    walk(model.graph, 1, None)
    return calls


def max_depth(model: ir.Model) -> int:
    return max((depth for _, _, depth in expanded_calls(model)), default=0)


def top_level_calls(model: ir.Model) -> list[str]:
    return [node.name for node in model.graph if is_call(node, model)]


def call_nodes(model: ir.Model) -> list[ir.Node]:
    """Call nodes in the main graph and in every function body."""
    nodes = [n for n in ir.traversal.RecursiveGraphIterator(model.graph) if is_call(n, model)]
    for function in model.functions.values():
        nodes += [n for n in ir.traversal.RecursiveGraphIterator(function) if is_call(n, model)]
    return nodes


def graph_bytes(path) -> int:
    """Serialized size of the model file without weights (initializer data dropped)."""
    proto = onnx.load(str(path), load_external_data=False)
    for tensor in proto.graph.initializer:
        for field in ("raw_data", "float_data", "external_data", "int64_data", "int32_data", "data_location"):
            tensor.ClearField(field)
    return proto.ByteSize()
