"""The inputs of models read from pixels, patches, audio and policies' states: images and videos
as each model's processor would give them, with as many image or audio tokens in the text as the
model makes features; the helpers :mod:`catalogue.model_inputs` draws on."""

from __future__ import annotations

import inspect
from typing import Any

from catalogue.config_keys import special_ids
from catalogue.overrides import BATCH, HIDDEN, SEQUENCE


def forward_parameters(model) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def token_ids(config, shape, generator):
    import torch

    text = getattr(config, "text_config", None) or config
    # or a sub-model's, where the composite has none of its own (FastSpeech 2 beside its vocoder)
    vocab = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None) or find_key(config.to_dict(), "vocab_size") or 100
    special = special_ids(config.to_dict()) | special_ids(text.to_dict() if hasattr(text, "to_dict") else {})
    allowed = [i for i in range(3, min(vocab, 100)) if i not in special] or [0]
    index = torch.randint(0, len(allowed), shape, generator=generator)
    return torch.tensor(allowed)[index]


def image_size_of(config) -> tuple[int, int]:
    size = getattr(config, "image_size", None) or 32
    if isinstance(size, (list, tuple)):
        return int(size[0]), int(size[-1])
    if isinstance(size, dict):
        return int(size.get("height", 32)), int(size.get("width", 32))
    return int(size), int(size)


def extractor_features(config) -> int | None:
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


def first_conv_channels(model) -> int | None:
    """The channels the model's first 1-D convolution (or transposed one) reads."""
    import torch

    kinds = (torch.nn.Conv1d, torch.nn.ConvTranspose1d)
    return next((m.in_channels for m in model.modules() if isinstance(m, kinds)), None)


def find_key(values: dict[str, Any], key: str) -> Any:
    """The value of ``key`` in a config's dict or the first sub-config that has it."""
    if key in values:
        return values[key]
    return next((found for v in values.values() if isinstance(v, dict) and (found := find_key(v, key)) is not None), None)


def codec_of(values: dict[str, Any]) -> tuple[int | None, bool]:
    """(channel count, whether stride ratios are given) of a config or its nearest codec sub-config
    (PE Audio's encoder wraps a DAC's)."""
    channels = next((values[k] for k in ("audio_channels", "channels") if isinstance(values.get(k), int)), None)
    strides = any(isinstance(values.get(k), (list, tuple)) for k in ("downsampling_ratios", "upsampling_ratios"))
    if channels is not None or strides:
        return channels, strides
    for value in values.values():
        if isinstance(value, dict) and value.get("model_type"):
            found = codec_of(value)
            if found != (None, False):
                return found
    return None, False


def patch_inputs(model, vision, generator) -> dict[str, Any]:
    """Pixels as processors that cut images into patches or tiles give them: a 4 x 4 grid of
    flattened patches with its ``spatial_shapes`` and ``pixel_attention_mask`` (SigLIP 2's NaFlex);
    a grid of whole pooling windows with each patch's (x, y) in ``pixel_position_ids`` (Gemma 4);
    one tile of one image with its ``aspect_ratio_ids`` (1: the 1 x 1 ratio) and ``aspect_ratio_mask`` (Mllama)."""
    import torch

    required = required_parameters(model)
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


def packed_patches(vision, generator) -> dict[str, Any]:
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


def matches_keypoints(config) -> bool:
    """Whether the architecture is a keypoint matcher (its base model reads image pairs too: EfficientLoFTR)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_KEYPOINT_MATCHING_MAPPING_NAMES

    return getattr(config, "model_type", None) in MODEL_FOR_KEYPOINT_MATCHING_MAPPING_NAMES


def policy_inputs(model, config, generator) -> dict[str, Any]:
    """A vision-language-action policy (PI0) as its processor and sampler give it: a prompt holding
    one camera image's tokens, the images (batch, cameras, channels, height, width) with which
    cameras are present, the robot's ``state`` (batch, ``max_state_dim``), the action ``noise``
    (batch, ``chunk_size``, ``max_action_dim``) and the flow-matching ``timestep`` in (0, 1). The
    policy's backbone takes state, noise and time already embedded (``action_embeds``: one state
    token and the chunk's, of its action expert's width)."""
    import torch

    parameters, required = forward_parameters(model), required_parameters(model)
    subs = [getattr(config, name, None) for name in getattr(config, "sub_configs", {}) or {}]
    language = next((sub for sub in subs if getattr(sub, "vision_config", None) is not None and _image_token(sub) is not None), None)
    tower = next((m for m in model.modules() if m is not model and hasattr(m, "get_image_features")), None)
    if language is None or tower is None:
        return {}
    vision = language.vision_config
    height, width = image_size_of(vision)
    pixels = torch.randn(BATCH, 1, getattr(vision, "num_channels", None) or 3, height, width, generator=generator)
    with torch.no_grad():
        count = _count(tower.get_image_features(pixels.flatten(0, 1)))
    out = _placeholders(model, token_ids(language, (BATCH, SEQUENCE), generator), _image_token(language), count or 0) or {}
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


def required_parameters(model) -> set[str]:
    """The forward's parameters without a default (what a call must give)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in parameters if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def text_beside_pixels(model, config, pixels: dict[str, Any], generator) -> dict[str, Any]:
    """Token ids for a model read from its pixels that takes text too, as its processor gives both:
    when its forward requires ``input_ids`` (BLIP-2, Grounding DINO, a video-text CLIP), or takes
    them with a ``text_config`` and either no decoder inputs to feed instead (Kosmos-2 and SAM 3
    take a text prompt) or an image token to mark where the images go. A Q-Former's image makes
    ``num_query_tokens`` features (per frame of a video): the text holds that many image tokens
    (InstructBLIP); the Q-Former's own prompt (``qformer_input_ids``) is given too. Kosmos-2 marks
    its ``latent_query_num`` image positions with ``image_embeds_position_mask``."""
    import torch

    parameters, required = forward_parameters(model), required_parameters(model)
    text = getattr(config, "text_config", None)
    token = _image_token(config)
    token = token if token is not None else getattr(config, "video_token_index", None)
    if "input_ids" not in required and not (
        "input_ids" in parameters and text is not None and ("decoder_input_ids" not in parameters or token is not None)
    ):
        return {}
    ids = token_ids(config, (BATCH, SEQUENCE), generator)
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
        out["qformer_input_ids"] = token_ids(qformer, (BATCH, SEQUENCE), generator)
        if "qformer_attention_mask" in parameters:
            out["qformer_attention_mask"] = torch.ones(BATCH, SEQUENCE, dtype=torch.long)
    return out


def _image_token(config) -> int | None:
    for key in ("image_token_id", "image_token_index"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def grid_patches(vision, generator) -> dict[str, Any]:
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

    parameters = forward_parameters(model)
    vision = config.vision_config
    channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", None) or 3
    if "image_grid_thw" in parameters:
        return grid_patches(vision, generator)
    features = _image_feature_parameters(model)
    if "image_position_ids" in features and "image_position_ids" in parameters:
        # patches with their (x, y) (Gemma 4's processor): as its vision tower takes them
        pixels, positions = _positioned_patches(vision, generator)
        return {"pixel_values": pixels, "image_position_ids": positions}
    if features.get("target_sizes", False) is inspect.Parameter.empty and "target_sizes" in parameters:
        return packed_patches(vision, generator)  # a NaViT tower's packed patches (MiniCPM-V's)
    if features.get("spatial_shapes", False) is inspect.Parameter.empty and "spatial_shapes" in parameters:
        return _naflex_patches(vision, generator)  # a NaFlex tower's patches (LFM2-VL's SigLIP 2)
    height, width = image_size_of(vision)
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
    if "attention_mask" in forward_parameters(model):
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
        ids = token_ids(config, (BATCH, count // BATCH), generator)
        out = {"input_ids": ids, "input_features": features}
        if "attention_mask" in forward_parameters(model):
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
    parameters = forward_parameters(model)
    if "mm_token_type_ids" in parameters:  # 1 marks image tokens for multimodal rotary positions
        out["mm_token_type_ids"] = (ids == token).to(torch.int32)
    return out
