"""Models with a KV cache (``use_cache=True``), cache inputs and outputs handled.

transformers' caches (``DynamicCache``, ``EncoderDecoderCache``) are registered for
torch.export automatically; the graph's inputs and outputs are named after the cache's
tensors (``input.past_key_values.layers.0.keys`` / ``output.past_key_values.layers.0.keys``),
and one ``{axis: Dim}`` spec covers every cache tensor.

Numerics: onnxruntime against torch eager, float32, atol 1e-4 (measured ~6e-8), over a
greedy decode loop that feeds the ONNX cache outputs back as inputs.
"""

from __future__ import annotations

import models
import numpy as np
import onnxruntime as ort
import pytest
import torch
from helpers import cache_argument, expanded_calls, returned_cache

from onnx_modular import export_modular
from onnx_modular.errors import InvalidInputError
from onnx_modular.format import metadata

CACHE_ARG = cache_argument()  # `cache` from transformers 5.24, `past_key_values` before

ATOL = 1e-4
LAYERS = 2


def _llama_lm():
    return models.llama_lm(LAYERS)


def _prefill(model, batch: int, length: int):
    ids = torch.randint(0, 100, (batch, length))
    with torch.no_grad():
        out = model(ids, use_cache=True)
    return out


def _dims(session_values) -> dict[str, list]:
    return {v.name: list(v.shape) for v in session_values}


@pytest.fixture(scope="module")
def llama_kv(tmp_path_factory):
    model = _llama_lm()
    cache = returned_cache(_prefill(model, batch=2, length=3))
    kwargs = dict(
        input_ids=torch.randint(0, 100, (2, 2)),
        attention_mask=torch.ones(2, 5, dtype=torch.long),
        **{CACHE_ARG: cache},
    )
    Dim = torch.export.Dim
    batch, seq, past = Dim("batch"), Dim("seq"), Dim("past")
    dynamic_shapes = dict(
        input_ids={0: batch, 1: seq},
        attention_mask={0: batch, 1: Dim.AUTO},  # = past + seq, which torch works out itself
        **{CACHE_ARG: {0: batch, 2: past}},  # one spec for every cache tensor
    )
    path = tmp_path_factory.mktemp("kv") / "llama_kv.onnx"
    result = export_modular(model, (), path, kwargs=kwargs, dynamic_shapes=dynamic_shapes)
    return model, result, path


def _cache_names(prefix: str) -> list[str]:
    return [f"{prefix}.{CACHE_ARG}.layers.{i}.{kind}" for i in range(LAYERS) for kind in ("keys", "values")]


def test_cache_inputs_and_outputs_are_named_and_dynamic(llama_kv):
    _, result, path = llama_kv
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs, outputs = _dims(session.get_inputs()), _dims(session.get_outputs())
    assert list(inputs) == ["input_ids", "attention_mask", *_cache_names("input")]
    assert list(outputs) == ["logits", *_cache_names("output")]
    assert inputs["input_ids"] == ["batch", "seq"]
    for name in _cache_names("input"):
        assert inputs[name] == ["batch", 2, "past", 8]
    for name in _cache_names("output"):
        assert outputs[name] == ["batch", 2, "past + seq", 8]
    assert outputs["logits"] == ["batch", "seq", 100]
    assert result.report.ok and result.report.max_abs < ATOL


def test_cache_flows_through_the_layer_functions(llama_kv):
    _, result, _ = llama_kv
    functions = {f.name: f for f in result.functions}
    layer = functions["LlamaDecoderLayer"]
    assert int(layer.metadata_props[metadata.CALL_COUNT]) == LAYERS  # one definition, shared
    assert layer.domain.startswith("pkg.transformers.")
    calls = expanded_calls(result.model)
    assert sum(1 for path, name, _ in calls if name == "LlamaDecoderLayer") == LAYERS
    # each layer reads its past keys/values and returns the grown ones
    assert len(layer.inputs) >= 2 + 2 and len(layer.outputs) == 1 + 2
    root_call = next(node for node in result.model.graph if node.op_type == "LlamaModel")
    assert [v.name for v in root_call.inputs if CACHE_ARG in v.name] == _cache_names("input")


def _torch_step(model, ids, mask, cache):
    with torch.no_grad():
        out = model(ids, attention_mask=mask, **{CACHE_ARG: cache}, use_cache=True)
    return out.logits.numpy(), returned_cache(out)


def test_prefill_and_greedy_decode_in_onnxruntime_match_torch(llama_kv):
    """One file does both: prefill with an empty cache, then decode one token at a time,
    at a batch size (3) and lengths the export never saw."""
    model, _, path = llama_kv
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    output_names = [o.name for o in session.get_outputs()]
    batch, prompt = 3, 4
    torch.manual_seed(1)
    ids = torch.randint(0, 100, (batch, prompt))

    # prefill: past length 0
    feed = {"input_ids": ids.numpy(), "attention_mask": np.ones((batch, prompt), np.int64)}
    feed.update({name: np.zeros((batch, 2, 0, 8), np.float32) for name in _cache_names("input")})
    onnx_out = dict(zip(output_names, session.run(None, feed)))
    expected_logits, cache = _torch_step(model, ids, torch.ones(batch, prompt, dtype=torch.long), None)
    np.testing.assert_allclose(onnx_out["logits"], expected_logits, atol=ATOL, rtol=0)

    onnx_tokens, torch_tokens = [], []
    token = torch.from_numpy(onnx_out["logits"][:, -1].argmax(-1)[:, None])
    length = prompt
    for _ in range(4):
        length += 1
        mask = torch.ones(batch, length, dtype=torch.long)
        feed = {"input_ids": token.numpy(), "attention_mask": mask.numpy()}
        feed.update({name.replace("output.", "input.", 1): onnx_out[name] for name in _cache_names("output")})
        onnx_out = dict(zip(output_names, session.run(None, feed)))
        expected_logits, cache = _torch_step(model, token, mask, cache)
        np.testing.assert_allclose(onnx_out["logits"], expected_logits, atol=ATOL, rtol=0)
        for layer in range(LAYERS):
            np.testing.assert_allclose(
                onnx_out[f"output.{CACHE_ARG}.layers.{layer}.values"], cache.layers[layer].values.numpy(), atol=ATOL
            )
        assert onnx_out[f"output.{CACHE_ARG}.layers.0.keys"].shape == (batch, 2, length, 8)
        onnx_tokens.append(onnx_out["logits"][:, -1].argmax(-1))
        torch_tokens.append(expected_logits[:, -1].argmax(-1))
        token = torch.from_numpy(onnx_tokens[-1][:, None])
    assert np.array_equal(np.stack(onnx_tokens), np.stack(torch_tokens))


def test_user_cache_is_not_modified(llama_kv):
    """export_modular runs the model on copies: the user's cache keeps its length."""
    model = _llama_lm()
    cache = returned_cache(_prefill(model, batch=1, length=3))
    kwargs = dict(input_ids=torch.randint(0, 100, (1, 1)), **{CACHE_ARG: cache})
    export_modular(model, (), None, kwargs=kwargs)
    assert cache.get_seq_length() == 3


def test_encoder_decoder_cache(tmp_path):
    """BART's decoder step with an ``EncoderDecoderCache`` (self- and cross-attention caches)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
    )
    model = transformers.BartForConditionalGeneration(config).eval()
    with torch.no_grad():
        first = model(input_ids=torch.randint(3, 100, (2, 6)), decoder_input_ids=torch.randint(3, 100, (2, 3)))
    kwargs = dict(
        encoder_outputs=(first.encoder_last_hidden_state,),
        decoder_input_ids=torch.randint(3, 100, (2, 1)),
        **{CACHE_ARG: returned_cache(first)},
    )
    result = export_modular(model, (), tmp_path / "bart_kv.onnx", kwargs=kwargs)
    assert result.report.ok and result.report.max_abs < ATOL
    names = [v.name for v in result.model.graph.inputs]
    assert names[:2] == ["encoder_outputs.0", "decoder_input_ids"]
    for kind in ("self_attention_cache", "cross_attention_cache"):
        assert f"input.{CACHE_ARG}.{kind}.layers.1.values" in names
    outputs = {v.name: v for v in result.model.graph.outputs}
    assert outputs[f"output.{CACHE_ARG}.self_attention_cache.layers.0.keys"].shape[2] == 4  # 3 + 1
    functions = {f.name: f for f in result.functions}
    assert int(functions["BartDecoderLayer"].metadata_props[metadata.CALL_COUNT]) == 2


def test_unflattenable_input_is_a_clear_error(tmp_path):
    class State:
        def __init__(self):
            self.hidden = torch.zeros(2, 4)

    class Model(torch.nn.Module):
        def forward(self, x, state):
            return x + state.hidden

    destination = tmp_path / "m.onnx"
    with pytest.raises(InvalidInputError) as info:
        export_modular(Model(), (torch.ones(2, 4), State()), destination)
    assert "`args.1`" in str(info.value) and "State" in str(info.value)
    assert "register_pytree_node" in str(info.value)
    assert not destination.exists()


def test_input_and_output_names_can_be_given(tmp_path):
    class Model(torch.nn.Module):
        def forward(self, x, y):
            return x + y, x * y

    result = export_modular(
        Model(), (torch.ones(2), torch.ones(2)), tmp_path / "m.onnx", input_names=["a", "b"], output_names=["s", "p"]
    )
    assert [v.name for v in result.model.graph.inputs] == ["a", "b"]
    assert [v.name for v in result.model.graph.outputs] == ["s", "p"]
    with pytest.raises(InvalidInputError, match="1 output_names"):
        export_modular(Model(), (torch.ones(2), torch.ones(2)), tmp_path / "n.onnx", output_names=["s"])
    assert not (tmp_path / "n.onnx").exists()


def test_default_names_follow_forward(tmp_path):
    class Model(torch.nn.Module):
        def forward(self, x, pair):
            return {"total": x + pair[0], "product": x * pair[1]}

    result = export_modular(Model(), (torch.ones(2), (torch.ones(2), torch.ones(2))), tmp_path / "m.onnx")
    assert [v.name for v in result.model.graph.inputs] == ["x", "pair.0", "pair.1"]
    assert [v.name for v in result.model.graph.outputs] == ["total", "product"]


def test_verify_on_new_inputs_leaves_the_cache_as_given(llama_kv):
    model, result, _ = llama_kv
    cache = returned_cache(_prefill(model, batch=3, length=5))
    kwargs = dict(
        input_ids=torch.randint(0, 100, (3, 1)), attention_mask=torch.ones(3, 6, dtype=torch.long), **{CACHE_ARG: cache}
    )
    report = result.verify((), kwargs, model=model)
    assert report.ok, str(report)
    assert report.max_abs < ATOL
    assert cache.get_seq_length() == 5
