"""A model of every architecture, built small: the config shrunk by tier (:func:`tiny_config`,
:data:`TIERS`, within :data:`PARAMETER_BUDGET`), random weights (seed 0), valid inputs
(:func:`~catalogue.model_inputs.make_inputs`) and PyTorch's outputs on them (:func:`build_with_tier`);
the inputs that fix a model's layout (:func:`layout_inputs`), larger images for models a tiny one
is too small for."""

from __future__ import annotations

from typing import Any

from catalogue.media_inputs import forward_parameters, image_size_of
from catalogue.model_inputs import make_inputs
from catalogue.overrides import OVERRIDES
from catalogue.reference_outputs import output_tensors
from catalogue.shrinking import shrunk_arguments

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
    """The default config of ``model_type``, shrunk by :func:`shrunk_arguments` as far as ``tier`` says
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
    shrunk = towers if tier == "default" else shrunk_arguments(default, shallow=tier == "shallow")
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
    _configure_head(config, class_name)
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
            relaid = _other_layouts(model, config, inputs, text)
            if relaid is not None:
                return relaid
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
    return model, inputs, output_tensors(expected)


def _configure_head(config, class_name: str) -> None:
    """What a task head needs of its config that the default leaves out (a padding token, a decoder's
    start, causal attention, the encoder alone, a Q-Former's text input)."""
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
    if class_name in _causal_lm_classes() and getattr(config, "is_decoder", True) is False:
        # a BERT-family causal LM (BertLMHeadModel, RobertaForCausalLM) is a decoder only when its config says
        # so, as a user exporting one sets it (transformers warns otherwise): causal, with a cache, no
        # cross-attention
        config.is_decoder = True
        if getattr(config, "add_cross_attention", False):
            config.add_cross_attention = False
    if class_name.endswith("EncoderModel") and getattr(config, "is_encoder_decoder", False) and getattr(config, "encoder", None) is not None:
        config.is_encoder_decoder = False  # the encoder of an encoder-decoder config, alone (T5Gemma refuses otherwise)
    qformer = getattr(config, "qformer_config", None)
    if class_name.endswith("ForImageTextRetrieval") and getattr(qformer, "use_qformer_text_input", None) is False:
        qformer.use_qformer_text_input = True  # the head reads its text through the Q-Former's text layers (BLIP-2's ITM checkpoint)


def _causal_lm_classes() -> frozenset[str]:
    """The class names of transformers' ``AutoModelForCausalLM`` mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(name for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
                     for name in ((names,) if isinstance(names, str) else names))


def _other_layouts(model, config, inputs: dict[str, Any], text: dict[str, Any]):
    """Where the model refused its inputs: ``(model, inputs, expected)`` with the same data in the
    layout another processor gives (boxes as fractions, patches unflattened, log-mel transposed), or
    None."""
    features = inputs.get("input_features")
    boxes = inputs.get("bbox")
    if boxes is not None and not boxes.is_floating_point():
        # document boxes come as integers within 0..1000 from LayoutLM's processor and as fractions
        # of the page from UDOP's
        try:
            fractions = {**inputs, "bbox": boxes.float() / 1000}
            return model, fractions, output_tensors(model(**fractions))
        except Exception:  # not that either: what follows
            pass
    patches = _patch_images(config, inputs)
    if patches is not None:
        # flattened patches come (patches, channels x patch x patch) from Qwen-VL's processor and
        # (patches, channels, patch, patch) from others (Kimi-K2.5's, embedded by a 2-D convolution)
        try:
            return model, {**inputs, "pixel_values": patches}, output_tensors(model(**{**inputs, "pixel_values": patches}))
        except Exception:  # not that either: what follows
            pass
    if text.keys() == inputs.keys() and getattr(features, "dim", lambda: 0)() == 3:
        # log-mel features come (batch, bins, frames) from Whisper's extractor and (batch, frames,
        # bins) from others (Parakeet's): the other layout
        inputs = {**inputs, "input_features": features.transpose(1, 2).contiguous()}
        return model, inputs, output_tensors(model(**inputs))
    return None


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
    if language is None or "position_ids" not in forward_parameters(model):
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
            return larger, output_tensors(model(**larger))
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
    size = image_size_of(backbone)
    if size == tuple(pixels.shape[-2:]):
        return None
    other = {**inputs, "pixel_values": torch.randn(*pixels.shape[:2], *size, generator=torch.Generator().manual_seed(0))}
    try:
        return other, output_tensors(model(**other))
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
