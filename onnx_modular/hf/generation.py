"""Greedy decoding through the ``prefill`` and ``decode`` components of an exported decoder.

``HfExporter.export_for_generation`` splits a decoder into ``prefill`` (the prompt, empty cache)
and ``decode`` (one token, the cache so far); transformers leaves the loop to the caller. The loop
itself is :func:`onnx_modular.runtime.generation.generate_with_sessions` (torch-free, the one
home of decoding, also behind ``onnx_modular.generate`` for files on disk); this runs it on the
components' onnxruntime sessions, for an export in memory or one loaded with
``ExportedModel.from_pretrained`` (an int4 folder converted component by component included).
"""

from __future__ import annotations

from typing import Any

import torch

from onnx_modular.errors import InvalidInputError
from onnx_modular.runtime.generation import generate_with_sessions

__all__ = ["greedy_generate"]


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
    tokens = generate_with_sessions(
        runners["prefill"].session, runners["decode"].session, input_ids.cpu().numpy(), max_new_tokens
    )
    return torch.from_numpy(tokens).to(input_ids.dtype)
