"""``optimize`` on a query multiplied after its rotary by one number a position (Ministral 3's Llama-4
attention scale, ``1 + beta * log(1 + floor(pos / original_max))``): the factor is applied to the query
before ``GroupQueryAttention`` (it commutes with the rotation), not dropped. The tiny config's
``original_max_position_embeddings`` of 4 makes the factor differ from 1 from the fifth position on, so
the check and the greedy tokens see it (with the real 16,384 a short check could not)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import export_and_optimize

from onnx_modular import generate


def test_a_position_scaled_query_is_scaled_before_the_fused_attention(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Ministral3Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.5,
                         "original_max_position_embeddings": 4})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    exported, optimized, report = export_and_optimize(model, tmp_path, capsys)
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
