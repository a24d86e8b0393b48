"""From a local checkpoint (a folder as ``save_pretrained`` writes it) to a model and sample inputs.

:func:`model_and_inputs` is the one entry point: the model for a task, sample inputs for it, and
dynamic shapes marking the batch and sequence axes (the cache's past axis too). Nothing is
downloaded: a name that is not a local folder must already be in the Hugging Face cache.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import torch
import transformers
from transformers.exporters.exporter_dynamo import get_auto_dynamic_shapes

from onnx_modular.errors import InvalidInputError
from onnx_modular.hf.meta import (
    check_checkpoint_folder,
    model_on_meta,
    on_meta,
    zero_cache,
)

__all__ = [
    "GENERATION_TASKS",
    "TASKS",
    "dynamic_shapes",
    "load_checkpoint",
    "meta_checkpoint",
    "model_and_inputs",
    "sample_inputs",
]

#: task -> the transformers auto class that loads the model for it.
TASKS: dict[str, str] = {
    "feature-extraction": "AutoModel",
    "masked-lm": "AutoModelForMaskedLM",
    "causal-lm": "AutoModelForCausalLM",
    "causal-lm-with-past": "AutoModelForCausalLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "image-classification": "AutoModelForImageClassification",
}

#: Tasks whose model ``generate``s (``--generation`` exports its prefill and decode components).
GENERATION_TASKS = ("causal-lm", "causal-lm-with-past", "seq2seq-lm")

# Sample sizes: distinct and > 1, so that torch.export keeps each axis symbolic.
BATCH, SEQUENCE, PAST, DECODER_SEQUENCE = 2, 7, 4, 5

_SEQUENCE_INPUTS = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise InvalidInputError(f"Unknown task {task!r}.", hint=f"Use one of: {', '.join(TASKS)}.")


def load_checkpoint(source: str | os.PathLike, task: str) -> torch.nn.Module:
    """The model of ``source`` for ``task``, in eval mode.

    ``source`` is a folder with ``config.json`` and weights (as ``save_pretrained`` writes
    them), or a Hub id whose files are already in the local cache (nothing is downloaded).

    Raises:
        InvalidInputError: No such folder, no config, no weights, a name not in the local
            cache, or a model that has no head for ``task``.
    """
    _check_task(task)
    path = pathlib.Path(source)
    if path.is_dir():
        if not os.path.lexists(path / "config.json"):
            raise InvalidInputError(
                f"{str(path)!r} has no config.json, so it is not a transformers checkpoint.",
                hint="Point at the folder save_pretrained wrote (config.json and *.safetensors).",
            )
        check_checkpoint_folder(path)
    elif path.exists():
        raise InvalidInputError(
            f"{str(source)!r} is not a checkpoint folder.",
            hint="Give the folder save_pretrained wrote (config.json and *.safetensors).",
        )
    auto_class = getattr(transformers, TASKS[task])
    try:
        config = transformers.AutoConfig.from_pretrained(source, local_files_only=True)
    except OSError as e:
        raise InvalidInputError(
            f"{str(source)!r} is neither a local folder nor a model in the local Hugging Face cache "
            "(onnx_modular never downloads).",
            hint="Download it first (hf download NAME), or pass the folder save_pretrained wrote.",
        ) from e
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise InvalidInputError(f"transformers refuses the config of {str(source)!r}: {str(e).splitlines()[0]}") from e
    try:
        model = auto_class.from_pretrained(source, config=config, local_files_only=True, use_safetensors=True)
    except ValueError as e:
        raise InvalidInputError(
            f"A {config.model_type!r} model has no {TASKS[task]} for task {task!r}: {str(e).splitlines()[0]}",
            hint=f"Choose a task this architecture supports (tasks: {', '.join(TASKS)}).",
        ) from e
    except (OSError, RuntimeError, TypeError, KeyError, AttributeError) as e:  # shapes that contradict the config, ...
        raise InvalidInputError(
            f"Loading the weights of {str(source)!r} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            hint="Check that the folder holds the weights save_pretrained wrote (*.safetensors) for this config.",
        ) from e
    return model.eval()


def _token_ids(config: Any, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    vocab = getattr(config, "vocab_size", None) or 2
    return torch.randint(0, vocab, shape, generator=generator)


def sample_inputs(model: torch.nn.Module, task: str, *, generation: bool = False) -> dict[str, Any]:
    """Forward inputs for ``task`` (generate inputs when ``generation``), seeded: token ids,
    masks, pixel values, and for ``causal-lm-with-past`` a cache filled by the model itself
    (of zeros for a model on the meta device, which cannot compute one)."""
    _check_task(task)
    config = model.config
    generator = torch.Generator().manual_seed(0)
    if task == "image-classification" or (task == "feature-extraction" and not hasattr(config, "vocab_size")):
        size = getattr(config, "image_size", 32)
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        channels = getattr(config, "num_channels", 3)
        return {"pixel_values": torch.randn((BATCH, channels, *size), generator=generator)}
    input_ids = _token_ids(config, (BATCH, SEQUENCE), generator)
    inputs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if generation:
        return inputs
    if task == "seq2seq-lm":
        inputs["decoder_input_ids"] = _token_ids(config, (BATCH, DECODER_SEQUENCE), generator)
        inputs["use_cache"] = False
    elif task == "causal-lm":
        inputs["use_cache"] = False
    elif task == "causal-lm-with-past":
        prefix = _token_ids(config, (BATCH, PAST), generator)
        if on_meta(model):
            cache = zero_cache(model, BATCH, PAST)
        else:
            with torch.no_grad():
                cache = model(input_ids=prefix, use_cache=True).past_key_values
        inputs["attention_mask"] = torch.ones(BATCH, PAST + SEQUENCE, dtype=torch.long)
        inputs["past_key_values"] = cache
    return inputs


def dynamic_shapes(inputs: dict[str, Any]) -> dict[str, Any]:
    """``Dim.AUTO`` on the batch and sequence axes of ``inputs`` (batch and past for a cache's
    tensors, batch for pixel values); every other axis stays static."""
    auto = torch.export.Dim.AUTO
    shapes: dict[str, Any] = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor):
            if name in _SEQUENCE_INPUTS or name in ("token_type_ids", "position_ids"):
                shapes[name] = {0: auto, 1: auto}
            elif name == "pixel_values":
                shapes[name] = {0: auto}
            else:
                shapes[name] = None
        elif name == "past_key_values":
            # transformers' own structure for the cache, with only batch and past dynamic.
            shapes[name] = torch.utils._pytree.tree_map(
                lambda spec: {0: auto, 2: auto} if len(spec) == 4 else {0: auto},
                get_auto_dynamic_shapes(value),
                is_leaf=lambda spec: isinstance(spec, dict),
            )
        elif not (value is None or isinstance(value, (bool, int, float, str))):
            shapes[name] = get_auto_dynamic_shapes(value)
    return shapes


def model_and_inputs(
    source: str | os.PathLike,
    task: str,
    *,
    static: bool = False,
    generation: bool = False,
    stream_weights: bool = False,
) -> tuple[torch.nn.Module, dict[str, Any], dict[str, Any] | None]:
    """``(model, sample inputs, dynamic shapes or None)`` for exporting ``source`` for ``task``.

    The seam where a checkpoint becomes something to export. With ``stream_weights`` the model
    is built on the meta device (:func:`~onnx_modular.hf.meta.model_on_meta`) and its weights
    are never loaded: export it with ``export_modular(model, (), f, kwargs=inputs,
    dynamic_shapes=shapes, weights=source)``, which streams them from the folder's safetensors.

    Raises:
        InvalidInputError: ``stream_weights`` with ``generation`` (not supported).
    """
    if generation and task not in GENERATION_TASKS:
        raise InvalidInputError(
            f"Task {task!r} does not generate, so it has no generation components.",
            hint=f"--generation applies to: {', '.join(GENERATION_TASKS)}.",
        )
    if stream_weights:
        model = meta_checkpoint(source, task, generation=generation)
    else:
        model = load_checkpoint(source, task)
    inputs = sample_inputs(model, task, generation=generation)
    return model, inputs, None if static or generation else dynamic_shapes(inputs)


def meta_checkpoint(source: str | os.PathLike, task: str, *, generation: bool = False) -> torch.nn.Module:
    """The model of the folder ``source`` for ``task`` on the meta device (weights not loaded).

    Raises:
        InvalidInputError: ``generation`` (its components go through transformers'
            exporter, which needs the weights in memory).
        InvalidInputError: ``source`` is not a folder with ``config.json``, or has no
            head for ``task``.
    """
    _check_task(task)
    if generation:
        raise InvalidInputError(
            "--stream-weights does not export generation components (--generation): they go through "
            "transformers' exporter, which needs the weights in memory.",
            hint="Export --task causal-lm-with-past --stream-weights to one .onnx file (it takes and returns "
            "the cache, which is what decoding needs), or drop --stream-weights if the weights fit in memory.",
        )
    if not pathlib.Path(source).is_dir():
        raise InvalidInputError(
            f"{str(source)!r} is not a folder: --stream-weights reads the weights from a checkpoint folder's "
            "safetensors files.",
            hint="Give the folder save_pretrained wrote (config.json and *.safetensors).",
        )
    if not os.path.lexists(pathlib.Path(source) / "config.json"):
        raise InvalidInputError(
            f"{str(source)!r} has no config.json.", hint="Give a folder written by save_pretrained (config.json and *.safetensors)."
        )
    check_checkpoint_folder(pathlib.Path(source))
    auto_class = getattr(transformers, TASKS[task])
    try:
        return model_on_meta(source, model_class=auto_class)
    except (TypeError, KeyError, AttributeError) as e:
        raise InvalidInputError(f"transformers cannot build the model of {str(source)!r}: {type(e).__name__}: {e}") from e
    except ValueError as e:
        raise InvalidInputError(
            f"This model has no {TASKS[task]} for task {task!r}: {str(e).splitlines()[0]}",
            hint=f"Choose a task this architecture supports (tasks: {', '.join(TASKS)}).",
        ) from e
