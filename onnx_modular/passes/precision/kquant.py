"""k-quant rounding of a weight for ``MatMulNBits`` (llama.cpp's, as onnxruntime ships it).

onnxruntime's ``quant_tensor_k_quant_cpu`` (``onnxruntime.quantization.neural_compressor.weight_only``,
what ``MatMulNBitsQuantizer``'s ``KQuantWeightOnlyQuantConfig`` and onnxruntime-genai's builder's
``k_quant`` run) chooses each block's scale and minimum by a weighted least-squares search instead of
the block's range (RTN). It is asymmetric: every block has a zero point. :class:`KQuantPacker` lays
its result out as ``DefaultWeightOnlyQuantizer.qbits_block_quant`` does (the ``MatMulNBits`` inputs,
each row of the weight's transpose padded to whole blocks), so the weight-quantization pass
(:mod:`onnx_modular.passes.precision.quantize_weights`) takes either.
"""

from __future__ import annotations

import numpy as np

__all__ = ["KQuantPacker"]


class KQuantPacker:
    """``qbits_block_quant(weight [K, N]) -> (packed [N, blocks, blob], scales [N, blocks], zero_points [N, zp_bytes])``."""

    def __init__(self, bits: int, block_size: int):
        if bits not in (4, 8):
            raise ValueError(f"k-quant packs 4 or 8 bits for MatMulNBits, not {bits}")
        self.bits, self.block_size = bits, block_size

    def qbits_block_quant(self, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # imported by quantize_weights' packer already, with the root logger kept as it was
        from onnxruntime.quantization.neural_compressor.weight_only import quant_tensor_k_quant_cpu

        k, n = weight.shape
        blocks = (k + self.block_size - 1) // self.block_size
        padded = np.pad(weight.astype(np.float32), ((0, blocks * self.block_size - k), (0, 0)))
        q, scale, zero = quant_tensor_k_quant_cpu(np.ascontiguousarray(padded.T), self.bits, self.block_size)
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
