"""``genai_config.json`` for the stages of a folder ``split`` wrote from a with-cache decoder file:
onnxruntime-genai's decoder pipeline (``model.type`` ``decoder-pipeline``, ``decoder.pipeline``: one
entry a stage with its file, inputs, outputs, ``run_on_prompt`` and ``run_on_token_gen``), torch-free.

genai runs the stages in order in one process. It feeds each stage the inputs it manages
(``input_ids``, ``attention_mask``, ``position_ids``, each layer's past keys and values, named by
the ``%d`` templates of ``decoder.inputs``) and every output an earlier stage returned under the
same name; it reads ``logits`` and each layer's present keys and values, wherever they come from.
So a split folder fits as it is: each crossing value keeps its name in the stage that makes it and
in the stages that read it, and each layer's cache is an input and an output of its own stage
(:func:`onnx_modular.runtime.pipeline.read_stages` checks both). The cache names are read from the
stages (transformers' ``input.past_key_values.layers.%d.keys`` as well as Optimum's
``past_key_values.%d.key``), and the sizes genai allocates the cache with (layers, KV heads, head
size) from their declared shapes.

Example::

    config = pipeline_config(read_stages("stages"), models, json.load(open("ckpt/config.json")))
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import onnx

from onnx_modular.files.genai_config import (
    FED_INPUTS,
    DecoderIO,
    GenaiError,
    config_for,
    uses_group_query_attention,
)
from onnx_modular.format.text import shown
from onnx_modular.runtime.decoder_checks import cache_positions
from onnx_modular.runtime.pipeline import LOGITS, StagePlan
from onnx_modular.storage.manifest import STAGE_OUTPUT

__all__ = ["PIPELINE_TYPE", "STAGE_FILE", "pipeline_config", "cache_templates"]

#: The ``model.type`` under which genai 0.18 runs ``decoder.pipeline`` (``ModelType::IsPipe``).
PIPELINE_TYPE = "decoder-pipeline"
#: genai composes a layer's cache name into a buffer of 64 bytes (``ComposeKeyValueName``).
NAME_LIMIT = 63
#: Each stage's file in a genai folder (its external data beside it, under the name the file records).
STAGE_FILE = "stage_%d/model.onnx"
_LAYER = re.compile(r"(?<=\.)(\d+)(?=\.)")

_HINT = "Export with --task causal-lm-with-past (with or without --io-names optimum), then split that file."


def _template(name: str) -> tuple[str, int]:
    """``input.past_key_values.layers.3.keys`` -> (``input.past_key_values.layers.%d.keys``, 3)."""
    match = _LAYER.search(name)
    if match is None or "%" in name:
        raise GenaiError(f"genai names each layer's cache by a template with the layer number; {shown(name)!r} has "
                         "no number between dots (or holds a '%').", hint=_HINT)
    return name[: match.start()] + "%d" + name[match.end():], int(match.group(1))


def _kind(template: str) -> str:
    tail = template.rsplit(".", 1)[-1].lower()
    return "value" if "value" in tail else "key" if "key" in tail else ""


def cache_templates(plans: Sequence[StagePlan]) -> tuple[tuple[str, str, str, str], int]:
    """The four cache templates (past key, past value, present key, present value) and the layer
    count of the stages' caches.

    Raises:
        GenaiError: Names that no ``%d`` template of keys and values covers for layers 0..L-1.
    """
    found: dict[tuple[str, str], dict[str, set[int]]] = {}
    for plan in plans:
        for past, present in plan.cache.values():
            (t_in, i), (t_out, j) = _template(past), _template(present)
            if i != j or _kind(t_in) != _kind(t_out) or not _kind(t_in):
                raise GenaiError(f"stage {plan.index}: the cache input {shown(past)!r} and output {shown(present)!r} are "
                                 "not one layer's keys or values by name.", hint=_HINT)
            found.setdefault((t_in, t_out), {}).setdefault("layers", set()).add(i)
    by_kind = {_kind(t_in): (t_in, t_out, entry["layers"]) for (t_in, t_out), entry in found.items()}
    if len(found) != 2 or set(by_kind) != {"key", "value"}:
        raise GenaiError(f"genai drives one template of keys and one of values; these stages have {sorted(found)[:4]}.",
                         hint=_HINT)
    layers = len(by_kind["key"][2])
    if by_kind["key"][2] != set(range(layers)) or by_kind["value"][2] != set(range(layers)):
        raise GenaiError(f"the stages hold the caches of layers {sorted(by_kind['key'][2])[:8]}, not every layer "
                         f"0..{layers - 1} once.", hint=_HINT)
    names = (by_kind["key"][0], by_kind["value"][0], by_kind["key"][1], by_kind["value"][1])
    longest = max((t % (layers - 1) for t in names), key=len)
    if len(longest.encode()) > NAME_LIMIT:
        raise GenaiError(f"genai composes cache names of at most {NAME_LIMIT} bytes; {shown(longest)!r} is longer.",
                         hint="Export with --io-names optimum (past_key_values.N.key), then split that file.")
    return names, layers


def _dims(value: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_param if d.HasField("dim_param") else d.dim_value for d in value.type.tensor_type.shape.dim]


def _check_names(plans: Sequence[StagePlan]) -> list[str]:
    """The model inputs genai feeds; refuses a crossing value read under another name, an input
    genai does not make, and an output name two stages return."""
    fed, made = set(), {}
    for plan in plans:
        for name, source in plan.inputs.items():
            match = STAGE_OUTPUT.fullmatch(source)
            if match and match.group(2) != name:
                raise GenaiError(f"stage {plan.index} reads {shown(source)!r} as {shown(name)!r}: genai passes a value "
                                 "between stages under one name.", hint=_HINT)
            if not match and name not in FED_INPUTS and name not in {p for p, _ in plan.cache.values()}:
                raise GenaiError(f"stage {plan.index} takes {shown(name)!r}, which genai does not feed (it feeds "
                                 f"{', '.join(FED_INPUTS)} and the cache).", hint=_HINT)
            if not match and name in FED_INPUTS:
                fed.add(name)
        for name in plan.outputs:
            if name in made:
                raise GenaiError(f"stages {made[name]} and {plan.index} both return {shown(name)!r}.", hint=_HINT)
            made[name] = plan.index
    if "input_ids" not in fed:
        raise GenaiError("no stage takes input_ids.", hint=_HINT)
    return [name for name in FED_INPUTS if name in fed]


def _geometry(plans: Sequence[StagePlan], models: Sequence[onnx.ModelProto], names, layers: int) -> tuple[int, int, bool]:
    inputs = {v.name: _dims(v) for model in models for v in model.graph.input}
    geometry = []
    for i in range(layers):
        key, value = inputs[names[0] % i], inputs[names[1] % i]
        geometry.append((key[1], key[3], value[3]))
    odd = [i for i, (heads, key, value) in enumerate(geometry) if key != value or not all(isinstance(d, int) and d > 0 for d in (heads, key))]
    if odd:
        raise GenaiError(f"layers {odd[:6]} have (KV heads, key size, value size) {sorted({str(geometry[i]) for i in odd})[:4]}: "
                         "genai allocates keys and values of one fixed size.",
                         hint="Not supported by onnxruntime-genai: run the stages with onnx-modular generate.")
    return geometry[0][0], geometry[0][1], len(set(geometry)) == 1


def pipeline_config(
    plans: Sequence[StagePlan],
    models: Sequence[onnx.ModelProto],
    config: dict,
    generation: dict | None = None,
    *,
    share_buffer: bool | None = None,
    intra_op_threads: int | None = None,
) -> dict[str, Any]:
    """The ``genai_config.json`` (a dict) running ``plans`` (:func:`~onnx_modular.runtime.pipeline.read_stages`;
    ``models``: their files' structure, in order) as genai's decoder pipeline, with the
    checkpoint's ``config.json`` and ``generation_config.json``. Each stage runs on the prompt and
    on every generated token; the file names are :data:`STAGE_FILE`'s.

    Raises:
        GenaiError: What genai cannot drive: cache names without a layer template, an input it does
            not feed, a value read under another name, keys and values of different sizes.
    """
    fed = _check_names(plans)
    names, layers = cache_templates(plans)
    kv_heads, head_size, uniform = _geometry(plans, models, names, layers)
    logits = next((v for v in models[-1].graph.output if v.name == LOGITS), None)
    vocab = _dims(logits)[-1] if logits is not None else None
    io = DecoderIO(tuple(fed), layers, kv_heads, head_size, vocab if isinstance(vocab, int) and vocab > 0 else None, uniform)
    if share_buffer is None:
        share_buffer = any(uses_group_query_attention(model) for model in models)
    rows = [r for r in map(cache_positions, models) if r is not None]
    written = config_for(io, config, generation, filename=None, share_buffer=share_buffer,
                         intra_op_threads=intra_op_threads, names=names, cache_rows=min(rows) if rows else None)
    written["model"]["type"] = PIPELINE_TYPE
    written["model"]["decoder"]["pipeline"] = [
        {
            f"stage_{plan.index}": {
                "filename": STAGE_FILE % plan.index,
                "inputs": list(plan.inputs),
                "outputs": list(plan.outputs),
                "run_on_prompt": True,
                "run_on_token_gen": True,
            }
        }
        for plan in plans
    ]
    return written
