"""Serving one model to Netron: the model file and its own external data, nothing else.

``netron.start(path)`` serves every file under the model's folder (a key file beside the model
included), reads what it serves whole with a plain ``open`` (a FIFO blocks a request thread for
good; three parallel requests for a 1.5 GiB data file hold 4.5 GB), writes the file name raw into
its ``index.html``, answers any ``Host`` (a web page the user visits can read the model through DNS
rebinding), and its page calls analytics.google.com and ipinfo.io. :func:`serve` runs its own small
HTTP server over Netron's static files instead:

- ``/data/<name>`` answers only for the model (its bytes, read once with the bounded loading of
  :mod:`onnx_modular.storage.load`) and the external-data files the model refers to (checked by
  ``check_external_data``, opened as regular files, streamed in :data:`CHUNK` pieces, at most
  :data:`MAX_DATA_RESPONSES` at once); every other path is a 404;
- a request whose ``Host`` is not this server (a name that is neither ``localhost``, an IP
  address nor the host given) is refused (403);
- every page is sent with a Content-Security-Policy that allows no connection outside this
  server (:data:`CONTENT_SECURITY_POLICY`), so Netron's analytics and its ipinfo.io consent check
  cannot leave the machine; the names written into ``index.html`` are HTML-escaped;
- a browser that leaves mid-response ends that response, quietly.
"""

from __future__ import annotations

import contextlib
import html
import http.server
import ipaddress
import os
import pathlib
import re
import threading
import urllib.parse
from collections.abc import Iterator

import onnx

from onnx_modular.errors import InvalidInputError, InvalidModelFileError
from onnx_modular.storage.load import check_external_data, open_regular_file, read_regular_file
from onnx_modular.storage.proto import all_tensors

__all__ = ["serve", "served_files", "CONTENT_SECURITY_POLICY", "allowed_host"]

#: One external-data file served at most (larger ones are refused, not truncated).
_MAX_SERVED_DATA = 2**44
#: Bytes read and sent at a time: a response holds this much, whatever the file's size.
CHUNK = 1 << 20
#: Data responses served at once; more wait (a response holds :data:`CHUNK` bytes).
MAX_DATA_RESPONSES = 4
#: Scripts, styles, images and fonts from this server only; no connection anywhere else.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    "font-src 'self' data:; connect-src 'self'; worker-src 'self' blob:; frame-src 'none'; object-src 'none'; "
    "form-action 'none'; base-uri 'none'"
)
_MIME_TYPES = {
    ".html": "text/html; charset=utf-8", ".js": "text/javascript", ".css": "text/css", ".png": "image/png",
    ".gif": "image/gif", ".jpg": "image/jpeg", ".ico": "image/x-icon", ".json": "application/json",
    ".pb": "application/octet-stream", ".ttf": "font/ttf", ".otf": "font/otf", ".woff": "font/woff",
    ".woff2": "font/woff2", ".svg": "image/svg+xml",
}  # fmt: skip


def served_files(path: str | os.PathLike, model: onnx.ModelProto) -> dict[str, pathlib.Path]:
    """``{name in the URL: file}`` of what the viewer may read: the model and each
    external-data location it refers to (checked: inside the folder, regular files)."""
    file = pathlib.Path(path)
    check_external_data(model, file.parent, name=repr(str(path)), model_path=file)
    files = {file.name: file}
    for tensor in all_tensors(model):
        if onnx.external_data_helper.uses_external_data(tensor):
            for entry in tensor.external_data:
                if entry.key == "location":
                    files[entry.value] = file.parent / entry.value
    return files


def allowed_host(header: str | None, bound_host: str) -> bool:
    """Whether a request's ``Host`` header names this server: ``localhost``, an IP address (a
    DNS-rebinding page reaches the server under a domain name of its own), or the host given."""
    if not header:
        return False
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\](?::\d+)?|([^:\[\]]+)(?::\d+)?", header.strip())
    if match is None:
        return False
    name = (match.group(1) or match.group(2)).lower().rstrip(".")
    if name in ("localhost", bound_host.lower().rstrip(".")):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class _Content:
    """The model's bytes and the files it may read (:func:`served_files`)."""

    def __init__(self, path: str | os.PathLike, model: onnx.ModelProto, shown: bytes | None = None):
        self.files = served_files(path, model)
        self.base = pathlib.Path(path).name
        self.name = str(path)
        self.data = shown if shown is not None else bytes(read_regular_file(pathlib.Path(path), str(path), limit=2**31 - 1))


def _netron_folder() -> pathlib.Path:
    import netron

    return pathlib.Path(os.path.realpath(os.path.dirname(netron.__file__)))


def _index_html(folder: pathlib.Path, content: _Content) -> bytes:
    """Netron's page with its Python meta tags, every value HTML-escaped (a file named
    ``"><script>...`` is shown as a name, never run)."""
    import netron.server

    page = (folder / "index.html").read_text(encoding="utf-8")
    meta = [
        '<meta name="type" content="Python">',
        f'<meta name="version" content="{html.escape(netron.server.__version__)}">',
        f'<meta name="file" content="/data/{html.escape(urllib.parse.quote(content.base))}">',
        f'<meta name="name" content="{html.escape(content.name)}">',
        f'<meta name="identifier" content="{html.escape(content.base)}">',
    ]
    return re.sub(r'<meta name="version" content=".*">', lambda _: "\n".join(meta), page).encode("utf-8")


class _Handler(http.server.BaseHTTPRequestHandler):
    """Netron's page, its assets and the model's bytes; the per-server values are set by :func:`_handler`."""

    protocol_version = "HTTP/1.0"
    content: _Content
    bound_host: str
    folder: pathlib.Path
    index: bytes
    data_slots: threading.BoundedSemaphore

    def log_message(self, format, *args):
        pass

    def handle(self):
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError):
            super().handle()

    def do_HEAD(self):
        self._answer(head=True)

    def do_GET(self):
        self._answer(head=False)

    def _headers(self, status: int, content_type: str | None, length: int | None) -> None:
        self.send_response(status)
        self.send_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "no-store")
        if content_type:
            self.send_header("Content-Type", content_type)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def _bytes(self, status: int, content_type: str, body: bytes, head: bool) -> None:
        self._headers(status, content_type, len(body))
        if not head:
            self.wfile.write(body)

    def _answer(self, head: bool) -> None:
        if not allowed_host(self.headers.get("Host"), self.bound_host):
            self._bytes(403, "text/plain", b"403: this server answers only to its own address", head)
            return
        path = urllib.parse.urlparse(self.path).path
        path = "/index.html" if path == "/" else path
        if path.startswith("/data/"):
            self._data(urllib.parse.unquote(path[len("/data/") :]), head)
        elif path == "/index.html":
            self._bytes(200, _MIME_TYPES[".html"], self.index, head)
        else:
            file = pathlib.Path(os.path.realpath(self.folder / path.lstrip("/")))
            if self.folder in file.parents and file.suffix in _MIME_TYPES and file.is_file():
                self._bytes(200, _MIME_TYPES[file.suffix], file.read_bytes(), head)
            else:
                self._bytes(404, "text/plain", b"404", head)

    def _data(self, name: str, head: bool) -> None:
        if name == self.content.base:
            self._bytes(200, "application/octet-stream", self.content.data, head)
            return
        file = self.content.files.get(name)
        if file is None:
            self._bytes(404, "text/plain", b"404", head)
            return
        with self.data_slots:  # at most MAX_DATA_RESPONSES streams, each holding one CHUNK
            try:
                with open_regular_file(file, repr(name)) as fd:
                    self._stream(fd, head)
            except InvalidModelFileError:
                self._bytes(404, "text/plain", b"404", head)

    def _stream(self, fd: int, head: bool) -> None:
        size = os.fstat(fd).st_size
        if size > _MAX_SERVED_DATA:
            self._bytes(404, "text/plain", b"404", head)
            return
        self._headers(200, "application/octet-stream", size)
        sent = 0
        while not head and sent < size:
            chunk = os.pread(fd, min(CHUNK, size - sent), sent)
            if not chunk:
                break  # the file shrank: the browser sees a short response
            self.wfile.write(chunk)
            sent += len(chunk)


def _handler(content: _Content, bound_host: str) -> type[http.server.BaseHTTPRequestHandler]:
    """A handler class for one server: its model, its address, its page."""
    folder = _netron_folder()
    attributes = {
        "content": content,
        "bound_host": bound_host,
        "folder": folder,
        "index": _index_html(folder, content),
        "data_slots": threading.BoundedSemaphore(MAX_DATA_RESPONSES),  # shared by the server's threads
    }
    return type("Handler", (_Handler,), attributes)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # a request's failure is that request's, never a traceback
        pass


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
    host, port = address
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidInputError(f"The port {port!r} is not a TCP port.", hint="Give a port from 1 to 65535 (0: any free port).")
    content = _Content(path, model, shown)
    try:
        server = _Server((host, port), _handler(content, host))
    except (OSError, OverflowError, UnicodeError) as e:
        raise InvalidInputError(
            f"Netron cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}",
            hint="Choose another --port (0: any free port) or --host.",
        ) from e
    bound_port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    shown_host = f"[{host}]" if ":" in host else host
    try:
        if browse:
            import webbrowser

            webbrowser.open(f"http://{shown_host}:{bound_port}")
        yield shown_host, bound_port
    finally:
        server.shutdown()
        server.server_close()
