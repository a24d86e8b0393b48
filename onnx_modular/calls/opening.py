"""One call of the main graph opened into it: its body inlined one level, its callees stay calls.
(:func:`open_instrumented`: the calls of an instrumented copy whose values exceed a run's budget.)

:func:`open_call` gives the call its own function first (:func:`~onnx_modular.calls.targets.specialize`,
the one way to give a call bodies of its own), then ``onnx.inliner`` inlines that one function; the
body's nodes and values get their export names back where they are free, and the graph's record of
calls without ops (``no_op_calls``) takes the body's in place of the call. ``split`` opens calls to cut
between the calls of their body (``model`` opened: cuts between decoder layers).

Example::

    opened = open_call(model, "model")   # model.layers.0, ... are now calls of the main graph
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import onnx
import onnx.inliner

from onnx_modular.calls import targets
from onnx_modular.calls.segments import reads
from onnx_modular.errors import InvalidInputError, InvalidModelFileError
from onnx_modular.format import metadata
from onnx_modular.format.text import first_line
from onnx_modular.storage.proto import all_nodes, function_id, node_id

__all__ = ["is_module_call", "open_call", "open_instrumented", "set_no_ops"]


def is_module_call(node: onnx.NodeProto, functions: Mapping) -> bool:
    return metadata.is_module_function(functions.get(node_id(node)))


def open_call(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """Inline the one call ``name`` of the main graph into it (its callees stay calls).

    The call gets its own function first (:func:`~onnx_modular.calls.targets.specialize`), so
    other calls of its function are untouched; onnx.inliner renames the body's values and nodes,
    and the call nodes get their names back (they carry the call index, ``shared@1``). The
    body's recorded calls without ops join the main graph's, at their place.
    """
    call = targets.specialize(model, name, including_call=True)
    if call.caller is not None or not any(node is call.node for node in model.graph.node):
        raise InvalidInputError(
            f"The call {name} sits inside an If/Loop/Scan body: the graph holding it is not a sequence of calls "
            "at the top of the model, and cannot be cut.",
            module_path=name,
            hint="Cut between calls outside control flow (`onnx-modular tree` lists them).",
        )
    functions = {function_id(f): f for f in model.functions}
    position = [n is call.node for n in model.graph.node].index(True)
    calls_before = sum(
        1 for node in model.graph.node[:position] for n in all_nodes([node]) if is_module_call(n, functions)
    )
    body = call.function
    body_nodes = list(body.node)
    body_calls = sum(1 for n in all_nodes(body_nodes) if is_module_call(n, functions))
    merged = _merged_no_ops(model.graph, body, calls_before, body_calls)
    try:
        opened = onnx.inliner.inline_selected_functions(model, [(body.domain, body.name)])
    except Exception as e:  # onnx.inliner raises its own exception types
        raise InvalidModelFileError(
            f"onnx.inliner cannot open the call {name}: {first_line(e)}",
            module_path=name,
            hint="Cut in the main graph (--at with calls of the main graph), and report the model.",
        ) from e
    new_nodes = opened.graph.node
    block = new_nodes[position : position + len(body_nodes)]
    if len(new_nodes) != len(model.graph.node) - 1 + len(body_nodes) or any(
        a.op_type != b.op_type for a, b in zip(block, body_nodes)
    ):
        raise InvalidModelFileError(f"onnx.inliner did not inline the call {name} node for node; it cannot be opened.")
    taken = {n.name for n in new_nodes}
    for inlined, original in zip(block, body_nodes):
        if original.name and original.name not in taken:
            taken.discard(inlined.name)
            inlined.name = original.name
            taken.add(original.name)
    _restore_value_names(opened.graph, block, body_nodes)
    kept = [f for f in opened.functions if function_id(f) != function_id(body)]
    del opened.functions[:]
    opened.functions.extend(kept)
    set_no_ops(opened.graph, merged)
    return opened


def _restore_value_names(graph: onnx.GraphProto, block, body_nodes) -> None:
    """The body's value names back where onnx.inliner suffixed them (``add_733__1``) and the
    original name is free: the stage inputs and outputs keep the names of the export."""
    used = targets.body_names(graph)
    boundary = {v.name for v in graph.input} | {v.name for v in graph.output} | {t.name for t in graph.initializer}
    renames = {}
    for inlined, original in zip(block, body_nodes):
        for new, old in zip(inlined.output, original.output):
            if new and old and new != old and old not in used and new not in boundary:
                renames[new] = old
                used.add(old)
    if not renames:
        return
    for node in all_nodes(graph.node):
        for i, name in enumerate(node.input):
            node.input[i] = renames.get(name, name)
        for i, name in enumerate(node.output):
            node.output[i] = renames.get(name, name)
    for value in graph.value_info:
        value.name = renames.get(value.name, value.name)


def _merged_no_ops(graph: onnx.GraphProto, body: onnx.FunctionProto, position: int, count: int) -> list:
    """The main graph's no-op calls with the opened body's in place of its call."""
    mine, theirs = metadata.no_op_calls(graph), metadata.no_op_calls(body)
    before = [e for e in mine if e.position <= position]
    after = [e for e in mine if e.position > position]
    index = {id(e): i for i, e in enumerate(mine)}
    order = before + [None] * len(theirs) + after
    new_index = {index[id(e)]: i for i, e in enumerate(order) if e is not None}
    merged = []
    for e in before:
        merged.append(dataclasses.replace(e, parent=new_index.get(e.parent, -1)))
    for e in theirs:
        parent = e.parent + len(before) if e.parent >= 0 else -1
        merged.append(dataclasses.replace(e, position=e.position + position, parent=parent))
    for e in after:
        merged.append(dataclasses.replace(e, position=e.position + count - 1, parent=new_index.get(e.parent, -1)))
    return merged


def set_no_ops(graph, entries: list) -> None:
    kept = [p for p in graph.metadata_props if p.key != metadata.NO_OP_CALLS]
    del graph.metadata_props[:]
    graph.metadata_props.extend(kept)
    if entries:
        graph.metadata_props.add(key=metadata.NO_OP_CALLS, value=json.dumps([e.to_json() for e in entries]))


def open_instrumented(model: onnx.ModelProto, ids: set[tuple[str, str]], probes: int) -> tuple[onnx.ModelProto, list[int]] | None:
    """``model`` (an instrumented copy, whole: its last ``probes`` main-graph nodes the probes'
    ``Identity``, :class:`~onnx_modular.calls.capture.Instrumented`) with every call of the functions
    ``ids`` inlined by onnx's inliner, and the index of the main-graph node that makes each probe.
    Unlike :func:`open_call`, the calls' names and values stay as they were: only the runs change.

    A call of the main graph makes every value of the calls it holds in one node: a run that needs
    one of them runs all of it (EfficientNet's encoder holds every block: 22 runs of the whole
    network for a budget of 1 GB). Opened, its calls are nodes of the main graph, and runs go on
    from where the last one stopped. The opened bodies' own probes (``Identity`` nodes that
    return their calls' values) are bypassed: each probe reads the value itself, where it is made
    (an ``Identity`` left reading every probe would keep all of them until the end of a pass).
    ``None`` when the inlined model does not keep the probes last.
    """
    opened = onnx.inliner.inline_selected_functions(model, sorted(ids), exclude=False)
    graph = opened.graph
    nodes = list(graph.node)
    main, tail = nodes[: len(nodes) - probes], nodes[len(nodes) - probes:]
    if any(n.op_type != "Identity" or n.output[0] != v.name for n, v in zip(tail, graph.output[len(graph.output) - probes:])):
        return None
    producer = {name: index for index, node in enumerate(main) for name in node.output if name}

    def source(name: str) -> str:
        for _ in range(len(main)):
            node = main[producer[name]] if name in producer else None
            if node is None or node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
                break
            name = node.input[0]
        return name

    for node in tail:
        node.input[0] = source(node.input[0])
    kept = {v.name for v in graph.output}
    while True:
        read = kept.union(*(reads(n) for n in main + tail))
        live = [n for n in main if not (n.op_type == "Identity" and n.domain in ("", "ai.onnx") and n.output[0] not in read)]
        if len(live) == len(main):
            break
        main = live
    del graph.node[:]
    graph.node.extend(main + tail)
    producer = {name: index for index, node in enumerate(main) for name in node.output if name}
    makers: list[int] = []
    for node in tail:  # a probe of a graph input or an initializer: made with the probe before it
        makers.append(producer.get(node.input[0], makers[-1] if makers else 0))
    return opened, makers
