"""Every output folder: written aside in a private folder next to it, then moved into place.

* :func:`publish_folder`: into a folder that may hold files already (a checkpoint export, a genai
  folder): every file through the journaled commit of :mod:`~onnx_modular.storage.commit`, a
  model's external data (and the references other models of the folder hold to it) following the
  name its staging chose. The commit goes into a mirror of the folder beside it (its files hard
  links, nothing copied), which then takes the folder's place in one ``rename(2)`` (Linux's
  ``RENAME_EXCHANGE``; a new folder: a plain rename): a reader (onnxruntime-genai), or a kill at
  any moment, sees the old folder whole or the new one whole, never a mix. Where that rename does
  not exist (another system, a file system without it, the folder a link or the working directory,
  an entry that cannot be linked) the files are committed in place, one journaled commit;
* :func:`new_folder`: into a new (or empty) folder, checked first by :func:`check_output_folder`
  (extract's cases, split's stages): the whole folder in one rename, so nothing is replaced.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import pathlib
import shutil
import stat
from collections.abc import Iterator

import onnx

from onnx_modular.errors import InvalidInputError, SaveError
from onnx_modular.storage.commit import MIRRORED, Staging, atomic_writes
from onnx_modular.storage.destination import check_destination, data_name, data_pattern, referenced_data
from onnx_modular.storage.guard import record_written, rewriting
from onnx_modular.storage.locks import LOCK_PREFIX, TEMP_PREFIX, remove_stale_temp_folders, temp_folder
from onnx_modular.storage.locks import shown_path as _shown
from onnx_modular.storage.signals import interrupt_on_sigterm, signals_deferred

__all__ = ["publish_folder", "check_output_folder", "new_folder"]


def check_output_folder(out: str | os.PathLike) -> pathlib.Path:
    """``out`` as a folder that does not exist yet, or is empty, in an existing folder."""
    if not isinstance(out, (str, os.PathLike)) or isinstance(os.fspath(out), bytes):
        raise InvalidInputError(f"The output folder must be a path, not {type(out).__name__}.")
    folder = pathlib.Path(out)
    parent = folder.parent if str(folder.parent) else pathlib.Path(".")
    if folder.name in ("", ".", ".."):
        folder = folder.resolve()
        parent = folder.parent
    if folder.exists() or folder.is_symlink():
        if not folder.is_dir() or folder.is_symlink():
            raise InvalidInputError(f"The output {str(out)!r} exists and is not a folder.", hint="Give a new folder.")
        if any(folder.iterdir()):
            raise InvalidInputError(
                f"The output folder {str(out)!r} exists and is not empty; nothing was written.",
                hint="Give a new or empty folder (nothing is overwritten).",
            )
    if not parent.is_dir():
        raise InvalidInputError(f"The folder {str(parent)!r} of the output does not exist.", hint="Create it first.")
    return folder


@contextlib.contextmanager
def new_folder(folder: pathlib.Path, what: str, *, hint: str | None = None) -> Iterator[pathlib.Path]:
    """A private folder next to ``folder`` (a :func:`check_output_folder`) to write into; on a normal
    exit it is renamed to ``folder`` (which does not exist or is empty: rename(2) replaces it). If the
    body raises, nothing is moved and the private folder is removed. SIGTERM is handled as SIGINT
    meanwhile. ``what`` names the content in the error (``"the stages"``)."""
    parent = folder.parent if str(folder.parent) else pathlib.Path(".")
    with interrupt_on_sigterm(), temp_folder(parent) as tmp:
        staged = tmp / "out"
        staged.mkdir()
        yield staged
        try:
            os.replace(staged, folder)
        except OSError as e:
            raise SaveError(f"Moving {what} into {str(folder)!r} failed: {e}", hint=hint) from e


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
        named = [model for model in models if data_pattern(folder / model).fullmatch(location)]
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
    return {location for location in referenced_data(folder / model) if data_pattern(folder / model).fullmatch(location)}


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
    moved in one commit, the reference following the data file's new name. The folder changes in
    one rename where the system has one (see the module's docstring): a kill never leaves it mixed.

    Returns the names written, in order.
    """
    if os.path.lexists(output) and not output.is_dir():
        raise SaveError(f"The output folder {_shown(output)} is not a folder.", hint="Give a folder path.")
    names = _publish_whole(staged, output, modes)
    if names is None:
        output.mkdir(exist_ok=True)
        names = _publish_files(staged, output, modes)
    return names


def _published_names(staged: pathlib.Path) -> list[str]:
    """The files of ``staged`` a publish names (its models' data files follow their models)."""
    names = sorted(os.listdir(staged))
    data_files = {name for model in names if model.endswith(".onnx") for name in referenced_data(staged / model)}
    return [name for name in names if name not in data_files]


@functools.cache
def _renameat2():
    """glibc's ``renameat2`` (Linux), or ``None``."""
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return function


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(first: pathlib.Path, second: pathlib.Path) -> bool:
    """Swap two folders in one ``rename(2)`` (``RENAME_EXCHANGE``); ``False`` where the system or the
    file system has no such rename (nothing moved then)."""
    function = _renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV, errno.EBUSY, errno.EPERM):
        return False
    raise OSError(code, os.strerror(code), os.fspath(second))


def _mirror(source: pathlib.Path, target: pathlib.Path) -> bool:
    """``target`` (an empty folder) made to hold what ``source`` holds: its files as hard links (no byte
    copied), its links as links, its folders as folders. ``False`` when an entry cannot be mirrored
    (a FIFO or device, a file system without hard links, a running writer's private folder)."""
    for entry in os.scandir(source):
        if entry.name.startswith(LOCK_PREFIX):
            continue  # a lock file stays with the folder its writer locked
        if entry.name.startswith(TEMP_PREFIX):
            return False  # a writer at work in the folder (stale ones were removed): commit in place, behind its locks
        mode = entry.stat(follow_symlinks=False).st_mode
        try:
            if stat.S_ISLNK(mode):
                os.symlink(os.readlink(entry.path), target / entry.name)
            elif stat.S_ISREG(mode):
                os.link(entry.path, target / entry.name, follow_symlinks=False)
            elif stat.S_ISDIR(mode):
                os.mkdir(target / entry.name, stat.S_IMODE(mode))
                if not _mirror(pathlib.Path(entry.path), target / entry.name):
                    return False
            else:
                return False
        except OSError:
            return False
    return True


def _holds_working_directory(folder: pathlib.Path) -> bool:
    here, place = os.getcwd(), os.path.realpath(folder)
    return here == place or here.startswith(place.rstrip(os.sep) + os.sep)


def _publish_whole(staged: pathlib.Path, output: pathlib.Path, modes) -> list[str] | None:
    """:func:`publish_folder` into a mirror of ``output`` beside it, then the mirror swapped in (one
    rename); ``None`` (nothing done) where that cannot be: the caller commits in place."""
    if _renameat2() is None or os.path.islink(output) or (output.exists() and _holds_working_directory(output)):
        return None
    existed = output.is_dir()
    names = _published_names(staged)
    if existed:  # the guard on the real paths (the commit below sees the mirror's)
        for name in names:
            check_destination(output / name)
        remove_stale_temp_folders(output)
    parent = output.parent if str(output.parent) else pathlib.Path(".")
    with interrupt_on_sigterm(), temp_folder(parent) as tmp:
        mirror = tmp / "folder"
        os.mkdir(mirror)
        if existed:
            os.chmod(mirror, stat.S_IMODE(os.stat(output).st_mode))
            if not _mirror(output, mirror):
                return None
        token = MIRRORED.set((mirror, output))
        try:
            with rewriting():
                _publish_files(staged, mirror, modes)
        finally:
            MIRRORED.reset(token)
        try:
            with signals_deferred():
                if existed and not _exchange(mirror, output):
                    return None
                if not existed:
                    os.rename(mirror, output)
        except OSError as e:
            raise SaveError(f"Moving the folder into {_shown(output)} failed: {e}") from e
    record_written([output / name for name in names])
    return names


def _publish_files(staged: pathlib.Path, output: pathlib.Path, modes) -> list[str]:
    """:func:`publish_folder`'s commit of the files of ``staged`` into the folder ``output``, in place."""
    names = _published_names(staged)
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
        with rewriting():  # the files this publish just wrote, moved to their final names
            _publish_models(output, output, moving + readers, [], None, models)
    return names
