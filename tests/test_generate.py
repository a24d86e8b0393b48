"""``onnx_modular.generate`` / ``onnx-modular generate``: greedy decoding in onnxruntime with the
with-cache files the exporter writes, as the user guide's "Ship a decoder" recipe runs them: a
tiny random-weight Llama (2 layers, hidden 64) saved with ``save_pretrained``, exported as one
``causal-lm-with-past`` file and as a ``--generation`` folder; the tokens are transformers'
``model.generate`` greedy tokens. The folder converted to int4 component by component loads with
``ExportedModel.from_pretrained`` and decodes as ``generate`` decodes it."""

from __future__ import annotations

import io
import shutil

import numpy as np
import onnx
import pytest
import torch

transformers = pytest.importorskip("transformers")

import onnx_modular  # noqa: E402
from onnx_modular.cli import main  # noqa: E402
from onnx_modular.errors import InvalidInputError  # noqa: E402
from onnx_modular.runtime.generation import cache_key  # noqa: E402

PROMPT = np.array([[5, 17, 33, 2], [9, 41, 7, 63]], np.int64)
NEW = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("generate") / "ckpt"
    model.save_pretrained(folder)
    with torch.no_grad():
        expected = model.generate(
            torch.from_numpy(PROMPT), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=None, pad_token_id=0
        )
    return folder, expected.numpy()


def test_cache_names_pair_inputs_with_outputs():
    assert cache_key("input.past_key_values.layers.0.keys") == cache_key("output.past_key_values.layers.0.keys")
    assert cache_key("input.cache.layers.1.values") == cache_key("output.cache.layers.1.values") == "cache.layers.1.values"
    assert cache_key("past_key_values.0.key") == cache_key("present.0.key")  # Optimum's names
    assert cache_key("past_key_values.layers.0.keys") == cache_key("input.past_key_values.layers.0.keys")  # prefill -> decode
    assert cache_key("input.cache.layers.0.keys") != cache_key("input.cache.layers.0.values")


def test_one_with_cache_file_generates_transformers_tokens(checkpoint, tmp_path, capsys):
    folder, expected = checkpoint
    path = tmp_path / "llama_kv.onnx"
    assert main(["export", str(folder), "--task", "causal-lm-with-past", "-o", str(path), "--no-verify"]) == 0  # the tokens check it
    inputs = [v.name for v in onnx.load(str(path), load_external_data=False).graph.input]
    assert "position_ids" not in inputs and any(name.startswith("input.") for name in inputs)  # transformers' names
    tokens = onnx_modular.generate(path, PROMPT, max_new_tokens=NEW)
    assert tokens.dtype == np.int64 and tokens.shape == (2, PROMPT.shape[1] + NEW)
    np.testing.assert_array_equal(tokens, expected)
    # one sequence as a flat list, and the command line
    np.testing.assert_array_equal(onnx_modular.generate(path, PROMPT[0].tolist(), max_new_tokens=3), expected[:1, :7])
    capsys.readouterr()
    assert main(["generate", str(path), "--input-ids", "5,17,33,2", "--max-new-tokens", str(NEW)]) == 0
    assert capsys.readouterr().out.strip() == f"prompt 5,17,33,2 -> new {','.join(map(str, expected[0, 4:]))}"

    # progress: one call per new token, in order; the command line's reporter prints a line from it
    calls = []
    onnx_modular.generate(path, PROMPT, max_new_tokens=NEW, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(k, NEW) for k in range(1, NEW + 1)]
    from onnx_modular.cli.progress import TokenProgress

    lines = io.StringIO()
    np.testing.assert_array_equal(
        onnx_modular.generate(path, PROMPT, max_new_tokens=NEW, progress=TokenProgress(lines, after=0, interval=0)), expected)
    printed = lines.getvalue().splitlines()
    assert len(printed) == NEW and printed[-1].startswith(f"  generate: {NEW} of {NEW} new tokens, ")
    assert "s left" in printed[0] and "s left" not in printed[-1]

    # float16 with the norms kept: the cache inputs keep the dtype the file declares, the loop reads it
    half = tmp_path / "llama_kv.f16.onnx"
    assert main(["convert", str(path), "-o", str(half), "--dtype", "float16", "--keep", "LlamaRMSNorm", "--no-verify"]) == 0
    assert onnx_modular.generate(half, PROMPT, max_new_tokens=NEW).shape == expected.shape


def test_generation_folder_and_its_int4_conversion(checkpoint, tmp_path):
    from transformers.exporters import ExportedModel

    import onnx_modular.hf as hf

    folder, expected = checkpoint
    gen = tmp_path / "gen"
    assert main(["export", str(folder), "--task", "causal-lm-with-past", "--generation", "-o", str(gen), "--no-verify"]) == 0
    np.testing.assert_array_equal(onnx_modular.generate(gen, PROMPT, max_new_tokens=NEW), expected)
    np.testing.assert_array_equal(onnx_modular.generate(gen / "prefill.onnx", PROMPT, max_new_tokens=1), expected[:, :5])

    # the guide's recipe: every component converted into a new folder beside copies of the JSON files
    q4 = tmp_path / "gen-int4"
    q4.mkdir()
    for name in ("config.json", "export.json", "generation_config.json"):
        shutil.copy(gen / name, q4 / name)
    for component in ("prefill", "decode"):  # decode.onnx reads tensors from prefill.onnx.data
        assert main(["convert", str(gen / f"{component}.onnx"), "-o", str(q4 / f"{component}.onnx"),
                     "--quantize", "int4", "--exclude", "lm_head", "--no-verify"]) == 0
        saved = onnx.load(str(q4 / f"{component}.onnx"), load_external_data=False)
        assert any(node.op_type == "MatMulNBits" for f in saved.functions for node in f.node)
    tokens = onnx_modular.generate(q4, PROMPT, max_new_tokens=NEW)
    assert tokens.shape == expected.shape and np.array_equal(tokens[:, :4], PROMPT)
    loaded = ExportedModel.from_pretrained(q4)
    np.testing.assert_array_equal(hf.greedy_generate(loaded, torch.from_numpy(PROMPT), NEW).numpy(), tokens)


def test_what_generate_refuses(tmp_path):
    with pytest.raises(InvalidInputError, match="does not exist") as missing:
        onnx_modular.generate(tmp_path / "nope.onnx", [[1, 2]], max_new_tokens=2)
    assert "causal-lm-with-past" in missing.value.hint
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidInputError, match="prefill.onnx and decode.onnx"):
        onnx_modular.generate(tmp_path / "empty", [[1, 2]], max_new_tokens=2)
