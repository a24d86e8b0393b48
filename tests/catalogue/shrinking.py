"""The rules that shrink a transformers config to a tiny one (:func:`shrunk_arguments`): hidden
sizes, layers, heads, experts, vocabulary, image and audio sizes, sub-configs recursively; with
``shallow``, the depth alone."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from catalogue.config_keys import (
    DEPTH_LIST_KEYS,
    EXPERT_KEYS,
    FFN_KEYS,
    FREE_TOKEN_ID,
    GROUP_KEYS,
    HEAD_DIM_KEYS,
    HEAD_KEYS,
    HIDDEN_KEYS,
    KV_HEAD_KEYS,
    LAYER_INDEX_KEYS,
    LAYER_KEYS,
    RANK_KEYS,
    SMALL_FFN_KEYS,
    TOPK_GROUP_KEYS,
    TOPK_KEYS,
    WIDTH_SUFFIXES,
    hidden_widths,
    joined_widths,
    special_ids,
    tied_channels,
)
from catalogue.overrides import HIDDEN, SEQUENCE


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


@dataclasses.dataclass
class _Shrinking:
    """What every rule of :func:`shrunk_arguments` reads about the config being shrunk."""

    config: Any
    values: dict[str, Any]
    widths: frozenset[int]
    special: set[int]
    sub_configs: set[str]
    layers: int | None
    heads: int | None
    kept: list[int] | None
    experts: bool
    unrouted: bool
    uncounted: bool
    derived: set[str]
    joined: set[int]
    shallow: bool
    followed: set[str] = dataclasses.field(default_factory=set)


def _shrinking(config: Any, inherited_ids: frozenset[int], widths: frozenset[int] | None, shallow: bool) -> _Shrinking:
    values = config.to_dict()
    widths = frozenset(hidden_widths(values)) if widths is None else widths
    special = special_ids(values) | inherited_ids
    sub_configs = set(getattr(config, "sub_configs", {}) or {})
    layers = next((values[k] for k in LAYER_KEYS if isinstance(values.get(k), int)), None)
    heads = next((values[k] for k in HEAD_KEYS if isinstance(values.get(k), int)), None)
    kept = _kept_layers(values, layers)
    experts = any(isinstance(values.get(k), int) and not isinstance(values[k], bool) and values[k] > 1 for k in EXPERT_KEYS)
    # experts whose routing (how many per token, in how many groups) is left to the checkpoint (DeepSeek-V2),
    # or their number too (dots.llm1)
    unrouted = any(k in values and values[k] is None for k in TOPK_KEYS)
    uncounted = unrouted and any(k in values and values[k] is None for k in EXPERT_KEYS)
    # ... unless the config turns its experts off (Gemma 4's enable_moe_block)
    uncounted = uncounted and not any(k.startswith(("enable_moe", "use_moe")) and v is False for k, v in values.items())
    unrouted = unrouted and (experts or uncounted)
    derived, joined = _unset_by_default(type(config)), joined_widths(values)
    return _Shrinking(config, values, widths, special, sub_configs, layers, heads, kept, experts, unrouted, uncounted,
                      derived, joined, shallow)


def shrunk_arguments(
    config: Any, inherited_ids: frozenset[int] = frozenset(), widths: frozenset[int] | None = None, shallow: bool = False
) -> dict[str, Any]:
    """Constructor arguments that shrink ``config`` (the rules; sub-configs recursively, keeping
    the vocabulary above the token ids of the enclosing config, LLaVA's image token, and shrinking
    widths tied to any hidden size of the tree, a projector's ``out_hidden_size``). ``shallow``:
    depth only (layers, stages, experts, vocabulary; what follows the kept layers), every width
    and size as the default config has it."""
    s = _shrinking(config, inherited_ids, widths, shallow)
    out: dict[str, Any] = {}
    for key, value in s.values.items():
        _shrink_one(s, key, value, out)
    _shrink_tied_sizes(s, out)
    _shrink_heads_and_rotary(s, out)
    _shrink_unset_layouts(s, out)
    if shallow:  # widths, heads and sizes stay consistent as the default config has them
        out = _depth_only(s, out)
    accepted = _init_parameters(type(config))
    # per-layer dicts and a backbone's outputs are taken through **kwargs (and a sub-config's
    # to_dict() hands back the default ones, which these must replace)
    through = ("per_layer", "out_features", "out_indices")
    return {key: value for key, value in out.items() if accepted is None or key in accepted or key.startswith(through)}


def _shrink_one(s: _Shrinking, key: str, value: Any, out: dict[str, Any]) -> None:
    """The rules for one key of the config (``out`` gets its shrunk value, if any)."""
    config, values = s.config, s.values
    if key in s.sub_configs or (isinstance(value, dict) and hasattr(getattr(config, key, None), "to_dict")):
        sub = _shrunk_sub_config(s, key)
        if sub is not None:
            out[key] = sub
        return
    if isinstance(value, bool):
        return
    if value is None:
        _shrink_unset(s, key, out)
        return
    if isinstance(value, int) and key.endswith("_dim") and value in s.joined:
        # the width of features joined from two models' (a codec's acoustic and semantic ones, quantized
        # together): derived again from the shrunk parts when the config derives it (XCodec), else their sum (XCodec2)
        if key not in s.derived:
            out[key] = 2 * HIDDEN
        return
    if isinstance(value, int):
        _shrink_int(s, key, value, out)
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        _shrink_int_list(s, key, value, out)
    kept, layers = s.kept, s.layers
    if kept is not None and isinstance(value, (list, tuple)) and len(value) == layers and key not in out:
        out[key] = [value[i] for i in kept]  # per-layer lists (layer_types, ...) follow the kept layers
        s.followed.add(key)
    elif kept is not None and key.startswith("per_layer") and isinstance(value, dict):
        out[key] = {  # keyed by layer index: the kept layers', renumbered, shrunk as the whole config is
            kept.index(int(k)): _layer_shrunk(v, values) for k, v in value.items() if str(k).isdigit() and int(k) in kept
        }


def _shrunk_sub_config(s: _Shrinking, key: str) -> dict[str, Any] | None:
    sub = getattr(s.config, key, None)
    if getattr(sub, "model_type", None) == "timm_backbone" and str(getattr(sub, "backbone", "")).startswith("resnet"):
        # transformers' own ResNet, same stages: the row stays small and the same on every torch
        # (timm needs torchvision, which does not import beside the CPU torch 2.13 here)
        from transformers import ResNetConfig

        sub = ResNetConfig(out_indices=list(getattr(sub, "out_indices", None) or [1, 2, 3, 4]))
    if sub is None or not hasattr(sub, "to_dict"):
        return None
    base = sub.to_dict()
    accepted = _init_parameters(type(sub))
    if accepted is not None and "qk_rope_head_dim" in base:
        # a head width the config derives from its rotary part (DeepSeek-V3's head_dim): derived again
        base = {k: v for k, v in base.items() if k in accepted or k not in HEAD_DIM_KEYS}
    # a key-head count or a head width its constructor does not take is derived from the heads and
    # widths (Parakeet's encoder under Canary, Pixtral's head_dim under Mistral 3): left out, so it
    # follows the shrunk ones instead of keeping the default's
    derived_heads = KV_HEAD_KEYS | HEAD_DIM_KEYS
    base = {k: v for k, v in base.items() if accepted is None or k not in derived_heads or k in accepted}
    return {**base, **shrunk_arguments(sub, frozenset(s.special), s.widths, s.shallow)}


def _shrink_unset(s: _Shrinking, key: str, out: dict[str, Any]) -> None:
    """A key the default config leaves unset (None): a value where the model needs one."""
    values, special, heads = s.values, s.special, s.heads
    if key == "vocab_size":  # left to the checkpoint (ESM): any tiny vocabulary
        out[key] = max(512, max(special, default=0) + 1)
    elif key in KV_HEAD_KEYS and heads:  # left unset, and a layer divides by it (Nemotron)
        out[key] = 1
    elif key in FREE_TOKEN_ID:  # left to the checkpoint (Voxtral's audio, BLIP-2's image)
        out[key] = FREE_TOKEN_ID[key]
    elif key == "default_language" and values.get("languages"):  # X-MOD's adapters need a language
        out[key] = values["languages"][0]
    elif not _shrink_unset_experts(s, key, out):
        _shrink_unset_heads(s, key, out)


def _shrink_unset_experts(s: _Shrinking, key: str, out: dict[str, Any]) -> bool:
    if key in TOPK_KEYS and s.unrouted:  # 2 of the 4 experts
        out[key] = 2
    elif key in EXPERT_KEYS and s.uncounted:
        out[key] = 4
    elif key == "n_shared_experts" and s.uncounted:
        out[key] = 1
    elif key in SMALL_FFN_KEYS and s.uncounted:  # the experts' width, left unset with their number (DiffusionGemma)
        out[key] = HIDDEN
    elif key in GROUP_KEYS | TOPK_GROUP_KEYS and s.unrouted:  # 4 experts: one group holds them all
        out[key] = 1
    else:
        return False
    return True


def _shrink_unset_heads(s: _Shrinking, key: str, out: dict[str, Any]) -> bool:
    values = s.values
    if key in ("class_thresholds", "class_order") and isinstance(values.get("id2label"), dict):
        # a detector's per-label score thresholds and reading-order category, left to the checkpoint
        # (PP-DocLayout V2): 0.5 each, every label its own category
        labels = len(values["id2label"])
        out[key] = [0.5] * labels if key == "class_thresholds" else list(range(labels))
    elif key.startswith("decoder_") and key.endswith(("hidden_size", "_depth", "_num_heads")):
        # a masked-image pretraining decoder left to the checkpoint (Hiera): one layer, 2 heads, HIDDEN wide
        out[key] = HIDDEN if key.endswith("hidden_size") else 1 if key.endswith("_depth") else 2
    elif key == "prediction_length":  # a forecaster's horizon, left to the user (the context follows it)
        out[key] = 4
    else:
        return False
    return True


def _shrink_int(s: _Shrinking, key: str, value: int, out: dict[str, Any]) -> None:
    """An integer setting, by the first rule that takes it."""
    for rules in (_shrink_int_depth, _shrink_int_widths, _shrink_int_sizes, _shrink_int_tied):
        if rules(s, key, value, out):
            return


def _shrink_int_depth(s: _Shrinking, key: str, value: int, out: dict[str, Any]) -> bool:
    values, layers, heads, kept = s.values, s.layers, s.heads, s.kept
    if key in HIDDEN_KEYS and value > HIDDEN:
        out[key] = HIDDEN
    elif key in LAYER_KEYS and value == layers and kept is not None:
        out[key] = len(kept)
    elif key in LAYER_KEYS and value > 2 or key in HEAD_KEYS and value > 2:
        out[key] = 2
    elif key == "num_windows" and value > 4 and isinstance(values.get("image_size"), int) and values["image_size"] > 32:
        out[key] = 4  # windowed attention over the tiny image's 4 x 4 patches (LW-DETR's ViT): 2 x 2 windows
    elif key == "num_blocks" and kept is not None and layers and len(kept) <= value < layers:
        # the last layers that read queries (EoMT's 4 of 24): the last of the kept ones, one before it without
        out[key] = max(1, len(kept) - 1)
    elif key.startswith("decoder_") and key.endswith("num_attention_heads") and value > 2 and HIDDEN % value:
        out[key] = 2  # a decoder's heads (VideoMAE's: 6) that would not divide its shrunk width
    elif key in KV_HEAD_KEYS and value > 1:
        # multi-head latent attention (DeepSeek's kv_lora_rank) repeats no key heads: kv == heads
        out[key] = 2 if value == heads and "kv_lora_rank" in values else 1
    else:
        return False
    return True


def _shrink_int_widths(s: _Shrinking, key: str, value: int, out: dict[str, Any]) -> bool:
    values = s.values
    if key == "mamba_n_heads" and value > 2:
        out[key] = 2
        if isinstance(values.get("mamba_d_head"), int):  # heads x head dim = expand x hidden
            out["mamba_d_head"] = (values.get("mamba_expand") or 2) * HIDDEN // 2
            if isinstance(values.get("mamba_d_ssm"), int):  # or the width given for it (Falcon-H1)
                out["mamba_d_ssm"] = 2 * out["mamba_d_head"]
    elif key in FFN_KEYS and value > 2 * HIDDEN:
        out[key] = 2 * HIDDEN
    elif key in SMALL_FFN_KEYS and value > HIDDEN:
        out[key] = HIDDEN
    elif key in EXPERT_KEYS and value > 4:
        out[key] = 4
    elif key in TOPK_KEYS and value > 2:
        out[key] = 2
    elif key in GROUP_KEYS and value > 1:  # 4 experts: one group holds them all
        out[key] = 1
    elif key in TOPK_GROUP_KEYS and value > 1:
        out[key] = 1
    elif key == "rotary_dim" and value > 8:  # partial rotary within a 16-wide head (GPT-J)
        out[key] = 8
    else:
        return False
    return True


def _shrink_int_sizes(s: _Shrinking, key: str, value: int, out: dict[str, Any]) -> bool:
    values, layers, kept = s.values, s.layers, s.kept
    if key == "num_queries" and value > 16:  # a detector's top-k over the few tokens of a tiny image
        out[key] = 16
    elif key in HEAD_DIM_KEYS and value > 16:
        out[key] = 16
    elif key in RANK_KEYS and value > HIDDEN:
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
        out[key] = max(512, max(s.special, default=0) + 1)
    elif key in ("num_conv_pos_embeddings",) and value > 16:
        out[key] = 16
    else:
        return False
    return True


def _shrink_int_tied(s: _Shrinking, key: str, value: int, out: dict[str, Any]) -> bool:
    values, widths = s.values, s.widths
    if key == "num_heads" and value > 2 and "spatial_merge_size" in values:  # a Qwen-VL vision tower's rotary needs 16-wide heads
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
    else:
        return _shrink_int_named_width(key, value, widths, out)
    return True


def _shrink_int_named_width(key: str, value: int, widths: frozenset[int], out: dict[str, Any]) -> bool:
    if key.endswith("_groups") and value in widths:  # a depthwise convolution over a hidden width (Mimi's upsampling)
        out[key] = HIDDEN
    elif (key.endswith(WIDTH_SUFFIXES) or key == "hidden_size_global") and value in widths and not key.endswith("head_dim") and key not in HEAD_DIM_KEYS:
        # (hidden_size_global: BLT's byte encoder reads the global transformer's width)
        out[key] = HIDDEN  # tied to a hidden size by the architecture (a projector's output, a condition)
    elif key in LAYER_INDEX_KEYS:
        out[key] = _layer_index(value)
    else:
        return False
    return True


def _shrink_int_list(s: _Shrinking, key: str, value: list | tuple, out: dict[str, Any]) -> None:
    values, widths, heads = s.values, s.widths, s.heads
    if key in ("hidden_sizes", "dims", "embed_dims", "neck_hidden_sizes") and not tied_channels(values, value):
        out[key] = [min(v, 8 * 2**i) for i, v in enumerate(value)]
    elif key in DEPTH_LIST_KEYS:
        out[key] = [1] * len(value)
    elif key in ("num_heads", "attention_heads", "num_attention_heads"):
        out[key] = [min(v, 2) for v in value]
    elif key == "conv_dim":
        out[key] = [HIDDEN] * len(value)
    elif key in LAYER_INDEX_KEYS:
        out[key] = _layer_index(value)
    elif key.endswith("_channels") and all(v in widths for v in value):  # a detector's decoder reads the encoder's width
        out[key] = [HIDDEN] * len(value)
    elif "key_value_heads" in key and heads:  # per layer: all heads stay all (2), grouped ones become 1
        out[key] = [2 if v == heads else 1 for v in value]
    elif sum(value) in widths and key.endswith("_dim"):  # factors of a width (Reformer's axial embeddings)
        out[key] = _fit_sections(list(value), HIDDEN)


def _shrink_tied_sizes(s: _Shrinking, out: dict[str, Any]) -> None:
    """Sizes another setting fixes, made to agree with the shrunk ones."""
    values, layers, kept = s.values, s.layers, s.kept
    patch = values.get("patch_size")
    for key, sub in list(out.items()):
        default = values.get(key)
        if not s.shallow and isinstance(patch, int) and isinstance(sub, dict) and isinstance(default, dict) and default.get("image_size") == patch:
            # a patch that is an encoder's whole image (DepthPro tiles its image for its DINOv2 encoders)
            if isinstance(sub.get("image_size"), int):
                out["patch_size"] = sub["image_size"]
    _shrink_tower_widths(values, out)
    if s.followed:  # one entry per layer: a rule's list (depths, hidden_sizes) follows the kept layers as the others do
        for key, value in list(out.items()):
            if key not in s.followed and isinstance(value, list) and len(value) == layers and isinstance(values.get(key), (list, tuple)):
                out[key] = [value[i] for i in kept]
    embed, depths, width = values.get("patch_embeds_hidden_size"), values.get("depths"), values.get("hidden_size")
    if isinstance(embed, int) and isinstance(depths, (list, tuple)) and isinstance(width, int) and embed << (len(depths) - 1) == width:
        # a Swin tower doubling its patch embeddings' width at each stage ends at hidden_size (CLAP's audio): shrunk with it
        out["patch_embeds_hidden_size"] = max(1, out.get("hidden_size", width) >> (len(depths) - 1))


def _shrink_tower_widths(values: dict[str, Any], out: dict[str, Any]) -> None:
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


def _shrink_heads_and_rotary(s: _Shrinking, out: dict[str, Any]) -> None:
    values, heads = s.values, s.heads
    if values.get("head_dim", 0) is None and heads and "head_dim" not in out:
        out["head_dim"] = HIDDEN // min(heads, 2)  # None: some models compute hidden // heads, others fail
    for key in ("rope_parameters", "rope_scaling"):  # multimodal rotary sections split half the head
        if isinstance(values.get(key), dict):
            _shrink_rotary(s, key, out)


def _shrink_rotary(s: _Shrinking, key: str, out: dict[str, Any]) -> None:
    values, heads = s.values, s.heads
    head_dim = out.get("head_dim") or values.get("head_dim")
    if not isinstance(head_dim, int) or head_dim > 16:
        head_dim = (out.get("hidden_size") or values.get("hidden_size") or HIDDEN) // max(1, min(heads or 2, 2))
    rope = _rope_shrunk(values[key], head_dim)
    # multimodal rotary (Qwen2-VL): the model falls back to sections for a full-size head when the
    # config has none; its config class says so by exempting them from rope validation
    exempt = getattr(type(s.config), "ignore_keys_at_rope_validation", None) or ()
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


def _shrink_unset_layouts(s: _Shrinking, out: dict[str, Any]) -> None:
    """Layouts a default config leaves to the checkpoint: a vocabulary map, a sliding window, the
    feed-forward kind per layer, a backbone's outputs."""
    values, layers, kept = s.values, s.layers, s.kept
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
    if "mlp_layer_types" in values and values["mlp_layer_types"] is None and s.experts and layers:
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


def _depth_only(s: _Shrinking, out: dict[str, Any]) -> dict[str, Any]:
    """``shallow``: of the shrunk settings, those of depth (and what follows the kept layers)."""
    config, values, layers, kept = s.config, s.values, s.layers, s.kept
    depth = LAYER_KEYS | EXPERT_KEYS | TOPK_KEYS | GROUP_KEYS | TOPK_GROUP_KEYS | DEPTH_LIST_KEYS | {"vocab_size", "stage_names", "mlp_layer_types", "sliding_window", "n_shared_experts"}
    return {
        key: value for key, value in out.items()
        if key in depth or key in s.followed or key in LAYER_INDEX_KEYS
        or key in s.sub_configs or hasattr(getattr(config, key, None), "to_dict")
        or key.startswith(("per_layer", "out_features", "out_indices", "_out"))
        or (kept is not None and isinstance(values.get(key), (list, tuple)) and len(values[key]) == layers)
    }


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
        if key in HEAD_KEYS and value > 2:
            out[key] = 2
        elif key in KV_HEAD_KEYS and value > 1:
            out[key] = 2 if value == whole.get("num_attention_heads") and "kv_lora_rank" in whole else 1
        elif key in HEAD_DIM_KEYS and key != "head_dim" and value > 16:  # a layer's own head_dim (Gemma 4's global
            out[key] = 16  # layers') stays, as it has: only a head made of parts follows them (below)
        elif key in RANK_KEYS and value > HIDDEN:
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
