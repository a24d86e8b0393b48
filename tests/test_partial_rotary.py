"""``optimize`` on a partial rotary whose cos/sin caches onnxruntime's GroupQueryAttention refuses on CPU
(width = rotary channels / 2 not a multiple of 8): the query and the key go through
``com.microsoft.RotaryEmbedding`` (``rotary_embedding_dim``, the rotary module's own caches and position
ids), then ``GroupQueryAttention`` without ``do_rotary``; greedy tokens equal transformers' ``generate``.
A partial rotary GroupQueryAttention takes (Phi's 0.4 of a head of 80: 16-wide caches) stays inside the op."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import export_and_optimize

from onnx_modular import generate
from onnx_modular.passes.fusions.rotary import needs_rotary_op


class _Shape:
    def __init__(self, head_size, rotary_dim, cos=True):
        self.head_size, self.rotary_dim, self.cos = head_size, rotary_dim, (object() if cos else None)


@pytest.mark.parametrize(("head", "rotary", "separate"), [
    (80, 32, False),  # Phi-2: 16-wide caches, inside GroupQueryAttention
    (128, 64, False),  # Nemotron-4 (0.5 of 128)
    (80, 40, True),  # 20-wide: refused by the op's kernel, RotaryEmbedding nodes
    (32, 8, True),
    (64, 64, False),  # the whole head: any width
])
def test_which_partial_rotaries_go_in_rotary_embedding_nodes(head, rotary, separate):
    assert needs_rotary_op(_Shape(head, rotary)) is separate
    assert needs_rotary_op(_Shape(head, rotary, cos=False)) is False  # no rotary at all


@pytest.mark.parametrize("kind", ["phi", pytest.param("nemotron", marks=pytest.mark.slow)])
def test_a_narrow_partial_rotary_is_fused_with_rotary_embedding_nodes(kind, tmp_path, capsys):
    import torch
    import transformers

    torch.manual_seed(0)
    common = {"vocab_size": 96, "intermediate_size": 96, "num_hidden_layers": 2, "max_position_embeddings": 128}
    if kind == "phi":  # heads of 32, rotary over 8 channels: 4-wide caches
        config = transformers.PhiConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                                        partial_rotary_factor=0.25, **common)
        heads, kv_heads, rotary = 2, 2, 8
    else:  # heads of 80, rotary over 40 channels: 20-wide caches
        config = transformers.NemotronConfig(hidden_size=160, num_attention_heads=2, num_key_value_heads=1,
                                             partial_rotary_factor=0.5, **common)
        heads, kv_heads, rotary = 2, 1, 40
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    exported, optimized, report = export_and_optimize(model, tmp_path, capsys)
    assert report["attention"] == "GroupQueryAttention"
    attention_class = f"{'Phi' if kind == 'phi' else 'Nemotron'}Attention"
    fused = [f for f in report["fusions"] if f["module_class"] == attention_class]
    assert len(fused) == 1 and fused[0]["fused"] and fused[0]["max_abs_diff"] < 1e-4
    assert "rotary_position_ids" in report["added_inputs"]

    written = onnx.load(str(optimized), load_external_data=False)
    body = next(f for f in written.functions if f.name == attention_class)
    rotaries = [n for n in body.node if n.op_type == "RotaryEmbedding"]
    assert [n.domain for n in rotaries] == ["com.microsoft"] * 2
    attributes = [{a.name: a.i for a in n.attribute} for n in rotaries]
    assert attributes == [{"num_heads": heads, "rotary_embedding_dim": rotary, "interleaved": 0},
                          {"num_heads": kv_heads, "rotary_embedding_dim": rotary, "interleaved": 0}]
    gqa = next(n for n in body.node if n.op_type == "GroupQueryAttention")
    assert {a.name: a.i for a in gqa.attribute}["do_rotary"] == 0
    assert [i for i in gqa.input[7:9] if i] == []  # no cos/sin caches inside the op
    assert list(gqa.input[:2]) == [r.output[0] for r in rotaries]

    prompt = np.array([[5, 17, 33, 2, 61, 8]])
    with torch.no_grad():
        expected = model.generate(torch.tensor(prompt), do_sample=False, max_new_tokens=8, min_new_tokens=8,
                                  eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(generate(optimized, prompt, 8), expected.numpy())
