"""The one guard every output goes through: no write destroys a file a model reads.

An output (a model, its data file, a JSON or HTML report, a folder) may not be:

- a file the running command reads: its input model, that model's external-data files, an
  ``--inputs`` archive, a file of an input folder;
- an external-data file of any model in the destination's folder (``decode.onnx`` reading its
  shared weights from ``prefill.onnx.data``, ``b.onnx`` and ``b.onnx.data``);
- Python source the running program executes: a module it imported (a factory's ``tiny.py``);
- another output of the same command (:func:`command_outputs`: ``-o``, ``--json``, ``--flat-file``,
  ``--html``, ``--trace`` are distinct files, none inside another's folder) or a file the command
  already wrote.

Editing in place is the one exception, asked for explicitly (``replace --in-place``): the command
leaves its input out of :func:`reading` and writes it atomically.

:func:`check_outputs` is called by each tool before any work (``save.check_destination(path,
reads=[input])``) and again by the writer itself (:func:`~onnx_modular.storage.commit.atomic_writes`)
for every file it is about to move in, with the files the running command declared it reads
(:func:`reading`, which the command line sets for every command). The error names the model
that owns the file.

The neighbours are read cheaply: the ``.onnx`` files of the folder (at most
:data:`~onnx_modular.storage.limits.MAX_NEIGHBOUR_MODELS`, those whose name starts the output's
name first) are mapped into memory and only their tensors' ``external_data`` entries are decoded
from the protobuf wire format; no weight is read and nothing is parsed whole.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.machinery
import mmap
import os
import pathlib
import stat
import sys
from collections.abc import Iterable, Iterator

import onnx

from onnx_modular.errors import InvalidInputError
from onnx_modular.storage.limits import MAX_NEIGHBOUR_MODELS, MAX_SCANNED_FIELDS
from onnx_modular.storage.load import WIRE_LENGTH, MalformedFile, wire_fields
from onnx_modular.storage.locks import shown_path

__all__ = ["check_outputs", "reading", "data_locations", "protected_files", "command_outputs", "record_written", "rewriting"]

_READS: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("onnx_modular_reads", default=())
# {place: what wrote it} of the files the running command has written (None: no command declared).
_WRITTEN: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("onnx_modular_written", default=None)
_SOURCE_SUFFIXES = (*importlib.machinery.all_suffixes(), ".pyc", ".pyi", ".pth")


def _numbers(message, *names: str) -> set[int]:
    return {message.DESCRIPTOR.fields_by_name[name].number for name in names}


# Where tensors live in a ModelProto, as (message kind -> {field number: kind of the field's message}).
_SCHEMA: dict[str, dict[int, str]] = {
    "model": {**dict.fromkeys(_numbers(onnx.ModelProto, "graph"), "graph"),
              **dict.fromkeys(_numbers(onnx.ModelProto, "functions"), "function")},
    "graph": {**dict.fromkeys(_numbers(onnx.GraphProto, "node"), "node"),
              **dict.fromkeys(_numbers(onnx.GraphProto, "initializer"), "tensor"),
              **dict.fromkeys(_numbers(onnx.GraphProto, "sparse_initializer"), "sparse")},
    "function": dict.fromkeys(_numbers(onnx.FunctionProto, "node"), "node"),
    "node": dict.fromkeys(_numbers(onnx.NodeProto, "attribute"), "attribute"),
    "attribute": {**dict.fromkeys(_numbers(onnx.AttributeProto, "t", "tensors"), "tensor"),
                  **dict.fromkeys(_numbers(onnx.AttributeProto, "g", "graphs"), "graph"),
                  **dict.fromkeys(_numbers(onnx.AttributeProto, "sparse_tensor", "sparse_tensors"), "sparse")},
    "sparse": dict.fromkeys(_numbers(onnx.SparseTensorProto, "values", "indices"), "tensor"),
    "tensor": dict.fromkeys(_numbers(onnx.TensorProto, "external_data"), "entry"),
}  # fmt: skip
_KEY, _VALUE = (onnx.StringStringEntryProto.DESCRIPTOR.fields_by_name[n].number for n in ("key", "value"))


def _entry(data, start: int, end: int) -> tuple[bytes, bytes]:
    key = value = b""
    for number, wire_type, _, payload, stop in wire_fields(data, start, end):
        if wire_type == WIRE_LENGTH and number == _KEY:
            key = bytes(data[payload:stop])
        elif wire_type == WIRE_LENGTH and number == _VALUE:
            value = bytes(data[payload:stop])
    return key, value


def _scan(data) -> set[str]:
    """The ``location`` of every external-data entry in a serialized model (wire format only)."""
    locations: set[str] = set()
    stack = [("model", 0, len(data))]
    visited = 0
    while stack:
        kind, start, end = stack.pop()
        for number, wire_type, _, payload, stop in wire_fields(data, start, end):
            visited += 1
            if visited > MAX_SCANNED_FIELDS:
                return locations
            child = _SCHEMA[kind].get(number)
            if child is None or wire_type != WIRE_LENGTH:
                continue
            if child == "entry":
                key, value = _entry(data, payload, stop)
                if key == b"location":
                    locations.add(value.decode("utf-8", "replace"))
            else:
                stack.append((child, payload, stop))
    return locations


def data_locations(model: str | os.PathLike) -> set[str]:
    """External-data locations the ``.onnx`` file ``model`` refers to (as written in the file),
    read without loading it; empty when it is not a readable regular file or not ONNX."""
    try:
        fd = os.open(model, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError):
        return set()
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
            return set()
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as data:
            try:
                return _scan(data)
            except (MalformedFile, IndexError, ValueError):
                return set()
    except OSError:
        return set()
    finally:
        os.close(fd)


def _places(folder: pathlib.Path, name: str) -> set[str]:
    """The paths a file ``name`` of ``folder`` is known by: as written (the entry a write replaces)
    and resolved (what it names, through links)."""
    entry = os.path.normpath(os.path.join(os.path.realpath(folder), name))
    return {entry, os.path.realpath(entry)}


def _reads_of(path: pathlib.Path) -> dict[str, str]:
    """``{place: owner}`` of one file a command reads: the file, and for a model its data files;
    for a folder (a checkpoint), the files in it."""
    owned: dict[str, str] = {}
    shown = shown_path(path)
    if path.is_dir():
        with contextlib.suppress(OSError):
            for index, entry in enumerate(sorted(os.listdir(path))):
                if index >= MAX_NEIGHBOUR_MODELS * 16:
                    break
                for place in _places(path, entry):
                    owned[place] = f"a file of the input folder {shown}"
        return owned
    for place in _places(path.parent, path.name):
        owned[place] = f"the input file {shown}"
    for location in data_locations(path):
        for place in _places(path.parent, location):
            owned.setdefault(place, f"the external data of the input {shown}")
    return owned


def _neighbours(folder: pathlib.Path, names: set[str]) -> dict[str, str]:
    """``{place: owner}`` of the external-data files the models of ``folder`` read; the models whose
    name starts one of ``names`` (``b.onnx`` for ``b.onnx.data``) are read first."""
    try:
        entries = [e for e in os.scandir(folder) if e.name.endswith(".onnx") and e.is_file(follow_symlinks=False)]
    except OSError:
        return {}
    entries.sort(key=lambda e: (not any(n.startswith(e.name) for n in names), e.name))
    owned: dict[str, str] = {}
    for entry in entries[:MAX_NEIGHBOUR_MODELS]:
        for location in data_locations(entry.path):
            for place in _places(folder, location):
                owned.setdefault(place, f"the external data of {shown_path(entry.name)}, a model in the same folder")
    return owned


def protected_files(outputs: Iterable[pathlib.Path], reads: Iterable[str | os.PathLike] = ()) -> dict[str, str]:
    """``{place: owner}`` of every file the outputs may not replace (see the module's docstring)."""
    owned: dict[str, str] = {}
    for read in [*_READS.get(), *reads]:
        with contextlib.suppress(OSError, ValueError):
            owned.update(_reads_of(pathlib.Path(read)))
    by_folder: dict[str, set[str]] = {}
    for output in outputs:
        folder = output.parent if str(output.parent) else pathlib.Path(".")
        by_folder.setdefault(os.path.realpath(folder), set()).add(output.name)
    for folder, names in by_folder.items():
        for place, owner in _neighbours(pathlib.Path(folder), names).items():
            owned.setdefault(place, owner)
    return owned


def check_outputs(outputs: Iterable[str | os.PathLike], *, reads: Iterable[str | os.PathLike] = ()) -> None:
    """Refuse, before any work, an output that is a file a model reads (see the module's docstring).

    ``reads``: the files the command reads (its input models, ``--inputs``), besides those
    declared with :func:`reading`.

    Raises:
        InvalidInputError: Naming the output and the model that owns the file.
    """
    paths = [pathlib.Path(os.fspath(p)) for p in outputs]
    paths = [p for p in paths if p.name not in ("", ".", "..")]
    if not paths:
        return
    for path in paths:
        _check_not_source(path)
        _check_not_written(path)
    owned = protected_files(paths, reads)
    if not owned:
        return
    for path in paths:
        folder = path.parent if str(path.parent) else pathlib.Path(".")
        for place in sorted(_places(folder, path.name)):
            if place in owned:
                raise InvalidInputError(
                    f"The output {shown_path(path)} is {owned[place]}; writing it would destroy a model's weights "
                    "or its source.",
                    hint="Write the output to another path (a new file name, or another folder).",
                )


@contextlib.contextmanager
def reading(paths: Iterable[str | os.PathLike | None]) -> Iterator[None]:
    """Declare the files the running command reads: every write inside the ``with`` refuses them
    (and their external data) as outputs."""
    kept = tuple(os.fspath(p) for p in paths if isinstance(p, (str, os.PathLike)) and os.fspath(p) not in ("", "-"))
    token = _READS.set(_READS.get() + kept)
    try:
        yield
    finally:
        _READS.reset(token)


def _place_of(path: pathlib.Path) -> set[str]:
    folder = path.parent if str(path.parent) else pathlib.Path(".")
    return _places(folder, path.name)


def _check_not_source(path: pathlib.Path) -> None:
    """A Python file the program has imported (a factory's module) is never an output."""
    if not path.name.endswith(_SOURCE_SUFFIXES):
        return
    places = _place_of(path)
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and os.path.realpath(file) in places:
            raise InvalidInputError(
                f"The output {shown_path(path)} is the Python source of the module {getattr(module, '__name__', '?')!r}, "
                "which this command runs; writing it would destroy the source.",
                hint="Write the output to another path (model.onnx, report.json).",
            )


def _check_not_written(path: pathlib.Path) -> None:
    written = _WRITTEN.get()
    if not written:
        return
    for place in sorted(_place_of(path)):
        if place in written:
            raise InvalidInputError(
                f"The output {shown_path(path)} is {written[place]}; one command never writes two outputs to one file.",
                hint="Give each output (-o, --json, --flat-file, --html, --trace) its own path.",
            )


def record_written(paths: Iterable[str | os.PathLike], what: str = "a file this command already wrote") -> None:
    """Note files the running command wrote (the commit calls it): a later output of the same
    command may not replace them (no-op outside :func:`command_outputs`)."""
    written = _WRITTEN.get()
    if written is None:
        return
    for path in paths:
        for place in _place_of(pathlib.Path(os.fspath(path))):
            written.setdefault(place, what)


def _inside(inner: str, outer: str) -> bool:
    return inner != outer and inner.startswith(outer.rstrip(os.sep) + os.sep)


def check_distinct(named: dict[str, str | os.PathLike | None]) -> None:
    """Refuse two outputs of one command naming one file, or one output inside another's folder
    (``--json DIR/model.onnx`` with ``-o DIR``). ``named``: ``{option: path}``; ``None`` and ``-`` skipped."""
    seen: list[tuple[str, str]] = []
    for option, value in named.items():
        if not isinstance(value, (str, os.PathLike)) or os.fspath(value) in ("", "-"):
            continue
        path = pathlib.Path(os.fspath(value))
        place = os.path.realpath(path)
        for other, other_place in seen:
            if place == other_place or _inside(place, other_place) or _inside(other_place, place):
                same = place == other_place
                raise InvalidInputError(
                    f"{option} {shown_path(path)} {'is the same file as' if same else 'overlaps'} the path of {other}; "
                    + ("the second write would replace the first." if same else "one output would be written inside the other."),
                    hint="Give each output (-o, --json, --flat-file, --html, --trace) its own path.",
                )
        seen.append((option, place))


@contextlib.contextmanager
def command_outputs(named: dict[str, str | os.PathLike | None]) -> Iterator[None]:
    """The outputs one command names, checked distinct (:func:`check_distinct`); inside the ``with``,
    every file written is recorded and no later write of the command may replace it."""
    check_distinct(named)
    token = _WRITTEN.set({})
    try:
        yield
    finally:
        _WRITTEN.reset(token)


@contextlib.contextmanager
def rewriting() -> Iterator[None]:
    """Inside, the command may move again files it wrote itself (a folder's models renamed to their
    data files' final names after the first commit); nothing is recorded meanwhile."""
    token = _WRITTEN.set(None)
    try:
        yield
    finally:
        _WRITTEN.reset(token)
