"""The transformers sweep (scripts/sweep_transformers.py) on its sample of ~20 architectures:
decoder, encoder, encoder-decoder, vision, audio, multimodal, state-space and mixture-of-experts
models, each from a tiny config with random weights. export_modular must export every one with
parity (its own check: onnxruntime, modular and inlined copy, against PyTorch, float32 atol 1e-4 /
rtol 1e-3) and one function per module call. The full sweep, with torch's flat export beside it
in bounded child processes, is script-only (docs/coverage.md)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import helpers
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
transformers = pytest.importorskip("transformers")


sweep = helpers.load_sweep()
BASE = {model_type: class_name for model_type, class_name, task in sweep.architectures(heads=False) if model_type in sweep.SAMPLE}


def test_sample_is_diverse():
    assert len(sweep.SAMPLE) >= 18 and set(sweep.SAMPLE) <= set(BASE)


@pytest.mark.parametrize("model_type", sweep.SAMPLE)
def test_sample_exports_with_parity(model_type):
    from onnx_modular import export_modular

    model, inputs, _ = sweep.build(model_type, BASE[model_type])
    calls = sum(1 for _ in model.modules())
    result = export_modular(model, (), kwargs=inputs)
    assert result.report.ok, str(result.report)
    assert result.model.functions and sweep._depth(result.hierarchy.root) >= 2
    assert len(result.model.functions) < calls  # one function per distinct module call, deduplicated


def test_tiny_config_shrinks_by_the_rules():
    config = sweep.tiny_config("llama")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (32, 2, 2, 1)
    assert config.intermediate_size == 64 and config.vocab_size == 512
    clip = sweep.tiny_config("clip")  # sub-configs shrink too
    assert clip.text_config.hidden_size == 32 and clip.vision_config.image_size == 32


def test_tiny_config_keeps_what_an_architecture_needs():
    # a hybrid keeps one layer of each kind (an attention layer beside its linear ones)
    hybrid = sweep.tiny_config("olmo_hybrid")
    assert hybrid.num_hidden_layers == len(hybrid.layer_types) == 2
    assert set(hybrid.layer_types) == {"linear_attention", "full_attention"}
    # multi-head latent attention keeps as many key heads as query heads
    deepseek = sweep.tiny_config("deepseek_v3")
    assert deepseek.num_key_value_heads == deepseek.num_attention_heads == 2
    # per-layer settings follow the kept layers, renumbered
    gemma = sweep.tiny_config("gemma4").text_config
    assert gemma.layer_types == ["sliding_attention", "full_attention"] and len(gemma.per_layer_config) == 2
    sliding, full = (gemma.per_layer_config[i].to_dict()["head_dim"] for i in range(2))
    assert sliding == gemma.to_dict()["head_dim"] != full  # the full-attention layer's own head size
    # a backbone's outputs are stages it has
    backbone = sweep.tiny_config("depth_anything").backbone_config
    assert backbone.num_hidden_layers == 4 and backbone.out_features == ["stage1", "stage2", "stage3", "stage4"]


def test_heads_get_inputs_of_their_shape():
    model, inputs, expected = sweep.build("bert", "BertForMultipleChoice")
    assert inputs["input_ids"].shape == (sweep.BATCH, 2, sweep.SEQUENCE) and expected[0].shape == (sweep.BATCH, 2)
    model, inputs, expected = sweep.build("qwen2", "Qwen2ForSequenceClassification")  # batch 2 needs a padding id
    assert model.config.pad_token_id == 0 and expected[0].shape[0] == sweep.BATCH


def test_compare_lists_regressions():
    Row = sweep.Row
    old = [Row("llama", "LlamaModel", "base", True, True, True), Row("bert", "BertModel", "base", True, True, True)]
    new = [Row("llama", "LlamaModel", "base", True, True, False, error="ParityError: x"), Row("bert", "BertModel", "base", True, True, True)]
    assert sweep.regressions(old, new) == ["LlamaModel (llama): modular regressed: ParityError: x"]


def test_report_files(tmp_path):
    rows = [
        sweep.Row("llama", "LlamaModel", "base", True, True, True, functions=11, depth=3, max_abs=5e-7, seconds=3),
        sweep.Row("rwkv", "RwkvModel", "base", True, True, False, stage="verify", error="ParityError: drift"),
    ]
    environment = {"commit": "abc", "torch": "t", "transformers": "x", "onnxscript": "o", "onnxruntime": "r", "date": "d"}
    sweep.write_markdown(tmp_path / "c.md", rows, environment, planned=5)
    sweep.write_json(tmp_path / "c.json", rows, environment, planned=5)
    text = (tmp_path / "c.md").read_text()
    assert text.index("## Totals") < text.index("## Every architecture")
    assert "| 2 | 5 | 2 | 2 | 1 | 1 | 1 | 0 |" in text and "`RwkvModel` (rwkv): verify: ParityError: drift" in text
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["totals"]["flat_only"] == 1 and [r.class_name for r in sweep.read_rows(tmp_path / "c.json")] == ["LlamaModel", "RwkvModel"]


@pytest.mark.slow
def test_sweep_script_on_the_sample_in_children(tmp_path):
    # both exporters in bounded children; nothing torch's flat export handles fails in ours
    output = tmp_path / "coverage.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "sweep_transformers.py"), "--sample", "--output", str(output)],
        capture_output=True, text=True, timeout=3600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    totals = json.loads(output.with_suffix(".json").read_text())["totals"]
    assert totals["tried"] == len(sweep.SAMPLE) and totals["flat_only"] == 0, totals
