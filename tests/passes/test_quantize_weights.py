"""quantize_weights (passes/precision/quantize_weights.py) on a small ONNX text model: a MatMul with a
constant [K, N] weight becomes MatMulNBits (K, N, bits, block_size), a Gemm with transB becomes
MatMulNBits + Add of its bias, a MatMul whose weight is a graph input is left and reported; the
result computes what onnxruntime's own MatMulNBitsQuantizer makes of the same model."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper
import onnx.parser
import onnxruntime as ort
import pytest

from onnx_modular.passes.precision.quantize_weights import QuantizeSettings, quantize_weights

K, N = 64, 16

MODEL = f"""
<ir_version: 10, opset_import: ["" : 18]>
main (float[2, {K}] x, float[{K}, 8] b) => (float[2, {N}] y, float[2, 8] z, float[2, {N}] g) {{
  y = MatMul(x, w)
  z = MatMul(x, b)
  g = Gemm <transB = 1> (x, v, c)
}}"""


def _model() -> onnx.ModelProto:
    model = onnx.parser.parse_model(MODEL)
    rng = np.random.default_rng(0)
    model.graph.initializer.extend([
        onnx.numpy_helper.from_array(rng.standard_normal((K, N)).astype(np.float32), "w"),
        onnx.numpy_helper.from_array(rng.standard_normal((N, K)).astype(np.float32), "v"),  # read transposed
        onnx.numpy_helper.from_array(rng.standard_normal(N).astype(np.float32), "c"),
    ])
    return model


def _filled(model: onnx.ModelProto, sources) -> onnx.ModelProto:
    """The packed initializers with their values (what the writer does one tensor at a time)."""
    for tensor in model.graph.initializer:
        if tensor.name in sources:
            tensor.CopyFrom(onnx.numpy_helper.from_array(np.asarray(sources[tensor.name]()), tensor.name))
    return model


def _run(model: onnx.ModelProto, feeds) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_constant_weight_becomes_matmulnbits(bits):
    model = _model()
    done = quantize_weights(model, [(model.graph, "<main graph>")], QuantizeSettings(bits=bits, block_size=32))
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 2 and all(n.domain == "com.microsoft" for n in nbits)
    for node in nbits:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attributes == {"K": K, "N": N, "bits": bits, "block_size": 32}
    matmul = next(n for n in nbits if n.input[1].startswith("w"))
    assert matmul.input == ["x", f"w_Q{bits}", "w_scales", "w_zero_points"] and matmul.output == ["y"]
    # the Gemm: its transposed weight packed as [K, N], its bias an Add after it
    gemm = next(n for n in nbits if n.input[1].startswith("v"))
    add = next(n for n in model.graph.node if n.op_type == "Add")
    assert add.input == [gemm.output[0], "c"] and add.output == ["g"]
    # the MatMul reading a graph input is left, with the reason
    assert [n.input for n in model.graph.node if n.op_type == "MatMul"] == [["x", "b"]]
    assert done.skipped == [("<main graph>", "z", "its weight is not an initializer (computed or a graph input)")]
    assert [q for q, _ in done.quantized] == ["<main graph>", "<main graph>"]
    assert any(o.domain == "com.microsoft" for o in model.opset_import)
    blocks = K // 32
    shapes = {t.name: list(t.dims) for t in model.graph.initializer if t.name.startswith("w_")}
    assert shapes == {f"w_Q{bits}": [N, blocks, 32 * bits // 8], "w_scales": [N, blocks], "w_zero_points": [N, (blocks * bits + 7) // 8]}


def test_it_computes_what_onnxruntimes_quantizer_makes():
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    original = _model()
    model = _model()
    done = quantize_weights(model, [(model.graph, "<main graph>")], QuantizeSettings(bits=4, block_size=32))
    _filled(model, done.sources)
    onnx.checker.check_model(model)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((2, K)).astype(np.float32), "b": rng.standard_normal((K, 8)).astype(np.float32)}
    reference = _run(original, feeds)
    quantized = _run(model, feeds)
    theirs = MatMulNBitsQuantizer(_model(), bits=4, block_size=32, is_symmetric=False)
    theirs.process()
    y_theirs = _run(theirs.model.model, feeds)[0]
    np.testing.assert_allclose(quantized[0], y_theirs, rtol=1e-5, atol=1e-5)  # the same packing
    np.testing.assert_array_equal(quantized[1], reference[1])  # the MatMul left as it was
    for ours, exact in ((quantized[0], reference[0]), (quantized[2], reference[2])):
        assert 0 < np.abs(ours - exact).max() < 0.1 * np.abs(exact).max()  # int4's rounding, not a different product
