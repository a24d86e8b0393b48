"""Atomic, checked writes of ONNX files (with or without external data).

A model is written into a private temporary folder next to the destination, checked
there with ``onnx.checker.check_model(full_check=True)`` (and, during export,
verified), and only then moved into place. A failure at any step removes the
temporary folder: no partial file, and an existing file at the destination is never
overwritten by a failed write.

External data never breaks the pair. The data file gets the conventional name
``<name>.data`` (as ``torch.onnx.export`` writes it) unless the model already at the
destination refers to that file; then this write's data goes to a name of its own
(``<name>.<8 hex>.data``) and the next write returns to ``<name>.data``. Either way the
data file is moved into place *before* the model file is replaced, and the previous
write's data file is removed *after*, so a crash at any point leaves the destination
referring to a complete data file that matches it (at worst an unreferenced data file or
temporary folder is left, removed by the next save to that folder). Concurrent saves to
one destination are serialized by an advisory lock (``fcntl.flock``) held from the choice
of the data file's name to the move, so the last one wins whole. SIGTERM is handled like
SIGINT while a save runs; temporary folders left by killed processes (``kill -9``) are
recognised by their prefix and removed once their owner is gone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import pathlib
import re
import secrets
import shutil
import signal
import stat
import threading
from collections.abc import Iterator

import onnx
import onnx_ir as ir

from onnx_modular.errors import InvalidInputError, SaveError

__all__ = [
    "check_destination",
    "staged_save",
    "atomic_write",
    "interrupt_on_sigterm",
    "EXTERNAL_DATA_THRESHOLD",
    "TEMP_PREFIX",
    "data_name",
    "referenced_data",
]

# Above this many bytes of weights, store them in external data, as torch.onnx.export does for
# every model: onnxruntime reads external data straight into its tensors, while weights inside
# the protobuf are parsed and then copied, which costs 0.2-0.5 ms of session creation per MB
# (GPT-2 12 layers, 38 MB: session 1.75x torch's flat file embedded, 1.63x with external data;
# a 98 M-parameter Llama: 1.37x and 0.76x; docs/benchmarks.md). Below 1 MiB that is under 0.5 ms,
# and one file is handier.
EXTERNAL_DATA_THRESHOLD = 1024 * 1024
# Every temporary folder onnx_modular makes next to a destination starts with this,
# followed by the owner's pid: ``.onnx_modular-tmp-<pid>-<random>``.
TEMP_PREFIX = ".onnx_modular-tmp-"
_LOCK_PREFIX = ".onnx_modular-lock-"
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


def check_destination(path: str | os.PathLike) -> pathlib.Path:
    """Fail fast (before any export work) if ``path`` cannot be written."""
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
    return path


def _shown(path: str | os.PathLike) -> str:
    """``path`` for a message: undecodable bytes as ``\\xNN``, control characters escaped."""
    return repr(os.fsencode(path).decode("utf-8", "backslashreplace"))


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


def _data_token(destination: pathlib.Path) -> str | None:
    """``None`` (the conventional data-file name) unless the model at ``destination`` may refer to it."""
    if not destination.exists():
        return None
    conventional = data_name(destination, None)
    try:
        small = destination.stat().st_size <= _LEGACY_SCAN_LIMIT
    except OSError:
        small = False
    if small and conventional not in referenced_data(destination):
        return None
    return secrets.token_hex(_TOKEN_HEX // 2)


def _own_data_files(destination: pathlib.Path) -> re.Pattern[str]:
    stem = data_name(destination, "0" * _TOKEN_HEX)[:-_DATA_SUFFIX_LEN]
    return re.compile(re.escape(stem) + rf"\.[0-9a-f]{{{_TOKEN_HEX}}}\.data")


# -- signals -----------------------------------------------------------------------------


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived; raised like KeyboardInterrupt so that every cleanup runs."""

    signum = signal.SIGTERM


def _raise_terminated(signum, frame):
    raise Terminated()


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` (a ``KeyboardInterrupt``).

    Only in the main thread and only when SIGTERM still has its default action (a
    handler installed by the application is left alone).
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT/SIGTERM wait until the block ends (the few renames of a commit)."""
    deferred = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, deferred)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# -- temporary folders and locks ------------------------------------------------------------


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
def _temp_folder(parent: pathlib.Path) -> Iterator[pathlib.Path]:
    """A private folder in ``parent``, locked by this process for its whole life."""
    remove_stale_temp_folders(parent)
    try:
        tmpdir = parent / f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        os.mkdir(tmpdir, 0o700)
        fd = os.open(tmpdir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise SaveError(
            f"Cannot write in {_shown(parent)}: {e.strerror or e}", hint="Choose a folder you can write to."
        ) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield tmpdir
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
        os.close(fd)


@contextlib.contextmanager
def destination_lock(destination: pathlib.Path) -> Iterator[None]:
    """An exclusive advisory lock for one destination, held by at most one writer.

    The lock file (``.onnx_modular-lock-<hash>``) is removed on release; a waiter that
    wakes up on a removed file takes the lock again on the new one.
    """
    digest = hashlib.sha256(os.fsencode(destination.name)).hexdigest()[:16]
    lock_path = destination.parent / f"{_LOCK_PREFIX}{digest}"
    while True:
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
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


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EROFS):  # file systems without fsync on this kind of file
            raise
    finally:
        os.close(fd)


def referenced_data(model_path: pathlib.Path) -> set[str]:
    """External-data locations of an existing (small) model file; empty when unreadable."""
    try:
        if model_path.stat().st_size > _LEGACY_SCAN_LIMIT:
            return set()
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception:
        return set()
    locations = set()
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            locations.update(entry.value for entry in tensor.external_data if entry.key == "location")
    return locations


# -- the write ----------------------------------------------------------------------------


class Staging:
    """Where to write one model: ``model_path`` (in a temporary folder) and, for external
    data, the relative ``data_location`` to record in the model (its file sits next to
    ``model_path``)."""

    def __init__(self, tmpdir: pathlib.Path, destination: pathlib.Path, token: str | None):
        self.destination = destination
        self.model_path = tmpdir / _safe_stem(destination.name, _name_max(tmpdir) - _NAME_ROOM)
        self.data_location = data_name(destination, token)


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
    destination = check_destination(path)
    parent = destination.parent if str(destination.parent) else pathlib.Path(".")
    # The lock is held from the choice of the data file's name to the move: a concurrent save
    # to the same destination waits, then sees this one's model.
    with interrupt_on_sigterm(), _temp_folder(parent) as tmpdir, destination_lock(destination):
        staging = Staging(tmpdir, destination, _data_token(destination))
        yield staging
        staged_data = tmpdir / staging.data_location
        try:
            if staged_data.exists() and staging.model_path.exists():
                # onnx's external-data writer creates the data file 0600: give it the model's permissions.
                os.chmod(staged_data, stat.S_IMODE(staging.model_path.stat().st_mode))
            for staged in (staged_data, staging.model_path):
                if staged.exists():
                    _fsync(staged)
            with _signals_deferred():
                _commit(staging, staged_data if staged_data.exists() else None, parent)
        except OSError as e:
            raise SaveError(f"Moving the file into {_shown(destination)} failed: {e}") from e


def _commit(staging: Staging, staged_data: pathlib.Path | None, parent: pathlib.Path) -> None:
    """Data first, then the model, then the previous data: each step leaves a valid pair."""
    destination = staging.destination
    previous = referenced_data(destination) if destination.exists() else set()
    if staged_data is not None:
        os.replace(staged_data, parent / staging.data_location)
        _fsync(parent)
    os.replace(staging.model_path, destination)
    _fsync(parent)
    own = _own_data_files(destination)
    conventional = data_name(destination, None)  # also torch.onnx.export's name: removed only if it was ours
    for entry in os.listdir(parent):
        if entry == staging.data_location:
            continue
        if own.fullmatch(entry) or (entry == conventional and entry in previous):
            with contextlib.suppress(OSError):
                os.unlink(parent / entry)


@contextlib.contextmanager
def staged_save(model: ir.Model, path: str | os.PathLike, *, external_data: bool | None = None) -> Iterator[pathlib.Path]:
    """Write ``model`` to a temporary path, yield it for checks, then move it into place.

    If the body of the ``with`` raises, nothing is moved and the temporary files
    are removed.

    Example::

        with staged_save(model, "m.onnx") as staged:
            run_checks(staged)      # raising here leaves "m.onnx" untouched
    """
    external = wants_external_data(model, external_data)
    with atomic_write(path) as staging:
        staged, destination = staging.model_path, staging.destination
        try:
            ir.save(model, staged, external_data=staging.data_location if external else None)
        except OSError as e:
            raise SaveError(f"Writing {_shown(destination)} failed: {e}", hint="Check free disk space and permissions.") from e
        try:
            onnx.checker.check_model(str(staged), full_check=True)
        except Exception as e:
            raise SaveError(
                f"The ONNX checker rejected the model: {e}",
                hint="This is a bug in onnx_modular or torch's translator; please report it with the model.",
            ) from e
        yield staged
