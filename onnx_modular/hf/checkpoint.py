"""From a local checkpoint (a folder as ``save_pretrained`` writes it) to a model and sample inputs.

:func:`model_and_inputs` is the one entry point: the model for a task, sample inputs for it, and
dynamic shapes marking the batch and sequence axes (the cache's past axis too). Nothing is
downloaded: a name that is not a local folder must already be in the Hugging Face cache.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import torch
import transformers

from onnx_modular.capture.diagnostics import module_path_from_traceback
from onnx_modular.errors import CaptureError, InvalidInputError, OnnxModularError
from onnx_modular.format.text import first_line
from onnx_modular.hf.cache_axes import dynamic_shapes
from onnx_modular.hf.meta import (
    check_checkpoint_config,
    check_checkpoint_folder,
    model_on_meta,
    on_meta,
    zero_cache,
)
from onnx_modular.hf.versions import CACHE_ARGUMENTS, cache_argument, returned_cache

__all__ = [
    "TASK_ALIASES",
    "DTYPES",
    "DTYPE_ALIASES",
    "resolve_task",
    "infer_task",
    "supported_tasks",
    "check_supported",
    "GENERATION_TASKS",
    "TASKS",
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

#: ``--dtype`` names -> torch dtypes (as Optimum's ``--dtype``): the precision the model is exported in.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

#: Optimum's spellings of :data:`DTYPES` (``optimum-cli export onnx --dtype fp16``) -> ours.
DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

#: Optimum's task names (``optimum-cli export onnx --task``) -> ours.
TASK_ALIASES: dict[str, str] = {
    "text-generation": "causal-lm",
    "text-generation-with-past": "causal-lm-with-past",
    "fill-mask": "masked-lm",
    "text2text-generation": "seq2seq-lm",
}

#: The end of a class name in ``config.architectures`` -> the task inferred when none is given
#: (a causal LM with its cache, as Optimum infers ``text-generation-with-past``).
_ARCHITECTURE_TASKS = (
    ("ForCausalLM", "causal-lm-with-past"),
    ("ForMaskedLM", "masked-lm"),
    ("ForConditionalGeneration", "seq2seq-lm"),
    ("ForSeq2SeqLM", "seq2seq-lm"),
    ("ForImageClassification", "image-classification"),
    ("Model", "feature-extraction"),
)

#: Tasks whose model ``generate``s (``--generation`` exports its prefill and decode components).
GENERATION_TASKS = ("causal-lm", "causal-lm-with-past", "seq2seq-lm")

# Sample sizes: distinct and > 1, so that torch.export keeps each axis symbolic.
BATCH, SEQUENCE, PAST, DECODER_SEQUENCE = 2, 7, 4, 5



def _model_class(config: Any, task: str) -> type | None:
    """The class :data:`TASKS`' auto class builds for ``config`` (``None``: that auto class has none),
    or the one :func:`_named_class` finds."""
    try:
        return getattr(transformers, TASKS[task])._model_mapping[type(config)]
    except (KeyError, ValueError, AttributeError):
        return _named_class(config, task)


def _loader(config: Any, task: str) -> Any:
    """What builds ``config``'s model for ``task``: the task's auto class, or :func:`_named_class`'s class
    where the auto class has none for ``config``'s type."""
    auto_class = getattr(transformers, TASKS[task])
    try:
        auto_class._model_mapping[type(config)]
    except (KeyError, ValueError, AttributeError):
        return _named_class(config, task) or auto_class
    return auto_class


def _named_class(config: Any, task: str) -> type | None:
    """The class ``config.architectures`` names when the task's auto class maps it under another model
    type and the class is built from ``config``'s type: ``Emu3ForCausalLM`` and ``MllamaForCausalLM``,
    mapped under the composite ``emu3`` and ``mllama`` and built from their text configs (what a
    checkpoint of the text model alone holds)."""
    names = getattr(getattr(getattr(transformers, TASKS[task]), "_model_mapping", None), "_model_mapping", {})
    name = next(iter(getattr(config, "architectures", None) or []), None)
    if not isinstance(name, str) or name not in set(names.values()):
        return None
    model_class = getattr(transformers, name, None)
    return model_class if getattr(model_class, "config_class", None) is type(config) else None


def _input_of(task: str, config: Any) -> str:
    """The input :func:`sample_inputs` makes for ``task``: token ids, or an image's pixel values."""
    if task == "image-classification" or (task == "feature-extraction" and not hasattr(config, "vocab_size")):
        return "pixel_values"
    return "input_ids"


def supported_tasks(config: Any) -> dict[str, str]:
    """``{task: model class name}``: the tasks of :data:`TASKS` that ``config`` exports for: the task's
    auto class has a model for it, whose ``forward`` takes the input :func:`sample_inputs` makes
    (token ids or pixel values; Whisper's ``input_features`` are not made) and, with the cache,
    a cache (``past_key_values``, or ``cache`` since transformers 5.24)."""
    tasks = {}
    for task in TASKS:
        model_class = _model_class(config, task)
        if model_class is None:
            continue
        parameters = inspect.signature(model_class.forward).parameters
        takes_cache = any(name in parameters for name in CACHE_ARGUMENTS)  # `cache` since transformers 5.24
        if _input_of(task, config) in parameters and (task != "causal-lm-with-past" or takes_cache):
            tasks[task] = model_class.__name__
    return tasks


def check_supported(config: Any, task: str, source: str | os.PathLike) -> None:
    """Refuse, before any loading, a task the checkpoint's model cannot be exported for, naming
    the tasks it can (or saying that none fits, and how to export it from Python)."""
    supported = supported_tasks(config)
    if task in supported:
        return
    model_type = getattr(config, "model_type", type(config).__name__)
    architecture = next(iter(getattr(config, "architectures", None) or []), model_type)
    model_class = _model_class(config, task)
    if model_class is None:
        why = f"transformers has no {TASKS[task]} for {model_type!r} models"
    else:
        parameters = [p for p in inspect.signature(model_class.forward).parameters if p != "self"]
        needed = _input_of(task, config)
        why = (
            f"{model_class.__name__}.forward takes no KV cache ({' or '.join(CACHE_ARGUMENTS)})"
            if needed in parameters
            else f"{model_class.__name__}.forward takes {parameters[0] if parameters else 'no input'}, "
            f"where the checkpoint export makes {needed}"
        )
    if supported:
        hint = (
            "Use --task " + " or --task ".join(f"{name} ({cls})" for name, cls in supported.items())
            + f"; to export {architecture} itself, use Python with inputs you build (export_modular(model, args, "
            "'m.onnx', kwargs=...), or a factory: onnx-modular export my_model.py:make -o m.onnx)."
        )
    else:
        hint = (
            f"No task of the checkpoint export fits {architecture} (tasks: {', '.join(TASKS)}). Export it from "
            "Python with inputs you build: export_modular(model, args, 'm.onnx', kwargs=...), or from a factory "
            "returning (model, args, kwargs): onnx-modular export my_model.py:make -o m.onnx."
        )
    raise InvalidInputError(f"{str(source)!r} ({architecture}) cannot be exported for task {task!r}: {why}.", hint=hint)


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise InvalidInputError(
            f"Unknown task {task!r}.", hint=f"Use one of: {', '.join(TASKS)} (or Optimum's {', '.join(TASK_ALIASES)})."
        )


def resolve_task(task: str) -> str:
    """Our name of ``task``: one of :data:`TASKS`, or an Optimum name (:data:`TASK_ALIASES`)."""
    task = TASK_ALIASES.get(task, task)
    _check_task(task)
    return task


def infer_task(source: str | os.PathLike) -> tuple[str, str]:
    """``(task, architecture)``: the task of the checkpoint's ``config.architectures[0]``.

    Raises:
        InvalidInputError: No config, no architectures, or one whose task is not known.
    """
    if os.path.lexists(pathlib.Path(source) / "config.json"):
        check_checkpoint_config(pathlib.Path(source))  # before transformers reads it
    try:
        config = transformers.AutoConfig.from_pretrained(source, local_files_only=True)
    except Exception as e:
        raise InvalidInputError(
            f"Cannot read the config of {str(source)!r} to infer the task: {type(e).__name__}: "
            f"{first_line(e)}",
            hint="Pass --task (see onnx-modular export --help), or fix config.json.",
        ) from e
    architectures = getattr(config, "architectures", None) or []
    for architecture in architectures[:1]:
        for suffix, task in _ARCHITECTURE_TASKS:
            if isinstance(architecture, str) and architecture.endswith(suffix):
                if task == "seq2seq-lm" and not getattr(config, "is_encoder_decoder", False):
                    break
                check_supported(config, task, source)  # Whisper's seq2seq-lm: say what fits instead
                return task, architecture
    supported = supported_tasks(config)
    raise InvalidInputError(
        f"Cannot infer the task of {str(source)!r} from config.architectures ({architectures or 'none'}).",
        hint=f"Pass --task: one of {', '.join(supported)} (what this model supports)." if supported
        else f"No task of the checkpoint export ({', '.join(TASKS)}) fits this model: export it from Python "
        "with inputs you build (export_modular, or a factory: onnx-modular export my_model.py:make -o m.onnx).",
    )


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in DTYPES:
        raise InvalidInputError(
            f"Unknown dtype {dtype!r}.", hint=f"Use one of: {', '.join(DTYPES)} (or Optimum's {', '.join(DTYPE_ALIASES)})."
        )
    return DTYPES[dtype]


@contextlib.contextmanager
def _transformers_log() -> Iterator[io.StringIO]:
    """What transformers logs inside the block (its load report names the checkpoint's tensors),
    kept instead of printed raw: a failure quotes it in its typed error, whose text the CLI
    escapes like every name that comes from a file."""
    logger = transformers.utils.logging._get_library_root_logger()
    text = io.StringIO()
    handler = logging.StreamHandler(text)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handlers = logger.handlers[:]
    logger.handlers = [handler]
    try:
        yield text
    finally:
        logger.handlers = handlers


def load_checkpoint(source: str | os.PathLike, task: str, *, dtype: str | torch.dtype | None = None) -> torch.nn.Module:
    """The model of ``source`` for ``task``, in eval mode.

    ``source`` is a folder with ``config.json`` and weights (as ``save_pretrained`` writes
    them), or a Hub id whose files are already in the local cache (nothing is downloaded).
    ``dtype`` (``"float32"``, ``"float16"``, ``"bfloat16"`` or a torch dtype): the precision of
    the model; default: the checkpoint's own (``config.json``'s ``dtype``).

    Raises:
        InvalidInputError: No such folder, no config, no weights, a name not in the local
            cache, or a model that has no head for ``task``.
    """
    _check_task(task)
    dtype = _dtype(dtype)
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
    try:
        config = transformers.AutoConfig.from_pretrained(source, local_files_only=True)
    except OSError as e:
        raise InvalidInputError(
            f"{str(source)!r} is neither a local folder nor a model in the local Hugging Face cache "
            "(onnx_modular never downloads).",
            hint="Download it first (hf download NAME), or pass the folder save_pretrained wrote.",
        ) from e
    except Exception as e:
        raise InvalidInputError(
            f"transformers refuses the config of {str(source)!r}: {type(e).__name__}: {first_line(e)}",
            hint="Fix config.json (save_pretrained writes it).",
        ) from e
    check_supported(config, task, source)
    try:
        with _transformers_log() as log:
            model = _loader(config, task).from_pretrained(
                source, config=config, local_files_only=True, use_safetensors=True,
                **({"dtype": dtype} if dtype is not None else {}),
            )
    except ValueError as e:
        raise InvalidInputError(
            f"A {config.model_type!r} model has no {TASKS[task]} for task {task!r}: {first_line(e)}",
            hint=f"Choose a task this architecture supports (tasks: {', '.join(TASKS)}).",
        ) from e
    except Exception as e:
        report = "\n".join(line for line in log.getvalue().splitlines() if "MISMATCH" in line or "MISSING" in line)
        raise InvalidInputError(
            f"Loading the weights of {str(source)!r} failed: {type(e).__name__}: {first_line(e)}"
            + (f"\ntransformers' load report:\n{report}" if report else ""),
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
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        return {"pixel_values": torch.randn((BATCH, channels, *size), generator=generator).to(dtype)}
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
                try:
                    cache = returned_cache(model(input_ids=prefix, use_cache=True))
                    cache = _whole_cache(model, prefix, cache)
                except Exception as exc:  # the checkpoint's own forward: a config that does not fit the class
                    raise _forward_failed(model, exc) from exc
            if cache is None:
                raise _no_cache(model)
        inputs["attention_mask"] = torch.ones(BATCH, PAST + SEQUENCE, dtype=torch.long)
        inputs[cache_argument(model)] = cache
    return inputs


def _whole_cache(model: torch.nn.Module, prefix: torch.Tensor, cache: Any) -> Any:
    """``cache`` with every sliding-window layer keeping its whole past, as ``export --genai`` keeps it:
    transformers' sliding layer (``DynamicSlidingWindowLayer``) is a rolling buffer of the last window's
    keys (its length stops growing, and a 0-d window size rides along), which a file of keys and values
    that grow by the new tokens each step cannot be; with the whole past the graph masks the window, as
    transformers' mask does. The other layers (full, convolution, recurrent) stay as the model made them."""
    from transformers import cache_utils

    # the sliding layers and their whole-past counterparts (a hybrid layer keeps its convolution states)
    whole_of = {cache_utils.DynamicSlidingWindowLayer: lambda layer: cache_utils.DynamicLayer()}
    hybrid = getattr(cache_utils, "LinearAttentionAndSlidingWindowAttentionLayer", None)
    if hybrid is not None and hasattr(cache_utils, "LinearAttentionAndFullAttentionLayer"):
        whole_of[hybrid] = lambda layer: cache_utils.LinearAttentionAndFullAttentionLayer(
            number_of_states=layer.number_of_states)
    layers = getattr(cache, "layers", None)
    if type(cache) is not cache_utils.DynamicCache or not layers or not any(type(layer) in whole_of for layer in layers):
        return cache
    whole = cache_utils.DynamicCache(config=model.config)
    if len(whole.layers) != len(layers):
        return cache
    whole.layers = [whole_of[type(layer)](layer) if type(layer) in whole_of else layer for layer in whole.layers]
    return returned_cache(model(input_ids=prefix, use_cache=True, **{cache_argument(model): whole}))


def _forward_failed(model: torch.nn.Module, exc: Exception) -> CaptureError:
    return CaptureError(
        f"{type(model).__name__} failed to run in PyTorch on token ids, before any export: {type(exc).__name__}: "
        f"{first_line(exc)}",
        module_path=module_path_from_traceback(exc, model),
        hint="The checkpoint's config.json may not fit its class (hidden_size, num_attention_heads, head_dim, "
             "vocab_size): check that transformers runs the model on token ids.")


def _no_cache(model: torch.nn.Module) -> InvalidInputError:
    """The model ran with ``use_cache=True`` and returned no cache: a class that is a decoder only when its
    config says so (BERT-family ``*ForCausalLM`` with ``is_decoder`` false attends both ways)."""
    name = type(model).__name__
    if getattr(model.config, "is_decoder", None) is False:
        return InvalidInputError(
            f"{name} returned no cache for task 'causal-lm-with-past': its config has is_decoder=false, so it runs "
            "as an encoder (every token attends to every other) and keeps no keys and values.",
            hint='Set "is_decoder": true in config.json to export it as a decoder with its cache, '
                 "or export it with --task causal-lm.")
    return InvalidInputError(f"{name} returned no cache (past_key_values) when run with use_cache=True.",
                             hint="Export it with --task causal-lm (no cache), or check the config's use_cache.")


def model_and_inputs(
    source: str | os.PathLike,
    task: str,
    *,
    static: bool = False,
    generation: bool = False,
    stream_weights: bool = False,
    dtype: str | torch.dtype | None = None,
) -> tuple[torch.nn.Module, dict[str, Any], dict[str, Any] | None]:
    """``(model, sample inputs, dynamic shapes or None)`` for exporting ``source`` for ``task``.

    The seam where a checkpoint becomes something to export. With ``stream_weights`` the model
    is built on the meta device (:func:`~onnx_modular.hf.meta.model_on_meta`) and its weights
    are never loaded: export it with ``export_modular(model, (), f, kwargs=inputs,
    dynamic_shapes=shapes, weights=source)``, which streams them from the folder's safetensors.
    ``dtype``: as for :func:`load_checkpoint` (streamed weights are cast to it as they are read).

    Raises:
        InvalidInputError: ``stream_weights`` with ``generation`` (not supported).
    """
    if generation and task not in GENERATION_TASKS:
        raise InvalidInputError(
            f"Task {task!r} does not generate, so it has no generation components.",
            hint=f"--generation applies to: {', '.join(GENERATION_TASKS)}.",
        )
    if stream_weights:
        model = meta_checkpoint(source, task, generation=generation, dtype=dtype)
    else:
        model = load_checkpoint(source, task, dtype=dtype)
    inputs = sample_inputs(model, task, generation=generation)
    return model, inputs, None if static or generation else dynamic_shapes(inputs)


def meta_checkpoint(
    source: str | os.PathLike, task: str, *, generation: bool = False, dtype: str | torch.dtype | None = None
) -> torch.nn.Module:
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
    try:
        config = transformers.AutoConfig.from_pretrained(source, local_files_only=True)
    except Exception:
        config = None  # an unreadable config is model_on_meta's to report
    if config is not None:
        check_supported(config, task, source)
    auto_class = getattr(transformers, TASKS[task]) if config is None else _loader(config, task)
    try:
        return model_on_meta(source, model_class=auto_class, dtype=_dtype(dtype))
    except OnnxModularError:
        raise
    except (TypeError, KeyError, AttributeError, ArithmeticError, IndexError, RuntimeError) as e:
        raise InvalidInputError(
            f"transformers cannot build the model of {str(source)!r}: {type(e).__name__}: {e}",
            hint="Check the sizes in config.json (heads, head_dim, hidden_size) against each other.",
        ) from e
    except ValueError as e:
        raise InvalidInputError(
            f"This model has no {TASKS[task]} for task {task!r}: {first_line(e)}",
            hint=f"Choose a task this architecture supports (tasks: {', '.join(TASKS)}).",
        ) from e
