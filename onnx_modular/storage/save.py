"""Atomic, checked writes of ONNX files (with or without external data).

A model is written into a private temporary folder next to the destination, checked
there with ``onnx.checker.check_model(full_check=True)`` (and, during export,
verified), and only then moved into place. A failure at any step removes the
temporary folder: no partial file, and an existing file at the destination is never
overwritten by a failed write.

External data never breaks the pair, and never touches another model's. The data file gets
the conventional name ``<name>.data`` (as ``torch.onnx.export`` writes it) when no file has
that name; otherwise (the model at the destination uses it, or another model refers to it)
this write's data goes to a new name of its own (``<name>.<8 hex>.data``): an existing file
is never replaced, except the destination itself. The data file is moved into place *before*
the model file is replaced, and the data files the previous model referred to (named as this
module names them) are removed *after*. A journal (``.onnx_modular-commit-<hash>``) lists the
new and the retired data files before anything moves, so the next save to that destination
finishes a commit that was killed half-way; nothing is ever removed by its name alone.
Concurrent saves to one destination are serialized by an advisory lock (``fcntl.flock``)
held from the choice of the data file's name to the move, so the last one wins whole. Lock and
journal files are created with ``O_EXCL | O_NOFOLLOW``. A destination that exists and is not
a regular file (a device, a FIFO) is refused before any work. SIGTERM is handled like SIGINT
while a save runs, and both wait until the renames of a commit are done; temporary folders
left by killed processes (``kill -9``) are recognised by their prefix and removed once their
owner is gone.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pathlib
import re
import secrets
import shutil
import stat
from collections.abc import Iterable, Iterator

import onnx
import onnx_ir as ir

from onnx_modular.errors import InvalidInputError, SaveError
from onnx_modular.storage.guard import check_outputs
from onnx_modular.storage.locks import (
    TEMP_PREFIX,
    destination_lock,
    open_private_file,
    private_path,
    scratch_folder,
    temp_folder,
)
from onnx_modular.storage.locks import shown_path as _shown
from onnx_modular.storage.signals import interrupt_on_sigterm, signals_deferred

__all__ = [
    "check_destination",
    "staged_save",
    "write_checked",
    "atomic_write",
    "atomic_writes",
    "write_text",
    "interrupt_on_sigterm",
    "EXTERNAL_DATA_THRESHOLD",
    "TEMP_PREFIX",
    "data_name",
    "referenced_data",
    "publish_folder",
]

# Above this many bytes of weights, store them in external data, as torch.onnx.export does for
# every model: onnxruntime reads external data straight into its tensors, while weights inside
# the protobuf are parsed and then copied, which costs 0.2-0.5 ms of session creation per MB
# (GPT-2 12 layers, 38 MB: session 1.75x torch's flat file embedded, 1.63x with external data;
# a 98 M-parameter Llama: 1.37x and 0.76x; docs/benchmarks.md). Below 1 MiB that is under 0.5 ms,
# and one file is handier.
EXTERNAL_DATA_THRESHOLD = 1024 * 1024

#: Threads writing the external data: one reads (and transposes) the next weights while another
#: writes; on 2 cores the 1B model's save went from 9.4-10.8 to 5.3-6.3 s (``docs/benchmarks.md``).
WRITER_THREADS = 2
#: Bytes of weights the writer threads hold at once (one tensor above it is written alone).
WRITER_BYTES_IN_FLIGHT = 256 * 2**20
_JOURNAL_PREFIX = ".onnx_modular-commit-"
_TOKEN_HEX = 8
_DATA_SUFFIX_LEN = len(f".{'0' * _TOKEN_HEX}.data")
# Writers add to the names they are given (onnx_ir stages ``.<name>.XXXXXXXX``, verification
# writes ``.<stem>.flat-XXXXXXXX.onnx``): names made here leave this much room below NAME_MAX.
_NAME_ROOM = 48
_LEGACY_SCAN_LIMIT = 64 * 1024 * 1024  # read an old model's data references only when it is this small


def _name_max(folder: pathlib.Path) -> int:
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
    name_max = _name_max(parent)
    if len(os.fsencode(path.name)) > name_max:
        raise SaveError(
            f"The output file name is {len(os.fsencode(path.name))} bytes long; this file system allows {name_max}.",
            hint="Choose a shorter file name.",
        )
    try:
        is_dir, parent_is_dir = path.is_dir(), parent.is_dir()
    except OSError as e:
        raise SaveError(f"Cannot use the output path {shown}: {e.strerror or e}", hint="Choose another path.") from e
    if is_dir:
        raise SaveError(f"The output path {shown} is a directory.", hint="Give a file path such as 'model.onnx'.")
    _check_replaceable(path, shown)
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


def _check_replaceable(path: pathlib.Path, shown: str) -> None:
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


def _initializer_bytes(model: ir.Model) -> int:
    total = 0
    for value in model.graph.initializers.values():
        if value.const_value is not None:
            total += value.const_value.nbytes
    return total


def wants_external_data(model: ir.Model, external_data: bool | None) -> bool:
    return _initializer_bytes(model) > EXTERNAL_DATA_THRESHOLD if external_data is None else external_data


# -- names -------------------------------------------------------------------------------


def _safe_stem(name: str, room: int) -> str:
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
    stem = _safe_stem(destination.name, _name_max(destination.parent) - _DATA_SUFFIX_LEN - _NAME_ROOM)
    return f"{stem}.data" if token is None else f"{stem}.{token}.data"


def _data_pattern(destination: pathlib.Path) -> re.Pattern[str]:
    """The names this module gives ``destination``'s data files: ``<name>.data``, ``<name>.<8 hex>.data``."""
    stem = data_name(destination, "0" * _TOKEN_HEX)[:-_DATA_SUFFIX_LEN]
    return re.compile(re.escape(stem) + rf"(\.[0-9a-f]{{{_TOKEN_HEX}}})?\.data")


def _choose_data_name(destination: pathlib.Path) -> str:
    """A data-file name that no file in the folder has: ``<name>.data`` when free, else a
    ``<name>.<8 hex>.data`` of its own. An existing file is never replaced, whoever it belongs
    to (the model at the destination, or another model that refers to that name)."""
    name = data_name(destination, None)
    while os.path.lexists(destination.parent / name):
        name = data_name(destination, secrets.token_hex(_TOKEN_HEX // 2))
    return name


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EROFS):  # file systems without fsync on this kind of file
            raise
    finally:
        os.close(fd)


def _references(model_path: pathlib.Path) -> set[str] | None:
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
    return _references(model_path) or set()


# -- the write ----------------------------------------------------------------------------


class Staging:
    """Where to write one model: ``model_path`` (in a temporary folder) and, for external
    data, the relative ``data_location`` to record in the model (its file sits next to
    ``model_path``)."""

    def __init__(self, tmpdir: pathlib.Path, destination: pathlib.Path):
        self.destination = destination
        self.model_path = tmpdir / _safe_stem(destination.name, _name_max(tmpdir) - _NAME_ROOM)
        self.data_location = _choose_data_name(destination)
        #: Whether the commit removes the data files of the model it replaces. A report (a text
        #: file) replaces the file named and nothing else, whatever that file was.
        self.retires_previous_data = True
        #: Permission bits the file may have at most (a copy of a private file stays private),
        #: whatever the mode of the file it replaces.
        self.max_mode: int | None = None


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[Staging]:
    """Stage a write of ``path``: write the model to ``staging.model_path`` (external data,
    if any, at ``staging.data_location``); on a normal exit it is moved into place.

    If the body raises, nothing is moved and the temporary files are removed.

    Example::

        with atomic_write("m.onnx") as staging:
            onnx.save(model, staging.model_path, save_as_external_data=True,
                      location=staging.data_location)
    """
    with atomic_writes([path]) as (staging,):
        yield staging


@contextlib.contextmanager
def atomic_writes(paths: list[str | os.PathLike]) -> Iterator[list[Staging]]:
    """Stage writes of several files that belong together (a modular file and its flat copy):
    all are moved into place, or none.

    As :func:`atomic_write`, one :class:`Staging` per path. The files are committed in order
    after the body; if a commit fails, the files already moved are put back as they were (the
    previous model restored, the new data file removed by the commit journal), and no previous
    data file is removed before every file of the set is in place.

    Example::

        with atomic_writes(["m.onnx", "m.flat.onnx"]) as (modular, flat):
            ...  # write both, check both; raising here moves neither
    """
    destinations = [check_destination(path) for path in paths]
    if len({os.path.abspath(d) for d in destinations}) != len(destinations):
        raise InvalidInputError(
            "Two files of one save have the same path: " + ", ".join(_shown(d) for d in destinations) + ".",
            hint="Give each file its own path.",
        )
    with interrupt_on_sigterm(), contextlib.ExitStack() as stack:
        tmpdirs = [stack.enter_context(temp_folder(_parent(d))) for d in destinations]
        # Locks in one order for every writer: two saves of the same set wait, never deadlock. Each
        # is held from the choice of the data file's name to the move: a concurrent save to the same
        # destination waits, then sees this one's model.
        for destination in sorted(destinations, key=lambda d: (str(_parent(d).resolve()), d.name)):
            stack.enter_context(destination_lock(destination))
        for destination in destinations:
            _finish_interrupted_commit(destination)
        stagings = [Staging(tmpdir, d) for tmpdir, d in zip(tmpdirs, destinations)]
        yield stagings
        try:
            for staging in stagings:
                staged_data = staging.model_path.parent / staging.data_location
                if staging.model_path.exists():
                    # A file written over an existing one keeps its permissions (a private 0600 model stays
                    # private); onnx's external-data writer creates the data file 0600: it gets the model's.
                    mode = _existing_mode(staging.destination)
                    if mode is None:
                        mode = stat.S_IMODE(staging.model_path.stat().st_mode)
                    if staging.max_mode is not None:
                        mode &= staging.max_mode
                    os.chmod(staging.model_path, mode)
                    if staged_data.exists():
                        os.chmod(staged_data, stat.S_IMODE(staging.model_path.stat().st_mode))
                for staged in (staged_data, staging.model_path):
                    if staged.exists():
                        _fsync(staged)
            with signals_deferred():
                _commit_all(stagings)
        except OSError as e:
            shown = ", ".join(_shown(d) for d in destinations)
            raise SaveError(f"Moving the file into {shown} failed: {e}") from e


def _existing_mode(destination: pathlib.Path) -> int | None:
    """The permission bits of the regular file at ``destination`` (through a link), None when there is none."""
    try:
        info = os.stat(destination)
    except OSError:
        return None
    return stat.S_IMODE(info.st_mode) if stat.S_ISREG(info.st_mode) else None


def _removable(path: pathlib.Path, destination: pathlib.Path) -> bool:
    """A previous data file of ``destination`` may be removed: a regular file (not a link) that no
    other model this process read refers to (:func:`~onnx_modular.storage.load.data_file_in_use`)."""
    from onnx_modular.storage.load import data_file_in_use

    try:
        return (
            stat.S_ISREG(os.lstat(path).st_mode)
            and not data_file_in_use(path, replaced=destination)
            and not _read_by_sibling(path, destination)
        )
    except OSError:
        return False


def _read_by_sibling(path: pathlib.Path, destination: pathlib.Path) -> bool:
    """Whether another ``.onnx`` file of ``path``'s folder refers to it (a ``decode.onnx`` that reads
    its shared weights from ``prefill.onnx.data``): the data file outlives the model it was written with."""
    folder = path.parent
    try:
        entries = [entry for entry in os.scandir(folder) if entry.name.endswith(".onnx") and entry.is_file(follow_symlinks=False)]
    except OSError:
        return False
    for entry in entries:
        if entry.name == destination.name:
            continue
        if path.name in (_references(folder / entry.name) or set()):  # unreadable: not a model that reads it
            return True
    return False


def _parent(destination: pathlib.Path) -> pathlib.Path:
    return destination.parent if str(destination.parent) else pathlib.Path(".")


def _write_journal(destination: pathlib.Path, names: list[str]) -> pathlib.Path:
    """Record the data files a commit creates and retires, before it touches any."""
    journal = private_path(destination, _JOURNAL_PREFIX)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(journal)  # a finished one: _finish_interrupted_commit read it
    fd = open_private_file(journal, create=True)
    try:
        os.write(fd, json.dumps(names).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return journal


def _finish_interrupted_commit(destination: pathlib.Path) -> None:
    """After a commit killed half-way, remove the data files it recorded that the model at
    the destination does not refer to (the new data of a model never moved, or the previous
    data of a model that was replaced). Only names the journal lists and that follow this
    destination's data-file naming are removed: nothing the journal cannot prove we made."""
    journal = private_path(destination, _JOURNAL_PREFIX)
    if not os.path.lexists(journal):
        return
    from onnx_modular.storage.load import read_regular_file

    try:
        names = json.loads(read_regular_file(journal, str(journal), limit=1 << 16))
    except Exception:
        names = None
    current = _references(destination)
    if isinstance(names, list) and current is not None:
        own = _data_pattern(destination)
        for name in names:
            if isinstance(name, str) and name not in current and own.fullmatch(name):
                with contextlib.suppress(OSError):
                    if _removable(destination.parent / name, destination):
                        os.unlink(destination.parent / name)
    with contextlib.suppress(OSError):
        os.unlink(journal)


def _move_without_replacing(source: pathlib.Path, target: pathlib.Path) -> None:
    """Move ``source`` to ``target``, failing rather than replacing a file that appeared there."""
    try:
        os.link(source, target)
    except FileExistsError as e:
        raise SaveError(f"{_shown(target)} appeared during the save; it was not replaced.", hint="Save again.") from e
    except OSError:  # a file system without hard links
        if os.path.lexists(target):
            raise SaveError(f"{_shown(target)} appeared during the save; it was not replaced.", hint="Save again.") from None
        os.replace(source, target)
    # (a linked source stays in the temporary folder, removed with it)


class _Moved:
    """One file of a set moved into place: its retired data files and journal, whether its model
    file moved yet, and the previous model (a hard link in the temporary folder) to restore if a
    later file fails."""

    def __init__(self, staging: Staging, retired: list[str], journal: pathlib.Path | None):
        self.staging, self.retired, self.journal = staging, retired, journal
        self.backup: pathlib.Path | None = None
        self.model_moved = False


def _commit_all(stagings: list[Staging]) -> None:
    """Move every data file of the set into place, then every model file, then retire the previous
    data files; if a move fails, the files already moved are restored first.

    Every data file goes in before any model: a model of the set may read another's data
    (``decode.onnx`` reads ``prefill.onnx.data``), so a ``kill -9`` between two moves never leaves a
    model pointing at a data file that is not there yet (the journal of each destination lists the
    new data, so the next save there removes what no model reads)."""
    moved: list[_Moved] = []
    try:
        for staging in stagings:
            moved.append(_move_data_in(staging))
        for entry in moved:
            _move_model_in(entry, keep_previous=len(stagings) > 1)
    except BaseException:
        for entry in reversed(moved):
            _restore(entry)
        raise
    for entry in moved:
        _retire(entry)


def _move_data_in(staging: Staging) -> _Moved:
    """The data file of one staging, first: a journal lists the new data file and the previous
    model's data files (only those named as this module names them) before anything moves, so the
    next save can finish a commit that was killed half-way (:func:`_finish_interrupted_commit`)."""
    destination = staging.destination
    tmpdir, parent = staging.model_path.parent, _parent(destination)
    staged_data = tmpdir / staging.data_location
    if not staged_data.exists():
        staged_data = None
    _check_replaceable(destination, _shown(destination))  # it may have changed since the check
    previous = (_references(destination) or set()) if staging.retires_previous_data else set()
    own = _data_pattern(destination)
    retired = sorted(name for name in previous if name != staging.data_location and own.fullmatch(name))
    created = [staging.data_location] if staged_data is not None else []
    journal = _write_journal(destination, created + retired) if created or retired else None
    entry = _Moved(staging, retired, journal)
    if staged_data is not None:
        _move_without_replacing(staged_data, parent / staging.data_location)
        _fsync(parent)
    return entry


def _move_model_in(entry: _Moved, *, keep_previous: bool) -> None:
    """Then the model file, in one rename (its previous version kept aside while the set commits)."""
    staging = entry.staging
    destination = staging.destination
    if keep_previous and os.path.lexists(destination):
        entry.backup = staging.model_path.parent / f".{secrets.token_hex(8)}.previous"
        try:
            os.link(destination, entry.backup)
        except OSError:
            shutil.copy2(destination, entry.backup)
    os.replace(staging.model_path, destination)
    entry.model_moved = True
    _fsync(_parent(destination))


def _retire(entry: _Moved) -> None:
    """Remove the data files the previous model used (regular files this module named), then the journal."""
    parent = _parent(entry.staging.destination)
    for name in entry.retired:
        with contextlib.suppress(OSError):
            if _removable(parent / name, entry.staging.destination):
                os.unlink(parent / name)
    if entry.journal is not None:
        with contextlib.suppress(OSError):
            os.unlink(entry.journal)


def _restore(entry: _Moved) -> None:
    """Undo one commit's moves (best effort): the previous model back (or the new one removed),
    then the journal removes the new data file that no model refers to any more."""
    destination = entry.staging.destination
    if entry.model_moved:
        with contextlib.suppress(OSError):
            if entry.backup is not None:
                os.replace(entry.backup, destination)
            else:
                os.unlink(destination)
    with contextlib.suppress(OSError):
        _finish_interrupted_commit(destination)
        _fsync(_parent(destination))


@contextlib.contextmanager
def scratch_model_file(model: ir.Model, purpose: str = "") -> Iterator[pathlib.Path]:
    """``model`` written to a private temporary folder (:func:`~onnx_modular.storage.locks.scratch_folder`)
    for the duration, its weights in ``model.onnx.data`` when they are large: an in-memory export
    run by onnxruntime, checked or profiled."""
    with scratch_folder(purpose) as folder:
        path = folder / "model.onnx"
        ir.save(model, path, external_data="model.onnx.data" if wants_external_data(model, None) else None)
        yield path


@contextlib.contextmanager
def staged_save(
    model: ir.Model, path: str | os.PathLike, *, external_data: bool | None = None, full_check: bool = True
) -> Iterator[pathlib.Path]:
    """Write ``model`` to a temporary path, yield it for checks, then move it into place.

    If the body of the ``with`` raises, nothing is moved and the temporary files
    are removed.

    Example::

        with staged_save(model, "m.onnx") as staged:
            run_checks(staged)      # raising here leaves "m.onnx" untouched
    """
    with atomic_write(path) as staging:
        yield write_checked(model, staging, external_data=external_data, full_check=full_check)


def write_checked(
    model: ir.Model, staging: Staging, *, external_data: bool | None = None, full_check: bool = True
) -> pathlib.Path:
    """Write ``model`` (functions callee-first) where ``staging`` says, check it with
    ``onnx.checker(full_check=True)``, and return the staged path.

    ``external_data``: ``None`` decides by size (:data:`EXTERNAL_DATA_THRESHOLD`).
    ``full_check=False``: the checker without strict type inference, for files with onnxruntime's
    contrib ops (``com.microsoft``), which onnx has no schemas for: their outputs have no inferred
    type, and strict inference refuses every op reading them. The caller runs the file in
    onnxruntime instead.
    """
    from onnx_modular.passes.function_order import SortFunctionsPass
    from onnx_modular.storage import ort_schemas

    SortFunctionsPass()(model)  # every file callee-first: readers that resolve functions in file order
    external = wants_external_data(model, external_data)
    if not external:
        # ir.save keeps a tensor still read from the source's data file as such a reference, relative
        # to a folder it is not written to ("should be stored in .onnx_modular-tmp-.../m.onnx.data"):
        # a model small enough to hold its weights reads them now.
        ir.external_data.load_to_model(model)
    staged, destination = staging.model_path, staging.destination
    try:
        ir.save(
            model, staged, external_data=staging.data_location if external else None,
            max_workers=WRITER_THREADS, max_in_flight_bytes=WRITER_BYTES_IN_FLIGHT,
        )
    except OSError as e:
        raise SaveError(f"Writing {_shown(destination)} failed: {e}", hint="Check free disk space and permissions.") from e
    ort_schemas.register()  # onnxruntime's SimplifiedLayerNormalization (ONNX domain) known to the checker
    try:
        onnx.checker.check_model(str(staged), full_check=full_check)
    except Exception as e:
        raise SaveError(
            f"The ONNX checker rejected the model: {e}",
            hint="This is a bug in onnx_modular or torch's translator; please report it with the model.",
        ) from e
    return staged


def write_text(path: str | os.PathLike, text: str) -> pathlib.Path:
    """Write a text file (a report: JSON, HTML) atomically, as models are written: into a
    private folder next to ``path``, then moved into place; a failure leaves ``path`` as it was.
    """
    with atomic_write(path) as staging:
        staging.retires_previous_data = False
        try:
            staging.model_path.write_text(text, encoding="utf-8")
        except OSError as e:
            raise SaveError(f"Writing {_shown(staging.destination)} failed: {e}", hint="Check free disk space and permissions.") from e
        destination = staging.destination
    return destination


# -- folders ------------------------------------------------------------------------------


def _link_or_copy(source: pathlib.Path, target: pathlib.Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _restage_model(source: pathlib.Path, staging: Staging, locations: dict[str, str] | None = None) -> None:
    """Stage the model file ``source`` (written by another writer, its external data beside it) at
    ``staging``: its own data file linked (not copied) under ``staging.data_location``, the
    references rewritten to that name. ``locations`` maps the data files of other models of the
    same folder this one also reads (:func:`~onnx_modular.storage.shared_data.share_external_data`)
    to their new names; those are staged with their own model. The weights are never read."""
    from onnx_modular.storage.proto import all_tensors

    locations = locations or {}
    model = onnx.load(str(source), load_external_data=False)
    own = set()
    for tensor in all_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    if entry.value in locations:
                        entry.value = locations[entry.value]
                    else:
                        own.add(entry.value)
                        entry.value = staging.data_location
    if len(own) > 1:
        raise SaveError(f"{_shown(source.name)} refers to {len(own)} external-data files of its own; one is expected.")
    for location in own:
        data = source.parent / location
        if os.path.isabs(location) or data.parent != source.parent or not stat.S_ISREG(os.lstat(data).st_mode):
            raise SaveError(f"{_shown(source.name)} refers to external data {_shown(location)} outside its folder.")
        _link_or_copy(data, staging.model_path.parent / staging.data_location)
    with open(staging.model_path, "wb") as file:
        file.write(model.SerializeToString())


def _data_owners(folder: pathlib.Path, models: list[str]) -> dict[str, str]:
    """``{data file: model}`` for the models of ``folder``: a data file belongs to the model it is
    named after (``<model>.data``, ``<model>.<8 hex>.data``), else to the one model that reads it."""
    owners: dict[str, str] = {}
    readers: dict[str, list[str]] = {}
    for model in models:
        for location in referenced_data(folder / model):
            readers.setdefault(location, []).append(model)
    for location, names in readers.items():
        named = [model for model in models if _data_pattern(folder / model).fullmatch(location)]
        owner = named or (names if len(names) == 1 else [])
        if len(owner) != 1:
            raise SaveError(f"The external-data file {_shown(location)} has no one model it belongs to ({', '.join(names)} read it).")
        owners[location] = owner[0]
    return owners


def _publish_models(
    source: pathlib.Path, output: pathlib.Path, models: list[str], others: list[str], modes, everyone: list[str]
) -> None:
    """One commit of ``models`` (and the plain files ``others``) from ``source`` into ``output``:
    each model's own data file linked under the name its staging chose, and every reference to it
    from another model of the set rewritten to that name. ``everyone``: all the models of the folder
    (a data file of one outside the set keeps its name)."""
    owners = _data_owners(source, everyone)
    with atomic_writes([output / name for name in models + others]) as stagings:
        by_name = dict(zip(models + others, stagings))
        new_names = {
            location: by_name[model].data_location if model in models else location for location, model in owners.items()
        }
        for name in models:
            staging = by_name[name]
            shared = {loc: new for loc, new in new_names.items() if owners[loc] != name}
            _restage_model(source / name, staging, shared)
        for name in others:
            staging = by_name[name]
            staging.retires_previous_data = False
            _link_or_copy(source / name, staging.model_path)
            staging.max_mode = (modes or {}).get(name)


def _own_data(folder: pathlib.Path, model: str) -> set[str]:
    return {location for location in referenced_data(folder / model) if _data_pattern(folder / model).fullmatch(location)}


def publish_folder(staged: pathlib.Path, output: pathlib.Path, *, modes: dict[str, int] | None = None) -> list[str]:
    """Move the files of a folder written aside (``staged``: ``save_pretrained`` into a private
    folder) into ``output``, through this module's commit, so a folder export has the guarantees
    of a file save: all files move or none (a failed move restores the ones already moved; SIGINT
    and SIGTERM wait for the moves), a model's external data goes to a name no other file has (an
    existing ``model.onnx.data`` of another model is never overwritten) and the previous data is
    retired by the journal, entries of ``output`` that are links are replaced, never followed, a
    FIFO or device there is refused, and a file written over another keeps that file's mode.
    ``modes``: the most permission bits a file may get (a copy of a private tokenizer file). A
    model may read tensors from another model's data file (``share_external_data``): both are
    moved in one commit, the reference following the data file's new name.

    Returns the names written, in order.
    """
    if os.path.lexists(output) and not output.is_dir():
        raise SaveError(f"The output folder {_shown(output)} is not a folder.", hint="Give a folder path.")
    output.mkdir(exist_ok=True)
    names = sorted(os.listdir(staged))
    data_files = {name for model in names if model.endswith(".onnx") for name in referenced_data(staged / model)}
    names = [name for name in names if name not in data_files]
    for name in names:
        if not stat.S_ISREG(os.lstat(staged / name).st_mode):
            raise SaveError(f"The export wrote {_shown(name)}, which is not a file; onnx_modular writes files only.")
    models = [name for name in names if name.endswith(".onnx")]
    _publish_models(staged, output, models, [name for name in names if name not in models], modes, models)
    # transformers' from_pretrained (and the Hub) expect <name>.data: a model whose previous data held
    # that name got a name of its own; that name is free now, so the model moves to it (linked, not copied),
    # with the models that read its data. A model of the set that moves with them may in turn get a name
    # of its own (its <name>.data still in place), hence the next round; nothing is read twice over.
    for _ in range(len(models) + 1):
        moving = [
            name for name in models
            if _own_data(output, name) not in ({data_name(output / name, None)}, set())
            and not os.path.lexists(output / data_name(output / name, None))
        ]
        if not moving:
            break
        owned = {location for name in moving for location in _own_data(output, name)}
        readers = [name for name in models if name not in moving and referenced_data(output / name) & owned]
        _publish_models(output, output, moving + readers, [], None, models)
    return names
