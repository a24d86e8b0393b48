"""Where the time goes, per module call: onnxruntime's profiler on the file's call tree.

``profile(path)`` runs the file in onnxruntime with its profiler on and attributes every
kernel event to the module call it came from (:mod:`onnx_modular.profiling.attribution`: a flat
copy whose node names carry the call, and onnxruntime's optimized graph for the nodes it
fuses). Per call: inclusive and self time (medians over the measured runs), share of the
kernel time, kernels; per class: the sum over its calls and the spread between them. Views:
the call tree with time columns (``str(report)``, ``format(max_depth=)``), JSON, a Chrome
trace with module calls as nested spans, a self-contained HTML flame chart
(:mod:`onnx_modular.profiling.views`). No torch.

Example::

    report = onnx_modular.profile("gpt2.onnx", runs=20)
    print(report.format(max_depth=2))
    report.save(json="p.json", trace="p.trace.json", html="p.html")
"""

from __future__ import annotations

import json
import numbers
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from onnx_modular.calls.tree import function_tree, module_path_tree, node_call
from onnx_modular.errors import InvalidInputError, ProfileError, VerificationError
from onnx_modular.format import metadata
from onnx_modular.format.calltree import CallTree
from onnx_modular.format.text import first_line
from onnx_modular.profiling.attribution import Attribution, attribute, tagged_copy
from onnx_modular.profiling.report import CallTime, ClassTime, KernelTime, ProfileReport, median_of
from onnx_modular.runtime import sessions as runtime
from onnx_modular.runtime.inputs import feeds_from_arrays, load_arrays, model_inputs, random_inputs
from onnx_modular.storage.checks import check_expanded_size
from onnx_modular.storage.limits import check_count
from onnx_modular.storage.load import load_model_file
from onnx_modular.storage.locks import scratch_folder

__all__ = ["profile", "ProfileReport", "CallTime", "KernelTime", "ClassTime", "OPTIMIZATION_LEVELS"]

#: ``optimization=`` -> onnxruntime's ``GraphOptimizationLevel`` member.
OPTIMIZATION_LEVELS = {
    "all": "ORT_ENABLE_ALL",
    "extended": "ORT_ENABLE_EXTENDED",
    "basic": "ORT_ENABLE_BASIC",
    "disabled": "ORT_DISABLE_ALL",
}
_KERNEL_SUFFIX = "_kernel_time"


# -- running -------------------------------------------------------------------------------


def _feeds(model: onnx.ModelProto, inputs: Any, dims: Mapping[str, int] | None, seed: int) -> dict[str, np.ndarray]:
    if inputs is None:
        return random_inputs(model, dims=dims, seed=seed)
    if dims:
        raise InvalidInputError("dims= sizes random inputs; it cannot be combined with inputs=.")
    if isinstance(inputs, (str, os.PathLike)):
        return feeds_from_arrays(model, load_arrays(inputs, "inputs"))
    if isinstance(inputs, Mapping):
        return feeds_from_arrays(model, {name: np.asarray(value) for name, value in inputs.items()})
    if isinstance(inputs, Sequence):
        names = [value.name for value in model_inputs(model)]
        if len(inputs) != len(names):
            raise InvalidInputError(
                f"The model has {len(names)} inputs ({', '.join(names)}) but {len(inputs)} arrays were given.",
                hint="Give one array per model input, in order, or a dict by input name.",
            )
        return feeds_from_arrays(model, {name: np.asarray(value) for name, value in zip(names, inputs)})
    raise InvalidInputError(
        f"inputs must be None, a dict of arrays by input name, a list of arrays or a .npz path, not {type(inputs).__name__}."
    )


#: Most intra-op threads a profile asks onnxruntime for: far past any gain, and well below the
#: counts that crash it (``--threads 100000`` ends in a segmentation fault while creating them).
MAX_THREADS = 1024


def _count(value: Any, name: str, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise InvalidInputError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    if maximum is not None and value > maximum:
        raise InvalidInputError(
            f"{name} must be at most {maximum}, got {value!r}.",
            hint=f"This machine has {os.cpu_count()} cores; more threads than cores only wait on each other.",
        )
    return int(value)


def _session(serialized: bytes, folder: pathlib.Path, providers_name: str | None, *, threads, optimization, data_folder):
    import onnxruntime as ort

    def configure(options) -> None:
        options.enable_profiling = True
        options.profile_file_prefix = str(folder / "ort_profile")
        options.optimized_model_filepath = str(folder / "optimized.onnx")
        # Weights of the optimized copy go to a side file, so its graph stays small to read back.
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.onnx.data")
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPTIMIZATION_LEVELS[optimization])
        if threads is not None:
            options.intra_op_num_threads = threads

    try:
        return runtime.session(
            serialized, providers_name, external_data_folder=data_folder, configure=configure
        )
    except VerificationError as e:
        raise ProfileError(first_line(e).removeprefix("[verify] "), hint=e.hint) from e


def profile(
    path: str | os.PathLike,
    inputs: Any = None,
    *,
    runs: int = 10,
    warmup: int = 2,
    execution_provider: str | None = None,
    threads: int | None = None,
    optimization: str = "all",
    dims: Mapping[str, int] | None = None,
    seed: int = 0,
) -> ProfileReport:
    """Profile an ONNX file in onnxruntime, with every kernel attributed to its module call.

    The file runs as a flat copy whose node names carry the call (onnxruntime inlines the
    functions of the file itself the same way and runs the same kernels); onnxruntime's graph
    optimizations stay on, and the nodes it fuses are attributed to the innermost call holding
    all their parts (:mod:`onnx_modular.profiling.attribution`). Times are medians over ``runs``
    runs after ``warmup`` runs. A file without local functions is profiled by op type.

    Args:
        path: The ``.onnx`` file (any file onnxruntime runs; functions give the call tree).
        inputs: ``None`` (random inputs from the declared shapes, symbolic dims from ``dims``,
            else 2), a dict of arrays by input name, a list of arrays in input order, or the
            path of a ``.npz`` (by name, or ``arr_0``, ``arr_1``...).
        runs: Measured runs (>= 1).
        warmup: Runs before them, not measured.
        execution_provider: onnxruntime's provider (CPU by default; ``"cuda"``...).
        threads: onnxruntime's intra-op threads (``None``: its default).
        optimization: onnxruntime's graph optimization level: ``all`` (its default),
            ``extended``, ``basic`` or ``disabled``.
        dims, seed: Sizes of symbolic dimensions and the seed of random inputs.

    Raises:
        InvalidInputError: Bad arguments, or inputs that do not fit the model.
        InvalidModelFileError: The file cannot be read.
        ExecutionProviderError: This onnxruntime build lacks the provider.
        ProfileError: onnxruntime cannot load or run the model.

    Example::

        report = profile("gpt2.onnx", {"input_ids": ids}, runs=20)
        print(report.by_self(3))
    """
    runs = _count(runs, "runs", 1)
    warmup = _count(warmup, "warmup", 0)
    check_count("MAX_RUNS", runs + warmup, "runs, the measured and warm-up runs of the profile")
    if threads is not None:
        threads = _count(threads, "threads", 1, MAX_THREADS)
    if optimization not in OPTIMIZATION_LEVELS:
        raise InvalidInputError(f"optimization must be one of {', '.join(OPTIMIZATION_LEVELS)}, got {optimization!r}.")
    providers = runtime.execution_providers(execution_provider)  # an unknown provider fails first
    model = load_model_file(path)
    check_expanded_size(model, name=repr(str(path)))
    feeds = _feeds(model, inputs, dims, seed)
    # A flat file (our flat copy, `inline`): its nodes record their module call, and the calls
    # recorded in the file's metadata without ops (a Dropout in eval) did not run.
    by_path = None if model.functions else module_path_tree(model)
    tree = by_path or function_tree(model)
    copy, origins = tagged_copy(model, node_call if by_path else None)
    try:
        serialized = copy.SerializeToString()
    except ValueError as e:
        raise ProfileError(
            f"The inlined copy of {str(path)!r} exceeds protobuf's 2 GiB limit: {first_line(e)}",
            hint="Save the model with external data (export_modular(..., external_data=True)).",
        ) from e
    data_folder = runtime.external_data_folder(path, model)
    with scratch_folder("profile") as folder:
        session = _session(
            serialized, folder, execution_provider, threads=threads, optimization=optimization, data_folder=data_folder
        )
        for _ in range(warmup + runs):
            try:
                runtime.run(session, feeds, what="model")
            except VerificationError as e:
                session.end_profiling()
                raise ProfileError(first_line(e).removeprefix("[verify] "), hint=e.hint) from e
        events = read_events(pathlib.Path(session.end_profiling()))
        optimized = onnx.load(str(folder / "optimized.onnx"), load_external_data=False)
    del session
    attribution = attribute(copy, origins, optimized, tree)
    settings = {
        "runs": runs,
        "warmup": warmup,
        "providers": providers,
        "threads": threads,
        "optimization": optimization,
        "local_functions": len(model.functions),
        "inputs": {name: {"shape": list(array.shape), "dtype": str(array.dtype)} for name, array in feeds.items()},
    }
    note = None
    if by_path:
        note = (
            f"{os.path.basename(str(path))} has no local functions: kernels are attributed by their nodes' "
            f"{metadata.MODULE_PATH} (a flat copy); the time is shown by op type too."
        )
    elif not model.functions:
        note = f"{os.path.basename(str(path))} has no local functions: the time is shown by op type."
    return _build(str(path), tree, events, attribution, warmup, runs, settings, note)


_EVENT_ARGS = ("op_name", "provider")
#: A kernel of a node onnxruntime left unnamed (``Cast_60_kernel_time``): its input shapes are kept
#: to tell it from the other unnamed nodes of its op type (:class:`~onnx_modular.profiling.attribution.Attributions`).
_UNNAMED_EVENT = re.compile(r"[A-Za-z][A-Za-z0-9]*_\d+" + _KERNEL_SUFFIX)


def _slim_event(item: dict) -> dict:
    """One profiler event with only what :func:`_build` reads (the shapes, thread statistics and
    parameters onnxruntime records per kernel are dropped as the JSON is parsed)."""
    if "cat" in item and "ts" in item:
        args = item.get("args")
        keys = _EVENT_ARGS + (("input_type_shape",) if _UNNAMED_EVENT.fullmatch(str(item.get("name", ""))) else ())
        args = {key: args[key] for key in keys if key in args} if isinstance(args, dict) else {}
        return {"cat": item["cat"], "name": item.get("name", ""), "ts": item["ts"], "dur": item.get("dur", 0), "args": args}
    return item


def _kernel_attribution(attribution: Mapping[str, Attribution], name: str, args: Mapping, tree: CallTree) -> Attribution:
    found = attribution.get(name)
    if found is None and hasattr(attribution, "unnamed_kernel"):  # a node onnxruntime left unnamed
        found = attribution.unnamed_kernel(name, args.get("op_name", ""), _event_shapes(args.get("input_type_shape")))
    if found is None:  # not a node of the optimized graph: never guessed, kept visible
        found = Attribution(tree.root.key, "unattributed")
    return found


def _event_shapes(shapes) -> tuple | None:
    """``[{"float": [32, 1, 1]}, ...]`` (the profiler's input shapes) -> ``((32, 1, 1), ...)``."""
    if not isinstance(shapes, list):
        return None
    try:
        return tuple(tuple(next(iter(entry.values()))) for entry in shapes)
    except (AttributeError, StopIteration, TypeError):
        return None


def read_events(path: pathlib.Path) -> list[dict]:
    """onnxruntime's profile (a JSON list of events), each event slimmed while parsed (:func:`_slim_event`)."""
    return json.loads(path.read_text(encoding="utf-8"), object_hook=_slim_event)


def _build(path, tree: CallTree, events, attribution: Mapping[str, Attribution], warmup, runs, settings, note):
    """Split the profiler's events into runs, attribute the kernels, and take the medians."""
    run_events = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=lambda e: e["ts"])
    if len(run_events) != warmup + runs:
        raise ProfileError(f"onnxruntime's profiler recorded {len(run_events)} runs, not {warmup + runs}.")
    measured = run_events[warmup:]
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in measured]
    kernel_events = sorted(
        (e for e in events if e.get("cat") == "Node" and str(e.get("name", "")).endswith(_KERNEL_SUFFIX)),
        key=lambda e: (e["ts"], -e["dur"]),
    )
    # A control-flow kernel (If, Loop, Scan) spans the kernels of its subgraphs, which the
    # profiler records too: each kernel is charged its exclusive time (its span minus the
    # spans nested in it), so nothing is counted twice.
    exclusive: dict[int, float] = {}
    open_events: list[dict] = []
    for event in kernel_events:
        while open_events and event["ts"] >= open_events[-1]["ts"] + open_events[-1]["dur"]:
            open_events.pop()
        exclusive[id(event)] = float(event["dur"])
        if open_events:
            exclusive[id(open_events[-1])] -= float(event["dur"])
        open_events.append(event)
    kernel_us = [0.0] * len(measured)  # the profiler's total per run: its outermost kernel spans
    index: dict[str, int] = {}
    kernels: list[KernelTime] = []
    timeline: list[list[tuple[int, float, float]]] = [[] for _ in measured]
    run = 0
    open_events = []
    for event in kernel_events:
        if event["ts"] < windows[0][0]:
            continue  # a warm-up run
        while run < len(windows) - 1 and event["ts"] >= windows[run + 1][0]:
            run += 1
        while open_events and event["ts"] >= open_events[-1]["ts"] + open_events[-1]["dur"]:
            open_events.pop()
        if not open_events:
            kernel_us[run] += float(event["dur"])
        open_events.append(event)
        name = event["name"][: -len(_KERNEL_SUFFIX)]
        if name not in index:
            args = event.get("args", {})
            found = _kernel_attribution(attribution, name, args, tree)
            index[name] = len(kernels)
            kernels.append(
                KernelTime(name, args.get("op_name", ""), found.call, found.kind, found.parts, found.crosses,
                           args.get("provider", ""), 0.0, [0.0] * len(measured))
            )
        position = index[name]
        kernels[position].runs_us[run] += max(exclusive[id(event)], 0.0)
        timeline[run].append((position, float(event["ts"] - windows[run][0]), float(event["dur"])))
    for kernel in kernels:
        kernel.median_us = median_of(kernel.runs_us)
    # A call's time is the sum of its kernels' medians: additive (the calls' self times add up
    # to the total) and robust to a run in which the process was descheduled during one kernel.
    own = dict.fromkeys((call.key for call in tree.walk()), 0.0)
    own_runs = {call.key: np.zeros(len(measured)) for call in tree.walk()}
    counts = {call.key: [0, 0] for call in tree.walk()}  # own kernels, fused across
    for kernel in kernels:
        key = kernel.call if kernel.call in own else tree.root.key
        own[key] += kernel.median_us
        own_runs[key] += np.asarray(kernel.runs_us)
        counts[key][0] += 1
        counts[key][1] += kernel.crosses
    inclusive: dict[str, float] = {}
    kernels_under: dict[str, int] = {}
    for call in reversed(list(tree.walk())):  # children before parents
        inclusive[call.key] = own[call.key] + sum(inclusive[c.key] for c in call.children)
        kernels_under[call.key] = counts[call.key][0] + sum(kernels_under[c.key] for c in call.children)
    total = inclusive[tree.root.key] or 1.0
    times = {}
    for call in tree.walk():
        times[call.key] = CallTime(
            call, inclusive[call.key], own[call.key], inclusive[call.key] / total,
            kernels_under[call.key], counts[call.key][0], counts[call.key][1], own_runs[call.key].tolist(),
        )
    return ProfileReport(
        path, tree, times, kernels, [float(e["dur"]) for e in measured], kernel_us, timeline, settings, note
    )
