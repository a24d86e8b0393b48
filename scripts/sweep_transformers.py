#!/usr/bin/env python
"""Sweep every model type transformers ships: tiny config, random weights, valid inputs, then
``torch.onnx.export(dynamo=True)`` (flat) and ``export_modular``, each in a time- and
memory-bounded child process. Writes ``docs/coverage.md`` (totals first) and a JSON beside it.

    python scripts/sweep_transformers.py                       # every type: base models, then heads
    python scripts/sweep_transformers.py --sample              # the ~20 architectures of the test suite
    python scripts/sweep_transformers.py --types llama,bert --heads
    python scripts/sweep_transformers.py --compare old.json    # also list what regressed
    python scripts/sweep_transformers.py --resume              # keep rows already in the JSON
    python scripts/sweep_transformers.py --resume --redo failed --jobs 2   # sweep failed rows again, two at once

Each architecture gets a configuration shrunk from its default one by the rules of
:func:`tiny_config` (hidden sizes, layers, heads, experts, vocabulary, image and audio sizes),
with per-architecture :data:`OVERRIDES`; when the model does not run on its inputs at that size,
the depth alone is shrunk (``shallow``: default widths), then nothing (``default``), within
:data:`PARAMETER_BUDGET` (the row's ``config`` says which tier built it); random weights (seed 0) and inputs from
:func:`make_inputs` (token ids, pixels, videos, audio features, waveforms, a codec decoder's latents,
spectrograms, patches with their grid, past values, a policy's state and action noise, a trajectory's
states and returns, by the model's forward; features as wide as the model's feature extractor makes them; a vision- or audio-language model also gets images or audio as
its processor would give them, with as many image or audio tokens in its text as it makes
features; a model read from pixels that takes text gets its prompt; what a forward requires beside
its main input is given by the parameter's name and the config's keys). Each row
records the inputs fed and, where both exporters fail, a note naming the cause (:func:`classify`). The children
are forked from this process after it has paid what each would pay again (:func:`_warm_up`:
imports, the translation registry, transformers' model machinery, the exporters' first call); each has a time limit (``--timeout``) and an address-space limit (``--memory-gb``).
Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import json
import math
import multiprocessing
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT / "scripts") not in sys.path:  # the tools phase beside this script
    sys.path.insert(0, str(ROOT / "scripts"))

import sweep_tools  # noqa: E402

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
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # one (global, local) pair: 2 layers
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

_HIDDEN_KEYS = {
    "hidden_size", "d_model", "n_embd", "embed_dim", "hidden_dim", "d_embed", "dim", "word_embed_proj_dim",
    "projection_dim", "encoder_hidden_size", "decoder_hidden_size", "text_hidden_size", "out_hidden_size",
}
_LAYER_KEYS = {
    "num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
    "num_encoder_layers", "num_decoder_layers", "num_text_layers", "num_vision_layers",
}
_HEAD_KEYS = {"num_attention_heads", "n_head", "n_heads", "encoder_attention_heads", "decoder_attention_heads"}
_KV_HEAD_KEYS = {"num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "num_key_value_attention_heads"}
_FFN_KEYS = {
    "intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner", "d_ff", "ffn_hidden_size",
    "decoder_intermediate_size", "encoder_intermediate_size",
}
_SMALL_FFN_KEYS = {"moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"}
_EXPERT_KEYS = {"num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"}
_TOPK_KEYS = {"num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_k", "top_k_experts"}
#: expert groups (DeepSeek-style routing: experts // groups per group, topk_group of them chosen)
_GROUP_KEYS = {"n_group", "num_expert_group", "num_group"}
_TOPK_GROUP_KEYS = {"topk_group"}
#: widths tied to a hidden size by name: shrunk with it when they equal one of the tree's hidden sizes
_WIDTH_SUFFIXES = ("hidden_size", "_dim", "embedding_size", "projection_size", "_input_size")  # _input_size: an adapter's input (Dots 3's audio)
#: layer indices into a (vision) tower: kept within the tiny tower's layers
_DEPTH_LIST_KEYS = {"depths", "num_layers_per_stage", "layers_per_stage"}
_LAYER_INDEX_KEYS = {
    "vision_feature_layer", "vision_feature_layers", "feature_layer", "feature_layers", "select_layer", "intermediate_hook_ids",
    "intermediate_layers_indices",
}
_HEAD_DIM_KEYS = {"head_dim", "attention_head_dim", "kv_channels", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"}
_RANK_KEYS = {"kv_lora_rank", "q_lora_rank"}


#: ids given to a multimodal token a default config leaves unset (kept out of the random text)
_FREE_TOKEN_ID = {"audio_token_id": 5, "image_token_id": 6, "video_token_id": 7, "image_token_index": 6, "video_token_index": 7}


def _special_ids(values: dict[str, Any]) -> set[int]:
    found = set()
    for key, value in values.items():
        if key.endswith(("_token_id", "_token_index", "_id")) and isinstance(value, int):
            found.add(value)
        elif key.endswith("_token_id") and isinstance(value, list):
            found.update(v for v in value if isinstance(v, int))
    return found


def _widths(values: dict[str, Any]) -> set[int]:
    """The hidden sizes (over :data:`HIDDEN`) anywhere in a config's dict, sub-configs included."""
    found = set()
    for key, value in values.items():
        if isinstance(value, dict):
            found |= _widths(value)
        elif key in _HIDDEN_KEYS and isinstance(value, int) and not isinstance(value, bool) and value > HIDDEN:
            found.add(value)
    return found


def _tied_channels(values: dict[str, Any], sizes: list[int]) -> list[str]:
    """The channel keys (``stage_out_channels``, ``stem_out_channels``, ...) that repeat a stage
    width of ``sizes``: the stages are built from those (HGNetV2, TextNet) and ``hidden_sizes`` only
    describe them to a backbone's users and a classifier, so shrinking the list alone breaks both."""
    def numbers(value: Any) -> set[int]:
        if isinstance(value, (list, tuple)):
            return set().union(*(numbers(v) for v in value)) if value else set()
        return {value} if isinstance(value, int) and not isinstance(value, bool) else set()

    stages = set(sizes)
    return sorted(k for k, v in values.items() if k.endswith("_channels") and k != "num_channels" and numbers(v) & stages)


def _joined_widths(values: dict[str, Any]) -> set[int]:
    """Sums of two of a config's hidden size and its sub-configs' (each over :data:`HIDDEN`)."""
    sizes = [values.get("hidden_size")] + [v.get("hidden_size") for v in values.values() if isinstance(v, dict)]
    sizes = [w for w in sizes if isinstance(w, int) and not isinstance(w, bool) and w > HIDDEN]
    return {a + b for i, a in enumerate(sizes) for b in sizes[i + 1:]}


def _fit_sections(sections: list[int], total: int) -> list[int]:
    """``sections`` scaled to sum to ``total`` (largest remainders; each at least 1 when it can):
    rotary sections (``mrope_section``) of a shrunk head, embedding factors of a shrunk width."""
    whole = sum(sections)
    exact = [v * total / whole for v in sections]
    fitted = [max(1, int(x)) if total >= len(sections) else int(x) for x in exact]
    order = sorted(range(len(sections)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    index = 0
    while sum(fitted) != total and index < 4 * len(sections):
        i = order[index % len(order)]
        step = 1 if sum(fitted) < total else -1
        if fitted[i] + step >= (1 if total >= len(sections) else 0):
            fitted[i] += step
        index += 1
    return fitted


def _rotary_half(rope: dict[str, Any], head_dim: int) -> int:
    """Half the rotated part of a head: what multimodal rotary sections split (all of the head, or
    its ``partial_rotary_factor``)."""
    factor = rope.get("partial_rotary_factor")
    rotated = int(head_dim * factor) if isinstance(factor, (int, float)) and 0 < factor < 1 else head_dim
    return rotated // 2


def _rope_shrunk(value: Any, head_dim: int) -> Any:
    """A rope dict (or one per layer kind) with ``mrope_section`` refitted to half the head."""
    if not isinstance(value, dict):
        return value
    out = {k: _rope_shrunk(v, head_dim) if isinstance(v, dict) else v for k, v in value.items()}
    sections = value.get("mrope_section")
    if isinstance(sections, (list, tuple)) and sections and all(isinstance(v, int) for v in sections):
        if sum(sections) != head_dim // 2:
            out["mrope_section"] = _fit_sections(list(sections), head_dim // 2)
    return out


def _shrunk(
    config: Any, inherited_ids: frozenset[int] = frozenset(), widths: frozenset[int] | None = None, shallow: bool = False
) -> dict[str, Any]:
    """Constructor arguments that shrink ``config`` (the rules; sub-configs recursively, keeping
    the vocabulary above the token ids of the enclosing config, LLaVA's image token, and shrinking
    widths tied to any hidden size of the tree, a projector's ``out_hidden_size``). ``shallow``:
    depth only (layers, stages, experts, vocabulary; what follows the kept layers), every width
    and size as the default config has it."""
    values = config.to_dict()
    widths = frozenset(_widths(values)) if widths is None else widths
    special = _special_ids(values) | inherited_ids
    sub_configs = set(getattr(config, "sub_configs", {}) or {})
    layers = next((values[k] for k in _LAYER_KEYS if isinstance(values.get(k), int)), None)
    heads = next((values[k] for k in _HEAD_KEYS if isinstance(values.get(k), int)), None)
    kept = _kept_layers(values, layers)
    experts = any(isinstance(values.get(k), int) and not isinstance(values[k], bool) and values[k] > 1 for k in _EXPERT_KEYS)
    # experts whose routing (how many per token, in how many groups) is left to the checkpoint (DeepSeek-V2),
    # or their number too (dots.llm1)
    unrouted = any(k in values and values[k] is None for k in _TOPK_KEYS)
    uncounted = unrouted and any(k in values and values[k] is None for k in _EXPERT_KEYS)
    # ... unless the config turns its experts off (Gemma 4's enable_moe_block)
    uncounted = uncounted and not any(k.startswith(("enable_moe", "use_moe")) and v is False for k, v in values.items())
    unrouted = unrouted and (experts or uncounted)
    followed: set[str] = set()
    derived, joined = _unset_by_default(type(config)), _joined_widths(values)
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key in sub_configs or (isinstance(value, dict) and hasattr(getattr(config, key, None), "to_dict")):
            sub = getattr(config, key, None)
            if getattr(sub, "model_type", None) == "timm_backbone" and str(getattr(sub, "backbone", "")).startswith("resnet"):
                # transformers' own ResNet, same stages: the row stays small and the same on every torch
                # (timm needs torchvision, which does not import beside the CPU torch 2.13 here)
                from transformers import ResNetConfig

                sub = ResNetConfig(out_indices=list(getattr(sub, "out_indices", None) or [1, 2, 3, 4]))
            if sub is not None and hasattr(sub, "to_dict"):
                base = sub.to_dict()
                accepted = _init_parameters(type(sub))
                if accepted is not None and "qk_rope_head_dim" in base:
                    # a head width the config derives from its rotary part (DeepSeek-V3's head_dim): derived again
                    base = {k: v for k, v in base.items() if k in accepted or k not in _HEAD_DIM_KEYS}
                # a key-head count or a head width its constructor does not take is derived from the heads and
                # widths (Parakeet's encoder under Canary, Pixtral's head_dim under Mistral 3): left out, so it
                # follows the shrunk ones instead of keeping the default's
                derived_heads = _KV_HEAD_KEYS | _HEAD_DIM_KEYS
                base = {k: v for k, v in base.items() if accepted is None or k not in derived_heads or k in accepted}
                out[key] = {**base, **_shrunk(sub, frozenset(special), widths, shallow)}
            continue
        if isinstance(value, bool):
            continue
        if value is None:
            if key == "vocab_size":  # left to the checkpoint (ESM): any tiny vocabulary
                out[key] = max(512, max(special, default=0) + 1)
            elif key in _KV_HEAD_KEYS and heads:  # left unset, and a layer divides by it (Nemotron)
                out[key] = 1
            elif key in _FREE_TOKEN_ID:  # left to the checkpoint (Voxtral's audio, BLIP-2's image)
                out[key] = _FREE_TOKEN_ID[key]
            elif key == "default_language" and values.get("languages"):  # X-MOD's adapters need a language
                out[key] = values["languages"][0]
            elif key in _TOPK_KEYS and unrouted:  # 2 of the 4 experts
                out[key] = 2
            elif key in _EXPERT_KEYS and uncounted:
                out[key] = 4
            elif key == "n_shared_experts" and uncounted:
                out[key] = 1
            elif key in _SMALL_FFN_KEYS and uncounted:  # the experts' width, left unset with their number (DiffusionGemma)
                out[key] = HIDDEN
            elif key in _GROUP_KEYS | _TOPK_GROUP_KEYS and unrouted:  # 4 experts: one group holds them all
                out[key] = 1
            elif key in ("class_thresholds", "class_order") and isinstance(values.get("id2label"), dict):
                # a detector's per-label score thresholds and reading-order category, left to the checkpoint
                # (PP-DocLayout V2): 0.5 each, every label its own category
                labels = len(values["id2label"])
                out[key] = [0.5] * labels if key == "class_thresholds" else list(range(labels))
            elif key.startswith("decoder_") and key.endswith(("hidden_size", "_depth", "_num_heads")):
                # a masked-image pretraining decoder left to the checkpoint (Hiera): one layer, 2 heads, HIDDEN wide
                out[key] = HIDDEN if key.endswith("hidden_size") else 1 if key.endswith("_depth") else 2
            elif key == "prediction_length":  # a forecaster's horizon, left to the user (the context follows it)
                out[key] = 4
            continue
        if isinstance(value, int) and key.endswith("_dim") and value in joined:
            # the width of features joined from two models' (a codec's acoustic and semantic ones, quantized
            # together): derived again from the shrunk parts when the config derives it (XCodec), else their sum (XCodec2)
            if key not in derived:
                out[key] = 2 * HIDDEN
            continue
        if isinstance(value, int):
            if key in _HIDDEN_KEYS and value > HIDDEN:
                out[key] = HIDDEN
            elif key in _LAYER_KEYS and value == layers and kept is not None:
                out[key] = len(kept)
            elif key in _LAYER_KEYS and value > 2 or key in _HEAD_KEYS and value > 2:
                out[key] = 2
            elif key == "num_windows" and value > 4 and isinstance(values.get("image_size"), int) and values["image_size"] > 32:
                out[key] = 4  # windowed attention over the tiny image's 4 x 4 patches (LW-DETR's ViT): 2 x 2 windows
            elif key == "num_blocks" and kept is not None and layers and len(kept) <= value < layers:
                # the last layers that read queries (EoMT's 4 of 24): the last of the kept ones, one before it without
                out[key] = max(1, len(kept) - 1)
            elif key.startswith("decoder_") and key.endswith("num_attention_heads") and value > 2 and HIDDEN % value:
                out[key] = 2  # a decoder's heads (VideoMAE's: 6) that would not divide its shrunk width
            elif key in _KV_HEAD_KEYS and value > 1:
                # multi-head latent attention (DeepSeek's kv_lora_rank) repeats no key heads: kv == heads
                out[key] = 2 if value == heads and "kv_lora_rank" in values else 1
            elif key == "mamba_n_heads" and value > 2:
                out[key] = 2
                if isinstance(values.get("mamba_d_head"), int):  # heads x head dim = expand x hidden
                    out["mamba_d_head"] = (values.get("mamba_expand") or 2) * HIDDEN // 2
                    if isinstance(values.get("mamba_d_ssm"), int):  # or the width given for it (Falcon-H1)
                        out["mamba_d_ssm"] = 2 * out["mamba_d_head"]
            elif key in _FFN_KEYS and value > 2 * HIDDEN:
                out[key] = 2 * HIDDEN
            elif key in _SMALL_FFN_KEYS and value > HIDDEN:
                out[key] = HIDDEN
            elif key in _EXPERT_KEYS and value > 4:
                out[key] = 4
            elif key in _TOPK_KEYS and value > 2:
                out[key] = 2
            elif key in _GROUP_KEYS and value > 1:  # 4 experts: one group holds them all
                out[key] = 1
            elif key in _TOPK_GROUP_KEYS and value > 1:
                out[key] = 1
            elif key == "rotary_dim" and value > 8:  # partial rotary within a 16-wide head (GPT-J)
                out[key] = 8
            elif key == "num_queries" and value > 16:  # a detector's top-k over the few tokens of a tiny image
                out[key] = 16
            elif key in _HEAD_DIM_KEYS and value > 16:
                out[key] = 16
            elif key in _RANK_KEYS and value > HIDDEN:
                out[key] = HIDDEN
            elif key == "image_size" and value > 32:
                out[key] = 32
            elif key == "patch_size" and value > 8:
                out[key] = 8
            elif key == "num_kv_shared_layers" and kept is not None and value > 0:
                # the last layers reuse an earlier layer's cache of their kind: one layer of each kind kept makes it
                kinds = values.get("layer_types")
                producing = len({kinds[i] for i in kept}) if isinstance(kinds, (list, tuple)) and len(kinds) == layers else 1
                out[key] = max(0, len(kept) - producing)
            elif key == "vocab_size" and value > 512:
                out[key] = max(512, max(special, default=0) + 1)
            elif key in ("num_conv_pos_embeddings",) and value > 16:
                out[key] = 16
            elif key == "num_heads" and value > 2 and "spatial_merge_size" in values:  # a Qwen-VL vision tower's rotary needs 16-wide heads
                out[key] = 2
            elif key == "mm_tokens_per_image" and value > 4:  # pooled from the 4 x 4 patches of a 32-pixel image
                out[key] = 4
            elif key == "num_groups" and value > 2 and "hidden_sizes" in values:  # group norms over 8-channel stages (BiT)
                out[key] = 2
            elif key in ("num_conv_pos_embedding_groups",) and value > 2:
                out[key] = 2
            elif key == "max_source_positions" and value > 64:
                out[key] = 64
            elif key == "embedding_size" and value > HIDDEN // 2 and value < (values.get("hidden_size") or 0):
                # a factorized embedding narrower than the hidden size stays narrower (MobileBERT's head
                # projects to the difference of the two)
                out[key] = HIDDEN // 2
            elif key == "num_cross_attention_heads" and value > 1 and values.get("cross_attention_shape_for_attention") == "kv":
                # heads over the inputs' channels, which a preprocessor fixes (Perceiver's pixels plus Fourier
                # features: 261 or 322), not the config: one head divides any width
                out[key] = 1
            elif key.endswith("_groups") and value in widths:  # a depthwise convolution over a hidden width (Mimi's upsampling)
                out[key] = HIDDEN
            elif (key.endswith(_WIDTH_SUFFIXES) or key == "hidden_size_global") and value in widths and not key.endswith("head_dim") and key not in _HEAD_DIM_KEYS:
                # (hidden_size_global: BLT's byte encoder reads the global transformer's width)
                out[key] = HIDDEN  # tied to a hidden size by the architecture (a projector's output, a condition)
            elif key in _LAYER_INDEX_KEYS:
                out[key] = _layer_index(value)
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            if key in ("hidden_sizes", "dims", "embed_dims", "neck_hidden_sizes") and not _tied_channels(values, value):
                out[key] = [min(v, 8 * 2**i) for i, v in enumerate(value)]
            elif key in _DEPTH_LIST_KEYS:
                out[key] = [1] * len(value)
            elif key in ("num_heads", "attention_heads", "num_attention_heads"):
                out[key] = [min(v, 2) for v in value]
            elif key == "conv_dim":
                out[key] = [HIDDEN] * len(value)
            elif key in _LAYER_INDEX_KEYS:
                out[key] = _layer_index(value)
            elif key.endswith("_channels") and all(v in widths for v in value):  # a detector's decoder reads the encoder's width
                out[key] = [HIDDEN] * len(value)
            elif "key_value_heads" in key and heads:  # per layer: all heads stay all (2), grouped ones become 1
                out[key] = [2 if v == heads else 1 for v in value]
            elif sum(value) in widths and key.endswith("_dim"):  # factors of a width (Reformer's axial embeddings)
                out[key] = _fit_sections(list(value), HIDDEN)
        if kept is not None and isinstance(value, (list, tuple)) and len(value) == layers and key not in out:
            out[key] = [value[i] for i in kept]  # per-layer lists (layer_types, ...) follow the kept layers
            followed.add(key)
        elif kept is not None and key.startswith("per_layer") and isinstance(value, dict):
            out[key] = {  # keyed by layer index: the kept layers', renumbered, shrunk as the whole config is
                kept.index(int(k)): _layer_shrunk(v, values) for k, v in value.items() if str(k).isdigit() and int(k) in kept
            }
    patch = values.get("patch_size")
    for key, sub in list(out.items()):
        default = values.get(key)
        if not shallow and isinstance(patch, int) and isinstance(sub, dict) and isinstance(default, dict) and default.get("image_size") == patch:
            # a patch that is an encoder's whole image (DepthPro tiles its image for its DINOv2 encoders)
            if isinstance(sub.get("image_size"), int):
                out["patch_size"] = sub["image_size"]
    layers_out = out.get("intermediate_layers_indices")
    if isinstance(layers_out, list) and isinstance(values.get("vision_output_dim"), int):
        # Mllama's tower hands on its last state and these layers' side by side: (1 + their count) x hidden
        out["vision_output_dim"] = (1 + len(layers_out)) * (out.get("hidden_size") or values["hidden_size"])
    ratio = values.get("pixel_shuffle_ratio")
    if isinstance(ratio, float) and 0 < ratio < 1 and isinstance(values.get("intermediate_size"), int) and "vision_output_dim" in values:
        # Llama 4's tower: the MLP after its pixel shuffle reads hidden / ratio² channels, its intermediate_size
        # (1408 x 4 = 5632 in the released checkpoints; the default config's 768-wide tower does not run)
        out["intermediate_size"] = int((out.get("hidden_size") or values["hidden_size"]) / ratio**2)
    pinpoints = values.get("image_grid_pinpoints")
    vision = values.get("vision_config") if isinstance(values.get("vision_config"), dict) else {}
    if isinstance(pinpoints, list) and isinstance(vision.get("image_size"), int) and vision["image_size"] > 32:
        # LLaVA-NeXT's tilings are multiples of the tower's image size: the tiny tower's
        scale = vision["image_size"]
        out["image_grid_pinpoints"] = [[v * 32 // scale for v in pair] for pair in pinpoints]
    if followed:  # one entry per layer: a rule's list (depths, hidden_sizes) follows the kept layers as the others do
        for key, value in list(out.items()):
            if key not in followed and isinstance(value, list) and len(value) == layers and isinstance(values.get(key), (list, tuple)):
                out[key] = [value[i] for i in kept]
    embed, depths, width = values.get("patch_embeds_hidden_size"), values.get("depths"), values.get("hidden_size")
    if isinstance(embed, int) and isinstance(depths, (list, tuple)) and isinstance(width, int) and embed << (len(depths) - 1) == width:
        # a Swin tower doubling its patch embeddings' width at each stage ends at hidden_size (CLAP's audio): shrunk with it
        out["patch_embeds_hidden_size"] = max(1, out.get("hidden_size", width) >> (len(depths) - 1))
    if values.get("head_dim", 0) is None and heads and "head_dim" not in out:
        out["head_dim"] = HIDDEN // min(heads, 2)  # None: some models compute hidden // heads, others fail
    for key in ("rope_parameters", "rope_scaling"):  # multimodal rotary sections split half the head
        if isinstance(values.get(key), dict):
            head_dim = out.get("head_dim") or values.get("head_dim")
            if not isinstance(head_dim, int) or head_dim > 16:
                head_dim = (out.get("hidden_size") or values.get("hidden_size") or HIDDEN) // max(1, min(heads or 2, 2))
            rope = _rope_shrunk(values[key], head_dim)
            # multimodal rotary (Qwen2-VL): the model falls back to sections for a full-size head when the
            # config has none; its config class says so by exempting them from rope validation
            exempt = getattr(type(config), "ignore_keys_at_rope_validation", None) or ()
            kinds = out.get("layer_types") or values.get("layer_types")
            if not rope and isinstance(kinds, (list, tuple)) and kinds and all(isinstance(k, str) for k in kinds):
                # rotary per layer kind, left empty to the checkpoint (Cohere Compass indexes it by kind)
                rope = {kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in dict.fromkeys(kinds)}
            for part in [rope, *(v for v in rope.values() if isinstance(v, dict))]:
                if "mrope_section" in exempt and "rope_type" in part and "mrope_section" not in part:
                    # of the rotated part only: a partial rotary (GLM-4.5V's half head) splits what it rotates
                    part["mrope_section"] = _fit_sections([16, 24, 24], _rotary_half(part, head_dim))
            if rope != values[key]:
                out[key] = rope
    vocab = [out.get("vocab_size")] + [v.get("vocab_size") for v in out.values() if isinstance(v, dict)]  # its text model's
    vocab = next((v for v in vocab if isinstance(v, int)), None)
    if "vocabulary_map" in values and values["vocabulary_map"] is None and vocab:
        # the tokenizer's map, left to the checkpoint (Chameleon, Emu3 read their image token from it): the
        # image placeholder as the last id, out of the random text's range
        out["vocabulary_map"] = {"<image>": vocab - 1}
    kinds = out.get("layer_types") or values.get("layer_types")
    if "sliding_window" in values and values["sliding_window"] is None:
        # sliding attention described (its layers, or their heads: Step 3.7 always masks for them), its window unset
        sliding_layers = isinstance(kinds, (list, tuple)) and any(isinstance(k, str) and k.startswith("sliding") for k in kinds)
        sliding_settings = any("sliding" in k and k != "sliding_window" and v not in (None, False) for k, v in values.items())
        if sliding_layers or sliding_settings:
            out["sliding_window"] = SEQUENCE // 2
    if "mlp_layer_types" in values and values["mlp_layer_types"] is None and experts and layers:
        # dense or mixture-of-experts feed-forward per layer, left to the checkpoint (DeepSeek-OCR 2): one of each
        count = len(kept) if kept is not None else layers
        out["mlp_layer_types"] = ["dense"] + ["sparse"] * (count - 1) if count > 1 else ["sparse"]
    stages = values.get("out_indices")
    if kept is not None and isinstance(stages, (list, tuple)) and stages and all(isinstance(i, int) for i in stages):
        # a backbone's outputs: the last len(out_indices) of the kept layers (a DPT neck needs all four)
        count = len(kept)
        chosen = list(range(max(1, count - len(stages) + 1), count + 1))
        for prefix in ("", "_"):  # the constructor takes one or the other
            out[prefix + "out_indices"] = chosen
            out[prefix + "out_features"] = [f"stage{i}" for i in chosen]
        out["stage_names"] = ["stem"] + [f"stage{i}" for i in range(1, count + 1)]
    if shallow:  # widths, heads and sizes stay consistent as the default config has them
        depth = _LAYER_KEYS | _EXPERT_KEYS | _TOPK_KEYS | _GROUP_KEYS | _TOPK_GROUP_KEYS | _DEPTH_LIST_KEYS | {"vocab_size", "stage_names", "mlp_layer_types", "sliding_window", "n_shared_experts"}
        out = {
            key: value for key, value in out.items()
            if key in depth or key in followed or key in _LAYER_INDEX_KEYS
            or key in sub_configs or hasattr(getattr(config, key, None), "to_dict")
            or key.startswith(("per_layer", "out_features", "out_indices", "_out"))
            or (kept is not None and isinstance(values.get(key), (list, tuple)) and len(values[key]) == layers)
        }
    accepted = _init_parameters(type(config))
    # per-layer dicts and a backbone's outputs are taken through **kwargs (and a sub-config's
    # to_dict() hands back the default ones, which these must replace)
    through = ("per_layer", "out_features", "out_indices")
    return {key: value for key, value in out.items() if accepted is None or key in accepted or key.startswith(through)}


def _layer_shrunk(layer: Any, values: dict[str, Any]) -> Any:
    """One layer's own settings (a ``per_layer_config`` entry: Dots 3's sliding-window layers have more
    heads and wider ones) shrunk by the rules for heads, head widths and ranks; a head made of a
    rotary and a non-rotary part stays their sum where the default's was."""
    if not isinstance(layer, dict):
        return layer
    whole = {**values, **layer}
    out = dict(layer)
    for key, value in layer.items():
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if key in _HEAD_KEYS and value > 2:
            out[key] = 2
        elif key in _KV_HEAD_KEYS and value > 1:
            out[key] = 2 if value == whole.get("num_attention_heads") and "kv_lora_rank" in whole else 1
        elif key in _HEAD_DIM_KEYS and key != "head_dim" and value > 16:  # a layer's own head_dim (Gemma 4's global
            out[key] = 16  # layers') stays, as it has: only a head made of parts follows them (below)
        elif key in _RANK_KEYS and value > HIDDEN:
            out[key] = HIDDEN
    parts = ("qk_nope_head_dim", "qk_rope_head_dim")
    if all(isinstance(whole.get(k), int) for k in (*parts, "head_dim")) and whole["head_dim"] == sum(whole[k] for k in parts):
        out["head_dim"] = sum(min(whole[k], 16) for k in parts)
    return out


def _layer_index(value: Any) -> Any:
    """Layer indices (LLaVA's ``vision_feature_layer``, one or a list) within the tiny tower: a
    negative index stays (it counts from the end), one past the two kept layers becomes the last
    ones, distinct as before."""
    if isinstance(value, bool) or not isinstance(value, (int, list, tuple)):
        return value
    many = isinstance(value, (list, tuple))
    items = list(value) if many else [value]
    if not all(isinstance(v, int) for v in items):
        return value
    fitted = []
    for v in items:
        if v >= 2 or v < -2:  # 2 layers kept: indices 0, 1 or -1, -2
            v = -1 - len([f for f in fitted if f < 0])
        fitted.append(max(v, -2))
    return fitted if many else fitted[0]


def _kept_layers(values: dict[str, Any], layers: int | None) -> list[int] | None:
    """Which of the default config's layers the tiny one keeps (None: all): two, or one of each
    kind in ``layer_types`` (a hybrid model needs an attention layer beside its linear ones), or
    as many as a backbone has outputs (``out_indices``)."""
    if not layers or layers <= 2:
        return None
    kinds = values.get("layer_types")
    chosen: list[int] = []
    if isinstance(kinds, (list, tuple)) and len(kinds) == layers:
        seen: set = set()
        for index, kind in enumerate(kinds):
            if kind not in seen and isinstance(kind, str):
                seen.add(kind)
                chosen.append(index)
    stages = values.get("out_indices")
    wanted = max(2, len(chosen), len(stages) if isinstance(stages, (list, tuple)) else 0)
    wanted = min(wanted, layers, 4)
    for index in range(layers):  # fill up with the first layers
        if len(chosen) >= wanted:
            break
        if index not in chosen:
            chosen.append(index)
    return sorted(chosen[:wanted])


def _unset_by_default(config_class) -> set[str]:
    """The constructor's parameters whose default is None (what the config derives or leaves to a checkpoint)."""
    try:
        parameters = inspect.signature(config_class.__init__).parameters
    except (TypeError, ValueError):
        return set()
    return {name for name, p in parameters.items() if p.default is None}


def _init_parameters(config_class) -> set[str] | None:
    """The constructor's named parameters (derived attributes, Swin's num_layers, are not)."""
    try:
        parameters = inspect.signature(config_class.__init__).parameters
    except (TypeError, ValueError):
        return None
    named = {name for name, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return named if len(named) > 1 else None


#: How far a config is shrunk, in the order :func:`build` tries them: every rule (``tiny``), depth
#: only (``shallow``: the default widths, which some architectures tie together in ways the rules
#: do not know), or none (``default``, within :data:`PARAMETER_BUDGET`).
TIERS = ("tiny", "shallow", "default")
#: The most parameters a ``shallow`` or ``default`` model may have (counted on the meta device
#: before any weight is made): larger ones would not export within a row's time limit.
PARAMETER_BUDGET = 150_000_000


#: sub-configs of towers that a default config may leave out (None) though its model has them
_TOWERS_BY_DEFAULT_ABSENT = ("vision_config", "audio_config")


def tiny_config(model_type: str, tier: str = "tiny"):
    """The default config of ``model_type``, shrunk by :func:`_shrunk` as far as ``tier`` says
    (:data:`TIERS`), with :data:`OVERRIDES`."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    towers = {}
    for key in _TOWERS_BY_DEFAULT_ABSENT:
        tower = (getattr(type(default), "sub_configs", None) or {}).get(key)
        if getattr(default, key, False) is None and isinstance(tower, type) and tower is not AutoConfig:
            # a tower the default config leaves out and every checkpoint of the model has (Gemma 4's vision
            # and audio): its config class's defaults, shrunk as the rest
            towers[key] = tower().to_dict()
    if towers:
        default = AutoConfig.for_model(model_type, **towers)
    shrunk = towers if tier == "default" else _shrunk(default, shallow=tier == "shallow")
    overrides = OVERRIDES.get(model_type, {})
    kwargs = _merged(shrunk, overrides)  # a sub-config's override is merged into its shrunk values
    config = AutoConfig.for_model(model_type, **kwargs)
    channels = _backbone_channels(config)
    if channels and isinstance(getattr(config, "encoder_in_channels", None), (list, tuple)):
        if len(config.encoder_in_channels) == len(channels) and list(config.encoder_in_channels) != channels:
            # a detector's encoder reads the backbone's stages: its input channels are theirs (RT-DETR)
            config = AutoConfig.for_model(model_type, **{**kwargs, "encoder_in_channels": channels})
    return config


def _merged(values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``values`` with ``overrides``, a dict for a sub-config (at any depth) merged into its values."""
    out = {**values, **overrides}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            out[key] = _merged(values[key], value)
    return out


def _backbone_channels(config) -> list[int] | None:
    """The channels of the stages a backbone sub-config hands on (``out_indices`` over its
    ``hidden_sizes``, stage 0 the stem), or None."""
    backbone = getattr(config, "backbone_config", None)
    sizes = getattr(backbone, "hidden_sizes", None)
    stages = getattr(backbone, "out_indices", None)
    if not isinstance(sizes, (list, tuple)) or not isinstance(stages, (list, tuple)) or not stages:
        return None
    stem = getattr(backbone, "embedding_size", None) or sizes[0]
    sizes = [stem, *sizes]
    return [sizes[i] for i in stages] if all(isinstance(i, int) and -len(sizes) <= i < len(sizes) for i in stages) else None


def _forward_parameters(model) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _token_ids(config, shape, generator):
    import torch

    text = getattr(config, "text_config", None) or config
    # or a sub-model's, where the composite has none of its own (FastSpeech 2 beside its vocoder)
    vocab = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None) or _find(config.to_dict(), "vocab_size") or 100
    special = _special_ids(config.to_dict()) | _special_ids(text.to_dict() if hasattr(text, "to_dict") else {})
    allowed = [i for i in range(3, min(vocab, 100)) if i not in special] or [0]
    index = torch.randint(0, len(allowed), shape, generator=generator)
    return torch.tensor(allowed)[index]


def _image_size(config) -> tuple[int, int]:
    size = getattr(config, "image_size", None) or 32
    if isinstance(size, (list, tuple)):
        return int(size[0]), int(size[-1])
    if isinstance(size, dict):
        return int(size.get("height", 32)), int(size.get("width", 32))
    return int(size), int(size)


def make_inputs(model, config, images: bool = True) -> dict[str, Any]:
    """Valid example inputs by the model's main input (token ids, pixels or videos, log-mel features,
    waveforms, patches with their grid or positions, flattened patches, past values, embeddings),
    batch 2, and what the forward requires beside it (a pixel model's text prompt, a Q-Former's
    prompt, region features, a task prompt, feature masks); a vision-language model also gets
    images unless ``images=False``."""
    import torch

    generator = torch.Generator().manual_seed(0)
    parameters = _forward_parameters(model)
    main = getattr(model, "main_input_name", "input_ids")
    if isinstance(main, str) and main not in parameters and "input_ids" in parameters:
        main = "input_ids"  # a text tower inheriting its composite's main input (SAM 3 Lite's: pixel_values)
    inputs: dict[str, Any] = {}
    grid = next((name for name in ("grid_thw", "image_grid_thw") if name in parameters), None)
    if grid and "input_ids" not in parameters:  # a Qwen-VL-style vision tower: flattened patches and their grid
        patches = _grid_patches(config, generator)
        pixels = "hidden_states" if "hidden_states" in parameters and "pixel_values" not in parameters else "pixel_values"
        inputs[pixels], inputs[grid] = patches["pixel_values"], patches["image_grid_thw"]
        if "merge_sizes" in parameters:
            inputs["merge_sizes"] = torch.tensor([getattr(config, "spatial_merge_size", None) or 1] * BATCH)
    elif "target_sizes" in parameters and "input_ids" not in parameters and main == "pixel_values":
        inputs.update(_packed_patches(config, generator))
    elif "past_time_features" in parameters:  # a probabilistic forecaster: its context plus the largest lag
        lags = getattr(config, "lags_sequence", None) or [0]
        length = (getattr(config, "context_length", None) or 32) + max(lags)
        size = getattr(config, "input_size", None) or 1
        shape = (BATCH, length) if size == 1 else (BATCH, length, size)  # univariate series come as (batch, time)
        features = getattr(config, "num_time_features", None) or 0
        inputs["past_values"] = torch.randn(*shape, generator=generator)
        inputs["past_time_features"] = torch.randn(BATCH, length, features, generator=generator)
        inputs["past_observed_mask"] = torch.ones(*shape)
    elif main == "past_values" or "past_values" in parameters:  # a time-series model: (batch, context, channels)
        length = getattr(config, "context_length", None) or 32
        channels = getattr(config, "num_input_channels", None)
        patch = getattr(config, "patch_length", None)
        if channels is None and isinstance(patch, int):
            # a univariate patched forecaster (TimesFM): (batch, whole patches), their padding flags and frequency
            inputs["past_values"] = torch.randn(BATCH, 4 * patch, generator=generator)
            if "past_values_padding" in parameters:
                inputs["past_values_padding"] = torch.zeros(BATCH, 4 * patch, dtype=torch.long)
            if "freq" in parameters:
                inputs["freq"] = torch.zeros(BATCH, 1, dtype=torch.long)
        else:
            inputs["past_values"] = torch.randn(BATCH, length, channels or 1, generator=generator)
    elif main in ("pixel_values", "pixel_values_videos") or ("pixel_values" in parameters and "input_ids" not in parameters):
        vision = getattr(config, "vision_config", None) or config
        height, width = _image_size(vision)
        channels = getattr(vision, "num_channels", 3) or 3
        frames = getattr(vision, "num_frames", None) or getattr(config, "num_frames", None)
        if "ForImage" in type(model).__name__:  # an image head of a config that also describes video (Perceiver's)
            frames = None
        # a video model by its input's name or by a video token in its text (InstructBLIP-Video)
        video = main == "pixel_values_videos" or any(k.startswith("video_token") for k in config.to_dict())
        required = _required(model)
        if (required | parameters & {"spatial_shapes"}) & {"spatial_shapes", "pixel_position_ids", "aspect_ratio_ids"}:
            inputs.update(_patch_inputs(model, vision, generator))
        elif type(model).__name__.endswith("ForKeypointMatching") or _matches_keypoints(config):  # a pair of images to match per row
            inputs["pixel_values"] = torch.randn(BATCH, 2, channels, height, width, generator=generator)
        elif video or (isinstance(frames, int) and frames > 0):  # a video model reads (batch, frames, channels, height, width)
            frames = frames if isinstance(frames, int) and frames > 0 else 2 * (getattr(vision, "tubelet_size", None) or 1)
            inputs[main if video else "pixel_values"] = torch.randn(BATCH, frames, channels, height, width, generator=generator)
        else:
            inputs["pixel_values"] = torch.randn(BATCH, channels, height, width, generator=generator)
        inputs.update(_text_beside_pixels(model, config, dict(inputs), generator))
        if "bool_masked_pos" in required:  # a masked-patch pretraining head (VideoMAE): half of each row's patches
            patches = next((m.num_patches for m in model.modules() if isinstance(getattr(m, "num_patches", None), int)), None)
            if patches:
                order = torch.stack([torch.randperm(patches, generator=generator) for _ in range(BATCH)])
                inputs["bool_masked_pos"] = order < patches // 2  # as many masked in every row, as the head needs
        prompts = sorted(required & {"prompt_pixel_values", "prompt_masks"})
        if prompts and "pixel_values" in inputs:
            # SegGPT: an example image and its mask, stacked above the input to fill image_size
            inputs["pixel_values"] = inputs["pixel_values"][..., : height // 2, :].contiguous()
            for name in prompts:
                inputs[name] = torch.randn(inputs["pixel_values"].shape, generator=generator)
        if "task_inputs" in _required(model):  # OneFormer's task prompt, tokenized to its task_seq_len
            vocab = getattr(config, "text_encoder_vocab_size", None) or 100
            length = getattr(config, "task_seq_len", None) or SEQUENCE
            inputs["task_inputs"] = torch.randint(3, min(vocab, 100), (BATCH, length), generator=generator)
    elif main == "input_features":
        bins = next((getattr(part, key) for part in (config, getattr(config, "encoder_config", None), getattr(config, "audio_config", None))
                     for key in ("num_mel_bins", "feature_size") if isinstance(getattr(part, key, None), int)), None)  # an ASR model's encoder's
        # or the speech tower's under another name (Nemotron's asr_config), or its feature extractor's (Gemma 4's audio tower)
        bins = bins or _find(config.to_dict(), "num_mel_bins") or _extractor_features(config) or 80
        stacked = getattr(config, "feature_projection_input_dim", None)  # w2v-BERT stacks frames: (batch, frames, 2 x bins)
        whisper_style = getattr(config, "num_mel_bins", None) and "speech_to_text" not in config.model_type
        if getattr(config, "max_source_positions", None) and whisper_style:  # reads exactly 2 x positions frames
            inputs["input_features"] = torch.randn(BATCH, bins, 2 * config.max_source_positions, generator=generator)
        elif isinstance(stacked, int):
            inputs["input_features"] = torch.randn(BATCH, 64, stacked, generator=generator)
        elif isinstance(getattr(config, "num_stacked_frames", None), int):  # low-frame-rate stacking (FunASR): (batch, frames, k x bins)
            inputs["input_features"] = torch.randn(BATCH, 16, bins * config.num_stacked_frames, generator=generator)
        else:
            window = getattr(config, "n_window", None)  # a windowed encoder (Qwen3-ASR) reads whole windows of 2 x n_window frames
            frames = 2 * window if isinstance(window, int) and window > 0 else 64
            shape = (BATCH, frames, bins) if "speech_to_text" in config.model_type else (BATCH, bins, frames)
            first = next((m for m in model.modules() if isinstance(getattr(m, "weight", None), torch.nn.Parameter)), None)
            width = getattr(first, "in_features", None) if isinstance(first, torch.nn.Linear) else None
            if isinstance(width, int) and width > bins and width % bins == 0 and _find(config.to_dict(), "subsampling_factor") is None:
                # an extractor stacking each frame's mel with its deltas and neighbours (Granite Speech 5): as wide as the
                # linear projection that reads them first (a model stacking them itself says by its subsampling_factor)
                shape = (BATCH, frames, width)
            inputs["input_features"] = torch.randn(*shape, generator=generator)
        if "input_features_mask" in parameters:  # every frame valid, as an extractor gives unpadded audio
            features = inputs["input_features"]
            frames = features.shape[-1] if features.shape[1] == bins else features.shape[1]
            inputs["input_features_mask"] = torch.ones(BATCH, frames, dtype=torch.long)
    elif main in ("input_values", "latents"):  # a codec's decoder reads its latents (Mimi's)
        inputs.update(_waveform(model, config, generator))
    elif main == "flattened_patches":
        # Pix2Struct's processor: patches flattened with their (row, column), 1-based, first
        vision = getattr(config, "vision_config", None) or config
        width = getattr(vision, "patch_embed_hidden_size", None) or 3 * 16 * 16
        rows, columns = torch.meshgrid(torch.arange(1, 5), torch.arange(1, 5), indexing="ij")
        places = torch.stack([rows.flatten(), columns.flatten()], dim=-1).float().expand(BATCH, -1, -1)
        inputs["flattened_patches"] = torch.cat([places, torch.randn(BATCH, 16, width, generator=generator)], dim=-1)
        if "attention_mask" in parameters:
            inputs["attention_mask"] = torch.ones(BATCH, 16, dtype=torch.long)
    elif isinstance(main, str) and main.endswith("_embeds") and "input_ids" not in parameters and isinstance(getattr(config, "hidden_size", None), int):
        # a forward reading embeddings another model made (Nemotron's word timestamps over audio frames)
        inputs[main] = torch.randn(BATCH, SEQUENCE, config.hidden_size, generator=generator)
        if "attention_mask" in parameters:
            inputs["attention_mask"] = torch.ones(BATCH, SEQUENCE, dtype=torch.long)
    elif main == "states" and isinstance(getattr(config, "state_dim", None), int):
        # an offline-RL trajectory (Decision Transformer): per step a state, an action, a reward, the
        # return to go, and the step's index within the episode
        steps = SEQUENCE
        inputs["states"] = torch.randn(BATCH, steps, config.state_dim, generator=generator)
        if "actions" in parameters:
            inputs["actions"] = torch.randn(BATCH, steps, getattr(config, "act_dim", None) or 1, generator=generator)
        for name in ("rewards", "returns_to_go"):
            if name in parameters:
                inputs[name] = torch.randn(BATCH, steps, 1, generator=generator)
        if "timesteps" in parameters:
            inputs["timesteps"] = torch.arange(steps).expand(BATCH, -1).clone()
        if "attention_mask" in parameters:
            inputs["attention_mask"] = torch.ones(BATCH, steps, dtype=torch.long)
    elif isinstance(getattr(config, "max_state_dim", None), int) and isinstance(getattr(config, "max_action_dim", None), int):
        inputs.update(_policy_inputs(model, config, generator))
    elif main == "audio_mel":  # Gemma 3n's audio tower: (batch, frames, bins) log-mel and its padding mask (True: padded)
        bins = getattr(config, "input_feat_size", None) or 128
        inputs["audio_mel"] = torch.randn(BATCH, 64, bins, generator=generator)
        inputs["audio_mel_mask"] = torch.zeros(BATCH, 64, dtype=torch.bool)
    elif main == "inputs" and "input_ids" not in parameters:  # a forward whose input is generic (`inputs`)
        encoder = getattr(model, "encoder", None)
        if isinstance(encoder, torch.nn.Module) and getattr(config, "encoder", None) is not None:
            # a composite speech encoder-decoder: its encoder's inputs, under their own names
            inputs.update({k: v for k, v in make_inputs(encoder, config.encoder).items() if hasattr(v, "shape")})
        elif isinstance(getattr(config, "d_model", None), int):  # Perceiver without a preprocessor: embeddings
            inputs["inputs"] = torch.randn(BATCH, SEQUENCE, config.d_model, generator=generator)
    else:
        # a multiple-choice head reads (batch, choices, sequence)
        shape = (BATCH, 2, SEQUENCE) if type(model).__name__.endswith("ForMultipleChoice") else (BATCH, SEQUENCE)
        codebooks = getattr(config, "num_codebooks", None)
        streams = isinstance(codebooks, int) and isinstance(getattr(config, "codebook_vocab_size", None), int)
        if isinstance(codebooks, int) and codebooks > 1 and not getattr(config, "is_encoder_decoder", False) and not streams:
            shape = (BATCH * codebooks, SEQUENCE)  # an audio-codes decoder (MusicGen) reads one row per codebook
        inputs["input_ids"] = _token_ids(config, shape, generator)
        if streams and "inputs_embeds" in parameters and "input_values" not in parameters:
            # a text stream beside the audio's codebooks (Kyutai's speech-to-text): per step a text token and
            # one code per codebook, (batch, sequence, 1 + codebooks)
            codes = torch.randint(0, config.codebook_vocab_size, (*shape, codebooks), generator=generator)
            inputs["input_ids"] = torch.cat([inputs["input_ids"][..., None], codes], dim=-1)
        if "bbox" in parameters:  # document models: one box (x0, y0, x1, y1 within 0..1000) per token
            corner = torch.randint(0, 500, (*shape, 2), generator=generator)
            inputs["bbox"] = torch.cat([corner, corner + torch.randint(1, 500, (*shape, 2), generator=generator)], dim=-1)
        if "attention_mask" in parameters:
            inputs["attention_mask"] = torch.ones(*shape, dtype=torch.long)
        image_tokens = [k for k in config.to_dict() if k.startswith(("image_token", "video_token"))]
        vision = getattr(config, "vision_config", None)
        if "pixel_values" in parameters and vision is None and isinstance(getattr(config, "modality_type_vocab_size", None), int):
            vision = config  # a single-stream model embedding text and image patches together (ViLT)
        if "pixel_values" in parameters and vision is not None and not image_tokens and "spatial_shapes" in parameters:
            inputs.update(_patch_inputs(model, vision, generator))  # a dual encoder over NaFlex patches (SigLIP 2)
        elif "pixel_values" in parameters and vision is not None and not image_tokens:  # dual encoders (CLIP)
            height, width = _image_size(vision)
            channels = getattr(vision, "num_channels", 3) or 3
            frames = getattr(vision, "num_frames", None)
            if isinstance(frames, int) and frames > 0:  # a video-text dual encoder (X-CLIP): (batch, frames, channels, h, w)
                inputs["pixel_values"] = torch.randn(BATCH, frames, channels, height, width, generator=generator)
            elif "image_attention_mask" in parameters:
                # IDEFICS: images per row (one here), and which images each token attends to (all)
                inputs["pixel_values"] = torch.randn(BATCH, 1, channels, height, width, generator=generator)
                inputs["image_attention_mask"] = torch.ones(*shape, 1, dtype=torch.long)
            else:
                inputs["pixel_values"] = torch.randn(BATCH, channels, height, width, generator=generator)
        if "visual_feats" in parameters and isinstance(getattr(config, "visual_feat_dim", None), int):
            # a two-stream model over detected regions (LXMERT): a detector's region features and boxes
            regions = 4
            inputs["visual_feats"] = torch.randn(BATCH, regions, config.visual_feat_dim, generator=generator)
            corner = torch.rand(BATCH, regions, 2, generator=generator) / 2
            inputs["visual_pos"] = torch.cat([corner, corner + 0.5], dim=-1)[..., : getattr(config, "visual_pos_dim", 4)]
        if "global_attention_mask" in parameters and type(model).__name__.endswith(("ForQuestionAnswering", "ForMultipleChoice")):
            # Longformer's question-answering heads look for separator tokens to put global attention on the
            # question; what a pipeline does instead: global attention on the first token
            inputs["global_attention_mask"] = torch.zeros(*shape, dtype=torch.long)
            inputs["global_attention_mask"][..., 0] = 1
        elif images and "pixel_values" in parameters and vision is not None and shape == (BATCH, SEQUENCE):
            inputs.update(image_inputs(model, config, inputs["input_ids"], generator))
        if images and "input_features" in parameters and getattr(config, "audio_config", None) is not None and shape == (BATCH, SEQUENCE):
            inputs.update(audio_inputs(model, config, inputs["input_ids"], generator))
        elif "input_features" in parameters and getattr(config, "audio_config", None) is None:
            # a text-to-speech model conditioned on a voice's log-mel (CLVP): (batch, bins, frames), the bins
            # its conditioning encoder's convolution reads
            bins = _find(config.to_dict(), "num_mel_bins") or _find(config.to_dict(), "feature_size")
            if isinstance(bins, int) and bins > 1:
                inputs["input_features"] = torch.randn(BATCH, bins, 64, generator=generator)
    question = getattr(config, "question_token_id", None)
    if isinstance(question, int) and "question_positions" in parameters and inputs.get("input_ids") is not None:
        # Splinter's processor puts a question token ([QUESTION]) in each row: the span heads start from it
        inputs["input_ids"][:, 1] = question
    if "decoder_input_ids" in parameters and not getattr(config, "is_encoder_decoder", False) and "pixel_values" in inputs:
        if type(model).__name__.endswith("ForQuestionAnswering"):  # a generative answer head (BLIP's VQA): the answer's start
            inputs["decoder_input_ids"] = _token_ids(config, (BATCH, 4), generator)
    patches = next((m.num_patches for m in model.modules() if isinstance(getattr(m, "num_patches", None), int)), None)
    if patches is None:  # masking by units of patches (Hiera): one value per unit
        units = next((m.mask_spatial_shape for m in model.modules() if isinstance(getattr(m, "mask_spatial_shape", None), (list, tuple))), None)
        patches = math.prod(units) if units and all(isinstance(u, int) for u in units) else None
    if "noise" in parameters and "noise" not in inputs and "pixel_values" in inputs and patches:
        # random masking (ViT-MAE) draws its noise inside forward unless given: one value per patch (or
        # unit), fixed, so PyTorch and both files mask the same patches
        inputs["noise"] = torch.rand(BATCH, patches, generator=generator)
    features = inputs.get("input_features")
    channels = getattr(config, "model_in_channels", None)
    if "noise_sequence" in parameters and getattr(features, "dim", lambda: 0)() == 3 and isinstance(channels, int):
        # a vocoder (UnivNet) draws its noise inside forward unless given: (batch, frames, channels), fixed;
        # frames: the axis that is not the mel bins (the features may yet be transposed, see _build)
        frames = features.shape[2] if features.shape[1] == getattr(config, "num_mel_bins", None) else features.shape[1]
        inputs["noise_sequence"] = torch.randn(BATCH, frames, channels, generator=generator)
    width = getattr(config, "hidden_size", None)
    for name in sorted(_required(model) - set(inputs)):
        if name.endswith("_embeds") and isinstance(width, int):
            # embeddings a caller computes (a Q-Former's queries): (batch, sequence, hidden)
            inputs[name] = torch.randn(BATCH, SEQUENCE, width, generator=generator)
            memory = getattr(config, "encoder_hidden_size", None)
            if "encoder_hidden_states" in parameters and isinstance(memory, int):  # what its cross-attention reads (an image's)
                inputs["encoder_hidden_states"] = torch.randn(BATCH, 2 * SEQUENCE, memory, generator=generator)
    if "input_values" in _required(model) and "input_values" not in inputs:  # audio beside text (PE Audio)
        inputs.update(_waveform(model, config, generator))
    if "use_cache" in parameters:  # no cache object in the outputs: torch.export needs its pytree registered
        inputs["use_cache"] = False
    if "sample" in parameters and inspect.signature(model.forward).parameters["sample"].default is True:
        # a VAE that draws its latents by default (VibeVoice's acoustic tokenizer: noise from torch.randn, which
        # no file reproduces): the encoder's mean, deterministic, as its decoding path takes it
        inputs["sample"] = False
    if "decoder_input_values" in parameters and isinstance(getattr(config, "hidden_size", None), int):
        # a speech decoder (SpeechT5's): mel frames when a layer reads them (its speech pre-net), else
        # hidden states; and the speaker's embedding its pre-net reads beside them
        bins = getattr(config, "num_mel_bins", None)
        mels = isinstance(bins, int) and any(isinstance(m, torch.nn.Linear) and m.in_features == bins for m in model.modules())
        inputs["decoder_input_values"] = torch.randn(BATCH, 4, bins if mels else config.hidden_size, generator=generator)
        speaker = getattr(config, "speaker_embedding_dim", None)
        if mels and "speaker_embeddings" in parameters and isinstance(speaker, int):
            inputs["speaker_embeddings"] = torch.randn(BATCH, speaker, generator=generator)
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in parameters:
        if type(model).__name__.endswith("ForSequenceClassification") and "input_ids" in inputs:
            # BART-style heads classify at each row's last end-of-sequence token, read from the decoder's
            # states over the same tokens: one EOS per row, the decoder input made from input_ids
            eos = getattr(config, "eos_token_id", None)
            if isinstance(eos, int):
                inputs["input_ids"][:, -1] = eos
        else:
            decoder = getattr(config, "decoder", None) or getattr(config, "decoder_config", None)
            codebooks = getattr(decoder, "num_codebooks", None)  # MusicGen: a row per codebook
            rows = BATCH * codebooks if isinstance(codebooks, int) and codebooks > 1 else BATCH
            channels = getattr(decoder, "num_channels", None)
            if codebooks is None and isinstance(channels, int) and channels > 1:
                # an audio decoder over parallel channels of codes (Dia): (batch, length, channels), the layout
                # it works in (its flattened one's view fails in eager PyTorch)
                inputs["decoder_input_ids"] = _token_ids(config, (BATCH, 4, channels), generator)
            else:
                inputs["decoder_input_ids"] = _token_ids(config, (rows, 4), generator)
    return inputs


def _waveform(model, config, generator) -> dict[str, Any]:
    """Raw audio under the forward's name for it: (batch, samples) for a speech encoder; (batch,
    channels, samples) for a codec, known by its channel count (``audio_channels``, ``channels``)
    or its stride ratios (EnCodec, Mimi, DAC), which some codecs' forwards call ``hidden_states``."""
    import torch

    # an x-vector head's time-delay layers need more frames than a quarter second gives
    samples = 16000 if getattr(config, "tdnn_kernel", None) else 4000
    per_token = getattr(config, "samples_per_token", None)
    if isinstance(per_token, int) and per_token > 0:  # an encoder collapsing that many samples into a token reads whole tokens (Muse Spark)
        samples = -(-samples // per_token) * per_token
    channels, strides = _codec(config.to_dict())
    parameters, required = _forward_parameters(model), _required(model)
    name = "hidden_states" if "input_values" not in parameters and "hidden_states" in required else "input_values"
    name = "latents" if "latents" in required else name
    bins, length = getattr(config, "num_mel_bins", None), getattr(config, "max_length", None)
    if channels is None and not strides and isinstance(bins, int) and isinstance(length, int):
        # a spectrogram transformer (AST) reads the extractor's (batch, max_length frames, bins), its positions sized for them
        return {name: torch.randn(BATCH, length, bins, generator=generator)}
    width = getattr(config, "hidden_size", None)
    if channels is None and not strides and "decoder_input_values" in parameters and _first_conv_channels(model) is None and isinstance(width, int):
        # an encoder-decoder without a speech front end (SpeechT5's bare model) reads hidden states
        return {name: torch.randn(BATCH, SEQUENCE, width, generator=generator)}
    if channels is None and not strides:
        return {name: torch.randn(BATCH, samples, generator=generator)}
    width = _first_conv_channels(model) if name in ("latents", "hidden_states") else None
    if width is not None and width != (channels or 1):
        # a codec's decoder (Mimi's, VibeVoice's) reads latents, not audio: (batch, latent width, frames)
        return {name: torch.randn(BATCH, width, SEQUENCE, generator=generator)}
    out = {name: torch.randn(BATCH, channels or 1, samples, generator=generator)}
    stacked = _find(config.to_dict(), "feature_projection_input_dim")
    ratios = getattr(config, "downsampling_ratios", None)
    if "input_features" in required and isinstance(stacked, int) and isinstance(ratios, (list, tuple)):
        # a codec with a semantic (w2v-BERT) encoder beside its acoustic one (XCodec2): stacked
        # features of one frame per acoustic frame, so both encoders' frames line up
        hop = math.prod(ratios)
        frames = max(1, samples // hop)
        out[name] = torch.randn(BATCH, channels or 1, frames * hop, generator=generator)
        out["input_features"] = torch.randn(BATCH, frames, stacked, generator=generator)
    return out


def _extractor_features(config) -> int | None:
    """The feature width (``feature_size`` over 1: log-mel bins) of the feature extractor transformers
    registers for the model type, or for its family (``gemma4`` for ``gemma4_audio``), made with its
    defaults; None when there is none or it cannot be made here (it needs torchaudio)."""
    import transformers
    from transformers.models.auto.feature_extraction_auto import FEATURE_EXTRACTOR_MAPPING_NAMES

    model_type = getattr(config, "model_type", "") or ""
    for name in (model_type, model_type.rsplit("_", 1)[0]):
        found = FEATURE_EXTRACTOR_MAPPING_NAMES.get(name)
        if found is None:
            continue
        try:
            extractor = getattr(transformers, found)()
        except Exception:  # a backend this environment lacks
            return None
        size = getattr(extractor, "feature_size", None)
        return size if isinstance(size, int) and size > 1 else None
    return None


def _first_conv_channels(model) -> int | None:
    """The channels the model's first 1-D convolution (or transposed one) reads."""
    import torch

    kinds = (torch.nn.Conv1d, torch.nn.ConvTranspose1d)
    return next((m.in_channels for m in model.modules() if isinstance(m, kinds)), None)


def _find(values: dict[str, Any], key: str) -> Any:
    """The value of ``key`` in a config's dict or the first sub-config that has it."""
    if key in values:
        return values[key]
    return next((found for v in values.values() if isinstance(v, dict) and (found := _find(v, key)) is not None), None)


def _codec(values: dict[str, Any]) -> tuple[int | None, bool]:
    """(channel count, whether stride ratios are given) of a config or its nearest codec sub-config
    (PE Audio's encoder wraps a DAC's)."""
    channels = next((values[k] for k in ("audio_channels", "channels") if isinstance(values.get(k), int)), None)
    strides = any(isinstance(values.get(k), (list, tuple)) for k in ("downsampling_ratios", "upsampling_ratios"))
    if channels is not None or strides:
        return channels, strides
    for value in values.values():
        if isinstance(value, dict) and value.get("model_type"):
            found = _codec(value)
            if found != (None, False):
                return found
    return None, False


def _patch_inputs(model, vision, generator) -> dict[str, Any]:
    """Pixels as processors that cut images into patches or tiles give them: a 4 x 4 grid of
    flattened patches with its ``spatial_shapes`` and ``pixel_attention_mask`` (SigLIP 2's NaFlex);
    a grid of whole pooling windows with each patch's (x, y) in ``pixel_position_ids`` (Gemma 4);
    one tile of one image with its ``aspect_ratio_ids`` (1: the 1 x 1 ratio) and ``aspect_ratio_mask`` (Mllama)."""
    import torch

    required = _required(model)
    channels = getattr(vision, "num_channels", None) or 3
    if "aspect_ratio_ids" in required:
        tiles = getattr(vision, "max_num_tiles", None) or 1
        size = getattr(vision, "image_size", None) or 32
        mask = torch.zeros(BATCH, 1, tiles, dtype=torch.long)
        mask[..., 0] = 1
        return {
            "pixel_values": torch.randn(BATCH, 1, tiles, channels, size, size, generator=generator),
            "aspect_ratio_ids": torch.ones(BATCH, 1, dtype=torch.long),
            "aspect_ratio_mask": mask,
        }
    if "pixel_position_ids" in required:
        pixels, positions = _positioned_patches(vision, generator)
        return {"pixel_values": pixels, "pixel_position_ids": positions}
    return _naflex_patches(vision, generator)


def _patch_grid(vision, generator):
    """(flattened patches of one square grid per row, the grid's side): whole pooling windows, twice."""
    import torch

    channels = getattr(vision, "num_channels", None) or 3
    patch = getattr(vision, "patch_size", None) or 16
    side = 2 * (getattr(vision, "pooling_kernel_size", None) or 2)
    return torch.randn(BATCH, side * side, channels * patch * patch, generator=generator), side


def _naflex_patches(vision, generator) -> dict[str, Any]:
    """A 4 x 4 grid of flattened patches with its ``spatial_shapes`` and ``pixel_attention_mask``
    (SigLIP 2's NaFlex processor)."""
    import torch

    pixels, side = _patch_grid(vision, generator)
    return {
        "pixel_values": pixels,
        "pixel_attention_mask": torch.ones(BATCH, side * side, dtype=torch.long),
        "spatial_shapes": torch.tensor([[side, side]] * BATCH),
    }


def _packed_patches(vision, generator) -> dict[str, Any]:
    """A NaViT-style tower's images (MiniCPM-V's): their patches packed side by side in one row of
    patches, (1, channels, patch, patches x patch), and each image's grid in patches (4 x 4: whole
    2 x 2 windows, twice) in ``target_sizes``."""
    import torch

    patch = getattr(vision, "patch_size", None) or 14
    channels = getattr(vision, "num_channels", None) or 3
    side = 4
    return {
        "pixel_values": torch.randn(1, channels, patch, BATCH * side * side * patch, generator=generator),
        "target_sizes": torch.tensor([[side, side]] * BATCH),
    }


def _positioned_patches(vision, generator):
    """(flattened patches, their (x, y)): a grid of whole pooling windows (Gemma 4's tower)."""
    import torch

    pixels, side = _patch_grid(vision, generator)
    rows, columns = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    positions = torch.stack([columns.flatten(), rows.flatten()], dim=-1)
    return pixels, positions.expand(BATCH, -1, -1).clone()


def _matches_keypoints(config) -> bool:
    """Whether the architecture is a keypoint matcher (its base model reads image pairs too: EfficientLoFTR)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_KEYPOINT_MATCHING_MAPPING_NAMES

    return getattr(config, "model_type", None) in MODEL_FOR_KEYPOINT_MATCHING_MAPPING_NAMES


def _policy_inputs(model, config, generator) -> dict[str, Any]:
    """A vision-language-action policy (PI0) as its processor and sampler give it: a prompt holding
    one camera image's tokens, the images (batch, cameras, channels, height, width) with which
    cameras are present, the robot's ``state`` (batch, ``max_state_dim``), the action ``noise``
    (batch, ``chunk_size``, ``max_action_dim``) and the flow-matching ``timestep`` in (0, 1). The
    policy's backbone takes state, noise and time already embedded (``action_embeds``: one state
    token and the chunk's, of its action expert's width)."""
    import torch

    parameters, required = _forward_parameters(model), _required(model)
    subs = [getattr(config, name, None) for name in getattr(config, "sub_configs", {}) or {}]
    language = next((sub for sub in subs if getattr(sub, "vision_config", None) is not None and _image_token(sub) is not None), None)
    tower = next((m for m in model.modules() if m is not model and hasattr(m, "get_image_features")), None)
    if language is None or tower is None:
        return {}
    vision = language.vision_config
    height, width = _image_size(vision)
    pixels = torch.randn(BATCH, 1, getattr(vision, "num_channels", None) or 3, height, width, generator=generator)
    with torch.no_grad():
        count = _count(tower.get_image_features(pixels.flatten(0, 1)))
    out = _placeholders(model, _token_ids(language, (BATCH, SEQUENCE), generator), _image_token(language), count or 0) or {}
    out.update(pixel_values=pixels, pixel_attention_mask=torch.ones(BATCH, 1, dtype=torch.bool))
    chunk = getattr(config, "chunk_size", None) or SEQUENCE
    if "state" in required:
        out["state"] = torch.randn(BATCH, config.max_state_dim, generator=generator)
        if "noise" in parameters:
            out["noise"] = torch.randn(BATCH, chunk, config.max_action_dim, generator=generator)
        if "timestep" in parameters:
            out["timestep"] = torch.full((BATCH,), 0.5)
    elif "action_embeds" in required:
        expert = next((getattr(sub, "hidden_size", None) for sub in subs if sub is not language and isinstance(getattr(sub, "hidden_size", None), int)), None)
        out["action_embeds"] = torch.randn(BATCH, 1 + chunk, expert or HIDDEN, generator=generator)
    return out


def _required(model) -> set[str]:
    """The forward's parameters without a default (what a call must give)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in parameters if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _text_beside_pixels(model, config, pixels: dict[str, Any], generator) -> dict[str, Any]:
    """Token ids for a model read from its pixels that takes text too, as its processor gives both:
    when its forward requires ``input_ids`` (BLIP-2, Grounding DINO, a video-text CLIP), or takes
    them with a ``text_config`` and either no decoder inputs to feed instead (Kosmos-2 and SAM 3
    take a text prompt) or an image token to mark where the images go. A Q-Former's image makes
    ``num_query_tokens`` features (per frame of a video): the text holds that many image tokens
    (InstructBLIP); the Q-Former's own prompt (``qformer_input_ids``) is given too. Kosmos-2 marks
    its ``latent_query_num`` image positions with ``image_embeds_position_mask``."""
    import torch

    parameters, required = _forward_parameters(model), _required(model)
    text = getattr(config, "text_config", None)
    token = _image_token(config)
    token = token if token is not None else getattr(config, "video_token_index", None)
    if "input_ids" not in required and not (
        "input_ids" in parameters and text is not None and ("decoder_input_ids" not in parameters or token is not None)
    ):
        return {}
    ids = _token_ids(config, (BATCH, SEQUENCE), generator)
    out: dict[str, Any] = {"input_ids": ids}
    queries = getattr(config, "num_query_tokens", None)
    latent = getattr(config, "latent_query_num", None)
    frames = next(iter(pixels.values())).shape[1] if next(iter(pixels.values())).dim() == 5 else 1
    if token is not None and isinstance(queries, int):
        out = _placeholders(model, ids, token, BATCH * queries * frames) or out
    elif isinstance(latent, int) and "image_embeds_position_mask" in parameters:
        # Kosmos-2's processor: <image> latent_query_num placeholders </image> after the first token
        ids = torch.cat([ids[:, :2], ids[:, 1:2].repeat(1, latent), ids[:, 2:]], dim=1)
        mask = torch.zeros_like(ids)
        mask[:, 2 : 2 + latent] = 1
        out = {"input_ids": ids, "image_embeds_position_mask": mask}
    if "attention_mask" in parameters:
        out["attention_mask"] = torch.ones_like(out["input_ids"])
    qformer = getattr(config, "qformer_config", None)
    if "qformer_input_ids" in parameters and qformer is not None:
        out["qformer_input_ids"] = _token_ids(qformer, (BATCH, SEQUENCE), generator)
        if "qformer_attention_mask" in parameters:
            out["qformer_attention_mask"] = torch.ones(BATCH, SEQUENCE, dtype=torch.long)
    return out


def _image_token(config) -> int | None:
    for key in ("image_token_id", "image_token_index"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def _grid_patches(vision, generator) -> dict[str, Any]:
    """One image per row as Qwen2-VL's processor gives it: a grid of 1 x 2m x 2m patches (m the
    spatial merge) flattened to (patches, channels x temporal patch x patch x patch), and the grids."""
    import torch

    channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", None) or 3
    patch = getattr(vision, "patch_size", None) or 14
    # frames per patch, under either name (Muse Spark's tower calls it patch_temporal)
    temporal = getattr(vision, "temporal_patch_size", None) or getattr(vision, "patch_temporal", None) or 1
    merge = getattr(vision, "spatial_merge_size", None) or 1
    side = 2 * merge  # a grid of 2 x 2 merged tokens
    grid = torch.tensor([[1, side, side]] * BATCH)
    pixels = torch.randn(BATCH * side * side, channels * temporal * patch * patch, generator=generator)
    return {"pixel_values": pixels, "image_grid_thw": grid}


def _pixel_inputs(model, config, generator) -> dict[str, Any]:
    """One image per row as the model's processor gives it: flattened patches with their
    ``image_grid_thw`` (Qwen2-VL), tiles with ``image_sizes`` (LLaVA-NeXT), or a batch of images."""
    import torch

    parameters = _forward_parameters(model)
    vision = config.vision_config
    channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", None) or 3
    if "image_grid_thw" in parameters:
        return _grid_patches(vision, generator)
    features = _image_feature_parameters(model)
    if "image_position_ids" in features and "image_position_ids" in parameters:
        # patches with their (x, y) (Gemma 4's processor): as its vision tower takes them
        pixels, positions = _positioned_patches(vision, generator)
        return {"pixel_values": pixels, "image_position_ids": positions}
    if features.get("target_sizes", False) is inspect.Parameter.empty and "target_sizes" in parameters:
        return _packed_patches(vision, generator)  # a NaViT tower's packed patches (MiniCPM-V's)
    if features.get("spatial_shapes", False) is inspect.Parameter.empty and "spatial_shapes" in parameters:
        return _naflex_patches(vision, generator)  # a NaFlex tower's patches (LFM2-VL's SigLIP 2)
    height, width = _image_size(vision)
    pinpoints = getattr(config, "image_grid_pinpoints", None)
    if "image_sizes" in parameters and pinpoints:
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        tiles = image_size_to_num_patches((height, width), pinpoints, height)
        pixels = torch.randn(BATCH, tiles, channels, height, width, generator=generator)
        return {"pixel_values": pixels, "image_sizes": torch.tensor([[height, width]] * BATCH)}
    pixels = {"pixel_values": torch.randn(BATCH, channels, height, width, generator=generator)}
    if "image_sizes" in parameters and features.get("image_sizes") is inspect.Parameter.empty:
        # each image's size beside the padded batch (Pixtral's processor, for Mistral 3): the whole image
        pixels["image_sizes"] = torch.tensor([[height, width]] * BATCH)
    return pixels


def _image_features(model):
    """The model's ``get_image_features``; a head without its own asks the model it wraps
    (PerceptionLM's, Janus's). None when neither has one."""
    return getattr(model, "get_image_features", None) or getattr(getattr(model, "model", None), "get_image_features", None)


def _image_feature_parameters(model) -> dict[str, Any]:
    """The parameters of :func:`_image_features`, with their defaults (``inspect.Parameter.empty``
    when required); empty when there is none."""
    get = _image_features(model)
    return {} if get is None else {name: p.default for name, p in inspect.signature(get).parameters.items()}


def _feature_count(model, pixels: dict[str, Any]) -> int | None:
    """How many token embeddings the model makes of the images (what its processor counts to
    put that many image tokens in the text): from its own ``get_image_features``."""
    import torch

    get = _image_features(model)
    if get is None:
        return None
    with torch.no_grad():
        return _count(get(**pixels))


def _placeholders(model, input_ids, token: int, count: int, start=None, end=None) -> dict[str, Any] | None:
    """``input_ids`` with ``count`` (over the batch) ``token`` placeholders after each row's first
    token, between ``start`` and ``end`` where given, and the attention mask for them."""
    import torch

    if not count or count % BATCH:
        return None
    block = ([start] if isinstance(start, int) else []) + [token] * (count // BATCH) + ([end] if isinstance(end, int) else [])
    ids = torch.cat([input_ids[:, :1], torch.tensor([block] * BATCH), input_ids[:, 1:]], dim=1)
    out = {"input_ids": ids}
    if "attention_mask" in _forward_parameters(model):
        out["attention_mask"] = torch.ones_like(ids)
    return out


def audio_inputs(model, config, input_ids, generator) -> dict[str, Any]:
    """Audio for an audio-language model (Voxtral, Qwen2-Audio): log-mel features of its encoder's
    length and as many audio tokens in the text as the model makes features of them. Nothing when
    the model does not say how many."""
    import torch

    token = next((getattr(config, k) for k in ("audio_token_id", "audio_token_index") if isinstance(getattr(config, k, None), int)), None)
    get = getattr(model, "get_audio_features", None)
    if get is None:
        return {}
    audio = config.audio_config
    bins = getattr(audio, "num_mel_bins", None) or 128
    positions = getattr(audio, "max_source_positions", None)
    frames = 2 * positions if isinstance(positions, int) else 64  # a Whisper-style encoder reads exactly this many
    features = torch.randn(BATCH, bins, frames, generator=generator)
    spec = getattr(audio, "spec_size", None)
    if isinstance(spec, int) and spec >= bins:
        # a Swin tower reading the log-mel as an image (CLAP): (batch, 1, frames, bins), as many frames as
        # its square input folds, so nothing is resized
        features = torch.randn(BATCH, 1, spec * (spec // bins), bins, generator=generator)
    try:
        with torch.no_grad():
            count = _count(get(input_features=features))
    except Exception:
        return {}
    if hasattr(model, "get_text_features"):  # a dual encoder (CLAP) embeds text and audio apart: the text as it is
        return {"input_features": features}
    if token is None:
        # no audio token: a streaming model adds each audio frame's embedding to its token's (Voxtral
        # Realtime), its text as long as the audio's frames
        if not count or count % BATCH:
            return {}
        ids = _token_ids(config, (BATCH, count // BATCH), generator)
        out = {"input_ids": ids, "input_features": features}
        if "attention_mask" in _forward_parameters(model):
            out["attention_mask"] = torch.ones_like(ids)
        return out
    text = _placeholders(model, input_ids, token, count or 0)
    return {**text, "input_features": features} if text else {}


def _count(out) -> int | None:
    """Token embeddings in what a ``get_*_features`` returns (rows of its pooled output)."""
    import torch

    if hasattr(out, "pooler_output") and out.pooler_output is not None:
        out = out.pooler_output
    elif hasattr(out, "last_hidden_state"):
        out = out.last_hidden_state
    parts = list(out) if isinstance(out, (list, tuple)) else [out]
    if not parts or not all(isinstance(p, torch.Tensor) for p in parts):
        return None
    return sum(p.numel() // p.shape[-1] for p in parts)


def image_inputs(model, config, input_ids, generator) -> dict[str, Any]:
    """Images for a vision-language model that takes ``pixel_values`` and marks images with an
    image token in its text: the pixels its processor would give, and the text rewritten to hold as
    many image tokens as the model makes features (between the vision start and end tokens where
    the config has them). Nothing when the model does not say how many (text only, as before)."""
    import torch

    token = _image_token(config)
    if token is None:
        return {}
    pixels = _pixel_inputs(model, config, generator)
    try:
        count = _feature_count(model, pixels)
    except Exception:
        tiles = pixels.get("pixel_values")
        if len(pixels) != 1 or getattr(tiles, "dim", lambda: 0)() != 4:
            return {}
        # images come (batch, tiles, channels, height, width) from a tiling processor (PerceptionLM's): one tile each
        pixels = {"pixel_values": tiles.unsqueeze(1)}
        try:
            count = _feature_count(model, pixels)
        except Exception:
            return {}
    start = getattr(config, "vision_start_token_id", None) or getattr(config, "image_start_token_id", None)
    end = getattr(config, "vision_end_token_id", None) or getattr(config, "image_end_token_id", None)
    text = _placeholders(model, input_ids, token, count or 0, start, end)
    if text is None:
        return {}
    out = {**text, **pixels}
    ids = text["input_ids"]
    parameters = _forward_parameters(model)
    if "mm_token_type_ids" in parameters:  # 1 marks image tokens for multimodal rotary positions
        out["mm_token_type_ids"] = (ids == token).to(torch.int32)
    return out


def config_for_class(config: Any, model_class) -> Any:
    """The part of ``config`` a class is built from: a text or vision tower of a composite model
    (``MllamaTextModel`` under ``mllama``) takes the sub-config of its ``config_class``."""
    wanted = getattr(model_class, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    pending = [config]
    while pending:
        part = pending.pop(0)
        for name in getattr(part, "sub_configs", {}) or {}:
            sub = getattr(part, name, None)
            if isinstance(sub, wanted):
                return sub
            if sub is not None and hasattr(sub, "sub_configs"):
                pending.append(sub)
    return config


class OverBudget(Exception):
    """A model over :data:`PARAMETER_BUDGET`: not built."""


def build(model_type: str, class_name: str):
    """(model, inputs, expected outputs as a list of tensors) with random weights, seed 0."""
    return build_with_tier(model_type, class_name)[:3]


def build_with_tier(model_type: str, class_name: str) -> tuple[Any, dict[str, Any], list, str]:
    """:func:`build`, and the tier of :data:`TIERS` it took: the first whose model runs on the
    inputs. When none does, the ``tiny`` tier's error is raised (the one the rules should fix)."""
    first: BaseException | None = None
    for tier in TIERS:
        try:
            return (*_build(model_type, class_name, tier), tier)
        except Exception as e:  # the next tier may build
            first = first or e
    assert first is not None
    raise first


def _parameter_count(model_class, config) -> int | None:
    """Parameters of ``model_class(config)`` counted on the meta device (None: it cannot be made there)."""
    import torch

    try:
        with torch.device("meta"):
            model = model_class._from_config(config)
    except Exception:  # made for real instead, under the child's memory limit
        return None
    return sum(p.numel() for p in model.parameters())


def _build(model_type: str, class_name: str, tier: str):
    import torch
    import transformers

    model_class = getattr(transformers, class_name)
    config = config_for_class(tiny_config(model_type, tier), model_class)
    if class_name.endswith("ForSequenceClassification"):  # batch 2 needs a padding token to find each row's last
        for part in (config, getattr(config, "text_config", None)):
            if part is not None and getattr(part, "pad_token_id", 0) is None:
                part.pad_token_id = 0
    if class_name.endswith("ForSequenceClassification") and getattr(config, "is_encoder_decoder", False):
        if getattr(config, "decoder_start_token_id", None) is None and isinstance(getattr(config, "pad_token_id", None), int):
            # the head shifts input_ids right to make the decoder's: T5's checkpoints start it with the padding id
            config.decoder_start_token_id = config.pad_token_id
    if class_name.endswith("WithLMHead") and getattr(config, "is_decoder", True) is False:
        config.is_decoder = True  # a language-model head predicts the next token: causal (Reformer asserts it)
    if class_name.endswith("EncoderModel") and getattr(config, "is_encoder_decoder", False) and getattr(config, "encoder", None) is not None:
        config.is_encoder_decoder = False  # the encoder of an encoder-decoder config, alone (T5Gemma refuses otherwise)
    qformer = getattr(config, "qformer_config", None)
    if class_name.endswith("ForImageTextRetrieval") and getattr(qformer, "use_qformer_text_input", None) is False:
        qformer.use_qformer_text_input = True  # the head reads its text through the Q-Former's text layers (BLIP-2's ITM checkpoint)
    if tier != "tiny":
        count = _parameter_count(model_class, config)
        if count is not None and count > PARAMETER_BUDGET:
            raise OverBudget(f"{tier} config: {count / 1e6:.0f}M parameters, over {PARAMETER_BUDGET / 1e6:.0f}M")
    torch.manual_seed(0)
    model = model_class._from_config(config).eval()
    _draw_constant_matrices(model)
    inputs = make_inputs(model, config)
    with torch.no_grad():
        try:
            expected = model(**inputs)
        except Exception as error:
            larger = _larger_image(model, inputs, error) or _backbone_image(model, config, inputs)
            if larger is not None:
                return model, *larger
            text = make_inputs(model, config, images=False)
            features = inputs.get("input_features")
            boxes = inputs.get("bbox")
            if boxes is not None and not boxes.is_floating_point():
                # document boxes come as integers within 0..1000 from LayoutLM's processor and as fractions
                # of the page from UDOP's
                try:
                    fractions = {**inputs, "bbox": boxes.float() / 1000}
                    return model, fractions, _tensors(model(**fractions))
                except Exception:  # not that either: what follows
                    pass
            patches = _patch_images(config, inputs)
            if patches is not None:
                # flattened patches come (patches, channels x patch x patch) from Qwen-VL's processor and
                # (patches, channels, patch, patch) from others (Kimi-K2.5's, embedded by a 2-D convolution)
                try:
                    return model, {**inputs, "pixel_values": patches}, _tensors(model(**{**inputs, "pixel_values": patches}))
                except Exception:  # not that either: what follows
                    pass
            if text.keys() == inputs.keys() and getattr(features, "dim", lambda: 0)() == 3:
                # log-mel features come (batch, bins, frames) from Whisper's extractor and (batch, frames,
                # bins) from others (Parakeet's): the other layout
                inputs = {**inputs, "input_features": features.transpose(1, 2).contiguous()}
                return model, inputs, _tensors(model(**inputs))
            if text.keys() == inputs.keys():
                raise
            # the images the sweep makes do not fit this model's processor: its text path, as before
            # (the row's `inputs` says which were fed)
            inputs, expected = text, model(**text)
    positions = _rope_positions(model, inputs) if layout_inputs(inputs) else None
    if positions is not None:
        inputs = {**inputs, "position_ids": positions}
        with torch.no_grad():
            expected = model(**inputs)
    return model, inputs, _tensors(expected)


#: Inputs that describe the example's layout (image grids, image sizes), not its data: the modular
#: export fixes them into the program (``export_modular(fixed_inputs=...)``), as a deployment at one
#: image resolution does. The towers split, index and interpolate by their values, which
#: torch.export cannot trace from an input (a data-dependent guard in either exporter).
LAYOUT_INPUTS = ("image_grid_thw", "video_grid_thw", "grid_thw", "image_sizes", "target_sizes", "merge_sizes")


def layout_inputs(inputs: dict[str, Any]) -> list[str]:
    """The tensors among ``inputs`` that :data:`LAYOUT_INPUTS` names."""
    return [name for name in LAYOUT_INPUTS if hasattr(inputs.get(name), "shape")]


def _rope_positions(model, inputs: dict[str, Any]):
    """The ``position_ids`` a model computes from its inputs' values when it is not given them
    (Qwen-VL's 3-D rope index, ``get_rope_index``: where each image's patches sit), as its
    deployments compute them beside the model from the processor's grid; ``None`` for a model
    that has no such index or does not take ``position_ids``."""
    import torch

    owner = next(
        (m for m in model.modules() if hasattr(m, "get_rope_index") or hasattr(m, "compute_3d_position_ids")), None
    )
    language = getattr(owner, "language_model", None)
    if language is None or "position_ids" not in _forward_parameters(model):
        return None
    seen: dict[str, Any] = {}

    def keep(module, args, kwargs):
        seen.setdefault("position_ids", kwargs.get("position_ids"))

    hook = language.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        hook.remove()
    return seen.get("position_ids")


def _draw_constant_matrices(model) -> list[str]:
    """Draw at random (normal, std 0.02, seeded) the parameters of two or more axes that the
    model's init leaves at one value, and name them. AFMoE's router gate starts at zero: every
    expert scores 0.5, top-k meets a tie, torch and onnxruntime break it differently, and
    parity would test the tie order instead of the computation. Vectors (norm weights, biases)
    keep their values; a checkpoint's weights are never constant."""
    import torch

    generator = torch.Generator().manual_seed(0)
    drawn = []
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2 and parameter.numel() > 1 and not parameter.is_meta:
                flat = parameter.reshape(-1)
                if bool((flat == flat[0]).all()):
                    parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float32).to(parameter.dtype) * 0.02)
                    drawn.append(name)
    return drawn


#: how many times wider and taller than the config's (or the sweep's 32 pixels) an image may grow
#: for a model whose pooling or windows need more pixels
_IMAGE_GROWTH = 8
#: what torch and transformers say when an image is too small for a model's pooling, tiling or padding
_SMALL_IMAGE = ("too small", "Padding size should be less than the corresponding input dimension")


def _says_too_small(error: BaseException) -> bool:
    return any(phrase in str(error) for phrase in _SMALL_IMAGE)


def _larger_image(model, inputs: dict[str, Any], error: BaseException) -> tuple[dict[str, Any], list] | None:
    """(inputs, expected outputs) with the image twice, four or eight times as tall and wide, when
    the model says its image is too small: a text recognizer pools rows its backbone has already
    halved five times (PP-OCR reads 48 x 320 lines), a depth model's patches need more pixels, a
    dewarper reflects-pads maps its backbone made small (UVDoc). None
    when the error is not about the image's size or no larger image runs either."""
    import torch

    pixels = inputs.get("pixel_values")
    if not isinstance(pixels, torch.Tensor) or pixels.dim() != 4 or not _says_too_small(error):
        return None
    generator = torch.Generator().manual_seed(0)
    height, width = pixels.shape[-2:]
    scale = 2
    while scale <= _IMAGE_GROWTH:
        larger = {**inputs, "pixel_values": torch.randn(*pixels.shape[:2], height * scale, width * scale, generator=generator)}
        try:
            return larger, _tensors(model(**larger))
        except Exception as e:
            if not _says_too_small(e):
                return None
        scale *= 2
    return None


def _backbone_image(model, config, inputs: dict[str, Any]) -> tuple[dict[str, Any], list] | None:
    """(inputs, expected outputs) with an image of the size the backbone config gives, for a model
    without an image size of its own that does not run on the sweep's (ViTPose's backbone embeds a
    fixed 256 x 192 grid; SAM 2's, under its vision config, the image its feature maps are sized
    for); None when there is no other size or the model does not run on it either."""
    import torch

    pixels = inputs.get("pixel_values")
    backbone = getattr(config, "backbone_config", None) or getattr(getattr(config, "vision_config", None), "backbone_config", None)
    if not isinstance(pixels, torch.Tensor) or pixels.dim() != 4 or getattr(backbone, "image_size", None) is None:
        return None
    size = _image_size(backbone)
    if size == tuple(pixels.shape[-2:]):
        return None
    other = {**inputs, "pixel_values": torch.randn(*pixels.shape[:2], *size, generator=torch.Generator().manual_seed(0))}
    try:
        return other, _tensors(model(**other))
    except Exception:
        return None


def _patch_images(config, inputs: dict[str, Any]):
    """Grid patches (``pixel_values`` of (patches, channels x patch x patch) beside a ``grid_thw``)
    as a batch of one-patch images, (patches, channels, patch, patch); None for other inputs."""
    pixels = inputs.get("pixel_values")
    if getattr(pixels, "dim", lambda: 0)() != 2 or not ({"grid_thw", "image_grid_thw"} & set(inputs)):
        return None
    vision = getattr(config, "vision_config", None) or config
    patch = getattr(vision, "patch_size", None)
    if not isinstance(patch, int) or pixels.shape[1] % (patch * patch):
        return None
    return pixels.reshape(pixels.shape[0], -1, patch, patch).contiguous()


#: PyTorch's outputs all within this of 0 (float32's atol): a parity pass on them says nothing.
NEAR_ZERO = 1e-4


def reference_max_abs(expected: list) -> float | None:
    """The largest magnitude of the floating-point reference outputs (``None``: none is floating)."""
    values = [float(t.detach().abs().max()) for t in expected if t.is_floating_point() and t.numel()]
    return max(values) if values else None


def with_signal(model, inputs: dict[str, Any], expected: list) -> tuple[list, bool]:
    """``(expected, jittered)``: when PyTorch's outputs are all within :data:`NEAR_ZERO` of 0 (a
    random-weight head whose weights start at 0), every floating parameter gets seeded noise
    (std 0.02, as transformers' init) and the reference is computed again; the same in both
    children, so flat and modular compare the same model."""
    import torch

    magnitude = reference_max_abs(expected)
    if magnitude is None or magnitude > NEAR_ZERO:
        return expected, False
    _jitter(model)
    with torch.no_grad():
        return _tensors(model(**inputs)), True


def _jitter(model) -> None:
    """Seeded noise (std 0.02, as transformers' init) on every floating parameter, in name order."""
    import torch

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters(), key=lambda item: item[0]):
            if parameter.is_floating_point():
                parameter.add_(torch.randn(parameter.shape, generator=generator).to(parameter.dtype) * 0.02)


def _unit_batch_norms(model) -> int:
    """Every batch norm's scale at 1 (PyTorch's own init; transformers draws some, RT-DETR's among
    them, from N(0, 0.02), and a dozen such layers in a row take the features to ~1e-17). The
    number of layers set."""
    import torch

    count = 0
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if "BatchNorm" in type(module).__name__ and isinstance(weight, torch.Tensor) and weight.is_floating_point():
                weight.fill_(1.0)
                count += 1
    return count


def _watched(model, inputs: dict[str, Any]) -> tuple[list, list]:
    """``(outputs, ties)``: the model's outputs, and each ``torch.topk`` whose input ties (check/ties.py)."""
    import torch

    from onnx_modular.check.ties import TieWatch

    with TieWatch() as watch, torch.no_grad():
        outputs = _tensors(model(**inputs))
    return outputs, watch.ties


def without_ties(model, inputs: dict[str, Any], expected: list) -> tuple[list, bool, str | None]:
    """``(expected, changed, ties)``: when PyTorch's reference selects with ``torch.topk`` among
    equal values (random weights whose features vanish: every query's score is the bias), torch's
    kernel and ONNX's TopK pick different elements among the ties, both rightly, and the outputs
    differ by whole units: a parity check on them says nothing. The weights are then made to
    give distinct scores, seeded (the same in both children): jittered as :func:`with_signal`
    does, then, if ties remain, every batch norm's scale at 1 as well. ``ties`` says what was
    found and done (``None``: no tie; it ends in "remain" when neither broke them)."""
    outputs, ties = _watched(model, inputs)
    if not ties:
        return expected, False, None
    found = "; ".join(str(tie) for tie in ties[:3]) + ("; ..." if len(ties) > 3 else "")
    _jitter(model)
    outputs, left = _watched(model, inputs)
    if not left:
        return outputs, True, f"torch.topk on ties ({found}): broken by jittered weights"
    norms = _unit_batch_norms(model)
    outputs, left = _watched(model, inputs) if norms else (outputs, left)
    if not left:
        return outputs, True, f"torch.topk on ties ({found}): broken by jittered weights and {norms} batch norm scales at 1"
    rest = "; ".join(str(tie) for tie in left[:3])
    return outputs, True, f"torch.topk on ties ({found}): {TIES_REMAIN} ({rest})"


#: How :func:`without_ties` ends when no re-draw of the weights broke the ties.
TIES_REMAIN = "ties remain after jittered weights and batch norm scales at 1"


def reference(model, inputs: dict[str, Any], expected: list, record: dict[str, Any]) -> tuple[list, bool]:
    """PyTorch's reference as both children compare it (:func:`with_signal`, :func:`without_ties`),
    recorded (:func:`_signal_record`); ``(expected, False)`` when a parity check on it says nothing."""
    expected, jittered = with_signal(model, inputs, expected)
    expected, redrawn, ties = without_ties(model, inputs, expected)
    if ties:
        record["ties"] = ties
    return expected, _signal_record(record, expected, jittered or redrawn)


def _signal_record(record: dict[str, Any], expected: list, jittered: bool) -> bool:
    """Record the reference's magnitude; ``False`` (and the row's error) when it is still ~0."""
    record["reference_max_abs"] = reference_max_abs(expected)
    if jittered:
        record["jittered"] = True
    if record["reference_max_abs"] is not None and record["reference_max_abs"] <= NEAR_ZERO:
        record.update(ok=False, stage="reference", error=f"PyTorch's outputs are all within {NEAR_ZERO:g} of 0, jittered "
                      "weights too: a parity check on them says nothing")
        return False
    return True


def _tensors(output) -> list:
    import torch

    leaves = torch.utils._pytree.tree_leaves(output.to_tuple() if hasattr(output, "to_tuple") else output)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _depth(call, level: int = 0) -> int:
    return max([level] + [_depth(child, level + 1) for child in call.children])


# -- one exporter in a child ---------------------------------------------------------------


def _job_modular(model_type: str, class_name: str, folder: str | None = None) -> dict[str, Any]:
    from onnx_modular import export_modular

    record: dict[str, Any] = {}
    start = time.perf_counter()
    model, inputs, expected, tier = build_with_tier(model_type, class_name)
    record.update(built=True, config=tier)
    expected, informative = reference(model, inputs, expected, record)
    record["build_seconds"] = time.perf_counter() - start
    record["inputs"] = input_names(inputs)
    if not informative:
        return record
    fixed = layout_inputs(inputs)
    if fixed:
        record["fixed"] = ",".join(fixed)
    try:
        result = export_modular(model, (), kwargs=inputs, fixed_inputs=fixed)
    except Exception as e:
        error = _first_line(e)
        if getattr(getattr(e, "report", None), "captured_differently", False):
            error += f" ({_CAPTURED_SO})"
        elif getattr(getattr(e, "report", None), "ties", None):
            error += f" ({_TIED_SO})"
        record.update(ok=False, stage=getattr(e, "stage", "export"), error=error, report=_report_of(e))
        return record
    record.update(
        ok=result.report.ok,
        functions=len(result.model.functions),
        depth=_depth(result.hierarchy.root),
        max_abs=_max_abs(result.report),
    )
    if folder and record["ok"]:  # the file and inputs of the tools phase (sweep_tools)
        result.save(pathlib.Path(folder) / sweep_tools.MODULAR)
        sweep_tools.save_inputs(pathlib.Path(folder), inputs)
    return record


def input_names(inputs: dict[str, Any]) -> str:
    """The tensor inputs fed, comma-separated (which modalities a row was tested with)."""
    return ",".join(name for name, value in inputs.items() if hasattr(value, "shape"))


def _report_of(error) -> float | None:
    report = getattr(error, "report", None)
    return _max_abs(report) if report is not None else None


def _max_abs(report) -> float | None:
    values = [o.modular_max_abs for o in report.outputs if getattr(o, "modular_max_abs", None) is not None]
    return max(values) if values else None


def _job_flat(model_type: str, class_name: str, folder: str | None = None) -> dict[str, Any]:
    import numpy as np
    import torch

    record: dict[str, Any] = {}
    start = time.perf_counter()
    model, inputs, expected, tier = build_with_tier(model_type, class_name)
    record.update(built=True, config=tier)
    expected, informative = reference(model, inputs, expected, record)
    record["build_seconds"] = time.perf_counter() - start
    record["inputs"] = input_names(inputs)
    if not informative:
        return record
    from onnx_modular.capture import torch_export

    try:
        with torch_export.partial_graphs_logged():  # torch.export's partial graph of a failure: not on stderr
            program = torch.onnx.export(model, (), kwargs=inputs, dynamo=True, verbose=False)
    except Exception as e:
        record.update(ok=False, stage="export", error=_first_line(e))
        return record
    try:
        outputs = program(**{k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)})  # constants are in the graph
    except Exception as e:
        record.update(ok=False, stage="run", error=_first_line(e))
        return record
    if len(outputs) != len(expected):
        record.update(ok=False, stage="verify", error=f"{len(outputs)} outputs, PyTorch has {len(expected)}")
        return record
    worst, ok = 0.0, True
    for got, want in zip(outputs, expected):
        got, want = np.asarray(got.detach().numpy(), np.float64), np.asarray(want.detach().numpy(), np.float64)
        if got.shape != want.shape:
            ok = False
            record["error"] = f"shape {list(got.shape)} != {list(want.shape)}"
            continue
        if got.size:
            worst = max(worst, float(np.max(np.abs(got - want))))
            ok = ok and bool(np.allclose(got, want, rtol=1e-3, atol=1e-4))  # onnx_modular's float32 default
    record.update(ok=ok, max_abs=worst)
    if folder and ok:  # modularize's input in the tools phase; weights beside it (inline, Perceiver's passed 2 GB)
        program.save(str(pathlib.Path(folder) / sweep_tools.FLAT), external_data=True)
    if not ok:
        record.setdefault("stage", "verify")
        record.setdefault("error", f"max abs difference {worst:.3g}")
    return record


def _first_line(error: BaseException) -> str:
    """The error's first line; for torch.onnx's errors, the first line of its exception summary."""
    text = str(error).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[0] if lines else ""
    if "## Exception summary" in lines:
        line = lines[lines.index("## Exception summary") + 1] if lines.index("## Exception summary") + 1 < len(lines) else line
    elif lines and line.startswith("[") and "]" in line and len(lines) > 1 and len(line) < 60:
        line = " ".join(lines[:2])
    return f"{type(error).__name__}: {line[:300]}"


def _job_tool(model_type: str, class_name: str, tool: str, folder: str) -> dict[str, Any]:
    return sweep_tools.run_tool(tool, folder)


_JOBS = {"flat": _job_flat, "modular": _job_modular, "tool": _job_tool}


def _child(kind: str, model_type: str, class_name: str, memory_bytes: int, connection, extra: tuple = ()) -> None:
    os.nice(0)
    try:
        if memory_bytes:
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, hard))
        warnings.simplefilter("ignore")
        import logging

        logging.disable(logging.WARNING)
        record = _JOBS[kind](model_type, class_name, *extra)
    except MemoryError:
        record = {"ok": False, "stage": "memory", "error": "MemoryError: over the memory limit"}
    except BaseException as e:
        record = {"ok": False, "stage": "build", "error": _first_line(e), "trace": traceback.format_exc()[-2000:]}
    try:
        connection.send(record)
    finally:
        connection.close()


def run_child(kind: str, model_type: str, class_name: str, timeout: float, memory_gb: float, *extra) -> dict[str, Any]:
    """One exporter (or one file tool, ``kind="tool"``) on one architecture in a forked child,
    bounded in time and address space; ``extra``: more arguments of the job."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    memory = int(memory_gb * 2**30) + _address_space() if memory_gb else 0
    start = time.perf_counter()
    process = context.Process(target=_child, args=(kind, model_type, class_name, memory, send, extra), daemon=True)
    process.start()
    send.close()
    record = None
    if receive.poll(timeout):
        try:
            record = receive.recv()
        except EOFError:
            record = None
    process.join(5)
    if process.is_alive():
        process.kill()
        process.join()
    if record is None:
        if time.perf_counter() - start >= timeout:
            record = {"ok": False, "stage": "timeout", "error": f"over {timeout:.0f} s"}
        else:
            record = {"ok": False, "stage": "crash", "error": f"child exited with code {process.exitcode}"}
    record["seconds"] = round(time.perf_counter() - start, 1)
    return record


def _address_space() -> int:
    """This process's virtual size (torch maps several GB before any work): the limit adds to it."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


# -- the list of architectures -----------------------------------------------------------


def architectures(heads: bool = True) -> list[tuple[str, str, str]]:
    """``(model_type, class name, task)`` for every model type: base models first, then heads."""
    import transformers
    from transformers.models.auto import configuration_auto, modeling_auto

    rows = []
    types = sorted(configuration_auto.CONFIG_MAPPING_NAMES)
    for model_type in types:
        name = modeling_auto.MODEL_MAPPING_NAMES.get(model_type)
        for class_name in _names(name):
            if hasattr(transformers, class_name):
                rows.append((model_type, class_name, "base"))
    if heads:
        mappings = sorted(n for n in dir(modeling_auto) if n.startswith("MODEL_FOR_") and n.endswith("_MAPPING_NAMES"))
        seen = {(row[0], row[1]) for row in rows}  # one row per (model type, class)
        for model_type in types:
            for mapping in mappings:
                task = mapping[len("MODEL_FOR_") : -len("_MAPPING_NAMES")].lower().replace("_", "-")
                for class_name in _names(getattr(modeling_auto, mapping).get(model_type)):
                    if (model_type, class_name) not in seen and hasattr(transformers, class_name):
                        seen.add((model_type, class_name))
                        rows.append((model_type, class_name, task))
    return rows


def _names(value) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else [v for v in value if isinstance(v, str)]


# -- the report ----------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    model_type: str
    class_name: str
    task: str
    built: bool = False
    flat_ok: bool = False
    modular_ok: bool = False
    functions: int | None = None
    depth: int | None = None
    max_abs: float | None = None
    flat_max_abs: float | None = None
    flat_stage: str | None = None
    flat_error: str | None = None
    stage: str | None = None
    error: str | None = None
    seconds: float = 0.0
    inputs: str | None = None  # the tensor inputs fed (input_ids,pixel_values,image_grid_thw: text and images)
    note: str | None = None  # why a row fails where both exporters fail: a torch limit, a missing package
    config: str | None = None  # how far the config was shrunk (TIERS): tiny, shallow or default
    commit: str | None = None  # the commit the row was swept on (a table resumed across commits mixes them)
    fixed: str | None = None  # the inputs the modular export fixed into the program (LAYOUT_INPUTS)
    reference_max_abs: float | None = None  # the largest |PyTorch output| compared (a pass on ~0 outputs says nothing)
    jittered: bool = False  # the weights got seeded noise: PyTorch's outputs were all ~0 (with_signal) or tied (without_ties)
    ties: str | None = None  # torch.topk picked among equal values in PyTorch's reference: what the sweep did (without_ties)
    tools: dict[str, str] | None = None  # modular-ok rows: each file tool's status (sweep_tools; None: not run)

    @property
    def key(self) -> tuple[str, str]:
        """A row is one (model type, class): a class serves several model types (LlamaModel)."""
        return (self.model_type, self.class_name)


def sweep_one(model_type: str, class_name: str, task: str, timeout: float, memory_gb: float, tools: bool = True) -> Row:
    """One row: torch's flat export, ours, then (``tools``, a modular-ok row) every file tool on
    the files they wrote, each tool in a child of its own (``sweep_tools``)."""
    with tempfile.TemporaryDirectory(prefix="sweep-tools-") as scratch:
        folder = (scratch,) if tools else ()
        flat = run_child("flat", model_type, class_name, timeout, memory_gb, *folder)
        if flat.get("stage") == "build":  # the same build would fail the same way: not run twice
            modular = dict(flat, seconds=0.0)
        else:
            modular = run_child("modular", model_type, class_name, timeout, memory_gb, *folder)
        row = row_of(model_type, class_name, task, flat, modular)
        if tools and row.modular_ok and (pathlib.Path(scratch) / sweep_tools.MODULAR).exists():
            row.tools = {}
            for tool in sweep_tools.TOOLS:
                record = run_child("tool", model_type, class_name, timeout, memory_gb, tool, scratch)
                row.tools[tool] = record.get("status") or f"{record.get('stage')}: {record.get('error')}"
    return row


def row_of(model_type: str, class_name: str, task: str, flat: dict[str, Any], modular: dict[str, Any]) -> Row:
    """The row of one (model type, class) from its two children's records."""
    row = Row(model_type, class_name, task)
    row.built = bool(flat.get("built") or modular.get("built"))
    row.flat_ok = bool(flat.get("ok"))
    row.flat_max_abs = flat.get("max_abs")
    if not row.flat_ok:
        row.flat_stage, row.flat_error = flat.get("stage"), flat.get("error")
    row.modular_ok = bool(modular.get("ok"))
    row.functions, row.depth = modular.get("functions"), modular.get("depth")
    row.max_abs = modular["max_abs"] if modular.get("max_abs") is not None else modular.get("report")  # an exact 0 stays 0
    row.reference_max_abs = modular.get("reference_max_abs", flat.get("reference_max_abs"))
    row.jittered = bool(modular.get("jittered") or flat.get("jittered"))
    row.ties = modular.get("ties") or flat.get("ties")
    if not row.modular_ok:
        row.stage, row.error = modular.get("stage"), modular.get("error")
    row.seconds = round(flat.get("seconds", 0) + modular.get("seconds", 0), 1)
    row.inputs = modular.get("inputs") or flat.get("inputs")
    row.fixed = modular.get("fixed")
    row.config = modular.get("config") or flat.get("config")
    row.note = classify(row)
    return row


#: What a modular row's error adds when torch.export's program is itself as far from PyTorch.
_CAPTURED_SO = "the captured program differs as much in PyTorch"

#: What a modular row's error adds when PyTorch's reference picks among ties (check/ties.py).
_TIED_SO = "torch.topk picks among equal values; with ties broken as ONNX's TopK does, PyTorch equals the file"

#: (what the error says, the note): why neither exporter, or no build, gets through
_NOTES = (
    ((_TIED_SO, TIES_REMAIN),
     "PyTorch's reference selects among equal values (torch.topk on ties: random weights whose scores are all "
     "the bias): torch's kernel leaves the order of tied elements unspecified, ONNX's TopK takes the lowest index "
     "first, so both files pick other elements than PyTorch and differ by whole units; not an export error "
     "(with ties broken the ONNX way PyTorch equals the file: check/ties.py)"),
    ((_CAPTURED_SO,),
     "the model's own limit: the program torch.export captures differs from eager PyTorch as much (a path only "
     "tracing takes, such as a mask built only when traced); both files compute what was captured"),
    (("requires the timm library", "requires the PIL library", "TimmWrapper", "TimmBackbone"),
     "needs timm, which needs torchvision: no torchvision wheel imports beside the CPU torch 2.13 here (a hard limit of this environment)"),
    (("requires the detectron2 library", "requires the natten library", "requires the torchaudio library"),
     "needs a package not installable here (detectron2, natten or torchaudio)"),
    (("GuardOnDataDependentSymNode", "data-dependent", "Could not guard on data-dependent", "Could not extract specialized integer",
      "unbacked", "u0", "_is_all_true"),
     "torch limit: a data-dependent guard (control flow or a shape on input values) that torch.export cannot trace"),
    (("No ONNX function found", "DispatchError", "no decomposition", "not implemented for", "Unsupported FX nodes"),
     "torch limit: an operator torch's ONNX translation has no function or decomposition for"),
    (("complex", "Complex"), "torch limit: complex tensors, which the ONNX translation does not take"),
)
#: both files run and differ from PyTorch alike: not an export failure (flat's error is a max difference)
_BOTH_DIFFER = "both files run and differ from PyTorch beyond the tolerance (no export failure)"


def classify(row: Row) -> str | None:
    """A short note for a row that fails where both exporters fail, or that cannot be built,
    when the error names a known cause (a torch limit, a package missing here); else None."""
    if row.modular_ok or row.flat_ok:
        return None
    text = " ".join(filter(None, (row.error, row.flat_error, row.ties)))
    for needles, note in _NOTES:
        if any(needle in text for needle in needles):
            return note
    if row.stage == "verify" and row.flat_stage == "verify":
        return _BOTH_DIFFER
    return _stage_note(row)


def _stage_note(row: Row) -> str:
    """Where no known cause is named: what the two failures are, by stage (every row both
    exporters fail has a note)."""
    if row.stage == "build":
        return ("not built: the sweep's config and input rules do not make a model of this class that runs "
                "in PyTorch (a limit of the harness, not of either exporter)")
    if row.stage == "timeout":
        return "over the sweep's time budget per exporter (timeout): no result either way"
    if row.stage == "capture" and row.flat_stage == "export":
        return "torch.export fails on the model's own code for both exporters (the same capture error)"
    if row.stage == "input":
        return "forward returns values that are not tensors (ints): not ONNX outputs; torch's exporter fails on them too"
    if row.stage == "verify" and row.flat_stage in ("export", "run"):
        return (f"torch's flat export fails ({row.flat_stage}); the modular file exports but differs from PyTorch "
                "beyond the tolerance: to investigate")
    return f"both fail: modular at {row.stage or '?'}, flat at {row.flat_stage or '?'} (the errors say why)"


def _environment() -> dict[str, str]:
    import onnxruntime
    import onnxscript
    import torch
    import transformers

    commit = os.environ.get("SWEEP_COMMIT", "")  # a sweep run from an exported snapshot of a commit
    if not commit:
        try:
            git = ["git", "rev-parse", "--short", "HEAD"]
            commit = subprocess.run(git, cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip() or "?"
        except OSError:
            commit = "?"
    return {
        "commit": commit,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnxscript": onnxscript.__version__,
        "onnxruntime": onnxruntime.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def totals(rows: list[Row]) -> dict[str, int]:
    return {
        "tried": len(rows),
        "built": sum(r.built for r in rows),
        "flat_ok": sum(r.flat_ok for r in rows),
        "modular_ok": sum(r.modular_ok for r in rows),
        "both_ok": sum(r.flat_ok and r.modular_ok for r in rows),
        "flat_only": sum(r.flat_ok and not r.modular_ok for r in rows),
        "modular_only": sum(r.modular_ok and not r.flat_ok for r in rows),
    }


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.2g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _jitter_cell(row: Row) -> str:
    """What the reference cell adds when the weights were re-drawn: jittered, and why when for ties."""
    if not row.jittered:
        return ""
    return " (jittered: top-k ties)" if row.ties else " (jittered)"


def write_markdown(path: pathlib.Path, rows: list[Row], environment: dict[str, str], planned: int, notes: str = "") -> None:
    t = totals(rows)
    lines = [
        "# Coverage: transformers architectures",
        "",
        f"Generated by `scripts/sweep_transformers.py` on commit {environment['commit']}, torch {environment['torch']}, "
        f"transformers {environment['transformers']}, onnxscript {environment['onnxscript']}, onnxruntime "
        f"{environment['onnxruntime']} ({environment['date']}). Tiny configs from the defaults, random weights, "
        "batch 2; flat = `torch.onnx.export(dynamo=True)` then onnxruntime vs PyTorch, modular = `export_modular` "
        "(its own parity check, modular and inlined copy); both with atol 1e-4 / rtol 1e-3.",
        "",
        "## Totals",
        "",
        "| tried | of planned | built | flat ok | modular ok | both | flat only | modular only |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {t['tried']} | {planned} | {t['built']} | {t['flat_ok']} | {t['modular_ok']} | {t['both_ok']} | {t['flat_only']} | {t['modular_only']} |",
        "",
    ]
    lines += sweep_tools.markdown(rows)
    if notes:
        lines += [notes.strip(), ""]
    flat_only = [r for r in rows if r.flat_ok and not r.modular_ok]
    lines += ["## Flat exports, modular does not", ""]
    lines += [f"- `{r.class_name}` ({r.model_type}): {r.stage}: {_cell(r.error)}" for r in flat_only] or ["None."]
    lines += [
        "",
        "## Every architecture",
        "",
        "| model type | class | task | built | flat | modular | functions | depth | max abs (modular) | max abs (flat) | max \\|PyTorch output\\| | failing stage | first error line | inputs | config | note | tools | s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        stage = r.stage or (f"flat: {r.flat_stage}" if r.flat_stage else "")
        error = r.error or r.flat_error
        lines.append(
            f"| {r.model_type} | {r.class_name} | {r.task} | {_cell(r.built)} | {_cell(r.flat_ok)} | {_cell(r.modular_ok)} | "
            f"{_cell(r.functions)} | {_cell(r.depth)} | {_cell(r.max_abs)} | {_cell(r.flat_max_abs)} | "
            f"{_cell(r.reference_max_abs)}{_jitter_cell(r)} | {_cell(stage)} | "
            f"{_cell((error or '')[:160])} | {_cell(r.inputs)}{f' (fixed: {r.fixed})' if r.fixed else ''} | {_cell(r.config)} | {_cell(r.note or classify(r))} | "
            f"{_cell(sweep_tools.cell(r.tools)[:200])} | {r.seconds:.0f} |"
        )
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


def write_json(path: pathlib.Path, rows: list[Row], environment: dict[str, str], planned: int, notes: str = "") -> None:
    data = {"environment": environment, "planned": planned, "totals": totals(rows), "tools": sweep_tools.tool_totals(rows),
            "notes": notes, "rows": [dataclasses.asdict(r) for r in rows]}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def read_rows(path: pathlib.Path) -> list[Row]:
    """The rows of a JSON report; a row swept before notes existed gets its note now."""
    data = json.loads(path.read_text())
    rows = [Row(**row) for row in data["rows"]]
    for row in rows:
        row.note = row.note or classify(row)
    return rows


def unique_rows(rows: list[Row]) -> list[Row]:
    """One row per (model type, class): of rows with one key (a table written when rows were
    keyed by class, whose copies took a sibling's model type), the first is kept."""
    seen: set[tuple[str, str]] = set()
    kept = []
    for row in rows:
        if row.key not in seen:
            seen.add(row.key)
            kept.append(row)
    return kept


def regressions(old: list[Row], new: list[Row]) -> list[str]:
    """What worked in ``old`` and does not in ``new`` (built, flat, modular), by class."""
    before = {r.key: r for r in old}
    found = []
    for r in new:
        o = before.get(r.key)
        if o is None:
            continue
        for field, label in (("built", "built"), ("flat_ok", "flat"), ("modular_ok", "modular")):
            if getattr(o, field) and not getattr(r, field):
                detail = r.error if field != "flat_ok" else r.flat_error
                found.append(f"{r.class_name} ({r.model_type}): {label} regressed: {detail or ''}".strip())
    return found


#: inputs that are text (or its masks and positions): a row fed only these was fed no image, audio or video
_TEXT_INPUTS = frozenset({
    "input_ids", "attention_mask", "token_type_ids", "position_ids", "decoder_input_ids", "decoder_attention_mask",
    "inputs_embeds",
})


def differing(kept: list[Row], other: list[Row]) -> list[str]:
    """The keys (model type, class) of ``kept`` whose row differs from the same row of ``other`` (another torch's
    run on the current commit): in outcome (built, flat, modular) or in the inputs fed or fixed. A kept row
    with no inputs recorded (swept before the column) differs when the other was fed more than
    text. What is not in ``other`` is left alone."""
    others = {r.key: r for r in other}
    found = []
    for row in kept:
        o = others.get(row.key)
        if o is None:
            continue
        fed = set(filter(None, (o.inputs or "").split(",")))
        if (row.built, row.flat_ok, row.modular_ok) != (o.built, o.flat_ok, o.modular_ok):
            found.append(row.key)
        elif row.inputs is None and fed - _TEXT_INPUTS or row.inputs is not None and set(row.inputs.split(",")) != fed:
            found.append(row.key)
        elif (row.fixed or None) != (o.fixed or None):  # fixed into the program on one run only
            found.append(row.key)
    return found


def _warm_up() -> None:
    """Pay once, in this process before it forks, what every child would pay again: torchlib's
    import and the translation registry (10-12 s), transformers' model machinery (the first model
    built, 8 s), the installed distributions that tag each function's package, and the first
    call of ``torch.export`` and of both exporters (4 s): about 20 s of a typical row's 40.

    With one thread, so that this process never starts OpenMP's pool (not fork-safe), and
    without onnxruntime (``verify=False``, no flat copy checked): the children start clean."""
    import torch
    import transformers  # noqa: F401

    from onnx_modular import export_modular
    from onnx_modular.capture import fx_call_tree, torch_compat

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch_compat.registry()
        for package in ("torch", "transformers"):
            fx_call_tree.package_of(package)
        model, inputs, _, _ = build_with_tier("bert", "BertModel")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            export_modular(model, (), kwargs=inputs, verify=False)
            torch.onnx.export(model, (), kwargs=inputs, dynamo=True, verbose=False)
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", help="comma-separated model types (default: every type)")
    parser.add_argument("--sample", action="store_true", help="the sample of the default test suite")
    parser.add_argument("--heads", action="store_true", help="also task heads (default with no --types/--sample)")
    parser.add_argument("--no-heads", action="store_true", help="base models only")
    parser.add_argument("--limit", type=int, help="at most this many architectures")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per exporter and architecture")
    parser.add_argument("--memory-gb", type=float, default=6, help="address space per child beyond the parent's")
    parser.add_argument("--output", default=str(ROOT / "docs" / "coverage.md"))
    parser.add_argument("--json", help="default: the output with .json")
    parser.add_argument("--compare", help="an older JSON: list regressions")
    parser.add_argument("--resume", action="store_true", help="keep the rows already in the JSON, sweep the rest")
    parser.add_argument("--redo", help="with --resume: sweep again the kept rows whose modular stage is one of these "
                        "(comma-separated, e.g. capture,verify; 'failed' for every row not modular ok)")
    parser.add_argument("--redo-types", help="with --resume: sweep again the kept rows of these model types (comma-separated)")
    parser.add_argument("--redo-classes", help="with --resume: sweep again the kept rows of these classes (comma-separated)")
    parser.add_argument("--redo-differing", help="with --resume: sweep again the kept rows whose outcome or inputs differ from "
                        "the same row of this JSON (another torch's run on the current commit)")
    parser.add_argument("--no-tools", action="store_true", help="skip the tools phase (every file tool on a modular-ok row's files)")
    parser.add_argument("--redo-untooled", type=int, metavar="N",
                        help="with --resume: sweep again N kept modular-ok rows the tools phase has not run on "
                        "(a seeded random sample across model types)")
    parser.add_argument("--jobs", type=int, default=1, help="architectures swept at once (each in its own children)")
    parser.add_argument("--order", choices=("shuffled", "alphabetical"), default="shuffled",
                        help="shuffled (default): the sample, then base models, then heads, each in a fixed random order")
    parser.add_argument("--notes", default="", help="text put under the totals")
    parser.add_argument("--render", help="only write the Markdown from this JSON (with --notes), no sweep")
    args = parser.parse_args(argv)
    if args.render:
        data = json.loads(pathlib.Path(args.render).read_text())
        rows = read_rows(pathlib.Path(args.render))
        write_markdown(pathlib.Path(args.output), rows, data["environment"], data["planned"], args.notes or data.get("notes", ""))
        return 0

    _warm_up()

    output = pathlib.Path(args.output)
    json_path = pathlib.Path(args.json) if args.json else output.with_suffix(".json")
    heads = not args.no_heads and (args.heads or not (args.types or args.sample))
    # a resumed sweep of some types keeps the whole catalogue's planned count and the notes of the table
    previous = json.loads(json_path.read_text()) if args.resume and json_path.exists() else {}
    notes = args.notes or previous.get("notes", "")
    planned = architectures(heads=heads)
    if args.sample or args.types:
        wanted = list(SAMPLE) if args.sample else args.types.split(",")
        planned = [row for row in planned if row[0] in wanted]
    elif args.order == "shuffled":  # the sample first, then the rest in a fixed random order:
        import random  # a sweep cut short by its time budget still covers every kind of model

        rest = [row for row in planned if row[0] not in SAMPLE or row[2] != "base"]
        random.Random(0).shuffle(rest)
        base = [row for row in rest if row[2] == "base"]
        planned = [row for row in planned if row[0] in SAMPLE and row[2] == "base"] + base + [r for r in rest if r[2] != "base"]
    if args.limit:
        planned = planned[: args.limit]
    rows: list[Row] = read_rows(json_path) if args.resume and json_path.exists() else []
    every = list(rows)  # a row swept again stays until its new row replaces it: a sweep cut short loses none
    if args.redo:
        stages = set(args.redo.split(","))
        rows = [r for r in rows if not ("failed" in stages and not r.modular_ok or r.stage in stages)]
    if args.redo_types:
        again = set(args.redo_types.split(","))
        rows = [r for r in rows if r.model_type not in again]
    if args.redo_classes:  # a class (every model type it serves) or model_type/class
        again = set(args.redo_classes.split(","))
        rows = [r for r in rows if r.class_name not in again and f"{r.model_type}/{r.class_name}" not in again]
    if args.redo_untooled:
        import random

        untooled = [r.key for r in rows if r.modular_ok and not r.tools]
        again = set(random.Random(51).sample(untooled, min(args.redo_untooled, len(untooled))))
        print(f"{len(again)} of {len(untooled)} modular-ok rows without tools: swept again", flush=True)
        rows = [r for r in rows if r.key not in again]
    if args.redo_differing:
        again = set(differing(rows, read_rows(pathlib.Path(args.redo_differing))))
        print(f"{len(again)} rows differ from {args.redo_differing}: swept again", flush=True)
        rows = [r for r in rows if r.key not in again]
    done = {r.key for r in unique_rows(rows)}
    rows = unique_rows(every)
    environment = _environment()
    todo = [row for row in planned if (row[0], row[1]) not in done]
    if args.redo_classes:  # in the order given: the most wanted first
        wanted_order = {name: i for i, name in enumerate(args.redo_classes.split(","))}
        todo.sort(key=lambda row: min(wanted_order.get(row[1], len(wanted_order)),
                                      wanted_order.get(f"{row[0]}/{row[1]}", len(wanted_order))))
    order = {(row[0], row[1]): i for i, row in enumerate(planned)}

    def finished(row: Row) -> None:  # in the main thread: rows, JSON and Markdown stay consistent
        row.commit = environment["commit"]
        rows[:] = [r for r in rows if r.key != row.key]
        rows.append(row)
        rows.sort(key=lambda r: order.get(r.key, len(order)))
        print(
            f"{row.model_type:24} {row.class_name:48} built={_cell(row.built):3} flat={_cell(row.flat_ok):3} "
            f"modular={_cell(row.modular_ok):3} {row.seconds:5.0f}s {row.stage or ''} {(row.error or '')[:100]}"
            f"{' tools: ' + sweep_tools.cell(row.tools)[:160] if row.tools else ''}",
            flush=True,
        )
        count = max(len(planned), previous.get("planned", 0)) if args.sample or args.types or args.limit else len(planned)
        write_json(json_path, rows, environment, count, notes)
        write_markdown(output, rows, environment, count, notes)

    if args.jobs <= 1:
        for model_type, class_name, task in todo:
            finished(sweep_one(model_type, class_name, task, args.timeout, args.memory_gb, not args.no_tools))
    else:  # threads only wait on their forked children: the exports run in parallel processes
        from concurrent.futures import ThreadPoolExecutor, as_completed

        with ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(sweep_one, *row, args.timeout, args.memory_gb, not args.no_tools) for row in todo]
            for future in as_completed(futures):
                finished(future.result())
    print(json.dumps(totals(rows)))
    if args.compare:
        found = regressions(read_rows(pathlib.Path(args.compare)), rows)
        print(f"{len(found)} regressions against {args.compare}")
        for line in found:
            print("  " + line)
        return 1 if found else 0
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
