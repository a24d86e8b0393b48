"""The transformers export backend (``onnx_modular.hf``) and ``onnx-modular export <checkpoint> --task``.

Every model is a tiny random-weight one written with ``save_pretrained`` into a temporary folder
(nothing is downloaded). Numerics: onnxruntime against PyTorch on the same weights, on inputs of
other shapes than the export's (dynamic axes); generation: the same greedy tokens as
``model.generate``. Structure: every program has the module functions, in the domains of the
installed torch and transformers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import onnx
import onnxruntime as ort
import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import cache_argument, returned_cache  # noqa: E402
from transformers.exporters import ExportedModel  # noqa: E402
from transformers.exporters.auto import get_exporter_class, get_runner_class  # noqa: E402

import onnx_modular.hf as hf  # noqa: E402
from onnx_modular.cli import main  # noqa: E402
from onnx_modular.errors import (  # noqa: E402
    InvalidInputError,
    MissingDependencyError,
    OnnxModularError,
)
from onnx_modular.format import metadata  # noqa: E402

CACHE_ARG = cache_argument()  # `cache` from transformers 5.24, `past_key_values` before

TORCH_DOMAIN = f"pkg.torch.{torch.__version__.split('+')[0]}"
TRANSFORMERS_DOMAIN = f"pkg.transformers.{transformers.__version__}"
ATOL = 1e-4


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def _bert():
    config = transformers.BertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=40,
        max_position_embeddings=64,
    )
    return transformers.BertForMaskedLM(config)


def _t5():
    config = transformers.T5Config(
        vocab_size=96, d_model=32, d_ff=48, d_kv=8, num_layers=1, num_decoder_layers=1, num_heads=4,
        decoder_start_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config)


def _vit():
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=40, num_labels=3,
    )
    return transformers.ViTForImageClassification(config)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Folders as save_pretrained writes them: ``{"llama": path, ...}``, random weights (seeded)."""
    root = tmp_path_factory.mktemp("checkpoints")
    folders = {}
    for name, build in (("llama", _llama), ("bert", _bert), ("t5", _t5), ("vit", _vit)):
        torch.manual_seed(0)
        build().save_pretrained(root / name)
        folders[name] = root / name
    return folders


def _model(folder, task):
    return hf.load_checkpoint(folder, task)


def _function_names(model: onnx.ModelProto) -> dict[str, str]:
    """``{function name: domain}`` of the module-call functions."""
    return {
        f.name: f.domain
        for f in model.functions
        if any(p.key == metadata.CLASS for p in f.metadata_props)
    }


def _assert_modular(model: onnx.ModelProto, expected: dict[str, str]) -> None:
    functions = _function_names(model)
    for name, domain in expected.items():
        assert functions.get(name) == domain, (name, functions)
    # The main graph calls module functions, not a flat copy of their ops.
    called = {(node.domain, node.op_type) for node in model.graph.node}
    assert any((domain, name) in called for name, domain in functions.items())


def _proto(program) -> onnx.ModelProto:
    import onnx_ir as ir

    return ir.serde.serialize_model(program)


# -- the exporter API -----------------------------------------------------------------------


def test_registered_with_transformers():
    assert get_exporter_class("onnx_modular") is hf.ModularOnnxExporter
    assert get_runner_class("onnx_modular") is hf.ModularOnnxModelRunner
    hf.register()  # idempotent
    assert get_exporter_class("onnx_modular") is hf.ModularOnnxExporter


def test_export_call_save_load_dynamic(checkpoints, tmp_path):
    model = _model(checkpoints["llama"], "causal-lm")
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    exporter = get_exporter_class("onnx_modular")()
    exported = exporter.export(
        model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}, {"dynamic": True}
    )
    result = hf.modular_result(exported)
    assert result.report is not None and result.report.ok  # checked on the final program
    _assert_modular(
        _proto(exported.program),
        {"LlamaModel": TRANSFORMERS_DOMAIN, "LlamaDecoderLayer": TRANSFORMERS_DOMAIN, "Linear": TORCH_DOMAIN},
    )
    assert [v.name for v in exported.program.graph.inputs] == ["input_ids", "attention_mask"]
    assert [v.name for v in exported.program.graph.outputs] == ["logits"]

    # Other batch and sequence sizes than the export's: the axes are dynamic.
    other = torch.randint(0, 96, (3, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(input_ids=other, attention_mask=torch.ones_like(other), use_cache=False).logits
    torch.testing.assert_close(
        exported(input_ids=other, attention_mask=torch.ones_like(other)).logits, expected, atol=ATOL, rtol=1e-3
    )

    exported.save_pretrained(tmp_path / "out")
    exported.save_pretrained(tmp_path / "out")  # over the first save: still the layout transformers reads
    assert {"model.onnx", "model.onnx.data", "export.json", "config.json"} <= set(os.listdir(tmp_path / "out"))
    assert not [name for name in os.listdir(tmp_path / "out") if name.endswith(".data") and name != "model.onnx.data"]
    assert json.loads((tmp_path / "out" / "export.json").read_text())["export_format"] == "onnx_modular"
    saved = onnx.load(str(tmp_path / "out" / "model.onnx"))
    _assert_modular(saved, {"LlamaAttention": TRANSFORMERS_DOMAIN})
    onnx.checker.check_model(saved, full_check=True)

    loaded = ExportedModel.from_pretrained(tmp_path / "out")
    assert loaded.export_format == "onnx_modular"
    torch.testing.assert_close(
        loaded(input_ids=other, attention_mask=torch.ones_like(other)).logits, expected, atol=ATOL, rtol=1e-3
    )
    with pytest.raises(InvalidInputError, match="loaded from a file"):
        hf.modular_result(loaded)


def test_generation_components_match_generate(checkpoints, tmp_path):
    model = _model(checkpoints["llama"], "causal-lm")
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    exporter = hf.ModularOnnxExporter()
    exported = exporter.export_for_generation(
        model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, hf.ModularOnnxConfig(dynamic=True)
    )
    assert list(exported.components) == ["prefill", "decode"]
    decode = exported.components["decode"].program
    # The KV cache as transformers names it, in and out.
    cache = [f"{CACHE_ARG}.layers.{i}.{kind}" for i in range(2) for kind in ("keys", "values")]
    assert [v.name for v in decode.graph.inputs][-4:] == [f"input.{name}" for name in cache]
    assert [v.name for v in decode.graph.outputs] == ["logits", *(f"output.{name}" for name in cache)]
    for name, component in exported.components.items():
        result = hf.modular_result(exported, name)
        assert result.report.ok
        _assert_modular(_proto(component.program), {"LlamaDecoderLayer": TRANSFORMERS_DOMAIN})
        # Each layer's cache length is its own torch symbol (Dim.AUTO); the two layers still
        # share one function (dedupe compares symbolic dims up to renaming).
        layers = [f for f in result.functions if f.name.startswith("LlamaDecoderLayer")]
        assert [f.name for f in layers] == ["LlamaDecoderLayer"]
        assert int(layers[0].metadata_props[metadata.CALL_COUNT]) == 2

    new_tokens = 10
    with torch.no_grad():
        expected = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
        )
    assert expected.shape[1] == ids.shape[1] + new_tokens
    assert torch.equal(hf.greedy_generate(exported, ids, new_tokens), expected)

    exported.save_pretrained(tmp_path / "gen")
    loaded = ExportedModel.from_pretrained(tmp_path / "gen")
    assert torch.equal(hf.greedy_generate(loaded, ids, new_tokens), expected)


def test_exporter_captures_through_the_capture_strategies(checkpoints):
    """transformers' torch.export call runs through onnx_modular's capture strategies: BERT's
    ``Dim("seq")`` without ``max`` takes torch's suggested bound (its 64 positions)."""
    model = _model(checkpoints["bert"], "masked-lm")
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(6))
    seq = torch.export.Dim("seq")
    config = hf.ModularOnnxConfig(dynamic_shapes={"input_ids": {1: seq}, "attention_mask": {1: seq}})
    exported = hf.ModularOnnxExporter().export(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, config)
    result = hf.modular_result(exported)
    assert result.capture_strategy == "suggested-fixes" and result.report.ok
    assert list(exported.program.graph.inputs[0].shape) == [2, "seq"]
    other = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = model(input_ids=other, attention_mask=torch.ones_like(other)).logits
    torch.testing.assert_close(
        exported(input_ids=other, attention_mask=torch.ones_like(other)).logits, expected, atol=ATOL, rtol=1e-3
    )


def test_config_rejects_fusions_and_quantizer():
    with pytest.raises(InvalidInputError, match="ort_fusions"):
        hf.ModularOnnxConfig(ort_fusions="cpu")


# -- the command line ------------------------------------------------------------------------


def _run_file(path, feeds: dict[str, torch.Tensor]) -> list:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {name: value.numpy() for name, value in feeds.items()})


def test_cli_causal_lm_with_past(checkpoints, tmp_path, capsys):
    out = tmp_path / "m.onnx"
    assert main(["export", str(checkpoints["llama"]), "--task", "causal-lm-with-past", "-o", str(out)]) == 0
    assert "PASS" in capsys.readouterr().out
    saved = onnx.load(str(out))
    _assert_modular(saved, {"LlamaModel": TRANSFORMERS_DOMAIN, "LlamaDecoderLayer": TRANSFORMERS_DOMAIN})
    names = [v.name for v in saved.graph.input]
    cache_names = [f"input.{CACHE_ARG}.layers.{i}.{kind}" for i in range(2) for kind in ("keys", "values")]
    assert names == ["input_ids", "attention_mask", *cache_names]
    # Dynamic by default: batch, sequence and past length are symbols.
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in saved.graph.input}
    assert all(isinstance(dims["input_ids"][axis], str) for axis in (0, 1))
    assert all(isinstance(dims[name][2], str) for name in cache_names)

    # Run it at other sizes than the export's (batch 3, past 6, 2 new tokens) against PyTorch.
    model = _model(checkpoints["llama"], "causal-lm-with-past")
    generator = torch.Generator().manual_seed(4)
    prefix, ids = torch.randint(0, 96, (3, 6), generator=generator), torch.randint(0, 96, (3, 2), generator=generator)
    with torch.no_grad():
        cache = returned_cache(model(input_ids=prefix, use_cache=True))
        feeds = {"input_ids": ids, "attention_mask": torch.ones(3, 8, dtype=torch.long)}
        for i, layer in enumerate(cache.layers):
            feeds[cache_names[2 * i]] = layer.keys.clone()
            feeds[cache_names[2 * i + 1]] = layer.values.clone()
        expected = model(input_ids=ids, attention_mask=feeds["attention_mask"], **{CACHE_ARG: cache})
    logits, *caches = _run_file(out, feeds)
    torch.testing.assert_close(torch.from_numpy(logits), expected.logits, atol=ATOL, rtol=1e-3)
    for i, layer in enumerate(returned_cache(expected).layers):
        torch.testing.assert_close(torch.from_numpy(caches[2 * i]), layer.keys, atol=ATOL, rtol=1e-3)
        torch.testing.assert_close(torch.from_numpy(caches[2 * i + 1]), layer.values, atol=ATOL, rtol=1e-3)
    assert caches[1].shape == (3, 2, 8, 8)


def test_cli_image_classification_static(checkpoints, tmp_path):
    out = tmp_path / "vit.onnx"
    code = main(
        ["export", str(checkpoints["vit"]), "--task", "image-classification", "--static", "-o", str(out), "--flat-file"]
    )
    assert code == 0
    flat = tmp_path / "vit.flat.onnx"  # --flat-file: the deployment copy beside it, verified
    assert not onnx.load(str(flat)).functions
    saved = onnx.load(str(out))
    _assert_modular(saved, {"ViTModel": TRANSFORMERS_DOMAIN, "ViTLayer": TRANSFORMERS_DOMAIN})
    shape = [d.dim_value for d in saved.graph.input[0].type.tensor_type.shape.dim]
    assert shape == [2, 3, 32, 32]  # --static: the sample's shape
    model = _model(checkpoints["vit"], "image-classification")
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(pixel_values=pixels).logits
    torch.testing.assert_close(torch.from_numpy(_run_file(out, {"pixel_values": pixels})[0]), expected, atol=ATOL, rtol=1e-3)
    torch.testing.assert_close(torch.from_numpy(_run_file(flat, {"pixel_values": pixels})[0]), expected, atol=ATOL, rtol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("checkpoint", "task", "functions"),
    [
        ("bert", "feature-extraction", {"BertEncoder": TRANSFORMERS_DOMAIN, "BertLayer": TRANSFORMERS_DOMAIN}),
        ("bert", "masked-lm", {"BertModel": TRANSFORMERS_DOMAIN, "BertOnlyMLMHead": TRANSFORMERS_DOMAIN}),
        ("t5", "seq2seq-lm", {"T5Stack": TRANSFORMERS_DOMAIN, "T5Block": TRANSFORMERS_DOMAIN}),
        ("llama", "causal-lm", {"LlamaModel": TRANSFORMERS_DOMAIN}),
    ],
)
def test_cli_tasks_dynamic(checkpoints, tmp_path, checkpoint, task, functions):
    out = tmp_path / "m.onnx"
    assert main(["export", str(checkpoints[checkpoint]), "--task", task, "-o", str(out), "--json", "-"]) == 0
    saved = onnx.load(str(out))
    _assert_modular(saved, functions)
    # Other batch and sequence sizes than the export's, against PyTorch.
    model = _model(checkpoints[checkpoint], task)
    generator = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 96, (3, 9), generator=generator)
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if task == "seq2seq-lm":
        kwargs["decoder_input_ids"] = torch.randint(0, 96, (3, 4), generator=generator)
    with torch.no_grad():
        expected = model(**kwargs, **({"use_cache": False} if "lm" in task and task != "masked-lm" else {}))
    first = expected[0]
    actual = torch.from_numpy(_run_file(out, kwargs)[0])
    torch.testing.assert_close(actual, first, atol=ATOL, rtol=1e-3)


@pytest.mark.slow
def test_cli_generation_folder(checkpoints, tmp_path, capsys):
    out = tmp_path / "gen"
    assert main(["export", str(checkpoints["llama"]), "--task", "causal-lm", "--generation", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "of weights are read from prefill.onnx.data, stored once)" in printed, printed
    assert {"prefill.onnx", "decode.onnx", "export.json", "config.json"} <= set(os.listdir(out))
    for name in ("prefill", "decode"):
        saved = onnx.load(str(out / f"{name}.onnx"))
        _assert_modular(saved, {"LlamaDecoderLayer": TRANSFORMERS_DOMAIN})
        params = {d.dim_param for v in (*saved.graph.input, *saved.graph.output) for d in v.type.tensor_type.shape.dim}
        assert "batch_size" in params and not [p for p in params if re.fullmatch(r"s\d+", p)], params  # Optimum's names
        ort.InferenceSession(str(out / f"{name}.onnx"), providers=["CPUExecutionProvider"])  # each component alone
    # One copy of the weights: decode reads every tensor it shares with prefill from prefill.onnx.data.
    decode = onnx.load(str(out / "decode.onnx"), load_external_data=False)
    locations = {
        {e.key: e.value for e in t.external_data}["location"]
        for t in decode.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
    }
    assert locations == {"prefill.onnx.data", "decode.onnx.data"}, locations  # from_pretrained needs the latter
    assert (out / "decode.onnx.data").stat().st_size * 10 < (out / "prefill.onnx.data").stat().st_size  # what differs
    model = _model(checkpoints["llama"], "causal-lm")
    ids = torch.randint(0, 96, (2, 4), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                                  min_new_tokens=8)
    assert torch.equal(hf.greedy_generate(ExportedModel.from_pretrained(out), ids, 8), expected)


# -- errors -----------------------------------------------------------------------------------


def test_hub_id_not_in_cache_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(InvalidInputError, match="never downloads"):
        hf.load_checkpoint("onnx-modular-tests/not-a-cached-model", "causal-lm")
    code = main(["export", "onnx-modular-tests/not-a-cached-model", "--task", "causal-lm", "-o", str(tmp_path / "m.onnx")])
    assert code == 2 and "never downloads" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_checkpoint_errors(checkpoints, tmp_path, capsys):
    with pytest.raises(InvalidInputError, match="no config.json"):
        hf.load_checkpoint(tmp_path, "causal-lm")
    with pytest.raises(InvalidInputError, match="has no AutoModelForMaskedLM"):
        hf.load_checkpoint(checkpoints["llama"], "masked-lm")
    assert main(["export", str(checkpoints["llama"]), "--task", "translation", "-o", str(tmp_path / "m.onnx")]) == 2
    assert "Unknown task 'translation'" in capsys.readouterr().err  # without --task, it is inferred
    assert main(["export", str(checkpoints["llama"]), "--task", "causal-lm", "--generation", "-o", str(tmp_path / "m.onnx")]) == 2
    assert "must be a folder" in capsys.readouterr().err
    assert main(["export", str(checkpoints["vit"]), "--task", "image-classification", "--generation", "-o", str(tmp_path / "g")]) == 2
    assert "does not generate" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.slow  # a fresh interpreter imports torch (~10 s)
def test_missing_transformers_is_a_typed_error():
    # An interpreter where `import transformers` fails, as it does without the [hf] extra.
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from onnx_modular.errors import MissingDependencyError\n"
        "try:\n    import onnx_modular.hf\nexcept MissingDependencyError as e:\n    print('typed:', e)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "typed:" in done.stdout and "onnx-modular[hf]" in done.stdout, done.stderr
    assert issubclass(MissingDependencyError, OnnxModularError) and issubclass(MissingDependencyError, ImportError)
