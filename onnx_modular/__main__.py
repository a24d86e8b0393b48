"""``python -m onnx_modular``: the command line (see :mod:`onnx_modular.cli`)."""

from onnx_modular.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
