"""A short run of the malformed-file fuzzer (``scripts/fuzz_files.py``) over the CLI.

Every failure (traceback, signal, timeout, memory limit) must belong to a class listed as
open (``fuzz_files.OPEN_BY_TEXT``, ``OPEN_BY_KIND``: empty since issue 12's items 1-7 were
fixed); any failure fails the test. The 2,000-case campaign is ``python scripts/fuzz_files.py --cases 2000``
(``docs/robustness.md``).
"""

from __future__ import annotations

import os
import pathlib
import random
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "scripts"))
import fuzz_files  # noqa: E402


def test_outcomes_are_classified(tmp_path):
    assert fuzz_files.classify(2, "error: [load] not an ONNX file\n", False) == "ok"
    assert fuzz_files.classify(3, "Traceback (most recent call last):\n  ...\nKeyError: 'x'\n", False) == "traceback"
    assert fuzz_files.classify(-11, "", False) == "signal"
    assert fuzz_files.classify(None, "", True) == "timeout"
    assert fuzz_files.classify(-6, "terminate called after throwing an instance of 'std::bad_alloc'", False) == "memory"
    assert fuzz_files.classify(1, "mismatch but no message", False) == "no-error-line"
    failing = {"argv": ["verify", "m.onnx", "--seed", "-1"], "stderr_tail": "ValueError: expected non-negative integer"}
    assert fuzz_files.open_item("bitflips", failing) is None  # fixed: no class is open any more
    assert fuzz_files.open_item("bomb", {"argv": ["verify", "m.onnx"], "stderr_tail": ""}) is None
    assert fuzz_files.open_item("bitflips", {"argv": ["tree", "m.onnx"], "stderr_tail": "KeyError: 'x'"}) is None


@pytest.fixture(scope="module")
def server():
    server = fuzz_files.ForkServer()
    yield server
    server.close()


def test_children_report_clean_errors_and_are_bounded(tmp_path, server):
    """A clean error is ok; a hang is a timeout (the child is killed, the test goes on)."""
    (tmp_path / "hang.py").write_text("import time\nwhile True:\n    time.sleep(1)\n")
    fuzz_files.gen_recursion(random.Random(1), tmp_path, {})
    result = fuzz_files.run_command(server, ["tree", "m.onnx"], tmp_path, 60, 2 << 30)
    assert result["outcome"] == "ok" and result["exitcode"] == 2, result
    (tmp_path / "m.onnx").write_bytes(fuzz_files.bomb(depth=24).SerializeToString())
    result = fuzz_files.run_command(server, ["tree", "m.onnx"], tmp_path, 60, 2 << 30)
    assert result["outcome"] == "ok" and result["exitcode"] == 2, result  # tree refuses the expansion
    os.remove(tmp_path / "m.onnx")
    os.mkfifo(tmp_path / "m.onnx")  # issue 12 item 1: reading a FIFO blocked; now refused
    result = fuzz_files.run_command(server, ["tree", "m.onnx"], tmp_path, 30, 2 << 30)
    assert result["outcome"] == "ok" and result["exitcode"] == 2, result
    # `export` loads torch before the factory; a CUDA build of torch (2.15 from the registry) maps
    # more address space than the 2 GiB the file commands get, so this child gets 16 GiB.
    result = fuzz_files.run_command(server, ["export", "hang.py:f", "-o", "x.onnx"], tmp_path, 2, 16 << 30)
    assert result["outcome"] == "timeout", result


def test_fifty_cases_find_no_new_failure_class(tmp_path, server):
    records = fuzz_files.run_campaign(50, seed=0, timeout=8, memory_mb=1536, workdir=tmp_path, server=server)
    assert len(records) == 50 and not any("generator_error" in r for r in records)
    assert sum(len(r["results"]) for r in records) == 150
    new = fuzz_files.new_failures(records)
    assert not new, fuzz_files.summary(records)
