"""One weights file for models that hold the same tensors (the ``prefill`` and ``decode`` components
of a ``--generation`` export): :func:`share_external_data`.

An ONNX external-data reference is per tensor (``location``, ``offset``, ``length``), so a model may
read some of its tensors from another model's data file. The models of a folder are taken in order:
each tensor of a later model whose bytes equal a tensor already stored (matched by content hash, not
by name) is pointed at that copy; the rest are packed into the model's own data file, which is
removed when nothing is left in it. Tensors are read one at a time, in pieces: memory does not grow
with the model.

It rewrites the folder in place, so it runs on a folder written aside (``save_pretrained`` into a
private staging folder) before :func:`~onnx_modular.storage.folders.publish_folder` moves it into place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import secrets

import onnx

from onnx_modular.errors import SaveError
from onnx_modular.format.text import shown
from onnx_modular.storage.proto import all_tensors

__all__ = ["SharedData", "share_external_data"]

_CHUNK = 16 << 20  # bytes read at a time


@dataclasses.dataclass
class SharedData:
    """What :func:`share_external_data` did: per model, the tensors now read from an earlier
    model's data file and their bytes (``{model: (tensors, bytes)}``)."""

    shared: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)

    @property
    def bytes_saved(self) -> int:
        return sum(size for _, size in self.shared.values())


def _reference(tensor: onnx.TensorProto) -> tuple[str, int, int | None]:
    entries = {entry.key: entry.value for entry in tensor.external_data}
    length = entries.get("length")
    return entries["location"], int(entries.get("offset", 0)), None if length is None else int(length)


def _point(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Make ``tensor`` read ``length`` bytes at ``offset`` of ``location`` (other keys, a checksum of
    the same bytes included, are kept)."""
    kept = [(entry.key, entry.value) for entry in tensor.external_data if entry.key not in ("location", "offset", "length")]
    del tensor.external_data[:]
    for key, value in [("location", location), ("offset", str(offset)), ("length", str(length)), *kept]:
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _byte_size(tensor: onnx.TensorProto) -> int:
    """The size of a tensor's raw data when its reference has no ``length`` (the spec allows it)."""
    count = 1
    for dim in tensor.dims:
        count *= dim
    return count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def _digest(file, offset: int, length: int) -> str:
    file.seek(offset)
    digest, left = hashlib.sha256(), length
    while left:
        piece = file.read(min(left, _CHUNK))
        if not piece:
            raise SaveError("An external-data file ends before the tensors it should hold.")
        digest.update(piece)
        left -= len(piece)
    return f"{length}:{digest.hexdigest()}"


def _copy(file, offset: int, length: int, target) -> None:
    file.seek(offset)
    left = length
    while left:
        piece = file.read(min(left, _CHUNK))
        target.write(piece)
        left -= len(piece)


def _external_tensors(model: onnx.ModelProto, folder: pathlib.Path, name: str, handles: dict) -> list[tuple]:
    """``(tensor, location, offset, length, content)`` of every external tensor of ``model`` (the
    model file ``name`` of ``folder``), the data files opened into ``handles`` (the caller closes them)."""
    found = []
    for tensor in all_tensors(model):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location, offset, length = _reference(tensor)
        if os.path.isabs(location) or pathlib.Path(location).name != location:
            raise SaveError(f"{shown(name)} refers to external data {shown(location)} outside its folder.")
        if location not in handles:
            handles[location] = open(folder / location, "rb")
        if length is None:
            length = _byte_size(tensor)
        found.append((tensor, location, offset, length, _digest(handles[location], offset, length)))
    return found


def share_external_data(folder: str | os.PathLike, models: list[str], *, keep_data_file: bool = False) -> SharedData:
    """Point each model of ``models`` (file names in ``folder``, in order) at the bytes an earlier
    model already stores, and keep only the others in its own data file.

    The first model is left as it is. For every later one, each external tensor whose content
    (length and SHA-256 of its bytes) equals one an earlier model stores gets that model's
    ``location``, ``offset`` and ``length``; the others are copied, densely packed, into a new data
    file that replaces the model's own (``<model>.data``), which is removed when every tensor is
    shared, unless ``keep_data_file``: then the smallest tensor stays in it (transformers'
    ``ExportedModel.from_pretrained`` requires each component's ``<file>.data``). Tensors stored
    inside the ``.onnx`` file are left where they are.

    Raises:
        SaveError: A model refers to data outside ``folder`` or past the end of a file.
    """
    folder = pathlib.Path(folder)
    stored: dict[str, tuple[str, int, int]] = {}  # content -> (location, offset, length) of its first copy
    result = SharedData()
    for index, name in enumerate(models):
        path = folder / name
        model = onnx.load(str(path), load_external_data=False)
        own_location = f"{name}.data"
        handles: dict[str, object] = {}
        try:
            found = _external_tensors(model, folder, name, handles)
            if index == 0:
                for _, location, offset, length, content in found:
                    stored.setdefault(content, (location, offset, length))
                continue
            shared = [item for item in found if item[4] in stored]
            if keep_data_file and found and len(shared) == len(found):
                smallest = min(shared, key=lambda item: item[3])
                shared = [item for item in shared if item is not smallest]
            shared_ids = {id(item) for item in shared}
            old_files = {item[1] for item in found}
            new_name = f".{secrets.token_hex(8)}.data"  # the model's own data, renamed once complete
            offset_out = 0
            with open(folder / new_name, "wb") as target:
                for item in found:
                    tensor, location, offset, length, content = item
                    if id(item) in shared_ids:
                        _point(tensor, *stored[content])
                        continue
                    _copy(handles[location], offset, length, target)
                    _point(tensor, own_location, offset_out, length)
                    stored.setdefault(content, (own_location, offset_out, length))
                    offset_out += length
        finally:
            for handle in handles.values():
                handle.close()
        still_read = {place for place, _, _ in stored.values()}
        for location in old_files - {own_location} - still_read:  # data files only this model read
            os.unlink(folder / location)
        if offset_out:
            os.replace(folder / new_name, folder / own_location)
        else:
            os.unlink(folder / new_name)
            if (folder / own_location).exists() and own_location not in still_read:
                os.unlink(folder / own_location)
        with open(path, "wb") as file:
            file.write(model.SerializeToString())
        result.shared[name] = (len(shared), sum(item[3] for item in shared))
    return result
