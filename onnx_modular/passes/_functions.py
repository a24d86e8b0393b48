"""Small helpers shared by the function passes."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import onnx_ir as ir

__all__ = ["all_nodes", "redirect_calls", "callees"]


def all_nodes(model: ir.Model) -> Iterator[ir.Node]:
    """Every node of the main graph and of every function, subgraphs included."""
    yield from ir.traversal.RecursiveGraphIterator(model.graph)
    for function in model.functions.values():
        yield from ir.traversal.RecursiveGraphIterator(function)


def redirect_calls(model: ir.Model, mapping: Mapping[ir.OperatorIdentifier, ir.OperatorIdentifier]) -> int:
    """Point every call of ``old`` function at ``new``, for each ``old -> new`` in mapping."""
    if not mapping:
        return 0
    count = 0
    for node in all_nodes(model):
        target = mapping.get(node.op_identifier())
        if target is not None:
            node.domain, node.op_type, node.overload = target
            count += 1
    return count


def callees(function: ir.Function, functions: Mapping[ir.OperatorIdentifier, ir.Function]) -> set[ir.OperatorIdentifier]:
    """Identifiers of the model-local functions that ``function`` calls directly or in subgraphs."""
    return {
        node.op_identifier()
        for node in ir.traversal.RecursiveGraphIterator(function)
        if node.op_identifier() in functions
    }
