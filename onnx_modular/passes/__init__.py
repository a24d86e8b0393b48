"""ONNX IR passes of the onnx_modular pipeline, one per file. None imports torch.

The FX pass that runs inside torch's decomposition lives in :mod:`onnx_modular.capture.fx_fixes`.
"""

from onnx_modular.passes.dedupe import DeduplicateFunctionsPass
from onnx_modular.passes.io_names import NameGraphInputsOutputsPass
from onnx_modular.passes.modularize import OutlineModuleCallsPass
from onnx_modular.passes.naming import NameFunctionsPass

__all__ = [
    "DeduplicateFunctionsPass",
    "NameFunctionsPass",
    "NameGraphInputsOutputsPass",
    "OutlineModuleCallsPass",
]
