"""Greedy generation with an exported decoder in onnxruntime, torch-free: the one home of the
decoding loop (``onnx_modular.generate``, ``onnx-modular generate``, and
``onnx_modular.hf.greedy_generate`` over an ``export_for_generation`` result).

It runs every with-cache file onnx_modular writes, converted (float16, int4) or not:

* one file of ``export --task causal-lm-with-past`` (or ``export_modular`` with a cache): the
  cache inputs are ``input.<name>.layers.N.keys`` / ``.values`` (``<name>`` is ``past_key_values``
  on transformers 5.23, ``cache`` on 5.24) and the outputs ``output.<name>.layers.N.keys``; with
  ``--io-names optimum`` the inputs are ``past_key_values.N.key`` and the outputs ``present.N.key``;
* a ``--generation`` folder: ``prefill.onnx`` (no cache inputs; returns ``past_key_values...``)
  and ``decode.onnx`` (takes ``input.past_key_values...``).

The cache is found by name: an input and an output are the same cache tensor when their names
agree once the ``input.`` / ``output.`` prefixes are dropped and ``present.`` is read as
``past_key_values.``. The first step feeds an empty past (``[batch, kv_heads, 0, head_dim]``, the
sizes and dtype the file declares; zeros for a recurrent or convolution layer's state, whose sizes
are fixed), the attention mask grows by one each step, ``position_ids``
and ``cache_position`` are fed when the file has them, and each returned cache tensor is fed back.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnx_modular.errors import InvalidInputError
from onnx_modular.runtime.decoder_checks import (
    check_length,
    check_vocabulary,
    components,
    file_bounds,
    logits_name,
    new_tokens,
    token_ids,
)
from onnx_modular.runtime.sessions import run, session

__all__ = ["generate", "generate_with_sessions", "cache_key", "decoder_files", "greedy_steps", "step_inputs", "MADE_INPUTS",
           "is_state", "past_axis", "prompt_logits", "prompt_feeds"]

#: onnxruntime's type names -> numpy dtypes of the inputs the loop makes.
_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
}
_MADE = ("input_ids", "attention_mask", "position_ids", "cache_position")
#: The inputs the loop makes each step (the cache aside): :func:`step_inputs`.
MADE_INPUTS = _MADE


def cache_key(name: str) -> str:
    """The name a cache tensor has as an input and as an output alike:
    ``input.past_key_values.layers.0.keys`` and ``output.past_key_values.layers.0.keys`` are
    ``past_key_values.layers.0.keys``; Optimum's ``present.0.key`` is ``past_key_values.0.key``."""
    for prefix in ("input.", "output."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    if name.startswith("present."):
        name = "past_key_values." + name[len("present.") :]
    return name


def decoder_files(path: str | os.PathLike) -> tuple[str, str]:
    """The files of the prefill and of the decode steps: the same file twice for one ``.onnx`` file
    (or a folder with ``model.onnx``), ``prefill.onnx`` and ``decode.onnx`` for a ``--generation``
    folder (read from its ``export.json`` when it names them)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return path, path
    if not os.path.isdir(path):
        raise InvalidInputError(
            f"{path!r} does not exist.",
            hint="Give a .onnx file exported with its cache (export --task causal-lm-with-past) "
            "or a folder written by `export --generation` (prefill.onnx and decode.onnx).",
        )
    named = components(path)  # export.json, checked: its files inside the folder, through no link
    if named:
        return str(named["prefill"]), str(named["decode"])
    prefill, decode = (os.path.join(path, f"{name}.onnx") for name in ("prefill", "decode"))
    if os.path.isfile(prefill) and os.path.isfile(decode):
        return prefill, decode
    single = os.path.join(path, "model.onnx")
    if os.path.isfile(single):
        return single, single
    raise InvalidInputError(
        f"The folder {path!r} has neither prefill.onnx and decode.onnx nor model.onnx.",
        hint="Give the folder `export --generation` wrote, or the .onnx file itself.",
    )


@dataclass
class _Signature:
    """What the loop feeds one file and reads back from it."""

    session: Any
    inputs: dict[str, Any]  # name -> onnxruntime NodeArg
    cache_inputs: dict[str, str]  # cache_key -> input name
    cache_outputs: dict[str, str]  # cache_key -> output name
    logits: str


def _signature(sess: Any, what: str) -> _Signature:
    inputs = {arg.name: arg for arg in sess.get_inputs()}
    outputs = [arg.name for arg in sess.get_outputs()]
    cache_inputs = {cache_key(name): name for name in inputs if name not in _MADE}
    # keys and values ([batch, heads, past, head]), and the states of a recurrent or convolution layer by name
    # (``conv_states.0``, ``recurrent_states.0``: fixed sizes, fed back as they come)
    cache_outputs = {cache_key(name): name for name in outputs
                     if len(_shape(sess, name, outputs=True)) == 4 or cache_key(name) in cache_inputs}
    unknown = [name for key, name in cache_inputs.items()
               if len(inputs[name].shape) != 4 and not is_state(name) and past_axis(inputs[name].shape) is None]
    if unknown:
        raise InvalidInputError(
            f"The {what} takes {unknown}, which the generation loop cannot build (it makes "
            f"{', '.join(_MADE)} and the cache).",
            hint="Run the file yourself with onnxruntime, feeding those inputs; the loop of "
            "onnx_modular/runtime/generation.py is the recipe.",
        )
    logits = logits_name({name: _shape(sess, name, outputs=True) for name in outputs}, set(cache_outputs.values()), what)
    return _Signature(sess, inputs, cache_inputs, cache_outputs, logits)


def _shape(sess: Any, name: str, outputs: bool = False) -> list:
    args = sess.get_outputs() if outputs else sess.get_inputs()
    return next(arg.shape for arg in args if arg.name == name)


#: The last name of a cache tensor that holds keys or values (``keys``, Optimum's ``key``); any other is a
#: recurrent or convolution layer's state (``conv_states.0``, ``recurrent_states.0``).
_KEYS_AND_VALUES = ("key", "keys", "value", "values")


def is_state(name: str) -> bool:
    """Whether the cache input or output ``name`` is a layer's state of fixed size (a convolution's last
    inputs, a recurrence's state: transformers' ``LinearAttentionLayer``), not keys or values that grow."""
    parts = cache_key(name).split(".")
    return parts[-1] not in _KEYS_AND_VALUES and any(part.endswith("_states") for part in parts)


def past_axis(shape: Sequence[Any]) -> int | None:
    """The axis of ``shape`` (an input's, as onnxruntime or onnx_ir gives it) named
    ``past_sequence_length`` (``None``: none is): where a cache tensor of another layout than
    ``[batch, heads, past, head]`` grows (a sparse attention's indexer keys, ``[batch, past, head]``)."""
    return next((i for i, d in enumerate(shape) if str(getattr(d, "value", d)) == "past_sequence_length"), None)


def _empty_past(arg: Any, batch: int, what: str) -> np.ndarray:
    """``[batch, kv_heads, 0, head_dim]`` in the dtype the file declares for this cache input; zeros of
    its fixed sizes for a state (:func:`is_state`), as transformers starts one; 0 on the
    :func:`past_axis` of a cache of another layout."""
    dims = list(arg.shape)
    if is_state(arg.name):
        sizes = [batch, *dims[1:]]
    elif len(dims) != 4 and past_axis(dims) is not None:
        sizes = [batch, *[0 if i == past_axis(dims) else d for i, d in enumerate(dims)][1:]]
    else:
        sizes = [batch, dims[1], 0, dims[3]]
    if not all(isinstance(size, int) for size in sizes):
        raise InvalidInputError(
            f"The {what}'s cache input {arg.name!r} has shape {dims}: the heads and head size (a state's every "
            "size but the batch) must be fixed numbers to build an empty past.",
            hint="Export with the heads and head size static (transformers' exporter and "
            "`export --task causal-lm-with-past` specialize them).",
        )
    return np.zeros(sizes, _dtype(arg))


def _dtype(arg: Any) -> type:
    dtype = _DTYPES.get(arg.type)
    if dtype is None:
        raise InvalidInputError(
            f"Input {arg.name!r} is a {arg.type}, which the generation loop does not make.",
            hint="Convert the file's inputs to float32, float16 or int64 (onnx-modular convert keeps them).",
        )
    return dtype


def step_inputs(inputs: dict[str, Any], step: np.ndarray, past: int) -> dict[str, np.ndarray]:
    """The inputs the loop makes for one step of ``step`` (``[batch, length]`` token ids) after
    ``past`` cached positions, for those of :data:`MADE_INPUTS` that ``inputs`` (name -> onnxruntime
    NodeArg) declares, in the dtype each declares: the ids, a mask of ones over ``past + length``,
    the positions ``past .. past + length - 1`` as ``position_ids`` and ``cache_position``."""
    batch, length = step.shape
    positions = np.arange(past, past + length, dtype=np.int64)
    made = {
        "input_ids": step,
        "attention_mask": np.ones((batch, past + length), np.int64),
        "position_ids": np.broadcast_to(positions, (batch, length)),
        "cache_position": positions,
    }
    return {name: made[name].astype(_dtype(arg), copy=False) for name, arg in inputs.items() if name in made}


def empty_past(arg: Any, batch: int, what: str) -> np.ndarray:
    """``[batch, kv_heads, 0, head_dim]`` in the dtype the file declares for the cache input ``arg``."""
    return _empty_past(arg, batch, what)


def _feeds(signature: _Signature, step: np.ndarray, past: int, cache: dict[str, np.ndarray], what: str) -> dict:
    feeds = step_inputs(signature.inputs, step, past)
    for key, name in signature.cache_inputs.items():
        value = cache.get(key)
        feeds[name] = _empty_past(signature.inputs[name], step.shape[0], what) if value is None else value
    return feeds


def greedy_steps(tokens: np.ndarray, max_new_tokens: int) -> Generator[tuple[np.ndarray, int], np.ndarray, np.ndarray]:
    """The greedy loop as a generator, for any way of running the model: yields ``(step, past)``
    (the ids to run, ``[batch, length]``, after ``past`` cached positions: the prompt first, then
    one token a step) and is sent the last position's logits (``[batch, vocab]``); returns the
    prompt followed by ``max_new_tokens`` tokens. One loop for one session, a prefill and a decode
    session, and a split decoder's stages in one process or on Ray workers (``runtime/pipeline.py``),
    several sequences of which are driven at once."""
    step, past = tokens, 0
    for _ in range(max_new_tokens):
        logits = yield step, past
        past += step.shape[1]
        step = np.asarray(logits).argmax(axis=-1).astype(np.int64)[:, None]
        tokens = np.concatenate([tokens, step], axis=1)
    return tokens


def generate_with_sessions(prefill: Any, decode: Any, input_ids: Any, max_new_tokens: int,
                           progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """Greedy generation with onnxruntime sessions: ``prefill`` runs the prompt, ``decode`` each new
    token (the same session for a file that does both). Returns the prompt followed by
    ``max_new_tokens`` tokens (``int64``, ``[batch, prompt + new]``), as transformers'
    ``generate(do_sample=False, min_new_tokens=max_new_tokens)`` does without a stop token.
    ``progress(done, max_new_tokens)`` is called as each new token is chosen.

    Raises:
        InvalidInputError: ``input_ids`` is not ``[batch, length]``, a file takes an input the loop
            cannot build, or ``decode`` takes a cache tensor ``prefill`` does not return.
    """
    tokens, max_new_tokens = token_ids(input_ids), new_tokens(max_new_tokens)  # typed errors, never numpy's
    check_length(tokens.shape[1], max_new_tokens, None)
    steps = {"prefill": _signature(prefill, "prefill"), "decode": _signature(decode, "decode")}
    for signature in steps.values():
        vocabulary = _shape(signature.session, signature.logits, outputs=True)[-1]
        check_vocabulary(tokens, vocabulary if isinstance(vocabulary, int) and vocabulary > 0 else None)
    missing = sorted(set(steps["decode"].cache_inputs) - set(steps["prefill"].cache_outputs))
    if missing:
        raise InvalidInputError(
            f"The decode step takes cache inputs {missing} that the prefill step does not return.",
            hint="Give the prefill and decode files of one export (`export --generation`), or one with-cache file.",
        )
    cache: dict[str, np.ndarray] = {}
    loop, what = greedy_steps(tokens, max_new_tokens), "prefill"
    try:
        step, past = next(loop)
        while True:
            signature = steps[what]
            names, outputs = run(signature.session, _feeds(signature, step, past, cache, what), what=f"{what} step")
            values = dict(zip(names, outputs))
            cache = {key: values[name] for key, name in signature.cache_outputs.items()}
            logits = values[signature.logits]
            if logits.ndim != 3 or logits.shape[0] != step.shape[0] or logits.shape[2] == 0:
                raise InvalidInputError(
                    f"The {what} step returned logits of shape {list(logits.shape)}, not [batch {step.shape[0]}, "
                    "sequence, vocabulary].",
                    hint="Give a decoder exported with its cache (export --task causal-lm-with-past).",
                )
            check_vocabulary(tokens, logits.shape[2])  # a vocabulary the file left symbolic, once it is known
            if progress is not None:  # the token this step's logits choose
                progress(past + step.shape[1] - tokens.shape[1] + 1, max_new_tokens)
            what = "decode"
            step, past = loop.send(logits[:, -1, :])
    except StopIteration as done:
        return done.value


def prompt_feeds(sess: Any, input_ids: np.ndarray, head_size: int | None = None) -> dict[str, np.ndarray]:
    """The feeds of a prompt ``input_ids`` (``[batch, length]``) with an empty cache (see :func:`prompt_logits`)."""
    signature = _signature(sess, "file")
    empty = {}
    for key, name in signature.cache_inputs.items():
        arg = signature.inputs[name]
        if head_size is not None and not is_state(name) and not isinstance(arg.shape[3], int) and isinstance(arg.shape[1], int):
            empty[key] = np.zeros((input_ids.shape[0], arg.shape[1], 0, head_size), _dtype(arg))
    return _feeds(signature, np.asarray(input_ids, dtype=np.int64), 0, empty, "file")


def prompt_logits(sess: Any, input_ids: np.ndarray, head_size: int | None = None) -> np.ndarray:
    """The logits of every position of each row of ``input_ids`` (``[n, length]``), each row a prompt
    with an empty cache, run alone (a fused attention takes a multi-token prompt at batch 1):
    ``[n, length, vocab]`` float32. The prefill step of :func:`generate_with_sessions`.
    ``head_size``: of a cache whose file leaves it symbolic (onnxruntime-genai's builder: ``kv_cache_dim``)."""
    signature = _signature(sess, "file")
    rows = []
    for row in np.asarray(input_ids, dtype=np.int64):
        names, outputs = run(sess, prompt_feeds(sess, row[None, :], head_size), what="prompt")
        rows.append(np.asarray(dict(zip(names, outputs))[signature.logits][0], dtype=np.float32))
    return np.stack(rows)


def generate(
    path: str | os.PathLike,
    input_ids: Sequence[Sequence[int]] | Sequence[int] | np.ndarray,
    max_new_tokens: int = 20,
    *,
    execution_provider: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> np.ndarray:
    """Greedy generation in onnxruntime with a with-cache file onnx_modular wrote: one ``.onnx``
    (``export --task causal-lm-with-past``, transformers' or Optimum's names, converted to
    float16 or int4 or not) or a ``--generation`` folder (``prefill.onnx`` + ``decode.onnx``).

    ``input_ids``: ``[batch, length]`` token ids (a flat list is one sequence). Returns the prompt
    followed by ``max_new_tokens`` greedy tokens, ``int64`` ``[batch, length + max_new_tokens]``,
    the tokens of transformers' ``model.generate(ids, do_sample=False, max_new_tokens=n,
    min_new_tokens=n)``. ``progress(done, max_new_tokens)`` is called as each new token is chosen
    (the command line prints a line from it every few seconds on a long run).

    Example::

        import onnx_modular
        tokens = onnx_modular.generate("llama.int4.onnx", [[1, 306, 4966]], max_new_tokens=20)

    Raises:
        InvalidInputError: The path is missing, or the file takes inputs the loop cannot build.
        VerificationError: onnxruntime cannot load or run a file.
    """
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise InvalidInputError(f"path must be a file or folder path, not {type(path).__name__}.", hint='generate("model.onnx", [[1, 2]])')
    ids, max_new_tokens = token_ids(input_ids), new_tokens(max_new_tokens)
    prefill_file, decode_file = decoder_files(path)
    for file in dict.fromkeys((prefill_file, decode_file)):  # call bombs, endless Loops: refused before onnxruntime
        check_length(ids.shape[1], max_new_tokens, file_bounds(file), what=repr(str(file)))
    prefill = session(prefill_file, execution_provider, what=f"file {prefill_file!r}")
    decode = prefill if decode_file == prefill_file else session(decode_file, execution_provider, what=f"file {decode_file!r}")
    return generate_with_sessions(prefill, decode, ids, max_new_tokens, progress)
