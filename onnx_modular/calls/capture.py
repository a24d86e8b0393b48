"""Every module call's values from one onnxruntime run of the real model, torch-free.

Two ways to look inside a file, both running the model as it is (no inlining, no re-export):

* :func:`instrument` / :func:`call_outputs`: every module call's outputs. A copy of the model is
  *instrumented* so that every call's outputs become extra outputs, all the way up to the main
  graph: each function body gets extra outputs for the calls it makes (and, recursively, for what
  those calls expose), and every call node gets matching extra outputs. A function shared by
  several calls is instrumented once, yet each call site yields its own values, so every call in
  the expanded hierarchy is observed exactly once. ``localize``, ``diff``, ``convert`` and ``optimize``
  use it. :class:`Instrumented` runs the copy for a few calls at a time, so that a comparison of two
  files (:func:`paired_calls`) holds at most :data:`PROBE_BUDGET` bytes of call outputs at once.
* :func:`call_values`: the inputs and outputs of a few chosen calls (``extract``): each chosen
  call's chain of callers gets bodies of its own that also return the call's values.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from onnx_modular.calls import targets
from onnx_modular.calls.opening import open_instrumented
from onnx_modular.calls.segments import (
    batches,
    bindings,
    declared_bytes,
    fixed,
    info_of,
    itemsize,
    reads,
    static_bytes,
)
from onnx_modular.format import metadata
from onnx_modular.runtime import sessions as runtime

__all__ = [
    "PROBE_BUDGET", "CallEntry", "CallValues", "Instrumented", "batches", "call_batches", "call_outputs", "call_values",
    "call_values_runs",
    "flatten_probes", "instrument", "low_memory", "paired_calls",
]



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
    return next(call_values_runs(model, wanted, lambda _session: [feeds], external_data_folder=runtime.external_data_folder(path, model)))


def call_values_runs(
    model: onnx.ModelProto,
    wanted: Mapping[str, list[int]],
    feeds: Callable[[Any], Iterable[Mapping[str, np.ndarray]]],
    *,
    external_data_folder: str | os.PathLike | None = None,
) -> Iterator[dict[str, tuple[dict[int, np.ndarray], list[np.ndarray]]]]:
    """:func:`call_values` over several runs of one copy: ``feeds(session)`` gives the feeds of each run
    (from the copy's open session, e.g. :func:`onnx_modular.runtime.generation.prompt_feeds`); one
    result per run, as :func:`call_values` returns it."""
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
    session = runtime.session(probe.SerializeToString(), external_data_folder=external_data_folder, arena=False, what="model")
    for run_feeds in feeds(session):
        names, arrays = runtime.run(session, run_feeds, what="model")
        by_name = dict(zip(names, arrays))
        captured = {}
        for name, (indices, outputs) in plan.items():
            values = [by_name.get(output) if output else None for output in outputs]
            captured[name] = (dict(zip(indices, values[: len(indices)])), values[len(indices) :])
        yield captured


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


#: The bytes of call outputs one run of an instrumented copy holds at once (of both files together
#: when two are compared, :func:`paired_calls`): the calls whose outputs do not fit run in further
#: batches, each one run of its own. ``None`` in the functions below: every call in one run.
PROBE_BUDGET = 1 << 30

#: Bytes per element assumed for a probe whose element type the file does not declare.
_UNKNOWN_ITEMSIZE = 8


@dataclasses.dataclass(frozen=True)
class CallEntry:
    """One module call of an instrumented copy, before its values are run (see :class:`CallValues`)."""

    call_name: str
    module_path: str
    call_index: int
    function: str
    depth: int
    probes: range  # its outputs among the copy's probes


class Instrumented:
    """An instrumented copy of ``model`` (:func:`instrument`) that runs the outputs of chosen calls.

    onnxruntime holds every graph output of a run until the run ends, so a copy that exposes every
    call's outputs at once holds them all (13.6 GB for SAM 2's Hiera at 1024x1024). Here a run
    (:meth:`run`) returns only the chosen calls' outputs, and runs only the part of the main graph
    they need: the main graph's nodes from where the previous run stopped to the last chosen
    call, fed the values that earlier runs made and later nodes read (each node of the main graph
    runs once over a pass of consecutive batches). The probes that are not chosen are freed as
    they are made (onnxruntime's priority-based order; its default order runs such dangling probes
    last and keeps them all). :meth:`batches` chooses the calls of each run under a byte budget
    (a call of the main graph whose calls exceed it opened first, :meth:`open_groups`)
    (:meth:`call_bytes`: from the declared shapes, onnx's shape inference with the inputs' shapes
    fixed, else a run that returns only every probe's ``Shape``).

    ``model`` is not changed (the copy runs in memory; its external data is read from
    ``external_data_folder``, the model's folder, so nothing is written next to it).
    """

    def __init__(self, model: onnx.ModelProto | ir.Model, feeds: Mapping[str, np.ndarray] | Sequence[np.ndarray], *,
                 external_data_folder: str | os.PathLike | None = None, execution_provider: str | None = None,
                 what: str = "instrumented model"):
        copy = ir.serde.deserialize_model(model) if isinstance(model, onnx.ModelProto) else (
            ir.serde.deserialize_model(ir.serde.serialize_model(model))
        )
        self.output_names = [v.name for v in copy.graph.outputs]
        functions = _module_functions(copy)
        called = [i for i, node in enumerate(copy.graph) if node.op_identifier() in functions]
        probes = instrument(copy)
        counter = metadata.CallCounter()
        entries = flatten_probes(probes, None, "", 1, [], counter, metadata.NoOpCalls(copy.graph, None, None, counter, True))
        self.calls = [CallEntry(name, path, index, function, depth, range(begin, end))
                      for name, path, index, function, depth, (begin, end) in entries]
        # the main-graph node whose run makes each probe (instrument keeps the main graph's node order)
        self._maker = [node for node, probe in zip(called, probes) for _ in range(probe.width)]
        if not isinstance(feeds, Mapping):
            feeds = dict(zip([v.name for v in copy.graph.inputs], feeds))
        self.feeds = dict(feeds)
        self._static = [static_bytes(v, bindings(copy.graph.inputs, self.feeds)) for v in copy.graph.outputs[len(self.output_names):]]
        self._take(ir.serde.serialize_model(copy))
        del copy
        self._probe_bytes: list[int] | None = None
        self.folder, self.execution_provider, self.what = external_data_folder, execution_provider, what
        self.outputs: dict[str, np.ndarray] = {name: self.feeds[name] for name in self.output_names if name in self.feeds}
        self._until = 0  # the main graph's nodes before this ran already; the values of theirs later nodes read:
        self._frontier: dict[str, np.ndarray] = {}
        self._previous: tuple[int, dict[str, np.ndarray]] = (0, {})  # the last run's start and what it was fed
        self.runs = 0
        self.nodes_run = 0  # main-graph nodes run, over all runs (each once over a pass of consecutive batches)

    def _take(self, proto: onnx.ModelProto) -> None:
        """Hold the copy ``proto`` as its parts: the main graph's nodes (then the probes' ``Identity``), inputs and outputs."""
        self.proto, graph = proto, proto.graph
        self._graph_outputs = [_copied(v) for v in graph.output]
        self._inputs = {v.name: _copied(v) for v in graph.input}
        self._nodes = [_copied(n) for n in graph.node]
        self._main = len(self._nodes) - (len(self._graph_outputs) - len(self.output_names))  # then the probes' Identity
        self._reads = [reads(n) for n in self._nodes[: self._main]]
        del graph.node[:], graph.input[:], graph.output[:]

    def open_groups(self, budget: int | None) -> None:
        """Before the first run: open each call of the main graph whose calls' outputs exceed
        ``budget`` (:func:`~onnx_modular.calls.opening.open_instrumented`), again inside it while they do
        (a few levels), so that a batch of its calls runs only the part of it they need."""
        if budget is None or self.runs:
            return
        sizes = self.call_bytes()
        for _ in range(4):
            held: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0])  # maker: bytes, calls
            for call in self.calls:
                if call.probes:
                    group = held[self._maker[call.probes[0]]]
                    group[0], group[1] = group[0] + sizes[call.call_name], group[1] + 1
            functions = {(f.domain, f.name) for f in self.proto.functions}
            ids = {(self._nodes[m].domain, self._nodes[m].op_type) for m, (size, count) in held.items()
                   if size > budget and count > 1} & functions
            whole = onnx.ModelProto()
            whole.CopyFrom(self.proto)
            whole.graph.node.extend(self._nodes), whole.graph.input.extend(self._inputs.values())
            whole.graph.output.extend(self._graph_outputs)
            opened = open_instrumented(whole, ids, len(self._graph_outputs) - len(self.output_names)) if ids else None
            if opened is None:
                return
            self._take(opened[0])
            self._maker = opened[1]

    def call_bytes(self) -> dict[str, int]:
        """Each call's output bytes on these feeds."""
        if self._probe_bytes is None:
            sizes = list(self._static)
            if None in sizes:
                sizes = [s if s is not None else inferred for s, inferred in zip(sizes, self._inferred())]
            if None in sizes:
                sizes = self._measured(sizes)
            self._probe_bytes = [int(s or 0) for s in sizes]
        return {c.call_name: sum(self._probe_bytes[i] for i in c.probes) for c in self.calls}

    def _inferred(self) -> list[int | None]:
        """The probes' bytes by onnx's shape inference on the copy with the inputs' shapes fixed."""
        probe = onnx.ModelProto()
        probe.CopyFrom(self.proto)
        graph = probe.graph
        graph.node.extend(self._nodes)
        graph.output.extend(self._graph_outputs[len(self.output_names):])
        for value in self._inputs.values():
            graph.input.append(fixed(value, self.feeds.get(value.name)))
        try:
            inferred = onnx.shape_inference.infer_shapes(probe, data_prop=True)
        except Exception:  # onnx's inference stops at what it does not know: the probes' shapes are then run
            return [None] * len(self._static)
        return [declared_bytes(v) for v in inferred.graph.output]

    def _measured(self, sizes: list[int | None]) -> list[int | None]:
        """The probes' bytes from one run of the whole copy that returns only every probe's ``Shape``."""
        first = len(self.output_names)
        wanted = [i for i, size in enumerate(sizes) if size is None]
        shapes = [onnx.helper.make_node("Shape", [self._graph_outputs[first + i].name], [f"_onnx_modular_shape_{i}"])
                  for i in wanted]
        infos = [onnx.helper.make_tensor_value_info(n.output[0], onnx.TensorProto.INT64, None) for n in shapes]
        identities = [self._nodes[self._main + i] for i in wanted]
        values = self._segment(0, self._main, [], extra=(identities + shapes, infos), keep=False)
        out = list(sizes)
        for i, shape in zip(wanted, values):
            size = itemsize(self._graph_outputs[first + i].type.tensor_type.elem_type)
            out[i] = int(np.prod(shape)) * (size or _UNKNOWN_ITEMSIZE)
        return out

    def _segment(self, start: int, end: int, probes: Sequence[int], extra=((), ()), keep: bool = True) -> list[np.ndarray]:
        """Run the main graph's nodes ``start:end`` (fed the values earlier runs left) and return the
        ``probes``' values (then ``extra``'s outputs); the model's own outputs made are kept."""
        first = len(self.output_names)
        frontier = self._frontier if start else {}
        nodes = self._nodes[start:end] + [self._nodes[self._main + i] for i in probes] + list(extra[0])
        later = set(self.output_names).union(*self._reads[end: self._main]) if keep else set()
        made = {name for n in self._nodes[start:end] for name in n.output if name}
        read = set().union(*(reads(n) for n in nodes))
        inputs = [self._inputs[n] for n in self._inputs if n in read]
        fed = [name for name in frontier if name in read and name not in self._inputs]
        inputs += [info_of(name, frontier[name]) for name in fed]
        originals = [name for name in self.output_names if name in made and name not in self.outputs]
        passed = [name for name in made if name in later and name not in originals] if keep else []
        outputs = ([self._graph_outputs[first + i] for i in probes] + list(extra[1])
                   + [self._graph_outputs[self.output_names.index(n)] for n in originals]
                   + [onnx.ValueInfoProto(name=n) for n in passed])
        if not outputs:
            return []
        graph = self.proto.graph
        graph.node.extend(nodes), graph.input.extend(inputs), graph.output.extend(outputs)
        try:
            serialized = self.proto.SerializeToString()
        finally:
            del graph.node[:], graph.input[:], graph.output[:]
        # onnxruntime's EliminateIdentity drops a probe's Identity whose input also feeds a node after the call
        # is inlined, leaving that node without its input (a GLU's output read by a Pad: Wav2Vec2-BERT): the probes
        # keep their Identity nodes.
        session = runtime.session(serialized, self.execution_provider, external_data_folder=self.folder,
                                  disabled_optimizers=("EliminateIdentity",), configure=low_memory, what=self.what)
        del serialized
        feeds = {name: self.feeds[name] for name in self._inputs if name in read and name in self.feeds}
        feeds.update((name, frontier[name]) for name in fed)
        # without the arena, onnxruntime's output arrays hold only their own memory: no copies
        _, values = runtime.run(session, feeds, what=self.what, copy=False)
        self.runs += 1
        self.nodes_run += end - start
        count = len(probes) + len(extra[1])
        self.outputs.update(zip(originals, values[count: count + len(originals)]))
        if keep:
            self._previous = (start, frontier)  # where this run began: a group cut in parts runs again from there
            carried = {name: value for name, value in frontier.items() if name in later}
            carried.update((name, self.outputs[name]) for name in originals if name in later)
            carried.update(zip(passed, values[count + len(originals):]))
            self._frontier, self._until = carried, end
        return values[:count]

    def model_outputs(self) -> dict[str, np.ndarray]:
        """The model's own outputs (kept from the runs so far; the rest of the main graph runs for the others)."""
        if any(name not in self.outputs for name in self.output_names):
            self._segment(self._resume(self._until), self._main, [])
        if any(name not in self.outputs for name in self.output_names):  # an initializer, say
            self._segment(0, self._main, [], keep=False)
        return {name: self.outputs[name] for name in self.output_names if name in self.outputs}

    def run(self, calls: Sequence[CallEntry]) -> list[CallValues]:
        """The outputs of ``calls`` (of :attr:`calls`) from one run, in the order given."""
        indices = [i for c in calls for i in c.probes]
        makers = [self._maker[i] for i in indices]
        values = []
        if indices:
            values = self._segment(self._resume(min(makers)), max(makers) + 1, indices)
        by_probe = dict(zip(indices, values))
        return [CallValues(c.call_name, c.module_path, c.call_index, c.function, c.depth, [by_probe[i] for i in c.probes])
                for c in calls]

    def _resume(self, first: int) -> int:
        """Where a run that needs the main graph's nodes from ``first`` on starts: where the last one
        stopped, or at the beginning (a node before it, or a value not a tensor to feed back)."""
        fed_back = all(isinstance(v, np.ndarray) for v in self._frontier.values())
        if first >= self._until and fed_back:
            return self._until
        start, frontier = self._previous
        if start <= first and all(isinstance(v, np.ndarray) for v in frontier.values()):
            self._frontier, self._until = frontier, start  # the next part of a group cut in parts
            return start
        return 0

    def batches(self, budget: int | None, calls: Sequence[CallEntry] | None = None) -> list[list[CallEntry]]:
        """``calls`` (all by default) in consecutive batches whose outputs fit ``budget`` bytes (a call
        over it alone, the calls one call of the main graph makes together when they fit in it:
        :func:`batches`); one batch when ``budget`` is ``None``."""
        calls = self.calls if calls is None else list(calls)
        self.open_groups(budget)
        if budget is None:
            return [list(calls)] if calls else []
        sizes = self.call_bytes()
        return batches(calls, [sizes[c.call_name] for c in calls], budget, self.together)

    def together(self, call: CallEntry, other: CallEntry) -> bool:
        """Two calls made by one call of the main graph (a run makes all of its calls' values or none)."""
        return bool(call.probes and other.probes) and self._maker[call.probes[0]] == self._maker[other.probes[0]]


def low_memory(options) -> None:
    """A probe session's options: dangling probes freed as they are made, memory given back as it is freed."""
    import onnxruntime as ort

    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    options.enable_cpu_mem_arena = False


def _copied(message):
    copy = type(message)()
    copy.CopyFrom(message)
    return copy


def call_batches(instrumented: Instrumented, budget: int | None = PROBE_BUDGET) -> Iterator[CallValues]:
    """Every call's outputs, one batch of runs under ``budget`` at a time, in the order the calls
    finish: a batch's arrays are dropped when the caller lets go of them."""
    for batch in instrumented.batches(budget):
        yield from instrumented.run(batch)


def paired_calls(
    a: Instrumented,
    b: Instrumented,
    budget: int | None = PROBE_BUDGET,
    select: Callable[[CallEntry, CallEntry], bool] | None = None,
) -> Iterator[tuple[CallValues, CallValues]]:
    """The calls of ``a`` that ``b`` also makes (by call name, ``select`` of both if given), each
    with ``b``'s values, in ``a``'s order: both files run once per batch of calls whose outputs in
    both fit ``budget`` bytes, so that a comparison holds one batch of each file at a time.

    The model outputs of both are :meth:`Instrumented.model_outputs` (the first batch returns them).
    """
    others = {c.call_name: c for c in b.calls}
    pairs = [(c, others[c.call_name]) for c in a.calls
             if c.call_name in others and (select is None or select(c, others[c.call_name]))]
    if budget is None:
        groups = [pairs] if pairs else []
    else:
        a.open_groups(budget // 2), b.open_groups(budget // 2)  # both files' values of a batch share the budget
        sizes_a, sizes_b = a.call_bytes(), b.call_bytes()
        groups = batches(pairs, [sizes_a[x.call_name] + sizes_b[y.call_name] for x, y in pairs], budget,
                         lambda p, q: a.together(p[0], q[0]) or b.together(p[1], q[1]))
    for group in groups:
        values_a = a.run([x for x, _ in group])
        values_b = b.run([y for _, y in group])
        yield from zip(values_a, values_b)
        del values_a, values_b


def call_outputs(
    model: onnx.ModelProto | ir.Model,
    feeds: Mapping[str, np.ndarray] | Sequence[np.ndarray],
    *,
    external_data_folder: str | os.PathLike | None = None,
    execution_provider: str | None = None,
    what: str = "instrumented model",
    budget: int | None = None,
) -> tuple[dict[str, np.ndarray], list[CallValues]]:
    """Run ``model`` on ``feeds`` with every module call's outputs exposed, all of them returned at
    once (in runs of ``budget`` bytes of outputs each when given; :func:`call_batches` and
    :func:`paired_calls` hold one batch at a time).

    ``model`` is not changed (an instrumented copy runs, in memory; its external data is read
    from ``external_data_folder``, the model's folder, so nothing is written next to it).

    Returns:
        The model's own outputs by name, and one :class:`CallValues` per module call in the order
        the calls finish (children before their parent).
    """
    instrumented = Instrumented(model, feeds, external_data_folder=external_data_folder,
                                execution_provider=execution_provider, what=what)
    calls = list(call_batches(instrumented, budget))
    return instrumented.model_outputs(), calls


def call_values_by_name(calls: Sequence[CallValues]) -> dict[str, CallValues]:
    """``calls`` by call name."""
    return {c.call_name: c for c in calls}

