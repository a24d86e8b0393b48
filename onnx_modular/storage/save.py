"""The checked model writer: :func:`write_checked` and :func:`staged_save` write an ``ir.Model``
(functions callee-first, external data by size) into a staging of the commit, check it with
``onnx.checker``, and let the commit move it into place; :func:`write_text` writes a report the
same way.

Every file goes through the journaled atomic commit of :mod:`~onnx_modular.storage.commit`
(staged next to the destination, checked there, moved into place; a failure leaves nothing
behind), guarded by :func:`~onnx_modular.storage.guard.check_outputs`. Folders are published by
:mod:`~onnx_modular.storage.folders`; destinations and the names of data files are
:mod:`~onnx_modular.storage.destination`'s; scratch models (run, never published) are written by
:mod:`~onnx_modular.storage.scratch`. This module re-exports the entry points of the commit,
destinations and folders, so ``from onnx_modular.storage import save`` reaches every writer of outputs."""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator

import onnx
import onnx_ir as ir

from onnx_modular.errors import SaveError
from onnx_modular.storage.commit import JOURNAL_PREFIX, Staging, atomic_write, atomic_writes
from onnx_modular.storage.destination import check_destination, data_name, referenced_data
from onnx_modular.storage.folders import publish_folder
from onnx_modular.storage.locks import TEMP_PREFIX
from onnx_modular.storage.locks import shown_path as _shown
from onnx_modular.storage.signals import interrupt_on_sigterm

__all__ = [
    "check_destination",
    "staged_save",
    "write_checked",
    "atomic_write",
    "atomic_writes",
    "write_text",
    "interrupt_on_sigterm",
    "EXTERNAL_DATA_THRESHOLD",
    "TEMP_PREFIX",
    "data_name",
    "referenced_data",
    "publish_folder",
    "Staging",
    "wants_external_data",
    "JOURNAL_PREFIX",
]

# Above this many bytes of weights, store them in external data, as torch.onnx.export does for
# every model: onnxruntime reads external data straight into its tensors, while weights inside
# the protobuf are parsed and then copied, which costs 0.2-0.5 ms of session creation per MB
# (GPT-2 12 layers, 38 MB: session 1.75x torch's flat file embedded, 1.63x with external data;
# a 98 M-parameter Llama: 1.37x and 0.76x; docs/benchmarks.md). Below 1 MiB that is under 0.5 ms,
# and one file is handier.
EXTERNAL_DATA_THRESHOLD = 1024 * 1024

#: Threads writing the external data: one reads (and transposes) the next weights while another
#: writes; on 2 cores the 1B model's save went from 9.4-10.8 to 5.3-6.3 s (``docs/benchmarks.md``).
WRITER_THREADS = 2
#: Bytes of weights the writer threads hold at once (one tensor above it is written alone).
WRITER_BYTES_IN_FLIGHT = 256 * 2**20


def _initializer_bytes(model: ir.Model) -> int:
    total = 0
    for value in model.graph.initializers.values():
        if value.const_value is not None:
            total += value.const_value.nbytes
    return total


def wants_external_data(model: ir.Model, external_data: bool | None) -> bool:
    return _initializer_bytes(model) > EXTERNAL_DATA_THRESHOLD if external_data is None else external_data


@contextlib.contextmanager
def staged_save(
    model: ir.Model, path: str | os.PathLike, *, external_data: bool | None = None, full_check: bool = True
) -> Iterator[pathlib.Path]:
    """Write ``model`` to a temporary path, yield it for checks, then move it into place.

    If the body of the ``with`` raises, nothing is moved and the temporary files
    are removed.

    Example::

        with staged_save(model, "m.onnx") as staged:
            run_checks(staged)      # raising here leaves "m.onnx" untouched
    """
    with atomic_write(path) as staging:
        yield write_checked(model, staging, external_data=external_data, full_check=full_check)


def write_checked(
    model: ir.Model, staging: Staging, *, external_data: bool | None = None, full_check: bool = True
) -> pathlib.Path:
    """Write ``model`` (functions callee-first) where ``staging`` says, check it with
    ``onnx.checker(full_check=True)``, and return the staged path.

    ``external_data``: ``None`` decides by size (:data:`EXTERNAL_DATA_THRESHOLD`).
    ``full_check=False``: the checker without strict type inference, for files with onnxruntime's
    contrib ops (``com.microsoft``), which onnx has no schemas for: their outputs have no inferred
    type, and strict inference refuses every op reading them. The caller runs the file in
    onnxruntime instead.
    """
    from onnx_modular.passes.function_order import SortFunctionsPass
    from onnx_modular.storage import ort_schemas

    SortFunctionsPass()(model)  # every file callee-first: readers that resolve functions in file order
    external = wants_external_data(model, external_data)
    if not external:
        # ir.save keeps a tensor still read from the source's data file as such a reference, relative
        # to a folder it is not written to ("should be stored in .onnx_modular-tmp-.../m.onnx.data"):
        # a model small enough to hold its weights reads them now.
        ir.external_data.load_to_model(model)
    staged, destination = staging.model_path, staging.destination
    try:
        ir.save(
            model, staged, external_data=staging.data_location if external else None,
            max_workers=WRITER_THREADS, max_in_flight_bytes=WRITER_BYTES_IN_FLIGHT,
        )
    except OSError as e:
        raise SaveError(f"Writing {_shown(destination)} failed: {e}", hint="Check free disk space and permissions.") from e
    ort_schemas.register()  # onnxruntime's SimplifiedLayerNormalization (ONNX domain) known to the checker
    try:
        onnx.checker.check_model(str(staged), full_check=full_check)
    except Exception as e:
        raise SaveError(
            f"The ONNX checker rejected the model: {e}",
            hint="This is a bug in onnx_modular or torch's translator; please report it with the model.",
        ) from e
    return staged


def write_text(path: str | os.PathLike, text: str) -> pathlib.Path:
    """Write a text file (a report: JSON, HTML) atomically, as models are written: into a
    private folder next to ``path``, then moved into place; a failure leaves ``path`` as it was.
    """
    with atomic_write(path) as staging:
        staging.retires_previous_data = False
        try:
            staging.model_path.write_text(text, encoding="utf-8")
        except OSError as e:
            raise SaveError(f"Writing {_shown(staging.destination)} failed: {e}", hint="Check free disk space and permissions.") from e
        destination = staging.destination
    return destination
