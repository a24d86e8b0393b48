"""``optimize --quantize auto --calibration FILE``: each module call's precision chosen from its measured sensitivity.

On the fused file (weights in memory):

1. Every call with a MatMul weight in its own body (the packed Q/K/V of an attention body, each
   projection's ``Linear``, ``lm_head``), or an embedding table (a ``Gather`` of a weight, read as
   ``GatherBlockQuantized`` from its own packed table when quantized; the builder and the uniform
   int4 file leave an untied one float32), gets a body of its own
   (:func:`~onnx_modular.calls.targets.specialize`).
2. **Importance**: one run per calibration row of a copy that returns each MatMul's input
   (:func:`~onnx_modular.calls.capture.call_values_runs`) gives, per weight, the mean squared
   activation entering each input channel (llama.cpp's importance matrix); the k-quant rounding
   weights each channel's error by it.
3. **Sensitivity**: for each such call and each :data:`CHOICES` entry (int4 at blocks of 16 to 64 with
   k-quant rounding, the builder's int4 (blocks of 32, symmetric, round-to-nearest), int8), the file
   with that call alone quantized so is run on the calibration ids; its mean next-token KL against
   the float file (:mod:`onnx_modular.check.quality`) and the bytes it saves are recorded. The weights
   are packed by the weight-quantization pass (:mod:`onnx_modular.passes.precision.quantize_weights`,
   onnxruntime's packing; k-quant: :mod:`onnx_modular.passes.precision.kquant`).
4. **Choice**: the KL of a file is predicted as the sum of its calls' KLs; the choice per call
   (float included) that minimises it within the size budget is found by dynamic programming over
   the bytes (:func:`choose`). The budget: ``max_size`` (bytes, or a ratio of the uniform file), by
   default the size of ``--quantize int4``'s uniform file (the builder's recipe) of the same input.
5. The file is built with those choices, measured on the calibration ids (KL, top-1, perplexity),
   and, when it is over the budget (the bodies no longer shared add bytes), chosen again within
   the budget less the excess.

Every choice computes at ``accuracy_level=4`` (int8 activations, the builder's speed); that error is
in the measured KL, so no separate guard runs. Left out on purpose, measured on onnxruntime 1.32's
CPU kernels (a trained 4-layer Llama, hidden 192, every call at one choice, one thread): 8-bit
``MatMulNBits`` at levels 0-3 decodes 120-140x slower than at level 4; int4 blocks of 128 (K=192:
one padded block) 1.57x slower than blocks of 32.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx

from onnx_modular.calls import targets as _calls
from onnx_modular.check.quality import QualityReport, compare_logits
from onnx_modular.errors import InvalidInputError
from onnx_modular.format import metadata
from onnx_modular.passes.precision.quantize_weights import QuantizeSettings, quantize_weights, root_logging_kept
from onnx_modular.storage.proto import function_id

__all__ = ["Choice", "CHOICES", "UNIFORM", "FLOAT", "AutoReport", "quantize_auto", "choose", "AUTO_KEY", "parse_max_size"]

#: The file's record of the choice per call (JSON).
AUTO_KEY = metadata.PREFIX + "quantize_auto"
#: The largest file the choice works on in memory (one protobuf message).
MAX_FLOAT_BYTES = 1_800_000_000


@dataclasses.dataclass(frozen=True)
class Choice:
    """One precision a call's MatMul weights can get (``bits`` None: left float)."""

    name: str
    bits: int | None = None
    block_size: int = 32
    symmetric: bool = False
    algorithm: str = "rtn"
    accuracy_level: int = 0
    #: k-quant's error weighted per input channel by the calibration activations' mean square (llama.cpp's importance matrix).
    weighted: bool = False

    def settings(self) -> QuantizeSettings:
        return QuantizeSettings(self.bits or 0, self.block_size, self.symmetric, self.accuracy_level or None, self.algorithm,
                                embeddings=True)


FLOAT = Choice("float")
#: The builder's int4 (the uniform ``--quantize int4`` file): blocks of 32, symmetric, round to nearest, int8 compute.
UNIFORM = Choice("int4 b32 sym", 4, 32, True, "rtn", 4)
CHOICES = (
    Choice("int4 b64 k-quant", 4, 64, False, "k_quant", 4, True),
    Choice("int4 b32 k-quant", 4, 32, False, "k_quant", 4, True),
    UNIFORM,
    Choice("int4 b16 k-quant", 4, 16, False, "k_quant", 4, True),
    Choice("int8 b32 sym", 8, 32, True, "rtn", 4),
)


@dataclasses.dataclass
class CallChoice:
    """A call's row of the report: its choice, that choice's KL alone (predicted share), the bytes of its weights."""

    call: str
    choice: str
    kl: float
    bytes: int
    float_bytes: int


@dataclasses.dataclass
class AutoReport:
    """What :func:`quantize_auto` chose and measured.

    Attributes:
        calls: Per call, in execution order: the choice, its KL alone, its weights' bytes.
        budget / budget_from: The size budget in bytes and where it came from.
        bytes: The file's size as written (model and weights, serialized).
        uniform_bytes: The size of the uniform int4 file of the same input.
        predicted_kl: The sum of the calls' KLs alone.
        measured: The chosen file against the float file on the calibration ids.
        uniform: The uniform int4 file (the builder's recipe) on the same ids.
        sensitivity: Per call, per choice, its KL alone (all that was measured).
        trials / seconds: Files run, and the time taken.
        weighted: The weights whose k-quant rounding was weighted by their input channels' importance
            (the calibration activations' mean square).
    """

    calls: list[CallChoice]
    budget: int
    budget_from: str
    bytes: int
    uniform_bytes: int
    predicted_kl: float
    measured: QualityReport
    uniform: QualityReport
    sensitivity: dict[str, dict[str, float]]
    trials: int
    seconds: float
    weighted: int = 0

    def text(self) -> str:
        m, u = self.measured, self.uniform
        lines = [f"Quantized (auto): each call's precision chosen on {m.positions} calibration positions, "
                 f"{self.trials} trial files, {self.seconds:.1f} s; k-quant weighted by the calibration activations "
                 f"(importance) for {self.weighted} weights",
                 f"  budget {self.budget:,} bytes ({self.budget_from}); file {self.bytes:,} bytes "
                 f"({self.bytes / self.uniform_bytes:.3f}x the uniform int4 file's {self.uniform_bytes:,})",
                 f"  mean next-token KL: predicted {self.predicted_kl:.3g}, measured {m.kl_mean:.3g} nats; top-1 {m.top1:.2%}; "
                 f"perplexity {m.perplexity:.4g} (float {m.perplexity_reference:.4g})",
                 f"  uniform int4 (blocks of 32, symmetric, accuracy_level=4): KL {u.kl_mean:.3g}, top-1 {u.top1:.2%}, "
                 f"perplexity {u.perplexity:.4g}"]
        width = max((len(c.call) for c in self.calls), default=4)
        lines.append(f"  {'call':<{width}}  {'choice':<18} {'KL alone':>10} {'bytes':>10}")
        lines += [f"  {c.call:<{width}}  {c.choice:<18} {c.kl:>10.3g} {c.bytes:>10,}" for c in self.calls]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_max_size(text: str | int | float | None) -> tuple[str, float] | None:
    """``--max-size``: ``BYTES`` (an integer, ``3.5MB``/``3500KB`` too) or ``RATIO`` (``1.02x`` or a number below 10:
    a ratio of the uniform int4 file's size). ``("bytes", n)`` or ``("ratio", r)``."""
    if text is None:
        return None
    value = str(text).strip().lower()
    units = {"kb": 1e3, "mb": 1e6, "gb": 1e9, "b": 1}
    try:
        if value.endswith("x"):
            ratio = float(value[:-1])
            return ("ratio", ratio) if ratio > 0 else _bad_size(text)
        for unit, factor in units.items():
            if value.endswith(unit):
                return ("bytes", float(value[: -len(unit)]) * factor)
        number = float(value)
    except ValueError:
        return _bad_size(text)
    if number <= 0:
        return _bad_size(text)
    return ("ratio", number) if number < 10 else ("bytes", number)


def _bad_size(text) -> tuple[str, float]:
    raise InvalidInputError(f"max_size must be bytes (3600000, 3.6MB) or a ratio of the uniform int4 file (1.02x), not {text!r}.",
                            hint="--max-size 1.0x keeps the uniform int4 file's size.")


def _weight_calls(model: onnx.ModelProto) -> tuple[list[str], set[str]]:
    """Calls whose own body has a MatMul or Gemm reading a formal input (a weight passed down), or a
    ``Gather`` of a formal input (an embedding table: ``GatherBlockQuantized`` when quantized); and the
    calls of the second kind only (which the uniform int4 file leaves float, as the builder does)."""
    found, tables = [], set()
    for name, call in _calls.module_calls(model).items():
        body = call.function
        if body is None:
            continue
        formal = set(body.input)
        ops = {n.op_type for n in body.node if n.domain in ("", "ai.onnx") and len(n.input) > 1 and
               (n.input[1] in formal if n.op_type in ("MatMul", "Gemm") else n.input[0] in formal)}
        if ops & {"MatMul", "Gemm", "Gather"}:
            found.append(name)
            if not ops & {"MatMul", "Gemm"}:
                tables.add(name)
    return found, tables


class _Bench:
    """The float file with every candidate in a body of its own; builds and runs trial files."""

    def __init__(self, model: onnx.ModelProto, ids: np.ndarray, size_of: Callable[[onnx.ModelProto], int],
                 props: Mapping[str, str]):
        self.size_of = size_of
        self.props = props
        self.original = model
        self.work = onnx.ModelProto()
        self.work.CopyFrom(model)
        candidates, self.tables = _weight_calls(self.work)
        for name in candidates:
            _calls.specialize(self.work, name, including_call=True)
        # the main-graph weights each call reads in its own body; a call with none (a Gather of an activation) is no candidate
        self.sources = {name: _sources(self.work, name) for name in candidates}
        self.candidates = [name for name in candidates if self.sources[name]]
        self.ids = ids
        self.trials = 0
        self.reference = self.logits(self.work)
        self.importance: dict[str, np.ndarray] = {}

    def uniform(self) -> dict[str, Choice]:
        """The uniform int4 file's choices: the builder's int4 for every MatMul, embedding tables float."""
        return {n: FLOAT if n in self.tables else UNIFORM for n in self.candidates}

    def measure_importance(self) -> None:
        """Per MatMul weight of the candidates (by initializer), the mean squared activation entering each of its
        input channels on the calibration ids (llama.cpp's importance matrix), from one capture of every call's inputs."""
        from onnx_modular.calls.capture import call_values_runs
        from onnx_modular.runtime.generation import prompt_feeds

        calls = _calls.module_calls(self.work)
        wanted, weights = {}, {}
        for name in self.candidates:
            body = calls[name].function
            matmuls = [n for n in body.node if n.op_type == "MatMul" and n.domain in ("", "ai.onnx") and len(n.input) == 2
                       and n.input[0] in body.input and n.input[1] in body.input]
            sources = self.sources[name]
            if len(matmuls) == 1 and len(sources) == 1:  # one weight, read by one MatMul of a formal input
                wanted[name] = [list(body.input).index(matmuls[0].input[0])]
                weights[name] = next(iter(sources))
        if not wanted:
            return
        sums: dict[str, np.ndarray] = {}
        counts: collections.Counter = collections.Counter()
        runs = call_values_runs(self.work, wanted, lambda session: (prompt_feeds(session, row[None, :]) for row in self.ids))
        for captured in runs:
            for name, (inputs, _) in captured.items():
                x = np.asarray(next(iter(inputs.values())), np.float64)
                x = x.reshape(-1, x.shape[-1])
                sums[name] = sums.get(name, 0) + np.sum(x * x, axis=0)
                counts[name] += x.shape[0]
        self.importance = {weights[n]: (sums[n] / counts[n]).astype(np.float32) for n in sums}

    def build(self, choices: Mapping[str, Choice], model: onnx.ModelProto | None = None) -> onnx.ModelProto:
        """A copy of the work file (or ``model``) with the calls of ``choices`` quantized so, weights inline."""
        result = onnx.ModelProto()
        result.CopyFrom(model if model is not None else self.work)
        calls = _calls.module_calls(result)
        groups: dict[Choice, list[str]] = {}
        for name, choice in choices.items():
            if choice.bits:
                groups.setdefault(choice, []).append(name)
        with root_logging_kept():
            for choice, names in groups.items():
                done = quantize_weights(result, [(calls[n].function, n) for n in names], choice.settings(),
                                        importance=self.importance if choice.weighted else None)
                made = {t.name: t for t in result.graph.initializer if t.name in done.sources}
                for name, source in done.sources.items():
                    tensor = made[name]
                    tensor.CopyFrom(onnx.numpy_helper.from_array(np.asarray(source()).reshape(tuple(tensor.dims)), name))
        read = {i for body in [result.graph] for n in body.node for i in n.input} | {o.name for o in result.graph.output}
        kept = [t for t in result.graph.initializer if t.name in read]
        del result.graph.initializer[:]
        result.graph.initializer.extend(kept)
        return result

    def build_shared(self, choices: Mapping[str, Choice], props: bool = True) -> onnx.ModelProto:
        """The original file with the calls of ``choices`` quantized so, bodies kept shared where the
        calls of a function got the same choice (the most common choice keeps the shared body)."""
        model = onnx.ModelProto()
        model.CopyFrom(self.original)
        calls = _calls.module_calls(model)
        by_function: dict = {}
        for name in choices:
            by_function.setdefault(function_id(calls[name].function), []).append(name)
        for names in by_function.values():
            common = collections.Counter(choices[n] for n in names).most_common(1)[0][0]
            for name in names:
                if choices[name] != common:
                    _calls.specialize(model, name, including_call=True)
        calls = _calls.module_calls(model)
        one_call: dict = {}  # one call per function: a shared body is quantized once
        for name in choices:
            one_call.setdefault(function_id(calls[name].function), name)
        result = self.build({n: choices[n] for n in one_call.values()}, model)
        for key, value in {} if not props else {**self.props, AUTO_KEY: json.dumps({n: c.name for n, c in choices.items()})}.items():
            _calls.set_prop(result, key, value)  # in the file, and in its size
        return result

    def logits(self, model: onnx.ModelProto) -> np.ndarray:
        from onnx_modular.check.quality import file_logits

        self.trials += 1
        return file_logits(model.SerializeToString(), self.ids, what="a trial file of quantize auto")

    def measure(self, model: onnx.ModelProto) -> QualityReport:
        report = compare_logits(self.reference, self.logits(model), self.ids)
        report.bytes = self.size_of(model)
        return report


def _weight_bytes(model: onnx.ModelProto, before: onnx.ModelProto) -> int:
    """Bytes of the initializers ``model`` has and ``before`` had not, less those it dropped."""
    old = {t.name: len(t.raw_data) for t in before.graph.initializer}
    new = {t.name: len(t.raw_data) for t in model.graph.initializer}
    return sum(v for k, v in new.items() if k not in old) - sum(v for k, v in old.items() if k not in new)


def choose(options: Mapping[str, Sequence[tuple[Choice, int, float]]], budget: int, steps: int = 4000) -> dict[str, Choice]:
    """Per call, the choice minimising the sum of KLs with the sum of bytes within ``budget``.

    ``options``: per call, ``(choice, bytes, kl)`` of each choice (float included). Multiple-choice
    knapsack by dynamic programming over bytes in ``steps`` units (rounded up: never over).

    Raises:
        InvalidInputError: Even the smallest choice of every call is over ``budget``.
    """
    names = list(options)
    smallest = sum(min(b for _, b, _ in options[n]) for n in names)
    if smallest > budget:
        raise InvalidInputError(f"quantize auto: the smallest choice of every call takes {smallest:,} bytes of weights, "
                                f"more than the {budget:,} the budget leaves for them.",
                                hint="Give a larger --max-size (bytes, or a ratio of the uniform int4 file such as 1.1x).")
    unit = max(1, math.ceil(budget / steps))
    size = budget // unit + 1
    best = np.zeros(size)  # best[b]: the least KL with at most b units used
    picks = []
    for name in names:
        candidate = np.full((len(options[name]), size), np.inf)
        for index, (_, cost, kl) in enumerate(options[name]):
            units = math.ceil(cost / unit)
            if units < size:
                candidate[index, units:] = best[: size - units] + kl
        picks.append(candidate.argmin(0))
        best = candidate.min(0)
    chosen: dict[str, Choice] = {}
    left = size - 1
    for name, pick in zip(reversed(names), reversed(picks)):
        index = int(pick[left])
        choice, cost, _ = options[name][index]
        chosen[name] = choice
        left -= math.ceil(cost / unit)
    return {name: chosen[name] for name in names}


def quantize_auto(model: onnx.ModelProto, ids: np.ndarray, *, max_size: tuple[str, float] | None = None,
                  choices: Sequence[Choice] = CHOICES,
                  size_of: Callable[[onnx.ModelProto], int] | None = None,
                  metadata_props: Mapping[str, str] | None = None) -> tuple[onnx.ModelProto, AutoReport]:
    """Choose each call's precision on ``ids`` within the budget; the quantized model (weights inline) and the report.

    Args:
        model: The fused float file, weights in memory.
        ids: Calibration token ids ``[n, seq]`` (:func:`onnx_modular.check.quality.load_ids`).
        max_size: :func:`parse_max_size`'s; ``None``: the uniform int4 file's size.
        size_of: The bytes a model takes once written (``optimize`` writes it and its external data);
            default its serialized size.
        metadata_props: Written into the file (and counted in its size) beside the choices (:data:`AUTO_KEY`).
    """
    start = time.perf_counter()
    if model.ByteSize() > MAX_FLOAT_BYTES:
        raise InvalidInputError(f"quantize auto works on the float file in memory: {model.ByteSize():,} bytes is past "
                                f"{MAX_FLOAT_BYTES:,}.", hint="Use --quantize int4 for files this large.")
    bench = _Bench(model, ids, size_of or (lambda proto: proto.ByteSize()), dict(metadata_props or {}))
    if not bench.candidates:
        raise InvalidInputError("quantize auto: no module call of the file has a MatMul weight to quantize.",
                                hint="Give a decoder exported by onnx_modular (export --task causal-lm-with-past).")
    bench.measure_importance()
    uniform_choices = bench.uniform()
    uniform_file = bench.build_shared(uniform_choices)
    uniform_bytes = bench.size_of(uniform_file)
    uniform = bench.measure(uniform_file)
    options: dict[str, list[tuple[Choice, int, float]]] = {}
    sensitivity: dict[str, dict[str, float]] = {}
    for name in bench.candidates:
        rows = []
        for choice in choices:
            trial = bench.build({name: choice})
            saved = _weight_bytes(trial, bench.work)
            rows.append((choice, saved, bench.measure(trial).kl_mean))
        own = sum(len(t.raw_data) for t in bench.work.graph.initializer if t.name in bench.sources[name])
        options[name] = [(FLOAT, own, 0.0)] + [(c, own + saved, kl) for c, saved, kl in rows]
        sensitivity[name] = {c.name: kl for c, _, kl in rows}
    if max_size is None:
        budget, budget_from = uniform_bytes, "the uniform int4 file's size"
    elif max_size[0] == "ratio":
        budget, budget_from = int(uniform_bytes * max_size[1]), f"{max_size[1]:g}x the uniform int4 file's size"
    else:
        budget, budget_from = int(max_size[1]), "--max-size"
    # all but the choosable weights, as the uniform file has it (names and bodies included)
    rest = uniform_bytes - sum(next(b for c, b, _ in o if c == uniform_choices[n]) for n, o in options.items())
    chosen, result = _solve(bench, options, budget, budget_from, rest)
    size = bench.size_of(result)
    rows = [CallChoice(n, chosen[n].name, next(kl for c, _, kl in options[n] if c == chosen[n]),
                       next(b for c, b, _ in options[n] if c == chosen[n]), options[n][0][1]) for n in bench.candidates]
    measured = bench.measure(result)
    measured.shares = {r.call: r.kl for r in rows}
    report = AutoReport(rows, budget, budget_from, size, uniform_bytes, sum(r.kl for r in rows), measured, uniform,
                        sensitivity, bench.trials, time.perf_counter() - start, len(bench.importance))
    return result, report


def _fit(bench: _Bench, options: Mapping[str, Sequence[tuple[Choice, int, float]]], budget: int, rest: int,
         expand=lambda chosen: chosen) -> tuple[dict[str, Choice], onnx.ModelProto] | None:
    """The choice within ``budget`` (``rest``: the bytes besides the choosable weights) and its file, or None."""
    weights = budget - rest
    for _ in range(6):  # the file's own bytes (bodies no longer shared, zero points' names) past the budget: less for the weights
        try:
            picked = choose(options, weights)
        except InvalidInputError:
            return None
        chosen = expand(picked)
        result = bench.build_shared(chosen)
        size = bench.size_of(result)
        if size <= budget:
            return chosen, result
        used = sum(next(b for c, b, _ in options[n] if c == choice) for n, choice in picked.items())
        weights = used - (size - budget) - 1
    return None


def _solve(bench: _Bench, options: dict[str, list[tuple[Choice, int, float]]], budget: int,
           budget_from: str, rest: int) -> tuple[dict[str, Choice], onnx.ModelProto]:
    """The better of two choices within ``budget``: per call (bodies that differ are no longer shared: the
    file grows by their copies) and per function (the calls of one shared body choose together)."""
    calls = _calls.module_calls(bench.original)
    roles: dict = collections.defaultdict(list)
    for name in options:
        roles[function_id(calls[name].function)].append(name)
    together = {names[0]: [(choice, sum(options[n][i][1] for n in names), sum(options[n][i][2] for n in names))
                           for i, (choice, _, _) in enumerate(options[names[0]])] for names in roles.values()}
    fits = [_fit(bench, options, budget, rest),
            _fit(bench, together, budget, rest, lambda chosen: {n: chosen[names[0]] for names in roles.values() for n in names})]
    fits = [f for f in fits if f is not None]
    if not fits:
        raise InvalidInputError(f"quantize auto: no choice of precisions fits in {budget:,} bytes ({budget_from}).",
                                hint="Give a larger --max-size (bytes, or a ratio of the uniform int4 file such as 1.05x).")

    def predicted(chosen: Mapping[str, Choice]) -> float:
        return sum(next(kl for c, _, kl in options[n] if c == chosen[n]) for n in options)

    return min(fits, key=lambda fit: predicted(fit[0]))


def _sources(model: onnx.ModelProto, name: str) -> set[str]:
    """The main-graph initializers of the weights (and embedding tables) the call ``name`` reads in its own body."""
    trial = onnx.ModelProto()
    trial.CopyFrom(model)
    calls = _calls.module_calls(trial)
    done = quantize_weights(trial, [(calls[name].function, name)], QuantizeSettings(8, 32, True, None, embeddings=True))
    return {n.rsplit("_Q8", 1)[0] for n in done.sources if "_Q8" in n}

