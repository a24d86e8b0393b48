"""What the catalogue sweep builds every architecture at: the test suite's sample of
architectures (:data:`SAMPLE`), the batch, sequence length and hidden width of the tiny models,
and the per-architecture constructor arguments the shrinking rules cannot guess (:data:`OVERRIDES`)."""

from __future__ import annotations

from typing import Any

#: Architectures of the default test suite's sample (tests/test_sweep.py): decoder, encoder,
#: encoder-decoder, vision, audio, multimodal, state-space, mixture of experts.
SAMPLE = (
    "llama", "gpt2", "qwen2", "bert", "deberta-v2", "roberta", "t5", "bart", "vit", "swin",
    "convnext", "resnet", "whisper", "wav2vec2", "clip", "mamba", "mamba2", "mixtral", "qwen2_moe", "falcon",
)

BATCH, SEQUENCE = 2, 8
HIDDEN = 32

_QWEN4_INDEXER = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 4, "indexer_compress_ratio": 2}

#: PP-OCR's text detectors' intra-class blocks (each a convolution's kernel, stride and padding), the
#: upsampling of their four maps and the head's kernels: None in the config classes, set by every released
#: checkpoint (PaddleOCR's IntraCLBlock: 7/5/3 vertical, horizontal and square kernels)
_PP_OCR_DETECTOR = {
    "intraclass_block_config": {
        "reduce_channel": [1, 1, 0],
        "return_channel": [1, 1, 0],
        "vertical_long_to_small_conv_longratio": [[7, 1], [1, 1], [3, 0]],
        "vertical_long_to_small_conv_midratio": [[5, 1], [1, 1], [2, 0]],
        "vertical_long_to_small_conv_shortratio": [[3, 1], [1, 1], [1, 0]],
        "horizontal_small_to_long_conv_longratio": [[1, 7], [1, 1], [0, 3]],
        "horizontal_small_to_long_conv_midratio": [[1, 5], [1, 1], [0, 2]],
        "horizontal_small_to_long_conv_shortratio": [[1, 3], [1, 1], [0, 1]],
        "symmetric_conv_long_longratio": [[7, 7], [1, 1], [3, 3]],
        "symmetric_conv_long_midratio": [[5, 5], [1, 1], [2, 2]],
        "symmetric_conv_long_shortratio": [[3, 3], [1, 1], [1, 1]],
    },
    "scale_factor_list": [1, 2, 4, 8],
    "kernel_list": [3, 2, 2],
}

#: PP-OCRv6 medium's text detector reads all four stages of a PP-LCNetV4 backbone halving both sides at
#: each (the config class's default backbone is the text recognizer's, halving the height only, and hands on
#: its last stage only): the released checkpoint's
_PP_OCRV6_DETECTOR_BACKBONE = {
    "stem_channels": [3, 64, 128],
    "stem_type": "large",
    "block_configs": [
        [[3, 128, 128, 1, True], [3, 128, 128, 1, False]],
        [[3, 128, 256, 2, False], [3, 256, 256, 1, True], [3, 256, 256, 1, False]],
        [[3, 256, 512, 2, False], [3, 512, 512, 1, True], [3, 512, 512, 1, False], [3, 512, 512, 1, True], [3, 512, 512, 1, False]],
        [[3, 512, 896, 2, False], [3, 896, 896, 1, True], [3, 896, 896, 1, False]],
    ],
    "stage_out_channels": [128, 256, 512, 896],  # derived from the blocks, but the shrunk dict carries the default's
    "depths": [2, 3, 5, 3],
    "out_features": ["stage1", "stage2", "stage3", "stage4"],
    "out_indices": [1, 2, 3, 4],
}

#: Per-architecture config overrides, applied after the generic shrinking rules (a dict for a
#: sub-config is merged into the shrunk one).
OVERRIDES: dict[str, dict[str, Any]] = {
    "pp_ocrv5_server_det": _PP_OCR_DETECTOR,
    # ViTMatte: the config class's defaults are tuples, which the model extends with a list ([hidden] + sizes),
    # where a checkpoint's config.json gives lists; its conv stream (three stride-2 convolutions) meets the
    # ViT's features upsampled once, at 1/8: patches of 16, as every checkpoint has
    "vitmatte": {
        "convstream_hidden_sizes": [48, 96, 192], "fusion_hidden_sizes": [256, 128, 64, 32], "backbone_config": {"patch_size": 16},
    },
    # UVDoc's head concatenates its six bridge stages (6 x 128 channels); the default backbone config hands on
    # the last only, the released checkpoint all six
    "uvdoc": {"backbone_config": {"out_features": [f"stage{i}" for i in range(1, 7)], "out_indices": list(range(1, 7))}},
    # LW-DETR's feature levels (none by default: the decoder has nothing to read): its tiny to medium
    # checkpoints project the backbone's features at one scale, 1.0
    "lw_detr": {"projector_scale_factors": [1.0]},
    # BEiT's segmentation head reads four layers, which its segmentation checkpoints list (out_indices
    # [3, 5, 7, 11]); the default config hands on the last only: four layers, each handed on
    "beit": {
        "num_hidden_layers": 4, "out_indices": [1, 2, 3, 4], "out_features": ["stage1", "stage2", "stage3", "stage4"],
        "stage_names": ["stem", "stage1", "stage2", "stage3", "stage4"],
    },
    "pp_ocrv6_medium_det": {**_PP_OCR_DETECTOR, "backbone_config": _PP_OCRV6_DETECTOR_BACKBONE},
    # SAM 2: the backbone's stage widths, the neck's channels (the stages' widths, last first) and feature
    # maps (the image over strides 4, 8 and 16) and the prompt encoder's embedding grid (the image over
    # its patch of 16) are tied by every checkpoint: all follow a 64-pixel image and narrow stages
    "sam2": {
        "vision_config": {
            "backbone_config": {
                "image_size": [64, 64], "hidden_size": HIDDEN, "embed_dim_per_stage": [HIDDEN, 2 * HIDDEN, 4 * HIDDEN, 8 * HIDDEN],
                "num_attention_heads_per_stage": [1, 1, 2, 2], "blocks_per_stage": [1, 1, 2, 1], "global_attention_blocks": [3],
                "window_size_per_stage": [8, 4, 4, 2],
            },
            "backbone_channel_list": [8 * HIDDEN, 4 * HIDDEN, 2 * HIDDEN, HIDDEN],
            "backbone_feature_sizes": [[16, 16], [8, 8], [4, 4]],
        },
        "prompt_encoder_config": {"image_size": 64, "patch_size": 16},
    },
    # EdgeTAM: its config class names the timm model under a misspelt key ("archirecture"), so the
    # default (ResNet-50, 4x wider) is built; released checkpoints name RepViT-M1, whose stages the
    # neck's channels list. Feature maps and the prompt grid follow the sweep's 32-pixel image.
    "edgetam": {
        "vision_config": {"backbone_config": {"architecture": "repvit_m1"}, "backbone_feature_sizes": [[8, 8], [4, 4], [2, 2]]},
        "prompt_encoder_config": {"image_size": 32, "patch_size": 16},
    },
    "edgetam_vision_model": {"backbone_config": {"architecture": "repvit_m1"}, "backbone_feature_sizes": [[8, 8], [4, 4], [2, 2]]},
    # PerceptionLM: the timm tower and its width (``model_args``, which the projector reads) are left to the
    # checkpoint; its checkpoints name PE core's ViT with these arguments, here narrow, shallow and sized for
    # the sweep's image (patches of 14 over 32 pixels: a 2 x 2 grid, as ``ref_feat_shape`` says)
    "perception_lm": {
        "vision_config": {
            "architecture": "vit_pe_core_large_patch14_336",
            "model_args": {
                "embed_dim": HIDDEN, "depth": 2, "num_heads": 2, "img_size": [32, 32], "ref_feat_shape": [2, 2],
                "global_pool": "", "use_post_transformer_norm": False, "init_values": 0.1,
            },
        },
    },
    # the timm model is left to the checkpoint (None): a released one, its four stages handed on (as DETR's)
    "timm_backbone": {"backbone": "resnet18", "out_indices": [1, 2, 3, 4]},
    "deberta-v2": {"relative_attention": True, "pos_att_type": ["p2c", "c2p"], "position_buckets": 8, "max_relative_positions": 16},
    "mamba2": {"num_heads": 4, "head_dim": 16, "n_groups": 1, "chunk_size": 16, "expand": 2},
    "whisper": {"max_source_positions": 32, "max_target_positions": 32},
    "swin": {"image_size": 224},  # windows of 7 over a 56 x 56 grid: smaller grids break its masks
    "esmc": {"num_key_value_heads": 2},  # no grouped-query attention
    # one (global, local) pair: 2 layers; 2 heads 16 wide (the default's 16 heads would be 2 wide, under
    # onnxruntime's GroupQueryAttention minimum of 8: the rules do not shrink its `num_heads`)
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "num_heads": 2},
    "xglm": {"attention_heads": 2},  # the same: 16 heads 2 wide by default (its key is not one the rules shrink)
    "diffllama": {"num_key_value_heads": 2},
    "esm": {"pad_token_id": 1},  # left to the checkpoint (None); positions count from the padding id  # differential attention splits the key heads in two
    # the default config leaves the layer kinds to the checkpoint (None), the model indexes them
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # no grouped-query attention, though the config has the key: v_proj has num_attention_heads
    # heads and k_proj num_key_value_heads (equal by default); with fewer key heads the eager CPU
    # attention still runs but torch.export's shape checks refuse the keys ("broadcast a
    # dimension of length 4"). Nothing in the config says so: per model type.
    "nemotron3_diarization_audio": {"num_key_value_heads": 2},
    "nemotron3_5_transcribe_asr_audio": {"num_key_value_heads": 2},
    "nemotron3_diarization": {"audio_config": {"num_key_value_heads": 2}},  # merged into the shrunk audio tower
    "granite_speech5_encoder": {"num_key_value_heads": 2},  # the same: its attention repeats no key heads
    "neucodec": {"num_key_value_heads": 2},  # the same (its decoder's attention)
    "granite_speech5_ctc": {"encoder_config": {"num_key_value_heads": 2}},
    "nemotron3_5_transcribe_audio": {  # both of its towers, merged into the shrunk ones
        "asr_config": {"num_key_value_heads": 2}, "diarization_config": {"audio_config": {"num_key_value_heads": 2}},
    },
    # the indexed-attention layers' token indexer is left unset (None) by the default config, which lists
    # such layers all the same: 2 query heads and 1 key head 16 wide, 4 tokens chosen in blocks of 2
    "qwen4_exp_text": _QWEN4_INDEXER,
    "qwen4_exp": {"text_config": _QWEN4_INDEXER},
    # the thinker's multimodal positions read a vision start token its config class does not declare (the
    # released checkpoints carry it in thinker_config): the talker's default
    "qwen2_5_omni_thinker": {"vision_start_token_id": 151652},
    "qwen3_omni_moe_thinker": {"vision_start_token_id": 151652},
    # the audio adaptor's width is tied to a quarter of the text model's by its validator
    "fun_asr_nano": {"adaptor_config": {"intermediate_size": HIDDEN // 4}},
    # attributes the modeling code reads that the config class does not declare (the released checkpoints
    # carry them): DBRX's rotary base and query-key-value clip (it clamps to None otherwise), Moonshine
    # Streaming's key heads (no grouped-query attention: as many as query heads), T5Gemma 2's dropout
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    "moonshine_streaming": {"num_key_value_heads": 2},
    "t5gemma2_encoder": {"text_config": {"dropout_rate": 0.0}},
    # multimodal rotary sections the config leaves to the checkpoint; the modeling code falls back to sections
    # for a full-size head: PaddleOCR-VL's [16, 24, 24] (128-wide heads; its config does not exempt the key, so
    # the generic fallback does not see it) and ERNIE 4.5-VL's [22, 22, 20] (height and width rotate in pairs,
    # so their sections must stay equal): both fitted to half the tiny 16-wide head
    "paddleocr_vl": {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [2, 3, 3]}}},
    "ernie4_5_vl_moe": {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [3, 3, 2]}}},
    # CodeGen's attention splits its fused query-key-value projection in 4 (mp_num, hard-coded in the modeling
    # code for the TPU layout of its checkpoints): heads in multiples of 4
    "codegen": {"n_head": 4},
    # BLT's sub-configs derive head_dim from their default widths (not a constructor argument, so the rules
    # leave it); its attention splits the shrunk width by the heads while its rotary reads head_dim: the
    # head width of the tiny towers (32 wide, 2 heads). Derived head widths elsewhere (Pixtral's) are read
    # by both, and stay as they build today.
    "blt": {name: {"head_dim": HIDDEN // 2} for name in ("patcher_config", "encoder_config", "decoder_config", "global_config")},
    # the speech encoder reads the ids its speech decoder makes (the default configs give it 256 of the decoder's
    # 8194); both encoders' rotary embeddings span at least 32 of each head (a floor in the modeling code): one head
    # of the tiny width
    "clvp": {
        "speech_config": {"vocab_size": 8194, "num_attention_heads": 1}, "text_config": {"num_attention_heads": 1},
    },
    # its decoder pre-net drops out even in eval mode (as the paper does): none, so PyTorch and the files agree
    "speecht5": {"speech_decoder_prenet_dropout": 0.0},
    # the task heads' channels are left to each checkpoint (every list None): two upsampling blocks, one
    # refinement convolution, and the pointmap head's scale branch, 16 channels each
    "sapiens2": {"head_config": {
        "upsample_out_channels": [16, 16], "conv_out_channels": [16],
        "scale_conv_out_channels": [16], "scale_final_hidden_sizes": [16, 16],
    }},
}
