"""What :mod:`~onnx_modular.runtime.generation` checks before its loop runs, as untrusted input:
the token ids and ``max_new_tokens`` a caller passes (typed errors, never numpy's), the files a
folder's ``export.json`` names (inside the folder, through no link), the files themselves (the
bounds every tool applies: call bombs, endless ``Loop`` s), the ids against the vocabulary the
logits declare, and the length of the run against the positions the file was exported for
(``max_position_embeddings``, or the rows of the rotary caches ``optimize`` built) and :data:`~onnx_modular.storage.limits.MAX_NEW_TOKENS`.
"""

from __future__ import annotations

import numbers
import os
import pathlib
import re
from typing import Any

import numpy as np
import onnx

from onnx_modular.errors import InvalidInputError
from onnx_modular.format.text import shown
from onnx_modular.storage.limits import check_count

__all__ = ["token_ids", "new_tokens", "check_length", "check_vocabulary", "components", "file_bounds", "logits_name", "cache_positions"]

_IDS_HINT = "Pass a [batch, length] list or array of integer token ids, e.g. [[1, 306, 4966]]."
_INT64 = np.iinfo(np.int64)


def token_ids(input_ids: Any) -> np.ndarray:
    """``input_ids`` as ``int64`` ``[batch, length]`` (a flat list is one sequence).

    Raises:
        InvalidInputError: Not integers (strings, floats, booleans), ragged rows, ids past ``int64``,
            negative ids, or an empty batch or prompt.
    """
    if input_ids is None or isinstance(input_ids, (str, bytes, dict)):
        raise InvalidInputError(f"input_ids must be token ids, not {type(input_ids).__name__}.", hint=_IDS_HINT)
    try:
        array = np.asarray(input_ids)
    except (ValueError, TypeError, OverflowError) as e:  # ragged rows: "inhomogeneous shape"
        raise InvalidInputError(f"input_ids must be rows of equal length: {str(e).splitlines()[0]}", hint=_IDS_HINT) from None
    if array.dtype.kind == "O":  # Python integers past int64, or mixed objects
        values = array.reshape(-1).tolist()
        if all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
            raise InvalidInputError("input_ids holds ids past the int64 range; no vocabulary is that large.", hint=_IDS_HINT)
        raise InvalidInputError("input_ids must hold integers of equal-length rows.", hint=_IDS_HINT)
    if array.size == 0:
        raise InvalidInputError(f"input_ids must be [batch, length] with batch and length >= 1; got shape {list(array.shape)}.",
                                hint=_IDS_HINT)
    if array.dtype.kind not in "iu":
        raise InvalidInputError(f"input_ids must hold integers, not {array.dtype} values.", hint=_IDS_HINT)
    if array.dtype.kind == "u" and array.size and int(array.max()) > _INT64.max:
        raise InvalidInputError("input_ids holds ids past the int64 range; no vocabulary is that large.", hint=_IDS_HINT)
    array = array.astype(np.int64)
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2 or array.shape[0] == 0 or array.shape[1] == 0:
        raise InvalidInputError(
            f"input_ids must be [batch, length] with batch and length >= 1; got shape {list(array.shape)}.", hint=_IDS_HINT
        )
    if (array < 0).any():
        raise InvalidInputError(f"input_ids holds the negative id {int(array.min())}; token ids start at 0.", hint=_IDS_HINT)
    return array


def new_tokens(max_new_tokens: Any) -> int:
    """``max_new_tokens`` as an ``int`` >= 0 (an integer, not a string, a float or a boolean)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise InvalidInputError(
            f"max_new_tokens must be an integer, not {type(max_new_tokens).__name__} ({shown(repr(max_new_tokens))}).",
            hint="Pass max_new_tokens=20.",
        )
    if max_new_tokens < 0:
        raise InvalidInputError(f"max_new_tokens must be >= 0; got {max_new_tokens}.", hint="Pass 1 or more.")
    return int(max_new_tokens)


def check_length(prompt: int, max_new_tokens: int, positions: int | None, what: str = "the file") -> None:
    """Refuse a run longer than the positions ``what`` was exported for, or than
    :data:`~onnx_modular.storage.limits.MAX_NEW_TOKENS` new tokens."""
    check_count("MAX_NEW_TOKENS", max_new_tokens, "max_new_tokens, the tokens to generate")
    if positions is not None and prompt + max_new_tokens > positions:
        raise InvalidInputError(
            f"A prompt of {prompt} tokens and {max_new_tokens} new tokens need {prompt + max_new_tokens} positions; "
            f"{what} runs at most {positions} positions (its max_position_embeddings, or the rows of its rotary caches).",
            hint=f"Ask for at most {max(positions - prompt, 0)} new tokens, or shorten the prompt.",
        )


def check_vocabulary(ids: np.ndarray, vocabulary: int | None) -> None:
    """Refuse ids at or past the vocabulary size (the logits' last dimension, when it is known)."""
    if vocabulary is not None and ids.size and int(ids.max()) >= vocabulary:
        raise InvalidInputError(
            f"input_ids holds the id {int(ids.max())}, past the vocabulary of {vocabulary} tokens the file's logits declare.",
            hint=f"Token ids run from 0 to {vocabulary - 1}; tokenize the prompt with the model's own tokenizer.",
        )


def components(folder: str | os.PathLike) -> dict[str, pathlib.Path] | None:
    """The files ``export.json`` of a ``--generation`` folder names (``{"prefill": ..., "decode": ...}``,
    or one file as both), checked: a small JSON object, each file relative, inside the folder,
    through no link; ``None`` when the folder has no ``export.json``."""
    from onnx_modular.storage.manifest import file_in_folder, read_folder_json

    folder = pathlib.Path(folder)
    path = folder / "export.json"
    if not os.path.lexists(path):
        return None
    hint = "Give the folder `export --generation` wrote (its export.json names prefill.onnx and decode.onnx)."
    manifest = read_folder_json(path, "The generation manifest", hint=hint)
    found = manifest.get("components", {}) if isinstance(manifest, dict) else None
    if not isinstance(found, dict) or not all(isinstance(v, dict) for v in found.values()):
        raise InvalidInputError(
            f"The generation manifest {shown(str(path))!r} is not an object with 'components' of objects.", hint=hint
        )
    files = {name: file_in_folder(folder, part.get("file"), f"export.json's file of {shown(name)!r}", hint=hint)
             for name, part in found.items() if name in ("prefill", "decode") or len(found) == 1}
    if {"prefill", "decode"} <= set(files):
        return {"prefill": files["prefill"], "decode": files["decode"]}
    if len(found) == 1 and files:
        single = next(iter(files.values()))
        return {"prefill": single, "decode": single}
    return {}


def file_bounds(path: str | os.PathLike) -> int | None:
    """Load the file with every tool's bounds before onnxruntime runs it (call bombs, a ``Loop`` that
    never ends, a malformed file); returns the positions it was exported for, when it says."""
    from onnx_modular.storage.checks import check_expanded_size
    from onnx_modular.storage.load import load_model_file

    model = load_model_file(path)  # the values too: a Loop's constant trip count is one
    check_expanded_size(model, name=repr(str(path)))
    text = next((p.value for p in model.metadata_props if p.key == "max_position_embeddings"), "").strip()
    known = [int(text)] if text.isdigit() and 0 < int(text) else []
    rows = cache_positions(model)  # optimize's rotary caches: GroupQueryAttention reads past them otherwise
    return min([*known, *([rows] if rows else [])], default=None)


def logits_name(outputs: dict[str, list], caches: set[str], what: str) -> str:
    """The logits output: ``logits``, else the one other output of rank 3 ``[batch, sequence, vocabulary]``."""
    if "logits" in outputs:
        return "logits"
    candidates = [name for name, shape in outputs.items() if name not in caches and len(shape) == 3]
    if len(candidates) != 1:
        raise InvalidInputError(
            f"The {what} has no output named 'logits' and {len(candidates)} other outputs of rank 3 "
            f"({', '.join(shown(c) for c in candidates) or 'none'}): the generation loop cannot tell which gives the next token.",
            hint="Name the logits output 'logits' (export names it so; export_modular(..., output_names=[...])).",
        )
    return candidates[0]


_POSITIONS = re.compile(r"gqa\d*\.positions")


def cache_positions(model: onnx.ModelProto) -> int | None:
    """Rows of the rotary caches ``optimize`` built for ``GroupQueryAttention`` (``--max-positions``):
    the longest sequence the file can run; ``None`` when it has none."""
    rows = []
    for node in [*model.graph.node, *(n for f in model.functions for n in f.node)]:
        if node.op_type == "Constant" and node.output and _POSITIONS.fullmatch(node.output[0]):
            rows += [a.t.dims[-1] for a in node.attribute if a.name == "value" and a.t.dims]
    return min(rows) if rows else None
