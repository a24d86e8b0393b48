"""The report of :func:`onnx_modular.files.convert.tool.convert`: what was converted and how far each
module call, class and model output moved against the original (:class:`Conversion`), measured by
:mod:`onnx_modular.check.drift` (the one drift definition)."""

from __future__ import annotations

import collections
import dataclasses
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from onnx_modular.check.drift import Drift, measure, measure_all
from onnx_modular.check.parity import fit_name, name_column_width
from onnx_modular.files.convert.select import Selection
from onnx_modular.format import records

__all__ = ["CallDrift", "ClassDrift", "Conversion", "QuantizationWarning"]

#: An output drift (of its range) the report points at the first call drifting that far.
_LARGE_DRIFT = 0.05


@dataclasses.dataclass
class CallDrift:
    """One module call of the converted file against the same call of the original.

    Attributes:
        call_name: As ``onnx-modular tree`` names it.
        module_class: The call's class (``LlamaRMSNorm``).
        converted: The call's own ops run in the new dtype.
        quantized: ``MatMulNBits`` in the call's own body.
        max_abs: The largest absolute difference over the call's outputs.
        drift: ``max_abs`` over the range (max - min) of the original's output: ``0.01`` is 1%.
        overflow: Some output is inf or NaN where the original's is finite (float16 overflowed).
    """

    call_name: str
    module_class: str
    converted: bool
    quantized: bool
    max_abs: float
    drift: float
    overflow: bool = False


@dataclasses.dataclass
class ClassDrift:
    """The worst :class:`CallDrift` of a class's calls."""

    module_class: str
    calls: int
    max_abs: float
    drift: float


@dataclasses.dataclass
class Conversion:
    """What :func:`convert` wrote and how far each module moved.

    Attributes:
        dtype / quantize: As asked (``None`` when not).
        kept: The calls left in the original precision (``keep``, ``auto_keep`` and ``range_kept``).
        auto_kept: The classes ``auto_keep`` kept, worst first, with why: the drift of the
            outputs when that class alone is converted.
        range_kept: float16: the calls kept float32 because a value at their inputs or outputs
            leaves float16's finite range (65504) in the original run, with that value's magnitude.
        range_values: float16: the values past its range; the ops that read or write them run in
            float32 inside converted bodies.
        excluded: The calls left unquantized.
        quantized: The ``MatMulNBits`` made, as ``(call or <main graph>, node)``.
        skipped: MatMuls of quantized calls left as they were, with the reason.
        weights: Main-graph weights stored in the new dtype; ``float32_weights``: those kept
            float32 because a kept module reads them.
        casts: ``Cast`` nodes added (boundaries between converted and kept, graph inputs and outputs).
        split: Functions given to some calls alone so that their plans differ.
        outputs: Per model output: ``(max_abs, drift)`` against the original.
        calls / classes: Per module call and class, in execution order / worst first.
        selections: ``TopK``/``ArgMax``/``ArgMin`` of the main graph whose indices differ from the
            original's (:class:`~onnx_modular.files.convert.select.Selection`): outputs downstream
            of a flipped selection move by whole elements (another box, another token), whatever
            the precision of the rest. ``flipped_before``: those ``auto_keep``'s first trial
            flipped (it then keeps the calls feeding them first).
    """

    source: str
    output: str
    dtype: str | None
    quantize: str | None
    block_size: int
    kept: list[str]
    auto_kept: list[tuple[str, float]]
    tolerance: float | None
    excluded: list[str]
    quantized: list[tuple[str, str]]
    skipped: list[tuple[str, str, str]]
    weights: int
    float32_weights: list[str]
    casts: int
    split: list[str]
    outputs: dict[str, tuple[float, float]]
    calls: list[CallDrift]
    classes: list[ClassDrift]
    source_bytes: int = 0
    output_bytes: int = 0
    range_kept: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    range_values: int = 0
    selections: list[Selection] = dataclasses.field(default_factory=list)
    flipped_before: list[Selection] = dataclasses.field(default_factory=list)

    @property
    def max_drift(self) -> float:
        """The largest drift of the model's outputs."""
        return max((drift for _, drift in self.outputs.values()), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["max_drift"] = self.max_drift
        data["outputs"] = {k: {"max_abs": a, "drift": d} for k, (a, d) in self.outputs.items()}
        data["auto_kept"] = [{"class": c, "drift_alone": d} for c, d in self.auto_kept]
        data["range_kept"] = [{"call": c, "magnitude": m} for c, m in self.range_kept]
        data["quantized"] = [{"call": c, "node": n} for c, n in self.quantized]
        data["skipped"] = [{"call": c, "node": n, "reason": r} for c, n, r in self.skipped]
        return data

    def to_json(self) -> str:
        """The report as strict JSON (the package's one encoder: a non-finite drift is ``"inf"``)."""
        return records.to_json(self.to_dict())

    def __str__(self) -> str:
        what = [f"{self.dtype}" if self.dtype else None, f"{self.quantize} weights (block {self.block_size})" if self.quantize else None]
        lines = [f"Wrote {self.output} ({' + '.join(w for w in what if w)}) from {self.source}"]
        if self.output_bytes and self.source_bytes:
            lines.append(f"  size: {self.source_bytes / 1e6:.2f} MB -> {self.output_bytes / 1e6:.2f} MB ({self.output_bytes / self.source_bytes:.2f}x)")
        lines += self._precision_lines()
        lines += self._quantize_lines()
        if self.split:
            lines.append(f"  calls given bodies of their plan (split from shared ones): {_short_list(self.split, 6)}")
        lines += self._output_lines()
        if self.calls:  # a flat file has no module calls to compare
            lines += self._call_lines()
        return "\n".join(lines)

    def _precision_lines(self) -> list[str]:
        lines = []
        if self.dtype:
            lines.append(f"  {self.weights} weights in {self.dtype}, {len(self.float32_weights)} kept float32; {self.casts} Casts added")
            if self.kept:
                lines.append(f"  kept in float32: {len(self.kept)} calls ({_short_list(self.kept)})")
            if self.range_values:
                largest = max((m for _, m in self.range_kept), default=0.0)
                lines.append(f"  {self.range_values} values leave {self.dtype}'s range in the original run: their ops run in float32"
                             + (f"; {len(self.range_kept)} calls kept float32 for it ({_short_list([c for c, _ in self.range_kept])}; "
                                f"values up to {largest:.4g})" if self.range_kept else ""))
        feeding = {c for s in self.flipped_before for c in s.feeding}
        for name, drift in self.auto_kept:
            if name in feeding:
                lines.append(f"  auto-keep {'kept' if self.dtype else 'left unquantized'} {name}: it feeds the scores of a "
                             f"selection the conversion flipped; then the outputs drift {drift:.3%} of their range")
                continue
            done = "converted" if self.dtype else "quantized"
            lines.append(f"  auto-keep {'kept' if self.dtype else 'left unquantized'} {name}: " + (
                f"{done} (alone, or with the rest), the file does not run in onnxruntime" if drift == math.inf
                else f"{done} alone, it moves the outputs by {drift:.3%} of their range"))
        if self.tolerance is not None:
            verdict = "within" if self.max_drift <= self.tolerance else "NOT within"
            lines.append(f"  outputs {verdict} --auto-keep {self.tolerance:g} ({self.max_drift:.3%} of their range)")
        return lines

    def _quantize_lines(self) -> list[str]:
        if not self.quantize:
            return []
        lines = [f"  MatMulNBits nodes (in shared bodies): {len(self.quantized)}; weights left float32: {len(self.skipped)}"
                 + (f"; not quantized: {_short_list(self.excluded)}" if self.excluded else "")]
        if not self.quantized:
            lines.append("  WARNING: nothing was quantized" + (" (the weights left are listed below)" if self.skipped else
                         " (no MatMul or Gemm reads a constant weight)"))
        for call, node, reason in self.skipped[:8]:
            lines.append(f"    left: {call} {node}: {reason}")
        if len(self.skipped) > 8:
            lines.append(f"    ... and {len(self.skipped) - 8} more (the report's `skipped`)")
        return lines

    def _output_lines(self) -> list[str]:
        lines = ["Drift against the original on the same inputs, per output (max abs; % of the output's range):"]
        width = name_column_width(self.outputs)
        for name, (max_abs, drift) in self.outputs.items():  # the file's names (output.past_key_values...) alone
            lines.append(f"  {fit_name(name, width):<{width}} {max_abs:10.3g} {drift:8.3%}")
        for s in self.selections:
            how = "the same elements in another order" if s.same_members else "other elements"
            lines.append(f"  selection flipped: {s.op_type} {s.node} picks {how} ({s.changed} of {s.total} indices differ): the "
                         "outputs it selects for move by whole elements, not by the precision lost; its scores come from "
                         f"{_short_list(s.feeding) if s.feeding else 'no module call'}. Keep those unconverted (--auto-keep "
                         "keeps them first, --exclude/--keep by name)")
        overflowed = [c.call_name for c in self.calls if c.overflow or not math.isfinite(c.max_abs)]
        if overflowed:  # the outputs' drift alone would hide them (a later op can clip an inf)
            lines.append(f"  {len(overflowed)} calls overflow (inf or NaN where the original is finite): {_short_list(overflowed)}; "
                         "keep them in float32 (--keep) to convert without overflow")
        return lines

    def _call_lines(self) -> list[str]:
        lines = []
        first = next((c for c in self.calls if c.drift > _LARGE_DRIFT and c.converted), None)
        if first is not None and self.tolerance is None and self.max_drift > _LARGE_DRIFT:
            lines.append(f"  hint: the first call drifting over {_LARGE_DRIFT:.0%}: {first.call_name} ({first.module_class}); "
                         f"try --keep {first.module_class}, or --auto-keep 0.01")
        lines.append("Per class, worst call:")
        width = name_column_width(c.module_class for c in self.classes)
        for c in self.classes:
            lines.append(f"  {fit_name(c.module_class, width):<{width}} {c.calls:4d} calls {c.max_abs:10.3g} {c.drift:8.3%}")
        lines.append("Per call:")
        width = name_column_width(c.call_name for c in self.calls)
        for c in self.calls:
            mode = ("q" if c.quantized else "-") + ("c" if c.converted else ("k" if self.dtype else "-"))
            lines.append(f"  {fit_name(c.call_name, width):<{width}} {mode} {c.module_class:<24} {c.max_abs:10.3g} {c.drift:8.3%}")
        return lines


class QuantizationWarning(UserWarning):
    """``quantize`` left weights in float32 (Conv weights, shared or computed ones): they are
    listed in :attr:`Conversion.skipped` with the reason."""


def warn_left(quantize: str | None, quantized: Sequence, skipped: Sequence[tuple[str, str, str]]) -> None:
    """A :class:`QuantizationWarning` when ``quantize`` left weights float32."""
    if not quantize or not skipped:
        return
    reasons = collections.Counter(reason for _, _, reason in skipped)
    text = (f"--quantize {quantize}: {len(skipped)} weight(s) left float32 ({len(quantized)} quantized): "
            + "; ".join(f"{count} x {reason}" for reason, count in reasons.most_common(3)))
    warnings.warn_explicit(text, QuantizationWarning, "onnx_modular", 0, module="onnx_modular")


def _short_list(names: Sequence[str], count: int = 4) -> str:
    shown = ", ".join(names[:count])
    return shown + (f" and {len(names) - count} more" if len(names) > count else "")


def call_drift(call_name: str, module_class: str, converted: bool, quantized: bool,
               actual: Iterable[np.ndarray], expected: Iterable[np.ndarray]) -> CallDrift:
    """A call's outputs in the converted file (``actual``) against the original's (``expected``)."""
    measured = measure_all(actual, expected)
    return CallDrift(
        call_name=call_name, module_class=module_class, converted=converted, quantized=quantized,
        max_abs=measured.max_abs, drift=measured.scaled, overflow=measured.overflow,
    )


def class_drifts(calls: Iterable[CallDrift]) -> list[ClassDrift]:
    """The worst call of every class, worst class first."""
    classes: dict[str, list[CallDrift]] = collections.defaultdict(list)
    for call in calls:
        classes[call.module_class].append(call)
    return sorted(
        (ClassDrift(name, len(rows), max(r.max_abs for r in rows), max(r.drift for r in rows)) for name, rows in classes.items()),
        key=lambda row: -row.drift,
    )


def output_drifts(actual: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> dict[str, tuple[float, float]]:
    """Per output of the original that the converted file also has: ``(max_abs, drift)``."""
    return {name: _pair(measure(actual[name], value)) for name, value in reference.items() if name in actual}


def _pair(measured: Drift) -> tuple[float, float]:
    return measured.max_abs, measured.scaled
