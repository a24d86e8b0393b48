"""Checked loading of ONNX files: a protobuf wire scan before parsing, then structure checks.

Tells a file that is not ONNX at all from one cut short, and refuses files that would crash,
hang or exhaust memory later (see :func:`onnx_modular.files.checks.check_model_structure`).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import onnx
from google.protobuf import message as protobuf_message

from onnx_modular.errors import InvalidModelFileError
from onnx_modular.files._proto import uses_external_data
from onnx_modular.files.checks import check_model_structure

__all__ = ["load_model_file"]

#: Protobuf cannot parse a message of 2 GiB or more.
_PROTOBUF_LIMIT = 2**31


_WIRE_VARINT, _WIRE_FIXED64, _WIRE_LENGTH, _WIRE_FIXED32 = 0, 1, 2, 5


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
        return _WIRE_LENGTH
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
        elif wire_type == _WIRE_LENGTH:
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


def load_model_file(
    path: str | os.PathLike, *, load_external_data: bool = False, check: bool = True
) -> onnx.ModelProto:
    """Load an ONNX file, refusing files that would crash, hang or exhaust memory later.

    Weights stored as external data are not read unless ``load_external_data`` is set;
    the call tree, the checks and the parameter counts only need their shapes.

    Args:
        path: The ``.onnx`` file.
        load_external_data: Also read the weights stored in external data files.
        check: Run :func:`check_model_structure` (recursion, missing functions, huge
            dimensions, nesting depth).

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
    if not file.exists():
        raise InvalidModelFileError(f"{text!r} does not exist.")
    if file.is_dir():
        raise InvalidModelFileError(f"{text!r} is a directory, not an ONNX file.")
    try:
        size = file.stat().st_size
        if size >= _PROTOBUF_LIMIT:
            raise InvalidModelFileError(
                f"{text!r} is {size / 2**30:.1f} GiB; an ONNX file cannot exceed protobuf's 2 GiB limit "
                "(large weights go to external data), so it is corrupted or not ONNX."
            )
        data = file.read_bytes()
    except OSError as e:
        raise InvalidModelFileError(f"{text!r} cannot be read: {e.strerror or e}.") from e
    if not data:
        raise InvalidModelFileError(f"{text!r} is empty (0 bytes), not an ONNX model.")
    present = _scan_model_fields(data, text)
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
    if load_external_data and uses_external_data(model):
        try:
            onnx.load_external_data_for_model(model, str(file.parent))
        except (OSError, ValueError) as e:
            raise InvalidModelFileError(f"The external data of {text!r} cannot be read: {e}") from e
    return model

