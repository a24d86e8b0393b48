"""The transformers releases onnx_modular.hf is tested with, and what differs between them.

transformers 5.24 renamed the cache argument of its models from ``past_key_values`` to ``cache``
(forward parameter and output field; ``past_key_values=`` still works, with a deprecation
warning, through ``**kwargs``). Everything here that builds or reads a cache asks
:func:`cache_argument` / :func:`returned_cache` instead of naming either spelling, so one code
path serves both releases. A release outside :data:`TESTED` is refused at ``import
onnx_modular.hf``, before anything fails later for a reason that would not name the version.
"""

from __future__ import annotations

import inspect
from typing import Any

from onnx_modular.errors import MissingDependencyError

__all__ = ["CACHE_ARGUMENTS", "TESTED", "cache_argument", "check_transformers_version", "returned_cache"]

#: ``major.minor`` of the transformers releases the test suite runs against (scripts/test-transformers.sh).
TESTED = ("5.23", "5.24")

#: The names a forward takes its KV cache under, in one release or the other.
CACHE_ARGUMENTS = ("cache", "past_key_values")


def check_transformers_version(version: str) -> None:
    """Refuse a transformers release that is not tested.

    Raises:
        MissingDependencyError: ``version`` is not one of :data:`TESTED`, naming what is installed
            and what to install.
    """
    release = ".".join(version.split("+", 1)[0].split(".")[:2])
    if release not in TESTED:
        raise MissingDependencyError(
            f"onnx_modular.hf is tested with transformers {' and '.join(TESTED)}; this environment has {version}.",
            hint=f"pip install 'transformers=={TESTED[-1]}.*' (or {TESTED[0]}.*); the file tools and "
            "export_modular work without onnx_modular.hf.",
        )


def cache_argument(model: Any) -> str:
    """The name under which ``model.forward`` takes a KV cache: ``cache`` (transformers 5.24) or
    ``past_key_values`` (5.23)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters and "past_key_values" not in parameters else "past_key_values"


def returned_cache(outputs: Any) -> Any:
    """The cache a forward returned (``outputs.cache`` in 5.24, ``outputs.past_key_values`` in 5.23)."""
    for name in ("cache", "past_key_values"):
        value = outputs.get(name) if hasattr(outputs, "get") else getattr(outputs, name, None)
        if value is not None:
            return value
    return None
