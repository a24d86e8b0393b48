"""onnx_modular: PyTorch -> ONNX with every nn.Module call kept as a nested local function.

Example::

    from onnx_modular import export_modular
    result = export_modular(model, (x,), "m.onnx")
    print(result.hierarchy)   # the function tree
    print(result.report)      # parity against PyTorch
"""

__version__ = "0.1.0"

from onnx_modular.errors import (
    CaptureError,
    DecompositionError,
    ExecutionProviderError,
    InvalidInputError,
    InvalidModelFileError,
    MissingDependencyError,
    ModularizeError,
    OnnxModularError,
    ParityError,
    SaveError,
    TranslationError,
    VerificationError,
)
from onnx_modular.export import ModularExport, export_modular
from onnx_modular.hierarchy import CallTree, ModuleCall
from onnx_modular.localization import LocalizationReport, VerificationReport, localize, verify
from onnx_modular.verification import ParityReport, Tolerance

__all__ = [
    "__version__",
    "export_modular",
    "ModularExport",
    "CallTree",
    "ModuleCall",
    "ParityReport",
    "Tolerance",
    "verify",
    "localize",
    "LocalizationReport",
    "VerificationReport",
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
]
