"""``python -m onnx_modular``: the command line (see :mod:`onnx_modular.cli`)."""

import sys

try:  # Ctrl-C while the libraries import (the first half second) is a clean exit 130, no traceback
    from onnx_modular.cli import main
except KeyboardInterrupt:
    sys.stderr.write("interrupted\n")
    raise SystemExit(130) from None

if __name__ == "__main__":
    raise SystemExit(main())
