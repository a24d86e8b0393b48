"""``optimize`` on a query multiplied after its rotary by one number a position (Ministral 3's Llama-4
attention scale, ``1 + beta * log(1 + floor(pos / original_max))``): the factor is applied to the query
before ``GroupQueryAttention`` (it commutes with the rotation), not dropped. The tiny config's
``original_max_position_embeddings`` of 4 makes the factor differ from 1 from the fifth position on, so
the check and the greedy tokens see it (with the real 16,384 a short check could not)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from onnx_modular import generate


def test_a_position_scaled_query_is_scaled_before_the_fused_attention(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from onnx_modular.cli import main

    torch.manual_seed(0)
    config = transformers.Ministral3Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.5,
                         "original_max_position_embeddings": 4})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / "ckpt")
    exported, optimized = tmp_path / "m.onnx", tmp_path / "m.opt.onnx"
    assert main(["export", str(tmp_path / "ckpt"), "--task", "causal-lm-with-past", "-o", str(exported),
                 "--io-names", "optimum", "--no-verify"]) == 0
    capsys.readouterr()
    assert main(["optimize", str(exported), "-o", str(optimized), "--max-positions", "128", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["attention"] == "GroupQueryAttention", report
    fused = [f for f in report["fusions"] if f["module_class"] == "Ministral3Attention"]
    assert len(fused) == 1 and fused[0]["fused"] and fused[0]["max_abs_diff"] < 1e-4

    body = next(f for f in onnx.load(str(optimized), load_external_data=False).functions if f.name == "Ministral3Attention")
    ops = [n.op_type for n in body.node]
    assert ops.count("GroupQueryAttention") == 1 and "Softmax" not in ops
    scaled = [n for n in body.node if n.name == "gqa.query_scaled"]
    gqa = next(n for n in body.node if n.op_type == "GroupQueryAttention")
    assert len(scaled) == 1 and gqa.input[0] in {o for n in body.node for o in n.output if n.name == "gqa.qkv_scaled"} | {scaled[0].output[0]}

    prompt = np.array([[5, 17, 33, 2, 61, 8]])
    with torch.no_grad():
        expected = model.generate(torch.tensor(prompt), do_sample=False, max_new_tokens=10, min_new_tokens=10,
                                  eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(generate(optimized, prompt, 10), expected.numpy())
