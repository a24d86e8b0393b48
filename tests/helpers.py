"""Helpers that read the structure of an exported modular model."""

from __future__ import annotations

import onnx_ir as ir

from onnx_modular import metadata

DOMAIN_TORCH = "pkg.torch.2.13.0"
DOMAIN_TRANSFORMERS = "pkg.transformers.5.23.0"

CALL_METADATA_KEYS = metadata.CALL_METADATA_KEYS


def functions_by_name(model: ir.Model) -> dict[str, ir.Function]:
    return {f.name: f for f in model.functions.values()}


def is_call(node: ir.Node, model: ir.Model) -> bool:
    """A call of a module-call function (torch's own helper functions excluded)."""
    return metadata.is_module_function(model.functions.get(node.op_identifier()))


def expanded_calls(model: ir.Model) -> list[tuple[str, str, int]]:
    """Every module call reachable from the main graph, expanded through shared bodies.

    Returns (call name, function name, depth) in execution order, from
    :func:`onnx_modular.metadata.expanded_calls` (the same walk the tree and localization use).
    """
    proto = ir.serde.serialize_model(model)
    return [(call.call_name, call.function.name, call.depth) for call in metadata.expanded_calls(proto)]


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
