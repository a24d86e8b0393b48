"""Every temporary file onnx_modular makes, and the locks of a save.

Next to a destination: a save's private temporary folder (:func:`temp_folder`, removed once its
owner is gone, even after ``kill -9``), a hidden scratch file (:func:`scratch_file` with
``near``) and the advisory lock that serializes saves to one destination. Elsewhere: a private
folder in the system's temporary folder (:func:`scratch_folder`), removed on exit whatever
happens. Lock and journal files are opened without following links (``O_NOFOLLOW``)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pathlib
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator

from onnx_modular.errors import SaveError

__all__ = [
    "TEMP_PREFIX",
    "LOCK_PREFIX",
    "SCRATCH_PREFIX",
    "shown_path",
    "remove_stale_temp_folders",
    "temp_folder",
    "scratch_folder",
    "scratch_file",
    "destination_lock",
    "private_path",
    "open_private_file",
]

#: Every temporary folder onnx_modular makes next to a destination starts with this,
#: followed by the owner's pid: ``.onnx_modular-tmp-<pid>-<random>``.
TEMP_PREFIX = ".onnx_modular-tmp-"
LOCK_PREFIX = ".onnx_modular-lock-"
#: Private folders in the system's temporary folder (``tempfile``): ``onnx_modular-<purpose>-<random>``.
SCRATCH_PREFIX = "onnx_modular-"


def shown_path(path: str | os.PathLike) -> str:
    """``path`` for a message: undecodable bytes as ``\\xNN``, control characters escaped."""
    return repr(os.fsencode(path).decode("utf-8", "backslashreplace"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_folders(folder: pathlib.Path) -> list[str]:
    """Remove ``TEMP_PREFIX`` folders whose owner is gone (pid not running and no lock held)."""
    removed = []
    try:
        entries = os.listdir(folder)
    except OSError:
        return removed
    for entry in entries:
        match = re.fullmatch(re.escape(TEMP_PREFIX) + r"(\d+)-\w+", entry)
        if not match or _pid_alive(int(match.group(1))):
            continue
        path = folder / entry
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a live owner (in another pid namespace) still holds it
        try:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(entry)
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def temp_folder(parent: pathlib.Path) -> Iterator[pathlib.Path]:
    """A private folder in ``parent``, locked by this process for its whole life."""
    remove_stale_temp_folders(parent)
    try:
        tmpdir = parent / f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        os.mkdir(tmpdir, 0o700)
        fd = os.open(tmpdir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise SaveError(
            f"Cannot write in {shown_path(parent)}: {e.strerror or e}", hint="Choose a folder you can write to."
        ) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield tmpdir
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
        os.close(fd)


@contextlib.contextmanager
def scratch_folder(purpose: str = "") -> Iterator[pathlib.Path]:
    """A private folder (mode 0700) in the system's temporary folder, removed on exit: where an
    in-memory model is written for onnxruntime, a profile trace, a widened copy."""
    prefix = f"{SCRATCH_PREFIX}{purpose}-" if purpose else SCRATCH_PREFIX
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        yield pathlib.Path(folder)


@contextlib.contextmanager
def scratch_file(near: str | os.PathLike | None, name: str = "model.onnx") -> Iterator[pathlib.Path]:
    """A hidden, unique file name next to ``near`` (in a :func:`scratch_folder` when ``None``), removed on exit.

    Next to the source, a copy reads the same external-data files (onnxruntime resolves them
    relative to the model and refuses paths that leave its folder).
    """
    if near is None:
        with scratch_folder() as folder:
            yield folder / name
        return
    near = pathlib.Path(near)
    path = near.parent / f".{near.stem}.{secrets.token_hex(6)}.{name}"
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def private_path(destination: pathlib.Path, prefix: str) -> pathlib.Path:
    digest = hashlib.sha256(os.fsencode(destination.name)).hexdigest()[:16]
    return destination.parent / f"{prefix}{digest}"


def open_private_file(path: pathlib.Path, *, create: bool) -> int:
    """Open one of our lock/journal files without following a link: created with
    ``O_EXCL`` when ``create``; an existing one must be a regular file. ``FileExistsError``
    and ``FileNotFoundError`` pass through (the caller retries); others are a SaveError."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if create:
        flags |= os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(path, flags, 0o600)
    except (FileExistsError, FileNotFoundError):
        raise
    except OSError as e:
        raise SaveError(
            f"Cannot use {shown_path(path)}, onnx_modular's lock/journal file for this destination: "
            f"{e.strerror or e} (something else sits at that name: a link, a folder or a special file).",
            hint="Remove it if no onnx_modular save is running in that folder, then save again.",
        ) from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SaveError(
            f"{shown_path(path)}, onnx_modular's lock file for this destination, is not a regular file.",
            hint="Remove it if no onnx_modular save is running in that folder, then save again.",
        )
    return fd


@contextlib.contextmanager
def destination_lock(destination: pathlib.Path) -> Iterator[None]:
    """An exclusive advisory lock for one destination, held by at most one writer.

    The lock file (``.onnx_modular-lock-<hash>``) is created with ``O_EXCL | O_NOFOLLOW``
    (an existing one, another writer's, is opened without following links and must be a
    regular file) and removed on release; a waiter that wakes up on a removed file takes the
    lock again on the new one.
    """
    lock_path = private_path(destination, LOCK_PREFIX)
    while True:
        try:
            fd = open_private_file(lock_path, create=True)
        except FileExistsError:
            try:
                fd = open_private_file(lock_path, create=False)
            except FileNotFoundError:
                continue  # released meanwhile
        except FileNotFoundError as e:
            raise SaveError(f"Cannot create a lock file in {shown_path(destination.parent)}.") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.lstat(lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        os.close(fd)
