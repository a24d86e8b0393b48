"""What a destination is, before and after a write: :func:`check_destination` (the path refused
before any work: no file name, a folder, a device, a file a model reads through
:func:`~onnx_modular.storage.guard.check_outputs`), the names this package gives a model's
external-data file (:func:`data_name`: ``<name>.data`` or ``<name>.<8 hex>.data``), and the data
files an existing model refers to (:func:`referenced_data`).

Used by the commit (:mod:`~onnx_modular.storage.commit`) and the folder publisher
(:mod:`~onnx_modular.storage.folders`).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
import secrets
import stat
from collections.abc import Iterable

import onnx

from onnx_modular.errors import InvalidInputError, SaveError
from onnx_modular.storage.guard import check_outputs
from onnx_modular.storage.locks import shown_path as _shown

__all__ = ["check_destination", "data_name", "referenced_data"]

_TOKEN_HEX = 8
_DATA_SUFFIX_LEN = len(f".{'0' * _TOKEN_HEX}.data")
# Writers add to the names they are given (onnx_ir stages ``.<name>.XXXXXXXX``, verification
# writes ``.<stem>.flat-XXXXXXXX.onnx``): names made here leave this much room below NAME_MAX.
NAME_ROOM = 48
_LEGACY_SCAN_LIMIT = 64 * 1024 * 1024  # read an old model's data references only when it is this small


def name_max(folder: pathlib.Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def check_destination(path: str | os.PathLike, *, reads: Iterable[str | os.PathLike] = ()) -> pathlib.Path:
    """Fail fast (before any export work) if ``path`` cannot be written, or if writing it would
    destroy a file a model reads: the input (``reads``, and the files the running command declared
    with :func:`~onnx_modular.storage.guard.reading`), its external data, or the external data of
    another model in the destination's folder (:func:`~onnx_modular.storage.guard.check_outputs`)."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise InvalidInputError(
            f"The output f must be a file path (str or os.PathLike), not {type(path).__name__}.",
            hint="Pass a path such as 'model.onnx' (os.fsdecode() turns bytes into one); for a file object, "
            "export with f=None and write result.model_proto.SerializeToString() to it.",
        )
    raw = os.fspath(path)
    path = pathlib.Path(raw)
    shown = _shown(raw)
    parent = path.parent if str(path.parent) else pathlib.Path(".")
    if "\x00" in raw:
        raise SaveError(f"The output path {shown} contains a NUL byte.", hint="Give a file path such as 'model.onnx'.")
    if path.name in ("", ".", "..") or raw.endswith((os.sep, os.sep + ".", os.sep + "..")):
        raise SaveError(f"The output path {shown} has no file name.", hint="Give a file path such as 'model.onnx'.")
    longest = name_max(parent)
    if len(os.fsencode(path.name)) > longest:
        raise SaveError(
            f"The output file name is {len(os.fsencode(path.name))} bytes long; this file system allows {longest}.",
            hint="Choose a shorter file name.",
        )
    try:
        is_dir, parent_is_dir = path.is_dir(), parent.is_dir()
    except OSError as e:
        raise SaveError(f"Cannot use the output path {shown}: {e.strerror or e}", hint="Choose another path.") from e
    if is_dir:
        raise SaveError(f"The output path {shown} is a directory.", hint="Give a file path such as 'model.onnx'.")
    check_replaceable(path, shown)
    if not parent_is_dir:
        raise SaveError(
            f"The output folder {_shown(parent)} does not exist.",
            hint="Create it first (mkdir -p) or choose another path.",
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SaveError(
            f"The output folder {_shown(parent)} is not writable.",
            hint="Choose a folder you can write to, or fix its permissions.",
        )
    check_outputs([path], reads=reads)
    return path


def check_replaceable(path: pathlib.Path, shown: str) -> None:
    """An existing destination must be a regular file (or a link to one): replacing a device
    node (``/dev/null``) breaks the system, and a FIFO would block the write forever."""
    try:
        info = os.stat(path)  # follows a symbolic link to what it names
    except FileNotFoundError:
        return  # nothing there, or a dangling link: the save replaces the link
    except OSError as e:
        raise SaveError(f"Cannot use the output path {shown}: {e.strerror or e}", hint="Choose another path.") from e
    if not stat.S_ISREG(info.st_mode):
        raise SaveError(
            f"The output path {shown} exists and is not a regular file (a device, a FIFO or a socket); "
            "onnx_modular only replaces regular files.",
            hint="Give the path of a new or existing .onnx file.",
        )


def safe_stem(name: str, room: int) -> str:
    """``name`` as valid UTF-8 (undecodable bytes become ``_``), at most ``room`` bytes.

    A shortened stem ends with a hash of the full name, so two long names never share it.
    """
    safe = os.fsencode(name).decode("utf-8", "replace").replace("\ufffd", "_")
    if len(safe.encode()) <= room:
        return safe
    tag = "~" + hashlib.sha256(os.fsencode(name)).hexdigest()[:8]
    while len((safe + tag).encode()) > room:
        safe = safe[:-1]
    return safe + tag


def data_name(destination: pathlib.Path, token: str | None) -> str:
    """The external-data file name of one write: ``<name>.data``, or ``<name>.<token>.data``
    when the current one is in use (fits NAME_MAX)."""
    stem = safe_stem(destination.name, name_max(destination.parent) - _DATA_SUFFIX_LEN - NAME_ROOM)
    return f"{stem}.data" if token is None else f"{stem}.{token}.data"


def data_pattern(destination: pathlib.Path) -> re.Pattern[str]:
    """The names this module gives ``destination``'s data files: ``<name>.data``, ``<name>.<8 hex>.data``."""
    stem = data_name(destination, "0" * _TOKEN_HEX)[:-_DATA_SUFFIX_LEN]
    return re.compile(re.escape(stem) + rf"(\.[0-9a-f]{{{_TOKEN_HEX}}})?\.data")


def choose_data_name(destination: pathlib.Path) -> str:
    """A data-file name that no file in the folder has: ``<name>.data`` when free, else a
    ``<name>.<8 hex>.data`` of its own. An existing file is never replaced, whoever it belongs
    to (the model at the destination, or another model that refers to that name)."""
    name = data_name(destination, None)
    while os.path.lexists(destination.parent / name):
        name = data_name(destination, secrets.token_hex(_TOKEN_HEX // 2))
    return name


def data_references(model_path: pathlib.Path) -> set[str] | None:
    """External-data locations of an existing model file (every tensor it holds), ``set()``
    when there is none, ``None`` when it cannot be told (unreadable, not ONNX, too large)."""
    from onnx_modular.storage.load import read_regular_file
    from onnx_modular.storage.proto import all_tensors

    try:
        if not os.path.lexists(model_path):
            return set()
        model = onnx.ModelProto()
        model.ParseFromString(read_regular_file(model_path, str(model_path), limit=_LEGACY_SCAN_LIMIT))
    except Exception:
        return None
    locations = set()
    for tensor in all_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            locations.update(entry.value for entry in tensor.external_data if entry.key == "location")
    return locations


def referenced_data(model_path: pathlib.Path) -> set[str]:
    """External-data locations of an existing (small) model file; empty when unreadable."""
    return data_references(model_path) or set()
