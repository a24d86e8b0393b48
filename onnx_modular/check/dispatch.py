"""The one entry of an export's parity check: :func:`verify_export`.

``export_modular`` (inside its staged save), ``ModularExport.verify`` / ``.save`` and the
transformers backend (``hf/exporter.py``, ``hf/command.py``) all call it; it picks the check:

* block by block (:mod:`~onnx_modular.check.blockwise`) when the weights are streamed onto a
  model on ``meta`` (``blocks=``);
* the float32-widened check (:func:`~onnx_modular.check.verification.verify_bfloat16`) for a
  bfloat16 file, which onnxruntime's CPU provider cannot run;
* the plain run of the file and its inlined copy (:func:`~onnx_modular.check.verification.verify_file`);

then the flat deployment copy (``flat_copy=``, ``export_modular(flat_file=...)``), checked the
same way as the modular file. The reference is the one stored with the export (PyTorch's outputs
on the example inputs) or, for new inputs, the model's outputs on them. torch is imported only
through the PyTorch half of :mod:`onnx_modular.check`.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator
from typing import Any

from onnx_modular.check.parity import ParityReport, Tolerance
from onnx_modular.errors import InvalidInputError

__all__ = ["verify_export", "assert_verified"]


def verify_export(
    result: Any,
    path: str | os.PathLike | None = None,
    *,
    args: Any = None,
    kwargs: Any = None,
    model: Any = None,
    flat: bool = True,
    flat_copy: str | os.PathLike | None = None,
    modular: bool = True,
    tolerance: Tolerance | None = None,
    execution_provider: str | None = None,
    blocks: Any = None,
    record: bool = True,
    check: bool = True,
) -> ParityReport | None:
    """Check an export's file(s) in onnxruntime against PyTorch.

    Args:
        result: The :class:`~onnx_modular.ModularExport` (its model, stored reference outputs and
            file); it receives the reports when ``record``.
        path: The file to run; default: ``result.path`` when saved, else the model written to a
            private temporary folder for the check.
        args, kwargs, model: New inputs and the PyTorch model that computes their reference
            (normalized as ``export_modular`` does); default: the export's example inputs and
            the PyTorch outputs stored with it.
        flat: Also run the file's inlined copy (the ``flat abs`` column).
        flat_copy: The flat deployment copy (``flat_file=``) to check as well (``result.flat_report``).
        modular: Check ``path`` itself (``False``: only ``flat_copy``, as ``result.save`` does).
        tolerance: The user's tolerance; ``None`` for the per-dtype defaults.
        execution_provider: onnxruntime's provider (CPU by default).
        blocks: The streamed blocks (``weights.streaming.Stream.blocks``): check block by block.
        record: Store the reports on ``result`` (``report``, ``flat_report``, ``blocks``).
        check: Raise :class:`~onnx_modular.errors.ParityError` beyond tolerance.

    Returns:
        The modular file's report (``None`` when ``modular`` is false).
    """
    from onnx_modular.check import blockwise, padding, verification

    inputs, expected, widened = _reference(result, args, kwargs, model)
    report = flat_report = block_report = None
    if modular:
        with _file(result, path) as file:
            if blocks is not None:
                block_report = blockwise.verify_blocks(
                    file, inputs, expected, blocks, tolerance=tolerance, execution_provider=execution_provider
                )
                report = block_report.outputs
                if record:
                    result.blocks = block_report
            else:
                report = _run(file, inputs, expected, widened, flat=flat, tolerance=tolerance, provider=execution_provider)
                if args is None and kwargs is None and not widened:  # on failure: was it captured so?
                    verification.add_program_differences(report, result, expected)
                if not report.ok and not widened:  # on failure: only where an attention mask pads?
                    report.padding = padding.explain(file, inputs, expected, report)
                if not report.ok and not widened and args is None and kwargs is None and not report.padding:
                    from onnx_modular.check import ties  # on failure: a selection among equal values?

                    report.ties = ties.explain(result, file, inputs, report, execution_provider)
    if flat_copy is not None:
        flat_report = _run(flat_copy, inputs, expected, widened, flat=False, tolerance=tolerance, provider=execution_provider)
    if record:
        if report is not None:
            result.report = report
        if flat_report is not None:
            result.flat_report = flat_report
    if check:
        assert_verified(result, [block_report, report, flat_report])
    return report


def assert_verified(result: Any, reports: Any = None) -> None:
    """Raise :class:`~onnx_modular.errors.ParityError` for the first report beyond tolerance:
    the block-by-block report, the modular file's, the flat copy's (by default those recorded
    on ``result``)."""
    from onnx_modular.check import blockwise, verification

    if reports is None:
        reports = [result.blocks, result.report, result.flat_report]
    for report in reports:
        if report is None:
            continue
        if isinstance(report, blockwise.BlockReport):
            blockwise.assert_blocks(report, result=result)
        else:
            verification.assert_parity(report, result=result)


def _run(file, inputs, expected, widened: bool, *, flat: bool, tolerance, provider) -> ParityReport:
    from onnx_modular.check import verification

    check = verification.verify_bfloat16 if widened else verification.verify_file
    return check(file, inputs, expected, flat=flat, tolerance=tolerance, execution_provider=provider)


def _reference(result: Any, args: Any, kwargs: Any, model: Any) -> tuple[list, list, bool]:
    """``(inputs, PyTorch outputs, widened)``: the stored reference, or the model's on new inputs.

    A bfloat16 model is checked on its float32-widened copy, against PyTorch in float32 on the
    same bfloat16 weights (``widened``); the export stores that reference unless its weights
    are streamed (then checked block by block, or by the plain run with ``verify="full"``).
    """
    from onnx_modular.capture import tensors
    from onnx_modular.check import verification

    if args is None and kwargs is None:
        widened = result._reference_float32 is not None  # stored for bfloat16 exports held in memory
        stored = result._reference_float32 if widened else result._reference
        if stored is None:
            raise InvalidInputError(
                "No reference outputs are stored with this export.", hint="Pass args and model=... to compute them."
            )
        return (*stored, widened)
    widened = verification.uses_bfloat16(result.model)
    if model is None:
        raise InvalidInputError("Pass model=... to compute PyTorch outputs for new inputs.")
    fixed = getattr(result, "_fixed", None) or {}  # fixed into the file: PyTorch takes them, the file does not
    args, kwargs = tensors.normalize_inputs(args, {**fixed, **(kwargs or {})}, model)
    if widened:
        return (*verification.float32_reference(model, args, kwargs, fixed), True)
    feed, run = tensors.with_fixed(kwargs, fixed)
    return tensors.flatten_inputs(args, feed), tensors.torch_outputs(model, args, run), False


@contextlib.contextmanager
def _file(result: Any, path: str | os.PathLike | None) -> Iterator[pathlib.Path]:
    """``path``, the export's saved file, or its model in a private temporary folder."""
    from onnx_modular.storage.scratch import scratch_model_file

    if path is not None:
        yield pathlib.Path(path)
    elif result.path is not None and pathlib.Path(result.path).exists():
        yield pathlib.Path(result.path)
    else:
        with scratch_model_file(result.model) as file:
            yield file
