"""transformers checkpoints built without their weights: models on the meta device.

:func:`model_on_meta` builds the model of a checkpoint folder (``config.json`` plus
safetensors weights, as ``save_pretrained`` writes them) with its parameters on the
``meta`` device and its non-persistent buffers (rotary tables) computed on the CPU,
the way ``from_pretrained`` prepares a model before loading. ``export_modular(model, ...,
weights=<folder>)`` then reads the weights one tensor at a time while the file is written,
and checks it block by block; ``onnx-modular export <folder> --task T --stream-weights``
does both (see :func:`onnx_modular.hf.checkpoint.model_and_inputs`).
:func:`zero_cache` is a key/value cache of zeros for sample inputs that need no weights.

Nothing is downloaded: the folder must hold the configuration and the weights.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import torch

from onnx_modular.errors import InvalidInputError
from onnx_modular.format.text import shown

__all__ = ["check_checkpoint_config", "check_checkpoint_folder", "checkpoint_weights", "model_on_meta", "on_meta", "zero_cache"]

#: Most values a sample cache of zeros may hold (2**28: 1 GiB of float32); real sample caches
#: (batch 2, 4 positions) hold a few million at most.
_MAX_CACHE_ELEMENTS = 2**28


# Size fields a config may carry (top level or in a nested text/vision config).
_WIDTHS = ("hidden_size", "n_embd", "d_model", "dim", "embed_dim")
_DEPTHS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers")
_COUNTS = (*_WIDTHS, *_DEPTHS, "vocab_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
           "head_dim", "n_head", "n_inner", "d_ff", "d_kv", "num_heads", "max_position_embeddings",
           "n_positions", "image_size", "patch_size", "num_channels", "num_labels")  # fmt: skip
#: Sizes a model has at least one of (0 divides by zero in transformers' own checks).
_POSITIVE = (*_WIDTHS, "num_attention_heads", "n_head", "num_heads", "num_key_value_heads", "head_dim", "vocab_size")


def _count(value) -> bool:
    return type(value) is int and value >= 0


_TOKEN_IDS = ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id", "sep_token_id")
_DTYPES = ("float32", "float16", "bfloat16", "float64", "auto")
_PICKLED = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt")
_CONFIG_LIMIT = 16 * 1024 * 1024


def _configs(config: dict) -> list[dict]:
    """The config and the sub-configs it nests (``text_config``, ``vision_config``, ...)."""
    return [config, *(value for value in config.values() if isinstance(value, dict) and "model_type" in value)]


def _estimated_parameters(config: dict) -> int:
    """A lower bound on the parameters a config describes: the embedding and one square
    matrix of the width per layer, for the config and each nested config. Every transformer
    has at least that much."""
    total = 0
    for part in _configs(config):
        width = next((part[k] for k in _WIDTHS if type(part.get(k)) is int), 0)
        depth = max((part[k] for k in _DEPTHS if type(part.get(k)) is int), default=0)
        vocab = part.get("vocab_size") if type(part.get("vocab_size")) is int else 0
        total += vocab * width + depth * width * width
        # An explicit head_dim: every layer projects the width to heads x head_dim (the query), whatever
        # the width says (head_dim=5e8 asked gigabytes of the rotary tables before this bound).
        heads = part.get("num_attention_heads") if type(part.get("num_attention_heads")) is int else 1
        head_dim = part.get("head_dim") if type(part.get("head_dim")) is int else 0
        total += max(depth, 1 if head_dim else 0) * width * heads * head_dim
    return total


def check_checkpoint_config(folder: pathlib.Path) -> dict:
    """The checkpoint's ``config.json`` as a dict, refused with a typed error before transformers
    reads it (see :func:`check_checkpoint_folder`, which adds the weights' checks).

    Raises:
        InvalidInputError: The first problem found, with what to do.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from onnx_modular.errors import InvalidModelFileError
    from onnx_modular.storage.load import read_regular_file
    from onnx_modular.weights.sources import parse_json

    file = folder / "config.json"
    shown_file = repr(str(file))
    try:
        config = parse_json(read_regular_file(file, str(file), limit=_CONFIG_LIMIT))
    except InvalidModelFileError as e:
        raise InvalidInputError(f"{shown_file} cannot be read: {e}", hint="Give the folder save_pretrained wrote.") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidInputError(
            f"{shown_file} is not valid JSON: {e}.", hint="Fix or regenerate config.json (save_pretrained writes it)."
        ) from e
    if not isinstance(config, dict):
        raise InvalidInputError(
            f"{shown_file} holds a JSON {type(config).__name__}, not an object of settings.",
            hint="Fix or regenerate config.json (save_pretrained writes it).",
        )
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES:
        raise InvalidInputError(
            f"{shown_file} has model_type {model_type!r}, which this transformers version does not know.",
            hint="Export a checkpoint of an architecture transformers ships (onnx_modular never runs code from the folder).",
        )
    for part in _configs(config):
        if "auto_map" in part:
            raise InvalidInputError(
                f"{shown_file} asks for model code from the folder (auto_map), and onnx_modular never runs code from a checkpoint.",
                hint="Build the model yourself and export it with export_modular(model, ...) or a factory.",
            )
        for key in _COUNTS:
            value = part.get(key)
            if value is not None and not _count(value) and not (key == "image_size" and isinstance(value, list)) and not (
                key == "intermediate_size" and isinstance(value, list) and value and all(map(_count, value))  # per layer (Gemma 3n)
            ):
                raise InvalidInputError(f"{shown_file} sets {key} to {value!r}; it must be a non-negative integer.")
        for key in _POSITIVE:
            if part.get(key) == 0:
                raise InvalidInputError(f"{shown_file} sets {key} to 0; a model has at least one.")
        for key in _TOKEN_IDS:
            if not _token_id(part.get(key)):
                raise InvalidInputError(
                    f"{shown_file} sets {key} to {shown(repr(part.get(key)))[:80]}; a token id is an integer, or a list of them.",
                    hint="Fix config.json (save_pretrained writes token ids as integers).",
                )
        for key in ("dtype", "torch_dtype"):
            value = part.get(key)
            if value is not None and value not in _DTYPES:
                raise InvalidInputError(f"{shown_file} sets {key} to {value!r}; expected one of {', '.join(_DTYPES)}.")
    return config


def _token_id(value: Any) -> bool:
    """Whether ``value`` is what a config may hold as a token id: none, an integer, or a list of them."""
    values = value if isinstance(value, list) else [value]
    return value is None or all(type(v) is int and abs(v) < 2**63 for v in values)


def check_checkpoint_folder(folder: pathlib.Path) -> None:
    """Refuse a checkpoint folder before transformers reads it, with a typed error that names
    what is wrong: ``config.json`` that is not a JSON object (or is nested, empty, duplicated);
    a ``model_type`` transformers does not know; ``auto_map`` (code in the folder, which
    onnx_modular never runs); negative or non-integer sizes; an unknown ``dtype``; no
    safetensors weights (pickled ``pytorch_model.bin`` is never unpickled); and sizes whose
    smallest possible model is far larger than the weights in the folder (``hidden_size=10**9``,
    ``num_hidden_layers=10**7``), which would take minutes or all memory to build.

    Raises:
        InvalidInputError: The first problem found, with what to do.
    """
    config = check_checkpoint_config(folder)
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        pickled = sorted(p.name for pattern in _PICKLED for p in folder.glob(pattern))
        raise InvalidInputError(
            f"{str(folder)!r} holds no safetensors weights"
            + (f" (only {', '.join(pickled[:3])}: pickled weights are never unpickled, as loading runs code)." if pickled else "."),
            hint="Convert the weights to safetensors (save_pretrained(..., safe_serialization=True)) in a trusted environment.",
        )
    from onnx_modular.weights.sources import folder_entries

    folder_entries(folder)  # every safetensors header and the shard index as data (WeightsError), before transformers reads one
    stored = sum(p.stat().st_size for p in weights if p.is_file())
    smallest = _estimated_parameters(config) // 2  # bytes, at 4 bits a parameter
    if smallest > 4 * stored + 2**20:
        raise InvalidInputError(
            f"{str(folder / 'config.json')!r} describes a model of at least {_estimated_parameters(config):.3g} parameters, but the folder "
            f"holds {stored / 1e6:.1f} MB of weights: the config and the weights do not belong together.",
            hint="Check hidden_size, num_hidden_layers and vocab_size in config.json against the weights.",
        )


def model_on_meta(
    checkpoint: str | os.PathLike | Any,
    *,
    model_class: type | None = None,
    dtype: torch.dtype | None = None,
) -> torch.nn.Module:
    """The model of ``checkpoint`` (a folder or a ``PretrainedConfig``) on the meta device.

    Args:
        checkpoint: A folder with ``config.json``, or a transformers config object.
        model_class: The transformers class to build (default: the first of
            ``config.architectures``, else ``AutoModelForCausalLM``).
        dtype: The parameters' dtype (default: the config's ``dtype``, else float32).
    """
    import transformers

    if isinstance(checkpoint, (str, os.PathLike)):
        folder = pathlib.Path(checkpoint)
        if not os.path.lexists(folder / "config.json"):
            raise InvalidInputError(
                f"{str(folder)!r} has no config.json.",
                hint="Give a folder written by save_pretrained (config.json and *.safetensors).",
            )
        check_checkpoint_folder(folder)
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    else:
        config = checkpoint
    if model_class is None:
        architectures = getattr(config, "architectures", None) or []
        model_class = getattr(transformers, architectures[0], None) if architectures else None
        model_class = model_class or transformers.AutoModelForCausalLM
    dtype = dtype or _config_dtype(config) or torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            if hasattr(model_class, "from_config"):
                model = model_class.from_config(config, dtype=dtype)  # else config.dtype wins
            else:
                model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    _compute_buffers(model)
    return model.eval()


def _config_dtype(config) -> torch.dtype | None:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _compute_buffers(model: torch.nn.Module) -> None:
    """Non-persistent buffers are in no checkpoint: compute them on the CPU, as from_pretrained does."""
    owners = []
    for module in model.modules():
        for name in list(module._non_persistent_buffers_set):
            buffer = module._buffers.get(name)
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device="cpu")
                owners.append(module)
    init = getattr(model, "_init_weights", None)
    for module in dict.fromkeys(owners):
        if init is None:
            raise InvalidInputError(
                f"{type(module).__name__} has non-persistent buffers that only its model can compute.",
                hint="Build the model on the CPU, or set those buffers before exporting.",
            )
        init(module)


def on_meta(model: torch.nn.Module) -> bool:
    """Whether ``model`` has its parameters on the meta device (built by :func:`model_on_meta`)."""
    return any(p.is_meta for p in model.parameters())


def zero_cache(model: torch.nn.Module, batch: int, past: int) -> Any:
    """A ``DynamicCache`` of zeros, ``past`` positions long for every decoder layer, shaped
    from the config (key/value heads, head dim) as the model fills it: sample inputs for
    ``causal-lm-with-past`` that need no weights (a model on meta cannot fill its cache)."""
    import transformers

    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", 0) // heads if heads else 0)
    layers = getattr(config, "num_hidden_layers", None)
    sizes = (batch, heads, past, head_dim, layers)
    if not all(type(size) is int and size > 0 for size in sizes):
        raise InvalidInputError(f"The config's cache sizes (batch, heads, past, head_dim, layers) {sizes} are not positive integers.")
    elements = 2 * batch * heads * past * head_dim * layers
    if elements > _MAX_CACHE_ELEMENTS:  # checked before anything is allocated
        raise InvalidInputError(
            f"A sample cache for this config holds {elements} values (batch {batch}, {heads} heads, {past} positions, "
            f"head_dim {head_dim}, {layers} layers): more than {_MAX_CACHE_ELEMENTS}; the config is implausible.",
            hint="Check num_key_value_heads, head_dim and num_hidden_layers in config.json.",
        )
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    layers = [
        (torch.zeros(batch, heads, past, head_dim, dtype=dtype), torch.zeros(batch, heads, past, head_dim, dtype=dtype))
        for _ in range(layers)
    ]
    return transformers.DynamicCache(layers, config=config)


def checkpoint_weights(folder: str | os.PathLike, model: torch.nn.Module) -> Any:
    """The weights of ``folder`` under ``model``'s names, read one tensor at a time.

    A checkpoint's names are not always the model's: transformers renames some at load
    (legacy layouts, e.g. ViT's ``attention.attention.query`` saved by ``save_pretrained``),
    and adds or strips the base model's prefix (a ``BertForMaskedLM`` checkpoint for a
    ``BertModel``). The same renaming is applied here, as ``from_pretrained`` does, and tensors
    the model has no place for (another task's head) are left out, as ``from_pretrained`` leaves
    them. Returns ``folder`` itself when nothing needs renaming.

    Raises:
        InvalidInputError: a tensor that transformers converts at load (experts fused into one
            tensor, q/k/v concatenated, ...): streaming reads tensors as stored.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    from onnx_modular.weights.sources import WeightSource

    source = WeightSource.open(folder)
    conversions = get_model_conversion_mapping(model) if hasattr(model, "base_model_prefix") else []
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    renamed: dict[str, str] = {}
    for key in source.keys():
        name, converted = rename_source_key(key, renamings, converters, prefix, state)
        if converted is not None:
            raise InvalidInputError(
                f"transformers converts {key!r} of {str(folder)!r} at load ({type(model).__name__}: {converted!r}), "
                "which streaming one stored tensor at a time cannot do.",
                hint="Export without --stream-weights (from_pretrained converts it), or save model.state_dict() with "
                "safetensors.torch.save_file and pass that file to export_modular(model_on_meta(...), weights=...).",
            )
        if name in state:  # others (another task's head) are left out, as from_pretrained leaves them
            renamed[name] = key
    if all(name == key for name, key in renamed.items()) and len(renamed) == len(source.keys()):
        return folder
    return WeightSource.from_functions(
        {name: (*source.spec(key), lambda key=key: source.read(key)) for name, key in renamed.items()},
        description=str(folder),
    )
