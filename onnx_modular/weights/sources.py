"""Weights that are read one tensor at a time: safetensors files, shard folders, state dicts.

``export_modular(model, args, f, weights=...)`` exports a model whose parameters may sit on
the ``meta`` device (no memory) and takes their values from a :class:`WeightSource`:

* a ``.safetensors`` file,
* a folder of safetensors shards with ``model.safetensors.index.json`` (as
  ``save_pretrained`` writes it), or a folder holding ``*.safetensors`` files,
* a state dict (``{name: tensor}``).

Names are matched as ``nn.Module.load_state_dict(strict=True)`` matches them: every name in
``model.state_dict()`` needs a tensor, and every tensor in the source needs a name. Tied
weights (one tensor reachable under several names, such as ``lm_head.weight`` and
``model.embed_tokens.weight``) need the tensor under any one of their names. A tensor of
another dtype is cast to the parameter's dtype when read, as ``load_state_dict`` does.

Safetensors files are read with plain file reads (no memory map, whose touched pages
would count in the process's resident memory); each read returns a fresh tensor that is
released as soon as its consumer drops it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import math
import os
import pathlib
import stat
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from onnx_modular.errors import (
    MissingWeightError,
    UnexpectedWeightError,
    WeightsError,
    WeightShapeError,
)

__all__ = ["INDEX_FILE", "WeightPlan", "WeightSource", "has_meta_tensors", "materialized", "plan_weights"]

#: The shard index ``save_pretrained`` writes next to the shards.
INDEX_FILE = "model.safetensors.index.json"

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclasses.dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]
    #: (file, first byte) of a tensor stored raw in a file: its bytes can be copied file to file.
    location: tuple[pathlib.Path, int] | None = None


_HEADER_LIMIT = 100 * 1024 * 1024
_SOURCE_HINT = "Give a .safetensors file, a folder of shards with model.safetensors.index.json, or a state dict."


def _open_regular(path: pathlib.Path, what: str) -> tuple[int, int]:
    """``(fd, size)`` of a regular file opened without blocking (a FIFO or a device is refused
    before anything is read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as e:
        raise WeightsError(f"{what} {str(path)!r} cannot be read: {getattr(e, 'strerror', None) or e}", hint=_SOURCE_HINT) from e
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise WeightsError(f"{what} {str(path)!r} is not a regular file (a pipe, a device or a folder).", hint=_SOURCE_HINT)
    return fd, info.st_size


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        duplicate = next(key for key in keys if keys.count(key) > 1)
        raise ValueError(f"the name {duplicate!r} appears twice")
    return dict(pairs)


def parse_json(raw: bytes | str) -> Any:
    """JSON that is refused (``ValueError``) rather than half-read: duplicate keys, nesting too
    deep for Python (``RecursionError``), invalid UTF-8."""
    try:
        return json.loads(raw, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise ValueError("it is nested too deeply") from None


def _read_header(path: pathlib.Path) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], int]:
    """The tensors of a safetensors file, ``{name: (dtype, shape, begin, end)}`` (absolute
    offsets), validated as data before any use: an 8-byte header length within the file; a
    JSON object of objects with a known ``dtype``, a ``shape`` of non-negative integers and two
    ``data_offsets`` whose difference is the tensor's size; no name twice; the tensors laid out
    in order, without overlaps or holes, ending at the end of the file (as the safetensors
    format requires). A header that lies is refused here, not read as weights."""
    fd, size = _open_regular(path, "The weights file")
    try:
        try:
            head = os.pread(fd, 8, 0)
            if len(head) < 8:
                raise ValueError(f"the file is {size} bytes long, shorter than a safetensors header")
            (length,) = struct.unpack("<Q", head)
            if length > min(_HEADER_LIMIT, size - 8):
                raise ValueError(f"its header claims {length} bytes, but the file holds {size - 8} after the length")
            header = parse_json(os.pread(fd, length, 8))
            if not isinstance(header, dict):
                raise ValueError(f"its header is a JSON {type(header).__name__}, not an object")
        except (OSError, ValueError, struct.error) as e:
            raise WeightsError(f"{str(path)!r} is not a readable safetensors file: {e}.", hint=_SOURCE_HINT) from e
    finally:
        os.close(fd)
    data_start, data_length = 8 + length, size - 8 - length
    header.pop("__metadata__", None)
    tensors, spans = {}, []
    for key, info in header.items():
        where = f"Tensor {key!r} in {str(path)!r}"
        if not isinstance(info, dict):
            raise WeightsError(f"{where} is described by a JSON {type(info).__name__}, not an object (the file is corrupted).")
        dtype = _SAFETENSORS_DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
        if dtype is None:
            raise WeightsError(f"{where} has dtype {info.get('dtype')!r}, which is not supported.")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise WeightsError(f"{where} has shape {shape!r}; a shape is a list of non-negative integers.")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_length
        ):
            raise WeightsError(
                f"{where} has data_offsets {offsets!r}; they must be two integers 0 <= begin <= end <= {data_length} "
                "(the bytes after the header)."
            )
        if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
            raise WeightsError(
                f"{where} declares shape {shape} of {info['dtype']} ({math.prod(shape) * dtype.itemsize} bytes) but "
                f"{offsets[1] - offsets[0]} bytes of data."
            )
        tensors[key] = (dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])
        spans.append((offsets[0], offsets[1], key))
    end = 0
    for begin, stop, key in sorted(spans):
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else f"leaves a hole of {begin - end} bytes before it"
            raise WeightsError(f"Tensor {key!r} in {str(path)!r} {what} (data_offsets {[begin, stop]}): the file is corrupted.")
        end = stop
    if end != data_length:
        raise WeightsError(
            f"The tensors of {str(path)!r} end at byte {end} of the data, but the file holds {data_length}: "
            "the file is truncated or corrupted."
        )
    return tensors, data_start


def _file_entries(path: pathlib.Path) -> dict[str, _Entry]:
    tensors, _ = _read_header(path)
    return {
        key: _Entry(dtype, shape, _file_reader(path, begin, end, dtype, shape), (path, begin))
        for key, (dtype, shape, begin, end) in tensors.items()
    }


def _file_reader(path: pathlib.Path, begin: int, end: int, dtype: torch.dtype, shape: tuple[int, ...]):
    def read() -> torch.Tensor:
        # numpy's buffers of 4 MiB and more are backed by transparent huge pages: filling a fresh
        # bytearray (zeroed, 4 KiB pages) took 3x as long as the read itself (42 vs 13 ms for 46 MB).
        buffer = np.empty(end - begin, dtype=np.uint8)
        with open(path, "rb") as file:
            file.seek(begin)
            if file.readinto(buffer) != len(buffer):
                raise WeightsError(f"{str(path)!r} is truncated (tensor at bytes {begin}-{end}).")
        if not buffer.size:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(shape)

    return read


class WeightSource:
    """Named tensors, each read only when asked for (see the module doc for the forms)."""

    def __init__(self, entries: Mapping[str, _Entry], description: str):
        self._entries = dict(entries)
        self.description = description

    @classmethod
    def open(cls, weights: WeightSource | str | os.PathLike | Mapping[str, torch.Tensor]) -> WeightSource:
        """A source from a safetensors file, a shard folder or a state dict."""
        if isinstance(weights, WeightSource):
            return weights
        if isinstance(weights, Mapping):
            entries = {}
            for key, tensor in weights.items():
                if not isinstance(tensor, torch.Tensor):
                    raise WeightsError(f"weights[{key!r}] is a {type(tensor).__name__}, not a tensor.")
                if tensor.is_meta:
                    raise WeightsError(f"weights[{key!r}] is on the meta device and has no values.", module_path=_owner(key))
                entries[key] = _Entry(tensor.dtype, tuple(tensor.shape), lambda tensor=tensor: tensor.detach())
            return cls(entries, "a state dict")
        if not isinstance(weights, (str, os.PathLike)):
            raise WeightsError(f"weights must be a path, a state dict or a WeightSource, not {type(weights).__name__}.", hint=_SOURCE_HINT)
        path = pathlib.Path(weights)
        try:
            info = os.stat(path)
        except (OSError, ValueError):
            raise WeightsError(f"weights={str(path)!r} does not exist.", hint=_SOURCE_HINT) from None
        if stat.S_ISDIR(info.st_mode):
            return cls(folder_entries(path), str(path))
        return cls(_file_entries(path), str(path))  # refuses a FIFO or a device as such

    @classmethod
    def from_functions(
        cls, tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...], Callable[[], torch.Tensor]]], description: str = "a custom source"
    ) -> WeightSource:
        """A source from ``{name: (dtype, shape, read)}``; ``read()`` is called each time the tensor is needed."""
        return cls({k: _Entry(dtype, tuple(shape), read) for k, (dtype, shape, read) in tensors.items()}, description)

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def spec(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        entry = self._entries[key]
        return entry.dtype, entry.shape

    def read(self, key: str) -> torch.Tensor:
        """The tensor ``key`` as stored (a fresh CPU tensor for files)."""
        return self._entries[key].read()

    def location(self, key: str) -> tuple[pathlib.Path, int] | None:
        """(file, first byte) when ``key`` is stored raw in a file, else ``None``."""
        return self._entries[key].location

    def nbytes(self) -> int:
        return sum(e.dtype.itemsize * math.prod(e.shape) for e in self._entries.values())


def folder_entries(folder: pathlib.Path) -> dict[str, _Entry]:
    index = folder / INDEX_FILE
    if os.path.lexists(index):
        fd, size = _open_regular(index, "The shard index")
        try:
            if size > _HEADER_LIMIT:
                raise WeightsError(f"{str(index)!r} is {size} bytes long: not a safetensors index.")
            document = parse_json(os.pread(fd, size, 0))
            weight_map = document.get("weight_map") if isinstance(document, dict) else None
            if not isinstance(weight_map, dict):
                raise ValueError(f"it has no weight_map object (got {type(weight_map).__name__})")
            bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
            if bad is not None:
                raise ValueError(f"weight_map maps {bad[0]!r} to {bad[1]!r}, not to a shard file name")
        except (OSError, ValueError) as e:
            raise WeightsError(f"{str(index)!r} is not a safetensors index: {e}.") from e
        finally:
            os.close(fd)
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        weight_map = None
    if not files:
        raise WeightsError(
            f"The folder {str(folder)!r} holds no safetensors weights.",
            hint="Save the model with save_pretrained(..., safe_serialization=True) or give a state dict.",
        )
    entries: dict[str, _Entry] = {}
    for name in files:
        shard = (folder / name).resolve()
        if folder.resolve() not in shard.parents:
            raise WeightsError(f"The index names {name!r}, which is outside {str(folder)!r}.")
        if not os.path.lexists(shard):
            raise WeightsError(f"The index names {name!r}, which is missing from {str(folder)!r}.")
        for key, entry in _file_entries(shard).items():
            if key in entries:
                raise WeightsError(f"Tensor {key!r} is stored in two shards of {str(folder)!r}.")
            if weight_map is None or weight_map.get(key) == name:
                entries[key] = entry
    if weight_map is not None:
        missing = [key for key in weight_map if key not in entries]
        if missing:
            raise WeightsError(f"The index of {str(folder)!r} names {missing[0]!r}, which its shard does not hold.")
    return entries


def _owner(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def has_meta_tensors(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


# -- matching names ---------------------------------------------------------------------


@dataclasses.dataclass
class WeightPlan:
    """Which source tensor gives each of the model's parameters and buffers.

    Attributes:
        source: Where the values come from.
        keys: Model tensor name (every alias of a tied tensor) -> source key.
        specs: Model tensor name -> (dtype, shape) the model expects.
    """

    source: WeightSource
    keys: dict[str, str]
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]

    def load(self, name: str) -> torch.Tensor:
        """The value of the model tensor ``name``, read now and cast to the model's dtype."""
        tensor = self.source.read(self.keys[name])
        dtype, _ = self.specs[name]
        return tensor if tensor.dtype == dtype else tensor.to(dtype)

    def lazy_tensor(self, name: str, ir_name: str | None = None) -> ir.LazyTensor:
        """An ``ir.LazyTensor`` that reads ``name`` each time its bytes are asked for (not cached)."""
        from onnx_ir.tensor_adapters import TorchTensor

        from onnx_modular.capture import torch_compat

        dtype, shape = self.specs[name]
        key = self.keys[name]
        location = self.source.location(key) if self.source.spec(key)[0] == dtype else None
        return _StoredTensor(
            lambda: TorchTensor(self.load(name), name=ir_name or name),
            location,
            dtype=torch_compat.torch_dtype_to_ir(dtype),
            shape=ir.Shape(shape),
            name=ir_name or name,
        )

    def nbytes(self, names: Iterable[str] | None = None) -> int:
        """Bytes of the model tensors ``names`` (each distinct source tensor once)."""
        names = self.keys if names is None else names
        seen: dict[str, int] = {}
        for name in names:
            dtype, shape = self.specs[name]
            seen[self.keys[name]] = dtype.itemsize * math.prod(shape)
        return sum(seen.values())


class _StoredTensor(ir.LazyTensor):
    """A lazy tensor whose bytes, when ``location`` is given, sit unchanged in a file (safetensors
    and ONNX external data both store raw little-endian C-order bytes): ``tofile`` copies them
    file to file in the kernel (``os.copy_file_range``), without reading them into memory."""

    def __init__(self, func: Callable[[], ir.TensorProtocol], location: tuple[pathlib.Path, int] | None, **kwargs):
        super().__init__(func, **kwargs)
        self._location = location

    def tofile(self, file) -> None:
        if self._location is None or not _copy_range(self._location, file, self.nbytes):
            super().tofile(file)


#: Errors of ``copy_file_range`` that mean "not between these files": fall back to read + write.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF, errno.ETXTBSY}


def _copy_range(location: tuple[pathlib.Path, int], file, nbytes: int) -> bool:
    """Copy ``nbytes`` from ``location`` to ``file`` at its position; False when the kernel cannot."""
    copy = getattr(os, "copy_file_range", None)
    try:
        destination = file.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return False
    if copy is None or nbytes == 0:
        return False
    file.flush()
    start = file.tell()
    path, begin = location
    done = 0
    with open(path, "rb") as source:
        try:
            while done < nbytes:
                copied = copy(source.fileno(), destination, nbytes - done, begin + done, start + done)
                if copied == 0:
                    raise WeightsError(f"{str(path)!r} is truncated (tensor at bytes {begin}-{begin + nbytes}).")
                done += copied
        except OSError as e:
            if e.errno not in _NO_KERNEL_COPY:
                raise
            file.seek(start)
            return False
    file.seek(start + nbytes)
    return True


def plan_weights(model: torch.nn.Module, weights) -> WeightPlan:
    """Match ``weights`` to ``model`` by name, as ``load_state_dict(strict=True)`` does.

    Raises:
        MissingWeightError: A parameter or buffer (of any alias of a tied group) has no tensor,
            or a non-persistent buffer is on the meta device (nothing can give its value).
        UnexpectedWeightError: The source holds a tensor no name of the model takes.
        WeightShapeError: A tensor's shape differs from its parameter's.
    """
    source = WeightSource.open(weights)
    state = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, tensor in state.items():
        groups.setdefault(id(tensor), []).append(name)
    keys: dict[str, str] = {}
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    missing: list[str] = []
    used: set[str] = set()
    for names in groups.values():
        present = [name for name in names if name in source]
        if not present:
            missing.append(names[0] if len(names) == 1 else f"{names[0]} (tied with {', '.join(names[1:])})")
            continue
        used.update(present)  # one tensor: the first name present gives it (as the last would in load_state_dict)
        key = present[0]
        for name in names:
            tensor = state[name]
            _, shape = source.spec(key)
            if tuple(tensor.shape) != shape:
                raise WeightShapeError(
                    f"Tensor {key!r} in {source.description} has shape {list(shape)}, but {name!r} of the model "
                    f"has shape {list(tensor.shape)}.",
                    module_path=_owner(name),
                    hint="Build the model from the configuration the weights were saved with.",
                )
            keys[name] = key
            specs[name] = (tensor.dtype, tuple(tensor.shape))
    if missing:
        raise MissingWeightError(
            f"{len(missing)} tensor(s) of the model are not in {source.description}: {', '.join(missing[:5])}"
            + (" ..." if len(missing) > 5 else ""),
            module_path=_owner(missing[0]),
            hint="Give weights saved from this model class (model.state_dict() names).",
        )
    unexpected = [key for key in source.keys() if key not in used]
    if unexpected:
        raise UnexpectedWeightError(
            f"{len(unexpected)} tensor(s) in {source.description} match no parameter or buffer of the model: "
            f"{', '.join(unexpected[:5])}" + (" ..." if len(unexpected) > 5 else ""),
            module_path=_owner(unexpected[0]),
            hint="Check that the model class and configuration match the checkpoint, or pass a state dict "
            "without the extra tensors.",
        )
    persistent = set(state)
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if buffer.is_meta and name not in persistent:
            raise MissingWeightError(
                f"The buffer {name!r} is on the meta device and not persistent, so no checkpoint can give its value.",
                module_path=_owner(name),
                hint="Build the model with its buffers on the CPU (parameters on meta), e.g. with "
                "onnx_modular.hf.meta.model_on_meta for transformers models.",
            )
    return WeightPlan(source, keys, specs)


# -- putting real values into a meta model ------------------------------------------------


def _slots(
    model: torch.nn.Module, prefixes: Iterable[str] | None, recurse: bool = True
) -> list[tuple[torch.nn.Module, str, str, bool]]:
    """(owner module, attribute, full name, is parameter) for every tensor under ``prefixes``
    (only the named modules' own tensors when ``recurse`` is false)."""
    prefixes = None if prefixes is None else set(prefixes)
    slots = []
    for module_path, module in model.named_modules(remove_duplicate=False):
        if prefixes is not None and module_path not in prefixes and (
            not recurse or not any(p == "" or module_path.startswith(p + ".") for p in prefixes)
        ):
            continue
        dot = f"{module_path}." if module_path else ""
        for attr, param in module._parameters.items():
            if param is not None:
                slots.append((module, attr, dot + attr, True))
        for attr, buffer in module._buffers.items():
            if buffer is not None:
                slots.append((module, attr, dot + attr, False))
    return slots


@contextlib.contextmanager
def materialized(
    model: torch.nn.Module, plan: WeightPlan, prefixes: Iterable[str] | None = None, *, recurse: bool = True,
    widen: bool = False,
) -> Iterator[int]:
    """Give the tensors of the modules under ``prefixes`` (``None``: all) their values
    (with ``recurse=False``, only the tensors those modules own directly; with ``widen``,
    bfloat16 values as float32, exactly: the reference of a bfloat16 file's widened check).

    Each tensor the plan covers is read from the source (a tied tensor once) and set on
    its module; on exit the original (meta) tensors are put back and the values dropped.
    Yields the number of bytes loaded.
    """
    loaded: dict[str, torch.Tensor] = {}
    restore: list[tuple[torch.nn.Module, str, bool, torch.Tensor]] = []
    try:
        for module, attr, name, is_parameter in _slots(model, prefixes, recurse):
            if name not in plan.keys:
                continue
            key = plan.keys[name]
            if key not in loaded:
                loaded[key] = plan.load(name)
                if widen and loaded[key].dtype == torch.bfloat16:
                    loaded[key] = loaded[key].float()
            table = module._parameters if is_parameter else module._buffers
            original = table[attr]
            restore.append((module, attr, is_parameter, original))
            value = loaded[key]
            table[attr] = torch.nn.Parameter(value, requires_grad=False) if is_parameter else value
        yield sum(t.nbytes for t in loaded.values())
    finally:
        for module, attr, is_parameter, original in reversed(restore):
            (module._parameters if is_parameter else module._buffers)[attr] = original
        loaded.clear()
