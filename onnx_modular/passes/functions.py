"""Small helpers shared by the function passes."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import onnx_ir as ir

__all__ = ["bodies", "all_nodes", "redirect_calls", "callees", "function_cycle", "keep_formal_inputs"]


def bodies(model: ir.Model) -> list[ir.Graph | ir.Function]:
    """The main graph and every function: the bodies a per-body pass visits."""
    return [model.graph, *model.functions.values()]


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


def function_cycle(model: ir.Model) -> list[ir.OperatorIdentifier] | None:
    """A chain of model-local functions that calls itself (``[f, g, f]``), or ``None``.

    ONNX forbids recursion; the function passes walk callees and need a DAG.
    """
    functions = model.functions
    state: dict[ir.OperatorIdentifier, int] = {}  # 1: on the current path, 2: done
    path: list[ir.OperatorIdentifier] = []

    def visit(identifier: ir.OperatorIdentifier) -> list[ir.OperatorIdentifier] | None:
        state[identifier] = 1
        path.append(identifier)
        for callee in sorted(callees(functions[identifier], functions)):
            if state.get(callee) == 1:
                return path[path.index(callee) :] + [callee]
            if callee not in state and (cycle := visit(callee)) is not None:
                return cycle
        path.pop()
        state[identifier] = 2
        return None

    for identifier in functions:
        if identifier not in state and (cycle := visit(identifier)) is not None:
            return cycle
    return None


def keep_formal_inputs(function: ir.Function, calls, keep: list[int]) -> None:
    """``function`` keeps only its formal inputs at positions ``keep`` (in order), and each call
    of it the matching arguments (trailing omitted ones dropped)."""
    for call in calls:
        arguments = [call.inputs[i] if i < len(call.inputs) else None for i in keep]
        while arguments and arguments[-1] is None:
            arguments.pop()
        for position, argument in enumerate(arguments):
            call.replace_input_with(position, argument)
        call.resize_inputs(len(arguments))
    remaining = [function.inputs[i] for i in keep]
    function.inputs.clear()
    function.inputs.extend(remaining)
