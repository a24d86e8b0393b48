"""Every module call's values from one onnxruntime run of the real model, torch-free.

Two ways to look inside a file, both running the model as it is (no inlining, no re-export):

* :func:`instrument` / :func:`call_outputs`: every module call's outputs. A copy of the model is
  *instrumented* so that every call's outputs become extra outputs, all the way up to the main
  graph: each function body gets extra outputs for the calls it makes (and, recursively, for what
  those calls expose), and every call node gets matching extra outputs. A function shared by
  several calls is instrumented once, yet each call site yields its own values, so every call in
  the expanded hierarchy is observed exactly once. ``localize``, ``diff`` and ``convert`` use it.
* :func:`call_values`: the inputs and outputs of a few chosen calls (``extract``): each chosen
  call's chain of callers gets bodies of its own that also return the call's values.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from onnx_modular.calls import targets
from onnx_modular.format import metadata
from onnx_modular.runtime import sessions as runtime

__all__ = ["CallValues", "instrument", "flatten_probes", "call_outputs", "call_values"]



@dataclasses.dataclass
class _Probe:
    """One call node in a body; its observed values are its outputs then its callee's probes'."""

    node_name: str
    module_path: str | None
    function: str
    num_outputs: int
    callee_representative: str
    children: list[_Probe]
    callee: Any = None  # the function, for its recorded calls without ops

    @property
    def width(self) -> int:
        return self.num_outputs + sum(child.width for child in self.children)


def _module_functions(model: ir.Model) -> dict[ir.OperatorIdentifier, ir.Function]:
    return {k: f for k, f in model.functions.items() if metadata.is_module_function(f)}


def _representative(function: ir.Function) -> str:
    return metadata.body_module_path(function) or ""


def instrument(model: ir.Model) -> list[_Probe]:
    """Expose every module call's outputs as graph outputs (in place). Returns the probe tree."""
    functions = _module_functions(model)
    default_opset = model.opset_imports.get("", 18)
    done: dict[ir.OperatorIdentifier, list[_Probe]] = {}

    def instrument_body(container, is_root: bool) -> list[_Probe]:
        probes: list[_Probe] = []
        exposed: list[ir.Value] = []
        for node in list(container):
            function = functions.get(node.op_identifier())
            if function is None:
                continue
            original = len(node.outputs)
            if node.op_identifier() not in done:
                done[node.op_identifier()] = []  # guards against recursion in broken files
                done[node.op_identifier()] = instrument_function(function)
            children = done[node.op_identifier()]
            extra = sum(child.width for child in children)
            node.resize_outputs(original + extra)
            for value in node.outputs[original:]:
                value.name = None
            probes.append(
                _Probe(node.name or "", node.metadata_props.get(metadata.MODULE_PATH), function.name, original,
                       _representative(function), children, function)
            )
            exposed.extend(node.outputs)
        if exposed and not is_root:
            container.opset_imports.setdefault("", default_opset)
        for value in exposed:
            probe_value = ir.Value(name=None, type=value.type, shape=value.shape)
            container.append(ir.Node("", "Identity", [value], outputs=[probe_value]))
            container.outputs.append(probe_value)
        return probes

    def instrument_function(function: ir.Function) -> list[_Probe]:
        return instrument_body(function, is_root=False)

    probes = instrument_body(model.graph, is_root=True)
    # Name the new values so that the model is valid and outputs are addressable.
    common_passes.NameFixPass()(model)
    return probes


def flatten_probes(
    probes: list[_Probe],
    caller: str | None,
    representative: str,
    depth: int,
    out: list,
    counter: metadata.CallCounter,
    no_ops: metadata.NoOpCalls,
    exact: bool = True,
) -> list:
    """Expand probes into (call name, path, index, function, depth, slice of values) in completion order.

    Call indices count calls in execution order, the body's recorded calls without ops included.
    """
    start = 0
    starts = []
    for probe in probes:
        starts.append(start)
        start += probe.width
    for probe, offset in zip(probes, starts):
        no_ops.before_next()
        path = metadata.resolve_module_path(probe.node_name, probe.module_path, caller, representative or None)
        name = counter.name(path, probe.node_name, exact) if probe.module_path is not None else counter(path)
        index = metadata.split_call_name(name)[1]
        entry_children: list = []
        inner = probe.callee_representative or None
        inner_exact = probe.callee is not None and name == metadata.first_call(probe.callee)
        flatten_probes(probe.children, name, probe.callee_representative, depth + 1, entry_children, counter,
                 metadata.NoOpCalls(probe.callee, name, inner, counter, inner_exact), inner_exact)
        for child in entry_children:
            out.append((*child[:5], (offset + probe.num_outputs + child[5][0], offset + probe.num_outputs + child[5][1])))
        out.append((name, path, index, probe.function, depth, (offset, offset + probe.num_outputs)))
    no_ops.rest()
    return out


def call_values(
    model: onnx.ModelProto,
    path: str | os.PathLike,
    wanted: Mapping[str, list[int]],
    feeds: Mapping[str, np.ndarray],
) -> dict[str, tuple[dict[int, np.ndarray], list[np.ndarray]]]:
    """The values entering (formal indices in ``wanted[call]``) and leaving each call, from one
    onnxruntime run of the whole model on ``feeds``.

    Runs a copy in which each call's chain of callers has bodies of its own that also return
    the call's values (the model's other calls keep their shared bodies).
    """
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    # One walk of the calls, again only after a call got bodies of its own: the calls of a class sit
    # mostly in the main graph or in bodies of their own already (a walk per call was quadratic:
    # 2,000 calls took 75 s).
    calls = targets.module_calls(probe)
    counts = collections.Counter(targets.function_id(c.function) for c in calls.values())
    for name in wanted:
        call = calls.get(name)
        # as specialize decides: a caller whose function serves other calls too
        if call is None or any(counts[targets.function_id(c.function)] > 1 for c in targets.chain(call)[:-1]):
            targets.specialize(probe, name)
            calls = targets.module_calls(probe)
            counts = collections.Counter(targets.function_id(c.function) for c in calls.values())
    taken = targets.body_names(probe.graph)
    for function in probe.functions:
        taken |= targets.body_names(function)
    plan = {}
    for name, indices in wanted.items():
        call = calls.get(name) or targets.find_call(probe, name)
        values = [call.node.input[i] if i < len(call.node.input) else "" for i in indices] + list(call.node.output)
        plan[name] = (indices, targets.expose(probe, call, values, taken))
    folder = runtime.external_data_folder(path, model)
    names, arrays = runtime.run(probe.SerializeToString(), feeds, what="model", external_data_folder=folder)
    by_name = dict(zip(names, arrays))
    captured = {}
    for name, (indices, outputs) in plan.items():
        values = [by_name.get(output) if output else None for output in outputs]
        captured[name] = (dict(zip(indices, values[: len(indices)])), values[len(indices) :])
    return captured


@dataclasses.dataclass
class CallValues:
    """One module call's outputs from one run.

    Attributes:
        call_name: As ``onnx-modular tree`` names it (``h.0.attn``, ``shared@1``).
        module_path: The module path (without the call index).
        call_index: Which call of that module (0 for the first).
        function: The name of the function the call runs.
        depth: 1 for a call of the main graph, 2 for a call inside it, ...
        outputs: The call's output arrays, in the order of the function's outputs.
    """

    call_name: str
    module_path: str
    call_index: int
    function: str
    depth: int
    outputs: list[np.ndarray]


def call_outputs(
    model: onnx.ModelProto | ir.Model,
    feeds: Mapping[str, np.ndarray] | Sequence[np.ndarray],
    *,
    external_data_folder: str | os.PathLike | None = None,
    execution_provider: str | None = None,
    what: str = "instrumented model",
) -> tuple[dict[str, np.ndarray], list[CallValues]]:
    """Run ``model`` once on ``feeds`` with every module call's outputs exposed.

    ``model`` is not changed (an instrumented copy runs, in memory; its external data is read
    from ``external_data_folder``, the model's folder, so nothing is written next to it).

    Returns:
        The model's own outputs by name, and one :class:`CallValues` per module call in the order
        the calls finish (children before their parent).
    """
    copy = ir.serde.deserialize_model(model) if isinstance(model, onnx.ModelProto) else (
        ir.serde.deserialize_model(ir.serde.serialize_model(model))
    )
    original = [v.name for v in copy.graph.outputs]
    probes = instrument(copy)
    counter = metadata.CallCounter()
    entries = flatten_probes(probes, None, "", 1, [], counter, metadata.NoOpCalls(copy.graph, None, None, counter, True))
    proto = ir.serde.serialize_model(copy)
    del copy
    # onnxruntime's EliminateIdentity drops a probe's Identity whose input also feeds a node after the call
    # is inlined, leaving that node without its input (a GLU's output read by a Pad: Wav2Vec2-BERT): the probes
    # keep their Identity nodes.
    probed_session = runtime.session(
        proto.SerializeToString(),
        execution_provider,
        external_data_folder=external_data_folder,
        disabled_optimizers=("EliminateIdentity",),
        what=what,
    )
    _, values = runtime.run(probed_session, feeds, what=what)
    outputs = dict(zip(original, values[: len(original)]))
    probed = values[len(original) :]
    calls = [
        CallValues(name, path, index, function, depth, list(probed[begin:end]))
        for name, path, index, function, depth, (begin, end) in entries
    ]
    return outputs, calls


def call_values_by_name(calls: Sequence[CallValues]) -> dict[str, CallValues]:
    """``calls`` by call name."""
    return {c.call_name: c for c in calls}

