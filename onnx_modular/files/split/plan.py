"""Where ``split`` cuts: which graph, which calls start a stage, and which nodes and values each stage holds.

``stages=N`` (:func:`plan_stages`): the main graph, then that graph with its heaviest call opened, and
so on (:class:`_Level`); in each, calls that hold only a table join the next call (:func:`_groups`), and
the groups are cut into N consecutive stages whose heaviest is as light as can be (:func:`_partition`);
the first graph within :data:`SHALLOW_PREFERENCE` of the best wins. ``at=`` (:func:`plan_at`): the
named calls, checked to be calls of one graph outside control flow.

:func:`assign` then gives every node of the opened graph to the stage of the call it follows, copies
nodes that read only weights and constants into each stage that uses them, and lists each stage's
inputs, outputs and initializers (:class:`Cut`). Nothing here writes or runs a model.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Mapping, Sequence, Set

import onnx

from onnx_modular.calls import targets
from onnx_modular.errors import InvalidInputError
from onnx_modular.format import metadata
from onnx_modular.storage.proto import function_id, node_id

__all__ = ["SHALLOW_PREFERENCE", "TABLE_SHARE", "Cut", "assign", "plan_at", "plan_stages"]

#: ``stages=N`` keeps the shallowest graph whose heaviest stage is at most this times the best
#: heaviest stage over the graphs along the heaviest call's chain.
SHALLOW_PREFERENCE = 1.25
#: ``stages=N``: a call whose weights are under this share of the heaviest call's of its graph (a
#: rotary table, a norm's scale) is never a stage alone; it joins the next call.
TABLE_SHARE = 0.05


@dataclasses.dataclass
class _Level:
    """One candidate graph: the calls opened to reach it and its calls, with their costs."""

    opened: list[str]
    calls: list[str]
    costs: list[float]


def _levels(model: onnx.ModelProto, calls: Sequence[metadata.ExpandedCall], cost_of) -> Iterator[_Level]:
    """The main graph, then that graph with its heaviest call opened, and so on while the
    heaviest call has calls of its own (``calls``: the model's expanded calls)."""
    children: dict[str | None, list[metadata.ExpandedCall]] = {}
    for call in calls:
        children.setdefault(call.caller.call_name if call.caller is not None else None, []).append(call)
    sequence = [c.call_name for c in children.get(None, []) if _at_top(c, model)]
    opened: list[str] = []
    while sequence:
        yield _Level(list(opened), list(sequence), [cost_of(name) for name in sequence])
        heaviest = max(sequence, key=cost_of)
        inner = [c.call_name for c in children.get(heaviest, []) if _at_top(c, model)]
        if not inner:
            return
        at = sequence.index(heaviest)
        sequence = sequence[:at] + inner + sequence[at + 1 :]
        opened.append(heaviest)


def _at_top(call: metadata.ExpandedCall, model: onnx.ModelProto) -> bool:
    """A call node at the top of its body (not inside an If/Loop/Scan subgraph)."""
    body = call.caller.function.node if call.caller is not None else model.graph.node
    return any(node is call.node for node in body)


def _partition(costs: Sequence[float], parts: int) -> tuple[float, list[int]]:
    """Cut ``costs`` into ``parts`` consecutive groups, the largest group's sum as small as
    possible; returns that sum and the first index of every group after the first."""
    n = len(costs)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    # best[k][i]: the smallest largest group over costs[:i] in k groups; cut[k][i]: where the last group starts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return best[parts][n], sorted(starts)[1:]


def _groups(calls: Sequence[str], bytes_of, callers: Set[str] = frozenset()) -> list[int]:
    """The first index of each group of calls that stages may not separate. A call whose weights
    are a table next to the graph's big calls (under :data:`TABLE_SHARE` of the heaviest call's
    bytes: a rotary table, a norm's scale, no weights at all) and that calls no module of its own
    joins the next call that holds more (trailing ones join the last group), so that no stage
    holds nothing but a table. A call in ``callers`` (one with calls of its own: an encoder
    beside a decoder whose vocabulary table outweighs it twenty times) is never a table. Every
    call is its own group when none holds weights."""
    heaviest = max((bytes_of(name) for name in calls), default=0)
    if heaviest <= 0:
        return list(range(len(calls)))
    starts, open_start = [], 0
    for i, name in enumerate(calls):
        if name in callers or bytes_of(name) > TABLE_SHARE * heaviest:
            starts.append(open_start)
            open_start = i + 1
    return starts


def _class_of(call: metadata.ExpandedCall) -> str:
    for prop in call.node.metadata_props if call.node is not None else ():
        if prop.key == metadata.CLASS:
            return prop.value
    return call.function.name if call.function is not None else ""


def _opened_blocks(calls: Sequence[metadata.ExpandedCall], opened: Sequence[str]) -> list[str]:
    """The opened calls that are one of several calls of their class in their graph (decoder
    layers): cutting inside those is what a user asking for N stages may not expect."""
    siblings: dict[str | None, list[metadata.ExpandedCall]] = {}
    by_name = {}
    for call in calls:
        siblings.setdefault(call.caller.call_name if call.caller is not None else None, []).append(call)
        by_name[call.call_name] = call
    blocks = []
    for name in opened:
        call = by_name.get(name)
        if call is None:
            continue
        peers = siblings.get(call.caller.call_name if call.caller is not None else None, [])
        if sum(_class_of(peer) == _class_of(call) for peer in peers) > 1:
            blocks.append(name)
    return blocks


def plan_stages(model: onnx.ModelProto, stages: int, cost_of, bytes_of=None) -> tuple[list[str], list[str], list[str]]:
    """(opened calls, first call of each stage after the first, notes) for ``stages=N``.

    The first graph whose heaviest stage is within :data:`SHALLOW_PREFERENCE` of the best over
    all graphs. No graph beats an even share (the total over N), so the walk stops at the
    first graph within that factor of it. A call without a weight matrix stays with the next
    call that has one (:func:`_groups`): no stage holds only a rotary table or a norm. When the
    stages outnumber what a graph allows and the cuts go inside repeated blocks (decoder
    layers), a note says so.
    """
    feasible: list[tuple[_Level, float, list[int]]] = []
    last = None
    allowed: list[tuple[_Level, int]] = []
    calls = list(metadata.expanded_calls(model, module_calls_only=False))  # expanded once for the whole plan
    callers = {c.caller.call_name for c in calls if c.caller is not None}
    for level in _levels(model, calls, cost_of):
        last = level
        groups = _groups(level.calls, bytes_of or cost_of, callers)
        allowed.append((level, len(groups)))
        if len(groups) < stages:
            continue
        bounds = [*groups, len(level.calls)]
        group_costs = [sum(level.costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        worst, group_starts = _partition(group_costs, stages)
        feasible.append((level, worst, [groups[i] for i in group_starts]))
        if worst <= SHALLOW_PREFERENCE * sum(level.costs) / stages:
            break
    if not feasible:
        most = max((count for _, count in allowed), default=0)
        shown_calls = ", ".join(last.calls[:6]) + (", ..." if len(last.calls) > 6 else "") if last is not None else "none"
        raise InvalidInputError(
            f"{stages} stages need {stages} module calls in one graph, each stage with more than a table (a "
            f"stage of a rotary table or a norm alone is not made); the graphs that can be cut here allow "
            f"{most} at most ({shown_calls}).",
            hint=f"Ask for {max(most, 2)} stages or fewer, or name the cuts with --at (`onnx-modular tree` lists the calls).",
        )
    smallest = min(worst for _, worst, _ in feasible)
    level, _, starts = next(item for item in feasible if item[1] <= smallest * SHALLOW_PREFERENCE)
    notes = []
    blocks = _opened_blocks(calls, level.opened)
    # the deepest graph that opens no repeated block: the cuts between decoder layers
    between = [(lvl, count) for lvl, count in allowed if not set(lvl.opened) & set(blocks)]
    if blocks and between and between[-1][1] < stages:
        shallow, count = between[-1]
        graph = "the main graph" + (f" with {', '.join(shallow.opened)} opened" if shallow.opened else "")
        notes.append(
            f"{stages} stages outnumber the {count} that {graph} allows: the cuts go inside "
            f"{_short(blocks)}, each cut across stages. Ask for {count} stages or fewer to cut between them, "
            "or name the cuts with --at."
        )
        warnings.warn(notes[-1], UserWarning, stacklevel=3)  # from split()'s caller
    return level.opened, [level.calls[i] for i in starts], notes


def _short(names: Sequence[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def plan_at(model: onnx.ModelProto, at: Sequence[str]) -> tuple[list[str], list[str]]:
    """(opened calls, cut calls) for ``at=``: calls of one graph, none its first call."""
    calls = targets.module_calls(model)
    named: list[metadata.ExpandedCall] = []
    for text in at:
        target = targets.resolve_target(model, text)
        if target.is_class:
            raise InvalidInputError(
                f"--at {text!r} names a class or function ({len(target.call_names)} calls: "
                f"{', '.join(target.call_names[:4])}{', ...' if len(target.call_names) > 4 else ''}), not one call.",
                hint="Give the call path of the first call of each new stage (`onnx-modular tree` lists them).",
            )
        named.append(calls[target.call_names[0]])
    names = [c.call_name for c in named]
    if len(set(names)) != len(names):
        raise InvalidInputError(f"--at names the call {next(n for n in names if names.count(n) > 1)} twice.")
    chains = [targets.chain(call)[:-1] for call in named]  # the callers of each
    shortest = min(chains, key=len)
    for call, callers in zip(named, chains):
        if [c.call_name for c in callers] != [c.call_name for c in shortest]:
            outer = next(c for c in callers if c.call_name not in {s.call_name for s in shortest})
            raise InvalidInputError(
                f"The cut at {call.call_name} is inside the call {outer.call_name}, while "
                f"{named[chains.index(shortest)].call_name} is a call of another graph: cuts fall only between "
                "consecutive calls of one graph.",
                module_path=call.call_name,
                hint=f"Cut at {outer.call_name} itself, or name only calls of one graph (siblings in `onnx-modular tree`).",
            )
        if not _at_top(call, model) or not all(_at_top(c, model) for c in callers):
            raise InvalidInputError(
                f"The call {call.call_name} sits inside an If/Loop/Scan body: its graph is not a sequence of calls "
                "at the top of the model.",
                module_path=call.call_name,
                hint="Cut between calls outside control flow.",
            )
    return [c.call_name for c in shortest], names


# -- the nodes and values of each stage ----------------------------------------------------


def _used(node: onnx.NodeProto) -> list[str]:
    """The values a node reads: its inputs and what its subgraphs read from outside them."""
    names = [n for n in node.input if n]
    for graph in metadata.subgraphs(node):
        names += _outer_names(graph)
    return names


def _outer_names(graph: onnx.GraphProto) -> list[str]:
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    outer = []
    for node in graph.node:
        outer += [n for n in _used(node) if n not in defined]
        defined.update(node.output)
    outer += [v.name for v in graph.output if v.name not in defined]
    return outer


@dataclasses.dataclass
class Cut:
    """One stage before it is written: node indices, inputs, outputs, initializers."""

    nodes: list[int]
    calls: list[str]
    inputs: list[str] = dataclasses.field(default_factory=list)
    outputs: list[str] = dataclasses.field(default_factory=list)
    initializers: list[str] = dataclasses.field(default_factory=list)
    shape_sources: dict[str, str] = dataclasses.field(default_factory=dict)


def assign(model: onnx.ModelProto, cut_calls: list[str]) -> list[Cut]:
    """Every node of the (opened) main graph in the stage of the call it follows."""
    graph = model.graph
    functions = {function_id(f): f for f in model.functions}
    names_by_node = _top_calls(model)
    starts = _cut_starts(names_by_node, cut_calls)
    initializers = {t.name for t in graph.initializer}
    inputs = {v.name for v in graph.input} - initializers
    constant = _constant_nodes(graph, initializers, functions)
    bounds = [0, *starts, len(graph.node)]
    stage_of = {}
    cuts = []
    for k in range(len(bounds) - 1):
        indices = [i for i in range(bounds[k], bounds[k + 1]) if i not in constant]
        for i in indices:
            stage_of[i] = k
        cuts.append(Cut(indices, [names_by_node[i] for i in indices if i in names_by_node]))
    producer = {name: i for i, node in enumerate(graph.node) for name in node.output}
    for cut in cuts:
        cut.nodes = _with_constants(graph, cut.nodes, producer, constant)
    outputs = [v.name for v in graph.output]
    # a model output made by constant nodes no stage reads (a cache's constant field, an opened
    # call's Identity of a lifted constant): the last stage computes it
    unread = {producer[n] for n in outputs if producer.get(n) in constant and not any(producer[n] in c.nodes for c in cuts)}
    if unread:
        cuts[-1].nodes = _with_constants(graph, sorted(set(cuts[-1].nodes) | unread), producer, constant)
    for k, cut in enumerate(cuts):
        _set_reads(graph, cut, initializers, inputs, producer, outputs if k == len(cuts) - 1 else [])
    for k, cut in enumerate(cuts):
        later = {n for other in cuts[k + 1 :] for n in other.inputs}
        made = [n for i in cut.nodes for n in graph.node[i].output if n]
        cut.outputs = [n for n in made if (n in later or n in outputs) and (n in outputs or stage_of.get(producer[n]) == k)]
        if k == len(cuts) - 1:
            cut.outputs += [n for n in outputs if n not in producer and n not in cut.outputs]
    _share_shapes(model, cuts)
    return cuts


def _top_calls(model: onnx.ModelProto) -> dict[int, str]:
    """Main-graph node index -> the name of the call it is (calls with or without a module)."""
    nodes = list(model.graph.node)  # held: protobuf keeps one wrapper per message while one is alive
    index_of = {id(node): i for i, node in enumerate(nodes)}
    return {
        index_of[id(c.node)]: c.call_name
        for c in metadata.expanded_calls(model, module_calls_only=False)
        if c.caller is None and id(c.node) in index_of
    }


def _cut_starts(names_by_node: Mapping[int, str], cut_calls: Sequence[str]) -> list[int]:
    """The node index of each cut's call, in graph order; none may be the graph's first call."""
    top_calls = sorted(names_by_node)
    starts = []
    for name in cut_calls:
        found = [i for i, n in names_by_node.items() if n == name]
        if not found:
            raise InvalidInputError(f"The call {name} is not a call of the graph being cut.", module_path=name)
        starts.append(found[0])
    starts.sort()
    if starts and starts[0] <= top_calls[0]:
        raise InvalidInputError(
            f"A cut at {names_by_node[starts[0]]}, the first call of the graph, leaves the first stage without a call.",
            module_path=names_by_node[starts[0]],
            hint="Name the first call of each *new* stage: a later call.",
        )
    return starts


def _constant_nodes(graph: onnx.GraphProto, initializers: set[str], functions: Mapping) -> set[int]:
    """Nodes that read only weights and constants (transitively): copied where they are used."""
    constant: set[int] = set()
    constant_values = set(initializers)
    for i, node in enumerate(graph.node):
        if node.domain in ("", "ai.onnx") and all(n in constant_values for n in _used(node)) and node_id(node) not in functions:
            constant.add(i)
            constant_values.update(node.output)
    return constant


def _with_constants(graph: onnx.GraphProto, indices: list[int], producer: Mapping[str, int], constant: set[int]) -> list[int]:
    """A stage's nodes and the constant nodes they read (and what those read, in turn)."""
    wanted = set(indices)
    stack = [producer[n] for i in indices for n in _used(graph.node[i]) if n in producer and producer[n] in constant]
    while stack:
        i = stack.pop()
        if i in wanted:
            continue
        wanted.add(i)
        stack += [producer[n] for n in _used(graph.node[i]) if n in producer and producer[n] in constant]
    return sorted(wanted)


def _set_reads(graph: onnx.GraphProto, cut: Cut, initializers: set[str], inputs: set[str], producer: Mapping[str, int],
               unproduced_outputs: Sequence[str]) -> None:
    """A stage's initializers and inputs: what its nodes read and do not make (the last stage
    also reads the model outputs no node makes: ``unproduced_outputs``, filtered here)."""
    made = {n for i in cut.nodes for n in graph.node[i].output}
    read = []
    for i in cut.nodes:
        read += _used(graph.node[i])
    read += [n for n in unproduced_outputs if n not in producer]
    seen = set()
    for name in read:
        if name in seen or name in made:
            continue
        seen.add(name)
        if name in initializers:
            cut.initializers.append(name)
        elif name in inputs or name in producer:
            cut.inputs.append(name)


def _share_shapes(model: onnx.ModelProto, cuts: list[Cut]) -> None:
    """A stage that reads a model input only through ``Shape`` and has another model input of
    the same declared type (every dim named or fixed) reads that one's shape instead."""
    graph = model.graph
    declared = {v.name: v for v in graph.input}
    producer_names = {n for node in graph.node for n in node.output}

    def key(value: onnx.ValueInfoProto):
        tensor = value.type.tensor_type
        if not value.type.HasField("tensor_type") or not tensor.HasField("shape"):
            return None
        dims = []
        for d in tensor.shape.dim:
            if d.HasField("dim_value"):
                dims.append(d.dim_value)
            elif d.dim_param:
                dims.append(d.dim_param)
            else:
                return None
        return tensor.elem_type, tuple(dims)

    for cut in cuts:
        model_inputs = [n for n in cut.inputs if n in declared and n not in producer_names]
        readers: dict[str, list[onnx.NodeProto]] = {n: [] for n in model_inputs}
        for i in cut.nodes:
            node = graph.node[i]
            for name in _used(node):
                if name in readers:
                    readers[name].append(node)
        shape_only = [n for n, nodes in readers.items() if nodes and all(r.op_type == "Shape" and r.domain in ("", "ai.onnx") for r in nodes)]
        for name in shape_only:
            own = [
                other for other in model_inputs
                if other not in shape_only and key(declared[other]) is not None and key(declared[other]) == key(declared[name])
            ]
            if own:
                cut.shape_sources[name] = own[0]
                cut.inputs.remove(name)
