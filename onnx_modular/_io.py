"""Atomic, checked writes of ONNX files.

A model is written into a private temporary folder next to the destination,
checked there with ``onnx.checker.check_model(full_check=True)`` (and, during
export, verified), and only then moved into place with ``os.replace``. A failure at
any step removes the temporary folder: no partial file, and an existing file at the
destination is never overwritten by a failed write.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator

import onnx
import onnx_ir as ir

from onnx_modular.errors import SaveError

__all__ = ["check_destination", "staged_save", "EXTERNAL_DATA_THRESHOLD"]

# Above this many bytes of weights, store them in external data (protobuf's limit is 2 GiB):
# onnxruntime reads external data straight into its tensors, while weights inside the protobuf
# are parsed and then copied (a 98 M-parameter Llama, 392 MB: session 0.76x torch's flat file
# with external data, 1.37x embedded; docs/benchmarks.md). torch.onnx.export always externalizes.
EXTERNAL_DATA_THRESHOLD = 64 * 1024 * 1024


def check_destination(path: str | os.PathLike) -> pathlib.Path:
    """Fail fast (before any export work) if ``path`` cannot be written."""
    path = pathlib.Path(path)
    parent = path.parent if str(path.parent) else pathlib.Path(".")
    if path.is_dir():
        raise SaveError(f"The output path {str(path)!r} is a directory.", hint="Give a file path such as 'model.onnx'.")
    if not parent.is_dir():
        raise SaveError(
            f"The output folder {str(parent)!r} does not exist.",
            hint=f"Create it first (mkdir -p {parent}) or choose another path.",
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SaveError(
            f"The output folder {str(parent)!r} is not writable.",
            hint="Choose a folder you can write to, or fix its permissions.",
        )
    return path


def _initializer_bytes(model: ir.Model) -> int:
    total = 0
    for value in model.graph.initializers.values():
        if value.const_value is not None:
            total += value.const_value.nbytes
    return total


def wants_external_data(model: ir.Model, external_data: bool | None) -> bool:
    return _initializer_bytes(model) > EXTERNAL_DATA_THRESHOLD if external_data is None else external_data


@contextlib.contextmanager
def staged_save(model: ir.Model, path: str | os.PathLike, *, external_data: bool | None = None) -> Iterator[pathlib.Path]:
    """Write ``model`` to a temporary path, yield it for checks, then move it into place.

    If the body of the ``with`` raises, nothing is moved and the temporary files
    are removed.

    Example::

        with staged_save(model, "m.onnx") as staged:
            run_checks(staged)      # raising here leaves "m.onnx" untouched
    """
    destination = check_destination(path)
    parent = destination.parent
    external = wants_external_data(model, external_data)
    data_name = destination.name + ".data"
    try:
        tmpdir = pathlib.Path(tempfile.mkdtemp(prefix=f".{destination.name}.", suffix=".tmp", dir=parent))
    except OSError as e:
        raise SaveError(
            f"Cannot write in {str(parent)!r}: {e.strerror or e}",
            hint="Choose a folder you can write to.",
        ) from e
    try:
        staged = tmpdir / destination.name
        try:
            ir.save(model, staged, external_data=data_name if external else None)
        except OSError as e:
            raise SaveError(f"Writing {str(destination)!r} failed: {e}", hint="Check free disk space and permissions.") from e
        try:
            onnx.checker.check_model(str(staged), full_check=True)
        except Exception as e:
            raise SaveError(
                f"The ONNX checker rejected the model: {e}",
                hint="This is a bug in onnx_modular or torch's translator; please report it with the model.",
            ) from e
        yield staged
        try:
            if external:
                os.replace(tmpdir / data_name, parent / data_name)
            os.replace(staged, destination)
        except OSError as e:
            raise SaveError(f"Moving the file into {str(destination)!r} failed: {e}") from e
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
