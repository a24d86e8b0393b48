"""Shared pytest setup: the ``--runslow`` flag and small helpers used across test files."""

from __future__ import annotations

import logging

import pytest

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
