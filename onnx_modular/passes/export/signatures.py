"""Eager call signatures, and matching them to the ONNX values at a module boundary.

:mod:`onnx_modular.capture.reference_run` records, per module call, the tensors ``forward()`` received and
returned (:class:`CallSignature`); :class:`~onnx_modular.passes.export.outline_calls.OutlineModuleCallsPass`
names a function's formal inputs and outputs by matching its boundary values to them
(docs/design.md, "Naming formal inputs and outputs from forward()"). What cannot be matched
with certainty gets an ``unbound_*`` name and a note saying why. No torch here: recorded
tensors are compared through numpy.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_modular.format import metadata

__all__ = [
    "TensorSpec",
    "CallSignature",
    "match_unambiguous",
    "match_by_value",
    "why_unbound_input",
    "why_unbound_output",
    "unique_names",
]

#: function.meta: lines explaining formal inputs/outputs not named from forward() (doc string)
UNBOUND_INPUT = "unbound_input"
UNBOUND_OUTPUT = "unbound_output"
SIZE_INPUT = "size"


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor seen at a module boundary in eager mode.

    ``value`` is kept only when another tensor of the same call has the same dtype and
    shape: then the value tells them apart. It is any array-like that ``ir.tensor`` accepts
    (a numpy array, a torch tensor); this module never imports torch.
    """

    name: str
    dtype: ir.DataType
    shape: tuple[int, ...]
    value: Any = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass
class CallSignature:
    """Tensors a module call received (forward() order) and returned (return order).

    ``absent`` names the forward() parameters that were ``None`` in the eager call: a formal
    input that matches no received tensor is often one of them, materialised by torch.export.
    """

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    absent: tuple[str, ...] = ()


def _compatible(value: ir.Value, spec: TensorSpec) -> bool:
    if value.dtype is not None and value.dtype != spec.dtype:
        return False
    shape = value.shape
    if shape is None:
        return True
    if len(shape) != len(spec.shape):
        return False
    return all(not isinstance(dim, int) or dim == size for dim, size in zip(shape, spec.shape))


def match_unambiguous(values: Sequence[ir.Value], specs: Sequence[TensorSpec]) -> dict[ir.Value, int]:
    """Match values to eager tensor specs where the match is certain.

    A value and a spec are paired when each is the other's only compatible partner
    (by dtype and shape), repeatedly, so that resolving one pair can make another
    certain. Values of equal dtype and shape stay unmatched: guessing between
    ``forward(self, a, b)``'s ``a`` and ``b`` would give names that may be wrong.
    """
    candidates = {value: {i for i, spec in enumerate(specs) if _compatible(value, spec)} for value in values}
    matched: dict[ir.Value, int] = {}
    changed = True
    while changed:
        changed = False
        for value, options in candidates.items():
            if value in matched or len(options) != 1:
                continue
            (index,) = options
            rivals = [other for other, other_options in candidates.items() if other is not value and index in other_options and other not in matched]
            if rivals:
                continue
            matched[value] = index
            for other, other_options in candidates.items():
                if other is not value:
                    other_options.discard(index)
            changed = True
    return matched


def match_by_value(
    values: Sequence[ir.Value],
    specs: Sequence[TensorSpec],
    matched: dict[ir.Value, int],
    value_of: Callable[[str], Any] | None,
) -> None:
    """Resolve equal-shaped values by comparing their computed values with the eager tensors."""
    if value_of is None:
        return
    taken = set(matched.values())
    for value in values:
        if value in matched:
            continue
        options = [i for i, spec in enumerate(specs) if i not in taken and spec.value is not None and _compatible(value, spec)]
        if not options:
            continue
        computed = _as_array(value_of(source_name(value)))
        if computed is None:
            continue
        equal = [i for i in options if _allclose(_as_array(specs[i].value), computed)]
        if len(equal) == 1:
            matched[value] = equal[0]
            taken.add(equal[0])


def _as_array(value: Any) -> np.ndarray | None:
    """A numpy view of an array-like (numpy, torch, onnx_ir tensor), in its own dtype: floats are
    widened chunk by chunk where they are compared (:func:`_allclose`), never whole."""
    if value is None or not hasattr(value, "shape") or not hasattr(value, "dtype"):
        return None  # sizes (SymInt), None, ...: not a tensor
    try:
        return value if isinstance(value, np.ndarray) else ir.tensor(value).numpy()
    except Exception:
        return None


#: Elements compared at once, at most: float64 temporaries of 8 MB whatever the tensor's size
#: (SAM 3's vision features, 2x256x288x288, took 324 MB per temporary when compared whole).
_CHUNK = 1 << 20


def _blocks(shape: tuple[int, ...]):
    """Indices over the leading axes that cut ``shape`` into views of at most :data:`_CHUNK`
    elements (or one last axis, if that alone is longer): no copy of a non-contiguous array."""
    lead, size = 0, math.prod(shape)
    while lead < len(shape) and size > _CHUNK:
        size //= max(shape[lead], 1)
        lead += 1
    return itertools.product(*(range(n) for n in shape[:lead]))


def _widened(array: np.ndarray) -> np.ndarray:
    return array if array.dtype.kind in "biu" else array.astype(np.float64)  # float16, bfloat16, float32, ...


def _allclose(expected: np.ndarray | None, computed: np.ndarray) -> bool:
    if expected is None or expected.shape != computed.shape:
        return False
    return all(
        np.allclose(_widened(np.asarray(expected[index])), _widened(np.asarray(computed[index])), rtol=1e-5, atol=1e-6, equal_nan=True)
        for index in _blocks(expected.shape)
    )


def source_name(value: ir.Value) -> str:
    return value.meta.get(metadata.SOURCE_NAME) or value.name or ""


def _candidates(value: ir.Value, specs: Sequence[TensorSpec], matched: dict[ir.Value, int]) -> list[str]:
    taken = set(matched.values())
    return [spec.name for i, spec in enumerate(specs) if i not in taken and _compatible(value, spec)]


def why_unbound_input(value: ir.Value, signature: CallSignature | None, matched: dict[ir.Value, int]) -> str:
    if signature is None:
        return "the call was not observed in eager mode, so forward()'s parameters are unknown"
    candidates = _candidates(value, signature.inputs, matched)
    if candidates:
        return f"one of {', '.join(candidates)} (equal dtype and shape; their values did not tell them apart)"
    reason = "not a tensor that forward() received in eager mode; the caller computes it"
    if signature.absent:
        reason += f" (forward() received None for {', '.join(signature.absent)}; torch.export may have materialised one)"
    return reason


def why_unbound_output(value: ir.Value, signature: CallSignature | None, matched: dict[ir.Value, int]) -> str:
    if signature is None:
        return "the call was not observed in eager mode, so what forward() returns is unknown"
    candidates = _candidates(value, signature.outputs, matched)
    if candidates:
        return f"one of {', '.join(candidates)} (equal dtype and shape; their values did not tell them apart)"
    return "computed in this call and read outside it, but not returned by forward() (a side effect such as a KV-cache update, or a value a later call reuses)"


def unique_names(names: list[str], reserved: Iterable[str] = ()) -> list[str]:
    """``names`` with later duplicates suffixed ``_1``, ``_2``, ... (avoiding ``reserved``)."""
    used = set(reserved)
    unique = []
    for name in names:
        candidate, suffix = name, 1
        while candidate in used:
            candidate, suffix = f"{name}_{suffix}", suffix + 1
        used.add(candidate)
        unique.append(candidate)
    return unique
