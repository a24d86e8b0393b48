"""Selections that a conversion flips: ``TopK``, ``ArgMax`` and ``ArgMin`` of the main graph whose
indices differ between the original and the converted file on the same inputs.

A detector's two-stage head ranks its proposals by score with ``TopK`` and gathers the boxes it
picks; with random weights (or genuinely close scores) the scores are near ties, and the small
drift of int8 weights reorders them: every query then gets another box, and outputs far past any
quantization error move (LW-DETR: 0.91 of the range of ``enc_outputs_coord_logits``, while every
call before the ``TopK`` is within 0.5%). :func:`flipped` names such selections and the calls
whose outputs feed their scores, nearest first (:func:`upstream_calls`), which ``auto_keep``
keeps in the original precision or unquantized first. Torch-free.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import numpy as np
import onnx

from onnx_modular.format import metadata
from onnx_modular.runtime import sessions as runtime

__all__ = ["SELECTION_OPS", "Selection", "selection_values", "run_with_selections", "flipped", "upstream_calls"]

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
    return {
        node.output[SELECTION_OPS[node.op_type]]: node
        for node in model.graph.node
        if node.domain in ("", "ai.onnx") and node.op_type in SELECTION_OPS
        and len(node.output) > SELECTION_OPS[node.op_type] and node.output[SELECTION_OPS[node.op_type]]
    }


def run_with_selections(
    model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], *, folder: str | os.PathLike | None, what: str
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One onnxruntime run of ``model`` (its external data in ``folder``): its outputs, and the index
    outputs of its selections (added as outputs of a copy in memory)."""
    extra = [name for name in selection_values(model) if name not in {v.name for v in model.graph.output}]
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.graph.output.extend(onnx.ValueInfoProto(name=name) for name in extra)
    names, values = runtime.run(copy.SerializeToString(), feeds, what=what, external_data_folder=folder)
    del copy
    count = len(model.graph.output)
    outputs = dict(zip(names[:count], values[:count]))
    selections = {name: outputs[name] for name in selection_values(model) if name in outputs}  # a model output itself
    return outputs, selections | dict(zip(names[count:], values[count:]))


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


def flipped(model: onnx.ModelProto, reference: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray]) -> list[Selection]:
    """The selections whose indices differ between ``reference`` and ``actual`` (by value name)."""
    nodes = selection_values(model)
    calls = main_calls(model) if any(name in actual for name in reference) else {}
    out = []
    for name, expected in reference.items():
        got = actual.get(name)
        if got is None or got.shape != expected.shape or np.array_equal(got, expected):
            continue
        node = nodes[name]
        same = bool(got.ndim and np.array_equal(np.sort(got, axis=-1), np.sort(expected, axis=-1)))
        scores = node.input[0] if node.input else ""
        out.append(Selection(node.name or name, node.op_type, int(np.count_nonzero(got != expected)), int(expected.size),
                             same, upstream_calls(model, scores, calls)))
    return out
