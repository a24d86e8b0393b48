"""The one drift definition (onnx_modular.check.drift) that convert, diff, optimize, extract and
split measure with: the numbers it gives on hand-made values, and the tools that read it."""

from __future__ import annotations

import ast
import math
import pathlib

import ml_dtypes
import numpy as np
import pytest

from onnx_modular.check.drift import NO_DRIFT, measure, measure_all
from onnx_modular.check.parity import Tolerance

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "onnx_modular"


def test_scaled_drift_is_the_difference_over_the_expected_range():
    expected = np.array([-1.0, 0.0, 3.0], np.float32)  # range 4
    measured = measure(expected + np.array([0.0, 0.2, 0.0], np.float32), expected)
    assert measured.max_abs == pytest.approx(0.2) and measured.scaled == pytest.approx(0.05)
    assert not measured.overflow


def test_an_offset_is_judged_by_its_signal_and_a_value_without_range_by_its_magnitude():
    offset = np.array([1000.0, 1001.0], np.float32)
    assert measure(offset + np.float32(0.5), offset).scaled == pytest.approx(0.5)  # half the span, not 5e-4
    scalar = np.array(4.0, np.float32)
    assert measure(np.array(4.2, np.float32), scalar).scaled == pytest.approx(0.05, rel=1e-5)
    zeros = np.zeros(3, np.float32)
    assert measure(zeros, zeros).scaled == 0.0 and measure(zeros + 1e-3, zeros).scaled == math.inf


def test_float16_and_bfloat16_values_are_compared_in_float32():
    expected = np.linspace(-2, 2, 9, dtype=np.float32) + np.float32(1 / 3)  # not exact in either
    for low in (np.float16, ml_dtypes.bfloat16):
        measured = measure(expected.astype(low), expected)
        assert 0 < measured.max_abs < 2e-2 and measured.scaled == pytest.approx(measured.max_abs / 4, rel=1e-5)


def test_overflow_nan_and_shape_mismatch():
    expected = np.array([1.0, 2.0], np.float32)
    assert measure(np.array([1.0, np.inf], np.float32), expected).overflow
    both_nan = np.array([np.nan, 2.0], np.float32)
    assert measure(both_nan, both_nan, Tolerance(1e-4, 1e-3)).within()  # NaN where expected is NaN: equal
    assert measure(np.zeros(3, np.float32), expected).max_abs == math.inf


def test_the_verdict_needs_a_tolerance_and_is_allclose():
    expected = np.array([1.0, 100.0], np.float32)
    tight, loose = Tolerance(atol=1e-6, rtol=1e-6), Tolerance(atol=1e-4, rtol=1e-2)
    got = expected + np.array([0.0, 0.5], np.float32)
    assert not measure(got, expected, tight).within() and measure(got, expected, loose).within()
    with pytest.raises(ValueError, match="without a tolerance"):
        measure(got, expected).within()


def test_several_outputs_give_the_worst_and_a_count_mismatch_is_infinite():
    a, b = np.array([0.0, 1.0], np.float32), np.array([0.0, 10.0], np.float32)
    worst = measure_all([a + 0.1, b + 0.1], [a, b], Tolerance(1e-4, 1e-3))
    assert worst.scaled == pytest.approx(0.1, rel=1e-5) and worst.max_abs == pytest.approx(0.1, rel=1e-5)
    assert not worst.within()
    assert measure_all([a], [a, b]).max_abs == math.inf
    assert measure_all([], [], Tolerance(1e-4, 1e-3)) == NO_DRIFT


def test_no_file_tool_judges_with_numpy_allclose_or_its_own_differences():
    """Drift is defined once, in check/: the file tools call it (no ``np.allclose``, no
    ``max_differences`` of their own)."""
    offenders = []
    for path in (PACKAGE / "files").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("allclose", "isclose"):
                offenders.append(f"{path.relative_to(PACKAGE)}: {node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module == "onnx_modular.check.parity":
                names = {alias.name for alias in node.names}
                offenders += [f"{path.relative_to(PACKAGE)}: imports {n}" for n in names & {"allclose", "max_differences"}]
    assert offenders == []
