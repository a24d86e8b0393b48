"""One model cut into stages at module boundaries, with a manifest that chains them.

``split("llama.onnx", "stages/", stages=2)`` writes::

    stages/manifest.json
    stages/stage_0/model.onnx [model.onnx.data]  test_data_set_0/input_0.pb ... output_0.pb
    stages/stage_1/model.onnx ...

Cuts fall only between consecutive module calls of one graph. The graph is the main graph, or
the body of a call opened into it: to cut between decoder layers, the ``model`` call
(``LlamaModel``) is opened, i.e. that one call's body is inlined into the main graph, one level
only, so its calls (``model.embed_tokens``, ``model.layers.0``, ...) become calls of the main
graph; their functions stay functions. ``at=`` names the first call of each new stage (calls of
one graph: the graph they share is opened); ``stages=N`` picks the graph and the cuts that
balance the stored weight bytes (or the time each call takes in ``profile``, ``balance="time"``):
the main graph, then the graph with its heaviest call opened, and so on: the first graph
whose best cut is within :data:`SHALLOW_PREFERENCE` of the best of them (an encoder-decoder is
cut between the two, not inside the decoder for a slightly better balance; a decoder LM is
cut between its layers).

Every node of the cut graph belongs to the stage of the call it follows (nodes before the first
call to the first stage); a node that reads only weights and constants is copied into each
stage that uses it. Every tensor a stage produces and a later stage reads (hidden states,
masks, position ids, rotary tables) is an output of the one and an input of the other; a model
input is an input of each stage that reads it, except where a stage reads only the shape of
an input of another stage (the past length from layer 2's cache in the first stage) and has an
input of the same declared type: it reads that one's shape instead, so each KV-cache input goes
to the stage owning its layer. Each stage holds the functions and the weights it uses; a weight
two stages use is stored in both and reported (:attr:`Split.shared_weights`).

``manifest.json``: ``{"stages": [{"file", "inputs": {stage input: model input or
"stage_K/<output>"}, "outputs": [...]}], "outputs": {model output: "stage_K/<output>"}}``.
Each stage's test data are its real inputs and outputs from one onnxruntime run of the whole
model (random inputs, seed 0, unless given), checked on the stage before anything is written.
:func:`run_stages` runs the chain.

External data is read in place and copied tensor by tensor into each stage's own data file
(onnx_ir's writer, through :func:`onnx_modular.storage.save.write_checked`); the folder is
built in a private temporary folder and moved into place whole: all stages or nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import warnings
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import onnx
import onnx.inliner
import onnx_ir as ir

from onnx_modular.calls import targets as _calls
from onnx_modular.calls.tree import call_weights
from onnx_modular.check.parity import allclose, default_tolerance, max_differences
from onnx_modular.errors import InvalidInputError, InvalidModelFileError, ParityError, SaveError
from onnx_modular.files.extract import check_output_folder, write_data_set
from onnx_modular.format import metadata
from onnx_modular.format.text import first_line, shown
from onnx_modular.runtime import sessions as runtime
from onnx_modular.runtime.inputs import feeds_for
from onnx_modular.storage import locks, save
from onnx_modular.storage.checks import check_expanded_size
from onnx_modular.storage.limits import check_count
from onnx_modular.storage.load import load_model_file
from onnx_modular.storage.manifest import check_feeds, check_stage_file, read_manifest
from onnx_modular.storage.proto import all_nodes, function_id, node_id

__all__ = ["split", "run_stages", "Split", "Stage", "MANIFEST", "MODEL_FILE", "SHALLOW_PREFERENCE", "BALANCES"]

#: The manifest's name in the output folder.
MANIFEST = "manifest.json"
#: Each stage's model in its folder (ONNX's test-case layout, as ``extract`` writes).
MODEL_FILE = "model.onnx"
#: ``stages=N`` keeps the shallowest graph whose heaviest stage is at most this times the best
#: heaviest stage over the graphs along the heaviest call's chain.
SHALLOW_PREFERENCE = 1.25
#: ``stages=N``: a call whose weights are under this share of the heaviest call's of its graph (a
#: rotary table, a norm's scale) is never a stage alone; it joins the next call.
TABLE_SHARE = 0.05
#: What ``stages=N`` balances.
BALANCES = ("bytes", "time")


@dataclasses.dataclass
class Stage:
    """One written stage.

    Attributes:
        index: Its place in the chain (``stage_<index>``).
        path: Its model file.
        calls: The module calls of the cut graph it runs (call names, in order).
        inputs: Stage input -> model input name or ``stage_K/<output>``.
        outputs: Its outputs, in order.
        weight_bytes: Bytes of the weights it stores (lifted constants excluded).
        max_abs: Per output, the largest difference of the stage from the whole model's values.
    """

    index: int
    path: pathlib.Path
    calls: list[str]
    inputs: dict[str, str]
    outputs: list[str]
    weight_bytes: int
    max_abs: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Split:
    """What :func:`split` wrote.

    Attributes:
        source: The file that was cut.
        output: The folder written (``manifest.json``, ``stage_<k>/``).
        stages: The stages, in order.
        opened: The calls opened to reach the cut graph (outermost first; empty: the main graph).
        balance: ``"bytes"``, ``"time"``, or ``"at"`` when the cuts were named.
        stage_costs: What was balanced, per stage (bytes, or microseconds for ``"time"``).
        shared_weights: Weights stored in more than one stage -> the stages that store them.
        weight_bytes: Bytes of the source file's weights (lifted constants excluded).
        notes: What the user may not expect of the plan (``stages=N`` cutting inside decoder layers).
    """

    source: str
    output: pathlib.Path
    stages: list[Stage]
    opened: list[str]
    balance: str
    stage_costs: list[float]
    shared_weights: dict[str, list[int]]
    weight_bytes: int
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def manifest(self) -> pathlib.Path:
        return self.output / MANIFEST

    def __str__(self) -> str:
        unit = "us" if self.balance == "time" else "bytes"
        where = "the main graph" + (f" with {', '.join(self.opened)} opened" if self.opened else "")
        lines = [f"{self.source}: {len(self.stages)} stages cut between the calls of {where} ({self.balance})"]
        for stage, cost in zip(self.stages, self.stage_costs):
            calls = stage.calls[0] if len(stage.calls) == 1 else f"{stage.calls[0]} .. {stage.calls[-1]}"
            worst = max(stage.max_abs.values(), default=0.0)
            lines.append(
                f"  stage_{stage.index}: {_count(len(stage.calls), 'call')} ({calls}), {_count(len(stage.inputs), 'input')}, "
                f"{_count(len(stage.outputs), 'output')}, weights {stage.weight_bytes:,} bytes"
                + (f", {cost:,.0f} {unit}" if self.balance == "time" else "")
                + (f"; test data max abs difference {worst:.3g}" if stage.max_abs else "; no test data")
            )
        total = sum(stage.weight_bytes for stage in self.stages)
        lines.append(f"Weights: {total:,} bytes in the stages, {self.weight_bytes:,} in the source.")
        for name, where_stored in self.shared_weights.items():
            lines.append(f"  {name}: stored in stages {', '.join(map(str, where_stored))}")
        lines.append(f"Manifest: {self.manifest}")
        lines.extend(f"Note: {note}" for note in self.notes)
        return "\n".join(lines)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


# -- the graph to cut ----------------------------------------------------------------------


def _tensor_bytes(tensor: onnx.TensorProto) -> int:
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        itemsize = 1
    count = 1
    for dim in tensor.dims:
        count *= int(dim)
    return count * itemsize


def _weight_sizes(model: onnx.ModelProto) -> dict[str, int]:
    """Stored bytes per main-graph initializer; lifted constants (shapes, scalars) count 0."""
    lifted = metadata.lifted_constants(model)
    return {t.name: 0 if t.name in lifted else _tensor_bytes(t) for t in model.graph.initializer}


def _is_module_call(node: onnx.NodeProto, functions: Mapping) -> bool:
    return metadata.is_module_function(functions.get(node_id(node)))


def _open_call(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """Inline the one call ``name`` of the main graph into it (its callees stay calls).

    The call gets its own function first (:func:`~onnx_modular.calls.targets.specialize`), so
    other calls of its function are untouched; onnx.inliner renames the body's values and nodes,
    and the call nodes get their names back (they carry the call index, ``shared@1``). The
    body's recorded calls without ops join the main graph's, at their place.
    """
    call = _calls.specialize(model, name, including_call=True)
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
        1 for node in model.graph.node[:position] for n in all_nodes([node]) if _is_module_call(n, functions)
    )
    body = call.function
    body_nodes = list(body.node)
    body_calls = sum(1 for n in all_nodes(body_nodes) if _is_module_call(n, functions))
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
    _set_no_ops(opened.graph, merged)
    return opened


def _restore_value_names(graph: onnx.GraphProto, block, body_nodes) -> None:
    """The body's value names back where onnx.inliner suffixed them (``add_733__1``) and the
    original name is free: the stage inputs and outputs keep the names of the export."""
    used = _calls.body_names(graph)
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


def _set_no_ops(graph, entries: list) -> None:
    kept = [p for p in graph.metadata_props if p.key != metadata.NO_OP_CALLS]
    del graph.metadata_props[:]
    graph.metadata_props.extend(kept)
    if entries:
        graph.metadata_props.add(key=metadata.NO_OP_CALLS, value=json.dumps([e.to_json() for e in entries]))


@dataclasses.dataclass
class _Level:
    """One candidate graph: the calls opened to reach it and its calls, with their costs."""

    opened: list[str]
    calls: list[str]
    costs: list[float]


def _levels(model: onnx.ModelProto, cost_of) -> Iterator[_Level]:
    """The main graph, then that graph with its heaviest call opened, and so on while the
    heaviest call has calls of its own."""
    children: dict[str | None, list[metadata.ExpandedCall]] = {}
    for call in metadata.expanded_calls(model, module_calls_only=False):
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


def _groups(calls: Sequence[str], bytes_of) -> list[int]:
    """The first index of each group of calls that stages may not separate. A call whose weights
    are a table next to the graph's big calls (under :data:`TABLE_SHARE` of the heaviest call's
    bytes: a rotary table, a norm's scale, no weights at all) joins the next call that holds more
    (trailing ones join the last group), so that no stage holds nothing but a table. Every call is
    its own group when none holds weights."""
    heaviest = max((bytes_of(name) for name in calls), default=0)
    if heaviest <= 0:
        return list(range(len(calls)))
    starts, open_start = [], 0
    for i, name in enumerate(calls):
        if bytes_of(name) > TABLE_SHARE * heaviest:
            starts.append(open_start)
            open_start = i + 1
    return starts


def _class_of(call: metadata.ExpandedCall) -> str:
    for prop in call.node.metadata_props if call.node is not None else ():
        if prop.key == metadata.CLASS:
            return prop.value
    return call.function.name if call.function is not None else ""


def _opened_blocks(model: onnx.ModelProto, opened: Sequence[str]) -> list[str]:
    """The opened calls that are one of several calls of their class in their graph (decoder
    layers): cutting inside those is what a user asking for N stages may not expect."""
    siblings: dict[str | None, list[metadata.ExpandedCall]] = {}
    by_name = {}
    for call in metadata.expanded_calls(model, module_calls_only=False):
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


def _plan_stages(model: onnx.ModelProto, stages: int, cost_of, bytes_of=None) -> tuple[list[str], list[str], list[str]]:
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
    for level in _levels(model, cost_of):
        last = level
        groups = _groups(level.calls, bytes_of or cost_of)
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
    blocks = _opened_blocks(model, level.opened)
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


def _plan_at(model: onnx.ModelProto, at: Sequence[str]) -> tuple[list[str], list[str]]:
    """(opened calls, cut calls) for ``at=``: calls of one graph, none its first call."""
    calls = _calls.module_calls(model)
    named: list[metadata.ExpandedCall] = []
    for text in at:
        target = _calls.resolve_target(model, text)
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
    chains = [_calls.chain(call)[:-1] for call in named]  # the callers of each
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


# -- stages --------------------------------------------------------------------------------


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
class _Cut:
    """One stage before it is written: node indices, inputs, outputs, initializers."""

    nodes: list[int]
    calls: list[str]
    inputs: list[str] = dataclasses.field(default_factory=list)
    outputs: list[str] = dataclasses.field(default_factory=list)
    initializers: list[str] = dataclasses.field(default_factory=list)
    shape_sources: dict[str, str] = dataclasses.field(default_factory=dict)


def _assign(model: onnx.ModelProto, cut_calls: list[str]) -> list[_Cut]:
    """Every node of the (opened) main graph in the stage of the call it follows."""
    graph = model.graph
    functions = {function_id(f): f for f in model.functions}
    nodes = list(graph.node)  # held: protobuf keeps one wrapper per message while one is alive
    index_of = {id(node): i for i, node in enumerate(nodes)}
    names_by_node = {
        index_of[id(c.node)]: c.call_name
        for c in metadata.expanded_calls(model, module_calls_only=False)
        if c.caller is None and id(c.node) in index_of
    }
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
    initializers = {t.name for t in graph.initializer}
    inputs = {v.name for v in graph.input} - initializers
    # Nodes that read only weights and constants (transitively) are copied where they are used.
    constant: set[int] = set()
    constant_values = set(initializers)
    for i, node in enumerate(graph.node):
        if node.domain in ("", "ai.onnx") and all(n in constant_values for n in _used(node)) and node_id(node) not in functions:
            constant.add(i)
            constant_values.update(node.output)
    bounds = [0, *starts, len(graph.node)]
    stage_of = {}
    cuts = []
    for k in range(len(bounds) - 1):
        indices = [i for i in range(bounds[k], bounds[k + 1]) if i not in constant]
        for i in indices:
            stage_of[i] = k
        cuts.append(_Cut(indices, [names_by_node[i] for i in indices if i in names_by_node]))
    producer = {name: i for i, node in enumerate(graph.node) for name in node.output}
    # constant nodes go to every stage that reads them (and what they read, in turn)
    for cut in cuts:
        wanted = set(cut.nodes)
        stack = [producer[n] for i in cut.nodes for n in _used(graph.node[i]) if n in producer and producer[n] in constant]
        while stack:
            i = stack.pop()
            if i in wanted:
                continue
            wanted.add(i)
            stack += [producer[n] for n in _used(graph.node[i]) if n in producer and producer[n] in constant]
        cut.nodes = sorted(wanted)
    outputs = [v.name for v in graph.output]
    for k, cut in enumerate(cuts):
        made = {n for i in cut.nodes for n in graph.node[i].output}
        read = []
        for i in cut.nodes:
            read += _used(graph.node[i])
        if k == len(cuts) - 1:
            read += [n for n in outputs if n not in producer]
        seen = set()
        for name in read:
            if name in seen or name in made:
                continue
            seen.add(name)
            if name in initializers:
                cut.initializers.append(name)
            elif name in inputs or name in producer:
                cut.inputs.append(name)
    for k, cut in enumerate(cuts):
        later = {n for other in cuts[k + 1 :] for n in other.inputs}
        made = [n for i in cut.nodes for n in graph.node[i].output if n]
        cut.outputs = [n for n in made if (n in later or n in outputs) and (n in outputs or stage_of.get(producer[n]) == k)]
        if k == len(cuts) - 1:
            cut.outputs += [n for n in outputs if n not in producer and n not in cut.outputs]
    # a model output computed by a copied constant node: the last stage returns it
    for name in outputs:
        if not any(name in cut.outputs for cut in cuts):
            cuts[-1].outputs.append(name)
    _share_shapes(model, cuts)
    return cuts


def _share_shapes(model: onnx.ModelProto, cuts: list[_Cut]) -> None:
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


# -- types ---------------------------------------------------------------------------------


def _types(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Declared or inferred types of the main graph's values (onnx's shape inference, symbolic)."""
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    for tensor in bare.graph.initializer:  # shapes only: no weight is read
        tensor.ClearField("raw_data")
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT
        for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
            tensor.ClearField(field)
    known = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(bare, check_type=False, strict_mode=False)
        known.update({v.name: v for v in inferred.graph.value_info})
    except Exception:  # inference is a help here, not a requirement: types then come from the run
        pass
    known.update({v.name: v for v in model.graph.value_info})
    known.update({v.name: v for v in model.graph.input})
    known.update({v.name: v for v in model.graph.output})
    return known


def _value_info(name: str, types: Mapping[str, onnx.ValueInfoProto], array: np.ndarray | None) -> onnx.ValueInfoProto:
    value = types.get(name)
    if value is not None and value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
        if array is None or value.type.tensor_type.HasField("shape") and len(value.type.tensor_type.shape.dim) == array.ndim:
            typed = onnx.ValueInfoProto()
            typed.CopyFrom(value)
            typed.name = name
            return typed
    if array is None:
        raise InvalidInputError(
            f"onnx's shape inference gives no type for {shown(name)!r}, a value crossing a cut, and without the "
            "test-data run there is nothing else to take it from.",
            hint="Split with the test data (drop --no-data / with_data=False), or cut elsewhere.",
        )
    elem = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
    return onnx.helper.make_tensor_value_info(name, elem, [None] * array.ndim)  # rank known, sizes free


# -- building and writing ------------------------------------------------------------------


def _stage_model(
    model: onnx.ModelProto, cut: _Cut, k: int, count: int, types, values, source: str, opened: list[str], positions
) -> onnx.ModelProto:
    graph = model.graph
    stage = onnx.GraphProto(name=f"{graph.name or 'main_graph'}_stage_{k}")
    for i in cut.nodes:
        node = onnx.NodeProto()
        node.CopyFrom(graph.node[i])
        if node.op_type == "Shape" and node.domain in ("", "ai.onnx"):
            node.input[0] = cut.shape_sources.get(node.input[0], node.input[0])
        stage.node.append(node)
    stage.input.extend(_value_info(n, types, values.get(n)) for n in cut.inputs)
    stage.output.extend(_value_info(n, types, values.get(n)) for n in cut.outputs)
    by_name = {t.name: t for t in graph.initializer}
    stage.initializer.extend(by_name[n] for n in cut.initializers)
    boundary = set(cut.inputs) | set(cut.outputs) | set(cut.initializers)
    inner = {n for node in stage.node for n in node.output} - boundary
    stage.value_info.extend(v for v in graph.value_info if v.name in inner)
    for entry in graph.metadata_props:
        if entry.key != metadata.NO_OP_CALLS:
            stage.metadata_props.add(key=entry.key, value=entry.value)
    first, last = positions
    recorded = metadata.no_op_calls(graph)
    mine = [i for i, e in enumerate(recorded) if first <= e.position and (last is None or e.position < last)]
    if mine:
        new_index = {old: new for new, old in enumerate(mine)}
        _set_no_ops(stage, [
            dataclasses.replace(recorded[i], position=recorded[i].position - first,
                                parent=new_index.get(recorded[i].parent, -1))
            for i in mine
        ])
    built = _calls.standalone_model(model, stage, "onnx_modular.split")
    lifted = [n for n in cut.initializers if n in metadata.lifted_constants(model)]
    entries = {
        metadata.SPLIT_FROM: os.path.basename(source),
        metadata.SPLIT_STAGE: f"{k}/{count}",
        metadata.SPLIT_OPENED: json.dumps(opened),
    }
    if lifted:
        entries[metadata.LIFTED_CONSTANTS] = json.dumps(lifted)
    onnx.helper.set_model_props(built, entries)
    _serve_stage_calls(built)
    built.doc_string = (
        f"Stage {k} of {count} of {os.path.basename(source)}, cut by onnx_modular at module boundaries: "
        f"calls {', '.join(cut.calls)}."
    )
    return built


def _serve_stage_calls(stage: onnx.ModelProto) -> None:
    """Each function's ``module_paths`` and ``call_count`` as the stage calls it; a body written
    for a call of another stage is rebased onto its first call here (its nested call names)."""
    served: dict = {}
    for call in metadata.expanded_calls(stage):
        served.setdefault(function_id(call.function), []).append(call.call_name)
    for function in stage.functions:
        names = served.get(function_id(function), [])
        if metadata.MODULE_PATHS not in metadata.props(function) or not names:
            continue
        written_for = metadata.body_module_path(function)
        _calls.set_prop(function, metadata.MODULE_PATHS, json.dumps(names))
        _calls.set_prop(function, metadata.CALL_COUNT, str(len(names)))
        _calls.rebase_body(function, written_for, metadata.strip_call_index(names[0]))


def _write_stage(built: onnx.ModelProto, folder: pathlib.Path, destination: pathlib.Path, source_folder: str) -> pathlib.Path:
    """Write one stage with onnx_ir: weights stored externally in the source are copied tensor by
    tensor into the stage's own data file (``model.onnx.data``); others as the size decides."""
    folder.mkdir()
    as_ir = ir.serde.deserialize_model(built)
    ir.external_data.set_base_dir(as_ir.graph, source_folder)
    staging = save.Staging(folder, destination)
    external = any(onnx.external_data_helper.uses_external_data(t) for t in built.graph.initializer)
    return save.write_checked(as_ir, staging, external_data=True if external else None)


def _check_stage(path: pathlib.Path, k: int, feeds, expected: Mapping[str, np.ndarray]) -> dict[str, float]:
    names, actual = runtime.run(str(path), feeds, what=f"stage {k}")
    differences = {}
    for name, got in zip(names, actual):
        want = expected[name]
        tolerance = default_tolerance(want.dtype)
        differences[name] = max_differences(got, want)[0] if want.size else 0.0
        if not allclose(got, want, tolerance):
            raise ParityError(
                f"Stage {k} does not reproduce the whole model's value {shown(name)!r}: max abs difference "
                f"{differences[name]:.3g} (atol {tolerance.atol:g}, rtol {tolerance.rtol:g}).",
                hint="Nothing was written. A model with random ops differs on every run; otherwise check the file "
                "with `onnx-modular verify`, and report it with the model.",
            )
    return differences


def _check_arguments(stages, at, balance) -> list[str] | None:
    if (stages is None) == (at is None):
        raise InvalidInputError("Give either stages= (--stages N) or at= (--at PATH ...), not both or neither.")
    if balance not in BALANCES:
        raise InvalidInputError(f"balance must be one of {', '.join(BALANCES)}, not {balance!r}.")
    if stages is not None:
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 2:
            raise InvalidInputError(f"stages must be an integer >= 2, not {stages!r}.")
        check_count("MAX_STAGES", stages, "stages")
        return None
    if isinstance(at, str):
        at = [at]
    at = list(at)
    if not at or not all(isinstance(a, str) and a for a in at):
        raise InvalidInputError(f"at must name one call path or more, not {at!r}.")
    check_count("MAX_STAGES", len(at) + 1, "stages (the cuts of at= and one)")
    if balance != "bytes":
        raise InvalidInputError("balance= chooses the cuts of stages=N; with at= the cuts are named.")
    return at


def split(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    stages: int | None = None,
    at: str | Sequence[str] | None = None,
    balance: str = "bytes",
    inputs: str | os.PathLike | Mapping[str, np.ndarray] | None = None,
    with_data: bool = True,
) -> Split:
    """Cut a modular file into stages at module boundaries and write them with a manifest.

    Args:
        path: The modular ``.onnx`` file.
        out_dir: A new (or empty) folder: ``manifest.json`` and ``stage_<k>/model.onnx`` with its
            test data (``test_data_set_0/input_<i>.pb``, ``output_<i>.pb``).
        stages: How many stages; the graph and cuts that balance ``balance``.
        at: The first call of each new stage (call paths of one graph, ``model.layers.2``).
        balance: ``"bytes"`` (stored weight bytes) or ``"time"`` (each call's time in
            :func:`onnx_modular.profile`, on the same inputs), for ``stages``.
        inputs: The whole model's inputs for the run that makes the test data (an ``.npz`` or
            arrays by name); random from the declared shapes (seed 0) by default.
        with_data: ``False`` skips that run (for a model onnxruntime cannot hold in memory): no
            test data, no check of the stages; types come from onnx's shape inference.

    Returns:
        What was written (:class:`Split`; ``str()`` is a report).

    Raises:
        InvalidInputError: Both or neither of ``stages``/``at``; a path that is not a call (the
            closest names are listed); cuts in different graphs (a cut inside a call); a cut at
            a graph's first call; more stages than calls; a call inside control flow; an output
            folder that is not new or empty. Nothing is written.
        InvalidModelFileError: The file cannot be read.
        ParityError: A stage does not reproduce the whole model's values. Nothing is written.

    Example::

        result = split("llama.onnx", "stages/", stages=2)
        outputs = run_stages("stages/", {"input_ids": ids, ...})
    """
    at = _check_arguments(stages, at, balance)
    folder = check_output_folder(out_dir)
    source = str(path)
    source_folder = os.path.dirname(os.path.abspath(source))
    model = load_model_file(path)  # external data stays where it is
    check_expanded_size(model, name=repr(source))  # call bombs and endless Loops, before any work
    if not model.functions:
        raise InvalidInputError(
            f"{source!r} has no local functions: there are no module boundaries to cut at.",
            hint="Export the model with onnx_modular.export_modular first.",
        )
    if not with_data and inputs is not None:
        raise InvalidInputError("inputs= are for the test-data run, which with_data=False (--no-data) skips.")
    if not with_data and balance == "time":
        raise InvalidInputError("balance='time' runs the model to profile it; with_data=False (--no-data) is for "
                                "models that are not run.", hint="Balance by bytes, or keep the test data.")
    feeds = feeds_for(model, inputs) if with_data else {}
    sizes = _weight_sizes(model)
    weights = call_weights(model)
    times: dict[str, float] = {}
    if balance == "time":
        from onnx_modular.profiling.run import profile

        report = profile(path, feeds, runs=5, warmup=1)
        times = {item.key: item.inclusive_us for item in report.calls()}

    def weight_bytes(name: str) -> float:
        return float(sum(sizes.get(w, 0) for w in weights.get(name, ())))

    def cost_of(name: str) -> float:
        return times.get(name, 0.0) if balance == "time" else weight_bytes(name)

    notes: list[str] = []
    if at is not None:
        opened, cut_calls = _plan_at(model, at)
    else:
        opened, cut_calls, notes = _plan_stages(model, stages, cost_of, weight_bytes)
    for name in opened:
        model = _open_call(model, name)
    cuts = _assign(model, cut_calls)
    count = len(cuts)
    values = _run_whole(model, path, cuts, feeds) if with_data else {}
    crossing = {name for cut in cuts for name in (*cut.inputs, *cut.outputs)}
    check_count("MAX_TEST_DATA_BYTES", sum(getattr(values.get(n), "nbytes", 0) for n in crossing),
                "The test data of the stages (the values they pass each other; --no-data skips it), in bytes,")
    types = _types(model)
    positions = _call_positions(model, cuts)
    built = [
        _stage_model(model, cut, k, count, types, values, source, opened, positions[k]) for k, cut in enumerate(cuts)
    ]
    graph_outputs = [v.name for v in model.graph.output]
    producer_stage = {n: k for k, cut in enumerate(cuts) for n in cut.outputs}
    manifest_stages = []
    for k, cut in enumerate(cuts):
        sources = {}
        for name in cut.inputs:
            stage_k = producer_stage.get(name)
            sources[name] = f"stage_{stage_k}/{name}" if stage_k is not None and stage_k < k else name
        manifest_stages.append({"file": f"stage_{k}/{MODEL_FILE}", "inputs": sources, "outputs": list(cut.outputs)})
    manifest = {
        "stages": manifest_stages,
        "outputs": {name: f"stage_{producer_stage[name]}/{name}" for name in graph_outputs},
    }
    stored: dict[str, list[int]] = {}
    for k, cut in enumerate(cuts):
        for name in cut.initializers:
            if sizes.get(name, 0):
                stored.setdefault(name, []).append(k)
    shared = {name: where for name, where in stored.items() if len(where) > 1}
    written: list[Stage] = []
    parent = folder.parent if str(folder.parent) else pathlib.Path(".")
    with save.interrupt_on_sigterm(), locks.temp_folder(parent) as tmp:
        staged = tmp / "out"
        staged.mkdir()
        for k, (cut, stage_model) in enumerate(zip(cuts, built)):
            stage_folder = staged / f"stage_{k}"
            model_path = _write_stage(stage_model, stage_folder, folder / f"stage_{k}" / MODEL_FILE, source_folder)
            differences = {}
            if with_data:
                stage_feeds = {n: values[n] for n in cut.inputs}
                expected = {n: values[n] for n in cut.outputs}
                differences = _check_stage(model_path, k, stage_feeds, expected)
                write_data_set(stage_folder / "test_data_set_0", stage_feeds, expected)
            written.append(
                Stage(
                    k, folder / f"stage_{k}" / MODEL_FILE, cut.calls, manifest_stages[k]["inputs"], list(cut.outputs),
                    sum(sizes.get(n, 0) for n in cut.initializers), differences,
                )
            )
        try:
            (staged / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
            os.replace(staged, folder)  # a folder that exists is empty (checked): rename(2) replaces it
        except OSError as e:
            raise SaveError(f"Moving the stages into {str(folder)!r} failed: {e}", hint="Check free disk space and permissions.") from e
    costs = [sum(cost_of(name) for name in cut.calls) for cut in cuts]
    return Split(source, folder, written, opened, balance if at is None else "at", costs, shared, sum(sizes.values()), notes)


def _run_whole(model: onnx.ModelProto, path, cuts: list[_Cut], feeds) -> dict[str, np.ndarray]:
    """One run of the whole (opened) model with every crossing value as an extra output."""
    crossing = [n for cut in cuts for n in cut.outputs]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    present = {v.name for v in probe.graph.output}
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in dict.fromkeys(crossing) if n not in present)
    names, arrays = runtime.run(
        probe.SerializeToString(), feeds, what="model", external_data_folder=runtime.external_data_folder(path, model)
    )
    values = dict(zip(names, arrays))
    values.update(feeds)
    return values


def _call_positions(model: onnx.ModelProto, cuts: list[_Cut]) -> list[tuple[int, int | None]]:
    """Per stage, the range of main-graph call positions (calls with functions) it covers."""
    functions = {function_id(f): f for f in model.functions}
    before = []
    count = 0
    for node in model.graph.node:
        before.append(count)
        count += sum(1 for n in all_nodes([node]) if _is_module_call(n, functions))
    firsts = []
    for cut in cuts:
        calls = [i for i in cut.nodes if _is_module_call(model.graph.node[i], functions)]
        firsts.append(before[calls[0]] if calls else 0)
    firsts[0] = 0
    return [(firsts[k], firsts[k + 1] if k + 1 < len(firsts) else None) for k in range(len(firsts))]


# -- running the chain ---------------------------------------------------------------------


def _read_manifest(folder: pathlib.Path) -> tuple[dict, list[pathlib.Path]]:
    """The manifest read as untrusted input, and its stage files (:mod:`~onnx_modular.storage.manifest`)."""
    return read_manifest(folder, MANIFEST)


def run_stages(
    folder: str | os.PathLike,
    feeds: Mapping[str, np.ndarray],
    execution_providers: str | Sequence[str | None] | None = None,
) -> dict[str, np.ndarray]:
    """Run the stages :func:`split` wrote, in order, in onnxruntime; return the model's outputs.

    Args:
        folder: The folder with ``manifest.json``.
        feeds: The whole model's inputs by name.
        execution_providers: ``None`` (CPU), one provider for every stage (``"cuda"``), or one
            per stage (``None`` entries: CPU).

    Returns:
        The model's outputs by name, in the order of the manifest.

    Raises:
        InvalidInputError: Not a split folder, a missing input, a provider list of another length.
        ExecutionProviderError: This onnxruntime build lacks a provider.
        VerificationError: onnxruntime cannot load or run a stage.

    Example::

        outputs = run_stages("stages/", {"input_ids": ids, "attention_mask": mask}, ["cuda", None])
    """
    folder = pathlib.Path(folder)
    manifest, files = _read_manifest(folder)
    stages = manifest["stages"]
    feeds = check_feeds(feeds, len(stages))
    for k, file in enumerate(files):  # every stage with the bounds of every tool, before anything runs
        check_stage_file(file, k)
    if execution_providers is None or isinstance(execution_providers, str):
        providers = [execution_providers] * len(stages)
    else:
        providers = list(execution_providers)
        if len(providers) != len(stages):
            raise InvalidInputError(
                f"{len(providers)} execution providers for {len(stages)} stages.",
                hint="Give one provider for all stages, or one per stage.",
            )
    produced: dict[str, np.ndarray] = {}
    for k, (stage, provider) in enumerate(zip(stages, providers)):
        stage_feeds = {}
        for name, source in stage["inputs"].items():
            if source in produced:
                stage_feeds[name] = produced[source]
            elif source in feeds:
                stage_feeds[name] = feeds[source]
            else:
                raise InvalidInputError(
                    f"Stage {k} needs {shown(source)!r} (as its input {shown(name)!r}), which the inputs do not hold.",
                    hint=f"Give every model input the manifest names ({MANIFEST}).",
                )
        session = runtime.session(str(files[k]), provider, what=f"stage {k}")
        names, arrays = runtime.run(session, stage_feeds, what=f"stage {k}")
        produced.update({f"stage_{k}/{name}": array for name, array in zip(names, arrays)})
    return {name: produced[source] for name, source in manifest["outputs"].items()}
