"""The transformers sweep (scripts/sweep_transformers.py) on its sample of ~20 architectures:
decoder, encoder, encoder-decoder, vision, audio, multimodal, state-space and mixture-of-experts
models, each from a tiny config with random weights. export_modular must export every one with
parity (its own check: onnxruntime, modular and inlined copy, against PyTorch, float32 atol 1e-4 /
rtol 1e-3) and one function per module call. The full sweep, with torch's flat export beside it
in bounded child processes, is script-only (docs/coverage.md)."""

from __future__ import annotations

import dataclasses
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


def test_rows_differing_from_another_torchs_run_are_swept_again(tmp_path):
    Row = sweep.Row
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
    assert sweep.differing(kept, other) == differ
    # as --redo-differing reads them: both tables from their JSON files, inputs and all
    table, reference = tmp_path / "cov.json", tmp_path / "other.json"
    sweep.write_json(table, kept, {"commit": "x"}, len(kept))
    sweep.write_json(reference, other, {"commit": "y"}, len(other))
    assert sweep.differing(sweep.read_rows(table), sweep.read_rows(reference)) == differ


def test_report_files(tmp_path):
    rows = [
        sweep.Row("llama", "LlamaModel", "base", True, True, True, functions=11, depth=3, max_abs=5e-7, seconds=3),
        sweep.Row("rwkv", "RwkvModel", "base", True, True, False, stage="verify", error="ParityError: drift", commit="abc"),
    ]
    environment = {"commit": "abc", "torch": "t", "transformers": "x", "onnxscript": "o", "onnxruntime": "r", "date": "d"}
    sweep.write_markdown(tmp_path / "c.md", rows, environment, planned=5)
    sweep.write_json(tmp_path / "c.json", rows, environment, planned=5)
    text = (tmp_path / "c.md").read_text()
    assert text.index("## Totals") < text.index("## Every architecture")
    assert "| 2 | 5 | 2 | 2 | 1 | 1 | 1 | 0 |" in text and "`RwkvModel` (rwkv): verify: ParityError: drift" in text
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["totals"]["flat_only"] == 1 and [r.class_name for r in sweep.read_rows(tmp_path / "c.json")] == ["LlamaModel", "RwkvModel"]
    assert [r.commit for r in sweep.read_rows(tmp_path / "c.json")] == [None, "abc"]  # rows of older runs have none


def test_rows_are_keyed_by_model_type_and_class():
    Row = sweep.Row
    rows = [Row("llama", "LlamaModel", "base", True, True, True), Row("internlm3", "LlamaModel", "base", True, True, False),
            Row("llama", "LlamaModel", "base", True, False, False)]  # a copy left by a table keyed by class
    assert [r.key for r in sweep.unique_rows(rows)] == [("llama", "LlamaModel"), ("internlm3", "LlamaModel")]
    old = [Row("llama", "LlamaModel", "base", True, True, True), Row("internlm3", "LlamaModel", "base", True, True, True)]
    new = [Row("llama", "LlamaModel", "base", True, True, True), Row("internlm3", "LlamaModel", "base", True, True, False)]
    assert sweep.regressions(old, new) == ["LlamaModel (internlm3): modular regressed:"]
    planned = sweep.architectures(heads=True)
    assert len({(t, c) for t, c, _ in planned}) == len(planned)
    served = {}
    for model_type, class_name, _ in planned:
        served.setdefault(class_name, set()).add(model_type)
    assert max(len(types) for types in served.values()) > 1  # classes serving several model types get a row each


def test_exact_zero_and_reference_magnitude_are_recorded():
    flat = {"built": True, "ok": True, "max_abs": 0.0, "reference_max_abs": 2.5, "seconds": 1}
    modular = {"built": True, "ok": True, "max_abs": 0.0, "functions": 3, "reference_max_abs": 2.5, "seconds": 2}
    row = sweep.row_of("bert", "BertModel", "base", flat, modular)
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
    assert sweep.reference_max_abs(expected) == 0.0
    again, jittered = sweep.with_signal(model, inputs, expected)
    assert jittered and sweep.reference_max_abs(again) > sweep.NEAR_ZERO
    record = {}
    assert sweep._signal_record(record, again, jittered) and record["jittered"]
    still_zero = {}
    assert not sweep._signal_record(still_zero, [torch.zeros(3)], True) and still_zero["stage"] == "reference"


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
    again, informative = sweep.reference(model, inputs, expected, record)
    assert informative and record["jittered"]
    assert record["ties"] == "torch.topk on ties (top 4 of 6 with 8 tied): broken by jittered weights and 12 batch norm scales at 1"
    assert sweep._watched(model, inputs)[1] == [] and not torch.equal(again[0], expected[0])
    plain, feed = torch.nn.Linear(8, 2), {"input": inputs["x"]}
    unchanged = [plain(**feed)]
    assert sweep.without_ties(plain, feed, unchanged) == (unchanged, False, None)
    row = sweep.row_of("p", "P", "base", {"built": True}, {"built": True, "ok": True, "jittered": True, "ties": record["ties"]})
    assert row.ties == record["ties"] and sweep._jitter_cell(row) == " (jittered: top-k ties)"


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
    assert totals["tried"] == len(sweep.SAMPLE) and totals["flat_only"] == 0, totals
    assert {row["commit"] for row in data["rows"]} == {data["environment"]["commit"]}  # each row says its commit


# -- the rules that build the catalogue's rows (issue 36): each asserts on the tiny config or the inputs made


def test_rotary_sections_fit_the_tiny_head():
    # Qwen2-VL's config has no sections: the model falls back to a full-size head's [16, 24, 24]
    text = sweep.tiny_config("qwen2_vl").text_config
    head_dim = text.hidden_size // text.num_attention_heads
    assert len(text.rope_parameters["mrope_section"]) == 3 and sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    # a config with its own sections ([24, 20, 20]) gets them refitted, in proportion
    cosmos = sweep.tiny_config("cosmos3_edge").text_config
    assert sum(cosmos.rope_parameters["mrope_section"]) == cosmos.head_dim // 2
    assert sweep._fit_sections([16, 24, 24], 8) == [2, 3, 3] and sum(sweep._fit_sections([24, 20, 20], 8)) == 8


def test_widths_tied_to_a_hidden_size_shrink_with_it():
    docling = sweep.tiny_config("granite_docling")  # the projector's output is the text model's width
    assert docling.vision_config.out_hidden_size == docling.text_config.hidden_size == sweep.HIDDEN
    tts = sweep.tiny_config("pocket_tts")  # the flow head is conditioned on the backbone's states
    assert tts.flow_head_config.condition_dim == tts.hidden_size == sweep.HIDDEN
    squeeze = sweep.tiny_config("squeezebert")
    assert squeeze.embedding_size == squeeze.hidden_size == sweep.HIDDEN
    reformer = sweep.tiny_config("reformer")  # factors of the width: the axial position embeddings
    assert sum(reformer.axial_pos_embds_dim) == reformer.hidden_size


def test_per_layer_lists_and_layer_indices_follow_the_kept_layers():
    swinv2 = sweep.tiny_config("swinv2")
    assert len(swinv2.depths) == len(swinv2.pretrained_window_sizes) == len(swinv2.num_heads)
    audio = sweep.tiny_config("muse_spark").audio_config
    assert len(audio.patch_sizes) == len(audio.hidden_sizes) == len(audio.depths) == audio.num_hidden_layers
    molmo = sweep.tiny_config("molmo2")  # [24, 18] of 27 layers: the last two of the tiny tower
    assert molmo.adapter_config.vision_feature_layer == [-1, -2]
    assert sweep._layer_index(-2) == -2 and sweep._layer_index(30) == -1


def test_routing_groups_none_sizes_and_languages():
    axk1 = sweep.tiny_config("axk1")  # 4 experts: one group, chosen
    assert axk1.n_group == axk1.topk_group == 1 and axk1.n_routed_experts == 4
    assert sweep.tiny_config("ernie4_5_moe").moe_k == 2
    assert sweep.tiny_config("nemotron").num_key_value_heads == 1  # None in the default config
    assert sweep.tiny_config("esm").vocab_size == 512
    assert sweep.tiny_config("xmod").default_language == "en_XX"
    assert sweep.tiny_config("gptj").rotary_dim == 8  # partial rotary inside a 16-wide head
    bit = sweep.tiny_config("bit")  # group norms over 8-channel stages
    assert all(size % bit.num_groups == 0 for size in bit.hidden_sizes)


def test_towers_are_built_from_their_own_sub_config():
    config = sweep.tiny_config("mllama")
    assert sweep.config_for_class(config, transformers.MllamaTextModel) is config.text_config
    assert sweep.config_for_class(config, transformers.MllamaVisionModel) is config.vision_config
    assert sweep.config_for_class(config, transformers.MllamaModel) is config


def test_a_detector_reads_the_channels_its_backbone_gives():
    config = sweep.tiny_config("rt_detr")
    backbone = config.backbone_config
    stages = [backbone.embedding_size, *backbone.hidden_sizes]
    assert list(config.encoder_in_channels) == [stages[i] for i in backbone.out_indices]
    assert set(config.decoder_in_channels) == {config.encoder_hidden_dim} == {sweep.HIDDEN}  # the encoder's width


def test_log_mel_features_in_the_layout_the_model_reads():
    # Whisper's extractor gives (batch, bins, frames); Parakeet's encoder reads (batch, frames, bins)
    model, inputs, _ = sweep.build("whisper", "WhisperModel")
    assert inputs["input_features"].shape[1] == model.config.num_mel_bins
    model, inputs, _ = sweep.build("parakeet_encoder", "ParakeetEncoder")
    assert inputs["input_features"].shape[-1] == model.config.num_mel_bins


def test_vision_language_rows_get_images_and_their_tokens():
    model, inputs, _ = sweep.build("qwen2_vl", "Qwen2VLModel")
    config = model.config
    grid = inputs["image_grid_thw"]
    merge = config.vision_config.spatial_merge_size
    per_image = int(grid[0].prod()) // merge**2
    assert inputs["pixel_values"].shape[0] == int(grid.prod(dim=1).sum())  # flattened patches, as the processor gives
    assert ((inputs["input_ids"] == config.image_token_id).sum(dim=1) == per_image).all()
    assert ((inputs["input_ids"] == config.vision_start_token_id).sum(dim=1) == 1).all()
    assert (inputs["mm_token_type_ids"] == (inputs["input_ids"] == config.image_token_id)).all()
    model, inputs, _ = sweep.build("llava", "LlavaForConditionalGeneration")  # 4 x 4 patches, the CLS dropped
    assert inputs["pixel_values"].shape == (sweep.BATCH, 3, 32, 32)
    assert ((inputs["input_ids"] == model.config.image_token_id).sum(dim=1) == 16).all()
    config = sweep.tiny_config("llava_next")  # tilings scaled to the tiny tower's image size
    assert [32, 64] in config.image_grid_pinpoints and max(max(p) for p in config.image_grid_pinpoints) <= 96


def test_video_audio_and_classification_inputs():
    _, inputs, _ = sweep.build("videomae", "VideoMAEModel")  # (batch, frames, channels, height, width)
    assert inputs["pixel_values"].dim() == 5 and inputs["pixel_values"].shape[1] == sweep.tiny_config("videomae").num_frames
    _, inputs, expected = sweep.build("bart", "BartForSequenceClassification")  # one EOS per row, the decoder's own input
    assert "decoder_input_ids" not in inputs and (inputs["input_ids"][:, -1] == 2).all() and expected[0].shape[0] == sweep.BATCH
    _, inputs, _ = sweep.build("wav2vec2", "Wav2Vec2ForXVector")  # enough frames for the time-delay layers
    assert inputs["input_values"].shape == (sweep.BATCH, 16000)


def test_notes_name_the_limit_where_both_exporters_fail():
    Row = sweep.Row
    guard = Row("x", "X", "base", True, False, False, error="GuardOnDataDependentSymNode: Could not guard on data-dependent expression Eq(u0, 1)",
                flat_error="... data-dependent ...")
    assert "data-dependent" in sweep.classify(guard)
    timm = Row("detr", "DetrModel", "base", error="ImportError: TimmBackbone requires the timm library but it was not found")
    assert "torchvision" in sweep.classify(timm)
    assert sweep.classify(Row("llama", "LlamaModel", "base", True, True, True)) is None
    assert sweep.classify(Row("y", "Y", "base", True, True, False, error="ParityError: drift")) is None  # flat passes: ours to fix
    built = Row("b", "B", "base", False, False, False, stage="build", error="TypeError: x", flat_stage="build")
    assert sweep.classify(built).startswith("not built")
    odd = Row("o", "O", "base", True, False, False, stage="translate", error="X", flat_stage="run", flat_error="Y")
    assert sweep.classify(odd) == "both fail: modular at translate, flat at run (the errors say why)"
    both = Row("z", "Z", "base", True, False, False, stage="verify", error="ParityError: drift", flat_stage="verify", flat_error="max abs difference 0.4")
    assert "differ from PyTorch" in sweep.classify(both)
    captured = dataclasses.replace(both, error=f"ParityError: drift ({sweep._CAPTURED_SO})")  # PaliGemma's prefix mask
    assert "torch.export captures differs from eager PyTorch" in sweep.classify(captured)
    tied = dataclasses.replace(both, error=f"ParityError: drift ({sweep._TIED_SO})")  # RT-DETR on random weights
    assert "torch.topk on ties" in sweep.classify(tied) and "lowest index first" in sweep.classify(tied)
    remain = dataclasses.replace(both, ties=f"torch.topk on ties (top 16 of 21 with 32 tied): {sweep.TIES_REMAIN} (...)")
    assert sweep.classify(remain) == sweep.classify(tied)


def test_towers_time_series_codebooks_and_stacked_features():
    # a Qwen-VL-style vision tower: flattened patches and their grid, as its processor gives them
    _, inputs, _ = sweep.build("qwen2_5_vl_vision", "Qwen2_5_VisionTransformerPretrainedModel")
    assert inputs["hidden_states"].shape[0] == int(inputs["grid_thw"].prod(dim=1).sum()) and inputs["grid_thw"].shape == (sweep.BATCH, 3)
    model, inputs, _ = sweep.build("patchtst", "PatchTSTModel")  # (batch, context, channels)
    assert inputs["past_values"].shape == (sweep.BATCH, model.config.context_length, model.config.num_input_channels)
    model, inputs, _ = sweep.build("musicgen", "MusicgenForCausalLM")  # one row per codebook
    assert inputs["input_ids"].shape == (sweep.BATCH * model.config.num_codebooks, sweep.SEQUENCE)
    model, inputs, _ = sweep.build("wav2vec2-bert", "Wav2Vec2BertModel")  # two frames stacked per row
    assert inputs["input_features"].shape[-1] == model.config.feature_projection_input_dim
    # per-layer key heads follow the tiny head count: all stay all, grouped become one
    assert set(sweep.tiny_config("sapiens2").num_key_value_heads_per_layer) == {1, 2}


def test_audio_language_rows_get_audio_and_their_tokens():
    assert sweep.tiny_config("voxtral").audio_token_id == 5  # left unset by the default config
    model, inputs, _ = sweep.build("voxtral", "VoxtralForConditionalGeneration")
    audio = model.config.audio_config
    assert inputs["input_features"].shape == (sweep.BATCH, audio.num_mel_bins, 2 * audio.max_source_positions)
    tokens = (inputs["input_ids"] == model.config.audio_token_id).sum(dim=1)
    with torch_no_grad():
        features = model.get_audio_features(input_features=inputs["input_features"]).pooler_output
    assert (tokens == features.shape[0] // sweep.BATCH).all() and int(tokens[0]) > 0


def torch_no_grad():
    import torch

    return torch.no_grad()


def test_timm_backbones_become_transformers_resnets():
    # timm needs torchvision, which does not import beside the CPU torch here
    config = sweep.tiny_config("detr")
    assert config.backbone_config.model_type == "resnet" and list(config.backbone_config.out_indices) == [1, 2, 3, 4]
    assert max(config.backbone_config.hidden_sizes) <= 64


def test_a_config_the_rules_break_builds_shallow():
    # Donut-Swin's tiny widths break its windows: depth only, the default widths, then export with parity
    from onnx_modular import export_modular

    default = transformers.AutoConfig.for_model("donut-swin")
    shallow = sweep.tiny_config("donut-swin", "shallow")
    assert shallow.embed_dim == default.embed_dim and shallow.depths == [1] * len(default.depths)
    model, inputs, _, tier = sweep.build_with_tier("donut-swin", "DonutSwinModel")
    assert tier == "shallow" and sum(p.numel() for p in model.parameters()) < sweep.PARAMETER_BUDGET
    result = export_modular(model, (), kwargs=inputs)
    assert result.report.ok, str(result.report)
    # a row that builds tiny stays tiny
    assert sweep.build_with_tier("llama", "LlamaModel")[3] == "tiny"


def test_a_model_over_the_budget_is_not_built(monkeypatch):
    monkeypatch.setattr(sweep, "PARAMETER_BUDGET", 1000)
    with pytest.raises(sweep.OverBudget, match="shallow config"):
        sweep._build("llama", "LlamaModel", "shallow")


def test_random_masking_gets_its_noise():
    # ViT-MAE draws the patches it masks from noise made inside forward unless given: fixed, the
    # export matches PyTorch
    from onnx_modular import export_modular

    model, inputs, _ = sweep.build("vit_mae", "ViTMAEModel")
    patches = (model.config.image_size // model.config.patch_size) ** 2
    assert inputs["noise"].shape == (sweep.BATCH, patches)
    result = export_modular(model, (), kwargs=inputs)
    assert result.report.ok, str(result.report)


def test_a_vocoder_gets_its_noise_sequence():
    # UnivNet draws its noise inside forward unless given (torch.randn, which no exporter
    # translates): fixed, one frame per spectrogram frame, the export matches PyTorch
    from onnx_modular import export_modular

    model, inputs, _ = sweep.build("univnet", "UnivNetModel")
    features, noise = inputs["input_features"], inputs["noise_sequence"]
    assert noise.shape == (sweep.BATCH, features.shape[1], model.config.model_in_channels)
    assert features.shape[2] == model.config.num_mel_bins  # (batch, frames, bins), as UnivNet reads them
    result = export_modular(model, (), kwargs=inputs)
    assert result.report.ok, str(result.report)


def test_values_a_default_config_leaves_to_the_checkpoint_are_filled():
    # experts whose routing is unset: 2 of the 4 per token, one group (DeepSeek-V2's topk(None) otherwise)
    deepseek = sweep.tiny_config("deepseek_v2")
    assert (deepseek.num_experts_per_tok, deepseek.n_group, deepseek.topk_group) == (2, 1, 1) and deepseek.n_routed_experts == 4
    assert sweep.tiny_config("axk2").n_group is None  # routing set by its config: its groups stay as they are
    # dense or sparse feed-forward per layer: one of each
    ocr = sweep.tiny_config("deepseek_ocr2").text_config
    assert ocr.mlp_layer_types == ["dense", "sparse"] and len(ocr.mlp_layer_types) == ocr.num_hidden_layers
    # rotary per layer kind, left empty: one default entry per kind, sections within half the head
    compass = sweep.tiny_config("cohere_compass_text")
    assert set(compass.rope_parameters) == set(compass.layer_types) == {"full_attention"}
    assert sum(compass.rope_parameters["full_attention"]["mrope_section"]) == compass.head_dim // 2
    # a forecaster's horizon (its context follows it)
    informer = sweep.tiny_config("informer")
    assert informer.prediction_length == informer.context_length == 4


def test_depthwise_groups_shrink_with_the_width_they_divide():
    mimi = sweep.tiny_config("mimi")  # an upsampling convolution grouped per hidden channel
    assert mimi.upsample_groups == mimi.hidden_size == sweep.HIDDEN
    assert sweep.tiny_config("csm").codec_config.upsample_groups == sweep.HIDDEN


def test_unrouted_experts_build_and_export_with_parity():
    from onnx_modular import export_modular

    model, inputs, _, tier = sweep.build_with_tier("deepseek_v2", "DeepseekV2Model")
    assert tier == "tiny" and model.config.num_experts_per_tok == 2
    result = export_modular(model, (), kwargs=inputs)
    assert result.report.ok, str(result.report)


def test_pixel_models_that_read_text_get_their_prompt():
    # a forward that requires input_ids beside pixels gets token ids too (Grounding DINO's caption)
    model, inputs, _ = sweep.build("grounding-dino", "GroundingDinoModel")
    assert inputs["input_ids"].shape == (sweep.BATCH, sweep.SEQUENCE) and inputs["pixel_values"].dim() == 4
    # a Q-Former's image makes num_query_tokens features: the text holds that many image tokens
    # (left unset by the default config), and the Q-Former gets its own prompt
    model, inputs, _ = sweep.build("instructblip", "InstructBlipForConditionalGeneration")
    config = model.config
    assert sweep.tiny_config("instructblip").image_token_index == 6
    assert ((inputs["input_ids"] == config.image_token_index).sum(dim=1) == config.num_query_tokens).all()
    assert inputs["qformer_input_ids"].shape == inputs["qformer_attention_mask"].shape == (sweep.BATCH, sweep.SEQUENCE)
    # a video Q-Former: (batch, frames, channels, height, width), num_query_tokens per frame
    model, inputs, _ = sweep.build("instructblipvideo", "InstructBlipVideoModel")
    frames = inputs["pixel_values"].shape[1]
    assert inputs["pixel_values"].dim() == 5
    assert ((inputs["input_ids"] == model.config.video_token_index).sum(dim=1) == frames * model.config.num_query_tokens).all()
    # Kosmos-2 marks its latent_query_num image positions
    model, inputs, _ = sweep.build("kosmos-2", "Kosmos2Model")
    assert (inputs["image_embeds_position_mask"].sum(dim=1) == model.config.latent_query_num).all()
    assert inputs["image_embeds_position_mask"].shape == inputs["input_ids"].shape
    # a text-prompted segmenter (optional input_ids, a text_config, no decoder) gets its prompt
    _, inputs, _ = sweep.build("sam3", "Sam3Model")
    assert inputs["input_ids"].shape == (sweep.BATCH, sweep.SEQUENCE)
    # an image-to-text decoder (decoder inputs, no image token) is read from its pixels alone, as before
    _, inputs, _ = sweep.build("pp_formulanet", "PPFormulaNetForConditionalGeneration")
    assert "input_ids" not in inputs


def test_a_pixel_model_with_its_prompt_exports_with_parity():
    from onnx_modular import export_modular

    model, inputs, _ = sweep.build("blip-2", "Blip2Model")
    assert ((inputs["input_ids"] == model.config.image_token_index).sum(dim=1) == model.config.num_query_tokens).all()
    result = export_modular(model, (), kwargs=inputs)
    assert result.report.ok, str(result.report)


def test_key_heads_stay_all_heads_where_values_have_all_heads():
    # Nemotron 3's audio attention: v_proj has num_attention_heads heads, k_proj num_key_value_heads;
    # an override keeps them equal, merged into the shrunk audio tower (its other sizes stay tiny)
    from onnx_modular import export_modular

    audio = sweep.tiny_config("nemotron3_diarization").audio_config
    assert audio.num_key_value_heads == audio.num_attention_heads == 2 and audio.hidden_size == 32
    for model_type in ("nemotron3_diarization_audio", "nemotron3_5_transcribe_asr_audio"):
        config = sweep.tiny_config(model_type)
        assert config.num_key_value_heads == config.num_attention_heads == 2 and config.hidden_size == 32
    model, inputs, _, tier = sweep.build_with_tier("nemotron3_diarization_audio", "Nemotron3DiarizationAudioModel")
    attention = next(m for name, m in model.named_modules() if name.endswith("self_attn"))
    assert tier == "tiny" and attention.k_proj.out_features == attention.v_proj.out_features
    result = export_modular(model, (), kwargs=inputs)
    assert result.report.ok, str(result.report)


def test_video_models_get_pixel_values_videos():
    # a forward whose main input is pixel_values_videos: (batch, frames, channels, height, width)
    model, inputs, _ = sweep.build("vjepa2", "VJEPA2Model")
    assert inputs["pixel_values_videos"].dim() == 5 and inputs["pixel_values_videos"].shape[1] == 2 * model.config.tubelet_size
    model, inputs, _ = sweep.build("videoprism", "VideoPrismClipModel")  # frames from the config, and the text
    assert inputs["pixel_values_videos"].shape[1] == model.config.vision_config.num_frames and "input_ids" in inputs


def test_codecs_get_a_waveform_with_its_channels():
    # a codec (a channel count or stride ratios in its config) reads (batch, channels, samples)
    model, inputs, _ = sweep.build("encodec", "EncodecModel")
    assert inputs["input_values"].shape == (sweep.BATCH, model.config.audio_channels, 4000)
    _, inputs, _ = sweep.build("vibevoice_acoustic_tokenizer_encoder", "VibeVoiceAcousticTokenizerEncoderModel")
    assert inputs["hidden_states"].dim() == 3  # its forward's name for the waveform
    # a speech encoder keeps (batch, samples)
    _, inputs, _ = sweep.build("wav2vec2", "Wav2Vec2Model")
    assert inputs["input_values"].dim() == 2
    # a required waveform beside text, its codec found in a sub-config (PE Audio wraps a DAC)
    _, inputs, _ = sweep.build("pe_audio", "PeAudioModel")
    assert inputs["input_ids"].shape == (sweep.BATCH, sweep.SEQUENCE) and inputs["input_values"].shape[:2] == (sweep.BATCH, 1)
    # a codec with a semantic encoder: one stacked feature frame per acoustic frame
    config = sweep.tiny_config("xcodec2")
    with torch_device("meta"):
        model = transformers.Xcodec2Model._from_config(config)
    inputs = sweep.make_inputs(model, config)
    hop = 1
    for ratio in config.downsampling_ratios:
        hop *= ratio
    assert inputs["input_values"].shape[-1] == hop * inputs["input_features"].shape[1]
    assert inputs["input_features"].shape[-1] == config.semantic_model_config.feature_projection_input_dim


def torch_device(name):
    import torch

    return torch.device(name)


def test_speech_encoders_get_their_frames_and_mask():
    # a forward that takes input_features_mask gets every frame valid, over the features' frames
    model, inputs, _ = sweep.build("audioflamingo3_encoder", "AudioFlamingo3Encoder")
    assert inputs["input_features_mask"].shape == (sweep.BATCH, inputs["input_features"].shape[-1])
    # low-frame-rate stacking: (batch, frames, k x bins)
    model, inputs, _ = sweep.build("fun_asr_nano_encoder", "FunAsrNanoEncoder")
    config = model.config
    assert inputs["input_features"].shape[-1] == config.num_mel_bins * config.num_stacked_frames
    assert inputs["input_features_mask"].shape == inputs["input_features"].shape[:2]
    # a windowed encoder reads whole windows of 2 x n_window frames
    model, inputs, _ = sweep.build("qwen3_asr_encoder", "Qwen3ASREncoder")
    assert inputs["input_features"].shape[-1] % (2 * model.config.n_window) == 0


def test_region_task_and_single_stream_inputs():
    # a two-stream model over detected regions: region features of visual_feat_dim and boxes in 0..1
    model, inputs, _ = sweep.build("lxmert", "LxmertModel")
    assert inputs["visual_feats"].shape[-1] == model.config.visual_feat_dim
    boxes = inputs["visual_pos"]
    assert boxes.shape[-1] == model.config.visual_pos_dim and (boxes[..., 2:] > boxes[..., :2]).all() and boxes.max() <= 1
    # a single-stream text and image model (modality type embeddings, no vision sub-config) gets pixels
    model, inputs, _ = sweep.build("vilt", "ViltForQuestionAnswering")
    assert inputs["pixel_values"].shape[1:] == (model.config.num_channels, model.config.image_size, model.config.image_size)
    # OneFormer's task prompt, task_seq_len tokens
    model, inputs, _ = sweep.build("oneformer", "OneFormerModel")
    assert inputs["task_inputs"].shape == (sweep.BATCH, model.config.task_seq_len)
    # Longformer's question-answering heads: global attention on the first token, as a pipeline gives
    _, inputs, _ = sweep.build("longformer", "LongformerForMultipleChoice")
    mask = inputs["global_attention_mask"]
    assert mask.shape == inputs["input_ids"].shape and (mask[..., 0] == 1).all() and int(mask.sum()) == sweep.BATCH * 2
    # a univariate patched forecaster: whole patches, padding flags, a frequency
    model, inputs, _ = sweep.build("timesfm", "TimesFmModel")
    assert inputs["past_values"].dim() == 2 and inputs["past_values"].shape[1] % model.config.patch_length == 0
    assert inputs["past_values_padding"].shape == inputs["past_values"].shape and inputs["freq"].shape[0] == sweep.BATCH


def test_patched_towers_and_image_pairs():
    # SigLIP 2's NaFlex tower: flattened patches, their grid and which are valid
    model, inputs, _ = sweep.build("siglip2_vision_model", "Siglip2VisionModel")
    config = model.config
    patches = int(inputs["spatial_shapes"][0].prod())
    assert inputs["pixel_values"].shape == (sweep.BATCH, patches, config.num_channels * config.patch_size**2)
    assert inputs["pixel_attention_mask"].shape == (sweep.BATCH, patches)
    # Gemma 4's tower: whole pooling windows of patches, each with its (x, y)
    model, inputs, _ = sweep.build("gemma4_vision", "Gemma4VisionModel")
    positions = inputs["pixel_position_ids"]
    assert positions.shape == (*inputs["pixel_values"].shape[:2], 2) and positions.shape[1] % model.config.pooling_kernel_size**2 == 0
    assert len({tuple(p) for p in positions[0].tolist()}) == positions.shape[1]  # every patch its own place
    # a keypoint matcher reads a pair of images per row
    _, inputs, _ = sweep.build("superglue", "SuperGlueForKeypointMatching")
    assert inputs["pixel_values"].shape[:2] == (sweep.BATCH, 2) and inputs["pixel_values"].dim() == 5


def test_generic_inputs_and_audio_towers():
    # a composite speech encoder-decoder takes its encoder's inputs under their own names
    model, inputs, _ = sweep.build("speech-encoder-decoder", "SpeechEncoderDecoderModel")
    assert model.main_input_name == "inputs" and inputs["input_values"].dim() == 2 and "decoder_input_ids" in inputs
    # Perceiver without a preprocessor reads embeddings of its d_model
    model, inputs, _ = sweep.build("perceiver", "PerceiverModel")
    assert inputs["inputs"].shape == (sweep.BATCH, sweep.SEQUENCE, model.config.d_model)
    _, inputs, _ = sweep.build("perceiver", "PerceiverForMaskedLM")  # a head with token ids keeps them
    assert "input_ids" in inputs and "inputs" not in inputs
    # Gemma 3n's audio tower: log-mel frames and their padding mask
    model, inputs, _ = sweep.build("gemma3n_audio", "Gemma3nAudioEncoder")
    assert inputs["audio_mel"].shape[-1] == model.config.input_feat_size and not inputs["audio_mel_mask"].any()


def test_flattened_patches_and_prompt_images():
    # Pix2Struct's flattened patches: (row, column) from 1, then the patch's pixels
    config = sweep.tiny_config("pix2struct")
    with torch_device("meta"):
        model = transformers.Pix2StructForConditionalGeneration._from_config(config)
    inputs = sweep.make_inputs(model, config)
    patches = inputs["flattened_patches"]
    assert patches.shape[-1] == 2 + config.vision_config.patch_embed_hidden_size and patches[..., :2].min() == 1
    assert inputs["attention_mask"].shape == patches.shape[:2]
    # SegGPT: an example image and its mask of the input's shape, the three filling its image_size
    model, inputs, _ = sweep.build("seggpt", "SegGptModel")
    height, width = model.config.image_size
    assert inputs["pixel_values"].shape[-2:] == inputs["prompt_masks"].shape[-2:] == (height // 2, width)
    assert inputs["prompt_pixel_values"].shape == inputs["pixel_values"].shape


def test_embeddings_a_caller_computes_and_video_text_pairs():
    # a required *_embeds gets (batch, sequence, hidden), with what a cross-attention reads
    model, inputs, _ = sweep.build("blip_2_qformer", "Blip2QFormerModel")
    assert inputs["query_embeds"].shape == (sweep.BATCH, sweep.SEQUENCE, model.config.hidden_size)
    assert inputs["encoder_hidden_states"].shape[-1] == model.config.encoder_hidden_size
    # a forward whose main input is embeddings gets them, and no token ids it would not read
    model, inputs, _ = sweep.build("nemotron3_5_transcribe_word_timestamp", "Nemotron3_5TranscribeWordTimestampModel")
    assert set(inputs) == {"inputs_embeds", "attention_mask"}
    # a video-text dual encoder: frames from its vision config
    model, inputs, _ = sweep.build("xclip", "XCLIPModel")
    assert inputs["pixel_values"].shape[:2] == (sweep.BATCH, model.config.vision_config.num_frames) and "input_ids" in inputs


def test_an_image_text_retrieval_head_reads_text_through_its_qformer():
    model, inputs, expected = sweep.build("blip-2", "Blip2ForImageTextRetrieval")
    assert model.config.qformer_config.use_qformer_text_input and "input_ids" in inputs and expected
    assert not sweep.tiny_config("blip-2").qformer_config.use_qformer_text_input  # other rows as they were


def test_interleaved_images_with_their_attention_mask():
    # IDEFICS: (batch, images, channels, height, width) and which images each token attends to
    _, inputs, _ = sweep.build("idefics", "IdeficsModel")
    assert inputs["pixel_values"].dim() == 5 and inputs["pixel_values"].shape[:2] == (sweep.BATCH, 1)
    assert inputs["image_attention_mask"].shape == (*inputs["input_ids"].shape, 1)


def test_overrides_fill_what_only_a_checkpoint_sets():
    # Sapiens2's task heads: every channel list None in the default config
    head = sweep.tiny_config("sapiens2").head_config
    assert head.upsample_out_channels == [16, 16] and head.upsample_kernel_sizes == [4, 4] and head.conv_out_channels == [16]
    # Qwen4-Exp's token indexer, merged into the shrunk text config (which stays tiny)
    text = sweep.tiny_config("qwen4_exp").text_config
    assert text.indexer_budget % text.indexer_compress_ratio == 0 and text.indexer_kv_heads == 1
    assert text.hidden_size == sweep.HIDDEN and "indexed_attention" in text.layer_types
    assert sweep.tiny_config("qwen4_exp_text").indexer_n_heads == 2


def test_expert_counts_mamba_widths_and_sliding_windows_left_unset():
    dots = sweep.tiny_config("dots1")  # neither how many experts nor how many per token
    assert (dots.n_routed_experts, dots.num_experts_per_tok, dots.n_shared_experts) == (4, 2, 1)
    falcon = sweep.tiny_config("falcon_h1")  # the Mamba width given: heads x head dim
    assert falcon.mamba_d_ssm == falcon.mamba_n_heads * falcon.mamba_d_head
    step = sweep.tiny_config("step3p7").text_config  # sliding-attention heads, no window: Step 3.7 always masks for one
    assert step.sliding_window == sweep.SEQUENCE // 2
    assert sweep.tiny_config("mixtral").sliding_window is None  # None means full attention there: kept


def test_a_forecaster_gets_its_lags_time_features_and_observed_mask():
    model, inputs, expected = sweep.build("time_series_transformer", "TimeSeriesTransformerModel")
    config = model.config
    length = config.context_length + max(config.lags_sequence)
    assert inputs["past_values"].shape == inputs["past_observed_mask"].shape == (sweep.BATCH, length)  # univariate
    assert inputs["past_time_features"].shape == (sweep.BATCH, length, config.num_time_features)
    assert expected[0].shape[0] == sweep.BATCH


def test_cache_sharing_layers_follow_the_kept_layers():
    # Gemma 3n's last 15 of 35 layers reuse an earlier cache of their kind: the two kept layers (one of
    # each kind) both make their own
    text = sweep.tiny_config("gemma3n_text")
    assert text.num_hidden_layers == 2 and set(text.layer_types) == {"sliding_attention", "full_attention"}
    assert text.num_kv_shared_layers == 0
    assert sweep.tiny_config("gemma4_text").num_kv_shared_layers == 0


def test_a_tokenizer_map_left_to_the_checkpoint_holds_the_image_token():
    # Chameleon and Emu3 read their image placeholder from the tokenizer's map (None by default)
    chameleon = sweep.tiny_config("chameleon")
    assert chameleon.vocabulary_map == {"<image>": chameleon.vocab_size - 1} and chameleon.image_token_id == chameleon.vocab_size - 1
    emu3 = sweep.tiny_config("emu3")  # its text model has the vocabulary
    assert emu3.vocabulary_map["<image>"] == emu3.text_config.vocab_size - 1


def test_overrides_for_keys_a_config_class_does_not_tie_or_declare():
    fun = sweep.tiny_config("fun_asr_nano")  # its validator: a quarter of the text model's width
    assert fun.adaptor_config.intermediate_size == fun.text_config.hidden_size // 4
    assert fun.adaptor_config.hidden_size == sweep.HIDDEN  # merged into the shrunk sub-config
    thinker = sweep.tiny_config("qwen2_5_omni_thinker")  # read by its multimodal positions, not declared
    assert thinker.vision_start_token_id == 151652
    assert sweep.tiny_config("dbrx").attn_config.clip_qkv == 8.0  # DBRX clamps to it unconditionally
    assert sweep.tiny_config("t5gemma2_encoder").text_config.dropout_rate == 0.0
    moonshine = sweep.tiny_config("moonshine_streaming")
    assert moonshine.num_key_value_heads == moonshine.num_attention_heads


def test_the_tools_phase_gives_every_tool_a_status(tmp_path):
    # issue 51: a modular-ok row's files (ours, torch's flat file, the inputs) go through every
    # file tool by the package's API; the row's tools field, the table's cell and totals say how
    import sweep_tools

    folder = str(tmp_path)
    modular = sweep._job_modular("llama", "LlamaModel", folder)
    flat = sweep._job_flat("llama", "LlamaModel", folder)
    assert modular["ok"] and flat["ok"]
    assert {p.name for p in tmp_path.iterdir()} >= {sweep_tools.MODULAR, sweep_tools.FLAT, sweep_tools.INPUTS}
    tools = {name: sweep_tools.run_tool(name, folder)["status"] for name in sweep_tools.TOOLS}
    assert tools == dict.fromkeys(sweep_tools.TOOLS, "ok"), tools
    # a tool that cannot run says why instead of failing the row; no flat file: modularize is n/a
    (tmp_path / sweep_tools.FLAT).unlink()
    assert sweep_tools.run_tool("modularize", folder)["status"].startswith("n/a: torch's flat export failed")
    (tmp_path / sweep_tools.MODULAR).write_bytes(b"not onnx")
    assert sweep_tools.run_tool("diff", folder)["status"].startswith("InvalidModelFileError")
    row = sweep.row_of("llama", "LlamaModel", "base", flat, modular)
    row.tools = dict(tools, profile="97.0% of kernel time attributed")
    other = sweep.Row("bert", "BertModel", "base", True, True, True)  # a row the tools phase did not run on
    environment = {"commit": "abc", "torch": "t", "transformers": "x", "onnxscript": "o", "onnxruntime": "r", "date": "d"}
    sweep.write_markdown(tmp_path / "c.md", [row, other], environment, planned=2)
    sweep.write_json(tmp_path / "c.json", [row, other], environment, planned=2)
    text = (tmp_path / "c.md").read_text()
    assert "Every file tool on the files of 1 of the 2 modular-ok rows" in text
    assert "| convert_f16 | 1 | 0 | 1 | 0 |" in text and "| profile | 0 | 0 | 1 | 0 |" in text
    assert "profile: 97.0% of kernel time attributed" in text
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["tools"]["split"] == {"passed": 1, "run": 1, "n/a": 0, "auto-keep": 0} and data["tools"]["rows"]["run"] == 1
    # a conversion that passes only with --auto-keep at its budget is a pass, counted apart
    auto = dataclasses.replace(row, tools=dict(row.tools, convert_int8="ok (--auto-keep 0.25 kept 1: score; without it: drift 1.02)"))
    assert sweep_tools.tool_totals([auto])["convert_int8"] == {"passed": 1, "run": 1, "n/a": 0, "auto-keep": 1}
    assert [r.tools for r in sweep.read_rows(tmp_path / "c.json")] == [row.tools, None]
