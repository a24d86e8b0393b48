"""onnx_modular: PyTorch -> ONNX with every nn.Module call kept as a nested local function.

Example::

    from onnx_modular import export_modular
    result = export_modular(model, (x,), "m.onnx")
    print(result.hierarchy)   # the function tree
    print(result.report)      # parity against PyTorch

``import onnx_modular`` does not import torch: the names that need it (``export_modular``,
``ModularExport``, ``localize``, ...) load their module when first used, and the file tools
(:mod:`onnx_modular.files`, ``verify`` without a model) never need it.
"""

import importlib

from onnx_modular.storage.signals import quiet_interrupt_while_importing

quiet_interrupt_while_importing()  # the command line only: Ctrl-C during the imports exits 130 quietly

from onnx_modular._version import __version__  # noqa: E402 - after the handler
from onnx_modular.check.parity import OutputParity, ParityReport, Tolerance  # noqa: E402
from onnx_modular.errors import (  # noqa: E402
    CaptureError,
    DecompositionError,
    ExecutionProviderError,
    InvalidInputError,
    InvalidModelFileError,
    MissingDependencyError,
    ModularizeError,
    OnnxModularError,
    ParityError,
    ProfileError,
    SaveError,
    TranslationError,
    VerificationError,
)
from onnx_modular.format.calltree import CallTree, ModuleCall  # noqa: E402

#: name -> module that defines it, imported on first use (these modules import torch).
_LAZY = {
    "export_modular": "onnx_modular.export",
    "ModularExport": "onnx_modular.result",
    "ModuleSelector": "onnx_modular.capture.selection",
    "localize": "onnx_modular.check.localization",
    "LocalizationReport": "onnx_modular.check.localization",
    "verify": "onnx_modular.check.verification",
    "VerificationReport": "onnx_modular.check.verification",
    # torch-free, but onnxruntime is imported only when profiling
    "profile": "onnx_modular.profiling.run",
    "ProfileReport": "onnx_modular.profiling.run",
    "extract": "onnx_modular.files.extract",
    "replace": "onnx_modular.files.replace",
    "diff": "onnx_modular.files.diff.tool",
    "ModelDiff": "onnx_modular.files.diff.tool",
    "split": "onnx_modular.files.split.tool",
    "run_stages": "onnx_modular.files.split.stages",
    "convert": "onnx_modular.files.convert.tool",
    "Conversion": "onnx_modular.files.convert.tool",
    "modularize": "onnx_modular.files.modularize.tool",
    "generate": "onnx_modular.runtime.decoding",
    "ModularizeReport": "onnx_modular.files.modularize.tool",
    "optimize": "onnx_modular.files.optimize.tool",
    "OptimizeReport": "onnx_modular.files.optimize.tool",
    "quality": "onnx_modular.check.quality",
    "QualityReport": "onnx_modular.check.quality",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'onnx_modular' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "__version__",
    "export_modular",
    "ModularExport",
    "ModuleSelector",
    "CallTree",
    "ModuleCall",
    "ParityReport",
    "OutputParity",
    "Tolerance",
    "verify",
    "VerificationReport",
    "extract",
    "replace",
    "diff",
    "ModelDiff",
    "split",
    "run_stages",
    "convert",
    "Conversion",
    "modularize",
    "ModularizeReport",
    "generate",
    "optimize",
    "OptimizeReport",
    "quality",
    "QualityReport",
    "localize",
    "LocalizationReport",
    "profile",
    "ProfileReport",
    "OnnxModularError",
    "InvalidInputError",
    "CaptureError",
    "DecompositionError",
    "TranslationError",
    "ModularizeError",
    "SaveError",
    "ParityError",
    "VerificationError",
    "InvalidModelFileError",
    "MissingDependencyError",
    "ExecutionProviderError",
    "ProfileError",
]
