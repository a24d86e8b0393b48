"""The inputs ``optimize`` verifies a decoder's rewrite on besides its short prompt and decode step,
so the check cannot be vacuous:

* a prompt longer than any window the file's bodies could hold (:func:`long_prompt_length`: past
  the largest small integer constant of the file, within ``max_positions``): an attention body that
  differs from a sliding window only past the short prompt differs here;
* a batch of two whose second row is right-padded (the padding contract of onnxruntime's fused
  attention: ``seqlens_k`` from the mask), compared on the real tokens (:func:`real_tokens`: what a
  padded query computes is the op's own);
* a batch of two whose second row is left-padded, measured on the rows' real tokens only
  (:func:`left_padded`): fused attention reads positions from the mask where a transformers body
  reads them from the cache position, so the rewrite may differ there; the report says by how much
  instead of calling the file verified on such batches.

A run the original file itself cannot make (a batch dimension fixed to 1) is left out.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

__all__ = ["long_prompt_length", "padded_batch", "left_padded", "logits_drift", "real_tokens", "MAX_LONG_PROMPT"]

#: The longest prompt the check runs (a window of 4,096 tokens is covered; more is the user's to check).
MAX_LONG_PROMPT = 4098
_SHORT = 6


def _small_ints(model: ir.Model) -> list[int]:
    """Scalar (or one-element) integer constants of the main graph and the bodies."""
    found = []
    bodies = [model.graph, *model.functions.values()]
    tensors = [v.const_value for v in model.graph.initializers.values() if v.const_value is not None]
    for body in bodies:
        for node in ir.traversal.RecursiveGraphIterator(body):
            if node.op_type == "Constant":
                attribute = node.attributes.get("value")
                if attribute is not None and attribute.type == ir.AttributeType.TENSOR:
                    tensors.append(attribute.value)
                elif attribute is None and node.attributes.get("value_int") is not None:
                    found.append(node.attributes["value_int"].as_int())
    for tensor in tensors:
        if tensor.size == 1 and tensor.dtype is not None and tensor.dtype.is_integer():
            try:
                found.append(int(tensor.numpy().reshape(-1)[0]))
            except Exception:  # a tensor onnx_ir cannot read: not a window
                continue
    return found


def long_prompt_length(model: ir.Model, max_positions: int) -> int:
    """A prompt past every window the file could hold: the largest small integer constant below
    ``max_positions``, plus 2 (at least 17), within ``max_positions`` and :data:`MAX_LONG_PROMPT`."""
    window = max([v for v in _small_ints(model) if 0 < v < max_positions], default=0)
    return max(min(max(window + 2, 17), max_positions, MAX_LONG_PROMPT), 1)


def padded_batch(feeds: dict[str, np.ndarray], ids: str | None, side: str, seed: int = 7) -> tuple[dict, int]:
    """``feeds`` of one row as a batch of two, the second row padded on ``side`` (a quarter of its tokens,
    at least one); returns the feeds and the padding. Positions of a left-padded row count its real tokens."""
    batch = {}
    length = next((a.shape[1] for n, a in feeds.items() if n == ids), 0)
    pad = max(length // 4, 1) if length > 1 else 0
    for name, array in feeds.items():
        batch[name] = np.concatenate([array, array]) if array.ndim >= 2 and array.shape[0] == 1 else array
    if ids is not None:
        rng = np.random.default_rng(seed)
        batch[ids] = batch[ids].copy()
        batch[ids][1] = rng.permutation(batch[ids][1])
    for name, array in batch.items():
        if "mask" in name and array.ndim == 2 and pad:
            array = array.copy()
            array[1, :pad] = 0 if side == "left" else array[1, :pad]
            if side == "right":
                array[1, -pad:] = 0
            batch[name] = array
    if side == "left":
        for name, array in batch.items():
            if "position" in name and array.ndim == 2 and pad:
                array = array.copy()
                array[1] = np.concatenate([np.ones(pad, array.dtype), np.arange(array.shape[1] - pad, dtype=array.dtype)])
                batch[name] = array
    return batch, pad


def real_tokens(array: np.ndarray, cut: tuple[int, int] | None) -> np.ndarray:
    """The values of a right-padded batch of two that belong to real tokens (``cut``: the sequence
    length and the second row's padding): what a padded query computes is left to the op."""
    if cut is None or array.ndim < 2 or array.shape[0] != 2:
        return array
    length, pad = cut
    if array.shape[1] == length:  # [batch, sequence, ...]
        return np.concatenate([array[0].ravel(), array[1, : length - pad].ravel()])
    if array.ndim == 4 and array.shape[2] == length:  # [batch, heads, sequence, size]
        return np.concatenate([array[0].ravel(), array[1, :, : length - pad].ravel()])
    return array


def logits_drift(expected: dict[str, np.ndarray], got: dict[str, np.ndarray], pad: int) -> float:
    """The largest difference of the rank-3 float outputs on the real tokens of a left-padded batch."""
    drift = 0.0
    for name, value in expected.items():
        other = got.get(name)
        if other is None or value.ndim != 3 or value.dtype.kind != "f" or other.shape != value.shape:
            continue
        drift = max(drift, float(np.abs(value[0] - other[0]).max()), float(np.abs(value[1, pad:] - other[1, pad:]).max()))
    return drift


def left_padded(make: Callable[[int], dict], ids: str | None, run: Callable[[dict], dict]) -> tuple[dict, dict, int] | None:
    """(feeds, the original file's outputs, padding) of a left-padded batch, or ``None`` when the file
    cannot run one."""
    feeds, pad = padded_batch(make(_SHORT + 2), ids, "left")
    if not pad:
        return None
    try:
        return feeds, run(feeds), pad
    except Exception:  # a batch dimension fixed to 1: nothing to measure
        return None
