"""What the command line prints and returns: exit codes, escaped text on stdout and stderr, JSON.

Every name that comes from a file goes through :func:`safe` (escaped line by line), so a file
cannot drive the terminal.
"""

from __future__ import annotations

import sys
from typing import Any

from onnx_modular.format import records
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


def print_json(data: Any) -> None:
    """``data`` (a report, a dict) as JSON on stdout: the package's one encoder (:mod:`format.records`)."""
    print(records.to_json(data))


def emit_json(destination: str | None, data: Any) -> bool:
    """``--json PATH|-``, the same for every command: ``-`` prints the report as JSON instead of
    the text (returns ``True``: print nothing else), a path gets it written (through the checked
    writer) beside the text. ``None``: no JSON asked for."""
    if destination is None:
        return False
    if destination == "-":
        print_json(data)
        return True
    from onnx_modular.storage import save

    save.write_text(destination, records.to_json(data) + "\n")
    stderr(f"Wrote {destination}")
    return False


def check_json_destination(destination: str | None, reads=()) -> None:
    """A ``--json`` path that cannot be written fails before the command's work."""
    if destination is not None and destination != "-":
        from onnx_modular.storage import save

        save.check_destination(destination, reads=reads)
