"""ONNX IR passes of the onnx_modular pipeline, one per file; :mod:`.pipeline` runs them. None imports torch.

A pass that needs data from the torch side (module stacks, axis names, checkpoint tensors)
receives it as plain data. The FX pass that runs inside torch's decomposition lives in
:mod:`onnx_modular.capture.fx_fixes`.
"""

from onnx_modular.passes.export.attach_weights import AttachWeightsPass
from onnx_modular.passes.export.constant_metadata import StripConstantMetadataPass
from onnx_modular.passes.export.dedupe import DeduplicateFunctionsPass
from onnx_modular.passes.export.default_opset import SetDefaultOpsetPass
from onnx_modular.passes.export.dynamic_axes import RenameDynamicAxesPass
from onnx_modular.passes.export.fold_weights import FoldWeightsPass
from onnx_modular.passes.export.inline_helpers import InlineHelperFunctionsPass
from onnx_modular.passes.export.io_names import NameGraphInputsOutputsPass
from onnx_modular.passes.export.module_stacks import AnnotateStacksPass
from onnx_modular.passes.export.naming import NameFunctionsPass
from onnx_modular.passes.export.no_op_calls import RecordNoOpCallsPass
from onnx_modular.passes.export.opset_conversion import ConvertOpsetPass
from onnx_modular.passes.export.opset_imports import AddOpsetImportsPass
from onnx_modular.passes.export.optimize_functions import OptimizeFunctionsPass
from onnx_modular.passes.export.outline_calls import OutlineModuleCallsPass
from onnx_modular.passes.export.remove_unused import RemoveUnusedPass
from onnx_modular.passes.export.standard_ops import FuseStandardOpsPass

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
