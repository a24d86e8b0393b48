"""``optimize``'s options checked before any work (typed errors, bounds from
:mod:`~onnx_modular.storage.limits`): options that only mean something with another one say so,
``max_positions`` is a positive integer within :data:`~onnx_modular.storage.limits.MAX_POSITIONS`
(the rotary caches it sizes are built in memory), and the file's own ``max_position_embeddings``
metadata is read as untrusted text."""

from __future__ import annotations

import numbers

import onnx_ir as ir

from onnx_modular.errors import InvalidInputError, InvalidModelFileError
from onnx_modular.format.text import shown
from onnx_modular.storage.limits import check_count

__all__ = ["check_options", "positions_of", "DEFAULT_POSITIONS"]

#: Rows of the rotary caches when neither the option nor the file says.
DEFAULT_POSITIONS = 4096


def check_options(*, max_positions, quantize, accuracy_level, accuracy_guard, int8_lm_head) -> int:
    """Refuse options that need ``quantize`` without it, and a bad ``max_positions``; returns the
    accuracy level to use (4, the builder's, when not given)."""
    needs = [name for name, given in (("--accuracy-level (accuracy_level)", accuracy_level is not None),
                                      ("--no-accuracy-guard (accuracy_guard=False)", not accuracy_guard)) if given]
    if quantize is None and needs:
        raise InvalidInputError(
            f"optimize: {' and '.join(needs)} only appl{'ies' if len(needs) == 1 else 'y'} with --quantize "
            "(how the quantized weights compute); nothing is quantized here.",
            hint="Add --quantize int4 (or int8), or drop --accuracy-level / --no-accuracy-guard.",
        )
    if max_positions is not None:
        check_positions(max_positions, "max_positions")
    del int8_lm_head  # checked with the recipe
    return 4 if accuracy_level is None else accuracy_level


def check_positions(value, what: str, *, from_file: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        message = f"{what} must be a positive integer (the longest sequence the file will run), not {shown(repr(value))}."
        if from_file is not None:
            raise InvalidModelFileError(f"{from_file}: {message}")
        raise InvalidInputError(message, hint="--max-positions 4096")
    check_count("MAX_POSITIONS", int(value), f"{what}, the rows of the rotary caches", from_file=from_file)
    return int(value)


def positions_of(model: ir.Model, path: str) -> int:
    """The file's ``max_position_embeddings`` metadata (checked: a positive integer within the
    limit), else :data:`DEFAULT_POSITIONS`."""
    text = model.metadata_props.get("max_position_embeddings")
    if text is None:
        return DEFAULT_POSITIONS
    try:
        value = int(text.strip())
    except ValueError:
        raise InvalidModelFileError(
            f"{path!r}: its max_position_embeddings metadata {shown(repr(text[:40]))} is not an integer."
        ) from None
    return check_positions(value, "max_position_embeddings", from_file=repr(path))
