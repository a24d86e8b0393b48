"""Rules of the transformers sweep's catalogue (tests/catalogue/) that make one family of
architectures build: each test asserts the tiny config or the inputs a rule produces and that the
model builds (runs in PyTorch on them); where cheap, that export_modular exports it with parity
(float32 atol 1e-4 / rtol 1e-3). The sweep's machinery and its sample are in test_sweep.py; these
are a file of their own so that the two run on separate test workers."""

from __future__ import annotations

import pytest
from catalogue import building, config_keys, media_inputs, model_inputs, overrides, reference_outputs

transformers = pytest.importorskip("transformers")



def torch_device(name):
    import torch

    return torch.device(name)


# ---- detectors, OCR, segmentation and dense prediction ----


def test_stage_widths_tied_to_channel_keys_stay():
    # HGNetV2 builds its stages from stage_*_channels; hidden_sizes only describe them (to a detector's
    # encoder, to the classifier): shrunk alone they break both, so they stay with the channels they repeat
    hgnet = building.tiny_config("hgnet_v2")
    assert list(hgnet.hidden_sizes[1:]) == list(hgnet.stage_out_channels[1:])
    assert config_keys.tied_channels({"stem_out_channels": 64, "num_channels": 3}, [64, 128]) == ["stem_out_channels"]
    assert config_keys.tied_channels({"num_channels": 3}, [8, 16]) == []
    assert building.tiny_config("resnet").hidden_sizes == [8, 16, 32, 64]  # untied stages still shrink
    # a detector's encoder reads the channels the backbone really hands on
    dfine = building.tiny_config("d_fine")
    assert list(dfine.encoder_in_channels) == dfine.backbone_config.hidden_sizes[1:]
    model, inputs, expected = building.build("d_fine", "DFineModel")
    assert inputs["pixel_values"].shape[-2:] == (32, 32) and expected
    _, _, expected = building.build("hgnet_v2", "HGNetV2ForImageClassification")
    assert expected[0].shape == (overrides.BATCH, hgnet.num_labels)


def test_a_text_recognizer_gets_an_image_tall_enough_for_its_pooling():
    # PP-OCR's recognizers pool (3, 2) over rows their backbone halved five times: 32 pixels leave 1 or 2
    model, inputs, _, tier = building.build_with_tier("pp_ocrv6_tiny_rec", "PPOCRV6TinyRecForTextRecognition")
    assert tier == "tiny" and inputs["pixel_values"].shape[-2:] == (64, 64)
    # other errors are not retried with larger images
    assert building._larger_image(model, inputs, ValueError("shapes differ")) is None


def test_pp_ocr_detectors_get_what_their_checkpoints_set():
    server = building.tiny_config("pp_ocrv5_server_det")
    assert server.scale_factor_list == [1, 2, 4, 8] and server.kernel_list == [3, 2, 2]
    assert server.intraclass_block_config["vertical_long_to_small_conv_longratio"] == [[7, 1], [1, 1], [3, 0]]
    medium = building.tiny_config("pp_ocrv6_medium_det")
    backbone = medium.backbone_config
    assert backbone.out_features == ["stage1", "stage2", "stage3", "stage4"]
    assert backbone.stage_out_channels == [blocks[-1][2] for blocks in backbone.block_configs]
    _, inputs, expected = building.build("pp_ocrv6_medium_det", "PPOCRV6MediumDetModel")
    assert expected[0].shape[0] == overrides.BATCH
    # a layout detector's per-label thresholds and reading-order categories, left unset: one per label
    layout = building.tiny_config("pp_doclayout_v2")
    assert len(layout.class_thresholds) == len(layout.class_order) == layout.num_labels
    assert building.build("pp_doclayout_v2", "PPDocLayoutV2ForObjectDetection")[2]


def test_a_dual_encoder_over_naflex_patches_and_its_projection_width():
    model, inputs, _ = building.build("siglip2", "Siglip2Model")
    config = model.config
    patches = int(inputs["spatial_shapes"][0].prod())
    assert inputs["pixel_values"].shape == (overrides.BATCH, patches, config.vision_config.num_channels * config.vision_config.patch_size**2)
    assert "input_ids" in inputs and config.text_config.projection_size == config.vision_config.hidden_size == overrides.HIDDEN
    _, inputs, _ = building.build("siglip2", "Siglip2ForImageClassification")
    assert inputs["pixel_attention_mask"].shape == (overrides.BATCH, patches)
    _, inputs, _ = building.build("siglip", "SiglipModel")  # a dual encoder over whole images keeps them
    assert inputs["pixel_values"].dim() == 4


def test_masked_pretraining_heads_get_their_mask_or_noise():
    # VideoMAE's pretraining head: as many masked patches in every row; its decoder's 6 heads fit the tiny width
    model, inputs, _ = building.build("videomae", "VideoMAEForPreTraining")
    mask = inputs["bool_masked_pos"]
    assert mask.shape == (overrides.BATCH, model.videomae.embeddings.num_patches) and len(set(mask.sum(-1).tolist())) == 1
    assert model.config.decoder_hidden_size % model.config.decoder_num_attention_heads == 0
    # Hiera's MAE decoder, left to the checkpoint, and one noise value per mask unit
    config = building.tiny_config("hiera")
    assert (config.decoder_hidden_size, config.decoder_depth, config.decoder_num_heads) == (overrides.HIDDEN, 1, 2)
    model, inputs, _ = building.build("hiera", "HieraForPreTraining")
    units = model.hiera.embeddings.patch_embeddings.mask_spatial_shape
    assert inputs["noise"].shape == (overrides.BATCH, units[0] * units[1])


def test_image_size_from_the_backbone_and_four_layers_for_beit_segmentation():
    model, inputs, _ = building.build("vitpose", "VitPoseForPoseEstimation")
    assert inputs["pixel_values"].shape[-2:] == tuple(model.config.backbone_config.image_size)
    config = building.tiny_config("beit")
    assert len(config.out_indices) == 4 and config.num_hidden_layers == 4 and config.hidden_size == overrides.HIDDEN
    assert building.build("beit", "BeitForSemanticSegmentation")[2]


def test_query_layers_windows_and_feature_levels_fit_the_tiny_encoder():
    # EoMT's queries join the last num_blocks layers: within the two kept ones
    config = building.tiny_config("eomt")
    assert 1 <= config.num_blocks < config.num_hidden_layers
    assert building.tiny_config("xlstm").num_blocks == building.tiny_config("xlstm").num_hidden_layers  # a layer count stays one
    _, _, expected = building.build("eomt", "EomtForUniversalSegmentation")
    assert expected
    # LW-DETR: 2 x 2 windows over the tiny image's patches, one feature level as its checkpoints project
    lw = building.tiny_config("lw_detr")
    assert lw.backbone_config.num_windows == 4 and lw.num_feature_levels == 1
    assert building.build("lw_detr", "LwDetrForObjectDetection")[2]


def test_keypoint_matchers_and_tiled_depth_models():
    # every class of a keypoint-matching architecture reads image pairs, its base model too
    config = building.tiny_config("efficientloftr", "shallow")
    with torch_device("meta"):
        model = transformers.EfficientLoFTRModel._from_config(config)
    inputs = model_inputs.make_inputs(model, config)
    assert inputs["pixel_values"].shape[:2] == (overrides.BATCH, 2) and inputs["pixel_values"].dim() == 5
    # DepthPro's patch is its encoders' whole image; the image grows until the smallest scale holds one
    config = building.tiny_config("depth_pro")
    assert config.patch_size == config.image_model_config.image_size == 32
    assert all(-2 <= i < 2 for i in config.intermediate_hook_ids)
    model, inputs, _ = building.build("depth_pro", "DepthProForDepthEstimation")
    assert min(inputs["pixel_values"].shape[-2:]) * min(config.scaled_images_ratios) >= config.patch_size


def test_a_dewarper_hands_on_every_bridge_stage_and_grows_its_image():
    # UVDoc's head concatenates the six bridge stages; their reflect padding needs more than 2 x 2 maps
    config = building.tiny_config("uvdoc")
    assert len(config.backbone_config.out_features) == len(config.backbone_config.stage_configs) == 6
    _, inputs, _ = building.build("uvdoc", "UVDocModel")
    assert inputs["pixel_values"].shape[-2:] == (64, 64)
    assert building._says_too_small(RuntimeError("Padding size should be less than the corresponding input dimension, but got: 2"))


def test_vitmatte_gets_list_sizes_and_its_backbone_patch():
    config = building.tiny_config("vitmatte")
    assert isinstance(config.fusion_hidden_sizes, list) and config.backbone_config.patch_size == 16
    assert config.backbone_config.hidden_size == config.hidden_size == overrides.HIDDEN
    assert building.build("vitmatte", "VitMatteForImageMatting")[2]


def test_sam2_ties_its_neck_feature_maps_and_prompt_grid_to_its_image():
    # SAM 2's neck reads the backbone's stages (widths last first), reshapes its maps to the feature
    # sizes (the image over strides 4, 8, 16) and its prompt grid is the image over 16: all tied
    config = building.tiny_config("sam2")
    vision, backbone = config.vision_config, config.vision_config.backbone_config
    assert vision.backbone_channel_list == list(reversed(backbone.embed_dim_per_stage))
    assert backbone.hidden_size == backbone.embed_dim_per_stage[0]
    side = backbone.image_size[0]
    assert [size[0] for size in vision.backbone_feature_sizes] == [side // 4, side // 8, side // 16]
    assert config.prompt_encoder_config.image_size // config.prompt_encoder_config.patch_size == side // 16
    # the image comes from the backbone config under the vision config once the sweep's 32 pixels fail
    model, inputs, expected = building.build("sam2", "Sam2Model")
    assert inputs["pixel_values"].shape[-2:] == (side, side)
    assert expected[1].shape[-2:] == (side // 4, side // 4)  # pred_masks, at the first feature map's size


def test_edgetam_builds_the_timm_model_its_checkpoints_name():
    # EdgeTAM's config class names its timm model under a misspelt key, so ResNet-50 is built, whose
    # stages the neck does not read; checkpoints name RepViT-M1
    config = building.tiny_config("edgetam")
    assert config.vision_config.backbone_config.architecture == "repvit_m1"
    assert config.vision_config.backbone_feature_sizes[-1] == [32 // 16] * 2 == [
        config.prompt_encoder_config.image_size // config.prompt_encoder_config.patch_size] * 2
    try:
        import timm  # noqa: F401
    except Exception:
        pytest.skip("timm does not import here (it needs torchvision)")
    model, inputs, expected = building.build("edgetam", "EdgeTamModel")
    assert model.vision_encoder.backbone.timm_model.feature_info.channels() == list(reversed(config.vision_config.backbone_channel_list))
    assert expected[1].shape[-2:] == (8, 8)


def test_a_timm_backbone_gets_a_released_timm_model_and_its_four_stages():
    # TimmBackbone leaves its timm model to the checkpoint (None): the sweep names a released one.
    # timm needs torchvision, which imports beside torch 2.15 but not beside the CPU torch 2.13.
    config = building.tiny_config("timm_backbone")
    assert config.backbone == "resnet18" and list(config.out_indices) == [1, 2, 3, 4]
    try:
        import timm  # noqa: F401
    except Exception:
        pytest.skip("timm does not import here (it needs torchvision)")
    model, inputs, expected = building.build("timm_backbone", "TimmBackbone")
    assert len(expected) == 4 and [t.shape[1] for t in expected] == [64, 128, 256, 512]
    from onnx_modular import export_modular

    result = export_modular(model, (), kwargs=inputs)
    domains = {f.domain for f in result.model.functions.values()}
    assert result.report.ok and any(d.startswith("pkg.timm.") for d in domains), domains


# ---- multimodal towers, text heads and per-layer configs ----


def test_causal_lm_heads_of_the_bert_family_are_built_as_decoders():
    # BertLMHeadModel, RobertaForCausalLM ...: decoders only with is_decoder (as a user exporting one sets
    # it), which keep a cache; a masked LM (no cache) is left alone
    bert = building.build("bert", "BertLMHeadModel")[0]
    assert bert.config.is_decoder is True and not bert.config.add_cross_attention
    assert building.build("roberta", "RobertaForMaskedLM")[0].config.is_decoder is False
    # heads whose default width would make heads narrower than GroupQueryAttention's 8
    assert building.tiny_config("gpt_neo").num_heads == 2 and building.tiny_config("xglm").attention_heads == 2


def test_iss36g_grid_patches_read_frames_per_patch_under_either_name():
    # Muse Spark's tower calls its temporal patch `patch_temporal`: (patches, 3 x frames x patch x patch)
    model, inputs, expected = building.build("muse_spark_vision", "MuseSparkVisionModel")
    config = model.config
    assert inputs["pixel_values"].shape[-1] == 3 * config.patch_temporal * config.patch_size**2
    assert inputs["grid_thw"].shape == (overrides.BATCH, 3) and expected


def test_iss36g_multimodal_rotary_sections_split_the_rotated_half_only():
    # GLM-4.5V rotates half of each head: the sections its config leaves unset sum to a quarter of the head
    text = building.tiny_config("glm4v_moe_text")
    head = text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == int(head * text.rope_parameters["partial_rotary_factor"]) // 2
    assert sum(building.tiny_config("glm4v_text").rope_parameters["mrope_section"]) == head // 2  # whole head: as before
    model, inputs, expected = building.build("glm4v_moe", "Glm4vMoeModel")
    assert "pixel_values" in inputs and inputs["image_grid_thw"].shape == (overrides.BATCH, 3) and expected


def test_iss36g_overrides_for_rotary_sections_and_fused_head_splits():
    # ERNIE 4.5-VL rotates height and width in pairs: equal sections, summing to half the 16-wide head
    sections = building.tiny_config("ernie4_5_vl_moe").text_config.rope_parameters["mrope_section"]
    assert sections[0] == sections[1] and sum(sections) == 8
    assert sum(building.tiny_config("paddleocr_vl").text_config.rope_parameters["mrope_section"]) == 8
    _, inputs, expected = building.build("ernie4_5_vl_moe", "Ernie4_5_VLMoeModel")
    assert "pixel_values" in inputs and expected
    codegen = building.tiny_config("codegen")  # the fused projection is split in 4
    assert codegen.n_head % 4 == 0 and codegen.rotary_dim <= codegen.n_embd // codegen.n_head


def test_iss36g_a_factorized_embedding_stays_narrower_than_the_hidden_size():
    mobile = building.tiny_config("mobilebert")
    assert mobile.embedding_size < mobile.hidden_size
    albert = building.tiny_config("albert")
    assert albert.embedding_size < albert.hidden_size == overrides.HIDDEN
    model, _, expected = building.build("mobilebert", "MobileBertForPreTraining")
    assert expected[0].shape[-1] == model.config.vocab_size


@pytest.mark.slow  # a 256-latent model: half a minute to build on this machine
def test_iss36g_perceiver_image_heads_get_images_and_one_cross_attention_head():
    assert building.tiny_config("perceiver").num_cross_attention_heads == 1
    model, inputs, expected = building.build("perceiver", "PerceiverForImageClassificationFourier")
    assert inputs["pixel_values"].shape == (overrides.BATCH, 3, 32, 32)  # an image, though the config counts frames
    assert expected[0].shape == (overrides.BATCH, model.config.num_labels)


def test_iss36g_per_layer_settings_shrink_with_the_config():
    # Dots 3's sliding layers have their own heads and widths: shrunk too, head = rotary + non-rotary part
    text = building.tiny_config("dots3_note_text")
    sliding = text.per_layer_config["sliding_attention"]
    assert sliding.num_attention_heads == sliding.num_key_value_heads == 2
    assert sliding.head_dim == sliding.qk_nope_head_dim + sliding.qk_rope_head_dim <= 32
    audio = building.tiny_config("dots3_note").audio_config  # the adapter reads the tower's width
    assert audio.adapter_input_size == audio.hidden_size == overrides.HIDDEN
    _, inputs, expected = building.build("dots3_note_text", "Dots3NoteTextModel")
    assert inputs["input_ids"].shape == (overrides.BATCH, overrides.SEQUENCE) and expected


def test_iss36g_task_heads_get_what_their_class_needs():
    # Reformer's language-model head is causal; T5's classifier starts its decoder with the padding id;
    # T5Gemma's encoder alone is built from an encoder-only config
    assert building.build("reformer", "ReformerModelWithLMHead")[0].config.is_decoder
    model, _, expected = building.build("t5", "T5ForSequenceClassification")
    assert model.config.decoder_start_token_id == model.config.pad_token_id and expected[0].shape[0] == overrides.BATCH
    assert not building.build("t5gemma", "T5GemmaEncoderModel")[0].config.is_encoder_decoder
    # Splinter's rows hold a question token; BLIP's answer head gets the answer's first tokens
    model, inputs, _ = building.build("splinter", "SplinterForPreTraining")
    assert (inputs["input_ids"] == model.config.question_token_id).sum(dim=1).min() >= 1
    _, inputs, expected = building.build("blip", "BlipForQuestionAnswering")
    assert inputs["decoder_input_ids"].shape == (overrides.BATCH, 4) and "pixel_values" in inputs and expected


def test_iss36g_navit_towers_get_packed_patches_and_their_grids():
    # MiniCPM-V's tower: the images' patches side by side in one row, each image's grid in patches
    model, inputs, expected = building.build("minicpm_ocr_vision", "MiniCPMOcrVisionModel")
    patch = model.config.patch_size
    grids = inputs["target_sizes"]
    assert inputs["pixel_values"].shape == (1, 3, patch, int((grids[:, 0] * grids[:, 1]).sum()) * patch)
    assert grids.shape == (overrides.BATCH, 2) and expected


def test_iss36g_derived_head_widths_and_experts_left_unset():
    # a composite's DeepSeek-V3 text tower derives head_dim from its rotary part: derived again once shrunk
    text = building.tiny_config("kimi_k25").text_config
    assert text.head_dim == text.qk_rope_head_dim <= 16
    # DiffusionGemma always builds experts its config leaves unset; Gemma 4 turns them off: left as they are
    moe = building.tiny_config("diffusion_gemma").text_config
    assert (moe.num_experts, moe.top_k_experts, moe.moe_intermediate_size) == (4, 2, overrides.HIDDEN)
    assert building.tiny_config("gemma4").text_config.num_experts is None
    # Kimi-K2.5's tower embeds each patch with a 2-D convolution: (patches, channels, patch, patch)
    model, inputs, expected = building.build("kimi_k25_vision", "Kimi_K25VisionModel")
    patch = model.config.patch_size
    assert inputs["pixel_values"].shape[1:] == (3, patch, patch) and "grid_thw" in inputs and expected


def test_iss36g_widths_named_after_the_hidden_size_and_fractional_boxes():
    # BLT's byte encoder reads the global transformer's width (hidden_size_global); its towers' heads are 16 wide
    blt = building.tiny_config("blt")
    assert blt.encoder_config.hidden_size_global == blt.global_config.hidden_size == overrides.HIDDEN
    assert blt.patcher_config.head_dim == blt.patcher_config.hidden_size // blt.patcher_config.num_attention_heads
    # UDOP reads boxes as fractions of the page (LayoutLM's processor gives integers to 1000: kept for them)
    _, inputs, expected = building.build("udop", "UdopModel")
    assert inputs["bbox"].is_floating_point() and 0 <= inputs["bbox"].min() and inputs["bbox"].max() <= 1 and expected
    _, inputs, _ = building.build("layoutlmv3", "LayoutLMv3Model")
    assert not inputs["bbox"].is_floating_point()


def test_iss36g_vision_towers_widths_tied_to_their_layers():
    # Llama 4: the MLP after the pixel shuffle reads hidden / ratio² channels
    vision = building.tiny_config("llama4").vision_config
    assert vision.intermediate_size == int(vision.hidden_size / vision.pixel_shuffle_ratio**2)
    # Mllama: intermediate layers within the tiny tower, handed on beside the last state
    vision = building.tiny_config("mllama").vision_config
    assert all(-vision.num_hidden_layers - 1 <= i <= vision.num_hidden_layers for i in vision.intermediate_layers_indices)
    assert vision.vision_output_dim == (1 + len(vision.intermediate_layers_indices)) * vision.hidden_size
    _, inputs, expected = building.build("llama4", "Llama4VisionModel")
    assert inputs["pixel_values"].shape[0] == overrides.BATCH and expected


def test_iss36g_a_text_tower_gets_text_whatever_its_composite_reads():
    model, inputs, expected = building.build("sam3_lite_text_text_model", "Sam3LiteTextTextModel")
    assert model.main_input_name == "pixel_values" and set(inputs) == {"input_ids", "attention_mask"} and expected


def test_a_head_asks_the_model_it_wraps_for_its_image_features():
    # Janus's generation head has no get_image_features of its own: its model counts the image tokens
    model, inputs, expected = building.build("janus", "JanusForConditionalGeneration")
    assert inputs["pixel_values"].dim() == 4
    token = media_inputs._image_token(model.config)
    count = media_inputs._count(model.model.get_image_features(pixel_values=inputs["pixel_values"]))
    assert int((inputs["input_ids"] == token).sum()) == count > 0


def test_a_vision_towers_output_width_is_the_text_models_width():
    # Qwen3-VL's default config projects to 3584 wide features for a 4096 wide text model (every
    # checkpoint ties them): shrunk with the hidden sizes, the images it is fed reach the text model
    config = building.tiny_config("qwen3_vl")
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size == overrides.HIDDEN
    model, inputs, expected = building.build("qwen3_vl", "Qwen3VLModel")
    assert {"pixel_values", "image_grid_thw"} <= set(inputs)
    assert int((inputs["input_ids"] == media_inputs._image_token(model.config)).sum()) == inputs["pixel_values"].shape[0] // 4


def test_towers_a_default_config_leaves_out_are_built_and_fed_positioned_patches():
    # Gemma 4's default config has no vision or audio tower (None); its checkpoints have both
    config = building.tiny_config("gemma4")
    assert config.vision_config is not None and config.audio_config is not None
    assert config.vision_config.hidden_size == overrides.HIDDEN
    model, inputs, expected = building.build("gemma4", "Gemma4Model")
    pixels, positions = inputs["pixel_values"], inputs["image_position_ids"]
    assert positions.shape == (*pixels.shape[:2], 2) and int(positions.max()) + 1 == int(pixels.shape[1] ** 0.5)
    count = media_inputs._count(model.get_image_features(pixel_values=pixels, image_position_ids=positions))
    assert int((inputs["input_ids"] == media_inputs._image_token(model.config)).sum()) == count > 0


def test_a_head_width_set_outside_the_constructor_follows_the_shrunk_widths():
    # Pixtral's head_dim is set from its widths after construction: kept from the default (64), the
    # rotary embedding did not fit the 16-wide heads of the shrunk tower under Mistral 3
    vision = building.tiny_config("mistral3").vision_config
    assert vision.head_dim == vision.hidden_size // vision.num_attention_heads
    model, inputs, expected = building.build("mistral3", "Mistral3Model")
    # each image's size beside the batch (Pixtral's processor)
    assert inputs["image_sizes"].tolist() == [list(inputs["pixel_values"].shape[-2:])] * overrides.BATCH


@pytest.mark.parametrize(("model_type", "class_name", "layout"), [
    ("lfm2_vl", "Lfm2VlModel", "spatial_shapes"),  # a NaFlex tower's patches with their grid and mask
    ("minicpmv4_6", "MiniCPMV4_6Model", "target_sizes"),  # a NaViT tower's packed patches
])
def test_a_vlm_gets_the_patches_its_towers_image_features_require(model_type, class_name, layout):
    model, inputs, expected = building.build(model_type, class_name)
    assert layout in inputs and "pixel_values" in inputs
    pixels = {k: v for k, v in inputs.items() if k in media_inputs._image_feature_parameters(model)}
    count = media_inputs._count(model.get_image_features(**pixels))
    assert int((inputs["input_ids"] == media_inputs._image_token(model.config)).sum()) == count > 0


def test_tiled_images_come_one_tile_each():
    # ModernVBert's processor gives (batch, tiles, channels, height, width); 4-D pixels do not run
    model, inputs, expected = building.build("modernvbert", "ModernVBertForMaskedLM")
    assert inputs["pixel_values"].dim() == 5 and inputs["pixel_values"].shape[:2] == (overrides.BATCH, 1)
    assert int((inputs["input_ids"] == media_inputs._image_token(model.config)).sum()) > 0


def test_perception_lm_gets_the_pe_tower_its_checkpoints_name():
    config = building.tiny_config("perception_lm")
    assert config.vision_config.model_args["embed_dim"] == overrides.HIDDEN
    try:
        import timm  # noqa: F401
    except Exception:
        pytest.skip("timm does not import here (it needs torchvision)")
    model, inputs, expected = building.build("perception_lm", "PerceptionLMModel")
    assert inputs["pixel_values"].shape == (overrides.BATCH, 1, 3, 32, 32)
    assert expected[1].shape == (overrides.BATCH, 4, overrides.HIDDEN)  # a 2 x 2 grid of image features per image


# ---- audio, codecs, speech and policies ----


def test_codec_decoders_read_latents_of_their_width():
    import torch

    # Mimi's decoder (main input `latents`) and VibeVoice's (`hidden_states`): (batch, latent width, frames)
    model, inputs, expected = building.build("mimi_decoder", "MimiDecoderModel")
    assert set(inputs) == {"latents"} and inputs["latents"].shape == (overrides.BATCH, model.config.hidden_size, overrides.SEQUENCE)
    assert expected[0].shape[:2] == (overrides.BATCH, model.config.audio_channels)
    model, inputs, _ = building.build("vibevoice_acoustic_tokenizer_decoder", "VibeVoiceAcousticTokenizerDecoderModel")
    assert inputs["hidden_states"].shape[1] == model.config.hidden_size != model.config.channels
    _, inputs, _ = building.build("mimi", "MimiModel")  # the codec itself still reads audio
    assert inputs["input_values"].shape[:2] == (overrides.BATCH, 1)
    # VibeVoice's tokenizer draws its latents (torch.randn) unless told not to: no file reproduces the draw
    model, inputs, expected = building.build("vibevoice_acoustic_tokenizer", "VibeVoiceAcousticTokenizerModel")
    assert inputs["sample"] is False
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(reference_outputs.output_tensors(model(**inputs)), expected))


def test_spectrograms_and_features_as_their_extractors_give_them():
    from onnx_modular import export_modular

    # AST: (batch, max_length frames, bins), what its position embeddings are sized for
    model, inputs, _ = building.build("audio-spectrogram-transformer", "ASTModel")
    assert inputs["input_values"].shape == (overrides.BATCH, model.config.max_length, model.config.num_mel_bins)
    result = export_modular(model, (), kwargs=inputs)
    assert result.report.ok, str(result.report)
    # Gemma 4's audio tower has no bin count: its family's feature extractor's (128)
    model, inputs, _ = building.build("gemma4_audio", "Gemma4AudioModel")
    assert media_inputs.extractor_features(model.config) == 128 and inputs["input_features"].shape[-1] == 128
    # Nemotron's audio model: the bins of its speech tower, a sub-config under another name
    model, inputs, _ = building.build("nemotron3_5_transcribe_audio", "Nemotron3_5TranscribeAudioModel")
    assert inputs["input_features"].shape[-1] == model.config.asr_config.num_mel_bins
    # Granite Speech 5: mel and deltas of two frames stacked, as wide as its first projection reads
    model, inputs, _ = building.build("granite_speech5_encoder", "GraniteSpeech5Encoder")
    assert inputs["input_features"].shape[-1] == model.input_linear.in_features == 4 * model.config.num_mel_bins
    # Muse Spark: whole tokens of samples
    model, inputs, _ = building.build("muse_spark_audio", "MuseSparkAudioModel")
    assert inputs["input_values"].shape[-1] % model.config.samples_per_token == 0


def test_an_action_policy_gets_camera_images_state_noise_and_time():
    model, inputs, _ = building.build("pi0", "PI0ForConditionalGeneration")
    config = model.config
    assert inputs["state"].shape == (overrides.BATCH, config.max_state_dim)
    assert inputs["noise"].shape == (overrides.BATCH, config.chunk_size, config.max_action_dim)
    assert inputs["pixel_values"].shape[:2] == inputs["pixel_attention_mask"].shape == (overrides.BATCH, 1)
    image_token = media_inputs._image_token(config.vlm_config)
    assert int((inputs["input_ids"] == image_token).sum()) > 0  # the image's tokens in the prompt
    assert 0 < float(inputs["timestep"].min()) < 1
    # the backbone takes them embedded: one state token and the chunk's, the action expert's width
    model, inputs, _ = building.build("pi0", "PI0Model")
    assert inputs["action_embeds"].shape == (overrides.BATCH, 1 + config.chunk_size, config.dit_config.hidden_size)


def test_a_trajectory_model_gets_states_actions_returns_and_steps():
    model, inputs, expected = building.build("decision_transformer", "DecisionTransformerModel")
    config = model.config
    assert inputs["states"].shape == (overrides.BATCH, overrides.SEQUENCE, config.state_dim)
    assert inputs["actions"].shape == (overrides.BATCH, overrides.SEQUENCE, config.act_dim)
    assert inputs["returns_to_go"].shape == inputs["rewards"].shape == (overrides.BATCH, overrides.SEQUENCE, 1)
    assert inputs["timesteps"].dtype.is_floating_point is False and int(inputs["timesteps"].max()) < config.max_ep_len
    assert expected


def test_audio_added_frame_by_frame_and_audio_beside_text():
    # Voxtral Realtime has no audio token: one text token per audio frame it makes
    model, inputs, _ = building.build("voxtral_realtime", "VoxtralRealtimeForConditionalGeneration")
    with __import__("torch").no_grad():
        frames = model.get_audio_features(input_features=inputs["input_features"]).pooler_output.shape[1]
    assert inputs["input_ids"].shape == (overrides.BATCH, frames)
    # CLAP, a dual encoder: its Swin tower reads the log-mel as an image, no resizing; the tower ends at hidden_size
    model, inputs, _ = building.build("clap", "ClapModel")
    audio = model.config.audio_config
    assert inputs["input_features"].shape == (overrides.BATCH, 1, audio.spec_size * (audio.spec_size // audio.num_mel_bins), audio.num_mel_bins)
    assert audio.patch_embeds_hidden_size * 2 ** (len(audio.depths) - 1) == audio.hidden_size
    assert inputs["input_ids"].shape == (overrides.BATCH, overrides.SEQUENCE)
    # CLVP: a voice's log-mel of the bins its conditioning encoder reads
    model, inputs, _ = building.build("clvp", "ClvpModelForConditionalGeneration")
    assert inputs["input_features"].shape[1] == model.config.decoder_config.feature_size


def test_speech_decoders_and_code_streams():
    # SpeechT5's text-to-speech head: mel frames for its speech pre-net and a speaker embedding
    model, inputs, _ = building.build("speecht5", "SpeechT5ForTextToSpeech")
    assert inputs["decoder_input_values"].shape[-1] == model.config.num_mel_bins
    assert inputs["speaker_embeddings"].shape == (overrides.BATCH, model.config.speaker_embedding_dim)
    assert model.config.speech_decoder_prenet_dropout == 0.0  # it drops out in eval mode too
    # the bare model has no pre-nets: hidden states on both sides
    model, inputs, _ = building.build("speecht5", "SpeechT5Model")
    assert inputs["input_values"].shape[-1] == inputs["decoder_input_values"].shape[-1] == model.config.hidden_size
    # Dia: (batch, length, channels) of codes; MusicGen keeps a row per codebook
    model, inputs, _ = building.build("dia", "DiaModel")
    assert inputs["decoder_input_ids"].shape == (overrides.BATCH, 4, model.config.decoder_config.num_channels)
    _, inputs, _ = building.build("musicgen", "MusicgenForConditionalGeneration")
    assert inputs["decoder_input_ids"].dim() == 2
    # Kyutai: a text token and one code per codebook at each step
    model, inputs, _ = building.build("kyutai_speech_to_text", "KyutaiSpeechToTextModel")
    config = model.config
    assert inputs["input_ids"].shape == (overrides.BATCH, overrides.SEQUENCE, 1 + config.num_codebooks)
    assert int(inputs["input_ids"][..., 1:].max()) < config.codebook_vocab_size


def test_derived_and_joined_widths_of_sub_configs():
    # Parakeet's encoder under Canary derives its key heads from the heads: they follow the shrunk ones
    encoder = building.tiny_config("canary").encoder_config
    assert encoder.num_key_value_heads == encoder.num_attention_heads == 2
    model, _, _, tier = building.build_with_tier("canary", "CanaryForConditionalGeneration")
    assert tier == "tiny"
    # XCodec derives its codebook from its acoustic and semantic widths; XCodec2 is given their sum
    xcodec = building.tiny_config("xcodec")
    assert xcodec.codebook_dim == xcodec.acoustic_model_config.hidden_size + xcodec.semantic_model_config.hidden_size
    xcodec2 = building.tiny_config("xcodec2")
    assert xcodec2.quantization_dim == xcodec2.hidden_size + xcodec2.semantic_model_config.hidden_size == 2 * overrides.HIDDEN
    assert building.build("xcodec2", "Xcodec2Model")[2]
    # FastSpeech 2 beside its vocoder: token ids within its model's vocabulary
    model, inputs, _ = building.build("fastspeech2_conformer_with_hifigan", "FastSpeech2ConformerWithHifiGan")
    assert int(inputs["input_ids"].max()) < model.config.model_config.vocab_size


def test_nested_overrides_merge_at_every_depth():
    config = building.tiny_config("nemotron3_5_transcribe_audio")
    assert config.asr_config.num_key_value_heads == 2 and config.asr_config.hidden_size == overrides.HIDDEN
    audio = config.diarization_config.audio_config
    assert audio.num_key_value_heads == 2 and audio.hidden_size == overrides.HIDDEN  # merged, still shrunk
    assert building.tiny_config("neucodec").num_key_value_heads == 2  # its attention repeats no key heads
    clvp = building.tiny_config("clvp")
    assert clvp.speech_config.vocab_size == clvp.decoder_config.vocab_size and clvp.speech_config.hidden_size == overrides.HIDDEN


def test_matrices_left_constant_by_the_init_are_drawn():
    """AFMoE's router gate starts at zero: every expert scores 0.5 and top-k is a tie, which torch
    and onnxruntime break differently (0.52 off at the last hidden state). Drawn, the row exports
    with parity; norm weights and biases (vectors) keep their values."""
    import torch

    from onnx_modular import export_modular

    model, inputs, _ = building.build("afmoe", "AfmoeModel")
    gate = model.layers[1].mlp.router.gate.weight
    assert float(gate.std()) > 0.01 and float(gate.abs().max()) < 0.2
    assert all(bool((norm.weight == 1).all()) for norm in model.modules() if type(norm).__name__ == "AfmoeRMSNorm")
    assert building._draw_constant_matrices(model) == []  # nothing constant is left
    with torch.no_grad():
        gate.zero_()
    assert building._draw_constant_matrices(model) == ["layers.1.mlp.router.gate.weight"]
    result = export_modular(model, (), kwargs=inputs)  # parity asserted inside
    assert result.report.ok and result.report.max_abs < 1e-4


def test_layout_inputs_are_fixed_and_rope_positions_fed():
    # A Qwen-VL row is fed its image grid and the 3-D rope positions its processor-side deployment
    # computes; the modular job fixes the grid into the program (export_modular(fixed_inputs=...))
    import torch

    model, inputs, expected = building.build("qwen2_vl", "Qwen2VLModel")
    assert building.layout_inputs(inputs) == ["image_grid_thw"]
    positions = inputs["position_ids"]
    assert positions.shape == (3, *inputs["input_ids"].shape)
    # where the images sit, the three rows (time, height, width) differ: not a plain arange
    assert not torch.equal(positions[1], positions[2])
    unfed = {k: v for k, v in inputs.items() if k != "position_ids"}
    with torch.no_grad():
        assert torch.equal(model(**unfed).last_hidden_state, expected[0])
    # the row exports with parity, the grid a constant of the program (in both exporters a data-dependent
    # guard while it is an input: the tower splits its patches by the grid's values)
    from onnx_modular import export_modular

    result = export_modular(model, (), kwargs=inputs, fixed_inputs=building.layout_inputs(inputs))
    assert result.report.ok, result.report
    names = [value.name for value in result.model.graph.inputs]
    assert "image_grid_thw" not in names and "position_ids" in names and "pixel_values" in names
    classes = {f.name for f in result.functions}
    assert {"Qwen2VisionTransformerPretrainedModel", "PatchMerger", "Qwen2VLTextModel"} <= classes, classes
    # a text-only model has no layout inputs and no rope index: fed as before
    _, text, _ = building.build("llama", "LlamaModel")
    assert building.layout_inputs(text) == [] and "position_ids" not in text
