"""``optimize``: RMS norm, skip norm and GroupQueryAttention fused inside the bodies of a modular
decoder file, each step verified in onnxruntime; greedy tokens equal transformers' ``generate``."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

from onnx_modular.passes.fusions.rms_norm import FuseRMSNormPass

RMS_TEXT = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[2,3,8] x) => (float[2,3,8] y)
<float[8] w = {1,2,3,4,5,6,7,8}, float two = {2.0}, int64[1] axes = {-1}, float eps = {1e-6}>
{
    y = pkg.test.Norm(x, w, two, axes, eps)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Norm (x, weight, two, axes, eps) => (out)
{
    p = Pow(x, two)
    m = ReduceMean<keepdims: int = 1>(p, axes)
    a = Add(m, eps)
    s = Sqrt(a)
    r = Reciprocal(s)
    n = Mul(x, r)
    out = Mul(weight, n)
}
"""


def test_rms_norm_body_fused_with_its_constants_read_through_the_call():
    """The exponent, axis and epsilon are formal inputs (lifted constants): read through the call."""
    import onnxruntime as ort

    model = ir.from_onnx_text(RMS_TEXT)
    before = ir.to_proto(model).SerializeToString()
    fusion = FuseRMSNormPass()
    fusion(model)
    body = model.functions[("pkg.test", "Norm", "")]
    assert [n.op_type for n in body] == ["SimplifiedLayerNormalization"]
    assert body[0].attributes.get_float("epsilon") == pytest.approx(1e-6)
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    expected = ort.InferenceSession(before).run(None, {"x": x})[0]
    got = ort.InferenceSession(ir.to_proto(model).SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_rms_norm_left_when_the_epsilon_differs_between_calls():
    text = RMS_TEXT.replace("y = pkg.test.Norm(x, w, two, axes, eps)",
                            "h = pkg.test.Norm(x, w, two, axes, eps)\n    y = pkg.test.Norm(h, w, two, axes, eps2)")
    text = text.replace("float eps = {1e-6}>", "float eps = {1e-6}, float eps2 = {1e-5}>")
    model = ir.from_onnx_text(text)
    fusion = FuseRMSNormPass()
    fusion(model)
    assert fusion.fused == []
    assert "SimplifiedLayerNormalization" not in [n.op_type for n in model.functions[("pkg.test", "Norm", "")]]


def _checkpoint(kind: str, folder):
    import torch
    import transformers

    torch.manual_seed(0)
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[kind]
    config = config_class(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if kind == "qwen2":  # random biases, so that they count
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(projection.bias, std=0.2)
    model.save_pretrained(folder)
    return model


def _greedy(path, prompt: np.ndarray, steps: int, layers: int, kv_heads: int, head_size: int) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    past = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    cache = {name: np.zeros((prompt.shape[0], kv_heads, 0, head_size), np.float32) for name in past}
    tokens, step = prompt, prompt
    for _ in range(steps):
        length = cache[past[0]].shape[2] + step.shape[1]
        outputs = dict(zip(names, session.run(None, {
            "input_ids": step, "attention_mask": np.ones((prompt.shape[0], length), np.int64), **cache})))
        cache = {name: outputs[name.replace("past_key_values", "present")] for name in past}
        step = outputs["logits"][:, -1:].argmax(-1)
        tokens = np.concatenate([tokens, step], axis=1)
    return tokens


def _calls(model: ir.Model, name: str) -> int:
    return sum(1 for body in [model.graph, *model.functions.values()] for node in body if node.op_type == name
               and node.op_identifier() in model.functions)


@pytest.mark.parametrize("kind", ["llama", "qwen2", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_decoder_fused_inside_the_bodies_and_generates_as_transformers(kind, tmp_path, capsys, monkeypatch):
    import torch

    from onnx_modular.cli import main

    model = _checkpoint(kind, tmp_path / "ckpt")
    exported, optimized = tmp_path / "m.onnx", tmp_path / "m.opt.onnx"
    assert main(["export", str(tmp_path / "ckpt"), "--task", "causal-lm-with-past", "-o", str(exported),
                 "--io-names", "optimum"]) == 0
    capsys.readouterr()
    assert main(["optimize", str(exported), "-o", str(optimized), "--max-positions", "128", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[kind]
    assert set(report["fused_classes"]) == {f"{prefix}RMSNorm", f"{prefix}DecoderLayer", f"{prefix}Attention"}
    assert report["attention"] == "GroupQueryAttention"
    assert report["added_inputs"] == ["cos_cache", "sin_cache", "seqlens_k", "total_sequence_length"]
    assert all(f["max_abs_diff"] < 1e-4 and f["calls"] > 0 for f in report["fusions"])

    result = ir.load(optimized)
    bodies = {key[1]: function for key, function in result.functions.items()}
    assert _calls(result, f"{prefix}DecoderLayer") == 2  # still one function, called once per layer
    attention = bodies[f"{prefix}Attention"]
    gqa = [n for n in attention if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 1 and gqa[0].domain == "com.microsoft"
    assert gqa[0].attributes.get_int("num_heads") == 4 and gqa[0].attributes.get_int("kv_num_heads") == 2
    assert gqa[0].attributes.get_int("do_rotary") == 1
    assert report["packed_qkv"] == [f"{prefix}Attention"]  # q, k, v: one MatMul on weights packed once per layer
    assert [n.op_type for n in attention if n.op_identifier() not in result.functions][:1] == ["MatMul"]
    packed = [name for name in result.graph.initializers if "qkv_proj" in name]
    assert len(packed) == (4 if kind == "qwen2" else 2)  # one weight (and bias) per layer
    calls = [n.op_type for n in attention if n.op_identifier() in result.functions]
    if kind == "qwen3":  # q_norm/k_norm between projections and heads: Split, each norm call on its part's heads
        ops = [n.op_type for n in attention]
        assert calls == ["Qwen3RMSNorm_2", "Qwen3RMSNorm_3", "Linear"]  # the norms and o_proj stay calls
        assert ops.index("Split") < ops.index("Qwen3RMSNorm_2") < ops.index("GroupQueryAttention")
        assert "Transpose" not in ops and ops.count("Reshape") == 4  # to [batch, seq, heads, head] and back, q and k
        assert [n.op_type for n in bodies["Qwen3RMSNorm_2"]] == ["SimplifiedLayerNormalization"]
    else:
        assert len(calls) == 1  # o_proj stays a call
    assert [n.op_type for n in bodies[f"{prefix}RMSNorm"]] == ["SimplifiedLayerNormalization"]  # the layers' norm
    assert "SkipSimplifiedLayerNormalization" in [n.op_type for n in bodies[f"{prefix}DecoderLayer"]]
    assert [v.name for v in result.graph.inputs] == [v.name for v in ir.load(exported).graph.inputs]

    prompt = np.array([[5, 17, 33, 2], [9, 41, 7, 63]])
    with torch.no_grad():
        expected = model.generate(torch.tensor(prompt), do_sample=False, max_new_tokens=6, min_new_tokens=6,
                                  eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(_greedy(optimized, prompt, 6, 2, 2, 16), expected.numpy())
    if kind == "qwen3":  # and the unfused file's tokens, through the project's own loop
        import onnx_modular

        np.testing.assert_array_equal(onnx_modular.generate(exported, prompt, max_new_tokens=6), expected.numpy())
    if kind == "llama":  # weights in external data are read beside the file, whatever the working folder
        import onnx

        from onnx_modular import optimize

        other = tmp_path / "elsewhere"
        other.mkdir()
        onnx.save(onnx.load(str(exported)), str(other / "e.onnx"), save_as_external_data=True, location="e.onnx.data",
                  size_threshold=0)
        monkeypatch.chdir(tmp_path)
        again = optimize(other / "e.onnx", other / "e.opt.onnx", max_positions=128, verify=False)
        assert again.attention == "GroupQueryAttention"


def test_file_without_functions_refused(tmp_path):
    from onnx_modular.errors import InvalidInputError
    from onnx_modular.files.optimize.tool import optimize

    flat = ir.from_onnx_text("""
<ir_version: 10, opset_import: ["" : 18]>
main (float[2] x) => (float[2] y) { y = Relu(x) }
""")
    ir.save(flat, tmp_path / "flat.onnx")
    with pytest.raises(InvalidInputError, match="no local functions"):
        optimize(tmp_path / "flat.onnx", tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_residual_add_and_fused_norm_call_become_one_skip_norm():
    """After the RMS norm step, ``Add`` + a call of the lone-norm body: one SkipSimplifiedLayerNormalization
    whose fourth output (the sum) keeps feeding the residual."""
    import onnxruntime as ort

    from onnx_modular.passes.fusions.skip_norm import FuseSkipNormPass

    text = RMS_TEXT.replace("main (float[2,3,8] x) => (float[2,3,8] y)", "main (float[2,3,8] x, float[2,3,8] r) => (float[2,3,8] y)")
    text = text.replace("y = pkg.test.Norm(x, w, two, axes, eps)",
                        "s = pkg.test.Layer(x, r, w, two, axes, eps)\n    y = Identity(s)")
    text += """
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Layer (x, r, weight, two, axes, eps) => (out)
{
    h = Add(x, r)
    n = pkg.test.Norm(h, weight, two, axes, eps)
    out = Add(h, n)
}
"""
    model = ir.from_onnx_text(text)
    before = ir.to_proto(model).SerializeToString()
    FuseRMSNormPass()(model)
    fusion = FuseSkipNormPass()
    fusion(model)
    layer = model.functions[("pkg.test", "Layer", "")]
    assert fusion.fused == [("pkg.test", "Layer", "")]
    assert [n.op_type for n in layer] == ["SkipSimplifiedLayerNormalization", "Add"]
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3, 8)).astype(np.float32), "r": rng.standard_normal((2, 3, 8)).astype(np.float32)}
    expected = ort.InferenceSession(before).run(None, feeds)[0]
    got = ort.InferenceSession(ir.to_proto(model).SerializeToString()).run(None, feeds)[0]
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def _windowed_checkpoint(kind: str, folder):
    import torch
    import transformers

    torch.manual_seed(0)
    sizes = dict(vocab_size=96, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=64)
    if kind == "gemma2":  # soft-capped scores, layers alternating a window of 4 and full attention
        config = transformers.Gemma2Config(**sizes, hidden_size=64, head_dim=16, sliding_window=4,
                                           attn_logit_softcapping=5.0, final_logit_softcapping=None)
    elif kind == "olmo3":  # a window of 4 on layer 0; each layer type its own rotary module call
        config = transformers.Olmo3Config(**sizes, hidden_size=64, head_dim=16, sliding_window=4,
                                          layer_types=["sliding_attention", "full_attention"])
    elif kind == "granitemoe_swa":  # attention sinks; layer 1 a window of 4
        config = transformers.GraniteMoeSWAConfig(**sizes, hidden_size=64, num_local_experts=2, num_experts_per_tok=1,
                                                  sliding_window=4, layer_types=["full_attention", "sliding_attention"])
    else:  # phi: rotary over the first 16 channels of heads of 32
        config = transformers.PhiConfig(**sizes, hidden_size=128, partial_rotary_factor=0.5)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    for name, parameter in model.named_parameters():
        if name.endswith("sinks"):  # random sink logits, so that they count
            torch.nn.init.normal_(parameter, std=1.0)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("kind", ["gemma2", pytest.param("olmo3", marks=pytest.mark.slow), "phi",
                                  pytest.param("granitemoe_swa", marks=pytest.mark.slow)])
def test_sliding_window_softcap_and_partial_rotary_fused(kind, tmp_path):
    """The window becomes ``local_window_size`` (bodies split per window: the decoder layer stays a
    function, one per kind of layer), Gemma 2's cap ``softcap``, Phi's partial rotary narrower
    cos/sin caches; each call checked, and greedy tokens past the window equal ``generate``."""
    import torch

    import onnx_modular
    from onnx_modular.hf.genai import export_genai

    model = _windowed_checkpoint(kind, tmp_path / "ckpt")
    export_genai(tmp_path / "ckpt", tmp_path / "genai", verify=False, check=False)
    report = onnx_modular.optimize(tmp_path / "genai" / "model.onnx", tmp_path / "opt.onnx", max_positions=64)
    assert report.attention == "GroupQueryAttention"
    attention = [f for f in report.fusions if f.step == "attention"]
    assert attention and all(f.fused and f.max_abs_diff < 1e-4 and f.calls > 0 for f in attention)

    result = ir.load(tmp_path / "opt.onnx")
    gqa = {key[1]: node for key, function in result.functions.items() for node in function
           if node.op_type == "GroupQueryAttention"}
    prefix = {"gemma2": "Gemma2", "olmo3": "Olmo3", "phi": "Phi", "granitemoe_swa": "GraniteMoeSWA"}[kind]
    if kind == "granitemoe_swa":  # the sink logits: the op's head_sink input; layer 0 full, layer 1 windowed
        assert {name: n.attributes.get_int("local_window_size") for name, n in gqa.items()} == {
            f"{prefix}Attention": -1, f"{prefix}Attention_window4": 4}
        assert all(len(n.inputs) == 12 and n.inputs[11] is not None for n in gqa.values())
    elif kind == "phi":
        assert list(gqa) == ["PhiAttention"] and gqa["PhiAttention"].attributes.get_int("do_rotary") == 1
    else:
        assert sorted(n.attributes.get_int("local_window_size") for n in gqa.values()) == [-1, 4]
        assert sorted(gqa) == [f"{prefix}Attention", f"{prefix}Attention_full"]
        layers = [key[1] for key in result.functions if key[1].startswith(f"{prefix}DecoderLayer")]
        assert sorted(layers) == [f"{prefix}DecoderLayer", f"{prefix}DecoderLayer_full"]
        assert all(_calls(result, name) == 1 for name in layers)
    softcaps = {n.attributes.get_float("softcap") for n in gqa.values()}
    assert softcaps == ({5.0} if kind == "gemma2" else {0.0})

    prompt = [5, 17, 33, 2, 9, 41, 7]  # longer than the window of 4
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6, min_new_tokens=6,
                                  eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(onnx_modular.generate(tmp_path / "opt.onnx", [prompt], 6), expected.numpy())


@pytest.mark.slow
def test_olmo2_norms_before_the_view_run_on_the_packed_projections_parts(tmp_path):
    """Olmo2 normalizes the whole q and k projections before viewing them as heads: packed Q/K/V,
    ``Split``, each norm call on its part, no view back; tokens equal transformers' ``generate``."""
    import torch
    import transformers

    import onnx_modular
    from onnx_modular.cli import main

    torch.manual_seed(0)
    config = transformers.Olmo2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      eos_token_id=None, pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / "ckpt")
    exported, optimized = tmp_path / "m.onnx", tmp_path / "m.opt.onnx"
    assert main(["export", str(tmp_path / "ckpt"), "--task", "causal-lm-with-past", "-o", str(exported),
                 "--io-names", "optimum", "--no-verify"]) == 0
    report = onnx_modular.optimize(exported, optimized, max_positions=128)
    assert report.packed_qkv == ["Olmo2Attention"]
    result = ir.load(optimized)
    attention = next(f for key, f in result.functions.items() if key[1] == "Olmo2Attention")
    ops = [n.op_type for n in attention]
    norms = [i for i, n in enumerate(attention) if n.op_identifier() in result.functions and "RMSNorm" in n.op_type]
    assert len(norms) == 2 and ops.index("Split") < min(norms) and max(norms) < ops.index("GroupQueryAttention")
    assert "Transpose" not in ops and "Reshape" not in ops  # the norms read the split parts as they are
    prompt = np.array([[5, 17, 33, 2], [9, 41, 7, 63]])
    with torch.no_grad():
        expected = model.generate(torch.tensor(prompt), do_sample=False, max_new_tokens=6, min_new_tokens=6,
                                  eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(_greedy(optimized, prompt, 6, 2, 2, 16), expected.numpy())
