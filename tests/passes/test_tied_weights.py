"""Tied embeddings under quantize_weights (passes/precision/tied_weights.py): one table ``W`` read by
an embedding body's ``Gather`` and a head body's ``MatMul(x, Transpose(W))``. At int4, symmetric, the
head becomes ``MatMulNBits`` on ``W`` packed as its transpose and the embedding
``com.microsoft.GatherBlockQuantized`` on the same packed table: the float table goes. The results
are checked against the packed values unpacked in numpy (the embedding) and against onnxruntime's
``MatMulNBits`` of the same table (the head); what stays float is asserted with its reason."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import onnx.parser
import onnxruntime as ort
import pytest

from onnx_modular.passes.precision.quantize_weights import QuantizeSettings, quantize_weights

V = 48


def _text(hidden: int, head: str = "t = Transpose <perm = [1, 0]> (weight)\n  out = MatMul(input, t)") -> str:
    return f"""
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (int64[2, 3] ids) => (float[2, 3, {V}] logits, float[2, 3, {hidden}] h) {{
  h = pkg.test.Embedding(ids, W)
  logits = pkg.test.Head(h, W)
}}
<domain: "pkg.test", opset_import: ["" : 18]>
Embedding (input, weight) => (output) {{
  output = Gather(weight, input)
}}
<domain: "pkg.test", opset_import: ["" : 18]>
Head (input, weight) => (out) {{
  {head}
}}"""


def _model(hidden: int, **kwargs) -> tuple[onnx.ModelProto, np.ndarray]:
    model = onnx.parser.parse_model(_text(hidden, **kwargs))
    table = np.random.default_rng(0).standard_normal((V, hidden)).astype(np.float32)
    model.graph.initializer.append(onnx.numpy_helper.from_array(table, "W"))
    return model, table


def _quantized(model: onnx.ModelProto, bits: int = 4, symmetric: bool = True):
    bodies = [(f, f.name) for f in model.functions]
    done = quantize_weights(model, bodies, QuantizeSettings(bits=bits, block_size=32, symmetric=symmetric))
    for tensor in model.graph.initializer:  # the packed values (what the writer computes one at a time)
        if tensor.name in done.sources:
            tensor.CopyFrom(onnx.numpy_helper.from_array(np.asarray(done.sources[tensor.name]()), tensor.name))
    return done


def _nibbles(packed: np.ndarray) -> np.ndarray:
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1).astype(np.float32)


def _unpacked(model: onnx.ModelProto, hidden: int) -> np.ndarray:
    """``W_Q4`` / ``W_scales`` (/ ``W_zero_points``) as float: low nibble first, zero point 8 when symmetric."""
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    packed, scales = arrays["W_Q4"], arrays["W_scales"]
    blocks = scales.shape[1]
    zero = _nibbles(arrays["W_zero_points"])[:, :blocks, None] if "W_zero_points" in arrays else 8.0
    return ((_nibbles(packed).reshape(V, blocks, 32) - zero) * scales[:, :, None]).reshape(V, -1)[:, :hidden]


def _bodies(model):
    return {f.name: f for f in model.functions}


@pytest.mark.parametrize(("hidden", "symmetric"), [(64, True), (40, True), (40, False)])  # 40: the rows sliced
def test_the_head_and_the_embedding_read_one_int4_table(hidden, symmetric):
    model, table = _model(hidden)
    done = _quantized(model, symmetric=symmetric)
    bodies = _bodies(model)
    parts = ["weight_Q4", "weight_scales"] + ([] if symmetric else ["weight_zero_points"])
    assert [n.op_type for n in bodies["Head"].node] == ["MatMulNBits"]
    assert list(bodies["Head"].input) == ["input", *parts]
    ops = [n.op_type for n in bodies["Embedding"].node]
    assert ops == ["Constant", "Reshape", "GatherBlockQuantized"] + (["Constant"] * 3 + ["Slice"] if hidden % 32 else [])
    gather = next(n for n in bodies["Embedding"].node if n.op_type == "GatherBlockQuantized")
    assert gather.domain == "com.microsoft"
    assert {a.name: a.i for a in gather.attribute} == {"bits": 4, "block_size": 32, "gather_axis": 0, "quantize_axis": 1}
    assert bodies["Embedding"].node[-1].output == ["output"]  # the Gather's output name kept
    # the float table is read by nothing (convert's build then drops it, as for every packed weight)
    assert not any("W" in n.input for body in [model.graph, *model.functions] for n in body.node)
    packed = ["W" + part[len("weight"):] for part in parts]
    assert [n.input for n in model.graph.node] == [["ids", *packed], ["h", *packed]]
    assert list(gather.input[2:]) == parts[1:]  # the head's scales (and zero points)
    assert done.tied == [("Embedding", "output")] and [label for label, _ in done.quantized] == ["Head"]
    onnx.checker.check_model(model)

    ids = np.array([[0, 5, 47], [3, 3, 11]], np.int64)
    logits, h = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})
    unpacked = _unpacked(model, hidden)
    np.testing.assert_allclose(h, unpacked[ids], rtol=0, atol=1e-6)  # the rows of the int4 table
    assert 0 < np.abs(h - table[ids]).max() < 0.25 * np.abs(table).max()  # int4's rounding of the float rows
    np.testing.assert_allclose(logits, h @ unpacked.T, rtol=1e-4, atol=1e-4)  # the head: the same table, transposed


def test_the_head_alone_at_int8_and_the_embedding_reads_the_float_table():
    """GatherBlockQuantized is used at int4 only (the builder's recipe); int8 quantizes the head and leaves the table."""
    model, table = _model(64)
    done = _quantized(model, bits=8)
    bodies = _bodies(model)
    assert [n.op_type for n in bodies["Head"].node] == ["MatMulNBits"]
    assert [n.op_type for n in bodies["Embedding"].node] == ["Gather"]
    assert {t.name for t in model.graph.initializer} == {"W", "W_Q8", "W_scales"}
    assert done.tied == []
    ids = np.array([[0, 5, 47], [3, 3, 11]], np.int64)
    logits, h = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})
    np.testing.assert_array_equal(h, table[ids])
    assert np.abs(logits - h @ table.T).max() < 0.02 * np.abs(h @ table.T).max()


def test_a_table_read_otherwise_stays_float_with_the_reason():
    """A third reader (here an Add of the transposed table) is neither a head nor an embedding: nothing changes."""
    model, _ = _model(64, head="t = Transpose <perm = [1, 0]> (weight)\n  u = Add(t, t)\n  out = MatMul(input, u)")
    done = _quantized(model)
    assert [n.op_type for n in _bodies(model)["Head"].node] == ["Transpose", "Add", "MatMul"]
    assert [n.op_type for n in _bodies(model)["Embedding"].node] == ["Gather"]
    assert done.tied == [] and done.quantized == []
    assert {t.name for t in model.graph.initializer} == {"W"}


def _untied(hidden: int, shared: bool = False) -> tuple[onnx.ModelProto, np.ndarray]:
    """An embedding body reading its own table ``W`` (``shared``: a second body reads ``W`` too, as a MatMul weight)."""
    other = "\n  p = pkg.test.Proj(h, W)" if shared else ""
    outputs = f", float[2, 3, {V}] p" if shared else ""
    text = f"""
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (int64[2, 3] ids) => (float[2, 3, {hidden}] h{outputs}) {{
  h = pkg.test.Embedding(ids, W){other}
}}
<domain: "pkg.test", opset_import: ["" : 18]>
Embedding (input, weight) => (output) {{
  output = Gather(weight, input)
}}
<domain: "pkg.test", opset_import: ["" : 18]>
Proj (input, weight) => (out) {{
  t = Transpose <perm = [1, 0]> (weight)
  out = MatMul(input, t)
}}"""
    model = onnx.parser.parse_model(text)
    if not shared:
        del model.functions[1:]
    table = np.random.default_rng(1).standard_normal((V, hidden)).astype(np.float32)
    model.graph.initializer.append(onnx.numpy_helper.from_array(table, "W"))
    return model, table


@pytest.mark.parametrize(("bits", "symmetric", "hidden"), [(4, True, 64), (8, True, 64), (4, False, 40), (8, False, 40)])
def test_untied_embedding_as_gather_block_quantized(bits, symmetric, hidden):
    """``QuantizeSettings(embeddings=True)`` (``optimize --quantize auto``'s embedding choice): an untied
    table read by ``Gather`` becomes ``GatherBlockQuantized`` on its own packed table (a hidden size of no
    whole blocks padded, then sliced back); the float table goes; each gathered row is within one
    quantization step of the float row (half a step of rounding, half of the zero point's rounding or
    of symmetric int4's unused +8). Without the setting (the builder's default) it stays float."""
    model, table = _untied(hidden)
    left = quantize_weights(model, [(f, f.name) for f in model.functions], QuantizeSettings(bits, 32, symmetric))
    assert not left.tied and any(n.op_type == "Gather" for n in model.functions[0].node)
    done = quantize_weights(model, [(f, f.name) for f in model.functions],
                            QuantizeSettings(bits, 32, symmetric, embeddings=True))
    assert [label for label, _ in done.tied] == ["Embedding"] and not done.quantized
    for tensor in model.graph.initializer:
        if tensor.name in done.sources:
            tensor.CopyFrom(onnx.numpy_helper.from_array(np.asarray(done.sources[tensor.name]()), tensor.name))
    kept = [t for t in model.graph.initializer if t.name != "W"]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    ops = [n.op_type for n in model.functions[0].node]
    assert "GatherBlockQuantized" in ops and "Gather" not in ops and ("Slice" in ops) == (hidden % 32 != 0)
    ids = np.array([[0, 5, 47], [3, 3, 12]], np.int64)
    rows = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]
    expected = table[ids]
    blocks = np.pad(expected, ((0, 0), (0, 0), (0, -hidden % 32))).reshape(2, 3, -1, 32)
    step = (blocks.max(-1) - blocks.min(-1)) / (2 ** bits - 1)  # each block's quantization step
    if symmetric:
        step = np.abs(blocks).max(-1) / 2 ** (bits - 1)
    bound = np.repeat(step, 32, axis=-1)[..., :hidden] * 1.001 + 1e-6
    error = np.abs(rows - expected)
    assert np.all(error <= bound), (error / bound).max()
    assert error.mean() < 0.5 * bound.mean()


def test_a_table_other_bodies_read_stays_float():
    """A table the embedding shares with another reader (a head of its own, not quantized with it) is not split."""
    model, _ = _untied(64, shared=True)
    done = quantize_weights(model, [(model.functions[0], "Embedding")], QuantizeSettings(4, 32, True, embeddings=True))
    assert not done.tied and "W" in {t.name for t in model.graph.initializer}
    assert any(n.op_type == "Gather" for n in model.functions[0].node)
