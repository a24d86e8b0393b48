"""The axes and names of a decoder file with its cache: the dynamic axes torch.export is given
(:func:`dynamic_shapes`: Optimum's names, one ``Dim`` per meaning, the cache's own structure),
the names a generation component's torch symbols get (:func:`generation_axis_names`), and the
graph input and output names a file can be given (:data:`IO_NAMINGS`, :func:`optimum_io_names`)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from transformers.exporters.exporter_dynamo import _pytree_flatten, get_auto_dynamic_shapes

from onnx_modular.errors import InvalidInputError
from onnx_modular.hf.versions import CACHE_ARGUMENTS

__all__ = ["dynamic_shapes", "generation_axis_names", "IO_NAMINGS", "optimum_io_names",
           "BATCH_AXIS", "SEQUENCE_AXIS", "PAST_AXIS", "DECODER_SEQUENCE_AXIS", "TOTAL_AXIS"]

_SEQUENCE_INPUTS = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")

#: Axis names, as Optimum names them: one name per meaning, shared by every input and output.
BATCH_AXIS, SEQUENCE_AXIS, PAST_AXIS = "batch_size", "sequence_length", "past_sequence_length"
DECODER_SEQUENCE_AXIS = "decoder_sequence_length"
#: The mask of a step after a prefill covers the past and the new tokens.
TOTAL_AXIS = f"{PAST_AXIS} + {SEQUENCE_AXIS}"


#: Axes of the generation components' inputs, by input name (a cache tensor: ``past_key_values``
#: in its name), named as :func:`dynamic_shapes` names them.
_GENERATION_AXES: dict[str, dict[int, str]] = {
    "input_ids": {0: BATCH_AXIS, 1: SEQUENCE_AXIS},
    "position_ids": {0: BATCH_AXIS, 1: SEQUENCE_AXIS},
    "cache_position": {0: SEQUENCE_AXIS},
    "attention_mask": {0: BATCH_AXIS, 1: TOTAL_AXIS},
    "past_key_values": {0: BATCH_AXIS, 2: PAST_AXIS},
    "cache.layers.": {0: BATCH_AXIS, 2: PAST_AXIS},  # transformers 5.24: input.cache.layers.0.keys
}


def generation_axis_names(model: Any) -> dict[str, str]:
    """``{torch symbol: Optimum's name}`` for a generation component (an ``onnx_ir.Model``), from its
    inputs: ``--generation`` exports through transformers' exporter with every axis ``Dim.AUTO``, so
    torch names them ``s44``, ``s70``; the single-file path names them from its ``Dim``s. The first
    input naming a symbol wins (the prefill's mask shares the ids' sequence symbol)."""
    names: dict[str, str] = {}
    for value in model.graph.inputs:
        axes = next((a for key, a in _GENERATION_AXES.items() if key in value.name), None)
        if axes is None or value.shape is None:
            continue
        for axis, name in axes.items():
            dim = value.shape[axis] if axis < len(value.shape) else None
            symbol = getattr(dim, "value", None)
            if isinstance(symbol, str) and symbol not in names and name not in names.values():
                names[symbol] = name
    return names


#: The graph input and output names a file can be given (``--io-names``): transformers'
#: exporter's (``input.past_key_values.layers.0.keys``, in transformers 5.24
#: ``input.cache.layers.0.keys``, which ``ExportedModel`` binds by), or Optimum's
#: (``past_key_values.0.key`` in, ``present.0.key`` out: what ``ORTModelForCausalLM`` and
#: onnxruntime-genai feed and read), the same on every transformers release.
IO_NAMINGS = ("transformers", "optimum")

_CACHE_LEAF = re.compile(
    r"^(?P<side>input|output)\.(?:" + "|".join(CACHE_ARGUMENTS)
    + r")\.layers\.(?P<layer>\d+)\.(?P<kind>keys|values|indexer_keys|(?:conv|recurrent)_states\.\d+)$"
)


def optimum_io_names(names: Iterable[str]) -> dict[str, str]:
    """``{name: Optimum's name}`` for the cache inputs and outputs among ``names`` (the graph's
    input and output names of a decoder exported with its cache): ``input.<cache>.layers.N.keys``
    becomes ``past_key_values.N.key``, ``output.<cache>.layers.N.values`` ``present.N.value``; a
    recurrent or convolution layer's state and a sparse attention's indexer keys (Optimum names
    neither) keep their names after the layer's (``past_key_values.N.conv_states.0``,
    ``present.N.indexer_keys``).
    Other names (``input_ids``, ``attention_mask``, ``logits``) are Optimum's already.

    Raises:
        InvalidInputError: No cache tensor among ``names`` (Optimum's names are those of a
            with-past decoder), or a cache of another layout (an encoder-decoder's two caches).
    """
    names = list(names)
    renamed: dict[str, str] = {}
    for name in names:
        match = _CACHE_LEAF.match(name)
        if match:
            prefix = "past_key_values" if match["side"] == "input" else "present"
            kind = match["kind"] if "_" in match["kind"] else match["kind"][:-1]  # a state, indexer keys: their names
            renamed[name] = f"{prefix}.{match['layer']}.{kind}"
    cache_leaves = tuple(f"{side}.{a}." for side in ("input", "output") for a in CACHE_ARGUMENTS)
    others = [n for n in names if n not in renamed and n.startswith(cache_leaves)]
    if not renamed or others:
        raise InvalidInputError(
            "Optimum's input and output names (past_key_values.N.key, present.N.key) are those of a decoder "
            f"with its cache; this file's are {names[:6]}{' ...' if len(names) > 6 else ''}.",
            hint="Use --io-names optimum with --task causal-lm-with-past (text-generation-with-past) of a decoder-only model.",
        )
    if len(set(renamed.values()) | (set(names) - set(renamed))) != len(names):
        raise InvalidInputError(f"Optimum's names would give two graph values one name: {sorted(renamed.values())}.")
    return renamed


def dynamic_shapes(inputs: dict[str, Any]) -> dict[str, Any]:
    """Named dynamic axes for ``inputs``: batch and sequence of token inputs, batch and past of a
    cache's tensors, batch of pixel values; every other axis stays static.

    The names are Optimum's (``batch_size``, ``sequence_length``, ``past_sequence_length``,
    ``decoder_sequence_length``), one ``Dim`` per name shared by every input, so that torch.export
    gives each meaning one symbol: every cache tensor has the same past length, and the decoder
    layers trace alike and share one function. A with-past mask spans ``past_sequence_length +
    sequence_length``, which no ``Dim`` expresses: that name is a string (``Dim.DYNAMIC`` for
    torch.export, as ``torch.onnx.export`` takes it), naming the ONNX axis.
    """
    dims = {name: torch.export.Dim(name) for name in (BATCH_AXIS, SEQUENCE_AXIS, PAST_AXIS, DECODER_SEQUENCE_AXIS)}
    batch = dims[BATCH_AXIS]
    with_past = any(name in inputs for name in CACHE_ARGUMENTS)
    shapes: dict[str, Any] = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor):
            if name in ("decoder_input_ids", "decoder_attention_mask"):
                shapes[name] = {0: batch, 1: dims[DECODER_SEQUENCE_AXIS]}
            elif name == "attention_mask" and with_past:
                shapes[name] = {0: batch, 1: TOTAL_AXIS}
            elif name in _SEQUENCE_INPUTS or name in ("token_type_ids", "position_ids"):
                shapes[name] = {0: batch, 1: dims[SEQUENCE_AXIS]}
            elif name == "pixel_values":
                shapes[name] = {0: batch}
            else:
                shapes[name] = None
        elif name in CACHE_ARGUMENTS:
            shapes[name] = _cache_shapes(value, batch, dims[PAST_AXIS])
        elif not (value is None or isinstance(value, (bool, int, float, str))):
            shapes[name] = get_auto_dynamic_shapes(value)
    return shapes


def _cache_shapes(cache: Any, batch: Any, past: Any) -> Any:
    """transformers' own structure for the cache, with only batch and past dynamic: the past on the
    keys and values (``[batch, heads, past, head]``), the batch alone on a recurrent or convolution
    layer's state (a ``LinearAttentionLayer``'s ``conv_states``, ``recurrent_states``: fixed sizes,
    even in 4 dimensions)."""
    specs = get_auto_dynamic_shapes(cache)
    layers = getattr(cache, "layers", ())
    states = {id(state) for layer in layers for kind in ("conv_states", "recurrent_states")
              for state in (getattr(layer, kind, None) or {}).values() if state is not None}
    # a sparse attention's indexer keys ([batch, past, head]) grow with the past on their second axis
    indexed = {id(keys) for layer in layers if isinstance(keys := getattr(layer, "indexer_keys", None), torch.Tensor)}
    tensors = iter(_pytree_flatten(cache)[0] if states or indexed else [])

    def axes(spec):
        if not spec:
            return None
        tensor = id(next(tensors, None))
        if tensor in indexed and len(spec) == 3:
            return {0: batch, 1: past}
        return {0: batch, 2: past} if len(spec) == 4 and tensor not in states else {0: batch}

    return torch.utils._pytree.tree_map(axes, specs, is_leaf=lambda spec: isinstance(spec, dict))
