"""Parity of a file: onnxruntime on the modular model and its inlined flat copy, against a reference.

One row type for every check (:class:`Parity`: a model output, a module call of localization,
a block of the block-wise check) and the report of a run's outputs (:class:`ParityReport`):
the export's check against PyTorch, ``onnx_modular.verify`` and ``onnx-modular verify``.
The reference columns are PyTorch's outputs, expected arrays given by the user, or absent
(then only modular vs flat is compared). No torch here; :mod:`onnx_modular.check.verification`
adds the PyTorch side.

Example::

    report = check_file("m.onnx", random_inputs(load_model_file("m.onnx")))
    print(report)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from onnx_modular.errors import InvalidInputError, ParityError
from onnx_modular.runtime import sessions as runtime
from onnx_modular.runtime.inputs import model_inputs
from onnx_modular.storage.checks import check_expanded_size
from onnx_modular.storage.load import load_model_file

__all__ = [
    "Tolerance",
    "default_tolerance",
    "user_tolerance",
    "REL_FLOOR",
    "max_differences",
    "blocks",
    "BLOCK",
    "allclose",
    "Parity",
    "OutputParity",
    "ParityReport",
    "compare_outputs",
    "check_file",
    "name_column_width",
    "fit_name",
]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``|onnx - reference| <= atol + rtol * |reference|`` elementwise (numpy.allclose)."""

    atol: float
    rtol: float

    def __post_init__(self) -> None:
        for name in ("atol", "rtol"):
            value = getattr(self, name)
            try:
                valid = math.isfinite(value) and value >= 0
            except TypeError:
                valid = False
            if not valid:
                raise InvalidInputError(
                    f"The tolerance {name}={value!r} must be a finite number >= 0 "
                    "(a NaN, infinite or negative tolerance makes the comparison meaningless)."
                )


_DEFAULT_TOLERANCES = {
    "float64": Tolerance(1e-7, 1e-6),
    "float32": Tolerance(1e-4, 1e-3),
    "float16": Tolerance(1e-2, 1e-2),
    "bfloat16": Tolerance(5e-2, 5e-2),
}


def default_tolerance(dtype: Any) -> Tolerance:
    """Defaults per dtype (a numpy or torch dtype, a numpy scalar type, or its name); integers and
    bools match exactly. The one table of default tolerances: every check reads it."""
    if isinstance(dtype, type) and issubclass(dtype, np.generic):  # np.float16, not np.dtype("float16")
        dtype = np.dtype(dtype)
    name = str(dtype).replace("torch.", "")
    return _DEFAULT_TOLERANCES.get(name, Tolerance(0.0, 0.0))


def user_tolerance(rtol: float | None, atol: float | None) -> Tolerance | None:
    """The user's ``rtol``/``atol``, or ``None`` for the per-dtype defaults of :func:`default_tolerance`.

    A missing half takes float32's default. Every entry point (``export_modular``,
    ``result.verify``, ``onnx_modular.verify``, ``onnx-modular export`` / ``verify``) reads the
    user's values through here. NaN, infinite or negative values are refused (:class:`Tolerance`).
    """
    if rtol is None and atol is None:
        return None
    default = default_tolerance("float32")
    return Tolerance(atol=default.atol if atol is None else atol, rtol=default.rtol if rtol is None else rtol)


#: Relative errors divide by ``|reference| + REL_FLOOR``, as torch's ONNX verifier does, so a
#: reference value of 0 gives a finite, readable ratio instead of one divided by float64's tiny.
REL_FLOOR = 1e-7


def max_differences(actual: np.ndarray, expected: np.ndarray, *, rel_above: float = 0.0) -> tuple[float, float]:
    """(max abs, max rel) difference; NaN/inf at the same places count as equal, a shape
    mismatch as inf; strings compare exactly. Relative: ``|a - e| / (|e| + REL_FLOOR)``, over the
    elements with ``|e| > rel_above`` (a report passes its ``atol``: near 0 the absolute tolerance
    judges, and a float16 logit of 1e-4 off by 3e-2 would show a relative error of 300)."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    if actual.shape != expected.shape:
        return math.inf, math.inf
    if actual.size == 0:
        return 0.0, 0.0
    if actual.dtype.kind in "OSU":
        return (0.0, 0.0) if bool(np.all(actual == expected)) else (math.inf, math.inf)
    if actual.dtype == expected.dtype and actual.dtype in (np.float16, np.float32):
        fast = _float32_differences(actual, expected, rel_above)
        if fast is not None:
            return fast
    worst_abs = worst_rel = 0.0
    for block_a, block_e in blocks(actual, expected):  # widened a block at a time: 48 bytes an element at once
        actual64 = block_a.astype(np.complex128 if actual.dtype.kind == "c" else np.float64)
        expected64 = block_e.astype(actual64.dtype)
        same = (np.isnan(actual64) & np.isnan(expected64)) | (actual64 == expected64)
        diff = np.where(same, 0.0, np.abs(actual64 - expected64))
        diff = np.where(np.isnan(diff), np.inf, diff)
        scale = np.abs(np.where(np.isfinite(expected64), expected64, 0.0))
        with np.errstate(over="ignore", invalid="ignore"):  # inf is the honest answer
            rel = np.where((diff == 0) | (scale <= rel_above) & np.isfinite(diff), 0.0, diff / (scale + REL_FLOOR))
        worst_abs, worst_rel = max(worst_abs, float(diff.max())), max(worst_rel, float(rel.max()))
    return worst_abs, worst_rel


def _float32_differences(actual: np.ndarray, expected: np.ndarray, rel_above: float) -> tuple[float, float] | None:
    """:func:`max_differences` of two float32 (or float16) arrays, in float32: a block of equal
    values at the cost of one comparison, the rest about 4x faster than widened to float64 (a
    difference is exact where the two are within a factor 2 of each other, else one float32 step
    of it). ``diff`` of an EfficientNet against itself compared 13 GB of call outputs a file.
    ``None`` when a difference is not finite (NaN or inf in either, or past float32's range): the
    whole comparison is then made in float64, whatever the blocks."""
    worst_abs = worst_rel = 0.0
    floor = np.float32(REL_FLOOR)
    for block_a, block_e in blocks(actual, expected):
        if np.array_equal(block_a, block_e):
            continue
        a, e = block_a.astype(np.float32, copy=False), block_e.astype(np.float32, copy=False)
        with np.errstate(over="ignore", invalid="ignore"):
            diff = np.abs(a - e)
        largest = float(diff.max())
        if not math.isfinite(largest):  # NaN propagates through max, and inf is its own max
            return None
        scale = np.abs(e)
        with np.errstate(over="ignore", invalid="ignore"):  # float16's largest over float32's smallest: finite
            rel = diff / (scale + floor)
        rel[(diff == 0) | (scale <= rel_above)] = 0.0
        worst_abs, worst_rel = max(worst_abs, largest), max(worst_rel, float(rel.max()))
    return worst_abs, worst_rel


#: Elements compared at a time (:func:`blocks`): widened to float64, a comparison's temporaries take
#: about 48 bytes an element, so a 576 MB float32 output compared whole needed 7 GB.
BLOCK = 1 << 20


def blocks(*arrays: np.ndarray, size: int | None = None):
    """The arrays (of one shape) flattened, ``size`` (:data:`BLOCK`) elements at a time, side by side
    (views when contiguous)."""
    size = size or BLOCK
    flat = [np.asarray(a).reshape(-1) for a in arrays]
    for start in range(0, flat[0].size if flat else 0, size):
        yield tuple(a[start: start + size] for a in flat)


def allclose(actual: np.ndarray, expected: np.ndarray, tolerance: Tolerance) -> bool:
    """``numpy.allclose`` with NaN == NaN, after a shape check; strings compare exactly."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    if actual.shape != expected.shape:
        return False
    if actual.dtype.kind in "OSU":
        return bool(np.all(actual == expected))
    kind = np.complex128 if actual.dtype.kind == "c" else np.float64
    return all(
        np.allclose(a.astype(kind), e.astype(kind), atol=tolerance.atol, rtol=tolerance.rtol, equal_nan=True)
        for a, e in blocks(actual, expected)
    )


@dataclasses.dataclass
class Parity:
    """One compared thing, onnxruntime against a reference: the one row type of every check.

    ``kind`` says what was compared: ``"output"`` (a model output: :func:`check_file`, the
    export's check, ``verify``), ``"call"`` (a module call's outputs:
    :func:`onnx_modular.check.localization.localize`) or ``"block"`` (a block call of the
    block-by-block check, :mod:`onnx_modular.check.blockwise`). Fields that do not apply to a
    kind stay at their defaults (``None`` where a comparison was not made).

    Attributes:
        name: The output name, or the call name (``h.0.attn``, ``shared@1``).
        modular_max_abs, modular_max_rel: The modular model against the reference.
        flat_max_abs, flat_max_rel: The flat (inlined) copy against the reference (outputs).
        modular_vs_flat_max_abs, modular_vs_flat_max_rel: The modular model against its flat copy.
        module_path, call_index, depth: Where the call sits (calls and blocks).
        function: The function a call ran (calls), or the module class (blocks).
        outputs_compared: How many of the call's outputs were matched with PyTorch's.
        weight_bytes: Weight bytes of a block.
        inputs_from_torch: How many of a block's inputs were PyTorch's own (the rest: the ONNX
            model's upstream values).
        chained_max_abs: A block's difference when fed the ONNX model's upstream values (drift
            included); ``modular_max_abs`` is the block's own, on PyTorch's inputs.
        shape_mismatch: When onnxruntime's shape differs from the reference's (``shape``), what
            each side gave (``"onnxruntime [1, 2, 6, 8] vs PyTorch [1, 2, 4, 8]"``); the
            differences of that side are then ``None`` (not comparable), not infinite.
        program_max_abs: The program torch.export captured, run in PyTorch, against the same
            reference (an export's output whose check failed; else ``None``): as far off as
            onnxruntime means the difference was captured, not translated.
    """

    name: str
    shape: tuple[int, ...] = ()
    dtype: str = ""
    tolerance: Tolerance | None = None
    modular_max_abs: float | None = None
    modular_max_rel: float | None = None
    flat_max_abs: float | None = None
    flat_max_rel: float | None = None
    modular_vs_flat_max_abs: float | None = None
    modular_vs_flat_max_rel: float | None = None
    ok: bool = True
    kind: str = "output"
    module_path: str | None = None
    call_index: int = 0
    function: str = ""
    depth: int = 0
    outputs_compared: int = 0
    weight_bytes: int = 0
    inputs_from_torch: int = 0
    chained_max_abs: float | None = None
    shape_mismatch: str | None = None
    program_max_abs: float | None = None

    @property
    def max_abs(self) -> float:
        """The modular model's largest absolute difference from the reference (0 when not compared)."""
        return self.modular_max_abs or 0.0

    @property
    def max_rel(self) -> float:
        return self.modular_max_rel or 0.0

    @property
    def call_name(self) -> str:
        return self.name

    @property
    def module_class(self) -> str:
        return self.function

    @property
    def atol(self) -> float | None:
        return self.tolerance.atol if self.tolerance is not None else None

    def to_dict(self) -> dict[str, Any]:
        row = dataclasses.asdict(self)
        row["tolerance"] = dataclasses.asdict(self.tolerance) if self.tolerance is not None else None
        row["max_abs"], row["max_rel"] = self.max_abs, self.max_rel
        return row


#: The row of a model output (the name the public API has always had).
OutputParity = Parity


@dataclasses.dataclass
class ParityReport:
    """Per-output differences of one run: onnxruntime (modular, flat) against a reference.

    Attributes:
        outputs: One row per model output.
        reference: What the outputs were compared with: ``"PyTorch"``, ``"expected"`` or
            ``None`` (only modular vs flat).
        shapes: Input name -> shape of the run.
        modules: Per-module localization of the run, when it was asked for.
        note: How the check was made when it is not the plain run of the file (a bfloat16
            file is checked on its float32-widened copy), else ``None``.
    """

    outputs: list[OutputParity]
    reference: str | None = "PyTorch"
    shapes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    modules: Any = None  # onnx_modular.check.localization.LocalizationReport
    note: str | None = None
    padding: str | None = None  # the outputs differ only where an attention mask pads (check/padding.py)
    ties: str | None = None  # the outputs differ because torch.topk picks among equal values (check/ties.py)

    @property
    def ok(self) -> bool:
        return all(output.ok for output in self.outputs) and (self.modules is None or self.modules.ok)

    @property
    def max_abs(self) -> float:
        """Largest difference of the modular model (against the reference, else against the flat copy)."""
        values = [o.modular_max_abs if self.reference else o.modular_vs_flat_max_abs for o in self.outputs]
        return max((v for v in values if v is not None), default=0.0)

    @property
    def modular_vs_flat_max_abs(self) -> float:
        return max((o.modular_vs_flat_max_abs or 0.0 for o in self.outputs), default=0.0)

    def failures(self) -> list[OutputParity]:
        return [output for output in self.outputs if not output.ok]

    @property
    def captured_differently(self) -> bool:
        """Whether every failing output is off already in the program torch.export captured:
        ``program_max_abs`` beyond the output's ``atol`` and at least half onnxruntime's
        difference. The files compute what was captured; the capture is not what eager
        PyTorch computes."""
        failures = self.failures()
        return bool(failures) and all(
            o.program_max_abs is not None
            and o.program_max_abs > (o.tolerance.atol if o.tolerance else 0.0)
            and o.program_max_abs >= 0.5 * (o.modular_max_abs or 0.0)
            for o in failures
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "reference": self.reference,
            "shapes": self.shapes,
            "outputs": [output.to_dict() for output in self.outputs],
            "modules": self.modules.to_dict() if self.modules is not None else None,
            "note": self.note,
            "padding": self.padding,
            "ties": self.ties,
            "captured_differently": self.captured_differently,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        def fmt(value: float | None) -> str:
            return "-" if value is None else f"{value:.2e}"

        width = name_column_width(o.name for o in self.outputs)
        against = self.reference or "-"
        header = (
            f"{'output':<{width}} {'shape':<18} {'dtype':<9} {'modular abs':>11} {'rel':>9} {'flat abs':>9} {'rel':>9} "
            f"{'mod-flat':>9} {'atol/rtol':>15}  ok"
        )
        title = (
            f"Parity against {against} (onnxruntime, max abs / max rel difference)"
            if self.reference
            else "onnxruntime: modular vs its inlined flat copy (max abs difference in mod-flat)"
        )
        lines = [title] + ([self.note] if self.note else []) + [header, "-" * len(header)]
        for o in self.outputs:
            tolerance = f"{o.tolerance.atol:.0e}/{o.tolerance.rtol:.0e}"
            if o.shape_mismatch:
                lines.append(
                    f"{fit_name(o.name, width):<{width}} {str(list(o.shape))[:18]:<18} {o.dtype:<9} "
                    f"shape mismatch: {o.shape_mismatch}  {'yes' if o.ok else 'NO'}"
                )
                continue
            lines.append(
                f"{fit_name(o.name, width):<{width}} {str(list(o.shape))[:18]:<18} {o.dtype:<9} {fmt(o.modular_max_abs):>11} "
                f"{fmt(o.modular_max_rel):>9} {fmt(o.flat_max_abs):>9} {fmt(o.flat_max_rel):>9} "
                f"{fmt(o.modular_vs_flat_max_abs):>9} {tolerance:>15}  {'yes' if o.ok else 'NO'}"
            )
        failures = len(self.failures())
        lines.append("PASS" if not failures else f"FAIL: {failures} output(s) beyond tolerance")
        captured = [o for o in self.outputs if o.program_max_abs is not None]
        if captured:
            lines.append(
                f"torch.export's program, run in PyTorch, against {against}: "
                + ", ".join(f"{o.name} {fmt(o.program_max_abs)}" for o in captured[:4])
                + (" (the difference is in the capture, not the translation)" if self.captured_differently else "")
            )
        if self.modules is not None:
            lines.append(str(self.modules))
        return "\n".join(lines)


def name_column_width(names: Iterable[str], minimum: int = 24, maximum: int = 56) -> int:
    """Width of a report's name column: the longest name, within bounds."""
    return max(minimum, min(maximum, max((len(name) for name in names), default=0)))


def fit_name(name: str, width: int) -> str:
    """``name`` shortened in the middle to ``width`` (both ends of a dotted path tell)."""
    if len(name) <= width:
        return name
    head = (width - 1) // 2
    return f"{name[:head]}…{name[len(name) - (width - 1 - head):]}"


def compare_outputs(
    names: Sequence[str],
    modular: Sequence[np.ndarray],
    flat: Sequence[np.ndarray] | None,
    reference: Sequence[np.ndarray | None] | None,
    *,
    reference_name: str | None = "PyTorch",
    tolerance: Tolerance | None = None,
    shapes: Mapping[str, list[int]] | None = None,
) -> ParityReport:
    """One :class:`ParityReport` from the onnxruntime outputs and an optional reference.

    An output passes when the modular model (and the flat copy, if run) is within tolerance
    of the reference, or, without a reference, when modular and flat agree within tolerance.
    """
    rows = []
    for index, name in enumerate(names):
        value = np.asarray(modular[index])
        expected = None if reference is None else reference[index]
        dtype = str(np.asarray(expected).dtype if expected is not None else value.dtype)
        tol = tolerance or default_tolerance(dtype)
        row = OutputParity(name=name, shape=tuple(value.shape), dtype=dtype, tolerance=tol)
        flat_value = None if flat is None else np.asarray(flat[index])
        mismatches = []
        if expected is not None:
            row.shape = tuple(np.shape(expected))
            for what, actual in (("onnxruntime", value), ("flat copy", flat_value)):
                if actual is not None and actual.shape != row.shape:
                    mismatches.append(f"{what} {list(actual.shape)}")
            if value.shape == row.shape:
                row.modular_max_abs, row.modular_max_rel = max_differences(value, expected, rel_above=tol.atol)
            row.ok = allclose(value, expected, tol)
        if flat_value is not None:
            if flat_value.shape == value.shape:
                row.modular_vs_flat_max_abs, row.modular_vs_flat_max_rel = max_differences(value, flat_value)
            elif expected is None:
                mismatches.append(f"onnxruntime {list(value.shape)} vs flat copy {list(flat_value.shape)}")
            if expected is not None:
                if flat_value.shape == row.shape:
                    row.flat_max_abs, row.flat_max_rel = max_differences(flat_value, expected, rel_above=tol.atol)
                row.ok = row.ok and allclose(flat_value, expected, tol)
            else:
                row.ok = allclose(value, flat_value, tol)
        if mismatches:
            against = f" vs {reference_name} {list(row.shape)}" if expected is not None else ""
            row.shape_mismatch = ", ".join(mismatches) + against
        rows.append(row)
    return ParityReport(rows, reference=reference_name if reference is not None else None, shapes=dict(shapes or {}))


def check_file(
    path: str | os.PathLike,
    feeds: Mapping[str, np.ndarray] | Sequence[np.ndarray],
    *,
    expected: Mapping[str, np.ndarray] | Sequence[np.ndarray] | None = None,
    reference_name: str = "expected",
    flat: bool = True,
    tolerance: Tolerance | None = None,
    execution_provider: str | None = None,
) -> ParityReport:
    """Run ``path`` (and its inlined flat copy) in onnxruntime on ``feeds``; compare with ``expected``.

    Args:
        path: The model file.
        feeds: Input name -> array, or one array per input in order.
        expected: Reference outputs by name (a subset is fine) or in order; ``None`` compares
            modular with flat only.
        reference_name: How the report names the reference (``"PyTorch"``, ``"expected"``).
        flat: Also run the flat copy.
        tolerance: Overrides the per-dtype default.

    Returns:
        A :class:`ParityReport`; it does not raise on a mismatch.

    Raises:
        VerificationError: onnxruntime cannot load or run a model.
        InvalidInputError: ``expected`` names an output the model does not have.
        ParityError: ``expected`` (a sequence) has another number of outputs than the model.
    """
    model = load_model_file(path)
    check_expanded_size(model, name=repr(str(path)))  # onnxruntime inlines every call at load
    names, modular = runtime.run(path, feeds, execution_provider=execution_provider)
    flat_outputs = None
    if flat:
        _, flat_outputs = runtime.run(
            runtime.flat_copy(path, model),
            feeds,
            what="inlined flat copy",
            execution_provider=execution_provider,
            external_data_folder=runtime.external_data_folder(path, model),
        )
    reference = None
    if expected is not None:
        if isinstance(expected, Mapping):
            unknown = sorted(set(expected) - set(names))
            if unknown:
                raise InvalidInputError(
                    f"Expected outputs name {unknown[0]!r}, which is not an output of the model {names}."
                )
            # Outputs without an expected value are compared modular vs flat only.
            reference = [np.asarray(expected[name]) if name in expected else None for name in names]
        else:
            reference = list(expected)
            if len(reference) != len(modular):
                raise ParityError(
                    f"The ONNX model has {len(modular)} outputs but the reference has {len(reference)} tensors.",
                    hint="Outputs that are not tensors (None, ints) are not ONNX outputs; return tensors only.",
                )
    if isinstance(feeds, Mapping):
        shapes = {name: list(np.shape(value)) for name, value in feeds.items()}
    else:
        shapes = {value.name: list(np.shape(array)) for value, array in zip(model_inputs(model), feeds)}
    return compare_outputs(
        names, modular, flat_outputs, reference, reference_name=reference_name, tolerance=tolerance, shapes=shapes
    )

