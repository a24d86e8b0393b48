"""The per-call choice of an encoder's int8 compute, by the error of its outputs (no top tokens: an
encoder has none).

An encoder's quantized file has, in its bodies, nodes that can compute two ways (a :class:`Toggle`):
the *fast* way (``DynamicQuantizeMatMul``: activations quantized to int8 at run time; or
``MatMulNBits`` at ``accuracy_level=4``) and the *safe* way (the same int8/int4 weights, float compute:
``Cast`` + ``Mul`` + ``MatMul``; ``accuracy_level=0``). :func:`choose` keeps every call fast unless
the outputs drift past the tolerance:

1. Reference: the outputs of the float file on the runs given (the user's inputs, or random inputs of
   the file's own shapes, fixed dimensions included: ``optimize``'s encoder runs).
2. The quantized file, every call fast, on the same runs. The error of an output is
   ``||got - reference|| / ||reference||`` (relative, over the whole tensor) and its cosine; the
   file's error is the largest over its float outputs and runs. Within ``tolerance``: done, after
   two runs of each input.
3. Otherwise every candidate call (a fast node in its own body) is run alone fast, the others safe,
   and ranked by the error it alone brings; the worst are made safe one at a time until the rest
   are within the tolerance. Past ``max_safe`` calls, the whole file computes safe.

Calls the user names (``safe_calls``) are safe from the start. Bodies are shared per class: a safe
call gets bodies of its own (:func:`~onnx_modular.calls.targets.specialize`), and a function whose
every call is safe is changed in place. Torch-free.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx

from onnx_modular.calls import targets as _calls
from onnx_modular.passes.proto_bodies import function_id
from onnx_modular.runtime import sessions as runtime

__all__ = ["Toggle", "EncoderGuardReport", "choose", "apply", "output_errors", "MAIN_GRAPH", "MAX_SAFE"]

#: The main graph's own nodes, as a candidate.
MAIN_GRAPH = "<main graph>"
#: Past this many safe calls (chosen by error), the whole file computes safe.
MAX_SAFE = 16
_WHAT = "guard's trial file"  # sessions say "the <what>"


@dataclasses.dataclass(frozen=True)
class Toggle:
    """Nodes that compute fast or safe. ``fast(node)``: the node computes the fast way;
    ``make_safe(body, node)``: the nodes that replace it, computing the safe way."""

    fast_name: str
    safe_name: str
    fast: Callable[[onnx.NodeProto], bool]
    make_safe: Callable[[object, onnx.NodeProto], list[onnx.NodeProto]]


@dataclasses.dataclass
class EncoderGuardReport:
    """What :func:`choose` did.

    Attributes:
        fast / safe: The compute of the two kinds (``dynamic int8``, ``weight-only int8``).
        tolerance: The largest relative error of an output allowed.
        candidates: Calls with a fast node in their own body.
        safe_calls: The calls made safe, in execution order (``forced``: those the user named).
        whole_file: Past ``max_safe`` calls: every call safe.
        error_fast: The relative error (and ``cosine_fast`` the cosine) of the outputs with every
            candidate fast (the user's safe calls safe).
        error: The same for the file as written.
        max_abs: The largest absolute difference of the file as written from the float reference.
        alone: Per safe call chosen by error, its error when it alone is fast.
        trials: Files run; runs: inputs each was run on; seconds: the guard's time.
    """

    fast: str
    safe: str
    tolerance: float
    candidates: int
    safe_calls: list[str]
    forced: list[str]
    whole_file: bool
    error_fast: float
    cosine_fast: float
    error: float
    cosine: float
    max_abs: float
    trials: int
    runs: int
    alone: dict[str, float] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    def text(self) -> str:
        head = (f"Encoder guard ({self.fast} vs {self.safe}, outputs against the float file on {self.runs} input(s)): "
                f"{self.trials} trial runs, {self.seconds:.1f} s")
        lines = [head, f"  every call {self.fast}: relative error {self.error_fast:.2e}, cosine {self.cosine_fast:.6f} "
                       f"(tolerance {self.tolerance:g})"]
        if self.forced:
            lines.append(f"  {self.safe} as asked: {', '.join(self.forced)}")
        chosen = [name for name in self.safe_calls if name not in self.forced]
        if self.whole_file:
            lines.append(f"  more than {MAX_SAFE} calls past the tolerance: every call {self.safe}")
        elif chosen:
            lines.append(f"  {self.safe} ({len(chosen)} of {self.candidates} calls; the error when the call alone is {self.fast}):")
            lines += [f"    {name}  {self.alone[name]:.2e}" if name in self.alone else f"    {name}" for name in chosen]
        else:
            lines.append(f"  all {self.candidates - len(self.forced)} calls stay {self.fast}")
        lines.append(f"  written: relative error {self.error:.2e}, cosine {self.cosine:.6f}, max abs diff {self.max_abs:.2e}")
        return "\n".join(lines)


def output_errors(got: Sequence[np.ndarray], expected: Sequence[np.ndarray]) -> tuple[float, float, float]:
    """(largest relative error, smallest cosine, largest absolute difference) over the float outputs."""
    error, cosine, biggest = 0.0, 1.0, 0.0
    for a, b in zip(got, expected):
        if b is None or np.asarray(b).dtype.kind != "f":
            continue
        a64, b64 = np.asarray(a, np.float64).reshape(-1), np.asarray(b, np.float64).reshape(-1)
        if a64.shape != b64.shape:
            return float("inf"), -1.0, float("inf")
        norm = float(np.linalg.norm(b64))
        diff = float(np.linalg.norm(a64 - b64))
        error = max(error, diff / norm if norm else diff)
        denominator = float(np.linalg.norm(a64)) * norm
        cosine = min(cosine, float(a64 @ b64) / denominator if denominator else (1.0 if diff == 0 else 0.0))
        biggest = max(biggest, float(np.abs(a64 - b64).max()) if a64.size else 0.0)
    return error, cosine, biggest


def _fast_nodes(body, toggle: Toggle) -> list[onnx.NodeProto]:
    return [node for node in body.node if toggle.fast(node)]


def _candidates(model: onnx.ModelProto, toggle: Toggle) -> list[str]:
    names = [MAIN_GRAPH] if _fast_nodes(model.graph, toggle) else []
    return names + [name for name, call in _calls.module_calls(model).items()
                    if call.function is not None and _fast_nodes(call.function, toggle)]


def _make_safe(body, toggle: Toggle) -> None:
    items: list = []
    for node in body.node:
        items.append(toggle.make_safe(body, node) if toggle.fast(node) else [node])
    del body.node[:]
    body.node.extend(node for made in items for node in made)


class _Trials:
    """The file with chosen calls fast and the other candidates safe, run on every input."""

    def __init__(self, model: onnx.ModelProto, folder, candidates: list[str], toggle: Toggle,
                 runs: Sequence[Mapping[str, np.ndarray]], reference: Sequence[Sequence[np.ndarray]]):
        work = onnx.ModelProto()
        work.CopyFrom(model)
        for name in candidates:
            if name != MAIN_GRAPH:
                _calls.specialize(work, name, including_call=True)
        calls = _calls.module_calls(work)
        self.bodies = {name: None if name == MAIN_GRAPH else function_id(calls[name].function) for name in candidates}
        self.base = work.SerializeToString()
        self.folder, self.toggle, self.runs, self.reference = folder, toggle, runs, reference
        self.count = 0

    def measure(self, fast: Sequence[str]) -> tuple[float, float, float]:
        work = onnx.ModelProto.FromString(self.base)
        functions = {function_id(f): f for f in work.functions}
        chosen = set(fast)
        for name, fid in self.bodies.items():
            if name not in chosen:
                _make_safe(work.graph if fid is None else functions[fid], self.toggle)
        self.count += 1
        session = runtime.session(work.SerializeToString(), external_data_folder=self.folder, what=_WHAT)
        worst = (0.0, 1.0, 0.0)
        for feeds, expected in zip(self.runs, self.reference):
            got = runtime.run(session, dict(feeds), what=_WHAT)[1]
            error, cosine, biggest = output_errors(got, expected)
            worst = (max(worst[0], error), min(worst[1], cosine), max(worst[2], biggest))
        return worst


def apply(model: onnx.ModelProto, safe: Sequence[str], toggle: Toggle) -> None:
    """``safe`` calls to the safe compute in ``model``: a function all of whose calls are safe is
    changed in place, other safe calls get bodies of their own first."""
    calls = _calls.module_calls(model)
    by_function: dict = {}
    for call in calls.values():
        if call.function is not None:
            by_function.setdefault(function_id(call.function), []).append(call.call_name)
    whole = {fid for fid, names in by_function.items() if set(names) <= set(safe)}
    for name in safe:
        if name != MAIN_GRAPH and function_id(calls[name].function) not in whole:
            _calls.specialize(model, name, including_call=True)
    calls = _calls.module_calls(model)
    done: set = set()
    for name in safe:
        body = model.graph if name == MAIN_GRAPH else calls[name].function
        key = "main" if name == MAIN_GRAPH else function_id(body)
        if key not in done:
            done.add(key)
            _make_safe(body, toggle)


def _search(trials: _Trials, candidates: list[str], forced: list[str], tolerance: float,
            max_safe: int) -> tuple[list[str], bool, tuple, dict[str, float]]:
    """The calls made safe by error, whether the whole file goes safe, the all-fast measure and each
    call's error alone."""
    free = [name for name in candidates if name not in forced]
    everything = trials.measure(free)
    if everything[0] <= tolerance:
        return [], False, everything, {}
    alone = {name: trials.measure([name])[0] for name in free}
    safe: list[str] = []
    for name in sorted(free, key=lambda n: -alone[n]):
        if len(safe) == max_safe:
            return list(free), True, everything, alone
        safe.append(name)
        if trials.measure([n for n in free if n not in safe])[0] <= tolerance:
            break
    return safe, False, everything, alone


def choose(model: onnx.ModelProto, folder, toggle: Toggle, runs: Sequence[Mapping[str, np.ndarray]],
           reference: Sequence[Sequence[np.ndarray]], *, tolerance: float, safe_calls: Sequence[str] = (),
           max_safe: int = MAX_SAFE) -> EncoderGuardReport:
    """Choose, per call of ``model`` (changed in place), fast or safe compute (module docstring).

    Args:
        model: The quantized file, every toggled node fast; weights in ``folder``.
        toggle: What fast and safe are.
        runs: Inputs that fit the file; ``reference``: the float file's outputs on each, in output order.
        tolerance: The largest relative error of an output allowed.
        safe_calls: Calls the user wants safe (call names, as ``calls.targets`` resolves them).
        max_safe: Past this many calls chosen by error, the whole file goes safe.

    Returns:
        An :class:`EncoderGuardReport`.
    """
    start = time.perf_counter()
    candidates = _candidates(model, toggle)
    forced = [name for name in candidates if name in set(safe_calls)]
    trials = _Trials(model, folder, candidates, toggle, runs, reference)
    chosen, whole_file, everything, alone = _search(trials, candidates, forced, tolerance, max_safe)
    safe = [name for name in candidates if name in set(chosen) | set(forced)] if not whole_file else list(candidates)
    final = trials.measure([name for name in candidates if name not in safe])
    apply(model, safe, toggle)
    return EncoderGuardReport(toggle.fast_name, toggle.safe_name, tolerance, len(candidates), safe, forced, whole_file,
                              everything[0], everything[1], final[0], final[1], final[2], trials.count, len(runs),
                              {name: alone[name] for name in safe if name in alone}, time.perf_counter() - start)
