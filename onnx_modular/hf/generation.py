"""Greedy decoding through the ``prefill`` and ``decode`` components of an exported decoder.

``HfExporter.export_for_generation`` splits a decoder into ``prefill`` (the prompt, empty cache)
and ``decode`` (one token, the cache so far); transformers leaves the loop to the caller. This is
that loop, for decoder-only models: it feeds each component the inputs it was traced with
(``input_ids``, ``attention_mask``, ``position_ids``, ``cache_position``, ``past_key_values``)
and passes the cache each step returns to the next.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from onnx_modular.errors import InvalidInputError
from onnx_modular.hf.versions import CACHE_ARGUMENTS, returned_cache

__all__ = ["greedy_generate"]

_KNOWN = {"input_ids", "attention_mask", "position_ids", "cache_position", *CACHE_ARGUMENTS}


def _step_inputs(traced: dict, tokens: torch.Tensor, past_length: int, cache: Any) -> dict[str, Any]:
    batch, length = tokens.shape
    positions = torch.arange(past_length, past_length + length, dtype=torch.long)
    values = {
        "input_ids": tokens,
        "attention_mask": torch.ones(batch, past_length + length, dtype=torch.long),
        "position_ids": positions.unsqueeze(0).expand(batch, -1),
        "cache_position": positions,
        **dict.fromkeys(CACHE_ARGUMENTS, cache),
    }
    return {name: values[name] for name in traced}


def greedy_generate(exported: Any, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy generation with an ``export_for_generation`` result (its ``prefill`` and ``decode``
    components, in onnxruntime); returns the prompt followed by the new tokens, like
    ``model.generate(input_ids, do_sample=False, max_new_tokens=...)`` without a stop token.

    Example::

        exported = get_exporter_class("onnx_modular")().export_for_generation(model, {"input_ids": ids}, config)
        tokens = greedy_generate(exported, ids, max_new_tokens=8)
    """
    missing = {"prefill", "decode"} - set(exported.components)
    if missing:
        raise InvalidInputError(
            f"greedy_generate needs the 'prefill' and 'decode' components; this export has {list(exported.components)}.",
            hint="Export a decoder-only model with export_for_generation.",
        )
    runners = exported.runners
    for name in ("prefill", "decode"):
        unknown = set(runners[name].metadata.kwargs) - _KNOWN
        if unknown:
            raise InvalidInputError(
                f"The {name} component takes {sorted(unknown)}, which greedy_generate cannot build.",
                hint="Drive the components yourself: exported.runners[name](**inputs).",
            )
    tokens = input_ids
    cache: Any = DynamicCache()
    step, runner_name = tokens, "prefill"
    for _ in range(max_new_tokens):
        runner = runners[runner_name]
        past_length = tokens.shape[1] - step.shape[1]
        outputs = runner(**_step_inputs(runner.metadata.kwargs, step, past_length, cache))
        cache = returned_cache(outputs)
        step = outputs.logits[:, -1, :].argmax(dim=-1, keepdim=True).to(tokens.dtype)
        tokens = torch.cat([tokens, step], dim=1)
        runner_name = "decode"
    return tokens
