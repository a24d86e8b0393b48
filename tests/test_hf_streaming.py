"""``onnx-modular export <checkpoint> --task T --stream-weights``: a sharded checkpoint exported
with its model on the meta device and its weights read one tensor at a time."""

from __future__ import annotations

import weakref

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import cache_argument, returned_cache  # noqa: E402

from onnx_modular.cli import build_parser, main  # noqa: E402
from onnx_modular.errors import InvalidInputError  # noqa: E402
from onnx_modular.format import metadata  # noqa: E402
from onnx_modular.hf import checkpoint as hf_checkpoint  # noqa: E402
from onnx_modular.hf import command  # noqa: E402
from onnx_modular.weights import sources as weights_module  # noqa: E402

CACHE_ARG = cache_argument()  # `cache` from transformers 5.24, `past_key_values` before

ATOL = 1e-4
CACHE = [f"input.{CACHE_ARG}.layers.{i}.{kind}" for i in range(2) for kind in ("keys", "values")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama saved in several shards by save_pretrained."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128,
    )
    path = tmp_path_factory.mktemp("sharded")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path, max_shard_size="200KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 1
    return path


@pytest.fixture
def spied(monkeypatch):
    """Record the model the command builds and every weight read from the safetensors files
    (the real readers, wrapped): how many tensors are alive at once and their bytes."""
    seen = {"models": [], "reads": 0, "alive": 0, "alive_bytes": 0, "peak_bytes": 0}

    def model_on_meta(*args, **kwargs):
        model = real_model_on_meta(*args, **kwargs)
        seen["models"].append(model)
        return model

    def file_reader(*args):
        read = real_file_reader(*args)

        def counted():
            tensor = read()
            seen["reads"] += 1
            seen["alive_bytes"] += tensor.nbytes
            seen["peak_bytes"] = max(seen["peak_bytes"], seen["alive_bytes"])
            size = tensor.nbytes
            weakref.finalize(tensor, lambda: seen.__setitem__("alive_bytes", seen["alive_bytes"] - size))
            return tensor

        return counted

    real_model_on_meta, real_file_reader = hf_checkpoint.model_on_meta, weights_module._file_reader
    monkeypatch.setattr(hf_checkpoint, "model_on_meta", model_on_meta)
    monkeypatch.setattr(weights_module, "_file_reader", file_reader)
    return seen


def _run(path, feeds):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {name: value.numpy() for name, value in feeds.items()})


def _assert_streamed(seen, folder):
    (model,) = seen["models"]
    assert all(p.is_meta for p in model.parameters())  # the exported model never held a weight
    total = sum(t.nbytes for t in transformers.LlamaForCausalLM.from_pretrained(folder).state_dict().values())
    assert seen["reads"] > 0
    assert 0 < seen["peak_bytes"] < total / 2, (seen["peak_bytes"], total)  # never all weights in memory


def _assert_modular(path):
    saved = onnx.load(str(path), load_external_data=False)
    classes = {
        f.name for f in saved.functions if any(p.key == metadata.CLASS for p in f.metadata_props)
    }
    assert {"LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP"} <= classes
    assert any(i.data_location == onnx.TensorProto.EXTERNAL for i in saved.graph.initializer)  # streamed into .data
    return saved


def test_stream_weights_causal_lm(folder, tmp_path, spied, capsys):
    out = tmp_path / "m.onnx"
    assert main(["export", str(folder), "--task", "causal-lm", "-o", str(out), "--stream-weights"]) == 0
    printed = capsys.readouterr().out
    assert "Block-by-block parity" in printed and "PASS" in printed
    _assert_streamed(spied, folder)
    saved = _assert_modular(out)
    assert [v.name for v in saved.graph.input] == ["input_ids", "attention_mask"]
    # Dynamic batch and sequence: run at other sizes than the export's, against the model loaded normally.
    real = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, 128, (3, 5), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = real(input_ids=ids, attention_mask=mask, use_cache=False).logits
    (logits,) = _run(out, {"input_ids": ids, "attention_mask": mask})
    np.testing.assert_allclose(logits, expected.numpy(), atol=ATOL, rtol=1e-3)


def test_stream_weights_causal_lm_with_past(folder, tmp_path, spied):
    out = tmp_path / "past.onnx"
    assert main(["export", str(folder), "--task", "causal-lm-with-past", "-o", str(out), "--stream-weights"]) == 0
    _assert_streamed(spied, folder)
    saved = _assert_modular(out)
    assert [v.name for v in saved.graph.input] == ["input_ids", "attention_mask", *CACHE]
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in saved.graph.input}
    assert all(isinstance(dims[name][2], str) for name in CACHE)  # the past length is dynamic
    # A real cache (the sample had zeros), batch 3, past 6, 2 new tokens, against the loaded model.
    real = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    generator = torch.Generator().manual_seed(4)
    prefix, ids = torch.randint(0, 128, (3, 6), generator=generator), torch.randint(0, 128, (3, 2), generator=generator)
    with torch.no_grad():
        cache = returned_cache(real(input_ids=prefix, use_cache=True))
        feeds = {"input_ids": ids, "attention_mask": torch.ones(3, 8, dtype=torch.long)}
        for i, layer in enumerate(cache.layers):
            feeds[CACHE[2 * i]], feeds[CACHE[2 * i + 1]] = layer.keys.clone(), layer.values.clone()
        expected = real(input_ids=ids, attention_mask=feeds["attention_mask"], **{CACHE_ARG: cache})
    logits, *caches = _run(out, feeds)
    np.testing.assert_allclose(logits, expected.logits.numpy(), atol=ATOL, rtol=1e-3)
    for i, layer in enumerate(returned_cache(expected).layers):
        np.testing.assert_allclose(caches[2 * i], layer.keys.numpy(), atol=ATOL, rtol=1e-3)
        np.testing.assert_allclose(caches[2 * i + 1], layer.values.numpy(), atol=ATOL, rtol=1e-3)


def test_stream_weights_inputs_need_no_weights(folder):
    """The sample inputs come from the config: a cache of zeros shaped as the model fills it;
    --static gives no dynamic shapes."""
    parse = build_parser().parse_args
    values = command.streamed(parse(["export", str(folder), "--task", "causal-lm-with-past", "-o", "m.onnx", "--stream-weights"]))
    assert values["weights"] == str(folder) and all(p.is_meta for p in values["model"].parameters())
    cache = values["kwargs"][CACHE_ARG]
    assert isinstance(cache, transformers.DynamicCache) and len(cache.layers) == 2
    assert tuple(cache.layers[0].keys.shape) == (hf_checkpoint.BATCH, 2, hf_checkpoint.PAST, 16)
    assert not cache.layers[0].keys.is_meta and not cache.layers[0].keys.any()
    assert set(values["dynamic_shapes"]) == set(values["kwargs"])  # a key per input, as torch.export wants
    static = command.streamed(parse(["export", str(folder), "--task", "causal-lm", "-o", "m.onnx", "--stream-weights", "--static"]))
    assert static["dynamic_shapes"] is None and static["kwargs"]["use_cache"] is False


def test_stream_weights_errors(folder, tmp_path, capsys):
    def export(*options):
        return main(["export", *options, "--stream-weights"])

    assert export(str(folder), "--task", "causal-lm", "--generation", "-o", str(tmp_path / "g")) == 2
    err = capsys.readouterr().err
    assert "--stream-weights does not export generation components" in err and "causal-lm-with-past" in err
    assert export(str(folder), "--task", "causal-lm", "-o", str(tmp_path / "folder")) == 2
    assert "must end with .onnx" in capsys.readouterr().err
    assert export(str(folder), "--task", "translation", "-o", str(tmp_path / "m.onnx")) == 2
    assert "Unknown task 'translation'" in capsys.readouterr().err  # without --task, it is inferred
    assert export("onnx_modular.hf.demo:gpt2", "-o", str(tmp_path / "m.onnx")) == 2
    assert "--stream-weights applies to a checkpoint folder" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(InvalidInputError, match="not a folder"):
        hf_checkpoint.meta_checkpoint(tmp_path / "missing", "causal-lm")


def test_stream_weights_renamed_checkpoint_keys(tmp_path):
    """transformers 5 saves ViT under its legacy names and renames them at load; streaming
    applies the same renaming (and the file matches the model loaded normally)."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=40, num_labels=3,
    )
    folder = tmp_path / "vit"
    transformers.ViTForImageClassification(config).eval().save_pretrained(folder)
    real = transformers.ViTForImageClassification.from_pretrained(folder).eval()
    stored = set(weights_module.WeightSource.open(folder).keys())
    assert stored != set(real.state_dict())  # the names on disk are not the model's
    out = tmp_path / "vit.onnx"
    assert main(["export", str(folder), "--task", "image-classification", "-o", str(out), "--stream-weights", "--static"]) == 0
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = real(pixel_values=pixels).logits
    (logits,) = _run(out, {"pixel_values": pixels})
    np.testing.assert_allclose(logits, expected.numpy(), atol=ATOL, rtol=1e-3)
    assert [d.dim_value for d in onnx.load(str(out), load_external_data=False).graph.input[0].type.tensor_type.shape.dim] == [2, 3, 32, 32]


def test_stream_weights_refuses_tensors_converted_at_load(tmp_path, capsys):
    """Mixtral's checkpoint stores one tensor per expert, which transformers fuses at load:
    streaming stored tensors cannot, so it says so before exporting anything."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, num_local_experts=2, num_experts_per_tok=1,
    )
    folder = tmp_path / "mixtral"
    transformers.MixtralForCausalLM(config).save_pretrained(folder)
    out = tmp_path / "out"
    out.mkdir()
    assert main(["export", str(folder), "--task", "causal-lm", "-o", str(out / "m.onnx"), "--stream-weights"]) == 2
    err = capsys.readouterr().err
    assert "transformers converts 'model.layers.0." in err and "experts" in err and "without --stream-weights" in err
    assert list(out.iterdir()) == []
