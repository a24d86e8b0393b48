"""The copy of a modular file that ``onnx-modular view`` shows: lifted constants back in their bodies.

The file keeps its constants lifted (onnxruntime creates its session faster); Netron would show
them as a dozen more inputs of every block (:mod:`onnx_modular.passes.sink_constants`). The
copy is written without the weights' external data (Netron reads tensor shapes, not values).
"""

from __future__ import annotations

import os
import pathlib

import onnx

from onnx_modular.files.load import load_model_file

__all__ = ["write_display_copy"]


def write_display_copy(source: str | os.PathLike, destination: str | os.PathLike) -> bool:
    """Write ``source`` to ``destination`` with its lifted constants sunk back into the bodies.

    Returns:
        Whether anything changed (a file without lifted constants is copied as it is).
    """
    import onnx_ir as ir

    from onnx_modular.passes.sink_constants import SinkLiftedConstantsPass

    model = ir.from_proto(load_model_file(source))
    changed = SinkLiftedConstantsPass()(model).modified
    onnx.save(ir.to_proto(model), str(pathlib.Path(destination)))
    return changed
