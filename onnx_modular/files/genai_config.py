"""``genai_config.json`` for a decoder file with Optimum's cache names: what onnxruntime-genai's
``Generator`` reads beside the model (torch-free: the file's inputs and outputs, ``config.json``
and ``generation_config.json`` as dicts).

The field set is that of onnxruntime-genai's model builder (``make_genai_config`` in
``onnxruntime_genai/models/builders/base.py``, 0.18): ``model`` (type, token ids, context
length, vocabulary, ``decoder`` with the file, head counts and size, hidden size, layers, the
input and output names) and ``search`` (the defaults of ``generation_config.json``). The sizes
genai allocates the cache with (layers, KV heads, head size) are read from the file's
``past_key_values.N.key`` inputs, so the config describes the file, not only the checkpoint.

Example::

    config = genai_config(onnx.load("m.onnx", load_external_data=False), json.load(open("config.json")))
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import onnx

from onnx_modular.errors import OnnxModularError
from onnx_modular.format.text import shown
from onnx_modular.runtime.decoder_checks import cache_positions

__all__ = [
    "GENERIC_TYPE",
    "RUNTIME_TYPES",
    "DecoderIO",
    "GenaiError",
    "config_for",
    "decoder_io",
    "genai_config",
    "genai_type",
    "uses_group_query_attention",
]

#: The ``model.type`` values onnxruntime-genai 0.18's runtime runs as a text decoder (the strings
#: of its ``ModelType::IsLLM``). A checkpoint whose ``model_type`` is among them keeps it.
RUNTIME_TYPES = frozenset({
    "chatglm", "ernie4_5", "gemma", "gemma2", "gemma3_text", "gptoss", "granite", "hunyuandensev1",
    "internlm2", "llama", "mistral", "nemotron", "olmo", "phi", "phimoe", "phi3", "phi3small", "qwen2", "qwen3",
    "smollm3",
})
#: The type of every other decoder: the runtime drives any file with these inputs and outputs the
#: same way (the graph computes everything else), so the plain decoder type is the one to name.
GENERIC_TYPE = "llama"

PAST_NAMES = ("past_key_values.%d.key", "past_key_values.%d.value")
PRESENT_NAMES = ("present.%d.key", "present.%d.value")
#: The inputs genai feeds besides the cache (``position_ids`` only when the file takes it).
FED_INPUTS = ("input_ids", "attention_mask", "position_ids")

_CACHE = re.compile(r"^(past_key_values|present)\.(\d+)\.(key|value)$")

#: ``search`` defaults (the builder's), overridden by ``generation_config.json``'s values.
SEARCH_DEFAULTS: dict[str, Any] = {
    "diversity_penalty": 0.0,
    "do_sample": False,
    "early_stopping": True,
    "length_penalty": 1.0,
    "min_length": 0,
    "no_repeat_ngram_size": 0,
    "num_beams": 1,
    "num_return_sequences": 1,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
}


class GenaiError(OnnxModularError):
    """onnxruntime-genai cannot drive this model (what it lacks is named), or could not load or run
    the folder written for it. Nothing is written."""

    stage = "genai"


@dataclass(frozen=True)
class DecoderIO:
    """What genai needs to know of a decoder file: its fed inputs, layers and cache geometry."""

    inputs: tuple[str, ...]
    layers: int
    kv_heads: int
    head_size: int
    vocab_size: int | None
    uniform: bool = True  # every layer has the same KV heads and head size


def _dims(value: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_param if d.HasField("dim_param") else d.dim_value for d in value.type.tensor_type.shape.dim]


def decoder_io(model: onnx.ModelProto) -> DecoderIO:
    """The inputs, layer count and cache geometry of a decoder file with Optimum's names.

    Raises:
        GenaiError: An input or output genai does not feed or read (a cache of another layout:
            a sliding window's size tensor, a recurrent state), cache names that are not
            ``past_key_values.N.key/value`` and ``present.N.key/value`` for N = 0..L-1, or layers
            whose keys and values differ in size (genai gives both the key's). Layers of different KV heads
            or head sizes are driven (genai reads each layer's from the file) unless the buffer is shared.
    """
    inputs = [v.name for v in model.graph.input]
    outputs = [v.name for v in model.graph.output]
    hint = (
        "Export the checkpoint with --genai (onnx-modular export CKPT --genai -o DIR), which gives the file "
        "these names and a cache of keys and values only."
    )
    unknown = [n for n in inputs if n not in FED_INPUTS and not _CACHE.match(n)]
    unknown += [n for n in outputs if n != "logits" and not _CACHE.match(n)]
    if unknown or "input_ids" not in inputs or "logits" not in outputs:
        raise GenaiError(
            "onnxruntime-genai feeds input_ids, attention_mask, position_ids and past_key_values.N.key/value, and reads "
            f"logits and present.N.key/value; this file has {unknown or 'no input_ids or logits'}, which it cannot feed.",
            hint=hint,
        )
    past = [v for v in model.graph.input if _CACHE.match(v.name)]
    layers = len(past) // 2
    expected = {p % i for p in (*PAST_NAMES, *PRESENT_NAMES) for i in range(layers)}
    if not past or expected != {n for n in (*inputs, *outputs) if _CACHE.match(n)}:
        raise GenaiError(
            "genai drives a cache named past_key_values.N.key/value -> present.N.key/value for every layer N = 0..L-1; "
            f"this file's cache inputs are {[v.name for v in past][:6]}.",
            hint=hint,
        )
    by_name = {v.name: _dims(v) for v in past}
    geometry = [tuple(by_name[PAST_NAMES[0] % i][1::2] + by_name[PAST_NAMES[1] % i][3:4]) for i in range(layers)]
    odd = [i for i, (heads, key, value) in enumerate(geometry) if key != value or not all(isinstance(d, int) and d > 0 for d in (heads, key))]
    if odd:
        raise GenaiError(
            "genai allocates a layer's key and value caches with one head size (the key's); this file's layers "
            f"{odd[:6]} have (KV heads, key size, value size) {sorted({str(geometry[i]) for i in odd})[:4]} "
            "(keys and values of different sizes, as multi-head latent attention has them, or sizes not fixed).",
            hint="Not supported by onnxruntime-genai: run the file with onnxruntime (Optimum's ORTModelForCausalLM).",
        )
    kv_heads, head_size, _ = geometry[0]
    logits = _dims(next(v for v in model.graph.output if v.name == "logits"))
    vocab = logits[-1] if logits and isinstance(logits[-1], int) and logits[-1] > 0 else None
    return DecoderIO(tuple(n for n in FED_INPUTS if n in inputs), layers, kv_heads, head_size, vocab, len(set(geometry)) == 1)


def _nodes(model: onnx.ModelProto) -> Iterable[onnx.NodeProto]:
    yield from model.graph.node
    for function in model.functions:
        yield from function.node


def uses_group_query_attention(model: onnx.ModelProto) -> bool:
    """Whether the file (its main graph or a function body) runs ``com.microsoft.GroupQueryAttention``:
    the one attention op that reads and writes a cache buffer shared by past and present, so
    genai may give both one buffer (``past_present_share_buffer``)."""
    return any(n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft" for n in _nodes(model))


def genai_type(model_type: str | None) -> str:
    """``model.type`` for a checkpoint's ``model_type``: its own when genai's runtime knows it, else
    :data:`GENERIC_TYPE`."""
    return model_type if model_type in RUNTIME_TYPES else GENERIC_TYPE


def _first(config: dict, *names: str) -> Any:
    for source in (config, config.get("text_config") or {}):
        for name in names:
            if source.get(name) is not None:
                return source[name]
    return None


def _token_ids(config: dict, generation: dict) -> tuple[int, int | list[int], int]:
    def pick(name: str) -> Any:
        value = generation.get(name)
        return value if value is not None else _first(config, name)

    eos = pick("eos_token_id")
    if eos is None:
        raise GenaiError(
            "genai stops at the end-of-sequence token, and neither config.json nor generation_config.json names one "
            "(eos_token_id).",
            hint="Set eos_token_id in the checkpoint's generation_config.json (or config.json) and export again.",
        )
    if isinstance(eos, list) and len(eos) == 1:
        eos = eos[0]
    if not _ids(eos if isinstance(eos, list) else [eos]) or eos == []:
        raise GenaiError(
            f"genai stops at the end-of-sequence token; eos_token_id is {shown(repr(eos))[:60]}, not a token id "
            "(an integer >= 0) or a non-empty list of them.",
            hint="Fix eos_token_id in the checkpoint's generation_config.json (or config.json) and export again.",
        )
    bos, pad = pick("bos_token_id"), pick("pad_token_id")
    for name, value in (("bos_token_id", bos), ("pad_token_id", pad)):
        if value is not None and not _ids([value]):
            raise GenaiError(f"{name} is {shown(repr(value))[:60]}, not a token id (an integer >= 0).",
                             hint=f"Fix {name} in the checkpoint's generation_config.json (or config.json).")
    first_eos = eos[0] if isinstance(eos, list) else eos
    return (1 if bos is None else bos), eos, (first_eos if pad is None else pad)


def _ids(values: list) -> bool:
    return all(type(v) is int and 0 <= v < 2**31 for v in values)


def _positive(value: Any, name: str, hint: str) -> int:
    if type(value) is not int or value < 1:
        raise GenaiError(f"{name} is {shown(repr(value))[:60]}; genai needs a positive integer.", hint=hint)
    return value


def _search_value(key: str, value: Any, default: Any) -> Any:
    """A search setting of generation_config.json, of the type genai reads (a bool for a bool, a number >= 0)."""
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    else:
        ok = type(value) in (int, float) and value == value and 0 <= value < 2**31 and (isinstance(default, float) or type(value) is int)
    if not ok:
        raise GenaiError(f"generation_config.json sets {key} to {shown(repr(value))[:60]}; genai reads a "
                         f"{type(default).__name__} there.", hint=f"Fix {key} in generation_config.json (or remove it).")
    return value


def genai_config(
    model: onnx.ModelProto,
    config: dict,
    generation: dict | None = None,
    *,
    filename: str = "model.onnx",
    share_buffer: bool | None = None,
    context_length: int | None = None,
    intra_op_threads: int | None = None,
) -> dict:
    """The ``genai_config.json`` (a dict) of the decoder file ``model`` (its structure; the weights
    need not be loaded), with ``config``/``generation`` the checkpoint's ``config.json`` and
    ``generation_config.json``.

    ``share_buffer``: ``past_present_share_buffer``; by default true exactly when the file runs
    ``GroupQueryAttention`` (:func:`uses_group_query_attention`; the optimized file), false
    otherwise (genai then feeds each step's ``present`` back as the next ``past``).
    ``context_length``: the longest sequence (default ``max_position_embeddings``).
    ``intra_op_threads``: onnxruntime's intra-op thread count in ``session_options`` (default:
    onnxruntime's).

    Raises:
        GenaiError: The file's inputs and outputs are not what genai drives (:func:`decoder_io`),
            or the checkpoint names no end-of-sequence token.
    """
    io = decoder_io(model)
    if share_buffer is None:
        share_buffer = uses_group_query_attention(model)
    return config_for(io, config, generation, filename=filename, share_buffer=share_buffer, context_length=context_length,
                      intra_op_threads=intra_op_threads, cache_rows=cache_positions(model))


def config_for(
    io: DecoderIO,
    config: dict,
    generation: dict | None = None,
    *,
    filename: str | None = "model.onnx",
    share_buffer: bool = False,
    context_length: int | None = None,
    intra_op_threads: int | None = None,
    names: tuple[str, str, str, str] = (*PAST_NAMES, *PRESENT_NAMES),
    cache_rows: int | None = None,
) -> dict:
    """The ``genai_config.json`` (a dict) of a decoder whose inputs and cache are ``io``, with
    ``names`` the templates of its cache (past key, past value, present key, present value;
    ``%d`` the layer); without ``filename`` the decoder names no file (a pipeline lists its own).
    ``cache_rows``: the positions the file's rotary caches hold (:func:`~onnx_modular.runtime.decoder_checks.cache_positions`), if any.

    Raises:
        GenaiError: A shared buffer with layers of different geometries, or no end-of-sequence token.
    """
    generation = generation or {}
    if share_buffer and not io.uniform:
        raise GenaiError(
            "A shared past/present buffer is allocated alike for every layer from the config's num_key_value_heads and "
            "head_size, and this file's layers differ in them.",
            hint="Write the folder with share_buffer=False (genai then feeds each layer's present back as its past).",
        )
    context = context_length if context_length is not None else (
        _first(config, "max_position_embeddings", "seq_length", "n_positions") or 4096)
    context = _positive(context, "The context length (max_position_embeddings)", "Fix max_position_embeddings in config.json.")
    rows = cache_rows
    if rows is not None and rows < context:
        raise GenaiError(
            f"The file's rotary caches hold {rows} positions (optimize --max-positions), fewer than the context length "
            f"{context} genai would run to: past position {rows} its attention reads outside them.",
            hint=f"Optimize with --max-positions {context} (or more), or pass context_length={rows}.",
        )
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    heads = _first(config, "num_attention_heads", "n_head")
    for name, value in (("hidden_size", hidden), ("num_attention_heads", heads), ("vocab_size", _first(config, "vocab_size"))):
        if value is not None:
            _positive(value, f"config.json's {name}", f"Fix {name} in config.json.")
    bos, eos, pad = _token_ids(config, generation)
    session: dict[str, Any] = {"log_id": "onnxruntime-genai", "provider_options": []}
    if intra_op_threads is not None:
        session["intra_op_num_threads"] = int(intra_op_threads)
    search = dict(SEARCH_DEFAULTS)
    for key in search:
        if generation.get(key) is not None and key not in ("early_stopping", "min_length"):
            search[key] = _search_value(key, generation[key], search[key])
    search.update(max_length=int(context), past_present_share_buffer=bool(share_buffer))
    decoder: dict[str, Any] = {
        "session_options": session,
        "filename": filename,
        "head_size": io.head_size,
        "hidden_size": int(hidden) if hidden is not None else io.kv_heads * io.head_size,
        "inputs": {
            **{name: name for name in io.inputs},
            "past_key_names": names[0],
            "past_value_names": names[1],
        },
        "outputs": {"logits": "logits", "present_key_names": names[2], "present_value_names": names[3]},
        "num_attention_heads": int(heads) if heads is not None else io.kv_heads,
        "num_hidden_layers": io.layers,
        "num_key_value_heads": io.kv_heads,
    }
    if filename is None:
        del decoder["filename"]
    return {
        "model": {
            "bos_token_id": bos,
            "context_length": int(context),
            "decoder": decoder,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "type": genai_type(_first(config, "model_type")),
            "vocab_size": _positive(io.vocab_size or _first(config, "vocab_size"), "The vocabulary size (the logits' last "
                                    "dimension, or config.json's vocab_size)", "Set vocab_size in config.json."),
        },
        "search": dict(sorted(search.items())),
    }
