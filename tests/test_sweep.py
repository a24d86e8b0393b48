"""The transformers sweep's catalogue (tests/catalogue/, run by scripts/sweep_transformers.py) on its
sample of ~20 architectures: decoder, encoder, encoder-decoder, vision, audio, multimodal,
state-space and mixture-of-experts models, each from a tiny config with random weights.
export_modular must export every one with parity (its own check: onnxruntime, modular and inlined
copy, against PyTorch, float32 atol 1e-4 / rtol 1e-3) and one function per module call. The full
sweep, with torch's flat export beside it in bounded child processes, is script-only
(docs/coverage.md)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys

import pytest
from catalogue import building, coverage, jobs, overrides, reference_outputs, tools_phase

ROOT = pathlib.Path(__file__).resolve().parent.parent
transformers = pytest.importorskip("transformers")


BASE = {model_type: class_name for model_type, class_name, task in jobs.architectures(heads=False) if model_type in overrides.SAMPLE}


def test_sample_is_diverse():
    assert len(overrides.SAMPLE) >= 18 and set(overrides.SAMPLE) <= set(BASE)


@pytest.mark.parametrize("model_type", overrides.SAMPLE)
def test_sample_exports_with_parity(model_type):
    from onnx_modular import export_modular

    model, inputs, _ = building.build(model_type, BASE[model_type])
    calls = sum(1 for _ in model.modules())
    result = export_modular(model, (), kwargs=inputs)
    assert result.report.ok, str(result.report)
    assert result.model.functions and reference_outputs.call_depth(result.hierarchy.root) >= 2
    assert len(result.model.functions) < calls  # one function per distinct module call, deduplicated


def test_tiny_config_shrinks_by_the_rules():
    config = building.tiny_config("llama")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (32, 2, 2, 1)
    assert config.intermediate_size == 64 and config.vocab_size == 512
    clip = building.tiny_config("clip")  # sub-configs shrink too
    assert clip.text_config.hidden_size == 32 and clip.vision_config.image_size == 32


def test_tiny_config_keeps_what_an_architecture_needs():
    # a hybrid keeps one layer of each kind (an attention layer beside its linear ones)
    hybrid = building.tiny_config("olmo_hybrid")
    assert hybrid.num_hidden_layers == len(hybrid.layer_types) == 2
    assert set(hybrid.layer_types) == {"linear_attention", "full_attention"}
    # multi-head latent attention keeps as many key heads as query heads
    deepseek = building.tiny_config("deepseek_v3")
    assert deepseek.num_key_value_heads == deepseek.num_attention_heads == 2
    # per-layer settings follow the kept layers, renumbered
    gemma = building.tiny_config("gemma4").text_config
    assert gemma.layer_types == ["sliding_attention", "full_attention"] and len(gemma.per_layer_config) == 2
    sliding, full = (gemma.per_layer_config[i].to_dict()["head_dim"] for i in range(2))
    assert sliding == gemma.to_dict()["head_dim"] != full  # the full-attention layer's own head size
    # a backbone's outputs are stages it has
    backbone = building.tiny_config("depth_anything").backbone_config
    assert backbone.num_hidden_layers == 4 and backbone.out_features == ["stage1", "stage2", "stage3", "stage4"]


def test_heads_get_inputs_of_their_shape():
    model, inputs, expected = building.build("bert", "BertForMultipleChoice")
    assert inputs["input_ids"].shape == (overrides.BATCH, 2, overrides.SEQUENCE) and expected[0].shape == (overrides.BATCH, 2)
    model, inputs, expected = building.build("qwen2", "Qwen2ForSequenceClassification")  # batch 2 needs a padding id
    assert model.config.pad_token_id == 0 and expected[0].shape[0] == overrides.BATCH


def test_compare_lists_regressions():
    Row = coverage.Row
    old = [Row("llama", "LlamaModel", "base", True, True, True), Row("bert", "BertModel", "base", True, True, True)]
    new = [Row("llama", "LlamaModel", "base", True, True, False, error="ParityError: x"), Row("bert", "BertModel", "base", True, True, True)]
    assert coverage.regressions(old, new) == ["LlamaModel (llama): modular regressed: ParityError: x"]


def test_rows_differing_from_another_torchs_run_are_swept_again(tmp_path):
    Row = coverage.Row
    text, images = "input_ids,attention_mask", "input_ids,attention_mask,pixel_values"
    kept = [
        Row("bert", "BertModel", "base", True, True, True),  # older: no inputs recorded, text either way
        Row("llava", "LlavaModel", "base", True, True, True),  # older: no inputs recorded, text only then
        Row("gemma4", "Gemma4Model", "base", True, True, True, inputs=text),  # text then, images now
        Row("sam2", "Sam2Model", "base", False, False, False),  # not built then, built now
        Row("t5", "T5Model", "base", True, False, True, inputs=text),  # the same
        Row("vit", "ViTModel", "base", True, True, True, inputs="pixel_values"),  # not in the other run
    ]
    other = [
        Row("bert", "BertModel", "base", True, True, True, inputs=text),
        Row("llava", "LlavaModel", "base", True, False, True, inputs=images),
        Row("gemma4", "Gemma4Model", "base", True, True, True, inputs=images),
        Row("sam2", "Sam2Model", "base", True, True, True, inputs="pixel_values"),
        Row("t5", "T5Model", "base", True, False, True, inputs=text),
    ]
    differ = [("llava", "LlavaModel"), ("gemma4", "Gemma4Model"), ("sam2", "Sam2Model")]
    assert coverage.differing(kept, other) == differ
    # as --redo-differing reads them: both tables from their JSON files, inputs and all
    table, reference = tmp_path / "cov.json", tmp_path / "other.json"
    coverage.write_json(table, kept, {"commit": "x"}, len(kept))
    coverage.write_json(reference, other, {"commit": "y"}, len(other))
    assert coverage.differing(coverage.read_rows(table), coverage.read_rows(reference)) == differ


def test_report_files(tmp_path):
    rows = [
        coverage.Row("llama", "LlamaModel", "base", True, True, True, functions=11, depth=3, max_abs=5e-7, seconds=3),
        coverage.Row("rwkv", "RwkvModel", "base", True, True, False, stage="verify", error="ParityError: drift", commit="abc"),
    ]
    environment = {"commit": "abc", "torch": "t", "transformers": "x", "onnxscript": "o", "onnxruntime": "r", "date": "d"}
    coverage.write_markdown(tmp_path / "c.md", rows, environment, planned=5)
    coverage.write_json(tmp_path / "c.json", rows, environment, planned=5)
    text = (tmp_path / "c.md").read_text()
    assert text.index("## Totals") < text.index("## Every architecture")
    assert "| 2 | 5 | 2 | 2 | 1 | 1 | 1 | 0 |" in text and "`RwkvModel` (rwkv): verify: ParityError: drift" in text
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["totals"]["flat_only"] == 1 and [r.class_name for r in coverage.read_rows(tmp_path / "c.json")] == ["LlamaModel", "RwkvModel"]
    assert [r.commit for r in coverage.read_rows(tmp_path / "c.json")] == [None, "abc"]  # rows of older runs have none


def test_rows_are_keyed_by_model_type_and_class():
    Row = coverage.Row
    rows = [Row("llama", "LlamaModel", "base", True, True, True), Row("internlm3", "LlamaModel", "base", True, True, False),
            Row("llama", "LlamaModel", "base", True, False, False)]  # a copy left by a table keyed by class
    assert [r.key for r in coverage.unique_rows(rows)] == [("llama", "LlamaModel"), ("internlm3", "LlamaModel")]
    old = [Row("llama", "LlamaModel", "base", True, True, True), Row("internlm3", "LlamaModel", "base", True, True, True)]
    new = [Row("llama", "LlamaModel", "base", True, True, True), Row("internlm3", "LlamaModel", "base", True, True, False)]
    assert coverage.regressions(old, new) == ["LlamaModel (internlm3): modular regressed:"]
    planned = jobs.architectures(heads=True)
    assert len({(t, c) for t, c, _ in planned}) == len(planned)
    served = {}
    for model_type, class_name, _ in planned:
        served.setdefault(class_name, set()).add(model_type)
    assert max(len(types) for types in served.values()) > 1  # classes serving several model types get a row each


def test_exact_zero_and_reference_magnitude_are_recorded():
    flat = {"built": True, "ok": True, "max_abs": 0.0, "reference_max_abs": 2.5, "seconds": 1}
    modular = {"built": True, "ok": True, "max_abs": 0.0, "functions": 3, "reference_max_abs": 2.5, "seconds": 2}
    row = coverage.row_of("bert", "BertModel", "base", flat, modular)
    assert row.max_abs == 0.0 and row.flat_max_abs == 0.0 and row.reference_max_abs == 2.5 and not row.jittered
    assert json.loads(json.dumps(dataclasses.asdict(row)))["max_abs"] == 0  # 0, not null


def test_a_head_whose_outputs_are_zero_gets_jittered_weights():
    import torch

    head = torch.nn.Linear(8, 3)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = head

        def forward(self, x):
            return self.head(x)

    model, inputs = Model(), {"x": torch.randn(2, 8)}
    expected = [model(**inputs)]
    assert reference_outputs.reference_max_abs(expected) == 0.0
    again, jittered = reference_outputs.with_signal(model, inputs, expected)
    assert jittered and reference_outputs.reference_max_abs(again) > reference_outputs.NEAR_ZERO
    record = {}
    assert reference_outputs._signal_record(record, again, jittered) and record["jittered"]
    still_zero = {}
    assert not reference_outputs._signal_record(still_zero, [torch.zeros(3)], True) and still_zero["stage"] == "reference"


def test_a_reference_that_picks_among_ties_gets_redrawn_weights():
    import torch

    class Picker(torch.nn.Module):  # RT-DETR's query selection on vanished features: every score is the bias
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.Sequential(*(torch.nn.BatchNorm1d(8) for _ in range(12)))
            self.score = torch.nn.Linear(8, 1)
            for norm in self.norm:  # transformers draws them ~N(0, 0.02): the features vanish, jittered too
                torch.nn.init.zeros_(norm.weight)

        def forward(self, x):
            features = self.norm(x.transpose(1, 2)).transpose(1, 2)
            _, index = torch.topk(self.score(features).squeeze(-1), 4, dim=1)
            return x.gather(1, index.unsqueeze(-1).expand(-1, -1, 8))

    torch.manual_seed(0)
    model, inputs = Picker().eval(), {"x": torch.randn(2, 6, 8)}
    expected = [model(**inputs)]
    record = {}
    again, informative = reference_outputs.reference(model, inputs, expected, record)
    assert informative and record["jittered"]
    assert record["ties"] == "torch.topk on ties (top 4 of 6 with 8 tied): broken by jittered weights and 12 batch norm scales at 1"
    assert reference_outputs._watched(model, inputs)[1] == [] and not torch.equal(again[0], expected[0])
    plain, feed = torch.nn.Linear(8, 2), {"input": inputs["x"]}
    unchanged = [plain(**feed)]
    assert reference_outputs.without_ties(plain, feed, unchanged) == (unchanged, False, None)
    row = coverage.row_of("p", "P", "base", {"built": True}, {"built": True, "ok": True, "jittered": True, "ties": record["ties"]})
    assert row.ties == record["ties"] and coverage._jitter_cell(row) == " (jittered: top-k ties)"


@pytest.mark.slow
def test_sweep_script_on_the_sample_in_children(tmp_path):
    # both exporters in bounded children; nothing torch's flat export handles fails in ours
    output = tmp_path / "coverage.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "sweep_transformers.py"), "--sample", "--output", str(output)],
        capture_output=True, text=True, timeout=3600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(output.with_suffix(".json").read_text())
    totals = data["totals"]
    assert totals["tried"] == len(overrides.SAMPLE) and totals["flat_only"] == 0, totals
    assert {row["commit"] for row in data["rows"]} == {data["environment"]["commit"]}  # each row says its commit


def test_the_tools_phase_gives_every_tool_a_status(tmp_path):
    # issue 51: a modular-ok row's files (ours, torch's flat file, the inputs) go through every
    # file tool by the package's API; the row's tools field, the table's cell and totals say how
    folder = str(tmp_path)
    modular = jobs._job_modular("llama", "LlamaModel", folder)
    flat = jobs._job_flat("llama", "LlamaModel", folder)
    assert modular["ok"] and flat["ok"]
    assert {p.name for p in tmp_path.iterdir()} >= {tools_phase.MODULAR, tools_phase.FLAT, tools_phase.INPUTS}
    tools = {name: tools_phase.run_tool(name, folder)["status"] for name in tools_phase.TOOLS}
    assert tools == dict.fromkeys(tools_phase.TOOLS, "ok"), tools
    # a tool that cannot run says why instead of failing the row; no flat file: modularize is n/a
    (tmp_path / tools_phase.FLAT).unlink()
    assert tools_phase.run_tool("modularize", folder)["status"].startswith("n/a: torch's flat export failed")
    (tmp_path / tools_phase.MODULAR).write_bytes(b"not onnx")
    assert tools_phase.run_tool("diff", folder)["status"].startswith("InvalidModelFileError")
    row = coverage.row_of("llama", "LlamaModel", "base", flat, modular)
    row.tools = dict(tools, profile="97.0% of kernel time attributed")
    other = coverage.Row("bert", "BertModel", "base", True, True, True)  # a row the tools phase did not run on
    environment = {"commit": "abc", "torch": "t", "transformers": "x", "onnxscript": "o", "onnxruntime": "r", "date": "d"}
    coverage.write_markdown(tmp_path / "c.md", [row, other], environment, planned=2)
    coverage.write_json(tmp_path / "c.json", [row, other], environment, planned=2)
    text = (tmp_path / "c.md").read_text()
    assert "Every file tool on the files of 1 of the 2 modular-ok rows" in text
    assert "| convert_f16 | 1 | 0 | 1 | 0 |" in text and "| profile | 0 | 0 | 1 | 0 |" in text
    assert "profile: 97.0% of kernel time attributed" in text
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["tools"]["split"] == {"passed": 1, "run": 1, "n/a": 0, "auto-keep": 0} and data["tools"]["rows"]["run"] == 1
    # a conversion that passes only with --auto-keep at its budget is a pass, counted apart
    auto = dataclasses.replace(row, tools=dict(row.tools, convert_int8="ok (--auto-keep 0.25 kept 1: score; without it: drift 1.02)"))
    assert tools_phase.tool_totals([auto])["convert_int8"] == {"passed": 1, "run": 1, "n/a": 0, "auto-keep": 1}
    assert [r.tools for r in coverage.read_rows(tmp_path / "c.json")] == [row.tools, None]
