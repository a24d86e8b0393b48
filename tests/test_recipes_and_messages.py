"""The guide's recipes as written (streamed bfloat16 checkpoints, Optimum's task, dtype and axis names,
the decode files sharing the prefill's weights), and what the command line prints and writes on each
path (a flat file reported, an unsupported task, a Hub id, a parity failure, a call at a wrong shape)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

transformers = pytest.importorskip("transformers")

from onnx_modular import export_modular  # noqa: E402
from onnx_modular.check.widen import WidenFloatPass  # noqa: E402
from onnx_modular.cli import main  # noqa: E402
from onnx_modular.format import metadata  # noqa: E402
from onnx_modular.hf.meta import model_on_meta  # noqa: E402

LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128, max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    """A tiny random Llama saved in bfloat16 (the usual format of big checkpoints), in two shards."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama_bf16")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).to(torch.bfloat16).eval()
    model.save_pretrained(path, max_shard_size="100KB")
    return path


def _widened_outputs(path, feeds):
    """Run a bfloat16 file in onnxruntime widened to float32 (its CPU provider has no bfloat16 kernels)."""
    model = ir.load(path)
    WidenFloatPass()(model)
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _float32_on_bf16_weights(folder):
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).float().eval()


def test_streamed_bfloat16_guide_snippet(bf16_folder, tmp_path):
    """The guide's `model_on_meta` + `weights=` snippet on a bfloat16 checkpoint: exported, checked block
    by block on float32-widened pieces, the file's weights stay bfloat16 in its external data."""
    model = model_on_meta(bf16_folder)
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    path = tmp_path / "llama.onnx"
    result = export_modular(model, (ids,), path, kwargs={"use_cache": False}, weights=str(bf16_folder))
    assert result.blocks.ok and result.report.ok
    assert result.report.reference == "PyTorch float32" and "float32-widened" in result.report.note
    assert all(p.is_meta for p in model.parameters())  # the weights were streamed, never loaded whole
    saved = onnx.load(str(path), load_external_data=False)
    weights = [t for t in saved.graph.initializer if t.data_type == onnx.TensorProto.BFLOAT16]
    big = [t for t in weights if np.prod(t.dims) >= 1024]
    assert big and all(t.data_location == onnx.TensorProto.EXTERNAL for t in big)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama.onnx", "llama.onnx.data"]  # no piece left behind
    (logits,) = _widened_outputs(path, {"input_ids": ids.numpy()})
    with torch.no_grad():
        expected = _float32_on_bf16_weights(bf16_folder)(input_ids=ids, use_cache=False).logits
    np.testing.assert_allclose(logits, expected.numpy(), atol=5e-3, rtol=1e-3)


def test_streamed_bfloat16_cli(bf16_folder, tmp_path, capsys):
    """`export <bf16 checkpoint> --stream-weights` (the task inferred: causal-lm-with-past) exports and
    verifies, where it failed after the whole capture with `Numpy_type 256`."""
    out = tmp_path / "m.onnx"
    assert main(["export", str(bf16_folder), "--stream-weights", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Block-by-block parity" in printed and "float32-widened" in printed and "PASS" in printed
    data = out.with_name("m.onnx.data").stat().st_size
    assert data > 150_000  # 90k bfloat16 weights
    assert f"Wrote {out} ({(out.stat().st_size + data) / 1e6:.1f} MB)" in printed  # the .data file counted


@pytest.fixture(scope="module")
def f32_folder(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama_f32")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval().save_pretrained(path)
    return path


def test_checkpoint_flat_file_is_reported(f32_folder, tmp_path, capsys):
    """`--flat-file` on the checkpoint path prints the flat copy's parity and its "Wrote" line, and
    `--json` has `flat_path` and `flat_report` (docs/cli.md promises them)."""
    out = tmp_path / "m.onnx"
    assert main(["export", str(f32_folder), "--task", "causal-lm", "-o", str(out), "--flat-file"]) == 0
    printed = capsys.readouterr().out
    flat = tmp_path / "m.flat.onnx"
    assert flat.is_file()
    assert "Flat copy: Parity against PyTorch" in printed
    assert f"Wrote {flat} (" in printed and "every call inlined, optimized" in printed
    out2 = tmp_path / "j.onnx"
    assert main(["export", str(f32_folder), "--task", "causal-lm", "-o", str(out2), "--flat-file", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["flat_path"] == str(tmp_path / "j.flat.onnx") and report["flat_report"]["ok"] is True
    assert [o["name"] for o in report["flat_report"]["outputs"]] == ["logits"]


@pytest.fixture(scope="module")
def whisper_folder(tmp_path_factory):
    config = transformers.WhisperConfig(
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=100, num_mel_bins=8, max_source_positions=16,
        max_target_positions=16, pad_token_id=1, bos_token_id=2, eos_token_id=3, decoder_start_token_id=2,
    )
    path = tmp_path_factory.mktemp("whisper")
    transformers.WhisperForConditionalGeneration(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("task", [None, "feature-extraction", "seq2seq-lm"])
def test_unsupported_task_names_what_fits(whisper_folder, tmp_path, capsys, task):
    """Whisper: its inferred task (seq2seq-lm) and feature-extraction (WhisperModel takes
    input_features) are refused before loading (exit 2, no traceback), naming the tasks that do fit."""
    options = [] if task is None else ["--task", task]
    assert main(["export", str(whisper_folder), *options, "-o", str(tmp_path / "w.onnx")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err
    assert "cannot be exported for task" in err
    assert "--task causal-lm (WhisperForCausalLM)" in err and "feature-extraction (" not in err
    if task == "feature-extraction":
        assert "WhisperModel.forward takes input_features, where the checkpoint export makes input_ids" in err
    assert list(tmp_path.iterdir()) == []


def test_supported_tasks_of_configs():
    from onnx_modular.hf.checkpoint import supported_tasks

    llama = supported_tasks(transformers.LlamaConfig(**LLAMA))
    assert llama == {"feature-extraction": "LlamaModel", "causal-lm": "LlamaForCausalLM",
                     "causal-lm-with-past": "LlamaForCausalLM"}
    assert set(supported_tasks(transformers.BertConfig())) == {"feature-extraction", "masked-lm", "causal-lm", "causal-lm-with-past"}
    assert set(supported_tasks(transformers.ViTConfig())) == {"feature-extraction", "image-classification"}


def test_optimum_dtype_spelling_and_recorded_tolerance(f32_folder, tmp_path, capsys):
    """`--dtype fp16` (Optimum's spelling) exports in float16; export.json records the tolerance the
    check used (float16's default), not null."""
    out = tmp_path / "out"
    assert main(["export", str(f32_folder), "--task", "causal-lm", "--dtype", "fp16", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "PASS" in printed
    saved = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert saved.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    manifest = json.loads((out / "export.json").read_text())["components"]["model"]["metadata"]["export_config"]
    from onnx_modular.check.parity import default_tolerance

    expected = default_tolerance("float16")
    assert (manifest["atol"], manifest["rtol"]) == (expected.atol, expected.rtol)
    assert f"{expected.atol:.0e}/{expected.rtol:.0e}" in printed


def test_hub_id_says_download_first(tmp_path, capsys):
    assert main(["export", "openai-community/gpt2", "-o", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err
    assert "neither a checkpoint folder nor a factory" in err and "never downloads" in err
    assert "hf download openai-community/gpt2 --local-dir gpt2" in err
    assert list(tmp_path.iterdir()) == []


def test_cli_parity_failure_names_keep_on_mismatch():
    """The command line's parity hint gives its options, not Python advice (`error.result.save`)."""
    import argparse

    from onnx_modular.cli import _for_the_command_line
    from onnx_modular.errors import ParityError

    error = ParityError("onnxruntime results differ from PyTorch", hint="Inspect error.report; error.result.save(path)")
    text = _for_the_command_line(error, argparse.Namespace(keep_on_mismatch=False))
    assert "--keep-on-mismatch" in text and "error.result" not in text and "--atol/--rtol" in text
    kept = _for_the_command_line(error, argparse.Namespace(keep_on_mismatch=True))
    assert "was kept" in kept and "error.result" not in kept
    assert "error.result" in _for_the_command_line(error, argparse.Namespace())  # other commands: as raised


def test_result_call_at_a_wrong_shape_is_an_input_error(tmp_path):
    """`result(x)` at a shape the (static) export does not take: an InvalidInputError naming the
    input ([input], as verify says it), not onnxruntime's raw text."""
    from onnx_modular.errors import InvalidInputError

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()).eval()
    x = torch.randn(2, 8)
    result = export_modular(model, (x,), tmp_path / "m.onnx")
    np.testing.assert_allclose(result(x)[0].numpy(), model(x).detach().numpy(), atol=1e-5)
    with pytest.raises(InvalidInputError, match=r"\[input\] Input 'input' has shape \[3, 5\] but the model declares \[2, 8\]"):
        result(torch.randn(3, 5))
    with pytest.raises(InvalidInputError, match="takes 1 input tensors"):
        result(x, x)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.linear(x))


def test_exported_file_holds_no_absolute_path_of_this_machine(tmp_path):
    """`pkg.onnx_modular.source` and torch's stack traces are stored relative to the import root
    (site-packages, the project folder): the exporting machine's folders do not ship with the model."""
    import os
    import pathlib

    model = torch.nn.Sequential(_Block(), _Block()).eval()
    path = tmp_path / "m.onnx"
    export_modular(model, (torch.randn(2, 4),), path, flat_file=True)
    site_packages = str(pathlib.Path(torch.__file__).parents[1])
    here = os.path.dirname(os.path.abspath(__file__))
    for file in (path, tmp_path / "m.flat.onnx"):
        saved = onnx.load(str(file), load_external_data=False)
        values = [p.value for p in saved.metadata_props]
        for owner in (*saved.functions, saved.graph):
            values += [p.value for p in getattr(owner, "metadata_props", [])]
            values += [p.value for node in owner.node for p in node.metadata_props]
        assert not [v for v in values if site_packages in v or here in v], file
        traces = [v for v in values if v.startswith("File ") or 'File "' in v]
        assert traces and any('File "torch/nn/modules/linear.py"' in v for v in traces)
    saved = onnx.load(str(path), load_external_data=False)
    sources = {p.value for f in saved.functions for p in f.metadata_props if p.key == metadata.SOURCE}
    sources |= {p.value for n in saved.graph.node for p in n.metadata_props if p.key == metadata.SOURCE}
    assert any(s.startswith("test_recipes_and_messages.py:") for s in sources), sources
    assert any(s.startswith("torch/nn/modules/linear.py:") for s in sources), sources


def test_generation_components_get_optimum_axis_names():
    """`--generation` goes through transformers' exporter with every axis Dim.AUTO (torch's `s44`):
    each component's axes are renamed as the single-file path names them."""
    from onnx_modular.hf.cache_axes import generation_axis_names
    from onnx_modular.passes.export.dynamic_axes import RenameDynamicAxesPass

    def value(name, dtype, dims):
        return ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(dims))

    for cache in ("past_key_values", "cache"):  # the cache's name in transformers 5.23, and 5.24
        keys = value(f"input.{cache}.layers.0.keys", ir.DataType.FLOAT, ["s44", 2, "s31", 16])
        inputs = [value("input_ids", ir.DataType.INT64, ["s44", 1]),
                  value("attention_mask", ir.DataType.INT64, ["s44", "s70"]), keys]
        node = ir.node("Identity", [keys], outputs=[value(f"output.{cache}.layers.0.keys", ir.DataType.FLOAT,
                                                          ["s44", 2, "s31 + 1", 16])])
        model = ir.Model(ir.Graph(inputs, node.outputs, nodes=[node], opset_imports={"": 18}), ir_version=10)
        assert generation_axis_names(model) == {
            "s44": "batch_size", "s70": "past_sequence_length + sequence_length", "s31": "past_sequence_length",
        }
        RenameDynamicAxesPass(generation_axis_names(model))(model)
        dims = [str(d) for v in (*model.graph.inputs, *model.graph.outputs) for d in v.shape]
        assert not [d for d in dims if d.startswith("s") and d[1:2].isdigit()]
        assert [str(d) for d in model.graph.outputs[0].shape] == ["batch_size", "2", "past_sequence_length + 1", "16"]


def test_causal_lm_with_past_is_supported_whatever_the_cache_is_called():
    """transformers 5.24 renamed forward's `past_key_values` to `cache`: the checkpoint command refused
    every decoder for `causal-lm-with-past` there (the task it infers for `*ForCausalLM`), saying
    "LlamaForCausalLM.forward takes no past_key_values" (README set-up installs 5.24). Under 5.23 this
    passes either way; `bash scripts/test-transformers.sh 5.24.0` runs it where it failed."""
    from onnx_modular.hf.checkpoint import supported_tasks

    tasks = supported_tasks(transformers.LlamaConfig(**LLAMA))
    assert tasks["causal-lm-with-past"] == "LlamaForCausalLM"


def test_relative_column_leaves_out_values_the_absolute_tolerance_judges():
    """A float16 output near 0 (1e-4, off by 3e-3) passes on atol: its row no longer shows a relative
    error of 30 beside PASS; a real relative error (on a value above atol) is still shown."""
    from onnx_modular.check.parity import compare_outputs, default_tolerance

    expected = np.array([1e-4, 1.0, -2.0], dtype=np.float16)
    actual = np.array([3.1e-3, 1.001, -2.0], dtype=np.float16)
    report = compare_outputs(["logits"], [actual], None, [expected])
    (row,) = report.outputs
    assert row.ok and default_tolerance("float16").atol > 1e-4
    assert row.modular_max_abs == pytest.approx(3e-3, rel=0.05)
    assert row.modular_max_rel < 1e-2  # 1.001 vs 1.0 in float16, not 3e-3 / 1e-4
    far = compare_outputs(["logits"], [np.array([1.0, 1.5], np.float32)], None, [np.array([1.0, 1.0], np.float32)])
    assert far.outputs[0].modular_max_rel == pytest.approx(0.5, rel=1e-3) and not far.outputs[0].ok


# -- one weights file for the generation components (item 5) --------------------------------------


def _component(weights: dict[str, np.ndarray], scale: float) -> onnx.ModelProto:
    """A small model ``y = (x @ w0 + b) * scale`` whose initializers are ``weights`` (names chosen by
    the caller: equal bytes under other names must still be shared)."""
    from onnx import helper

    names = list(weights)
    nodes = [
        helper.make_node("MatMul", ["x", names[0]], ["h"]),
        helper.make_node("Add", ["h", names[1]], ["a"]),
        helper.make_node("Mul", ["a", "scale"], ["y"]),
    ]
    inits = [onnx.numpy_helper.from_array(value, name) for name, value in weights.items()]
    inits.append(onnx.numpy_helper.from_array(np.array(scale, np.float32), "scale"))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 16])], inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _save_components(folder, models: dict[str, onnx.ModelProto]) -> None:
    folder.mkdir(exist_ok=True)
    for name, model in models.items():  # as transformers' OnnxExporter.save_program: <name>.onnx.data each
        _save_external(model, folder / name, f"{name}.data")


def _save_external(model: onnx.ModelProto, path, location: str) -> None:
    copy = onnx.ModelProto.FromString(model.SerializeToString())  # onnx.save moves the values out of the proto
    onnx.save(copy, str(path), save_as_external_data=True, location=location, size_threshold=0)


def _run(path) -> np.ndarray:
    x = np.arange(32, dtype=np.float32).reshape(2, 16) / 32
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _locations(path) -> dict[str, str]:
    model = onnx.load(str(path), load_external_data=False)
    return {
        t.name: {e.key: e.value for e in t.external_data}["location"]
        for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
    }


def test_decode_reads_the_weights_it_shares_from_prefill_data(tmp_path):
    """Item 5: `--generation` stored the weights twice. The decode component now reads every tensor
    whose bytes equal one of prefill's (matched by content, whatever its name) from prefill.onnx.data;
    only the others stay in decode.onnx.data. Each file still runs alone in onnxruntime, a second
    export over the folder keeps it whole, and a later save of prefill.onnx alone keeps the data
    decode reads."""
    from onnx_modular.storage import save
    from onnx_modular.storage.shared_data import share_external_data

    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((16, 16)).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    own = rng.standard_normal(16).astype(np.float32)
    prefill = _component({"model.w": w, "model.b": b}, 1.0)
    decode = _component({"w_renamed": w, "bias_of_decode": own}, 2.0)  # w shared under another name, b not
    staged = tmp_path / "staged"
    _save_components(staged, {"prefill.onnx": prefill, "decode.onnx": decode})
    expected = {name: _run(staged / name) for name in ("prefill.onnx", "decode.onnx")}
    before = sum(f.stat().st_size for f in staged.iterdir())

    shared = share_external_data(staged, ["prefill.onnx", "decode.onnx"])
    assert shared.shared == {"decode.onnx": (1, w.nbytes)}
    assert _locations(staged / "decode.onnx") == {
        "w_renamed": "prefill.onnx.data", "bias_of_decode": "decode.onnx.data", "scale": "decode.onnx.data",
    }
    assert before - sum(f.stat().st_size for f in staged.iterdir()) >= w.nbytes - 64  # (protobuf: a few bytes more)

    out = tmp_path / "out"
    for _ in range(2):  # a first export, then one over the folder it wrote (data names taken by the first)
        save.publish_folder(staged, out)
        assert sorted(p.name for p in out.iterdir()) == ["decode.onnx", "decode.onnx.data", "prefill.onnx", "prefill.onnx.data"]
        assert _locations(out / "decode.onnx")["w_renamed"] == "prefill.onnx.data"
        assert _locations(out / "decode.onnx")["bias_of_decode"] == "decode.onnx.data"
        for name, values in expected.items():
            np.testing.assert_array_equal(_run(out / name), values)  # each file alone, bit for bit
    shutil.rmtree(staged)  # (the staged folder's hard links are what onnx's checker would refuse)
    for name in expected:
        onnx.checker.check_model(str(out / name), full_check=True)

    # prefill.onnx saved alone (another tool writing over it): the data decode reads is kept.
    with save.atomic_write(out / "prefill.onnx") as staging:
        _save_external(prefill, staging.model_path, staging.data_location)
    assert _locations(out / "prefill.onnx")["model.w"] != "prefill.onnx.data"
    np.testing.assert_array_equal(_run(out / "decode.onnx"), expected["decode.onnx"])


def test_all_shared_leaves_decode_without_a_data_file(tmp_path):
    """When every tensor of decode is one of prefill's (the usual case), decode has no data file of
    its own, or only its smallest tensor there with ``keep_data_file``."""
    from onnx_modular.storage import save
    from onnx_modular.storage.shared_data import share_external_data

    rng = np.random.default_rng(1)
    weights = {"w": rng.standard_normal((16, 16)).astype(np.float32), "b": rng.standard_normal(16).astype(np.float32)}
    staged = tmp_path / "staged"
    _save_components(staged, {"prefill.onnx": _component(weights, 3.0), "decode.onnx": _component(weights, 3.0)})
    expected = _run(staged / "decode.onnx")
    kept = tmp_path / "kept"
    shutil.copytree(staged, kept)
    share_external_data(staged, ["prefill.onnx", "decode.onnx"])
    assert not (staged / "decode.onnx.data").exists()
    save.publish_folder(staged, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["decode.onnx", "prefill.onnx", "prefill.onnx.data"]
    assert set(_locations(tmp_path / "out" / "decode.onnx").values()) == {"prefill.onnx.data"}
    np.testing.assert_array_equal(_run(tmp_path / "out" / "decode.onnx"), expected)

    # keep_data_file (transformers' from_pretrained wants decode.onnx.data): the smallest tensor stays there.
    share_external_data(kept, ["prefill.onnx", "decode.onnx"], keep_data_file=True)
    locations = _locations(kept / "decode.onnx")
    assert locations == {"w": "prefill.onnx.data", "b": "prefill.onnx.data", "scale": "decode.onnx.data"}
    assert (kept / "decode.onnx.data").stat().st_size == 4  # the float32 scalar
    np.testing.assert_array_equal(_run(kept / "decode.onnx"), expected)

    # Published over the folder whose decode had no data file, then again: every data file ends under
    # its conventional name (from_pretrained looks for decode.onnx.data), nothing stale is left.
    for _ in range(2):
        save.publish_folder(kept, tmp_path / "out")
        names = sorted(p.name for p in (tmp_path / "out").iterdir())
        assert names == ["decode.onnx", "decode.onnx.data", "prefill.onnx", "prefill.onnx.data"], names
        assert _locations(tmp_path / "out" / "decode.onnx")["scale"] == "decode.onnx.data"
        np.testing.assert_array_equal(_run(tmp_path / "out" / "decode.onnx"), expected)
