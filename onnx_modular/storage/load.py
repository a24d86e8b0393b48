"""Checked loading of ONNX files: a protobuf wire scan before parsing, then structure checks.

Tells a file that is not ONNX at all from one cut short, and refuses files that would crash,
hang or exhaust memory later (see :func:`onnx_modular.storage.checks.check_model_structure`).
"""

from __future__ import annotations

import contextlib
import difflib
import os
import pathlib
import stat
from typing import Any

import onnx
from google.protobuf import message as protobuf_message

from onnx_modular.errors import InvalidModelFileError
from onnx_modular.storage.checks import check_model_structure
from onnx_modular.storage.proto import all_tensors, numel, shown, uses_external_data

__all__ = [
    "load_model_file",
    "load_external_data",
    "read_regular_file",
    "check_external_data",
    "data_file_in_use",
    "open_regular_file",
    "stored_bytes",
]

#: Protobuf cannot parse a message of 2 GiB or more.
_PROTOBUF_LIMIT = 2**31


_WIRE_VARINT, _WIRE_FIXED64, WIRE_LENGTH, _WIRE_FIXED32 = 0, 1, 2, 5


def _read_varint(data: bytes, position: int) -> tuple[int, int] | None:
    """(value, next position), or ``None`` when the varint runs past the end or is too long."""
    value, shift = 0, 0
    while position < len(data) and shift < 64:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
    return None


def _expected_wire_type(field: Any) -> int:
    if field.type == field.TYPE_MESSAGE or field.type == field.TYPE_STRING or field.type == field.TYPE_BYTES:
        return WIRE_LENGTH
    return _WIRE_VARINT


def _sniff_format(data: bytes) -> str:
    """A guess at what a non-ONNX file is, to make the error message useful."""
    if data.startswith(b"PK\x03\x04"):
        return " (it looks like a zip archive, e.g. a PyTorch .pt/.pth checkpoint)"
    if data.startswith(b"\x89HDF"):
        return " (it looks like an HDF5 file, e.g. a Keras model)"
    if data[:1] in (b"{", b"["):
        return " (it looks like JSON)"
    if data.startswith(b"\x80") and data[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return " (it looks like a Python pickle)"
    head = data[:256]
    if head and all(32 <= b < 127 or b in (9, 10, 13) for b in head):
        return " (it looks like a text file)"
    return ""


def _scan_model_fields(data: bytes, path: str) -> set[int]:
    """Walk the top-level fields of a serialized ModelProto without parsing them.

    Tells a file that is not ONNX at all (its first field is not a ModelProto field)
    from an ONNX file that was cut short (a field declares more bytes than remain),
    before protobuf's generic "Error parsing message" could blur the two.

    Returns:
        The field numbers present.
    """
    fields = onnx.ModelProto.DESCRIPTOR.fields_by_number
    present: set[int] = set()
    position = 0
    while position < len(data):
        tag = _read_varint(data, position)
        if tag is None:
            break
        key, after_tag = tag
        number, wire_type = key >> 3, key & 7
        field = fields.get(number)
        if not present and (field is None or wire_type != _expected_wire_type(field)):
            raise InvalidModelFileError(f"{path!r} is not an ONNX model file{_sniff_format(data)}.")
        if wire_type == _WIRE_VARINT:
            value = _read_varint(data, after_tag)
            if value is None:
                break
            position = value[1]
        elif wire_type == WIRE_LENGTH:
            length = _read_varint(data, after_tag)
            if length is None:
                break
            size, start = length
            if start + size > len(data):
                name = field.name if field is not None else f"field {number}"
                raise InvalidModelFileError(
                    f"{path!r} is truncated: its {name!r} part declares {size} bytes but only "
                    f"{len(data) - start} remain (file size {len(data)} bytes). The file was cut short "
                    "while being written or copied; export or download it again."
                )
            position = start + size
        elif wire_type == _WIRE_FIXED64:
            position = after_tag + 8
        elif wire_type == _WIRE_FIXED32:
            position = after_tag + 4
        else:
            raise InvalidModelFileError(f"{path!r} is corrupted or not an ONNX model file{_sniff_format(data)}.")
        if position > len(data):
            break
        present.add(number)
    else:
        return present
    raise InvalidModelFileError(
        f"{path!r} is truncated: it ends in the middle of a field (file size {len(data)} bytes). "
        "Export or download it again."
    )



def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


class MalformedFile(Exception):
    """The wire format does not hold together where the values would be cut."""


def wire_fields(data, start: int, end: int):
    """``(number, wire type, field start, payload start, field end)`` of each field in
    ``data[start:end]``; :class:`MalformedFile` when a field does not fit."""
    position = start
    while position < end:
        tag = _read_varint(data, position)
        if tag is None:
            raise MalformedFile
        key, after = tag
        number, wire_type = key >> 3, key & 7
        if wire_type == _WIRE_VARINT:
            value = _read_varint(data, after)
            if value is None:
                raise MalformedFile
            payload, stop = after, value[1]
        elif wire_type == WIRE_LENGTH:
            length = _read_varint(data, after)
            if length is None:
                raise MalformedFile
            payload, stop = length[1], length[1] + length[0]
        elif wire_type == _WIRE_FIXED64:
            payload, stop = after, after + 8
        elif wire_type == _WIRE_FIXED32:
            payload, stop = after, after + 4
        else:
            raise MalformedFile
        if stop > end:
            raise MalformedFile
        yield number, wire_type, position, payload, stop
        position = stop


#: TensorProto fields that hold values (float_data, int32_data, string_data, int64_data,
#: raw_data, double_data, uint64_data); name (8), dims and data_type stay.
_TENSOR_PAYLOADS = frozenset({4, 5, 6, 7, 9, 10, 11})
_MODEL_GRAPH, _GRAPH_INITIALIZER = 7, 5


def _without_initializer_payloads(data) -> bytearray:
    """The serialized model with the values of the main graph's initializers left out (their
    names, shapes and types kept; tensors of 256 bytes or less kept whole, as a ``Loop``'s trip
    count), for tools that read only the structure (``tree``).

    A file near 2 GiB is then never held twice: the parsed model is the size of its
    structure, not of its weights. Works on the wire format, so nothing is parsed first.
    """

    def length_field(number: int, body: bytes | bytearray) -> bytes:
        return _varint(number << 3 | WIRE_LENGTH) + _varint(len(body)) + bytes(body)

    def tensor(start: int, end: int) -> bytearray:
        if end - start <= 256:  # a scalar (a Loop's trip count): kept, so the bounds on it can be checked
            return bytearray(data[start:end])
        out = bytearray()
        for number, _, first, _, stop in wire_fields(data, start, end):
            if number not in _TENSOR_PAYLOADS:
                out += data[first:stop]
        return out

    def graph(start: int, end: int) -> bytearray:
        out = bytearray()
        for number, wire_type, first, payload, stop in wire_fields(data, start, end):
            if number == _GRAPH_INITIALIZER and wire_type == WIRE_LENGTH:
                out += length_field(number, tensor(payload, stop))
            else:
                out += data[first:stop]
        return out

    out = bytearray()
    try:
        for number, wire_type, first, payload, stop in wire_fields(data, 0, len(data)):
            if number == _MODEL_GRAPH and wire_type == WIRE_LENGTH:
                out += length_field(number, graph(payload, stop))
            else:
                out += data[first:stop]
    except MalformedFile:
        return data  # parsed whole: protobuf reports the damage, nothing is silently dropped
    return out


def missing_file_error(file: pathlib.Path, text: str) -> InvalidModelFileError:
    """``'llama.onx' does not exist; did you mean llama.onnx?`` with what to do: the closest names
    of its folder (``.onnx`` files first), or the folder's absence."""
    folder = file.parent
    try:
        entries = sorted(os.listdir(folder or "."))
    except OSError:
        return InvalidModelFileError(
            f"{text!r} does not exist (nor does its folder {str(folder)!r}).",
            hint="Check the path; give the .onnx file the export wrote (`-o`).",
        )
    models = [name for name in entries if name.endswith(".onnx")]
    stems = {name.removesuffix(".onnx"): name for name in models}  # ".onnx" alone makes every name look close
    close = [stems[stem] for stem in difflib.get_close_matches(file.name.removesuffix(".onnx"), stems, n=3, cutoff=0.6)]
    others = [name for name in entries if name not in stems.values()]
    close = close or difflib.get_close_matches(file.name, others, n=3, cutoff=0.6)
    where = "" if str(folder) in ("", ".") else str(folder)
    named = [os.path.join(where, name) for name in close]
    hint = "Check the path"
    if models and not close:
        listed = ", ".join(models[:5]) + (f" and {len(models) - 5} more" if len(models) > 5 else "")
        hint += f"; the .onnx files in {repr(where) if where else 'this folder'}: {listed}"
    return InvalidModelFileError(
        f"{text!r} does not exist" + (f"; did you mean {', '.join(map(repr, named))}?" if close else "."),
        hint=hint + ". An ONNX file is written by `onnx-modular export ... -o FILE.onnx`.",
    )


def read_regular_file(file: pathlib.Path, text: str, *, limit: int) -> bytearray:
    """The bytes of a regular file of at most ``limit`` bytes.

    Opened without blocking and checked on the open descriptor (``fstat``), so a FIFO, a
    device (``/dev/zero``), a socket or a folder is refused before anything is read, and the
    read is bounded by the size the file had when opened.

    Raises:
        InvalidModelFileError: The file is missing, not a regular file, too large or unreadable.
    """
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise missing_file_error(file, text) from None
    except IsADirectoryError:
        raise InvalidModelFileError(f"{text!r} is a directory, not an ONNX file.") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise InvalidModelFileError(f"{shown(text)!r} cannot be read: {getattr(e, 'strerror', None) or e}.") from e
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise InvalidModelFileError(f"{text!r} is a directory, not an ONNX file.")
        if not stat.S_ISREG(info.st_mode):
            raise InvalidModelFileError(
                f"{text!r} is not a regular file (a pipe, a device or a socket); give the path of an .onnx file."
            )
        if info.st_size > limit:
            raise InvalidModelFileError(
                f"{text!r} is {info.st_size / 2**30:.1f} GiB; an ONNX file cannot exceed protobuf's 2 GiB limit "
                "(large weights go to external data), so it is corrupted or not ONNX."
            )
        # One buffer of the size at open, filled in place: the bytes are held once (a file
        # near 2 GiB read in chunks and joined would be held twice).
        buffer = bytearray(info.st_size)
        view, filled = memoryview(buffer), 0
        while filled < info.st_size:
            count = os.readv(fd, [view[filled : filled + (1 << 24)]])
            if not count:
                break  # the file shrank while being read: the scan reports it truncated
            filled += count
        view.release()
        if filled < info.st_size:
            del buffer[filled:]
        return buffer
    except OSError as e:
        raise InvalidModelFileError(f"{text!r} cannot be read: {e.strerror or e}.") from e
    finally:
        os.close(fd)


def _external_fields(tensor: onnx.TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def _nonnegative(value: str | None, what: str, where: str) -> int | None:
    if value is None:
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = -1
    if number < 0:
        raise InvalidModelFileError(f"{where}: its external-data {what} {shown(value)!r} is not a non-negative integer.")
    return number


#: ``(st_dev, st_ino)`` of every external-data file a model checked in this process refers to, with
#: the model files that refer to it (``None``: a model not read from a file). A save never removes
#: one of these as "the previous model's data" while another of those models is still there (the
#: source of ``inline`` sharing its data-file name with the destination would lose its weights).
_DATA_FILES_IN_USE: dict[tuple[int, int], set[str | None]] = {}


def data_file_in_use(path: str | os.PathLike, *, replaced: str | os.PathLike | None = None) -> bool:
    """Whether ``path`` is an external-data file of a model this process read (see
    :func:`check_external_data`) other than ``replaced`` (the model file a save replaces) that is
    still there."""
    try:
        info = os.stat(path)
    except OSError:
        return False
    replaced = os.path.realpath(replaced) if replaced is not None else None
    for model in _DATA_FILES_IN_USE.get((info.st_dev, info.st_ino), ()):
        if model is None or (model != replaced and os.path.lexists(model)):
            return True
    return False


def check_external_data(
    model: onnx.ModelProto, folder: str | os.PathLike, *, name: str = "the model", model_path: str | os.PathLike | None = None
) -> None:
    """Check every external-data reference of ``model`` before anything reads it.

    Each ``location`` must be a relative path that stays inside ``folder`` (the model's
    folder; symbolic links are resolved), name a regular file, and ``offset`` + ``length``
    (or the tensor's size) must lie within that file. One check for loading, ``inline`` and
    ``verify``; onnx and onnxruntime would otherwise fail later with untyped errors (or read
    a FIFO forever).

    Raises:
        InvalidModelFileError: Naming the tensor and the reference.
    """
    root = pathlib.Path(os.path.realpath(folder))
    sizes: dict[str, int] = {}
    for tensor in all_tensors(model):
        if not onnx.external_data_helper.uses_external_data(tensor):
            continue
        fields = _external_fields(tensor)
        where = f"{name}: tensor {shown(tensor.name)!r}"
        location = fields.get("location", "")
        if not location or "\x00" in location:
            raise InvalidModelFileError(f"{where} stores its data externally but names no valid file ({shown(location)!r}).")
        if location not in sizes:
            target = pathlib.Path(os.path.realpath(root / location))
            if os.path.isabs(location) or (target != root and root not in target.parents):
                raise InvalidModelFileError(
                    f"{where} refers to external data {shown(location)!r} outside the model's folder; "
                    "refusing to read it (move the data file next to the model)."
                )
            try:
                info = os.stat(target)
            except OSError as e:
                raise InvalidModelFileError(
                    f"{where} refers to external data {shown(location)!r}, which cannot be read: {e.strerror or e} "
                    "(copy the data file along with the model)."
                ) from e
            if not stat.S_ISREG(info.st_mode):
                raise InvalidModelFileError(f"{where} refers to external data {shown(location)!r}, which is not a regular file.")
            sizes[location] = info.st_size
            _DATA_FILES_IN_USE.setdefault((info.st_dev, info.st_ino), set()).add(
                os.path.realpath(model_path) if model_path is not None else None
            )
        size = sizes[location]
        offset = _nonnegative(fields.get("offset"), "offset", where) or 0
        length = _nonnegative(fields.get("length"), "length", where)
        try:
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        except (KeyError, TypeError, ValueError):
            itemsize = 0
        needed = length if length is not None else numel(tensor.dims) * itemsize
        if offset + needed > size:
            raise InvalidModelFileError(
                f"{where} reads bytes {offset} to {offset + needed} of {shown(location)!r}, which holds {size} bytes "
                "(the data file is truncated or belongs to another export)."
            )


def load_external_data(
    model: onnx.ModelProto, folder: str | os.PathLike, *, name: str = "the model", model_path: str | os.PathLike | None = None
) -> None:
    """Read every external tensor of ``model`` (:func:`~onnx_modular.storage.proto.all_tensors`:
    sparse tensors and subgraphs in functions included) into the model, after
    :func:`check_external_data`: each read is bounded by the file's size and opened as a
    regular file inside ``folder``, as the model itself is read.

    Raises:
        InvalidModelFileError: A reference the check refuses, or a file changed since.
    """
    check_external_data(model, folder, name=name, model_path=model_path)
    root = pathlib.Path(os.path.realpath(folder))
    with contextlib.ExitStack() as stack:
        files: dict[str, int] = {}
        for tensor in all_tensors(model):
            if not onnx.external_data_helper.uses_external_data(tensor):
                continue
            fields = _external_fields(tensor)
            location = fields["location"]
            if location not in files:
                files[location] = stack.enter_context(open_regular_file(root / location, f"{shown(location)} (external data of {name})"))
            fd = files[location]
            size = os.fstat(fd).st_size
            _, offset, length = external_byte_range(tensor)
            end = offset + length
            if end > size:
                raise InvalidModelFileError(f"{name}: the external data {shown(location)!r} changed while being read.")
            tensor.raw_data = _read_range(fd, offset, end - offset, location, name)
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT


@contextlib.contextmanager
def open_regular_file(file: pathlib.Path, text: str):
    """A read descriptor of a regular file (a FIFO or a device is refused without blocking)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise InvalidModelFileError(f"{text} cannot be read: {e.strerror or e}.") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidModelFileError(f"{text} is not a regular file.")
        yield fd
    finally:
        os.close(fd)


def _read_range(fd: int, offset: int, length: int, location: str, name: str) -> bytes:
    """Bytes ``offset`` to ``offset + length`` of an open file: only what a tensor references is
    read (a 32-byte weight at the start of a sparse 20 GiB file costs 32 bytes, not 20 GiB)."""
    buffer = bytearray(length)
    view, filled = memoryview(buffer), 0
    try:
        while filled < length:
            count = os.preadv(fd, [view[filled : filled + (1 << 24)]], offset + filled)
            if not count:
                raise InvalidModelFileError(f"{name}: the external data {shown(location)!r} changed while being read.")
            filled += count
    except OSError as e:
        raise InvalidModelFileError(f"{name}: the external data {shown(location)!r} cannot be read: {e.strerror or e}.") from e
    finally:
        view.release()
    return bytes(buffer)


def external_byte_range(tensor: onnx.TensorProto) -> tuple[str, int, int]:
    """``(location, offset, length)`` of an external tensor's bytes; without a ``length`` the
    tensor's own size (its dims times its element size), never "to the end of the file": a data
    file may hold trailing bytes, or be a sparse file far larger than the tensor."""
    fields = _external_fields(tensor)
    offset = int(fields.get("offset") or 0)
    length = fields.get("length")
    if length is None:
        try:
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        except (KeyError, TypeError, ValueError):
            itemsize = 0
        return fields.get("location", ""), offset, numel(tensor.dims) * itemsize
    return fields.get("location", ""), offset, int(length)


_load_external_data = load_external_data  # the parameter of load_model_file shadows the name


def load_model_file(
    path: str | os.PathLike, *, load_external_data: bool = False, check: bool = True, values: bool = True
) -> onnx.ModelProto:
    """Load an ONNX file, refusing files that would crash, hang or exhaust memory later.

    Weights stored as external data are not read unless ``load_external_data`` is set;
    the call tree, the checks and the parameter counts only need their shapes.

    Args:
        path: The ``.onnx`` file.
        load_external_data: Also read the weights stored in external data files.
        check: Run :func:`check_model_structure` (recursion, missing functions, huge
            dimensions, nesting depth).
        values: Keep the values of the main graph's initializers. ``False`` for tools that
            read only the structure (``tree``): names, shapes and types stay, and the memory
            used is that of the structure, not of the weights stored in the file.

    Returns:
        The model.

    Raises:
        InvalidModelFileError: The file is missing, is not ONNX, is truncated or
            corrupted, or its structure is unusable. The message says which.

    Example::

        model = load_model_file("gpt2.onnx")
    """
    text = str(path)
    file = pathlib.Path(path)
    data = read_regular_file(file, text, limit=_PROTOBUF_LIMIT - 1)
    if not data:
        raise InvalidModelFileError(f"{text!r} is empty (0 bytes), not an ONNX model.")
    present = _scan_model_fields(data, text)
    if not values:
        data = _without_initializer_payloads(data)
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (protobuf_message.DecodeError, RuntimeError, ValueError) as e:
        raise InvalidModelFileError(f"{text!r} is corrupted: protobuf cannot decode it ({e}).") from e
    del data
    graph_field = onnx.ModelProto.DESCRIPTOR.fields_by_name["graph"].number
    if graph_field not in present or not model.HasField("graph"):
        raise InvalidModelFileError(
            f"{text!r} is not an ONNX model: it has no graph (a truncated file or another protobuf format)."
        )
    if not model.opset_import:
        raise InvalidModelFileError(
            f"{text!r} declares no opset_import; the file is truncated or was not written by an ONNX exporter."
        )
    if check:
        check_model_structure(model, name=repr(text))
        check_external_data(model, file.parent, name=repr(text), model_path=file)
    if load_external_data and uses_external_data(model):
        _load_external_data(model, file.parent, name=repr(text), model_path=file)
    return model



def stored_bytes(path: str | os.PathLike, model: onnx.ModelProto | None = None) -> int:
    """The bytes the model at ``path`` takes on disk: the ``.onnx`` file and every external-data
    file its initializers name (each once), whatever their names (``<name>.data`` or
    ``<name>.<8 hex>.data``). ``model``: the file already loaded (``values=False`` is enough)."""
    file = pathlib.Path(path)
    if model is None:
        model = load_model_file(file, values=False)
    locations = {
        _external_fields(tensor).get("location")
        for tensor in model.graph.initializer
        if tensor.data_location == onnx.TensorProto.EXTERNAL
    }
    total = file.stat().st_size
    for location in sorted(name for name in locations if name):
        data = file.parent / location
        if data.is_file():
            total += data.stat().st_size
    return total
