"""The one scratch-model writer: :func:`scratch_model_file`, an in-memory ``ir.Model`` written to a
private file for onnxruntime (checked, profiled, a trial conversion, a block of a model), removed
with its external data on exit whatever happens.

Where: a private folder in the system's temporary folder
(:func:`~onnx_modular.storage.locks.scratch_folder`), or a hidden file next to a model
(:func:`~onnx_modular.storage.locks.scratch_file` with ``near``) when the scratch model still reads
that model's external data. Scratch files are never outputs: they are not published, only run.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator

import onnx_ir as ir

from onnx_modular.storage.locks import scratch_file, scratch_folder
from onnx_modular.storage.save import wants_external_data

__all__ = ["scratch_model_file"]

@contextlib.contextmanager
def scratch_model_file(
    model: ir.Model,
    purpose: str = "",
    *,
    name: str = "model.onnx",
    near: str | os.PathLike | None = None,
    external_data: bool | None = None,
) -> Iterator[pathlib.Path]:
    """``model`` written to a scratch file for the duration of the ``with``; yields its path.

    ``near=None``: ``<name>`` in a private :func:`~onnx_modular.storage.locks.scratch_folder`
    (named after ``purpose``); else a hidden file next to ``near`` (a model file whose external data
    the scratch model still reads: onnxruntime resolves it relative to the scratch file).
    ``external_data``: write the weights to ``<file>.data`` (``None``: when they are above
    :data:`~onnx_modular.storage.save.EXTERNAL_DATA_THRESHOLD`); without it, tensors already read from external data stay
    references to their file. The file and its data file are removed on exit.
    """
    with contextlib.ExitStack() as stack:
        if near is None:
            path = stack.enter_context(scratch_folder(purpose)) / name
        else:
            path = stack.enter_context(scratch_file(near, name))
        data = path.with_name(f"{path.name}.data")
        stack.callback(data.unlink, missing_ok=True)
        ir.save(model, path, external_data=data.name if wants_external_data(model, external_data) else None)
        yield path
