"""Every formal input and output of a module function is named from forward().

Parameters by their names, a lone returned tensor ``output``, tuple items ``output_0``, ...,
mapping (ModelOutput) items by key; what cannot be bound is ``unbound_*`` / ``size_*`` and
explained in the doc string. The honest check: no formal name is an FX node name of the
exported program. The zoo (tests/test_zoo.py) runs the same check on its models.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import (
    functions_by_name,
    torch_value_names_in_signatures,
    without_lifted_constants,
)

from onnx_modular import export_modular


def _ids(batch: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, 100, (batch, seq))


def _qwen2():
    import transformers as T

    config = T.Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return T.Qwen2Model(config), (_ids(),), {}


def _bart():
    import transformers as T

    config = T.BartConfig(vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                          max_position_embeddings=64, use_cache=False)
    return T.BartModel(config), (), {"input_ids": _ids(), "decoder_input_ids": _ids(2, 5)}


def _gpt_neox():
    import transformers as T

    config = T.GPTNeoXConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, use_cache=False)
    return T.GPTNeoXModel(config), (_ids(),), {}


def _clip():
    import transformers as T

    config = T.CLIPConfig(
        text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, max_position_embeddings=16, bos_token_id=0, eos_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           image_size=32, patch_size=8),
        projection_dim=16,
    )
    return T.CLIPModel(config), (), {"input_ids": _ids(), "pixel_values": torch.randn(2, 3, 32, 32)}


def _gpt2_with_cache():
    import transformers as T

    config = T.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=32, use_cache=True,
                          bos_token_id=0, eos_token_id=0)
    return T.GPT2Model(config), (_ids(),), {}


MODELS = {"qwen2": _qwen2, "bart": _bart, "gpt_neox": _gpt_neox, "clip": _clip, "gpt2_cache": _gpt2_with_cache}
DEFAULT = {"qwen2"}


@functools.cache  # one export per model for this file's tests
def _export(name: str):
    torch.manual_seed(0)
    model, args, kwargs = MODELS[name]()
    return export_modular(model.eval(), args, kwargs=kwargs, verify=False)


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=[] if name in DEFAULT else [pytest.mark.slow]) for name in MODELS]
)
def test_no_torch_value_name_in_any_signature(name):
    result = _export(name)
    assert torch_value_names_in_signatures(result) == []


def test_qwen2_signatures_read_like_forward():
    result = _export("qwen2")
    functions = functions_by_name(result.model)
    layer = functions["Qwen2DecoderLayer"]
    inputs = [value.name for value in layer.inputs]
    # forward(hidden_states, attention_mask=None, position_ids=None, ..., position_embeddings=(cos, sin))
    assert inputs[:3] == ["hidden_states", "position_embeddings_0", "position_embeddings_1"]
    # The causal mask: forward() got None in eager mode, torch.export materialised it. Not guessed.
    # The shapes are static, so the mask depends on constants only: the weight fold stores it
    # precomputed and the input says so (`.folded`).
    assert inputs[3] == "unbound_input_0.folded"
    assert "unbound_input_0: not a tensor that forward() received" in layer.doc_string
    assert "None for attention_mask" in layer.doc_string
    assert "input_layernorm.weight" in inputs
    assert [value.name for value in layer.outputs] == ["output"]
    rotary = functions["Qwen2RotaryEmbedding"]
    assert [value.name for value in rotary.outputs] == ["output_0", "output_1"]  # (cos, sin)
    assert [value.name for value in functions["Qwen2MLP"].inputs][0] == "x"  # Qwen2MLP.forward(self, x)
    attention = functions["Qwen2Attention"]
    assert [value.name for value in attention.outputs] == ["output_0"]  # (attn_output, attn_weights=None)


@pytest.mark.slow
def test_kv_cache_writes_are_unbound_outputs_explained():
    result = _export("gpt2_cache")
    attention = functions_by_name(result.model)["GPT2Attention"]
    outputs = [value.name for value in attention.outputs]
    assert outputs == ["output_0", "unbound_output_0", "unbound_output_1"]  # the cache update, a side effect
    assert "unbound_output_0: computed in this call and read outside it, but not returned" in attention.doc_string


class _Pair(torch.nn.Module):
    def forward(self, x, y):
        return {"sum": y + x, "diff": y - x}  # equal shapes: only values tell x and y apart


class _Two(torch.nn.Module):
    def forward(self, h):
        return h * 2, h.sum(-1)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.pair = _Pair()
        self.two = _Two()

    def forward(self, x, y):
        d = self.pair(x, y)
        a, b = self.two(d["sum"])
        return a + d["diff"], b


def test_dict_and_tuple_returns_and_equal_shaped_parameters():
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    result = export_modular(_Model().eval(), (x, y))  # parity asserted inside
    functions = functions_by_name(result.model)
    pair, two = functions["_Pair"], functions["_Two"]
    assert [v.name for v in without_lifted_constants(pair.inputs)] == ["x", "y"]
    assert [v.name for v in pair.outputs] == ["sum", "diff"]
    assert [v.name for v in without_lifted_constants(two.inputs)] == ["h"]
    assert [v.name for v in two.outputs] == ["output_0", "output_1"]
    call = next(node for node in result.model.graph if node.op_type == "_Pair")
    assert [v.name for v in without_lifted_constants(call.inputs)] == ["x", "y"]  # bound to the right graph inputs
    assert torch_value_names_in_signatures(result) == []
    assert "names not from forward()" not in (pair.doc_string + two.doc_string)


def test_equal_shaped_outputs_are_told_apart_block_by_block(monkeypatch):
    """Values are compared in bounded blocks, views of the leading axes: SAM 3's vision features
    (2x256x288x288) ran a 6 GB child out of memory when each was widened to float64 whole."""
    import numpy as np

    from onnx_modular.passes.export import signatures

    monkeypatch.setattr(signatures, "_CHUNK", 6)
    a = np.random.default_rng(0).standard_normal((3, 5, 6)).astype(np.float32)
    strided = np.asfortranarray(a)  # the same values, not C-contiguous: blocks are views, not copies
    assert len(list(signatures._blocks(a.shape))) == 15 and signatures._allclose(a, strided)
    changed = strided.copy()
    changed[2, 4, 5] += 1e-3  # only the last block differs
    assert not signatures._allclose(a, changed)
    result = export_modular(_Model().eval(), (torch.randn(2, 3), torch.randn(2, 3)))
    pair = functions_by_name(result.model)["_Pair"]
    assert [v.name for v in pair.outputs] == ["sum", "diff"]


class _Scores(torch.nn.Module):
    def forward(self, x, y):
        scores = (x @ y.transpose(-1, -2)).softmax(-1)  # inside the module only
        return scores @ y, scores @ x


class _Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attend = _Scores()

    def forward(self, x, y):
        a, b = self.attend(x, y)
        c, d = self.attend(a, b)
        return c + d


def test_the_reference_run_records_only_values_that_cross_a_module():
    # match_by_value's reference run kept every value of the program: SegGpt's attentions held
    # 10 GB of them (issue 51's sweep). Only a call's inputs and outputs can be asked for
    from onnx_modular.capture import reference_run

    x, y = torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    program = torch.export.export(_Twice().eval(), (x, y)).run_decompositions()
    values = reference_run.program_values(program, (x, y), {})
    nodes = list(program.graph.nodes)
    softmax = [n.name for n in nodes if n.target == torch.ops.aten._softmax.default]
    assert len(softmax) == 2 and not set(softmax) & set(values)  # the scores stay inside: not recorded
    stack = {n.name: list(n.meta.get("nn_module_stack", {})) for n in nodes}
    handed = [n for n in nodes if stack[n.name][-1:] == ["L__self__attend"] and any(stack[u.name][-1:] == ["L__self__attend@1"] for u in n.users)]
    assert len(handed) == 2 and all(n.name in values for n in handed)  # the first call's outputs, the second's inputs
    result = export_modular(_Twice().eval(), (x, y))  # equal-shaped inputs and outputs, told apart by value
    attend = functions_by_name(result.model)["_Scores"]
    assert [v.name for v in without_lifted_constants(attend.inputs)] == ["x", "y"]
    first, second = [n for n in result.model.graph if n.op_type == "_Scores"]
    assert list(without_lifted_constants(second.inputs)) == list(first.outputs)  # a -> x, b -> y
