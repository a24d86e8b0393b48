"""The converted model of one plan, for :func:`onnx_modular.files.convert.tool.convert`.

Every module call gets a plan (low precision or kept; quantized or not). A function whose calls
want different plans is split: the calls that differ get bodies of their own
(:func:`~onnx_modular.calls.targets.specialize`, as ``replace`` does). Then the weight
quantization (:mod:`onnx_modular.passes.precision.quantize_weights`) and the precision change
(:mod:`onnx_modular.passes.precision.casts`) rewrite the bodies, and the main graph's weights become
lazy tensors converted one at a time when the file is written. :func:`build` returns that model
and its :class:`BuildFacts`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import onnx

from onnx_modular.calls import targets as _calls
from onnx_modular.format import metadata
from onnx_modular.passes.precision.casts import FLOAT, WeightSources, clip_for, convert_precision
from onnx_modular.passes.precision.quantize_weights import QuantizeSettings, quantize_weights
from onnx_modular.storage.proto import FunctionId, function_id


@dataclasses.dataclass(frozen=True)
class Plan:
    """What happens to a call's own body."""

    low: bool  # own ops in the new dtype
    quantize: bool  # own MatMul weights to MatMulNBits


#: The plan of a call no plan names.
NO_PLAN = Plan(False, False)


@dataclasses.dataclass
class BuildFacts:
    """What :func:`build` did, for the report.

    Attributes:
        quantized / skipped: The ``MatMulNBits`` made and the weights left (``quantize_weights``).
        weights: Main-graph weights stored in the new dtype; ``float32_weights``: those kept float32.
        casts: ``Cast`` nodes added.
        split: Calls given bodies of their own.
        plans: The plan of every function that has calls.
        calls: The module calls of the converted model, by name.
    """

    quantized: list[tuple[str, str]]
    skipped: list[tuple[str, str, str]]
    weights: int
    float32_weights: list[str]
    casts: int
    split: list[str]
    plans: dict[FunctionId, Plan]
    calls: dict[str, metadata.ExpandedCall]

    def plan_of(self, call_name: str) -> Plan:
        """The plan the call ``call_name`` ran with (none for a call the model no longer has)."""
        call = self.calls.get(call_name)
        return NO_PLAN if call is None else self.plans.get(function_id(call.function), NO_PLAN)


def class_of(call: metadata.ExpandedCall) -> str:
    """A call's class, without its module (``LlamaRMSNorm``)."""
    return metadata.props(call.function).get(metadata.CLASS, "").rsplit(".", 1)[-1] or call.function.name


def selected(model: onnx.ModelProto, names: Iterable[str]) -> set[str]:
    """The call names ``names`` select (closest names listed when one selects nothing)."""
    chosen: set[str] = set()
    for text in names:
        chosen.update(_calls.resolve_target(model, text).call_names)
    return chosen


def under(call: metadata.ExpandedCall, chosen: set[str]) -> bool:
    """The call or one of its callers is chosen."""
    return any(link.call_name in chosen for link in _calls.chain(call))


def _split_plans(model: onnx.ModelProto, plan_of: Callable[[metadata.ExpandedCall], Plan]) -> tuple[dict[FunctionId, Plan], list[str]]:
    """Give calls whose plan differs from their function's other calls bodies of their own.

    Returns the plan of every function that has calls, and the calls given own bodies.
    """
    split: list[str] = []
    copies: dict[tuple[FunctionId, Plan], FunctionId] = {}  # (function, plan) -> the body split off for it
    while True:
        calls = _calls.module_calls(model)
        by_function: dict[FunctionId, dict[Plan, list[str]]] = collections.defaultdict(lambda: collections.defaultdict(list))
        for call in calls.values():
            by_function[function_id(call.function)][plan_of(call)].append(call.call_name)
        mixed = next(((fid, plans) for fid, plans in by_function.items() if len(plans) > 1), None)
        if mixed is None:
            return {fid: next(iter(plans)) for fid, plans in by_function.items()}, split
        fid, plans = mixed
        # the plan of most calls keeps the body; the others move to a body split off once per plan
        majority = max(plans, key=lambda plan: len(plans[plan]))
        plan, name = next((plan, names[0]) for plan, names in plans.items() if plan != majority)
        copy = copies.get((fid, plan))
        if copy is not None and any(function_id(f) == copy for f in model.functions):
            _move_call(model, _calls.specialize(model, name), copy)
        else:
            copies[(fid, plan)] = function_id(_calls.specialize(model, name, including_call=True).function)
        split.append(name)


def _move_call(model: onnx.ModelProto, call: metadata.ExpandedCall, target: FunctionId) -> None:
    """Let ``call`` (whose callers serve it alone) run ``target``, a copy of its function split off
    for another call with the same plan: the two share it, as the export shares bodies."""
    old = call.function
    copy = next(f for f in model.functions if function_id(f) == target)
    remaining = [p for p in metadata.module_paths(old) if p != call.call_name]
    written_for = metadata.body_module_path(old)
    _calls.set_prop(old, metadata.MODULE_PATHS, json.dumps(remaining))
    _calls.set_prop(old, metadata.CALL_COUNT, str(len(remaining)))
    if remaining:  # its nested calls are named after its first call
        _calls.rebase_body(old, written_for, metadata.strip_call_index(remaining[0]))
    paths = [*metadata.module_paths(copy), call.call_name]
    _calls.set_prop(copy, metadata.MODULE_PATHS, json.dumps(paths))
    _calls.set_prop(copy, metadata.CALL_COUNT, str(len(paths)))
    call.node.op_type = copy.name



def weight_sources(model: onnx.ModelProto, calls: Mapping[str, metadata.ExpandedCall]) -> WeightSources:
    """Per function with calls: its weight formals, formal inputs every call feeds from a
    main-graph initializer, with those initializers."""
    by_function: dict[FunctionId, list[metadata.ExpandedCall]] = collections.defaultdict(list)
    for call in calls.values():
        by_function[function_id(call.function)].append(call)
    functions = {function_id(f): f for f in model.functions}
    sources: dict[FunctionId, dict[str, set[str]]] = {}
    main_names = _calls.main_graph_names(model)  # once: per call it made 10,000 calls quadratic
    for fid, its_calls in by_function.items():
        formals: dict[str, set[str]] = {}
        for index, formal in enumerate(functions[fid].input):
            found = [_calls.initializer_source(model, call, index, main_names=main_names) for call in its_calls]
            if found and all(found):
                formals[formal] = set(found)
        sources[fid] = formals
    return sources


def build(
    model: onnx.ModelProto,
    folder: str | None,
    *,
    dtype: int | None,
    low_calls: Callable[[metadata.ExpandedCall], bool],
    root_low: bool,
    quant: Callable[[metadata.ExpandedCall], bool],
    root_quant: bool,
    quantize: QuantizeSettings | None,
    note: Mapping[str, Any],
):
    """The converted model (onnx_ir, weights converted lazily when written) and its :class:`BuildFacts`."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common_passes

    work = onnx.ModelProto()
    work.CopyFrom(model)

    def plan_of(call: metadata.ExpandedCall) -> Plan:
        return Plan(dtype is not None and low_calls(call), quantize is not None and quant(call))

    plans, split = _split_plans(work, plan_of)
    calls = _calls.module_calls(work)
    quantized: list[tuple[str, str]] = []
    skipped: list[tuple[str, str, str]] = []
    sources: dict[str, Callable[[], np.ndarray]] = {}
    if quantize is not None:
        label_of: dict[FunctionId, str] = {}
        for call in calls.values():
            label_of.setdefault(function_id(call.function), call.call_name)
        bodies = [(work.graph, "<main graph>")] if root_quant else []
        bodies += [(f, label_of.get(function_id(f), f.name)) for f in list(work.functions) if plans.get(function_id(f), NO_PLAN).quantize]
        done = quantize_weights(work, bodies, quantize, folder=folder)
        quantized, skipped, sources = done.quantized, done.skipped, done.sources
    initializer_types: dict[str, int] = {}
    casts = 0
    if dtype is not None:
        low = {fid: plan.low for fid, plan in plans.items()}
        precision = convert_precision(work, dtype, low, root_low=root_low, weight_sources=weight_sources(work, _calls.module_calls(work)))
        initializer_types, casts = precision.initializer_types, precision.casts
    work.metadata_props.add(key=metadata.CONVERTED, value=json.dumps(dict(note)))
    result = ir.serde.deserialize_model(work)
    if folder:
        ir.external_data.set_base_dir(result.graph, folder)
    lowered = {name for name, kind in initializer_types.items() if kind != FLOAT}
    lazy_weights(result, sources, {name: initializer_types[name] for name in lowered})
    common_passes.RemoveUnusedNodesPass()(result)
    common_passes.RemoveUnusedFunctionsPass()(result)
    facts = BuildFacts(
        quantized=quantized,
        skipped=skipped,
        weights=len(lowered),
        float32_weights=sorted(n for n, kind in initializer_types.items() if kind == FLOAT and n in result.graph.initializers),
        casts=casts,
        split=split,
        plans=plans,
        calls=calls,
    )
    return result, facts


def lazy_weights(result, sources: Mapping[str, Callable[[], np.ndarray]], lowered: Mapping[str, int]) -> None:
    """The main graph's packed and lowered initializers as lazy tensors: computed one at a time
    when the file is written."""
    import onnx_ir as ir

    for name, value in list(result.graph.initializers.items()):
        source = sources.get(name)
        to = lowered.get(name)
        if source is None and to is None:
            continue
        original = value.const_value

        def compute(source=source, to=to, original=original, name=name):
            array = source() if source is not None else original.numpy()
            if to is not None:
                array = clip_for(to, array)  # a new array: the source's mapped pages can go
                if source is None and isinstance(original, ir.ExternalTensor):
                    original.release()  # one tensor at a time: the file is not mapped whole by the end
            return ir.Tensor(array, name=name)

        if source is not None:
            shape = ir.Shape(list(value.shape))
            kind = value.dtype if to is None else ir.DataType(to)
        else:
            shape = original.shape
            kind = ir.DataType(to)
        value.const_value = ir.LazyTensor(compute, dtype=kind, shape=shape, name=name)
        value.dtype = kind
