"""transformers checkpoints exported without loading their weights whole.

:func:`model_on_meta` builds the model of a checkpoint folder (``config.json`` plus
safetensors weights, as ``save_pretrained`` writes them) with its parameters on the
``meta`` device and its non-persistent buffers (rotary tables) computed on the CPU,
the way ``from_pretrained`` prepares a model before loading. :func:`export_checkpoint`
exports it with ``weights=<folder>``: weights are read one tensor at a time while the
file is written, and checked block by block.

Nothing is downloaded: the folder must hold the configuration and the weights.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import torch

from onnx_modular.errors import InvalidInputError

__all__ = ["export_checkpoint", "model_on_meta"]


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
                model = model_class.from_config(config)
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


def export_checkpoint(
    checkpoint: str | os.PathLike,
    f: str | os.PathLike,
    args: tuple | torch.Tensor | None = None,
    *,
    kwargs: dict | None = None,
    model_class: type | None = None,
    dtype: torch.dtype | None = None,
    **options: Any,
):
    """Export a checkpoint folder with its weights streamed from its safetensors files.

    ``args`` default to ``input_ids`` of shape ``(1, 8)``. ``options`` go to
    :func:`~onnx_modular.export_modular` (``verify``, ``dynamic_shapes``, ...).

    Example::

        from onnx_modular.checkpoint import export_checkpoint
        result = export_checkpoint("llama-8b/", "llama.onnx")
        print(result.blocks)
    """
    from onnx_modular.export import export_modular

    model = model_on_meta(checkpoint, model_class=model_class, dtype=dtype)
    if args is None and kwargs is None:
        vocab = getattr(model.config, "vocab_size", 32) or 32
        args = (torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(0)),)
        kwargs = {"use_cache": False} if "use_cache" in _forward_parameters(model) else None
    return export_modular(model, args if args is not None else (), f, kwargs=kwargs, weights=checkpoint, **options)


def _forward_parameters(model: torch.nn.Module) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()
