"""ONNX IR pass: initializers named like checkpoint tensors read their values from the checkpoint."""

from __future__ import annotations

from collections.abc import Callable, Collection

import onnx_ir as ir

from onnx_modular.errors import WeightsError

__all__ = ["AttachWeightsPass"]


class AttachWeightsPass(ir.passes.InPlacePass):
    """Give each initializer named like a checkpoint tensor a lazy value read from the checkpoint.

    Plain data in, from the weights side: ``names`` (the checkpoint's tensor names) and
    ``lazy_tensor(name)`` (an ``ir.LazyTensor`` reading that tensor when the file is written;
    ``ir.save`` writes external data one tensor at a time, so each value lives only while it
    is written). Runs before any pass renames an initializer. ``self.count`` is the number
    attached.

    Raises :class:`~onnx_modular.errors.WeightsError` if an initializer still holds a value
    on the ``meta`` device (a constant torch.export lifted from a meta tensor that the
    checkpoint does not name).

    Example::

        AttachWeightsPass(plan.keys, plan.lazy_tensor)(model)
    """

    def __init__(self, names: Collection[str], lazy_tensor: Callable[[str], ir.TensorProtocol]):
        super().__init__()
        self.names = names
        self.lazy_tensor = lazy_tensor
        self.count = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.count = 0
        for name, value in list(model.graph.initializers.items()):
            if name in self.names:
                value.const_value = self.lazy_tensor(name)
                self.count += 1
            elif _is_meta(value.const_value):
                raise WeightsError(
                    f"The initializer {name!r} comes from a meta tensor that the weights do not name.",
                    module_path=name.rsplit(".", 1)[0] if "." in name else "",
                    hint="Create that tensor on the CPU (it is a constant or non-persistent buffer).",
                )
        return ir.passes.PassResult(model, modified=self.count > 0)


def _is_meta(tensor) -> bool:
    """A tensor wrapping a torch tensor on the meta device (read by duck typing: no torch import)."""
    return getattr(getattr(tensor, "raw", None), "is_meta", False) is True
