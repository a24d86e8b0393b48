"""Where the nodes of inferred calls go (``calls/inferred.py``): the nodes off the skeleton into
the call common to their readers, and an order of the main graph (still topological) in which
each call's nodes are contiguous, as the outlining pass reads them; the canonical order the search
also runs on.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir

from onnx_modular.passes.export.outline_calls import used_values

__all__ = ["reads", "canonical", "readers_of", "constant_keys", "contiguous_order"]

_GRAPH_ATTRIBUTES = (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)


def reads(node: ir.Node) -> Sequence[ir.Value]:
    """The values ``node`` reads (its subgraphs' reads of outer values included)."""
    if any(attr.type in _GRAPH_ATTRIBUTES for attr in node.attributes.values()):
        return list(used_values(node))
    return [value for value in node.inputs if value is not None]


def canonical(skeleton: Sequence[ir.Node], outputs: Sequence[ir.Value]) -> list[ir.Node]:
    """The skeleton in a canonical topological order, whatever order the file keeps: depth first
    from the graph's outputs, each node after its inputs' producers in input order (a graph tool's
    re-sort puts the layers' nodes anywhere; this walk gives them back one layer at a time)."""
    members = set(skeleton)
    seen: set[ir.Node] = set()
    order: list[ir.Node] = []
    starts = [value.producer() for value in outputs if value.producer() in members]
    for start in [*starts, *reversed(skeleton)]:  # then what reaches no output
        if start in seen:
            continue
        seen.add(start)
        stack = [(start, iter(reads(start)))]
        while stack:
            node, inputs = stack[-1]
            for value in inputs:
                producer = value.producer()
                if producer in members and producer not in seen:
                    seen.add(producer)
                    stack.append((producer, iter(reads(producer))))
                    break
            else:
                stack.pop()
                order.append(node)
    return order


def _common_prefix(stacks: list[tuple[str, ...]]) -> tuple[str, ...]:
    common = stacks[0]
    for stack in stacks[1:]:
        n = 0
        while n < min(len(common), len(stack)) and common[n] == stack[n]:
            n += 1
        common = common[:n]
    return common


def readers_of(nodes: Sequence[ir.Node], members: set[ir.Node]) -> dict[ir.Node, list[ir.Node]]:
    """The readers of each node off the skeleton."""
    readers: dict[ir.Node, list[ir.Node]] = {}
    for node in nodes:
        for value in reads(node):
            producer = value.producer()
            if producer is not None and producer not in members:
                readers.setdefault(producer, []).append(node)
    return readers


def constant_keys(
    graph: ir.Graph, nodes: Sequence[ir.Node], keys: dict[ir.Node, tuple[str, ...]], members: set[ir.Node],
    readers: dict[ir.Node, list[ir.Node]],
) -> None:
    """Keys of the nodes off the skeleton: the calls common to all their readers."""
    outputs = set(graph.outputs)
    for node in reversed(nodes):
        if node in members:
            continue
        stacks = [keys.get(reader, ()) for reader in readers.get(node, ())]
        if not stacks or any(value in outputs for value in node.outputs):
            stacks.append(())
        common = _common_prefix(stacks)
        if common:
            keys[node] = common


def _root_schedule(
    nodes: Sequence[ir.Node], skeleton: Sequence[ir.Node], keys: dict[ir.Node, tuple[str, ...]],
    members: set[ir.Node], readers: dict[ir.Node, list[ir.Node]], pending: list[ir.Node],
) -> dict[int, list[ir.Node]]:
    """Where the root's nodes off the skeleton go: before the top-level call of their first reader
    on the skeleton (by position in ``skeleton``, the members in search order; the end when none
    reads them)."""
    position = {node: i for i, node in enumerate(skeleton)}
    start: list[int] = []
    for i, node in enumerate(skeleton):
        top = keys.get(node, ())[:1]
        start.append(start[-1] if i and top and top == keys.get(skeleton[i - 1], ())[:1] else i)
    due: dict[ir.Node, int] = {}
    for node in reversed(nodes):
        if node not in members:
            due[node] = min(
                (position[r] if r in members else due.get(r, len(skeleton)) for r in readers.get(node, ())),
                default=len(skeleton),
            )
    schedule: dict[int, list[ir.Node]] = {}
    for node in pending:
        at = due[node]
        schedule.setdefault(start[at] if at < len(skeleton) else at, []).append(node)
    return schedule


def contiguous_order(
    graph: ir.Graph, nodes: Sequence[ir.Node], skeleton: Sequence[ir.Node], keys: dict[ir.Node, tuple[str, ...]],
    readers: dict[ir.Node, list[ir.Node]],
) -> list[ir.Node]:
    """``nodes`` in an order (topological) where each call's nodes are contiguous: a node off the
    skeleton where its call begins (the root's: before the top-level call that first reads it)."""
    members = set(skeleton)
    pending: dict[tuple[str, ...], list[ir.Node]] = {}
    for node in nodes:
        if node not in members:
            pending.setdefault(keys.get(node, ()), []).append(node)
    schedule = _root_schedule(nodes, skeleton, keys, members, readers, pending.pop((), []))
    order: list[ir.Node] = []
    placed: set[ir.Node] = set()

    def emit(node: ir.Node) -> None:  # producers first (iterative: graphs are deep)
        stack = [(node, False)]
        while stack:
            item, ready = stack.pop()
            if item in placed:
                continue
            if ready:
                placed.add(item)
                order.append(item)
                continue
            stack.append((item, True))
            stack += [
                (value.producer(), False)
                for value in reads(item)
                if value.producer() is not None and value.producer() not in placed and value.producer().graph is graph
            ]

    for index, node in enumerate(skeleton):
        for early in schedule.pop(index, []):
            emit(early)
        stack = keys.get(node, ())
        for depth in range(1, len(stack) + 1):
            for constant in pending.pop(stack[:depth], []):
                emit(constant)
        emit(node)
    for rest in [*schedule.values(), *pending.values()]:
        for node in rest:
            emit(node)
    return order
