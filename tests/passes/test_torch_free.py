"""The passes and their unit tests run with ``import torch`` made impossible.

In the full suite torch is already imported by other test files, so this check runs the pass
tests again in a fresh interpreter where a meta-path finder refuses ``torch``.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parent.parent

BLOCK_TORCH = """
import importlib.abc, pkgutil, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            # ModuleNotFoundError, as a machine without torch raises: pytest.importorskip skips on it
            # in pytest 8 and 9 (pytest 9 no longer skips on a plain ImportError).
            raise ModuleNotFoundError(f"torch is blocked in this test ({name})", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
import onnx_modular.passes
for module in pkgutil.walk_packages(onnx_modular.passes.__path__, "onnx_modular.passes."):
    __import__(module.name)
import pytest
code = pytest.main([sys.argv[1], "-q", "-p", "no:cacheprovider", "--ignore", sys.argv[2]])
assert "torch" not in sys.modules, "a pass or its test imported torch"
sys.exit(code)
"""


def test_passes_and_their_tests_need_no_torch():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    process = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH, str(HERE), str(HERE / "test_torch_free.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    assert " passed" in process.stdout and "failed" not in process.stdout
