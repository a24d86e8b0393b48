"""Translations of torch ops that torch's ONNX translator (torchlib) lacks, registered only where
torch has none (:func:`onnx_modular.capture.torch_compat.registry`), so every op torch translates is
translated as torch does.

* Complex values travel through torch's translator as real tensors with a trailing axis of 2
  (real, imaginary). torchlib has complex variants of most shape ops (``view``, ``permute``,
  ``slice``, ``squeeze.dim``) but not of ``unsqueeze`` and ``expand``, which Llama-4-style
  rotary embeddings apply to complex frequencies ("No decompositions registered for the
  complex-valued input"). The variants here move a negative axis past the trailing pair and keep
  it, as torchlib's own complex variants do.
* ``aten._is_all_true`` is what ``torch._check(tensor.all())``-style runtime checks capture to
  (transformers' image-token count check in LLaVA-style models): a bool scalar, all elements
  true. Its value feeds an assertion that the translator drops, but the op itself needs a
  translation.
"""

from __future__ import annotations

from collections.abc import Sequence

from onnxscript.function_libs.torch_lib.ops import common as common_ops
from onnxscript.onnx_opset import opset18 as op

__all__ = ["complex_expand", "complex_unsqueeze", "is_all_true", "translations"]


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


def is_all_true(self):
    """``aten::_is_all_true``: every element true, as a bool scalar."""
    return op.Cast(op.ReduceMin(op.Cast(self, to=7), keepdims=0), to=9)  # INT64, then BOOL


def translations() -> list[tuple[object, object, bool]]:
    """``(torch op, function, is_complex)`` for the registry."""
    import torch

    aten = torch.ops.aten
    return [
        (aten.unsqueeze.default, complex_unsqueeze, True),
        (aten.expand.default, complex_expand, True),
        (aten._is_all_true.default, is_all_true, False),
    ]
