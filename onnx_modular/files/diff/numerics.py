"""``diff``'s numerics and time: both files run on the same inputs, each call's drift, each call's time.

:func:`feeds_for_both` checks that the two files take the same inputs (floating-point types may
differ: B gets the same values cast to its type) and makes them (given, or random from A's
declared types); :func:`call_drift` runs both files once in onnxruntime with every call's outputs
captured a batch at a time (:func:`~onnx_modular.calls.capture.paired_calls`) and sets each matched call's drift
(:func:`drift`), execution order and the first drifting call on the merged tree;
:func:`output_drift` the model outputs' only (files compared by module); :func:`times` each call's
inclusive kernel time in both files (:func:`~onnx_modular.profiling.run.profile`). No torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import onnx

from onnx_modular.calls.capture import PROBE_BUDGET, Instrumented, paired_calls
from onnx_modular.check.drift import measure_all
from onnx_modular.errors import InvalidInputError
from onnx_modular.files.diff.result import CallDiff
from onnx_modular.format.text import shown
from onnx_modular.runtime import sessions as runtime
from onnx_modular.runtime.inputs import check_feeds, feeds_for, model_inputs

__all__ = ["PROFILE_ROUNDS", "check_inputs", "feeds_for_both", "drift", "call_drift", "output_drift", "times"]


class Side(Protocol):
    """One file of the two (``diff``'s loaded file): its path and its model."""

    path: str
    model: onnx.ModelProto


#: Element types between which the same input values are cast (a float32 file and its float16 copy).
_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE})


def check_inputs(file_a: Side, file_b: Side) -> dict[str, int]:
    """The two files take the same inputs (names, ranks, fixed dims, element types), or say which not.

    Returns:
        The inputs whose floating-point type differs (a float32 file and its float16 copy), with
        B's type: B is fed the same values cast to it.
    """
    inputs_a = {v.name: v for v in model_inputs(file_a.model)}
    inputs_b = {v.name: v for v in model_inputs(file_b.model)}
    only_a, only_b = [n for n in inputs_a if n not in inputs_b], [n for n in inputs_b if n not in inputs_a]
    if only_a or only_b:
        raise InvalidInputError(
            f"The inputs of the two files do not match: only {file_a.path!r} takes {only_a or 'nothing more'}, "
            f"only {file_b.path!r} takes {only_b or 'nothing more'}.",
            hint="diff runs both files on the same inputs; compare files of one model with the same signature.",
        )

    def described(value: onnx.ValueInfoProto) -> tuple[int, str, list]:
        tensor = value.type.tensor_type
        elem = onnx.TensorProto.DataType.Name(tensor.elem_type).lower() if tensor.elem_type else "?"
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor.shape.dim]
        return tensor.elem_type, elem, dims

    cast: dict[str, int] = {}
    for name, value in inputs_a.items():
        (type_a, elem_a, dims_a), (type_b, elem_b, dims_b) = described(value), described(inputs_b[name])
        fixed_differ = len(dims_a) != len(dims_b) or any(
            isinstance(x, int) and isinstance(y, int) and x != y for x, y in zip(dims_a, dims_b)
        )
        if type_a != type_b and type_a in _FLOATS and type_b in _FLOATS and not fixed_differ:
            cast[name] = type_b
        elif type_a != type_b or fixed_differ:
            raise InvalidInputError(
                f"The input {shown(name)!r} differs between the two files: {elem_a}{dims_a} in {file_a.path!r}, "
                f"{elem_b}{dims_b} in {file_b.path!r}.",
                hint="diff runs both files on the same inputs; an input's rank, fixed dims and element type must "
                "agree (floating-point types may differ: B gets the same values cast to its type).",
            )
    return cast


def feeds_for_both(file_a: Side, file_b: Side, inputs: Any, seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A's feeds and B's: the same values, cast where B declares another floating-point type."""
    cast = check_inputs(file_a, file_b)
    feeds = feeds_for(file_a.model, inputs, seed=seed)
    feeds_b = dict(feeds)
    for name, elem_type in cast.items():
        feeds_b[name] = feeds[name].astype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    try:
        check_feeds(file_b.model, feeds_b)
    except InvalidInputError as e:
        raise InvalidInputError(f"{file_b.path!r}: {str(e).splitlines()[0].removeprefix('[input] ')}") from e
    return feeds, feeds_b


def drift(outputs_a: list[np.ndarray], outputs_b: list[np.ndarray]) -> tuple[float, float, float]:
    """(max abs, max rel, scaled drift) of B's outputs against A's: :func:`onnx_modular.check.drift.measure_all`."""
    measured = measure_all(outputs_b, outputs_a)
    return measured.max_abs, measured.max_rel, measured.scaled


def call_drift(root: CallDiff, file_a: Side, file_b: Side, feeds: Mapping[str, np.ndarray], feeds_b) -> None:
    """Each matched call's drift, both files run with their calls' outputs exposed a batch at a time
    (:func:`~onnx_modular.calls.capture.paired_calls`: at most ``PROBE_BUDGET`` bytes of both at once)."""
    a = Instrumented(file_a.model, feeds, external_data_folder=runtime.external_data_folder(file_a.path, file_a.model),
                     what=f"instrumented copy of {file_a.path!r}")
    b = Instrumented(file_b.model, feeds_b, external_data_folder=runtime.external_data_folder(file_b.path, file_b.model),
                     what=f"instrumented copy of {file_b.path!r}")
    by_path = {call.path: call for call in root.walk() if call.change != "added" and call.change != "removed"}
    order = {c.call_name: i for i, c in enumerate(a.calls)}
    seen = 0.0
    first = True
    for values, other in paired_calls(a, b, PROBE_BUDGET, select=lambda x, _: x.call_name in by_path):
        node = by_path[values.call_name]
        node.max_abs, node.max_rel, node.scaled_drift = drift(values.outputs, other.outputs)
        node.order = order[values.call_name]
        node.drift_before = seen
        seen = max(seen, node.scaled_drift)
        if first and node.max_abs:
            node.first_drift, first = True, False
    _set_output_drift(root, a.model_outputs(), b.model_outputs())
    root.drift_before = seen  # the model outputs come last


def _set_output_drift(root: CallDiff, outputs_a: Mapping[str, np.ndarray], outputs_b: Mapping[str, np.ndarray]) -> None:
    """The model outputs' drift on the root: matched by name, else by position."""
    names_a, names_b = list(outputs_a), list(outputs_b)
    if set(names_a) == set(names_b):
        pairs = [(outputs_a[n], outputs_b[n]) for n in names_a]
    elif len(names_a) == len(names_b):
        pairs = list(zip(outputs_a.values(), outputs_b.values()))
    else:
        root.max_abs, root.max_rel, root.scaled_drift = math.inf, math.inf, math.inf
        return
    root.max_abs, root.max_rel, root.scaled_drift = drift([x for x, _ in pairs], [y for _, y in pairs])


def output_drift(root: CallDiff, file_a: Side, file_b: Side, feeds: Mapping[str, np.ndarray], feeds_b) -> None:
    """The model outputs only (files compared by module: no call outputs to capture)."""
    outputs = []
    for file, file_feeds in ((file_a, feeds), (file_b, feeds_b)):
        names, values = runtime.run(
            file.model.SerializeToString(), file_feeds, what=f"model {file.path!r}",
            external_data_folder=runtime.external_data_folder(file.path, file.model),
        )
        outputs.append(dict(zip(names, values)))
    _set_output_drift(root, *outputs)


#: Rounds of ``profile=True``: the files are profiled in turn (A B, B A, A B), so that a change of
#: the machine's load during the measurement falls on both.
PROFILE_ROUNDS = 3


def times(root: CallDiff, file_a: Side, file_b: Side, feeds, feeds_b, runs: int, threads: int | None) -> dict[str, Any]:
    """Each call's inclusive time in both files: the median over :data:`PROFILE_ROUNDS` alternating
    rounds of :func:`~onnx_modular.profiling.run.profile` (each round's own median over its runs)."""
    import statistics

    from onnx_modular.profiling.run import profile

    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise InvalidInputError(f"runs must be an integer >= 1, got {runs!r}.")
    rounds = min(PROFILE_ROUNDS, runs)
    per_round = -(-runs // rounds)
    reports: dict[int, list] = {0: [], 1: []}
    for index in range(rounds):
        for side in ((0, 1) if index % 2 == 0 else (1, 0)):
            file = (file_a, file_b)[side]
            reports[side].append(profile(file.path, dict((feeds, feeds_b)[side]), runs=per_round, threads=threads))
    for call in root.walk():
        for side, attribute in ((0, "time_a_us"), (1, "time_b_us")):
            module_call = call.a if side == 0 else call.b
            if module_call is None or module_call.key not in reports[side][0].times:
                continue
            setattr(call, attribute, statistics.median(r.times[module_call.key].inclusive_us for r in reports[side]))
    settings = dict(reports[1][0].settings)
    settings.update(runs=per_round * rounds, rounds=rounds)
    settings["median_run_ms"] = [statistics.median(r.median_run_us for r in reports[side]) / 1e3 for side in (0, 1)]
    return settings
