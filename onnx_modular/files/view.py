"""Serving one model to Netron: the model file and its own external data, nothing else.

``netron.start(path)`` serves every file under the model's folder (a key file beside the
model included) and reads what it serves with a plain ``open``, so a FIFO in the folder blocks
a request thread for good. :func:`serve` hands netron a content provider that answers only
for the model (read once, with the bounded loading of :mod:`onnx_modular.storage.load`) and for
the external-data files the model refers to (checked by ``check_external_data``, read as
regular files, bounded by their size); every other path is a 404.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator

import onnx

from onnx_modular.errors import InvalidInputError, InvalidModelFileError
from onnx_modular.storage.load import check_external_data, read_regular_file
from onnx_modular.storage.proto import all_tensors

__all__ = ["serve", "served_files"]

#: One external-data file served at most (larger ones are refused, not truncated).
_MAX_SERVED_DATA = 2**34


def served_files(path: str | os.PathLike, model: onnx.ModelProto) -> dict[str, pathlib.Path]:
    """``{name in the URL: file}`` of what the viewer may read: the model and each
    external-data location it refers to (checked: inside the folder, regular files)."""
    file = pathlib.Path(path)
    check_external_data(model, file.parent, name=repr(str(path)))
    files = {file.name: file}
    for tensor in all_tensors(model):
        if onnx.external_data_helper.uses_external_data(tensor):
            for entry in tensor.external_data:
                if entry.key == "location":
                    files[entry.value] = file.parent / entry.value
    return files


class _Content:
    """What netron's request handler asks for a path (``read``) and shows (``base``, ``name``)."""

    def __init__(self, path: str | os.PathLike, model: onnx.ModelProto, shown: bytes | None = None):
        self.files = served_files(path, model)
        file = pathlib.Path(path)
        self.base = file.name
        self.name = str(path)
        self.identifier = file.name
        self.dir = str(file.parent)
        self.data = shown if shown is not None else read_regular_file(file, str(path), limit=2**31 - 1)

    def read(self, path: str) -> bytes | None:
        if path == self.base:
            return bytes(self.data)
        file = self.files.get(path)
        if file is None:
            return None
        try:
            return bytes(read_regular_file(file, path, limit=_MAX_SERVED_DATA))
        except InvalidModelFileError:
            return None


@contextlib.contextmanager
def serve(
    path: str | os.PathLike,
    model: onnx.ModelProto,
    *,
    address: tuple[str, int],
    browse: bool,
    shown: bytes | None = None,
) -> Iterator[tuple[str, int]]:
    """Serve ``path`` with Netron at ``address`` until the block ends; yields ``(host, port)``.

    ``shown``: the bytes served as the model instead of the file's (the display copy of
    :mod:`onnx_modular.storage.display`); its external data is still the model's own.

    Request threads are daemons, so Ctrl+C or SIGTERM (a ``KeyboardInterrupt`` in the CLI)
    ends the block, stops the server and the process exits.
    """
    import netron
    import netron.server

    content = _Content(path, model, shown)
    netron.server._ThreadedHTTPServer.daemon_threads = True
    try:
        served = netron.serve(str(path), content.data, address=address, browse=False)
    except OSError as e:
        raise InvalidInputError(f"Netron cannot listen on {address[0]}:{address[1]}: {e.strerror or e}") from e
    host, port = served if isinstance(served, tuple) else (address[0], served)
    # netron's handler reads through the class attribute its server thread set: ours answers instead.
    netron.server._HTTPRequestHandler.content = content
    try:
        if browse:
            import webbrowser

            webbrowser.open(f"http://{host}:{port}")
        yield host, port
    finally:
        netron.stop((host, port))
