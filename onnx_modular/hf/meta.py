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

__all__ = ["checkpoint_weights", "model_on_meta", "on_meta", "zero_cache"]


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
        if not (folder / "config.json").is_file():
            raise InvalidInputError(
                f"{str(folder)!r} has no config.json.",
                hint="Give a folder written by save_pretrained (config.json and *.safetensors).",
            )
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
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    layers = [
        (torch.zeros(batch, heads, past, head_dim, dtype=dtype), torch.zeros(batch, heads, past, head_dim, dtype=dtype))
        for _ in range(config.num_hidden_layers)
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
    for key in source.keys():  # noqa: SIM118 (a WeightSource, not a dict)
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
