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
from onnx_modular.hf.meta import model_on_meta, on_meta, zero_cache

__all__ = [
    "TASKS",
    "check_checkpoint_folder",
    "GENERATION_TASKS",
    "load_checkpoint",
    "meta_checkpoint",
    "sample_inputs",
    "dynamic_shapes",
    "model_and_inputs",
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


# Size fields a config may carry (top level or in a nested text/vision config).
_WIDTHS = ("hidden_size", "n_embd", "d_model", "dim", "embed_dim")
_DEPTHS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers")
_COUNTS = (*_WIDTHS, *_DEPTHS, "vocab_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
           "head_dim", "n_head", "n_inner", "d_ff", "d_kv", "num_heads", "max_position_embeddings",
           "n_positions", "image_size", "patch_size", "num_channels", "num_labels")  # fmt: skip
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
    return total


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
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from onnx_modular.errors import InvalidModelFileError
    from onnx_modular.files.load import read_regular_file
    from onnx_modular.weights.sources import _parse_json

    file = folder / "config.json"
    shown_file = repr(str(file))
    try:
        config = _parse_json(read_regular_file(file, str(file), limit=_CONFIG_LIMIT))
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
            if value is not None and not (type(value) is int and value >= 0) and not (key == "image_size" and isinstance(value, list)):
                raise InvalidInputError(f"{shown_file} sets {key} to {value!r}; it must be a non-negative integer.")
        for key in ("dtype", "torch_dtype"):
            value = part.get(key)
            if value is not None and value not in _DTYPES:
                raise InvalidInputError(f"{shown_file} sets {key} to {value!r}; expected one of {', '.join(_DTYPES)}.")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        pickled = sorted(p.name for pattern in _PICKLED for p in folder.glob(pattern))
        raise InvalidInputError(
            f"{str(folder)!r} holds no safetensors weights"
            + (f" (only {', '.join(pickled[:3])}: pickled weights are never unpickled, as loading runs code)." if pickled else "."),
            hint="Convert the weights to safetensors (save_pretrained(..., safe_serialization=True)) in a trusted environment.",
        )
    stored = sum(p.stat().st_size for p in weights if p.is_file())
    smallest = _estimated_parameters(config) // 2  # bytes, at 4 bits a parameter
    if smallest > 4 * stored + 2**20:
        raise InvalidInputError(
            f"{shown_file} describes a model of at least {_estimated_parameters(config):.3g} parameters, but the folder "
            f"holds {stored / 1e6:.1f} MB of weights: the config and the weights do not belong together.",
            hint="Check hidden_size, num_hidden_layers and vocab_size in config.json against the weights.",
        )


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
