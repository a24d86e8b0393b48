"""The dynamic int8 pass inside function bodies: constant MatMul weights threaded up to the main graph as
int8 + per-column scales, ``DynamicQuantizeMatMul`` in the bodies (the bias ``Add`` folded in),
``Attention`` opened into a quantized GEMM + ``MultiHeadAttention``, weight-only as the alternative."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

LINEAR_TEXT = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[2,3,16] x) => (float[2,3,8] y, float[2,3,8] z)
<float[16,8] w1, float[8] b1, float[8,8] w2, float[8] b2>
{
    h = pkg.test.Linear(x, w1, b1)
    y = pkg.test.Linear(h, w2, b2)
    z = pkg.test.Scores(y, w2)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Linear (x, weight, bias) => (out)
{
    product = MatMul(x, weight)
    out = Add(product, bias)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Scores (x, weight) => (out)
{
    t = Transpose<perm: ints = [0, 2, 1]>(x)
    s = MatMul(x, t)
    out = MatMul(s, x)
}
"""


def _model() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    model = onnx.parser.parse_model(LINEAR_TEXT)
    rng = np.random.default_rng(0)
    values = {"w1": rng.standard_normal((16, 8)), "b1": rng.standard_normal(8), "w2": rng.standard_normal((8, 8)),
              "b2": rng.standard_normal(8)}
    del model.graph.initializer[:]
    model.graph.initializer.extend(onnx.numpy_helper.from_array(v.astype(np.float32), k) for k, v in values.items())
    return model, {k: v.astype(np.float32) for k, v in values.items()}


def _materialized(model: onnx.ModelProto, sources) -> bytes:
    for tensor in model.graph.initializer:
        if tensor.name in sources:
            tensor.CopyFrom(onnx.numpy_helper.from_array(sources[tensor.name](), tensor.name))
    names = {n for body in [model.graph, *model.functions] for node in body.node for n in node.input}
    kept = [t for t in model.graph.initializer if t.name in names]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return model.SerializeToString()


def test_a_weight_read_elsewhere_too_leaves_the_shared_body_float_with_the_reason():
    from onnx_modular.passes.precision.dynamic_int8 import quantize_dynamic_int8

    model, _ = _model()  # w2 is read by the Scores call too: the Linear body (shared by both calls) stays float
    done = quantize_dynamic_int8(model, [(f, f.name) for f in model.functions])
    assert done.quantized == [] and done.sources == {}
    assert {reason for _, _, reason in done.skipped} == {"its weight is read by other nodes too (shared)"}
    scores = next(f for f in model.functions if f.name == "Scores")
    assert [n.op_type for n in scores.node] == ["Transpose", "MatMul", "MatMul"]  # activations times activations


def test_quantized_file_runs_close_to_float_and_weight_only_is_the_dequantized_weight():
    import onnxruntime as ort

    from onnx_modular.passes.precision.dynamic_int8 import is_dynamic, quantize_dynamic_int8, to_weight_only

    model, values = _model()
    del model.graph.node[2]  # nothing else reads w2: both Linear calls quantize
    del model.graph.output[1]
    before = model.SerializeToString()
    done = quantize_dynamic_int8(model, [(f, f.name) for f in model.functions])
    assert set(done.sources) == {"w1_int8", "w1_scale", "w2_int8", "w2_scale"}
    linear = next(f for f in model.functions if f.name == "Linear")
    assert [(n.op_type, n.domain) for n in linear.node] == [("DynamicQuantizeMatMul", "com.microsoft")]
    assert list(linear.node[0].input) == ["x", "weight_int8", "weight_scale", "", "bias"]  # the Add folded into its bias
    weight, scale = done.sources["w1_int8"](), done.sources["w1_scale"]()
    assert weight.dtype == np.int8 and weight.shape == (16, 8) and scale.shape == (8,) and np.abs(weight).max() == 127
    np.testing.assert_allclose(weight * scale, values["w1"], atol=float(scale.max()) / 2 + 1e-6)  # per column, symmetric
    x = np.random.default_rng(1).standard_normal((2, 3, 16)).astype(np.float32)
    expected = ort.InferenceSession(before).run(None, {"x": x})
    dynamic = ort.InferenceSession(_materialized(model, done.sources)).run(None, {"x": x})
    for got, want in zip(dynamic, expected):
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.03  # int8 activations and weights
        assert not np.allclose(got, want, atol=1e-6)  # it does compute in int8
    linear = next(f for f in model.functions if f.name == "Linear")
    made = [new for node in linear.node for new in (to_weight_only(linear, node) if is_dynamic(node) else [node])]
    del linear.node[:]
    linear.node.extend(made)
    assert [n.op_type for n in linear.node] == ["Cast", "Mul", "MatMul", "Add"]
    weight_only = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    w1 = done.sources["w1_int8"]().astype(np.float32) * done.sources["w1_scale"]()
    h = x @ w1 + values["b1"]
    w2 = done.sources["w2_int8"]().astype(np.float32) * done.sources["w2_scale"]()
    np.testing.assert_allclose(weight_only[0], h @ w2 + values["b2"], atol=1e-4, rtol=1e-4)


ATTENTION_TEXT = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1, "com.microsoft" : 1]>
main (float[1,5,16] x, float[1,1,5,5] mask) => (float[1,5,16] y)
<float[16,48] qkv, float[48] bias>
{
    y = pkg.test.SelfAttention(x, qkv, bias, mask)
}
<domain: "pkg.test", opset_import: ["" : 18, "com.microsoft" : 1]>
SelfAttention (x, w, b, mask) => (out)
{
    out = com.microsoft.Attention<num_heads: int = 2, scale: float = 0.35>(x, w, b, , , mask)
}
"""


def test_attention_on_packed_weights_opened_into_a_quantized_gemm_and_multi_head_attention():
    import onnxruntime as ort

    from onnx_modular.passes.precision.dynamic_int8 import quantize_dynamic_int8

    model = onnx.parser.parse_model(ATTENTION_TEXT)
    rng = np.random.default_rng(0)
    model.graph.initializer.extend([onnx.numpy_helper.from_array(rng.standard_normal((16, 48)).astype(np.float32) * 0.3, "qkv"),
                                    onnx.numpy_helper.from_array(rng.standard_normal(48).astype(np.float32), "bias")])
    before = model.SerializeToString()
    done = quantize_dynamic_int8(model, [(f, f.name) for f in model.functions])
    assert done.opened == [("SelfAttention", done.opened[0][1])]
    body = model.functions[0]
    assert [n.op_type for n in body.node] == ["DynamicQuantizeMatMul", "Split", "MultiHeadAttention"]
    mha = body.node[2]
    assert list(mha.input)[3:] == ["b", "", "mask"]  # the packed bias and the additive mask kept
    assert {a.name: onnx.helper.get_attribute_value(a) for a in mha.attribute} == {"num_heads": 2, "scale": pytest.approx(0.35)}
    feeds = {"x": rng.standard_normal((1, 5, 16)).astype(np.float32), "mask": np.zeros((1, 1, 5, 5), np.float32)}
    feeds["mask"][..., 3:] = -1e4
    expected = ort.InferenceSession(before).run(None, feeds)[0]
    got = ort.InferenceSession(_materialized(model, done.sources)).run(None, feeds)[0]
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 0.03


def test_attention_with_a_mask_index_is_left_as_it_is():
    from onnx_modular.passes.precision.dynamic_int8 import quantize_dynamic_int8

    model = onnx.parser.parse_model(ATTENTION_TEXT.replace("(x, w, b, , , mask)", "(x, w, b, index)")
                                    .replace("SelfAttention (x, w, b, mask)", "SelfAttention (x, w, b, index)")
                                    .replace("float[1,1,5,5] mask", "int32[1,5] mask"))
    model.graph.initializer.extend([onnx.numpy_helper.from_array(np.ones((16, 48), np.float32), "qkv"),
                                    onnx.numpy_helper.from_array(np.ones(48, np.float32), "bias")])
    done = quantize_dynamic_int8(model, [(f, f.name) for f in model.functions])
    assert done.opened == [] and done.quantized == []
    assert [n.op_type for n in model.functions[0].node] == ["Attention"]


SKIP_TEXT = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1, "com.microsoft" : 1]>
main (float[2,3,8] x, float[2,3,8] r) => (float[2,3,8] y, float[2,3,8] s)
<float[8] g, float[8] b>
{
    y, s = pkg.test.Output(x, r, g, b)
}
<domain: "pkg.test", opset_import: ["" : 18, "com.microsoft" : 1]>
Output (x, r, g, b) => (out, total)
{
    out, mean, inv, total = com.microsoft.SkipLayerNormalization<epsilon: float = 1e-5>(x, r, g, b)
}
"""


@pytest.mark.parametrize("statistics_read", [False, True])
def test_skip_layer_norm_opened_into_sum_and_layer_norm(statistics_read):
    """onnxruntime's CPU SkipLayerNormalization is slower than Sum + LayerNormalization (which it does not
    fuse back); a node whose mean or inverse deviation is read stays."""
    import onnxruntime as ort

    from onnx_modular.passes.precision.dynamic_int8 import quantize_dynamic_int8

    text = SKIP_TEXT if not statistics_read else SKIP_TEXT.replace(
        "Output (x, r, g, b) => (out, total)", "Output (x, r, g, b) => (out, mean)").replace("y, s = ", "y, s = ")
    model = onnx.parser.parse_model(text.replace("float[2,3,8] s)", "float[2,3,8] s)" if not statistics_read else "float[2,3,1] s)"))
    rng = np.random.default_rng(0)
    model.graph.initializer.extend([onnx.numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), n) for n in "gb"])
    before = model.SerializeToString()
    done = quantize_dynamic_int8(model, [(f, f.name) for f in model.functions])
    ops = [n.op_type for n in model.functions[0].node]
    if statistics_read:
        assert done.norms == [] and ops == ["SkipLayerNormalization"]
        return
    assert len(done.norms) == 1 and ops == ["Sum", "LayerNormalization"]
    feeds = {"x": rng.standard_normal((2, 3, 8)).astype(np.float32), "r": rng.standard_normal((2, 3, 8)).astype(np.float32)}
    for got, expected in zip(ort.InferenceSession(model.SerializeToString()).run(None, feeds),
                             ort.InferenceSession(before).run(None, feeds)):
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
