"""Names from files, made safe to print (no onnx, no torch: used by the call tree and the file tools)."""

from __future__ import annotations

import re
import unicodedata

__all__ = ["shown", "first_line"]

# C0/C1 controls (ANSI escapes, BEL, newlines), and the invisible format characters that reorder
# or hide text: bidirectional embeddings, overrides and isolates (U+202E turns a line around),
# zero-width characters, line/paragraph separators, the byte-order mark.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")


def shown(value: str | bytes) -> str:
    """A name read from a file, safe to print: undecodable bytes as ``\\xff``, control
    characters (ANSI escapes, newlines) as ``\\x1b`` and bidirectional overrides or
    zero-width characters as ``\\u202e``, so a name cannot rewrite the terminal or reorder a line.

    protobuf returns ``bytes`` for a string field that is not valid UTF-8.

    Example::

        shown("\\x1b[31mred")  # '\\x1b[31mred', printed as is
    """
    if isinstance(value, bytes):
        value = value.decode("utf-8", "backslashreplace")
    text = _CONTROL.sub(_escape, str(value))
    if not text.isascii():  # any other invisible format character (tags, annotations, ...)
        text = "".join(_escape_char(c) if unicodedata.category(c) in _INVISIBLE else c for c in text)
    return text


_INVISIBLE = frozenset({"Cc", "Cf", "Zl", "Zp"})


def _escape_char(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


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
