"""Causal LMs that had no with-cache export in the catalogue's sweep (issue 66): a BERT-family decoder
(``is_decoder=True``: its self-attention returns the merged heads, projected by its caller's
``BertSelfOutput``) exported with past, fused into ``GroupQueryAttention`` and decoding as transformers'
``generate``; GPT-Neo, whose position table bounds the sequence and the past (torch's suggested fixes
applied beside the mask's ``past_sequence_length + sequence_length`` axis). Numerics: the export's own
parity check (float32, atol 1e-4 / rtol 1e-3), each fusion's check (``max_abs_diff`` < 1e-4), and greedy
tokens equal to ``generate``'s."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from onnx_modular import generate
from onnx_modular.cli import main

transformers = pytest.importorskip("transformers")

PROMPT = np.array([[5, 17, 33, 2, 61, 8]])


def _expected(model, new_tokens: int) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model.generate(torch.tensor(PROMPT), do_sample=False, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0).numpy()


def _export(model, tmp_path) -> tuple:
    """``export --task causal-lm-with-past --io-names optimum`` (parity checked) of ``model`` saved to a folder."""
    model.save_pretrained(tmp_path / "ckpt")
    exported = tmp_path / "m.onnx"
    assert main(["export", str(tmp_path / "ckpt"), "--task", "causal-lm-with-past", "-o", str(exported),
                 "--io-names", "optimum"]) == 0
    graph = onnx.load(str(exported), load_external_data=False).graph
    return exported, [i.name for i in graph.input], [o.name for o in graph.output]


def _cache_names(layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{n}.{kind}" for n in range(layers) for kind in ("key", "value")]
    return past, [name.replace("past_key_values", "present") for name in past]


@pytest.mark.slow  # about a minute: export, optimize (each fusion checked), generate
def test_a_bert_decoder_exports_with_past_fuses_and_decodes_as_generate(tmp_path, capsys):
    import torch

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=96, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                     num_hidden_layers=2, max_position_embeddings=64, is_decoder=True)
    model = transformers.BertLMHeadModel(config).eval()
    exported, inputs, outputs = _export(model, tmp_path)
    past, present = _cache_names(2)
    assert inputs[:2] == ["input_ids", "attention_mask"] and set(past) <= set(inputs)
    assert outputs == ["logits", *present]
    capsys.readouterr()

    optimized = tmp_path / "m.opt.onnx"
    assert main(["optimize", str(exported), "-o", str(optimized), "--max-positions", "64", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["attention"] == "GroupQueryAttention"
    fused = [f for f in report["fusions"] if f["module_class"] == "BertSelfAttention"]
    assert len(fused) == 1 and fused[0]["fused"] and fused[0]["max_abs_diff"] < 1e-4
    body = next(f for f in onnx.load(str(optimized), load_external_data=False).functions if f.name == "BertSelfAttention")
    gqa = next(n for n in body.node if n.op_type == "GroupQueryAttention")
    assert body.output[0] == gqa.output[0]  # the merged heads are the op's output: the caller projects them
    assert not [n for n in body.node if n.op_type == "Softmax"]
    np.testing.assert_array_equal(generate(optimized, PROMPT, 6), _expected(model, 6))


def test_a_bert_decoder_without_is_decoder_is_refused_as_an_encoder(tmp_path, capsys):
    config = transformers.BertConfig(vocab_size=96, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                     num_hidden_layers=1, max_position_embeddings=64)
    transformers.BertLMHeadModel(config).eval().save_pretrained(tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), "--task", "causal-lm-with-past", "-o", str(tmp_path / "m.onnx")]) != 0
    assert "is_decoder=false, so it runs as an encoder" in capsys.readouterr().err


@pytest.mark.slow  # about 45 s: three capture strategies before the suggested fixes
def test_gpt_neo_exports_with_past_over_its_bounded_positions(tmp_path):
    import torch

    torch.manual_seed(0)
    config = transformers.GPTNeoConfig(vocab_size=96, hidden_size=32, num_heads=2, num_layers=2,
                                       attention_types=[[["global", "local"], 1]], window_size=4,
                                       max_position_embeddings=64)
    model = transformers.GPTNeoForCausalLM(config).eval()
    exported, inputs, outputs = _export(model, tmp_path)
    past, present = _cache_names(2)
    assert set(past) <= set(inputs) and outputs == ["logits", *present]
    graph = onnx.load(str(exported), load_external_data=False).graph
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert dims["input_ids"] == ["batch_size", "sequence_length"]
    assert dims["past_key_values.0.key"][2] == "past_sequence_length"
    # 6 prompt tokens and 8 more: past the local layer's window of 4
    np.testing.assert_array_equal(generate(exported, PROMPT, 8), _expected(model, 8))


@pytest.mark.slow  # about 45 s: export, optimize (each fusion checked), generate
def test_a_convolution_layers_state_is_a_cache_input_and_output_fed_back(tmp_path, capsys):
    """LFM2-MoE's short convolution keeps its last inputs in transformers' cache (a ``LinearAttentionLayer``'s
    ``conv_states``, ``[batch, hidden, kernel]``): with past it is one more cache input and output
    (``past_key_values.0.conv_states.0``, ``present.0.conv_states.0``, only its batch dynamic), zeros at the
    prompt, fed back each step by ``generate``; ``optimize`` checks its fusions on those steps."""
    import torch

    torch.manual_seed(0)
    config = transformers.Lfm2MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, conv_L_cache=3,
                                        num_dense_layers=2, layer_types=["conv", "full_attention"], max_position_embeddings=64)
    model = transformers.Lfm2MoeForCausalLM(config).eval()
    exported, inputs, outputs = _export(model, tmp_path)
    assert inputs[2:] == ["past_key_values.0.conv_states.0", "past_key_values.1.key", "past_key_values.1.value"]
    assert outputs == ["logits", "present.0.conv_states.0", "present.1.key", "present.1.value"]
    graph = onnx.load(str(exported), load_external_data=False).graph
    state = next(i for i in graph.input if i.name == "past_key_values.0.conv_states.0")
    assert [d.dim_param or d.dim_value for d in state.type.tensor_type.shape.dim] == ["batch_size", 32, 3]
    expected = _expected(model, 8)
    np.testing.assert_array_equal(generate(exported, PROMPT, 8), expected)
    capsys.readouterr()

    optimized = tmp_path / "m.opt.onnx"
    assert main(["optimize", str(exported), "-o", str(optimized), "--max-positions", "64", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["attention"] == "GroupQueryAttention"
    np.testing.assert_array_equal(generate(optimized, PROMPT, 8), expected)


@pytest.mark.slow  # about 40 s: export, optimize (each fusion checked), generate
def test_a_sliding_window_keeps_its_whole_past_and_fuses_with_its_window(tmp_path, capsys):
    """transformers' sliding-window cache is a rolling buffer (the last window's keys, a 0-d window size
    beside them); ``export --task causal-lm-with-past`` keeps every position's keys and values instead, as
    ``export --genai`` does, and the graph masks the window: no ``_sliding_window_tensor`` input, tokens equal
    to ``generate`` well past the window of 4, and ``optimize`` fuses it with ``local_window_size`` 4."""
    import torch

    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        max_position_embeddings=64, sliding_window=4)
    model = transformers.MistralForCausalLM(config).eval()
    exported, inputs, outputs = _export(model, tmp_path)
    past, present = _cache_names(2)
    assert inputs == ["input_ids", "attention_mask", *past] and outputs == ["logits", *present]
    expected = _expected(model, 10)
    np.testing.assert_array_equal(generate(exported, PROMPT, 10), expected)
    capsys.readouterr()

    optimized = tmp_path / "m.opt.onnx"
    assert main(["optimize", str(exported), "-o", str(optimized), "--max-positions", "64", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["attention"] == "GroupQueryAttention"
    body = next(f for f in onnx.load(str(optimized), load_external_data=False).functions if f.name == "MistralAttention")
    gqa = next(n for n in body.node if n.op_type == "GroupQueryAttention")
    assert {a.name: a.i for a in gqa.attribute}["local_window_size"] == 4
    np.testing.assert_array_equal(generate(optimized, PROMPT, 10), expected)


def test_a_text_models_checkpoint_is_built_by_the_class_its_architectures_name():
    """AutoModelForCausalLM maps Emu3ForCausalLM and MllamaForCausalLM under the composite ``emu3`` and
    ``mllama`` types, though each is built from its text config (what a checkpoint of the text model
    alone holds): the class ``architectures`` names is taken when it is the task's and built from that
    config; a class of another task, or another config's, is not."""
    from onnx_modular.hf.checkpoint import supported_tasks

    emu3 = transformers.Emu3TextConfig(architectures=["Emu3ForCausalLM"])
    assert supported_tasks(emu3).get("causal-lm-with-past") == "Emu3ForCausalLM"
    assert "causal-lm-with-past" not in supported_tasks(transformers.Emu3TextConfig())  # no name: no guess
    other = transformers.Emu3TextConfig(architectures=["MllamaForCausalLM"])  # built from another config
    assert "causal-lm-with-past" not in supported_tasks(other)


@pytest.mark.slow  # about 30 s
def test_mllamas_text_model_exports_with_past_and_decodes_as_generate(tmp_path):
    import torch

    torch.manual_seed(0)
    config = transformers.MllamaTextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, cross_attention_layers=[], pad_token_id=0,
                                           max_position_embeddings=64, architectures=["MllamaForCausalLM"])
    model = transformers.MllamaForCausalLM(config).eval()
    exported, inputs, outputs = _export(model, tmp_path)
    past, present = _cache_names(2)
    assert set(past) <= set(inputs) and outputs == ["logits", *present]
    np.testing.assert_array_equal(generate(exported, PROMPT, 6), _expected(model, 6))


@pytest.mark.slow  # about a minute
def test_a_sparse_attentions_indexer_keys_grow_with_the_past(tmp_path):
    """DeepSeek V3.2's indexer keeps keys of its own (transformers' ``DynamicIndexedLayer.indexer_keys``,
    ``[batch, past, head]``): their past is the past axis too (declared static, torch.export made the past
    a constant), named ``past_key_values.N.indexer_keys``; ``generate`` starts them empty on that axis."""
    from catalogue import building

    model = building.build("deepseek_v32", "DeepseekV32ForCausalLM")[0].eval()
    exported, inputs, outputs = _export(model, tmp_path)
    assert "past_key_values.0.indexer_keys" in inputs and "present.0.indexer_keys" in outputs
    graph = onnx.load(str(exported), load_external_data=False).graph
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert dims["past_key_values.0.indexer_keys"][:2] == ["batch_size", "past_sequence_length"]
    np.testing.assert_array_equal(generate(exported, PROMPT, 6), _expected(model, 6))


@pytest.mark.slow  # about 40 s
def test_gpt2s_conv1d_projection_is_fused_whole(tmp_path, capsys):
    """GPT-2's ``Conv1D`` (``addmm(b, x.view(-1, d), W).view(..., 3 * d)``: a ``Gemm`` between two
    reshapes) is a projection: its one ``[q | k | v]`` output goes to ``GroupQueryAttention`` whole."""
    import torch

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_head=2, n_layer=2, n_positions=64,
                                     bos_token_id=1, eos_token_id=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    exported, _, _ = _export(model, tmp_path)
    capsys.readouterr()
    optimized = tmp_path / "m.opt.onnx"
    assert main(["optimize", str(exported), "-o", str(optimized), "--max-positions", "64", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    fused = [f for f in report["fusions"] if f["module_class"] == "GPT2Attention"]
    assert len(fused) == 1 and fused[0]["fused"] and fused[0]["max_abs_diff"] < 1e-4
    body = next(f for f in onnx.load(str(optimized), load_external_data=False).functions if f.name == "GPT2Attention")
    gqa = next(n for n in body.node if n.op_type == "GroupQueryAttention")
    assert next(n for n in body.node if gqa.input[0] in n.output).op_type == "Conv1D"  # the packed projection, whole
    np.testing.assert_array_equal(generate(optimized, PROMPT, 8), _expected(model, 8))


@pytest.mark.slow  # about 40 s
def test_glms_rotary_made_interleaved_in_the_body_is_fused(tmp_path, capsys):
    """GLM turns the first half of its rotary module's rotate-half cos/sin into interleaved pairs in the
    attention body (``cos[..., :d // 2].repeat_interleave(2, -1)``, over half the head): the caches are
    that first half, the rotary interleaved; greedy tokens equal ``generate``'s."""
    import torch

    torch.manual_seed(0)
    config = transformers.GlmConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                    max_position_embeddings=64, pad_token_id=0)
    model = transformers.GlmForCausalLM(config).eval()
    exported, _, _ = _export(model, tmp_path)
    capsys.readouterr()
    optimized = tmp_path / "m.opt.onnx"
    assert main(["optimize", str(exported), "-o", str(optimized), "--max-positions", "64", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    fused = [f for f in report["fusions"] if f["module_class"] == "GlmAttention"]
    assert len(fused) == 1 and fused[0]["fused"] and fused[0]["max_abs_diff"] < 1e-4
    body = next(f for f in onnx.load(str(optimized), load_external_data=False).functions if f.name == "GlmAttention")
    gqa = next(n for n in body.node if n.op_type == "GroupQueryAttention")
    attributes = {a.name: a.i for a in gqa.attribute}
    rotaries = [n for n in body.node if n.op_type == "RotaryEmbedding"]
    assert attributes["rotary_interleaved"] == 1 or [{a.name: a.i for a in n.attribute}["interleaved"] for n in rotaries] == [1, 1]
    np.testing.assert_array_equal(generate(optimized, PROMPT, 8), _expected(model, 8))
