"""Passes of the onnx_modular pipeline (FX: relax_views; ONNX IR: the rest)."""

from onnx_modular.passes.dedupe import DeduplicateFunctionsPass
from onnx_modular.passes.modularize import OutlineModuleCallsPass
from onnx_modular.passes.naming import NameFunctionsPass
from onnx_modular.passes.relax_views import relax_view_strides

__all__ = [
    "DeduplicateFunctionsPass",
    "NameFunctionsPass",
    "OutlineModuleCallsPass",
    "relax_view_strides",
]
