"""``optimize`` on encoders: attention bodies without a cache into ``Attention`` (packed self-attention)
or ``MultiHeadAttention`` (cross-attention), residual add + ``LayerNorm`` into
``SkipLayerNormalization``, GELU into ``Gelu``, inside the bodies; the calls stay functions and the
optimized file computes what torch computes (a padded row included)."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

SKIP_LN_TEXT = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[2,3,8] x, float[2,3,8] r) => (float[2,3,8] y)
<float[8] w = {1,2,3,4,5,6,7,8}, float[8] b = {0,1,0,1,0,1,0,1}>
{
    y = pkg.test.Output(x, r, w, b)
}
<domain: "pkg.test", opset_import: ["" : 18]>
LayerNorm (x, weight, bias) => (out)
{
    out = LayerNormalization<axis: int = -1, epsilon: float = 1e-5>(x, weight, bias)
}
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Output (x, r, weight, bias) => (out)
{
    h = Add(x, r)
    out = pkg.test.LayerNorm(h, weight, bias)
}
"""


def test_residual_add_and_layer_norm_call_become_one_skip_layer_norm():
    """BertSelfOutput's shape: the norm of the sum is the body's output (a graph output of the function)."""
    import onnxruntime as ort

    from onnx_modular.passes.fusions.skip_norm import FuseSkipNormPass

    model = ir.from_onnx_text(SKIP_LN_TEXT)
    before = ir.to_proto(model).SerializeToString()
    plain = FuseSkipNormPass()  # the RMS flavour leaves a LayerNormalization body alone
    plain(model)
    assert plain.fused == []
    fusion = FuseSkipNormPass(layer_norm=True)
    fusion(model)
    body = model.functions[("pkg.test", "Output", "")]
    assert fusion.fused == [("pkg.test", "Output", "")]
    assert [(n.op_type, n.domain) for n in body] == [("SkipLayerNormalization", "com.microsoft")]
    assert body[0].attributes.get_float("epsilon") == pytest.approx(1e-5)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3, 8)).astype(np.float32), "r": rng.standard_normal((2, 3, 8)).astype(np.float32)}
    expected = ort.InferenceSession(before).run(None, feeds)[0]
    got = ort.InferenceSession(ir.to_proto(model).SerializeToString()).run(None, feeds)[0]
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


GELU_TEXT = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[2,3,8] x) => (float[2,3,8] y)
<float root = {1.4142135}, float one = {1.0}, float half = {0.5}, float other = {0.4}>
{
    g = pkg.test.Gelu(x, root, one, half)
    y = pkg.test.Gelu(g, root, one, HALF)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Gelu (input, root, one, half) => (out)
{
    d = Div(input, root)
    e = Erf(d)
    a = Add(e, one)
    m = Mul(half, a)
    out = Mul(input, m)
}
"""


@pytest.mark.parametrize("second", ["half", "other"])
def test_gelu_body_fused_when_its_constants_are_gelus_at_every_call(second):
    """transformers' ``x * (0.5 * (1 + erf(x / sqrt(2))))`` with lifted constants; a call passing
    another factor leaves the body as it is."""
    import onnxruntime as ort

    from onnx_modular.passes.fusions.activation import FuseActivationPass

    model = ir.from_onnx_text(GELU_TEXT.replace("HALF", second))
    before = ir.to_proto(model).SerializeToString()
    fusion = FuseActivationPass()
    fusion(model)
    body = model.functions[("pkg.test", "Gelu", "")]
    if second == "other":
        assert fusion.fused == [] and "Erf" in [n.op_type for n in body]
        return
    assert [(n.op_type, n.domain) for n in body] == [("Gelu", "com.microsoft")]
    assert fusion.ops == {("pkg.test", "Gelu", ""): "com.microsoft.Gelu"}
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    expected = ort.InferenceSession(before).run(None, {"x": x})[0]
    got = ort.InferenceSession(ir.to_proto(model).SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def _model(kind: str):
    import torch
    import transformers

    torch.manual_seed(0)
    if kind == "bert":
        config = transformers.BertConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=64)
        return transformers.BertModel(config).eval()
    if kind == "vit":
        config = transformers.ViTConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                        image_size=32, patch_size=8)
        return transformers.ViTModel(config).eval()
    config = transformers.BartConfig(vocab_size=96, d_model=64, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=96,
                                     decoder_ffn_dim=96, max_position_embeddings=64)
    return transformers.BartModel(config).eval()


def _feeds(kind: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    if kind == "vit":
        return {"pixel_values": rng.standard_normal((2, 3, 32, 32)).astype(np.float32)}
    mask = np.ones((2, 9), np.int64)
    mask[1, 5:] = 0  # a padded row: the mask reaches the op as attention_bias
    return {"input_ids": rng.integers(3, 96, (2, 9)).astype(np.int64), "attention_mask": mask}


#: kind -> (attention function, its class, the bodies with a SkipLayerNormalization, the report's attention)
CASES = {
    "bert": ("BertSelfAttention", "BertLayer", {"BertSelfOutput", "BertOutput", "BertEmbeddings"}, "Attention"),
    "vit": ("ViTAttention", "ViTLayer", {"ViTLayer"}, "Attention"),
    "bart": ("BartAttention", "BartEncoderLayer", {"BartEncoderLayer", "BartDecoderLayer"}, "Attention+MultiHeadAttention"),
}


@pytest.mark.parametrize("kind", ["bert", "vit", pytest.param("bart", marks=pytest.mark.slow)])
def test_encoder_attention_fused_inside_the_bodies(kind, tmp_path, capsys):
    import onnxruntime as ort
    import torch

    from onnx_modular.cli import main

    model = _model(kind)
    model.save_pretrained(tmp_path / "ckpt")
    exported, optimized = tmp_path / "m.onnx", tmp_path / "m.opt.onnx"
    assert main(["export", str(tmp_path / "ckpt"), "-o", str(exported), "--no-verify"]) == 0  # the test checks torch
    capsys.readouterr()
    assert main(["optimize", str(exported), "-o", str(optimized), "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    attention_class, layer_class, skip_bodies, attention_ops = CASES[kind]
    assert report["attention"] == attention_ops
    assert attention_class in report["packed_qkv"]  # self-attention: one GEMM on the packed weights
    mha = [f for f in report["fusions"] if f["step"] == "mha"]
    assert mha and all(f["fused"] and f["calls"] > 0 and f["max_abs_diff"] < 1e-4 for f in mha)
    activation = [f for f in report["fusions"] if f["step"] == "activation"]
    assert [(f["module_class"], f["op"], f["fused"]) for f in activation] == [("GELUActivation", "com.microsoft.Gelu", True)]
    assert {f["function"] for f in report["fusions"] if f["step"] == "skip_layer_norm" and f["fused"]} >= skip_bodies
    assert report["nodes_after"] < report["nodes_before"]

    result = ir.load(optimized)
    bodies = {key[1]: function for key, function in result.functions.items()}
    calls = sum(1 for body in [result.graph, *result.functions.values()] for n in body if n.op_type == layer_class)
    assert calls == 2  # the layer is still one function, called once per layer
    ops = [(n.op_type, n.domain) for n in bodies[attention_class]]
    assert ("Attention", "com.microsoft") in ops and ("Softmax", "") not in ops
    node = next(n for n in bodies[attention_class] if n.op_type == "Attention")
    assert node.attributes.get_int("num_heads") == 4
    packed = node.inputs[1].name  # the packed weights, a formal input fed from one main-graph initializer a layer
    assert packed.endswith("qkv_proj.weight.T") and node.inputs[2] is not None and node.inputs[5] is not None
    assert node.attributes.get_float("scale") == pytest.approx(0.25)  # 1 / sqrt(16)
    for name in skip_bodies:
        assert "SkipLayerNormalization" in [n.op_type for n in bodies[name]]
    assert "Gelu" in [n.op_type for n in bodies["GELUActivation"]]
    if kind == "bart":  # the cross-attention (key and value from the encoder): MultiHeadAttention, not packed
        cross = [f for f in mha if not f["packed_qkv"]]
        assert [(f["op"], f["fused"]) for f in cross] == [("com.microsoft.MultiHeadAttention", True)]

    feeds = _feeds(kind)
    with torch.no_grad():
        expected = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).last_hidden_state.numpy()
    session = ort.InferenceSession(str(optimized), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))["last_hidden_state"]
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-3)
