"""What the command line prints and returns: exit codes, escaped text on stdout and stderr, JSON.

Every name that comes from a file goes through :func:`safe` (escaped line by line), so a file
cannot drive the terminal.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from onnx_modular.format.text import shown

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3


class Mismatch(Exception):
    """Verification ran and found differences beyond tolerance (exit code 1)."""


def safe(text: Any) -> str:
    """``text`` with every line escaped (:func:`~onnx_modular.format.text.shown`): names from a file
    (outputs, nodes, functions) cannot move the cursor, clear the screen or reorder the line."""
    return "\n".join(shown(line) for line in str(text).split("\n"))


def stderr(text: str) -> None:
    print(safe(text), file=sys.stderr, flush=True)


def stdout(text: Any) -> None:
    print(safe(text))


def _json_safe(value: Any) -> Any:
    """Infinities and NaNs (e.g. the difference of mismatched shapes) as strings: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def print_json(data: Any) -> None:
    print(json.dumps(_json_safe(data), indent=2, allow_nan=False))

