"""Reports as JSON: the one encoder of every ``--json`` and ``to_json`` of the package.

A report is a dataclass (or has ``to_dict()``); :func:`plain` turns it into JSON values the same
way for every tool, so the commands agree on the details:

* floats that are not finite (the drift of an overflowed call, the difference of mismatched
  shapes) are the strings ``"inf"``, ``"-inf"`` and ``"nan"``: strict JSON, and the value is not
  lost (``null`` would say "not measured");
* paths are strings, numpy scalars and arrays plain numbers and lists, sets sorted lists,
  mappings with other keys than strings have them as strings;
* a dataclass field whose metadata says ``{"record": False}`` (in-memory links such as IR nodes)
  is left out; an object with ``to_dict()`` is what that method gives.

Names from files are not escaped here: JSON escapes every control character itself.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["plain", "to_json", "NOT_RECORDED"]

#: ``dataclasses.field(metadata=NOT_RECORDED)``: a field the JSON of its report leaves out.
NOT_RECORDED = {"record": False}


def plain(value: Any) -> Any:
    """``value`` as JSON values (dicts, lists, strings, numbers, booleans, ``None``)."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _non_finite(value)
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict) and not isinstance(value, type):
        return plain(to_dict())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            field.name: plain(getattr(value, field.name))
            for field in dataclasses.fields(value)
            if field.metadata.get("record", True)
        }
    if isinstance(value, Mapping):
        return {key if isinstance(key, str) else str(plain(key)): plain(item) for key, item in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted((plain(item) for item in value), key=str)
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    tolist = getattr(value, "tolist", None)  # numpy scalars and arrays
    if callable(tolist):
        return plain(tolist())
    return str(value)


def _non_finite(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def to_json(value: Any, indent: int | None = 2) -> str:
    """:func:`plain` of ``value``, as strict JSON text."""
    return json.dumps(plain(value), indent=indent, allow_nan=False)
