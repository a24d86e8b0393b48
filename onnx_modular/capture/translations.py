"""Translations of torch ops that torch's ONNX translator (torchlib) lacks, registered only where
torch has none (:func:`onnx_modular.capture.torch_compat.registry`), so every op torch translates is
translated as torch does.

* Complex values travel through torch's translator as real tensors with a trailing axis of 2
  (real, imaginary). torchlib has complex variants of most shape ops (``view``, ``permute``,
  ``slice``, ``squeeze.dim``) but not of ``unsqueeze``, ``expand`` and ``reshape``, which
  Llama-4-style rotary embeddings apply to complex frequencies ("No decompositions registered
  for the complex-valued input"; ``reshape`` is what ``relax_view_strides`` makes of a
  ``view``). The variants here move a negative axis past the trailing pair and keep it, as
  torchlib's own complex variants do.
* ``aten._is_all_true`` is what ``torch._check(tensor.all())``-style runtime checks capture to
  (transformers' image-token count check in LLaVA-style models): a bool scalar, all elements
  true. Its value feeds an assertion that the translator drops, but the op itself needs a
  translation.
* ``aten.cummax`` / ``aten.cummin`` (Grounding DINO's text-block masks): ONNX has ``CumSum`` only.
  Position ``i`` reduces the positions ``j <= i`` of an ``n x n`` lower-triangular mask (``n`` the
  scanned axis, a sequence: quadratic in it, as attention is); ties give the last index, as torch.
* ``aten.histc`` with ``min == max`` (the default: the data's extremes; MoE routers counting
  tokens per expert, HunYuan's), which torchlib's ``aten_histc`` refuses: each element's bin is
  compared with every bin (``numel x bins``), ``max`` falls in the last bin, equal extremes widen
  by one each way, as torch. Other calls go to torchlib's (:func:`refinements`).
* ``aten.erfinv`` / ``prims.erf_inv`` (Gemma 3n's activation sparsity): Giles' single-precision
  polynomials ("Approximating the erfinv function", GPU Computing Gems, 2011), then one Newton
  step on ONNX ``Erf``; computed in float32 (double inputs lose precision), ``erfinv(+-1) = +-inf``.
"""

from __future__ import annotations

from collections.abc import Sequence

from onnxscript.function_libs.torch_lib.ops import common as common_ops
from onnxscript.onnx_opset import opset18 as op

__all__ = ["complex_expand", "complex_reshape", "complex_unsqueeze", "cummax", "cummin", "erfinv", "histc", "is_all_true", "refinements", "translations"]


def complex_unsqueeze(self, dim: int):
    """``aten::unsqueeze`` on a complex tensor (real ``[..., 2]``)."""
    if dim < 0:
        dim -= 1  # counted from before the (real, imaginary) axis
    return op.Unsqueeze(self, [dim])


def complex_expand(self, size: Sequence, implicit: bool = False):
    """``aten::expand`` on a complex tensor (real ``[..., 2]``): the pair axis is kept."""
    del implicit
    size = [1 if isinstance(s, int) and s == -1 else s for s in size] + [2]
    return op.Expand(self, common_ops.merge_dims(size))


def complex_reshape(self, shape: Sequence):
    """``aten::reshape`` on a complex tensor (real ``[..., 2]``), as torchlib's complex ``view``."""
    return op.Reshape(self, common_ops.merge_dims([*shape, 2]), allowzero=True)


def is_all_true(self):
    """``aten::_is_all_true``: every element true, as a bool scalar."""
    return op.Cast(op.ReduceMin(op.Cast(self, to=7), keepdims=0), to=9)  # INT64, then BOOL


def _cumulative(self, dim: int, reduce, fill):
    """(values, indices) of a running ``reduce`` (``op.ReduceMax``/``op.ReduceMin``) along ``dim``;
    ``fill`` (the other extreme of ``self``) stands in for the positions after ``i``."""
    rank = len(self.shape)
    if rank == 0:
        return op.Identity(self), op.Constant(value_int=0)
    dim = dim % rank
    n = op.Shape(self, start=dim, end=dim + 1)
    j = op.Range(op.Constant(value_int=0), op.Squeeze(n), op.Constant(value_int=1))  # INT64 [n]
    mask = op.LessOrEqual(op.Unsqueeze(j, [0]), op.Unsqueeze(j, [1]))  # [i, j]: j <= i
    trailing = list(range(2, 1 + rank - dim))
    if trailing:  # aligned with the axes after dim
        mask = op.Unsqueeze(mask, trailing)
    scanned = op.Unsqueeze(self, [dim])  # [..., 1, j, ...]
    values = reduce(op.Where(mask, scanned, fill(self, keepdims=0)), [dim + 1], keepdims=0)
    reached = op.And(mask, op.Equal(scanned, op.Unsqueeze(values, [dim + 1])))
    position = op.Unsqueeze(j, [0, *trailing])  # [1, j, 1...]
    indices = op.ReduceMax(op.Where(reached, position, op.Constant(value_int=-1)), [dim + 1], keepdims=0)
    return values, indices


def cummax(self, dim: int):
    """``aten::cummax``: running maximum along ``dim`` and its last index."""
    return _cumulative(self, dim, op.ReduceMax, op.ReduceMin)


def cummin(self, dim: int):
    """``aten::cummin``: running minimum along ``dim`` and its last index."""
    return _cumulative(self, dim, op.ReduceMin, op.ReduceMax)


def histc(self, bins: int = 100, min: float = 0.0, max: float = 0.0):
    """``aten::histc``: counts in ``bins`` equal bins over ``[min, max]``, of ``self``'s dtype;
    torchlib's translation unless ``min == max``."""
    if min != max:
        from onnxscript.function_libs.torch_lib.ops import core

        return core.aten_histc(self, bins, min, max)
    values = op.Reshape(self, op.Constant(value_ints=[-1]))
    low, high = op.ReduceMin(values, keepdims=0), op.ReduceMax(values, keepdims=0)
    same = op.Equal(low, high)  # widened by one each way, as torch
    one = op.CastLike(op.Constant(value_float=1.0), values)
    low, high = op.Where(same, op.Sub(low, one), low), op.Where(same, op.Add(high, one), high)
    inside = op.And(op.GreaterOrEqual(values, low), op.LessOrEqual(values, high))
    scaled = op.Div(op.Mul(op.Sub(values, low), op.CastLike(op.Constant(value_float=float(bins)), values)), op.Sub(high, low))
    index = op.Min(op.Cast(op.Floor(op.Cast(scaled, to=1)), to=7), op.Constant(value_int=bins - 1))  # max: the last bin
    hits = op.And(op.Equal(op.Unsqueeze(index, [1]), op.Range(op.Constant(value_int=0), op.Constant(value_int=bins), op.Constant(value_int=1))), op.Unsqueeze(inside, [1]))
    return op.CastLike(op.ReduceSum(op.Cast(hits, to=7), [0], keepdims=0), self)


_ERFINV_CENTRAL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)
_ERFINV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)


def _horner(coefficients, w):
    p = op.Constant(value_float=coefficients[0])
    for c in coefficients[1:]:
        p = op.Add(op.Mul(p, w), op.Constant(value_float=c))
    return p


def erfinv(self):
    """``aten::erfinv``: the inverse error function (see the module doc)."""
    x = op.Cast(self, to=1)
    one = op.Constant(value_float=1.0)
    w = op.Neg(op.Log(op.Mul(op.Sub(one, x), op.Add(one, x))))
    central = _horner(_ERFINV_CENTRAL, op.Sub(w, op.Constant(value_float=2.5)))
    tail = _horner(_ERFINV_TAIL, op.Sub(op.Sqrt(w), op.Constant(value_float=3.0)))
    y = op.Mul(op.Where(op.Less(w, op.Constant(value_float=5.0)), central, tail), x)
    # one Newton step on erf(y) = x: y -= (erf(y) - x) / (2/sqrt(pi) exp(-y^2))
    slope = op.Mul(op.Constant(value_float=1.1283791670955126), op.Exp(op.Neg(op.Mul(y, y))))
    refined = op.Sub(y, op.Div(op.Sub(op.Erf(y), x), slope))
    edge = op.Mul(x, op.Constant(value_float=float("inf")))  # erfinv(+-1) = +-inf
    y = op.Where(op.Equal(op.Abs(x), one), edge, refined)
    return op.CastLike(y, self)


def translations() -> list[tuple[object, object, bool]]:
    """``(torch op, function, is_complex)`` for the registry."""
    import torch

    aten = torch.ops.aten
    return [
        (aten.unsqueeze.default, complex_unsqueeze, True),
        (aten.expand.default, complex_expand, True),
        (aten.reshape.default, complex_reshape, True),
        (aten._is_all_true.default, is_all_true, False),
        (aten.cummax.default, cummax, False),
        (aten.cummin.default, cummin, False),
        (aten.erfinv.default, erfinv, False),
        (torch.ops.prims.erf_inv.default, erfinv, False),
    ]


def refinements() -> list[tuple[object, object]]:
    """``(torch op, function)`` registered over torchlib's translation: each handles the arguments
    torchlib's refuses and hands every other call to torchlib's own function."""
    import torch

    return [(torch.ops.aten.histc.default, histc)]
