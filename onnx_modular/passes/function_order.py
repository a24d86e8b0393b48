"""Store local functions callee-first, so that readers that resolve functions in file order work.

The ONNX standard does not order ``ModelProto.functions``, and onnxruntime resolves them in any
order. Other consumers read the list once, front to back, and know only the functions they have
already seen: onnx's ``ReferenceEvaluator`` refuses a file whose ``GPT2Block`` comes before the
``LayerNorm`` it calls (``Node type 'LayerNorm' from domain ... is unknown``). Our passes create
functions caller-first (the outliner makes a module's function before its children's), so every
file the project writes goes through :class:`SortFunctionsPass` on its way to disk
(``files.save.write_checked``, ``files.inline``).

The order is a depth-first post-order from the main graph's calls, in the order the calls
appear: a function comes right after the last of the functions it calls, so the file still reads
roughly in model order (``Embedding``, ``LayerNorm``, ``Conv1D``, ``GPT2Attention``, ...,
``GPT2Block``). Functions the main graph does not reach keep their relative order at the end
(after their own callees).

Example::

    SortFunctionsPass()(model)             # onnx_ir model
    sort_functions_proto(model_proto)      # the same order on an onnx.ModelProto, in place
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

import onnx
import onnx_ir as ir

from onnx_modular.format import metadata

__all__ = ["SortFunctionsPass", "callee_first", "is_callee_first", "sort_functions_proto"]

_Id = TypeVar("_Id", bound=Hashable)


def callee_first(roots: Iterable[_Id], functions: Sequence[_Id], callees: Callable[[_Id], Iterable[_Id]]) -> list[_Id]:
    """``functions`` reordered so that each comes after every function it calls.

    Args:
        roots: The function ids called by the main graph, in call order.
        functions: Every function id, in file order.
        callees: Function id -> the function ids its body calls, in call order
            (ids that are not functions are ignored).

    Cycles (which the ONNX standard forbids) are broken where they are met.
    """
    known = set(functions)
    order: list[_Id] = []
    entered: set[_Id] = set()

    def visit(start: _Id) -> None:
        # Iterative depth-first post-order: deep nesting must not hit Python's recursion limit.
        stack = [(start, iter(callees(start)))]
        entered.add(start)
        while stack:
            function, pending = stack[-1]
            for callee in pending:
                if callee in known and callee not in entered:
                    entered.add(callee)
                    stack.append((callee, iter(callees(callee))))
                    break
            else:
                stack.pop()
                order.append(function)

    for function in [*roots, *functions]:
        if function in known and function not in entered:
            visit(function)
    return order


class SortFunctionsPass(ir.passes.InPlacePass):
    """Reorder ``model.functions`` callee-first (see the module docstring).

    Example::

        SortFunctionsPass()(model)
        assert is_callee_first(ir.to_proto(model))
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        functions = model.functions
        if len(functions) < 2:
            return ir.passes.PassResult(model, modified=False)

        def calls(nodes: Iterable[ir.Node]) -> list[ir.OperatorIdentifier]:
            return [node.op_identifier() for node in nodes]

        body_calls = {key: calls(ir.traversal.RecursiveGraphIterator(f)) for key, f in functions.items()}
        order = callee_first(calls(ir.traversal.RecursiveGraphIterator(model.graph)), list(functions), body_calls.__getitem__)
        if order == list(functions):
            return ir.passes.PassResult(model, modified=False)
        reordered = {key: functions[key] for key in order}
        functions.clear()
        functions.update(reordered)
        return ir.passes.PassResult(model, modified=True)


def _proto_id(node: onnx.NodeProto) -> tuple[str, str, str]:
    return (node.domain, node.op_type, node.overload)


def _proto_calls(graph_nodes: Iterable[onnx.NodeProto]) -> list[tuple[str, str, str]]:
    ids = []
    for node in graph_nodes:
        ids.append(_proto_id(node))
        for graph in metadata.subgraphs(node):
            ids += _proto_calls(graph.node)
    return ids


def sort_functions_proto(model: onnx.ModelProto) -> bool:
    """Reorder ``model.functions`` callee-first, in place (for writers that hold a proto).

    Returns:
        Whether the order changed.
    """
    keys = [(f.domain, f.name, f.overload) for f in model.functions]
    if len(keys) < 2:
        return False
    body_calls = {key: _proto_calls(function.node) for key, function in zip(keys, model.functions)}
    order = callee_first(_proto_calls(model.graph.node), keys, body_calls.__getitem__)
    if order == keys:
        return False
    position = {key: index for index, key in enumerate(order)}
    model.functions.sort(key=lambda f: position[(f.domain, f.name, f.overload)])
    return True


def is_callee_first(model: onnx.ModelProto) -> bool:
    """Whether every function of ``model`` comes after the local functions it calls."""
    seen: set[tuple[str, str, str]] = set()
    local = {(f.domain, f.name, f.overload) for f in model.functions}
    for function in model.functions:
        if any(call in local and call not in seen for call in _proto_calls(function.node)):
            return False
        seen.add((function.domain, function.name, function.overload))
    return True
