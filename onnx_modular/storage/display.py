"""The copy of a modular file that ``onnx-modular view`` shows: lifted constants back in their bodies.

The file keeps its constants lifted (onnxruntime creates its session faster); Netron would show
them as a dozen more inputs of every block (:mod:`onnx_modular.passes.export.sink_constants`). The
copy is written without the weights' external data (Netron reads tensor shapes, not values).
"""

from __future__ import annotations

import os
import pathlib

import onnx

from onnx_modular.storage.load import load_model_file

__all__ = ["display_bytes", "write_display_copy"]


def display_bytes(model: onnx.ModelProto) -> bytes | None:
    """``model`` serialized with its lifted constants sunk back into the bodies, or ``None``
    when it has none (then the file is shown as it is). External-data references are kept as
    they are: the viewer reads them from the model's own folder."""
    import onnx_ir as ir

    from onnx_modular.passes.export.sink_constants import SinkLiftedConstantsPass

    copy = ir.from_proto(model)
    if not SinkLiftedConstantsPass()(copy).modified:
        return None
    return ir.to_proto(copy).SerializeToString()


def write_display_copy(source: str | os.PathLike, destination: str | os.PathLike) -> bool:
    """Write the display copy of ``source`` to ``destination`` (the file as it is when it has
    no lifted constants). Returns whether anything changed."""
    model = load_model_file(source)
    shown = display_bytes(model)
    pathlib.Path(destination).write_bytes(shown if shown is not None else model.SerializeToString())
    return shown is not None
