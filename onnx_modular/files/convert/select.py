"""Selections that a conversion flips: ``TopK``, ``ArgMax`` and ``ArgMin`` of the main graph whose
indices differ between the original and the converted file on the same inputs.

A detector's two-stage head ranks its proposals by score with ``TopK`` and gathers the boxes it
picks; with random weights (or genuinely close scores) the scores are near ties, and the small
drift of int8 weights reorders them: every query then gets another box, and outputs far past any
quantization error move (LW-DETR: 0.91 of the range of ``enc_outputs_coord_logits``, while every
call before the ``TopK`` is within 0.5%). :func:`flipped` names such selections and the calls
whose outputs feed their scores, nearest first (:func:`upstream_calls`), which ``auto_keep``
keeps in the original precision or unquantized first.

Selections inside module bodies are watched too, each call's apart: a mixture-of-experts router's
``TopK`` (every layer's gate), a codec's nearest codebook entry (DAC's ``ArgMax`` over distances
its quantizer computes with its own codebook MatMul). The run copy (:func:`exposed`) returns
their indices through extra outputs of every function on the way up; their calls feeding the
scores are found by walking back across bodies (:func:`_inner_upstream`): the calls inside the
body first, then the call that holds the selection (its own ops compute the scores), then the
calls before it in its callers. Torch-free.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Mapping

import numpy as np
import onnx

from onnx_modular.format import metadata
from onnx_modular.runtime import sessions as runtime

__all__ = ["SELECTION_OPS", "Selection", "exposed", "selection_values", "run_with_selections", "flipped", "upstream_calls"]

#: The ops whose integer outputs pick elements by the order of their input.
SELECTION_OPS = {"TopK": 1, "ArgMax": 0, "ArgMin": 0}  # op -> its index output

#: Calls named per flipped selection (nearest first).
_UPSTREAM = 8


@dataclasses.dataclass
class Selection:
    """A selection of the main graph whose indices the conversion changed.

    Attributes:
        node: The node's name; ``op_type``: ``TopK``, ``ArgMax`` or ``ArgMin``.
        changed / total: Index elements that differ, of all.
        same_members: Every row picks the same elements in another order (``TopK``).
        feeding: The calls whose outputs its scores are computed from, nearest first.
    """

    node: str
    op_type: str
    changed: int
    total: int
    same_members: bool
    feeding: list[str]


def selection_values(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    """The index outputs of the main graph's selections, by value name."""
    return {_index(node): node for node in _own_selections(model.graph.node)}


def _selects(node: onnx.NodeProto) -> bool:
    """A selection node whose index output is used."""
    return (node.domain in ("", "ai.onnx") and node.op_type in SELECTION_OPS
            and len(node.output) > SELECTION_OPS[node.op_type] and bool(node.output[SELECTION_OPS[node.op_type]]))


def _index(node: onnx.NodeProto) -> str:
    return node.output[SELECTION_OPS[node.op_type]]


def _own_selections(nodes) -> list[onnx.NodeProto]:
    """A body's top-level selection nodes whose index output is used."""
    return [node for node in nodes if _selects(node)]


class _Inner:
    """The selections inside the model's function bodies: how many index values each function
    returns (its own and its calls'), and the call names of the expanded hierarchy."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.functions = {(f.domain, f.name, f.overload): f for f in model.functions}
        self.counts: dict[tuple[str, str, str], int] = {}
        self.child: dict[tuple[str | None, int], str] = {}  # (caller call name, id(call node)) -> call name
        self.call: dict[str, metadata.ExpandedCall] = {}
        if any(_own_selections(f.node) for f in model.functions):
            for call in metadata.expanded_calls(model, module_calls_only=False):
                if call.node is not None:
                    self.child[(call.caller.call_name if call.caller else None, id(call.node))] = call.call_name
                    self.call[call.call_name] = call

    def count(self, fid: tuple[str, str, str]) -> int:
        if fid not in self.counts:
            self.counts[fid] = 0  # a function that calls itself (a broken file) exposes nothing more
            function = self.functions[fid]
            self.counts[fid] = len(_own_selections(function.node)) + sum(
                self.count(node_id) for node in function.node if (node_id := (node.domain, node.op_type, node.overload)) in self.functions)
        return self.counts[fid]

    def callee(self, node: onnx.NodeProto) -> tuple[str, str, str] | None:
        fid = (node.domain, node.op_type, node.overload)
        return fid if fid in self.functions and self.count(fid) else None

    def selections(self) -> dict[str, tuple[str, onnx.NodeProto]]:
        """The selections inside bodies by key (``call/node``) -> (call name, node), in the order
        :func:`exposed` adds their outputs."""
        return {f"{call}/{node.name or _index(node)}": (call, node) for call, node in self.keys(self.model.graph.node, None)}

    def keys(self, nodes, caller: str | None) -> list[tuple[str, onnx.NodeProto]]:
        """``(call name, selection node)`` of what a body exposes, in the order :func:`exposed` adds
        its outputs: node order, a call's own selections and its calls' as they come."""
        out = []
        for node in nodes:
            if caller is not None and _selects(node):
                out.append((caller, node))
            fid = self.callee(node)
            if fid is not None:
                name = self.child.get((caller, id(node)), f"{caller}.{node.name}" if caller else node.name)
                out += self.keys(self.functions[fid].node, name)
        return out


def exposed(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, str], dict[str, tuple[str, onnx.NodeProto]]]:
    """A copy of ``model`` whose graph outputs also hold the index outputs of its selections: the
    main graph's (by value name) and, each call's apart, those inside function bodies. Returns the
    copy, selection key -> its graph output, and the inner keys -> (call name, node)."""
    inner = _Inner(model)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    outputs = {v.name for v in model.graph.output}
    found = {name: name for name in selection_values(model)}
    copy.graph.output.extend(onnx.ValueInfoProto(name=name) for name in found if name not in outputs)
    keys = inner.selections()
    if not keys:
        return copy, found, {}
    fresh = (f"onnx_modular_selection_{i}" for i in itertools.count())

    def extend(nodes, is_function: bool) -> list[str]:
        """Extra outputs on the calls of ``nodes`` (and Identity copies of own selections)."""
        extra: list[str] = []
        added = []
        for node in nodes:
            if is_function and _selects(node):
                name = next(fresh)
                added.append(onnx.helper.make_node("Identity", [_index(node)], [name]))
                extra.append(name)
            fid = inner.callee(node)
            if fid is not None:
                width = len(inner.functions[fid].output)
                node.output.extend([""] * (width - len(node.output)))  # omitted trailing outputs keep their places
                names = [next(fresh) for _ in range(inner.count(fid))]
                node.output.extend(names)
                extra += names
        nodes.extend(added)
        return extra

    for function in copy.functions:
        fid = (function.domain, function.name, function.overload)
        if inner.count(fid):
            function.output.extend(extend(function.node, True))
    names = extend(copy.graph.node, False)
    copy.graph.output.extend(onnx.ValueInfoProto(name=name) for name in names)
    found.update(zip(keys, names))
    return copy, found, keys


def run_with_selections(
    model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], *, folder: str | os.PathLike | None, what: str
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One onnxruntime run of ``model`` (its external data in ``folder``): its outputs, and the index
    outputs of its selections, each under its key (:func:`exposed`; a copy in memory)."""
    copy, found, _ = exposed(model)
    names, values = runtime.run(copy.SerializeToString(), feeds, what=what, external_data_folder=folder)
    del copy
    by_name = dict(zip(names, values))
    outputs = {v.name: by_name[v.name] for v in model.graph.output if v.name in by_name}
    return outputs, {key: by_name[name] for key, name in found.items() if name in by_name}


def upstream_calls(model: onnx.ModelProto, value: str, call_names: Mapping[str, str], limit: int = _UPSTREAM) -> list[str]:
    """The main-graph calls ``value`` is computed from, nearest first (a walk back over the main graph).

    ``call_names``: main-graph call nodes' first output -> call name.
    """
    producer = {name: node for node in model.graph.node for name in node.output if name}
    found: list[str] = []
    seen = {value}
    frontier = [value]
    while frontier and len(found) < limit:
        following = []
        for name in frontier:
            node = producer.get(name)
            if node is None:
                continue
            call = call_names.get(node.output[0]) if node.output else None
            if call is not None and call not in found:
                found.append(call)
            for read in node.input:
                if read and read not in seen:
                    seen.add(read)
                    following.append(read)
        frontier = following
    return found[:limit]


def main_calls(model: onnx.ModelProto) -> dict[str, str]:
    """The main graph's call nodes: first output -> call name."""
    return {call.node.output[0]: call.call_name for call in metadata.expanded_calls(model, module_calls_only=False)
            if call.depth == 1 and call.node is not None and call.node.output}


def _inner_upstream(inner: _Inner, call_name: str, node: onnx.NodeProto, limit: int = _UPSTREAM) -> list[str]:
    """The calls a selection inside ``call_name``'s body reads its scores from, nearest first: the
    calls of that body, the call itself, then the calls before it in its callers (a walk back)."""
    found: list[str] = []
    producers: dict[int, dict[str, onnx.NodeProto]] = {}
    frontier: list[tuple[str | None, str]] = [(call_name, node.input[0])] if node.input else []
    seen = set(frontier)
    while frontier and len(found) < limit:
        following = []
        for owner, value in frontier:
            call = inner.call.get(owner) if owner is not None else None
            nodes = call.function.node if call is not None and call.function is not None else inner.model.graph.node
            producer = producers.setdefault(id(nodes), {o: n for n in nodes for o in n.output if o})
            made = producer.get(value)
            reads: list[tuple[str | None, str]] = []
            if made is not None:
                child = inner.child.get((owner, id(made)))
                if child is not None and child not in found:
                    found.append(child)
                reads = [(owner, v) for v in made.input if v]
            elif call is not None and call.function is not None and value in call.function.input:
                if owner not in found:
                    found.append(owner)  # its own ops compute the scores from its inputs
                index = list(call.function.input).index(value)
                caller = call.caller.call_name if call.caller else None
                if call.node is not None and index < len(call.node.input) and call.node.input[index]:
                    reads = [(caller, call.node.input[index])]
            for item in reads:
                if item not in seen:
                    seen.add(item)
                    following.append(item)
        frontier = following
    if call_name not in found and len(found) < limit:
        found.append(call_name)
    return found[:limit]


def flipped(model: onnx.ModelProto, reference: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray]) -> list[Selection]:
    """The selections whose indices differ between ``reference`` and ``actual`` (by key: the value
    name of a main-graph selection, ``call/node`` of one inside a body)."""
    nodes = selection_values(model)
    changed = [key for key, expected in reference.items()
               if (got := actual.get(key)) is not None and got.shape == expected.shape and not np.array_equal(got, expected)]
    if not changed:
        return []
    calls = main_calls(model) if any(key in nodes for key in changed) else {}
    inner = _Inner(model) if any(key not in nodes for key in changed) else None
    inner_keys = inner.selections() if inner else {}
    out = []
    for key in changed:
        got, expected = actual[key], reference[key]
        if key in nodes:
            node, name = nodes[key], nodes[key].name or key
            feeding = upstream_calls(model, node.input[0] if node.input else "", calls)
        elif key in inner_keys:
            call_name, node = inner_keys[key]
            name = key
            feeding = _inner_upstream(inner, call_name, node)
        else:
            continue
        same = bool(got.ndim and np.array_equal(np.sort(got, axis=-1), np.sort(expected, axis=-1)))
        out.append(Selection(name, node.op_type, int(np.count_nonzero(got != expected)), int(expected.size), same, feeding))
    return out
