"""``optimize`` on encoders: attention bodies without a cache into ``MultiHeadAttention`` (self- and
cross-attention), residual add + ``LayerNorm`` into ``SkipLayerNormalization``, inside the bodies;
the calls stay functions and the optimized file computes what torch computes."""

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

    from onnx_modular.passes.fuse_skip_norm import FuseSkipNormPass

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


#: kind -> (attention function, its class, the bodies with a SkipLayerNormalization)
CASES = {
    "bert": ("BertSelfAttention", "BertLayer", {"BertSelfOutput", "BertOutput", "BertEmbeddings"}),
    "vit": ("ViTAttention", "ViTLayer", {"ViTLayer"}),
    "bart": ("BartAttention", "BartEncoderLayer", {"BartEncoderLayer", "BartDecoderLayer"}),
}


@pytest.mark.parametrize("kind", ["bert", "vit", pytest.param("bart", marks=pytest.mark.slow)])
def test_encoder_attention_fused_into_multi_head_attention(kind, tmp_path, capsys):
    import onnxruntime as ort
    import torch

    from onnx_modular.cli import main

    model = _model(kind)
    model.save_pretrained(tmp_path / "ckpt")
    exported, optimized = tmp_path / "m.onnx", tmp_path / "m.opt.onnx"
    assert main(["export", str(tmp_path / "ckpt"), "-o", str(exported)]) == 0
    capsys.readouterr()
    assert main(["optimize", str(exported), "-o", str(optimized), "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    attention_class, layer_class, skip_bodies = CASES[kind]
    assert report["attention"] == "MultiHeadAttention"
    assert attention_class in report["packed_qkv"]  # self-attention: one MatMul on the packed weights
    mha = [f for f in report["fusions"] if f["step"] == "mha"]
    assert mha and all(f["fused"] and f["calls"] > 0 and f["max_abs_diff"] < 1e-4 for f in mha)
    assert {f["function"] for f in report["fusions"] if f["step"] == "skip_layer_norm" and f["fused"]} >= skip_bodies
    assert report["nodes_after"] < report["nodes_before"]

    result = ir.load(optimized)
    bodies = {key[1]: function for key, function in result.functions.items()}
    calls = sum(1 for body in [result.graph, *result.functions.values()] for n in body if n.op_type == layer_class)
    assert calls == 2  # the layer is still one function, called once per layer
    ops = [(n.op_type, n.domain) for n in bodies[attention_class]]
    assert ("MultiHeadAttention", "com.microsoft") in ops and ("Softmax", "") not in ops
    node = next(n for n in bodies[attention_class] if n.op_type == "MultiHeadAttention")
    assert node.attributes.get_int("num_heads") == 4
    assert node.attributes.get_float("scale") == pytest.approx(0.25)  # 1 / sqrt(16)
    for name in skip_bodies:
        assert "SkipLayerNormalization" in [n.op_type for n in bodies[name]]
    if kind == "bart":  # the cross-attention (key and value from the encoder): fused, not packed
        assert sum(1 for f in mha if f["fused"] and not f["packed_qkv"]) == 1

    feeds = _feeds(kind)
    with torch.no_grad():
        expected = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).last_hidden_state.numpy()
    session = ort.InferenceSession(str(optimized), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))["last_hidden_state"]
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-3)
