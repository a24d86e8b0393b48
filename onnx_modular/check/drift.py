"""Drift: how far one file's values are from another's, the one definition every file tool uses.

``convert`` (each call and output of the converted file against the original), ``diff`` (each
matched call of B against A) and ``optimize`` (each rewritten call against the input file's) all
measure a value pair with :func:`measure` and judge it with :meth:`Drift.within`, so the same call
gets the same number from each tool:

- ``max_abs``: the largest absolute difference (:func:`~onnx_modular.check.parity.max_differences`:
  NaN/inf at the same places count as equal, a shape mismatch as inf);
- ``max_rel``: the largest relative difference over the expected values above the dtype's default
  ``atol`` (near 0 the absolute difference judges);
- ``scaled``: ``max_abs`` over the range (max - min) of the expected value's finite entries, so that
  ``0.01`` is 1% of what the value spans: a LayerNorm's output and a logit compare on one scale,
  and a value that is an offset plus a small signal is judged by the signal. A value with no range
  (a scalar, a constant fill) is scaled by its magnitude instead; 0 against 0 is 0, any other
  difference from an all-zero value is infinite;
- ``overflow``: some entry is inf or NaN where the expected one is finite (float16 overflowed).

No torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np

from onnx_modular.check.parity import Tolerance, allclose, blocks, default_tolerance, max_differences

__all__ = ["Drift", "NO_DRIFT", "measure", "measure_all", "spread", "overflows"]


@dataclasses.dataclass(frozen=True)
class Drift:
    """One value (or the worst of several) against its expected value; see the module docstring."""

    max_abs: float
    max_rel: float
    scaled: float
    overflow: bool = False
    #: ``allclose`` under the tolerance the measure was taken with (``None``: no tolerance given).
    close: bool | None = None

    def within(self) -> bool:
        """The verdict under the measure's tolerance: every pair ``allclose`` (``atol + rtol * |expected|``,
        NaN equal to NaN). A measure taken without a tolerance has no verdict (``ValueError``)."""
        if self.close is None:
            raise ValueError("this drift was measured without a tolerance: pass one to measure()")
        return self.close

    def worst(self, other: Drift) -> Drift:
        """The larger of each field (the verdict: both within)."""
        close = None if self.close is None or other.close is None else self.close and other.close
        return Drift(max(self.max_abs, other.max_abs), max(self.max_rel, other.max_rel),
                     max(self.scaled, other.scaled), self.overflow or other.overflow, close)


#: What an empty comparison measures.
NO_DRIFT = Drift(0.0, 0.0, 0.0, False, True)
_INFINITE = Drift(math.inf, math.inf, math.inf, False, False)


def measure(actual: np.ndarray, expected: np.ndarray, tolerance: Tolerance | None = None) -> Drift:
    """``actual`` against ``expected``; floating values are compared in float32 (float64 when
    ``expected`` is float64), whatever their width in either file (float16, bfloat16)."""
    expected, actual = np.asarray(expected), np.asarray(actual)
    rel_above = default_tolerance(expected.dtype).atol if expected.dtype.kind in "fcV" else 0.0
    if expected.dtype.kind in "fV":
        wide = np.float64 if expected.dtype == np.float64 else np.float32
        expected = expected.astype(wide, copy=False)
        actual = actual.astype(wide, copy=False) if actual.dtype.kind in "fiuV" else actual
    elif actual.dtype != expected.dtype and actual.dtype.kind in "fV":
        actual = actual.astype(np.float32, copy=False)
    max_abs, max_rel = max_differences(actual, expected, rel_above=rel_above)
    scale = _scale(expected)
    scaled = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    close = allclose(actual, expected, tolerance) if tolerance is not None else None
    return Drift(max_abs, max_rel, scaled, overflows(actual, expected), close)


def measure_all(actual: Iterable[np.ndarray], expected: Iterable[np.ndarray], tolerance: Tolerance | None = None) -> Drift:
    """The worst :func:`measure` over pairs of values (a call's outputs); a count mismatch is infinite."""
    actual, expected = list(actual), list(expected)
    if len(actual) != len(expected):
        return _INFINITE
    result = NO_DRIFT if tolerance is not None else dataclasses.replace(NO_DRIFT, close=None)
    for a, e in zip(actual, expected):
        result = result.worst(measure(a, e, tolerance))
    return result


def _scale(expected: np.ndarray) -> float:
    """The value's range, or its largest finite magnitude when it has none."""
    if expected.dtype.kind not in "fiu" or expected.size == 0:
        return 0.0
    width = spread(expected)
    if width > 0:
        return width
    finite = expected[np.isfinite(expected)] if expected.dtype.kind == "f" else expected
    return float(np.max(np.abs(finite.astype(np.float64)))) if finite.size else 0.0


def spread(values: np.ndarray) -> float:
    """max - min of the finite values (0 when none), a block at a time."""
    low, high = math.inf, -math.inf
    for (block,) in blocks(values):
        if block.size and values.dtype.kind == "f" and not (math.isfinite(block.min()) and math.isfinite(block.max())):
            block = block[np.isfinite(block)]  # NaN or inf in it (a min and a max first: no copy for the rest)
        if block.size:
            low, high = min(low, float(block.min())), max(high, float(block.max()))
    return high - low if high >= low else 0.0


def overflows(actual: np.ndarray, expected: np.ndarray) -> bool:
    """Some value is inf or NaN in ``actual`` where ``expected`` holds a finite one."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape or actual.dtype.kind != "f" or expected.dtype.kind != "f":
        return False
    return any(not np.isfinite(a).all() and bool(np.any(~np.isfinite(a) & np.isfinite(e))) for a, e in blocks(actual, expected))
