"""Why an export's check fails on a padded batch: the outputs differ only where the attention
mask pads.

A left-padded sample (``attention_mask`` ``[[0, 0, 1, 1], [1, 1, 1, 1]]``) gives a causal model
attention rows in which every key is masked (the padded query positions see only padded keys).
Eager PyTorch returns 0 (or NaN) there, onnxruntime's softmax averages over the masked keys:
the values at padded positions mean nothing either way, and torch's own flat export differs
there as much. :func:`explain` finds that case so the :class:`~onnx_modular.errors.ParityError`
says it and how to export such a model (docs/verification.md, "Padded batches").
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from onnx_modular.check.parity import ParityReport, allclose, max_differences
from onnx_modular.runtime import sessions as runtime
from onnx_modular.storage.load import load_model_file

__all__ = ["explain", "HINT"]

HINT = (
    "Export with a sample whose mask pads nothing (attention_mask=torch.ones_like(attention_mask)): the file takes "
    "any mask at run time and computes the padded batch as torch's flat export does, equal to PyTorch at every "
    "position the mask keeps (the values at padded positions are meaningless in both). Or keep this sample with "
    "verify=False and check the kept positions yourself."
)


def _masks(names: Sequence[str], inputs: Sequence[Any]) -> list[tuple[str, np.ndarray]]:
    """The 2-D integer or boolean inputs named like a mask that hold zeros (padding)."""
    found = []
    for name, value in zip(names, inputs):
        array = np.asarray(value)
        if "mask" in name.lower() and array.ndim == 2 and array.dtype.kind in "biu" and (array == 0).any():
            found.append((name, array != 0))
    return found


def explain(path: str | os.PathLike, inputs: Sequence[Any], expected: Sequence[Any], report: ParityReport) -> str | None:
    """A sentence for the parity error when every failing output is within tolerance at the
    positions an attention mask keeps (its first two axes are the mask's); else ``None``.
    Runs the file once more (only on failure, only with a padding mask among the inputs)."""
    failures = report.failures()
    if report.ok or not failures or any(o.shape_mismatch for o in failures):
        return None
    model = load_model_file(path)
    names = [value.name for value in model.graph.input]
    masks = _masks(names, [np.asarray(v) for v in inputs])
    if not masks:
        return None
    outputs, values = runtime.run(path, [np.asarray(v) for v in inputs], what="model")
    by_name = dict(zip(outputs, zip(values, expected)))
    for mask_name, keep in masks:
        parts = []
        for row in failures:
            actual, reference = by_name.get(row.name, (None, None))
            if actual is None or reference is None or actual.shape[:2] != keep.shape:
                break
            reference = np.asarray(reference)
            if not allclose(actual[keep], reference[keep], row.tolerance):
                break
            kept_abs = max_differences(actual[keep], reference[keep])[0]
            padded_abs = max_differences(actual[~keep], reference[~keep])[0]
            parts.append(f"{row.name}: max abs {kept_abs:.1e} where {mask_name} keeps, {padded_abs:.1e} at its padded positions")
        else:
            rows = int((~keep).any(axis=1).sum())
            return (
                f"The outputs differ only at the {int((~keep).sum())} positions {mask_name} pads (in {rows} of "
                f"{keep.shape[0]} sequences) "
                f"({'; '.join(parts)}). There the attention has every key masked (a left-padded causal batch): eager "
                "PyTorch gives 0 (or NaN), onnxruntime's softmax averages the masked keys."
            )
    return None
