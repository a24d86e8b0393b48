"""``onnx-modular export <checkpoint>`` as an Optimum user drives it: Optimum's task names and axis
names, the task inferred from the config, ``--dtype`` (bfloat16 checked on a float32-widened copy,
float16 streamed and checked block by block), ``--atol``/``--rtol``, a complete output folder, and
errors before the export starts. Tiny random-weight models saved with ``save_pretrained``."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import cache_argument, returned_cache  # noqa: E402

import onnx_modular  # noqa: E402
from onnx_modular.cli import main  # noqa: E402
from onnx_modular.errors import InvalidInputError  # noqa: E402
from onnx_modular.format import metadata  # noqa: E402
from onnx_modular.hf import cache_axes as hf_cache_axes  # noqa: E402
from onnx_modular.hf import checkpoint as hf_checkpoint  # noqa: E402
from onnx_modular.hf.command import export_checkpoint  # noqa: E402

CACHE_ARG = cache_argument()  # `cache` from transformers 5.24, `past_key_values` before

CACHE = [f"input.{CACHE_ARG}.layers.{i}.{kind}" for i in range(2) for kind in ("keys", "values")]


def _llama(folder, dtype=torch.float32, **save):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(config).eval().to(dtype).save_pretrained(folder, **save)
    return folder


def _dims(model: onnx.ModelProto) -> dict[str, list]:
    values = [*model.graph.input, *model.graph.output]
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}


def test_optimum_task_names_and_inference(tmp_path):
    assert hf_checkpoint.resolve_task("text-generation-with-past") == "causal-lm-with-past"
    assert hf_checkpoint.resolve_task("fill-mask") == "masked-lm"
    assert hf_checkpoint.resolve_task("text2text-generation") == "seq2seq-lm"
    with pytest.raises(InvalidInputError, match="fill-mask"):  # the hint lists Optimum's names too
        hf_checkpoint.resolve_task("translation")
    configs = {
        "llama": (transformers.LlamaConfig(architectures=["LlamaForCausalLM"]), "causal-lm-with-past"),
        "bert": (transformers.BertConfig(architectures=["BertForMaskedLM"]), "masked-lm"),
        "t5": (transformers.T5Config(architectures=["T5ForConditionalGeneration"]), "seq2seq-lm"),
        "vit": (transformers.ViTConfig(architectures=["ViTForImageClassification"]), "image-classification"),
        "bare": (transformers.BertConfig(architectures=["BertModel"]), "feature-extraction"),
    }
    for name, (config, task) in configs.items():
        config.save_pretrained(tmp_path / name)
        assert hf_checkpoint.infer_task(tmp_path / name) == (task, config.architectures[0])
    transformers.BertConfig().save_pretrained(tmp_path / "none")  # no architectures recorded
    with pytest.raises(InvalidInputError, match="--task"):
        hf_checkpoint.infer_task(tmp_path / "none")


def test_missing_output_folder_fails_before_the_export(tmp_path, capsys):
    folder = tmp_path / "ckpt"
    transformers.LlamaConfig(architectures=["LlamaForCausalLM"]).save_pretrained(folder)  # never loaded
    for output in (tmp_path / "missing" / "m.onnx", tmp_path / "missing" / "out"):
        assert main(["export", str(folder), "--task", "causal-lm", "-o", str(output)]) == 2
        err = capsys.readouterr().err
        assert "does not exist" in err and "  load" not in err  # nothing was loaded or exported
    assert not (tmp_path / "missing").exists()


def test_kv_cache_folder_export_as_optimum_names_it(tmp_path, capsys):
    from tokenizers import Tokenizer, models

    checkpoint = _llama(tmp_path / "ckpt")
    vocabulary = {f"t{i}": i for i in range(95)} | {"[UNK]": 95}
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocabulary, "[UNK]")))
    tokenizer.save_pretrained(checkpoint)
    out = tmp_path / "out"
    code = main([
        "export", str(checkpoint), "--task", "text-generation-with-past", "-o", str(out),
        "--atol", "2e-4", "--rtol", "2e-3",
    ])
    assert code == 0
    printed = capsys.readouterr().out
    assert "PASS" in printed and "2e-04/2e-03" in printed  # the check used the given tolerances
    # What a runtime needs is in the folder, as in the checkpoint.
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (checkpoint / name).read_bytes(), name
    manifest = json.loads((out / "export.json").read_text())["components"]["model"]["metadata"]["export_config"]
    assert manifest["verify"] is True and manifest["verified"] is True
    assert (manifest["atol"], manifest["rtol"], manifest["task"]) == (2e-4, 2e-3, "causal-lm-with-past")
    # Optimum's axis names, one symbol per meaning, on every input and output.
    saved = onnx.load(str(out / "model.onnx"))
    dims = _dims(saved)
    assert dims["input_ids"] == ["batch_size", "sequence_length"]
    assert dims["attention_mask"] == ["batch_size", "past_sequence_length + sequence_length"]
    assert all(dims[name] == ["batch_size", 2, "past_sequence_length", 8] for name in CACHE)
    assert dims["logits"] == ["batch_size", "sequence_length", 96]
    for name in CACHE:
        present = dims[name.replace("input.", "output.")]
        assert present == ["batch_size", 2, "past_sequence_length + sequence_length", 8]
    # `verify` sizes the mask as past + sequence by itself: no --dim flags.
    assert main(["verify", str(out / "model.onnx")]) == 0
    assert "PASS" in capsys.readouterr().out
    # The decoder layers share one function (torch kept one past-length symbol per cache tensor
    # apart; capture/symbols.py makes them one), and the file decodes as PyTorch does.
    functions = {f.name: f for f in saved.functions}
    layers = [name for name in functions if name.startswith("LlamaDecoderLayer")]
    assert layers == ["LlamaDecoderLayer"], layers
    calls = {p.key: p.value for p in functions["LlamaDecoderLayer"].metadata_props}
    assert int(calls[metadata.CALL_COUNT]) == 2
    _assert_decode_step_matches_torch(checkpoint, out / "model.onnx")


def test_sliding_window_cache_checkpoint(tmp_path, capsys):
    """Mistral's sliding-window cache (transformers' rolling buffer, a 0-d window size beside keys and
    values) is exported with every position's keys and values, the window masked in the graph: one
    decoder function, no input but the ids, the mask and the cache, verified with no flags."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, architectures=["MistralForCausalLM"],
    )
    transformers.MistralForCausalLM(config).eval().save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "mistral.onnx"
    assert main(["export", str(tmp_path / "ckpt"), "-o", str(out)]) == 0  # text-generation-with-past, inferred
    assert "PASS" in capsys.readouterr().out
    saved = onnx.load(str(out))
    assert [f.name for f in saved.functions if "DecoderLayer" in f.name] == ["MistralDecoderLayer"]
    assert all(dims == ["batch_size", 2, "past_sequence_length", 8] for name, dims in _dims(saved).items() if name in CACHE)
    assert not [i.name for i in saved.graph.input if "sliding_window" in i.name]
    assert main(["verify", str(out)]) == 0


def _assert_decode_step_matches_torch(checkpoint, path, atol=1e-4):
    """A decode step at sizes the export never saw (batch 3, past 5, one new token), onnxruntime
    against PyTorch on the same checkpoint: logits and the grown cache."""
    import onnxruntime as ort

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    generator = torch.Generator().manual_seed(3)
    prompt, token = torch.randint(0, 96, (3, 5), generator=generator), torch.randint(0, 96, (3, 1), generator=generator)
    with torch.no_grad():
        cache = returned_cache(model(prompt, use_cache=True))
        feed = {"input_ids": token.numpy(), "attention_mask": np.ones((3, 6), np.int64)}
        for i, layer in enumerate(cache.layers):
            feed[f"input.{CACHE_ARG}.layers.{i}.keys"] = layer.keys.numpy()
            feed[f"input.{CACHE_ARG}.layers.{i}.values"] = layer.values.numpy()
        expected = model(token, attention_mask=torch.ones(3, 6, dtype=torch.long), **{CACHE_ARG: cache}, use_cache=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))
    np.testing.assert_allclose(got["logits"], expected.logits.numpy(), atol=atol, rtol=0)
    for i, layer in enumerate(returned_cache(expected).layers):
        np.testing.assert_allclose(got[f"output.{CACHE_ARG}.layers.{i}.keys"], layer.keys.numpy(), atol=atol, rtol=0)
        np.testing.assert_allclose(got[f"output.{CACHE_ARG}.layers.{i}.values"], layer.values.numpy(), atol=atol, rtol=0)


def test_bfloat16_checkpoint_exported_and_verified(tmp_path, capsys):
    checkpoint = _llama(tmp_path / "ckpt", torch.bfloat16)
    out = tmp_path / "bf16.onnx"
    assert main(["export", str(checkpoint), "-o", str(out)]) == 0  # the task from config.architectures
    captured = capsys.readouterr()
    assert "Task: causal-lm-with-past (inferred from config.architectures: LlamaForCausalLM" in captured.err
    assert "bfloat16" in captured.err  # the load line names the precision
    assert "float32-widened copy" in captured.out and "PASS" in captured.out
    saved = onnx.load(str(out), load_external_data=False)
    weights = [i for i in saved.graph.initializer if i.data_type != onnx.TensorProto.INT64 and len(i.dims) == 2]
    assert weights and all(i.data_type == onnx.TensorProto.BFLOAT16 for i in weights)  # the file is bfloat16
    assert saved.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
    # --dtype float32 exports the same checkpoint in float32 (checked directly in onnxruntime).
    out32 = tmp_path / "f32.onnx"
    assert main(["export", str(checkpoint), "--task", "text-generation", "--dtype", "float32", "-o", str(out32)]) == 0
    captured = capsys.readouterr()
    assert "float32-widened" not in captured.out and "PASS" in captured.out
    assert onnx.load(str(out32)).graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT


def test_float16_streamed_export_passes_block_by_block(tmp_path, capsys):
    checkpoint = _llama(tmp_path / "ckpt", max_shard_size="100KB")
    out = tmp_path / "fp16.onnx"
    code = main([
        "export", str(checkpoint), "--task", "causal-lm-with-past", "--stream-weights", "--dtype", "float16",
        "-o", str(out),
    ])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Block-by-block parity" in printed and "chained" in printed and "PASS" in printed
    saved = onnx.load(str(out), load_external_data=False)
    assert saved.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    # One axis name per meaning in every decoder body, and one body for both layers.
    bodies = [f for f in saved.functions if f.name.startswith("LlamaDecoderLayer")]
    assert [f.name for f in bodies] == ["LlamaDecoderLayer"]
    symbols = {d.dim_param for f in bodies for v in f.value_info for d in v.type.tensor_type.shape.dim if d.dim_param}
    assert symbols and symbols <= {"batch_size", "sequence_length", "past_sequence_length", "past_sequence_length + sequence_length"}
    assert _dims(saved)["attention_mask"] == ["batch_size", "past_sequence_length + sequence_length"]
    assert main(["verify", str(out)]) == 0


def test_optimum_io_names_decode_as_optimum_feeds_them(tmp_path, capsys):
    """``--io-names optimum``: the cache inputs and outputs are ``past_key_values.N.key`` and
    ``present.N.key`` whatever transformers release exported them (5.24 calls its argument
    ``cache``), and the file decodes as Optimum's ``ORTModelForCausalLM`` drives it: an empty past
    at the prompt, then each step's ``present.*`` fed back as ``past_key_values.*``, giving
    ``model.generate``'s greedy tokens (``onnx_modular.generate``'s loop)."""
    checkpoint = _llama(tmp_path / "ckpt")
    path = tmp_path / "m.onnx"
    assert main(["export", str(checkpoint), "--task", "text-generation-with-past", "-o", str(path), "--io-names", "optimum"]) == 0
    printed = capsys.readouterr().out
    assert "present.0.key" in printed and "PASS" in printed  # the report names the file's outputs
    saved = onnx.load(str(path), load_external_data=False)
    layers = range(2)
    past = [f"past_key_values.{i}.{kind}" for i in layers for kind in ("key", "value")]
    present = [f"present.{i}.{kind}" for i in layers for kind in ("key", "value")]
    assert [v.name for v in saved.graph.input] == ["input_ids", "attention_mask", *past]
    assert [v.name for v in saved.graph.output] == ["logits", *present]
    dims = _dims(saved)
    assert all(dims[name] == ["batch_size", 2, "past_sequence_length", 8] for name in past)
    assert all(dims[name] == ["batch_size", 2, "past_sequence_length + sequence_length", 8] for name in present)

    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint).eval()
    prompt = torch.tensor([[5, 17, 33, 2], [9, 41, 7, 63]])
    with torch.no_grad():
        expected = model.generate(prompt, do_sample=False, max_new_tokens=6, min_new_tokens=6, eos_token_id=None, pad_token_id=0)
    tokens = onnx_modular.generate(path, prompt.numpy(), max_new_tokens=6)  # an empty past, then present.* fed back
    np.testing.assert_array_equal(tokens, expected.numpy())

    # Optimum's names are for one file of a with-past decoder: other uses are refused before any work.
    assert main(["export", str(checkpoint), "--task", "causal-lm-with-past", "-o", str(tmp_path / "out"), "--io-names", "optimum"]) == 2
    assert "ExportedModel" in capsys.readouterr().err and not (tmp_path / "out" / "model.onnx").exists()
    assert main(["export", str(checkpoint), "--task", "causal-lm", "-o", str(tmp_path / "nc.onnx"), "--io-names", "optimum"]) == 2
    assert "past_key_values.N.key" in capsys.readouterr().err and not (tmp_path / "nc.onnx").exists()
    assert main(["export", str(checkpoint), "--task", "causal-lm-with-past", "-o", str(tmp_path / "s.onnx"),
                 "--io-names", "optimum", "--stream-weights"]) == 2
    assert "--stream-weights" in capsys.readouterr().err
    with pytest.raises(InvalidInputError, match="decoder"):
        hf_cache_axes.optimum_io_names(["input.past_key_values.self_attention_cache.layers.0.keys", "logits"])


def test_with_past_of_an_encoder_configured_bert_says_to_set_is_decoder(tmp_path):
    """BertLMHeadModel with is_decoder false runs as an encoder and returns no cache: a typed error naming
    the class and the config key, before anything is written."""
    config = transformers.BertConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                     num_attention_heads=4, is_decoder=False)
    transformers.BertLMHeadModel(config).eval().save_pretrained(tmp_path / "ckpt")
    with pytest.raises(InvalidInputError, match=r"BertLMHeadModel returned no cache.*is_decoder") as error:
        export_checkpoint(str(tmp_path / "ckpt"), "causal-lm-with-past", tmp_path / "m.onnx")
    assert '"is_decoder": true' in error.value.hint
    assert not (tmp_path / "m.onnx").exists()


def test_checkpoint_whose_forward_fails_names_the_module_and_the_config(tmp_path):
    """A config that does not fit its class (Helium's o_proj is hidden x hidden, its heads are head_dim wide):
    the checkpoint's own forward fails before any export, and the error says so, naming the module."""
    if not hasattr(transformers, "HeliumConfig"):
        pytest.skip("this transformers has no Helium")
    config = transformers.HeliumConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    transformers.HeliumForCausalLM(config).eval().save_pretrained(tmp_path / "ckpt")
    with pytest.raises(onnx_modular.errors.CaptureError, match="HeliumForCausalLM failed to run in PyTorch") as error:
        export_checkpoint(str(tmp_path / "ckpt"), "causal-lm-with-past", tmp_path / "m.onnx")
    assert error.value.module_path == "model.layers.0.self_attn.o_proj"
    assert "config.json" in error.value.hint
    assert not (tmp_path / "m.onnx").exists()
