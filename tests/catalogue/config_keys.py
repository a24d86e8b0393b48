"""The names transformers' configs give their sizes (hidden widths, layers, heads, experts, head
widths, layer indices), and what a config's values say through them: the token ids it reserves,
its hidden widths, channels tied to a width."""

from __future__ import annotations

from typing import Any

from catalogue.overrides import HIDDEN

HIDDEN_KEYS = {
    "hidden_size", "d_model", "n_embd", "embed_dim", "hidden_dim", "d_embed", "dim", "word_embed_proj_dim",
    "projection_dim", "encoder_hidden_size", "decoder_hidden_size", "text_hidden_size", "out_hidden_size",
}
LAYER_KEYS = {
    "num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
    "num_encoder_layers", "num_decoder_layers", "num_text_layers", "num_vision_layers",
}
HEAD_KEYS = {"num_attention_heads", "n_head", "n_heads", "encoder_attention_heads", "decoder_attention_heads"}
KV_HEAD_KEYS = {"num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "num_key_value_attention_heads"}
FFN_KEYS = {
    "intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner", "d_ff", "ffn_hidden_size",
    "decoder_intermediate_size", "encoder_intermediate_size",
}
SMALL_FFN_KEYS = {"moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"}
EXPERT_KEYS = {"num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"}
TOPK_KEYS = {"num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_k", "top_k_experts"}
#: expert groups (DeepSeek-style routing: experts // groups per group, topk_group of them chosen)
GROUP_KEYS = {"n_group", "num_expert_group", "num_group"}
TOPK_GROUP_KEYS = {"topk_group"}
#: widths tied to a hidden size by name: shrunk with it when they equal one of the tree's hidden sizes
WIDTH_SUFFIXES = ("hidden_size", "_dim", "embedding_size", "projection_size", "_input_size")  # _input_size: an adapter's input (Dots 3's audio)
#: layer indices into a (vision) tower: kept within the tiny tower's layers
DEPTH_LIST_KEYS = {"depths", "num_layers_per_stage", "layers_per_stage"}
LAYER_INDEX_KEYS = {
    "vision_feature_layer", "vision_feature_layers", "feature_layer", "feature_layers", "select_layer", "intermediate_hook_ids",
    "intermediate_layers_indices",
}
HEAD_DIM_KEYS = {"head_dim", "attention_head_dim", "kv_channels", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"}
RANK_KEYS = {"kv_lora_rank", "q_lora_rank"}


#: ids given to a multimodal token a default config leaves unset (kept out of the random text)
FREE_TOKEN_ID = {"audio_token_id": 5, "image_token_id": 6, "video_token_id": 7, "image_token_index": 6, "video_token_index": 7}


def special_ids(values: dict[str, Any]) -> set[int]:
    found = set()
    for key, value in values.items():
        if key.endswith(("_token_id", "_token_index", "_id")) and isinstance(value, int):
            found.add(value)
        elif key.endswith("_token_id") and isinstance(value, list):
            found.update(v for v in value if isinstance(v, int))
    return found


def hidden_widths(values: dict[str, Any]) -> set[int]:
    """The hidden sizes (over :data:`HIDDEN`) anywhere in a config's dict, sub-configs included."""
    found = set()
    for key, value in values.items():
        if isinstance(value, dict):
            found |= hidden_widths(value)
        elif key in HIDDEN_KEYS and isinstance(value, int) and not isinstance(value, bool) and value > HIDDEN:
            found.add(value)
    return found


def tied_channels(values: dict[str, Any], sizes: list[int]) -> list[str]:
    """The channel keys (``stage_out_channels``, ``stem_out_channels``, ...) that repeat a stage
    width of ``sizes``: the stages are built from those (HGNetV2, TextNet) and ``hidden_sizes`` only
    describe them to a backbone's users and a classifier, so shrinking the list alone breaks both."""
    def numbers(value: Any) -> set[int]:
        if isinstance(value, (list, tuple)):
            return set().union(*(numbers(v) for v in value)) if value else set()
        return {value} if isinstance(value, int) and not isinstance(value, bool) else set()

    stages = set(sizes)
    return sorted(k for k, v in values.items() if k.endswith("_channels") and k != "num_channels" and numbers(v) & stages)


def joined_widths(values: dict[str, Any]) -> set[int]:
    """Sums of two of a config's hidden size and its sub-configs' (each over :data:`HIDDEN`)."""
    sizes = [values.get("hidden_size")] + [v.get("hidden_size") for v in values.values() if isinstance(v, dict)]
    sizes = [w for w in sizes if isinstance(w, int) and not isinstance(w, bool) and w > HIDDEN]
    return {a + b for i, a in enumerate(sizes) for b in sizes[i + 1:]}


