"""The package version, importable without the package root (``onnx_modular.__init__``)."""

__version__ = "0.1.0"
