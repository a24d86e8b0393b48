"""ONNX IR passes of the onnx_modular pipeline, one per file; :mod:`.pipeline` runs them. None imports torch.

A pass that needs data from the torch side (module stacks, axis names, checkpoint tensors)
receives it as plain data. The FX pass that runs inside torch's decomposition lives in
:mod:`onnx_modular.capture.fx_fixes`.
"""

from onnx_modular.passes.attach_weights import AttachWeightsPass
from onnx_modular.passes.constant_metadata import StripConstantMetadataPass
from onnx_modular.passes.dedupe import DeduplicateFunctionsPass
from onnx_modular.passes.default_opset import SetDefaultOpsetPass
from onnx_modular.passes.dynamic_axes import RenameDynamicAxesPass
from onnx_modular.passes.fold_weights import FoldWeightsPass
from onnx_modular.passes.inline_helpers import InlineHelperFunctionsPass
from onnx_modular.passes.io_names import NameGraphInputsOutputsPass
from onnx_modular.passes.modularize import OutlineModuleCallsPass
from onnx_modular.passes.module_stacks import AnnotateStacksPass
from onnx_modular.passes.naming import NameFunctionsPass
from onnx_modular.passes.no_op_calls import RecordNoOpCallsPass
from onnx_modular.passes.opset_conversion import ConvertOpsetPass
from onnx_modular.passes.opset_imports import AddOpsetImportsPass
from onnx_modular.passes.optimize import OptimizeFunctionsPass
from onnx_modular.passes.remove_unused import RemoveUnusedPass
from onnx_modular.passes.standard_ops import FuseStandardOpsPass

__all__ = [
    "AddOpsetImportsPass",
    "AnnotateStacksPass",
    "AttachWeightsPass",
    "ConvertOpsetPass",
    "DeduplicateFunctionsPass",
    "FoldWeightsPass",
    "FuseStandardOpsPass",
    "InlineHelperFunctionsPass",
    "NameFunctionsPass",
    "NameGraphInputsOutputsPass",
    "OptimizeFunctionsPass",
    "OutlineModuleCallsPass",
    "RecordNoOpCallsPass",
    "RemoveUnusedPass",
    "RenameDynamicAxesPass",
    "SetDefaultOpsetPass",
    "StripConstantMetadataPass",
]
