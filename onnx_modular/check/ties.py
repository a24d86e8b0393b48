"""Why an export's check fails on a model that selects among equal values: ``topk`` on ties.

``torch.topk`` over values of which several are exactly equal (untrained weights whose scores
collapse to one value: a detection head picking its queries, a router picking its experts)
returns the tied elements in an order its CPU kernel leaves unspecified; ONNX's ``TopK`` (and
onnxruntime) takes the lowest index first. Both are right, they pick different elements, and
everything computed from the pick differs: by whole units, not by rounding. torch's own flat
export differs as much, and torch.export's program run in PyTorch does not (it calls the same
kernel as eager PyTorch).

:func:`explain` runs the captured program again with the ties broken the ONNX way (``topk``
replaced by a stable sort: lowest index first) and, when PyTorch's outputs then equal the
file's, says so, so the :class:`~onnx_modular.errors.ParityError` names the cause instead of a
difference (docs/verification.md, "Selections among ties"). :class:`TieWatch` is the
dispatch mode that finds (and optionally breaks) the ties; the catalogue sweep uses it to
re-draw such a model's weights.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from onnx_modular.capture.tensors import to_numpy, torch_outputs
from onnx_modular.check.parity import ParityReport, allclose, max_differences
from onnx_modular.runtime import sessions as runtime

__all__ = ["Tie", "TieWatch", "explain", "HINT"]

HINT = (
    "The file is right: PyTorch's reference picks among equal scores in an arbitrary order. Check it on weights or "
    "inputs whose scores differ (a trained checkpoint rarely ties; random weights often do, when the features "
    "vanish and every score is the bias), or compare with ties broken lowest index first (onnx_modular.check.ties."
    "TieWatch(break_ties=True) around the PyTorch call)."
)


@dataclasses.dataclass
class Tie:
    """One ``topk`` call whose result depends on how ties are broken."""

    k: int
    size: int  # the length of the axis selected along
    tied: int  # elements among the first k + 1 (in sorted order) equal to a neighbour

    def __str__(self) -> str:
        return f"top {self.k} of {self.size} with {self.tied} tied"


def _sorted(x: torch.Tensor, dim: int, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Values and indices along ``dim``, ties in index order (ONNX's ``TopK`` order)."""
    result = torch.sort(x, dim=dim, descending=largest, stable=True)
    return result.values, result.indices


def _tie(x: torch.Tensor, k: int, dim: int, largest: bool) -> Tie | None:
    """The tie of one ``topk`` call: equal values among the first ``k + 1`` sorted (which elements
    are kept, and their order, depends on the tie-break); ``None`` when there is none."""
    if x.dim() == 0 or k == 0 or x.dtype == torch.bool:
        return None
    size = x.shape[dim]
    values = _sorted(x, dim, largest)[0].narrow(dim, 0, min(k + 1, size))
    if values.shape[dim] < 2:
        return None
    equal = values.narrow(dim, 1, values.shape[dim] - 1) == values.narrow(dim, 0, values.shape[dim] - 1)
    tied = int(equal.sum())
    return Tie(k, size, tied) if tied else None


class TieWatch(TorchDispatchMode):
    """Records every ``aten.topk`` whose input ties (:attr:`ties`); with ``break_ties``, returns
    those calls' results with ties broken lowest index first, as ONNX's ``TopK`` does.

    >>> with TieWatch() as watch:
    ...     model(**inputs)
    >>> watch.ties  # [] when no selection depends on a tie-break
    """

    def __init__(self, break_ties: bool = False):
        super().__init__()
        self.break_ties = break_ties
        self.ties: list[Tie] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.topk.default:
            x, k = args[0], int(args[1])
            dim = int(args[2] if len(args) > 2 else kwargs.get("dim", -1))
            largest = bool(args[3] if len(args) > 3 else kwargs.get("largest", True))
            tie = _tie(x, k, dim, largest)
            if tie is not None:
                self.ties.append(tie)
                if self.break_ties:
                    values, indices = _sorted(x, dim, largest)
                    return values.narrow(dim, 0, k).contiguous(), indices.narrow(dim, 0, k).contiguous()
        return func(*args, **kwargs)


def _program(result: Any):
    """The program torch.export captured (as :func:`~onnx_modular.check.verification.add_program_differences`
    runs it), or ``None`` when it cannot be run again without side effects."""
    program = getattr(result, "_captured", None) or getattr(result, "exported_program", None)
    if program is None or getattr(result, "_example", None) is None or program.graph_signature.buffers_to_mutate:
        return None
    return program


def explain(
    result: Any, path: str | os.PathLike, inputs: Sequence[Any], report: ParityReport, execution_provider: str | None = None
) -> str | None:
    """A sentence for the parity error when the captured program selects among ties and, run
    with the ties broken lowest index first, equals the file within every output's tolerance;
    else ``None``. Only on failure: one more forward pass, then (only when a tie is found) one
    more run of the file."""
    failures = report.failures()
    program = _program(result)
    if report.ok or program is None or not failures or any(o.shape_mismatch for o in failures):
        return None
    try:
        with TieWatch(break_ties=True) as watch:
            broken = torch_outputs(program.module(), *result._example)
    except Exception:  # not runnable eagerly (weights on meta): no explanation
        return None
    if not watch.ties or len(broken) != len(report.outputs):
        return None
    names, values = runtime.run(path, [np.asarray(v) for v in inputs], what="model", execution_provider=execution_provider)
    actual = dict(zip(names, values))
    worst = 0.0
    for row, reference in zip(report.outputs, broken):
        got = actual.get(row.name)
        if got is None or got.shape != tuple(reference.shape):
            return None
        reference = to_numpy(reference)
        if not allclose(got, reference, row.tolerance):
            return None
        worst = max(worst, max_differences(got, reference)[0])
    calls = "; ".join(str(tie) for tie in watch.ties[:3]) + ("; ..." if len(watch.ties) > 3 else "")
    return (
        f"torch.topk selects among exactly equal values ({len(watch.ties)} call(s): {calls}). torch's kernel leaves "
        "the order of tied elements unspecified, ONNX's TopK takes the lowest index first: with the ties broken that "
        f"way, PyTorch's outputs equal the file's (max abs {worst:.1e}, within tolerance)."
    )
