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
    InvalidInputError,
    InvalidModelFileError,
    ModularizeError,
    OnnxModularError,
    ParityError,
    SaveError,
    TranslationError,
    VerificationError,
)

# Loaded on first use (PEP 562), so that ``import onnx_modular.passes`` (and the file tools)
# need no torch: the export and verification modules import it.
_LAZY = {
    "ModularExport": "onnx_modular.export",
    "export_modular": "onnx_modular.export",
    "CallTree": "onnx_modular.hierarchy",
    "ModuleCall": "onnx_modular.hierarchy",
    "LocalizationReport": "onnx_modular.localization",
    "VerificationReport": "onnx_modular.localization",
    "localize": "onnx_modular.localization",
    "verify": "onnx_modular.localization",
    "ParityReport": "onnx_modular.verification",
    "Tolerance": "onnx_modular.verification",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'onnx_modular' has no attribute {name!r}")

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
]
