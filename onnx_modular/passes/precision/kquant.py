"""k-quant rounding of a weight for ``MatMulNBits`` (llama.cpp's search), optionally importance-weighted.

llama.cpp's k-quants (and onnxruntime's ``quant_tensor_k_quant_cpu``, what onnxruntime-genai's
builder's ``k_quant`` runs) choose each block's scale and minimum by a weighted least-squares search
instead of the block's range (RTN); asymmetric: every block has a zero point. :func:`weighted_k_quant`
runs that search for the integer zero point ``MatMulNBits`` stores (onnxruntime's solves for a real
minimum, then rounds the zero point and the block again, which leaves its optimum: on the trained
Llama of docs/quality.md each call's KL alone is about 10% lower with this search, blocks of 32 and 64),
with each element's error weighted by its input channel's *importance* when given (llama.cpp's
importance matrix: the mean squared activation entering each row of the weight on calibration inputs;
the error of ``x @ W`` is ``sum_k x_k dW_k``, whose mean square is ``sum_k E[x_k^2] dW_k^2`` when the
channels are uncorrelated). :class:`KQuantPacker` lays the result out as
``DefaultWeightOnlyQuantizer.qbits_block_quant`` does (the ``MatMulNBits`` inputs, each row of the
weight's transpose padded to whole blocks), so the weight-quantization pass
(:mod:`onnx_modular.passes.precision.quantize_weights`) takes either.
"""

from __future__ import annotations

import numpy as np

__all__ = ["KQuantPacker", "weighted_k_quant", "block_error"]

#: The scales tried per block: ``(levels - 1 + offset) / range`` for ``offset`` in -1 to +1 (llama.cpp's ``make_qkx2_quants`` range).
STEPS = np.linspace(-1.0, 1.0, 41)


class KQuantPacker:
    """``qbits_block_quant(weight [K, N], importance [K] | None) -> (packed [N, blocks, blob], scales [N, blocks], zero_points [N, zp_bytes])``."""

    def __init__(self, bits: int, block_size: int):
        if bits not in (4, 8):
            raise ValueError(f"k-quant packs 4 or 8 bits for MatMulNBits, not {bits}")
        self.bits, self.block_size = bits, block_size

    def qbits_block_quant(self, weight: np.ndarray, importance: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k, n = weight.shape
        blocks = (k + self.block_size - 1) // self.block_size
        padded = np.pad(weight.astype(np.float32), ((0, blocks * self.block_size - k), (0, 0)))
        channels = np.ones(k, np.float32) if importance is None else np.asarray(importance, np.float32).reshape(k)
        rows = np.pad(channels, (0, blocks * self.block_size - k), constant_values=1.0)  # the padding is zeros: exact anyway
        q, scale, zero = weighted_k_quant(np.ascontiguousarray(padded.T), np.broadcast_to(rows, (n, rows.size)),
                                          self.bits, self.block_size)
        q = q.astype(np.uint8).reshape(n, blocks, self.block_size)
        zero = zero.astype(np.uint8).reshape(n, blocks)
        scales = scale.astype(np.float32).reshape(n, blocks)
        if self.bits == 8:
            return q, scales, zero
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
        if blocks % 2:  # a row's last byte holds one zero point; the other nibble is the default, 8
            zero = np.concatenate([zero, np.full((n, 1), 8, np.uint8)], axis=1)
        zero_points = (zero[:, 0::2] | (zero[:, 1::2] << 4)).astype(np.uint8)
        return packed, scales, zero_points


def block_error(data: np.ndarray, importance: np.ndarray, q: np.ndarray, scale: np.ndarray, zero: np.ndarray,
                block_size: int) -> float:
    """``sum(importance * (scale * (q - zero) - data)^2)`` over every element (``data``/``importance``/``q``:
    ``[rows, K]``, blocks along K; ``scale``/``zero``: one per block)."""
    x = data.reshape(-1, block_size).astype(np.float64)
    w = np.asarray(importance, np.float64).reshape(-1, block_size)
    dequant = np.reshape(scale, (-1, 1)) * (q.reshape(-1, block_size) - np.reshape(zero, (-1, 1)).astype(np.float64))
    return float(np.sum(w * (dequant - x) ** 2))


def weighted_k_quant(data: np.ndarray, importance: np.ndarray, bits: int = 4, block_size: int = 32
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per block of ``block_size`` along the last axis of ``data`` (``[rows, K]``), the scale and integer zero
    point minimising ``sum(w * (scale * (q - zero) - x)^2)``, ``w = importance * (rms(block) + |x|)``
    (llama.cpp's weights times the channel's importance): ``(q [blocks, block_size], scale [blocks], zero [blocks])``,
    as ``quant_tensor_k_quant_cpu`` returns them."""
    x = data.reshape(-1, block_size).astype(np.float64)
    imp = np.asarray(importance, np.float64).reshape(-1, block_size)
    imp = imp / np.maximum(imp.mean(axis=1, keepdims=True), 1e-30) + 1e-3  # relative weights; a silent channel still counts a little
    w = imp * (np.sqrt(np.mean(x * x, axis=1, keepdims=True)) + np.abs(x))
    maxq = 2 ** bits - 1
    rmin = np.minimum(x.min(axis=1, keepdims=True), 0.0)
    rmax = np.maximum(x.max(axis=1, keepdims=True), 0.0)
    span = np.where(rmax > rmin, rmax - rmin, 1.0)
    best = (np.full((x.shape[0], 1), np.inf), np.zeros_like(x), np.ones((x.shape[0], 1)), np.zeros((x.shape[0], 1)))
    for step in STEPS:
        iscale = (maxq + step) / span
        zero = np.clip(np.round(-rmin * iscale), 0, maxq)
        q = np.clip(np.round(x * iscale + zero), 0, maxq)
        for _ in range(2):  # the best scale for these levels, then the levels for that scale
            centred = q - zero
            denominator = np.sum(w * centred * centred, axis=1, keepdims=True)
            scale = np.where(denominator > 0, np.sum(w * centred * x, axis=1, keepdims=True) / np.maximum(denominator, 1e-300),
                             1.0 / iscale)
            scale = np.where(np.abs(scale) > 1e-30, scale, 1.0 / iscale)
            q = np.clip(np.round(x / scale + zero), 0, maxq)
        error = np.sum(w * (scale * (q - zero) - x) ** 2, axis=1, keepdims=True)
        better = error < best[0]
        best = (np.where(better, error, best[0]), np.where(better, q, best[1]), np.where(better, scale, best[2]),
                np.where(better, zero, best[3]))
    _, q, scale, zero = best
    return q, scale.reshape(-1), zero.reshape(-1)
