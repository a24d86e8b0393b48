"""The journaled atomic commit every file goes through: :func:`atomic_writes` (and :func:`atomic_write`).

It owns the staging of files in a private folder next to their destination, the move into place
(data files first, then models, all or none), the journal and the retirement of the previous data.
The checked model writer is :mod:`~onnx_modular.storage.save`, folders are
:mod:`~onnx_modular.storage.folders`, destinations and data-file names
:mod:`~onnx_modular.storage.destination`.

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
import contextvars
import errno
import json
import os
import pathlib
import secrets
import shutil
import stat
from collections.abc import Iterator

from onnx_modular.errors import InvalidInputError, SaveError
from onnx_modular.storage.destination import (
    NAME_ROOM,
    check_destination,
    check_replaceable,
    choose_data_name,
    data_pattern,
    data_references,
    name_max,
    safe_stem,
)
from onnx_modular.storage.guard import record_written
from onnx_modular.storage.locks import destination_lock, open_private_file, private_path, temp_folder
from onnx_modular.storage.locks import shown_path as _shown
from onnx_modular.storage.signals import interrupt_on_sigterm, signals_deferred

__all__ = ["Staging", "atomic_write", "atomic_writes"]

JOURNAL_PREFIX = ".onnx_modular-commit-"
#: ``(mirror, folder)`` while a folder is committed into its mirror (:mod:`~onnx_modular.storage.folders`):
#: a file of the mirror is the folder's file of that name (the model a save replaces, by its real path).
MIRRORED: contextvars.ContextVar[tuple[pathlib.Path, pathlib.Path] | None] = contextvars.ContextVar(
    "onnx_modular_mirrored", default=None)


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EROFS):  # file systems without fsync on this kind of file
            raise
    finally:
        os.close(fd)


class Staging:
    """Where to write one model: ``model_path`` (in a temporary folder) and, for external
    data, the relative ``data_location`` to record in the model (its file sits next to
    ``model_path``)."""

    def __init__(self, tmpdir: pathlib.Path, destination: pathlib.Path):
        self.destination = destination
        self.model_path = tmpdir / safe_stem(destination.name, name_max(tmpdir) - NAME_ROOM)
        self.data_location = choose_data_name(destination)
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
            record_written(destinations)  # no later output of the command replaces them (guard.py)
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
            and not data_file_in_use(path, replaced=_real(destination))
            and not _read_by_sibling(path, destination)
        )
    except OSError:
        return False


def _real(destination: pathlib.Path) -> pathlib.Path:
    mirrored = MIRRORED.get()
    if mirrored is not None and _parent(destination).resolve() == mirrored[0].resolve():
        return mirrored[1] / destination.name
    return destination


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
        if path.name in (data_references(folder / entry.name) or set()):  # unreadable: not a model that reads it
            return True
    return False


def _parent(destination: pathlib.Path) -> pathlib.Path:
    return destination.parent if str(destination.parent) else pathlib.Path(".")


def _write_journal(destination: pathlib.Path, names: list[str]) -> pathlib.Path:
    """Record the data files a commit creates and retires, before it touches any."""
    journal = private_path(destination, JOURNAL_PREFIX)
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
    journal = private_path(destination, JOURNAL_PREFIX)
    if not os.path.lexists(journal):
        return
    from onnx_modular.storage.load import read_regular_file

    try:
        names = json.loads(read_regular_file(journal, str(journal), limit=1 << 16))
    except Exception:
        names = None
    current = data_references(destination)
    if isinstance(names, list) and current is not None:
        own = data_pattern(destination)
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
    check_replaceable(destination, _shown(destination))  # it may have changed since the check
    previous = (data_references(destination) or set()) if staging.retires_previous_data else set()
    own = data_pattern(destination)
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
