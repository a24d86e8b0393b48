"""What transformers adds to every capture: pytree registration of its caches, translations of its ops.

Registered with :mod:`onnx_modular.capture.library_hooks` when imported; the core imports this
module itself once transformers is imported, so a transformers model exports with or without
``import onnx_modular.hf``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from onnx_modular.capture import library_hooks
from onnx_modular.errors import InvalidInputError

__all__ = ["is_transformers_cache", "register_caches", "translations"]


def is_transformers_cache(value: Any) -> bool:
    return any(
        cls.__module__.startswith("transformers.") and (cls.__name__ == "Cache" or cls.__name__.endswith("Cache"))
        for cls in type(value).__mro__
    )


def register_caches(model: Any, values: Sequence[Any]) -> bool:
    """Make transformers' caches flattenable with transformers' own helper (every ``Cache`` type)."""
    if not any(is_transformers_cache(value) for value in values):
        return False
    try:  # transformers >= 5.2x: the registration its own exporters use, for every Cache type
        from transformers.exporters.exporter_dynamo import (
            register_cache_pytrees_for_model,
        )
    except ImportError:
        register_cache_pytrees_for_model = None
    if register_cache_pytrees_for_model is not None:
        register_cache_pytrees_for_model(model)
        return True
    try:  # older transformers: DynamicCache only
        from transformers.integrations.executorch import (
            register_dynamic_cache_export_support,
        )
    except ImportError as e:
        raise InvalidInputError(
            "The inputs hold a transformers cache, and this transformers version has no helper "
            "that makes caches flattenable for torch.export.",
            hint="Install transformers>=5.2, or register the cache type with "
            "torch.utils._pytree.register_pytree_node.",
        ) from e
    register_dynamic_cache_export_support()
    return True


def translations() -> dict[Callable, Callable]:
    """transformers' translations of its own custom ops.

    transformers 5 runs mixture-of-experts layers through its custom op
    ``transformers::grouped_mm_fallback`` under ``torch.export``; torchlib has no translation
    for it, so ``torch.onnx.export`` alone fails on such models, and transformers' own ONNX
    exporter passes its table (``exporters.exporter_onnx._ONNX_TRANSLATION_TABLE``) as
    ``custom_translation_table``. The registry uses it only for ops torch lacks, so every op
    torch translates is translated as torch does.
    """
    try:
        from transformers.exporters import exporter_onnx
    except Exception:  # an older transformers, or onnxscript missing: nothing to add
        return {}
    return dict(getattr(exporter_onnx, "_ONNX_TRANSLATION_TABLE", {}))


library_hooks.register_input_types(register_caches)
library_hooks.register_translations(translations)
