"""Names from files, made safe to print (no onnx, no torch: used by the call tree and the file tools)."""

from __future__ import annotations

import re

__all__ = ["shown", "first_line"]

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def shown(value: str | bytes) -> str:
    """A name read from a file, safe to print: undecodable bytes as ``\\xff`` and control
    characters (ANSI escapes, newlines) as ``\\x1b``, so a name cannot rewrite the terminal.

    protobuf returns ``bytes`` for a string field that is not valid UTF-8.

    Example::

        shown("\\x1b[31mred")  # '\\x1b[31mred', printed as is
    """
    if isinstance(value, bytes):
        value = value.decode("utf-8", "backslashreplace")
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", str(value))


def first_line(exc: BaseException, *, cause: bool = False) -> str:
    """The first line of an error's message (its type when empty), at most 400 characters.

    With ``cause``, the first line of its innermost ``__cause__`` follows (which usually says why).
    """

    def line(error: BaseException) -> str:
        text = str(error).strip()
        return text.splitlines()[0][:400] if text else type(error).__name__

    root = exc
    while cause and root.__cause__ is not None:
        root = root.__cause__
    if root is exc:
        return line(exc)
    return f"{line(exc)} Cause: {type(root).__name__}: {line(root)}"
