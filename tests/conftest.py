"""Shared pytest setup: the ``--runslow`` flag and small helpers used across test files."""

from __future__ import annotations

import logging
import os
import sys

import pytest

# Under pytest-xdist (scripts/test.sh runs one worker per core) each worker computes on one thread:
# torch's capture is Python-bound, and two workers each spinning a core-wide thread pool only
# thrash. Set before the test modules import torch; tests that time nothing are unaffected.
if os.environ.get("PYTEST_XDIST_WORKER") and "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
