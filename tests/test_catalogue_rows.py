"""The rules that build the catalogue's rows (tests/catalogue/), by family of architectures: each
test asserts on the tiny config or the inputs the rules make (rotary sections, widths tied to a
hidden size, layers kept, experts, towers, log-mel features, images and their tokens, prompts,
noise, codecs' waveforms), a few export the row with parity (export_modular's own check), and the
notes name the limit where both exporters fail."""

from __future__ import annotations

import dataclasses

import pytest
from catalogue import building, coverage, model_inputs, overrides, reference_outputs, shrinking

transformers = pytest.importorskip("transformers")


def test_rotary_sections_fit_the_tiny_head():
    # Qwen2-VL's config has no sections: the model falls back to a full-size head's [16, 24, 24]
    text = building.tiny_config("qwen2_vl").text_config
    head_dim = text.hidden_size // text.num_attention_heads
    assert len(text.rope_parameters["mrope_section"]) == 3 and sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    # a config with its own sections ([24, 20, 20]) gets them refitted, in proportion
    cosmos = building.tiny_config("cosmos3_edge").text_config
    assert sum(cosmos.rope_parameters["mrope_section"]) == cosmos.head_dim // 2
    assert shrinking._fit_sections([16, 24, 24], 8) == [2, 3, 3] and sum(shrinking._fit_sections([24, 20, 20], 8)) == 8


def test_widths_tied_to_a_hidden_size_shrink_with_it():
    docling = building.tiny_config("granite_docling")  # the projector's output is the text model's width
    assert docling.vision_config.out_hidden_size == docling.text_config.hidden_size == overrides.HIDDEN
    tts = building.tiny_config("pocket_tts")  # the flow head is conditioned on the backbone's states
    assert tts.flow_head_config.condition_dim == tts.hidden_size == overrides.HIDDEN
    squeeze = building.tiny_config("squeezebert")
    assert squeeze.embedding_size == squeeze.hidden_size == overrides.HIDDEN
    reformer = building.tiny_config("reformer")  # factors of the width: the axial position embeddings
    assert sum(reformer.axial_pos_embds_dim) == reformer.hidden_size


def test_per_layer_lists_and_layer_indices_follow_the_kept_layers():
    swinv2 = building.tiny_config("swinv2")
    assert len(swinv2.depths) == len(swinv2.pretrained_window_sizes) == len(swinv2.num_heads)
    audio = building.tiny_config("muse_spark").audio_config
    assert len(audio.patch_sizes) == len(audio.hidden_sizes) == len(audio.depths) == audio.num_hidden_layers
    molmo = building.tiny_config("molmo2")  # [24, 18] of 27 layers: the last two of the tiny tower
    assert molmo.adapter_config.vision_feature_layer == [-1, -2]
    assert shrinking._layer_index(-2) == -2 and shrinking._layer_index(30) == -1


def test_routing_groups_none_sizes_and_languages():
    axk1 = building.tiny_config("axk1")  # 4 experts: one group, chosen
    assert axk1.n_group == axk1.topk_group == 1 and axk1.n_routed_experts == 4
    assert building.tiny_config("ernie4_5_moe").moe_k == 2
    assert building.tiny_config("nemotron").num_key_value_heads == 1  # None in the default config
    assert building.tiny_config("esm").vocab_size == 512
    assert building.tiny_config("xmod").default_language == "en_XX"
    assert building.tiny_config("gptj").rotary_dim == 8  # partial rotary inside a 16-wide head
    bit = building.tiny_config("bit")  # group norms over 8-channel stages
    assert all(size % bit.num_groups == 0 for size in bit.hidden_sizes)


def test_towers_are_built_from_their_own_sub_config():
    config = building.tiny_config("mllama")
    assert building.config_for_class(config, transformers.MllamaTextModel) is config.text_config
    assert building.config_for_class(config, transformers.MllamaVisionModel) is config.vision_config
    assert building.config_for_class(config, transformers.MllamaModel) is config


def test_a_detector_reads_the_channels_its_backbone_gives():
    config = building.tiny_config("rt_detr")
    backbone = config.backbone_config
    stages = [backbone.embedding_size, *backbone.hidden_sizes]
    assert list(config.encoder_in_channels) == [stages[i] for i in backbone.out_indices]
    assert set(config.decoder_in_channels) == {config.encoder_hidden_dim} == {overrides.HIDDEN}  # the encoder's width


def test_log_mel_features_in_the_layout_the_model_reads():
    # Whisper's extractor gives (batch, bins, frames); Parakeet's encoder reads (batch, frames, bins)
    model, inputs, _ = building.build("whisper", "WhisperModel")
    assert inputs["input_features"].shape[1] == model.config.num_mel_bins
    model, inputs, _ = building.build("parakeet_encoder", "ParakeetEncoder")
    assert inputs["input_features"].shape[-1] == model.config.num_mel_bins


def test_vision_language_rows_get_images_and_their_tokens():
    model, inputs, _ = building.build("qwen2_vl", "Qwen2VLModel")
    config = model.config
    grid = inputs["image_grid_thw"]
    merge = config.vision_config.spatial_merge_size
    per_image = int(grid[0].prod()) // merge**2
    assert inputs["pixel_values"].shape[0] == int(grid.prod(dim=1).sum())  # flattened patches, as the processor gives
    assert ((inputs["input_ids"] == config.image_token_id).sum(dim=1) == per_image).all()
    assert ((inputs["input_ids"] == config.vision_start_token_id).sum(dim=1) == 1).all()
    assert (inputs["mm_token_type_ids"] == (inputs["input_ids"] == config.image_token_id)).all()
    model, inputs, _ = building.build("llava", "LlavaForConditionalGeneration")  # 4 x 4 patches, the CLS dropped
    assert inputs["pixel_values"].shape == (overrides.BATCH, 3, 32, 32)
    assert ((inputs["input_ids"] == model.config.image_token_id).sum(dim=1) == 16).all()
    config = building.tiny_config("llava_next")  # tilings scaled to the tiny tower's image size
    assert [32, 64] in config.image_grid_pinpoints and max(max(p) for p in config.image_grid_pinpoints) <= 96


def test_video_audio_and_classification_inputs():
    _, inputs, _ = building.build("videomae", "VideoMAEModel")  # (batch, frames, channels, height, width)
    assert inputs["pixel_values"].dim() == 5 and inputs["pixel_values"].shape[1] == building.tiny_config("videomae").num_frames
    _, inputs, expected = building.build("bart", "BartForSequenceClassification")  # one EOS per row, the decoder's own input
    assert "decoder_input_ids" not in inputs and (inputs["input_ids"][:, -1] == 2).all() and expected[0].shape[0] == overrides.BATCH
    _, inputs, _ = building.build("wav2vec2", "Wav2Vec2ForXVector")  # enough frames for the time-delay layers
    assert inputs["input_values"].shape == (overrides.BATCH, 16000)


def test_notes_name_the_limit_where_both_exporters_fail():
    Row = coverage.Row
    guard = Row("x", "X", "base", True, False, False, error="GuardOnDataDependentSymNode: Could not guard on data-dependent expression Eq(u0, 1)",
                flat_error="... data-dependent ...")
    assert "data-dependent" in coverage.classify(guard)
    timm = Row("detr", "DetrModel", "base", error="ImportError: TimmBackbone requires the timm library but it was not found")
    assert "torchvision" in coverage.classify(timm)
    assert coverage.classify(Row("llama", "LlamaModel", "base", True, True, True)) is None
    assert coverage.classify(Row("y", "Y", "base", True, True, False, error="ParityError: drift")) is None  # flat passes: ours to fix
    built = Row("b", "B", "base", False, False, False, stage="build", error="TypeError: x", flat_stage="build")
    assert coverage.classify(built).startswith("not built")
    odd = Row("o", "O", "base", True, False, False, stage="translate", error="X", flat_stage="run", flat_error="Y")
    assert coverage.classify(odd) == "both fail: modular at translate, flat at run (the errors say why)"
    both = Row("z", "Z", "base", True, False, False, stage="verify", error="ParityError: drift", flat_stage="verify", flat_error="max abs difference 0.4")
    assert "differ from PyTorch" in coverage.classify(both)
    captured = dataclasses.replace(both, error=f"ParityError: drift ({coverage.CAPTURED_SO})")  # PaliGemma's prefix mask
    assert "torch.export captures differs from eager PyTorch" in coverage.classify(captured)
    tied = dataclasses.replace(both, error=f"ParityError: drift ({coverage.TIED_SO})")  # RT-DETR on random weights
    assert "torch.topk on ties" in coverage.classify(tied) and "lowest index first" in coverage.classify(tied)
    remain = dataclasses.replace(both, ties=f"torch.topk on ties (top 16 of 21 with 32 tied): {reference_outputs.TIES_REMAIN} (...)")
    assert coverage.classify(remain) == coverage.classify(tied)


def test_towers_time_series_codebooks_and_stacked_features():
    # a Qwen-VL-style vision tower: flattened patches and their grid, as its processor gives them
    _, inputs, _ = building.build("qwen2_5_vl_vision", "Qwen2_5_VisionTransformerPretrainedModel")
    assert inputs["hidden_states"].shape[0] == int(inputs["grid_thw"].prod(dim=1).sum()) and inputs["grid_thw"].shape == (overrides.BATCH, 3)
    model, inputs, _ = building.build("patchtst", "PatchTSTModel")  # (batch, context, channels)
    assert inputs["past_values"].shape == (overrides.BATCH, model.config.context_length, model.config.num_input_channels)
    model, inputs, _ = building.build("musicgen", "MusicgenForCausalLM")  # one row per codebook
    assert inputs["input_ids"].shape == (overrides.BATCH * model.config.num_codebooks, overrides.SEQUENCE)
    model, inputs, _ = building.build("wav2vec2-bert", "Wav2Vec2BertModel")  # two frames stacked per row
    assert inputs["input_features"].shape[-1] == model.config.feature_projection_input_dim
    # per-layer key heads follow the tiny head count: all stay all, grouped become one
    assert set(building.tiny_config("sapiens2").num_key_value_heads_per_layer) == {1, 2}


def test_audio_language_rows_get_audio_and_their_tokens():
    assert building.tiny_config("voxtral").audio_token_id == 5  # left unset by the default config
    model, inputs, _ = building.build("voxtral", "VoxtralForConditionalGeneration")
    audio = model.config.audio_config
    assert inputs["input_features"].shape == (overrides.BATCH, audio.num_mel_bins, 2 * audio.max_source_positions)
    tokens = (inputs["input_ids"] == model.config.audio_token_id).sum(dim=1)
    with torch_no_grad():
        features = model.get_audio_features(input_features=inputs["input_features"]).pooler_output
    assert (tokens == features.shape[0] // overrides.BATCH).all() and int(tokens[0]) > 0


def torch_no_grad():
    import torch

    return torch.no_grad()


def test_timm_backbones_become_transformers_resnets():
    # timm needs torchvision, which does not import beside the CPU torch here
    config = building.tiny_config("detr")
    assert config.backbone_config.model_type == "resnet" and list(config.backbone_config.out_indices) == [1, 2, 3, 4]
    assert max(config.backbone_config.hidden_sizes) <= 64


def test_a_config_the_rules_break_builds_shallow():
    # Donut-Swin's tiny widths break its windows: depth only, the default widths, then export with parity
    from onnx_modular import export_modular

    default = transformers.AutoConfig.for_model("donut-swin")
    shallow = building.tiny_config("donut-swin", "shallow")
    assert shallow.embed_dim == default.embed_dim and shallow.depths == [1] * len(default.depths)
    model, inputs, _, tier = building.build_with_tier("donut-swin", "DonutSwinModel")
    assert tier == "shallow" and sum(p.numel() for p in model.parameters()) < building.PARAMETER_BUDGET
    result = export_modular(model, (), kwargs=inputs)
    assert result.report.ok, str(result.report)
    # a row that builds tiny stays tiny
    assert building.build_with_tier("llama", "LlamaModel")[3] == "tiny"


def test_a_model_over_the_budget_is_not_built(monkeypatch):
    monkeypatch.setattr(building, "PARAMETER_BUDGET", 1000)
    with pytest.raises(building.OverBudget, match="shallow config"):
        building._build("llama", "LlamaModel", "shallow")


def test_random_masking_gets_its_noise():
    # ViT-MAE draws the patches it masks from noise made inside forward unless given: fixed, the
    # export matches PyTorch
    from onnx_modular import export_modular

    model, inputs, _ = building.build("vit_mae", "ViTMAEModel")
    patches = (model.config.image_size // model.config.patch_size) ** 2
    assert inputs["noise"].shape == (overrides.BATCH, patches)
    result = export_modular(model, (), kwargs=inputs)
    assert result.report.ok, str(result.report)


def test_a_vocoder_gets_its_noise_sequence():
    # UnivNet draws its noise inside forward unless given (torch.randn, which no exporter
    # translates): fixed, one frame per spectrogram frame, the export matches PyTorch
    from onnx_modular import export_modular

    model, inputs, _ = building.build("univnet", "UnivNetModel")
    features, noise = inputs["input_features"], inputs["noise_sequence"]
    assert noise.shape == (overrides.BATCH, features.shape[1], model.config.model_in_channels)
    assert features.shape[2] == model.config.num_mel_bins  # (batch, frames, bins), as UnivNet reads them
    result = export_modular(model, (), kwargs=inputs)
    assert result.report.ok, str(result.report)


def test_values_a_default_config_leaves_to_the_checkpoint_are_filled():
    # experts whose routing is unset: 2 of the 4 per token, one group (DeepSeek-V2's topk(None) otherwise)
    deepseek = building.tiny_config("deepseek_v2")
    assert (deepseek.num_experts_per_tok, deepseek.n_group, deepseek.topk_group) == (2, 1, 1) and deepseek.n_routed_experts == 4
    assert building.tiny_config("axk2").n_group is None  # routing set by its config: its groups stay as they are
    # dense or sparse feed-forward per layer: one of each
    ocr = building.tiny_config("deepseek_ocr2").text_config
    assert ocr.mlp_layer_types == ["dense", "sparse"] and len(ocr.mlp_layer_types) == ocr.num_hidden_layers
    # rotary per layer kind, left empty: one default entry per kind, sections within half the head
    compass = building.tiny_config("cohere_compass_text")
    assert set(compass.rope_parameters) == set(compass.layer_types) == {"full_attention"}
    assert sum(compass.rope_parameters["full_attention"]["mrope_section"]) == compass.head_dim // 2
    # a forecaster's horizon (its context follows it)
    informer = building.tiny_config("informer")
    assert informer.prediction_length == informer.context_length == 4


def test_depthwise_groups_shrink_with_the_width_they_divide():
    mimi = building.tiny_config("mimi")  # an upsampling convolution grouped per hidden channel
    assert mimi.upsample_groups == mimi.hidden_size == overrides.HIDDEN
    assert building.tiny_config("csm").codec_config.upsample_groups == overrides.HIDDEN


def test_unrouted_experts_build_and_export_with_parity():
    from onnx_modular import export_modular

    model, inputs, _, tier = building.build_with_tier("deepseek_v2", "DeepseekV2Model")
    assert tier == "tiny" and model.config.num_experts_per_tok == 2
    result = export_modular(model, (), kwargs=inputs)
    assert result.report.ok, str(result.report)


def test_pixel_models_that_read_text_get_their_prompt():
    # a forward that requires input_ids beside pixels gets token ids too (Grounding DINO's caption)
    model, inputs, _ = building.build("grounding-dino", "GroundingDinoModel")
    assert inputs["input_ids"].shape == (overrides.BATCH, overrides.SEQUENCE) and inputs["pixel_values"].dim() == 4
    # a Q-Former's image makes num_query_tokens features: the text holds that many image tokens
    # (left unset by the default config), and the Q-Former gets its own prompt
    model, inputs, _ = building.build("instructblip", "InstructBlipForConditionalGeneration")
    config = model.config
    assert building.tiny_config("instructblip").image_token_index == 6
    assert ((inputs["input_ids"] == config.image_token_index).sum(dim=1) == config.num_query_tokens).all()
    assert inputs["qformer_input_ids"].shape == inputs["qformer_attention_mask"].shape == (overrides.BATCH, overrides.SEQUENCE)
    # a video Q-Former: (batch, frames, channels, height, width), num_query_tokens per frame
    model, inputs, _ = building.build("instructblipvideo", "InstructBlipVideoModel")
    frames = inputs["pixel_values"].shape[1]
    assert inputs["pixel_values"].dim() == 5
    assert ((inputs["input_ids"] == model.config.video_token_index).sum(dim=1) == frames * model.config.num_query_tokens).all()
    # Kosmos-2 marks its latent_query_num image positions
    model, inputs, _ = building.build("kosmos-2", "Kosmos2Model")
    assert (inputs["image_embeds_position_mask"].sum(dim=1) == model.config.latent_query_num).all()
    assert inputs["image_embeds_position_mask"].shape == inputs["input_ids"].shape
    # a text-prompted segmenter (optional input_ids, a text_config, no decoder) gets its prompt
    _, inputs, _ = building.build("sam3", "Sam3Model")
    assert inputs["input_ids"].shape == (overrides.BATCH, overrides.SEQUENCE)
    # an image-to-text decoder (decoder inputs, no image token) is read from its pixels alone, as before
    _, inputs, _ = building.build("pp_formulanet", "PPFormulaNetForConditionalGeneration")
    assert "input_ids" not in inputs


def test_a_pixel_model_with_its_prompt_exports_with_parity():
    from onnx_modular import export_modular

    model, inputs, _ = building.build("blip-2", "Blip2Model")
    assert ((inputs["input_ids"] == model.config.image_token_index).sum(dim=1) == model.config.num_query_tokens).all()
    result = export_modular(model, (), kwargs=inputs)
    assert result.report.ok, str(result.report)


def test_key_heads_stay_all_heads_where_values_have_all_heads():
    # Nemotron 3's audio attention: v_proj has num_attention_heads heads, k_proj num_key_value_heads;
    # an override keeps them equal, merged into the shrunk audio tower (its other sizes stay tiny)
    from onnx_modular import export_modular

    audio = building.tiny_config("nemotron3_diarization").audio_config
    assert audio.num_key_value_heads == audio.num_attention_heads == 2 and audio.hidden_size == 32
    for model_type in ("nemotron3_diarization_audio", "nemotron3_5_transcribe_asr_audio"):
        config = building.tiny_config(model_type)
        assert config.num_key_value_heads == config.num_attention_heads == 2 and config.hidden_size == 32
    model, inputs, _, tier = building.build_with_tier("nemotron3_diarization_audio", "Nemotron3DiarizationAudioModel")
    attention = next(m for name, m in model.named_modules() if name.endswith("self_attn"))
    assert tier == "tiny" and attention.k_proj.out_features == attention.v_proj.out_features
    result = export_modular(model, (), kwargs=inputs)
    assert result.report.ok, str(result.report)


def test_video_models_get_pixel_values_videos():
    # a forward whose main input is pixel_values_videos: (batch, frames, channels, height, width)
    model, inputs, _ = building.build("vjepa2", "VJEPA2Model")
    assert inputs["pixel_values_videos"].dim() == 5 and inputs["pixel_values_videos"].shape[1] == 2 * model.config.tubelet_size
    model, inputs, _ = building.build("videoprism", "VideoPrismClipModel")  # frames from the config, and the text
    assert inputs["pixel_values_videos"].shape[1] == model.config.vision_config.num_frames and "input_ids" in inputs


def test_codecs_get_a_waveform_with_its_channels():
    # a codec (a channel count or stride ratios in its config) reads (batch, channels, samples)
    model, inputs, _ = building.build("encodec", "EncodecModel")
    assert inputs["input_values"].shape == (overrides.BATCH, model.config.audio_channels, 4000)
    _, inputs, _ = building.build("vibevoice_acoustic_tokenizer_encoder", "VibeVoiceAcousticTokenizerEncoderModel")
    assert inputs["hidden_states"].dim() == 3  # its forward's name for the waveform
    # a speech encoder keeps (batch, samples)
    _, inputs, _ = building.build("wav2vec2", "Wav2Vec2Model")
    assert inputs["input_values"].dim() == 2
    # a required waveform beside text, its codec found in a sub-config (PE Audio wraps a DAC)
    _, inputs, _ = building.build("pe_audio", "PeAudioModel")
    assert inputs["input_ids"].shape == (overrides.BATCH, overrides.SEQUENCE) and inputs["input_values"].shape[:2] == (overrides.BATCH, 1)
    # a codec with a semantic encoder: one stacked feature frame per acoustic frame
    config = building.tiny_config("xcodec2")
    with torch_device("meta"):
        model = transformers.Xcodec2Model._from_config(config)
    inputs = model_inputs.make_inputs(model, config)
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
    model, inputs, _ = building.build("audioflamingo3_encoder", "AudioFlamingo3Encoder")
    assert inputs["input_features_mask"].shape == (overrides.BATCH, inputs["input_features"].shape[-1])
    # low-frame-rate stacking: (batch, frames, k x bins)
    model, inputs, _ = building.build("fun_asr_nano_encoder", "FunAsrNanoEncoder")
    config = model.config
    assert inputs["input_features"].shape[-1] == config.num_mel_bins * config.num_stacked_frames
    assert inputs["input_features_mask"].shape == inputs["input_features"].shape[:2]
    # a windowed encoder reads whole windows of 2 x n_window frames
    model, inputs, _ = building.build("qwen3_asr_encoder", "Qwen3ASREncoder")
    assert inputs["input_features"].shape[-1] % (2 * model.config.n_window) == 0


def test_region_task_and_single_stream_inputs():
    # a two-stream model over detected regions: region features of visual_feat_dim and boxes in 0..1
    model, inputs, _ = building.build("lxmert", "LxmertModel")
    assert inputs["visual_feats"].shape[-1] == model.config.visual_feat_dim
    boxes = inputs["visual_pos"]
    assert boxes.shape[-1] == model.config.visual_pos_dim and (boxes[..., 2:] > boxes[..., :2]).all() and boxes.max() <= 1
    # a single-stream text and image model (modality type embeddings, no vision sub-config) gets pixels
    model, inputs, _ = building.build("vilt", "ViltForQuestionAnswering")
    assert inputs["pixel_values"].shape[1:] == (model.config.num_channels, model.config.image_size, model.config.image_size)
    # OneFormer's task prompt, task_seq_len tokens
    model, inputs, _ = building.build("oneformer", "OneFormerModel")
    assert inputs["task_inputs"].shape == (overrides.BATCH, model.config.task_seq_len)
    # Longformer's question-answering heads: global attention on the first token, as a pipeline gives
    _, inputs, _ = building.build("longformer", "LongformerForMultipleChoice")
    mask = inputs["global_attention_mask"]
    assert mask.shape == inputs["input_ids"].shape and (mask[..., 0] == 1).all() and int(mask.sum()) == overrides.BATCH * 2
    # a univariate patched forecaster: whole patches, padding flags, a frequency
    model, inputs, _ = building.build("timesfm", "TimesFmModel")
    assert inputs["past_values"].dim() == 2 and inputs["past_values"].shape[1] % model.config.patch_length == 0
    assert inputs["past_values_padding"].shape == inputs["past_values"].shape and inputs["freq"].shape[0] == overrides.BATCH


def test_patched_towers_and_image_pairs():
    # SigLIP 2's NaFlex tower: flattened patches, their grid and which are valid
    model, inputs, _ = building.build("siglip2_vision_model", "Siglip2VisionModel")
    config = model.config
    patches = int(inputs["spatial_shapes"][0].prod())
    assert inputs["pixel_values"].shape == (overrides.BATCH, patches, config.num_channels * config.patch_size**2)
    assert inputs["pixel_attention_mask"].shape == (overrides.BATCH, patches)
    # Gemma 4's tower: whole pooling windows of patches, each with its (x, y)
    model, inputs, _ = building.build("gemma4_vision", "Gemma4VisionModel")
    positions = inputs["pixel_position_ids"]
    assert positions.shape == (*inputs["pixel_values"].shape[:2], 2) and positions.shape[1] % model.config.pooling_kernel_size**2 == 0
    assert len({tuple(p) for p in positions[0].tolist()}) == positions.shape[1]  # every patch its own place
    # a keypoint matcher reads a pair of images per row
    _, inputs, _ = building.build("superglue", "SuperGlueForKeypointMatching")
    assert inputs["pixel_values"].shape[:2] == (overrides.BATCH, 2) and inputs["pixel_values"].dim() == 5


def test_generic_inputs_and_audio_towers():
    # a composite speech encoder-decoder takes its encoder's inputs under their own names
    model, inputs, _ = building.build("speech-encoder-decoder", "SpeechEncoderDecoderModel")
    assert model.main_input_name == "inputs" and inputs["input_values"].dim() == 2 and "decoder_input_ids" in inputs
    # Perceiver without a preprocessor reads embeddings of its d_model
    model, inputs, _ = building.build("perceiver", "PerceiverModel")
    assert inputs["inputs"].shape == (overrides.BATCH, overrides.SEQUENCE, model.config.d_model)
    _, inputs, _ = building.build("perceiver", "PerceiverForMaskedLM")  # a head with token ids keeps them
    assert "input_ids" in inputs and "inputs" not in inputs
    # Gemma 3n's audio tower: log-mel frames and their padding mask
    model, inputs, _ = building.build("gemma3n_audio", "Gemma3nAudioEncoder")
    assert inputs["audio_mel"].shape[-1] == model.config.input_feat_size and not inputs["audio_mel_mask"].any()


def test_flattened_patches_and_prompt_images():
    # Pix2Struct's flattened patches: (row, column) from 1, then the patch's pixels
    config = building.tiny_config("pix2struct")
    with torch_device("meta"):
        model = transformers.Pix2StructForConditionalGeneration._from_config(config)
    inputs = model_inputs.make_inputs(model, config)
    patches = inputs["flattened_patches"]
    assert patches.shape[-1] == 2 + config.vision_config.patch_embed_hidden_size and patches[..., :2].min() == 1
    assert inputs["attention_mask"].shape == patches.shape[:2]
    # SegGPT: an example image and its mask of the input's shape, the three filling its image_size
    model, inputs, _ = building.build("seggpt", "SegGptModel")
    height, width = model.config.image_size
    assert inputs["pixel_values"].shape[-2:] == inputs["prompt_masks"].shape[-2:] == (height // 2, width)
    assert inputs["prompt_pixel_values"].shape == inputs["pixel_values"].shape


def test_embeddings_a_caller_computes_and_video_text_pairs():
    # a required *_embeds gets (batch, sequence, hidden), with what a cross-attention reads
    model, inputs, _ = building.build("blip_2_qformer", "Blip2QFormerModel")
    assert inputs["query_embeds"].shape == (overrides.BATCH, overrides.SEQUENCE, model.config.hidden_size)
    assert inputs["encoder_hidden_states"].shape[-1] == model.config.encoder_hidden_size
    # a forward whose main input is embeddings gets them, and no token ids it would not read
    model, inputs, _ = building.build("nemotron3_5_transcribe_word_timestamp", "Nemotron3_5TranscribeWordTimestampModel")
    assert set(inputs) == {"inputs_embeds", "attention_mask"}
    # a video-text dual encoder: frames from its vision config
    model, inputs, _ = building.build("xclip", "XCLIPModel")
    assert inputs["pixel_values"].shape[:2] == (overrides.BATCH, model.config.vision_config.num_frames) and "input_ids" in inputs


def test_an_image_text_retrieval_head_reads_text_through_its_qformer():
    model, inputs, expected = building.build("blip-2", "Blip2ForImageTextRetrieval")
    assert model.config.qformer_config.use_qformer_text_input and "input_ids" in inputs and expected
    assert not building.tiny_config("blip-2").qformer_config.use_qformer_text_input  # other rows as they were


def test_interleaved_images_with_their_attention_mask():
    # IDEFICS: (batch, images, channels, height, width) and which images each token attends to
    _, inputs, _ = building.build("idefics", "IdeficsModel")
    assert inputs["pixel_values"].dim() == 5 and inputs["pixel_values"].shape[:2] == (overrides.BATCH, 1)
    assert inputs["image_attention_mask"].shape == (*inputs["input_ids"].shape, 1)


def test_overrides_fill_what_only_a_checkpoint_sets():
    # Sapiens2's task heads: every channel list None in the default config
    head = building.tiny_config("sapiens2").head_config
    assert head.upsample_out_channels == [16, 16] and head.upsample_kernel_sizes == [4, 4] and head.conv_out_channels == [16]
    # Qwen4-Exp's token indexer, merged into the shrunk text config (which stays tiny)
    text = building.tiny_config("qwen4_exp").text_config
    assert text.indexer_budget % text.indexer_compress_ratio == 0 and text.indexer_kv_heads == 1
    assert text.hidden_size == overrides.HIDDEN and "indexed_attention" in text.layer_types
    assert building.tiny_config("qwen4_exp_text").indexer_n_heads == 2


def test_expert_counts_mamba_widths_and_sliding_windows_left_unset():
    dots = building.tiny_config("dots1")  # neither how many experts nor how many per token
    assert (dots.n_routed_experts, dots.num_experts_per_tok, dots.n_shared_experts) == (4, 2, 1)
    falcon = building.tiny_config("falcon_h1")  # the Mamba width given: heads x head dim
    assert falcon.mamba_d_ssm == falcon.mamba_n_heads * falcon.mamba_d_head
    step = building.tiny_config("step3p7").text_config  # sliding-attention heads, no window: Step 3.7 always masks for one
    assert step.sliding_window == overrides.SEQUENCE // 2
    assert building.tiny_config("mixtral").sliding_window is None  # None means full attention there: kept


def test_a_forecaster_gets_its_lags_time_features_and_observed_mask():
    model, inputs, expected = building.build("time_series_transformer", "TimeSeriesTransformerModel")
    config = model.config
    length = config.context_length + max(config.lags_sequence)
    assert inputs["past_values"].shape == inputs["past_observed_mask"].shape == (overrides.BATCH, length)  # univariate
    assert inputs["past_time_features"].shape == (overrides.BATCH, length, config.num_time_features)
    assert expected[0].shape[0] == overrides.BATCH


def test_cache_sharing_layers_follow_the_kept_layers():
    # Gemma 3n's last 15 of 35 layers reuse an earlier cache of their kind: the two kept layers (one of
    # each kind) both make their own
    text = building.tiny_config("gemma3n_text")
    assert text.num_hidden_layers == 2 and set(text.layer_types) == {"sliding_attention", "full_attention"}
    assert text.num_kv_shared_layers == 0
    assert building.tiny_config("gemma4_text").num_kv_shared_layers == 0


def test_a_tokenizer_map_left_to_the_checkpoint_holds_the_image_token():
    # Chameleon and Emu3 read their image placeholder from the tokenizer's map (None by default)
    chameleon = building.tiny_config("chameleon")
    assert chameleon.vocabulary_map == {"<image>": chameleon.vocab_size - 1} and chameleon.image_token_id == chameleon.vocab_size - 1
    emu3 = building.tiny_config("emu3")  # its text model has the vocabulary
    assert emu3.vocabulary_map["<image>"] == emu3.text_config.vocab_size - 1


def test_overrides_for_keys_a_config_class_does_not_tie_or_declare():
    fun = building.tiny_config("fun_asr_nano")  # its validator: a quarter of the text model's width
    assert fun.adaptor_config.intermediate_size == fun.text_config.hidden_size // 4
    assert fun.adaptor_config.hidden_size == overrides.HIDDEN  # merged into the shrunk sub-config
    thinker = building.tiny_config("qwen2_5_omni_thinker")  # read by its multimodal positions, not declared
    assert thinker.vision_start_token_id == 151652
    assert building.tiny_config("dbrx").attn_config.clip_qkv == 8.0  # DBRX clamps to it unconditionally
    assert building.tiny_config("t5gemma2_encoder").text_config.dropout_rate == 0.0
    moonshine = building.tiny_config("moonshine_streaming")
    assert moonshine.num_key_value_heads == moonshine.num_attention_heads
