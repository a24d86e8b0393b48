"""How a model becomes an ``ExportedProgram``: the capture strategies of ``export_modular``.

* :func:`capture`: ``torch.export`` in non-strict mode (:func:`onnx_modular.capture.torch_compat.capture`);
  for a model on the ``meta`` device (weights streamed from a checkpoint, ``weights=``), again
  with the example inputs on ``meta`` when an op rejects CPU inputs next to meta weights
  (``F.linear`` does): the meta-device route. The values are never needed to capture.
* a program captured beforehand (``exported_program=``, transformers' exporter) is used as is
  by ``export_modular``.
"""

from __future__ import annotations

import torch

from onnx_modular.capture import torch_compat

__all__ = ["capture"]


def capture(model: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes, *, on_meta: bool = False) -> torch.export.ExportedProgram:
    """``torch.export`` (non-strict); with ``on_meta``, the meta-device route (see the module doc)."""
    try:
        return torch_compat.capture(model, args, kwargs, dynamic_shapes)
    except Exception as first:
        if not on_meta:
            raise
        to_meta = lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v
        try:
            return torch_compat.capture(model, *torch.utils._pytree.tree_map(to_meta, (args, kwargs)), dynamic_shapes)
        except Exception:
            raise first from None
