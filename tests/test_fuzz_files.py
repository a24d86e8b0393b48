"""A short run of the malformed-file fuzzer (``tests/fuzzing/``, command line ``scripts/fuzz_files.py``) over the CLI.

Every failure (traceback, signal, timeout, memory limit) must belong to a class listed as
open (``runner.OPEN_BY_TEXT``, ``OPEN_BY_KIND``: empty since issue 12's items 1-7 were
fixed); any failure fails the test. The 2,000-case campaign is ``python scripts/fuzz_files.py --cases 2000``
(``docs/robustness.md``).
"""

from __future__ import annotations

import json
import os
import random
import struct
import unicodedata

import pytest
from fuzzing import builders, generators_export, generators_graphs, runner
from fuzzing.cases import run_campaign
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def test_outcomes_are_classified(tmp_path):
    assert runner.classify(2, "error: [load] not an ONNX file\n", False) == "ok"
    assert runner.classify(3, "Traceback (most recent call last):\n  ...\nKeyError: 'x'\n", False) == "traceback"
    assert runner.classify(-11, "", False) == "signal"
    assert runner.classify(None, "", True) == "timeout"
    assert runner.classify(-6, "terminate called after throwing an instance of 'std::bad_alloc'", False) == "memory"
    assert runner.classify(1, "mismatch but no message", False) == "no-error-line"
    failing = {"argv": ["verify", "m.onnx", "--seed", "-1"], "stderr_tail": "ValueError: expected non-negative integer"}
    assert runner.open_item("bitflips", failing) is None  # fixed: no class is open any more
    assert runner.open_item("bomb", {"argv": ["verify", "m.onnx"], "stderr_tail": ""}) is None
    assert runner.open_item("bitflips", {"argv": ["tree", "m.onnx"], "stderr_tail": "KeyError: 'x'"}) is None


@pytest.fixture(scope="module")
def server():
    server = runner.ForkServer()
    yield server
    server.close()


def test_children_report_clean_errors_and_are_bounded(tmp_path, server):
    """A clean error is ok; a hang is a timeout (the child is killed, the test goes on)."""
    (tmp_path / "hang.py").write_text("import time\nwhile True:\n    time.sleep(1)\n")
    generators_graphs.gen_recursion(random.Random(1), tmp_path, {})
    result = runner.run_command(server, ["tree", "m.onnx"], tmp_path, 60, 2 << 30)
    assert result["outcome"] == "ok" and result["exitcode"] == 2, result
    (tmp_path / "m.onnx").write_bytes(builders.bomb(depth=24).SerializeToString())
    result = runner.run_command(server, ["tree", "m.onnx"], tmp_path, 60, 2 << 30)
    assert result["outcome"] == "ok" and result["exitcode"] == 2, result  # tree refuses the expansion
    os.remove(tmp_path / "m.onnx")
    os.mkfifo(tmp_path / "m.onnx")  # issue 12 item 1: reading a FIFO blocked; now refused
    result = runner.run_command(server, ["tree", "m.onnx"], tmp_path, 30, 2 << 30)
    assert result["outcome"] == "ok" and result["exitcode"] == 2, result
    # `export` loads torch before the factory; a CUDA build of torch (2.15 from the registry) maps
    # more address space than the 2 GiB the file commands get, so this child gets 16 GiB.
    result = runner.run_command(server, ["export", "hang.py:f", "-o", "x.onnx"], tmp_path, 2, 16 << 30)
    assert result["outcome"] == "timeout", result


def test_fifty_cases_find_no_new_failure_class(tmp_path, server):
    records = run_campaign(50, seed=0, timeout=8, memory_mb=1536, workdir=tmp_path, server=server)
    assert len(records) == 50 and not any("generator_error" in r for r in records)
    # three commands per file case (tree, inline, verify); the kinds of issues 38, 53 and 65 run their own (1 to 5:
    # guard_outputs runs two tools and three verifies)
    assert all(1 <= len(r["results"]) <= 5 for r in records) and sum(len(r["results"]) for r in records) >= 100
    new = runner.new_failures(records)
    assert not new, runner.summary(records)


# -- issue 25: hypothesis over safetensors headers and printed names ----------------------------



_json_scalars = st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats(allow_nan=False) | st.text(max_size=8)
_json = st.recursive(_json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
_entry = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(["F32", "F16", "I64", "BOOL", "U8", "F33", ""]) | _json,
        "shape": st.lists(st.integers(-2, 6), max_size=3) | _json,
        "data_offsets": st.lists(st.integers(-64, 200), min_size=0, max_size=3) | _json,
    },
)
_header = st.dictionaries(st.sampled_from(["a", "b", "c", "__metadata__"]), _entry | _json, max_size=4) | _json


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(header=_header, body=st.binary(max_size=200), claimed=st.none() | st.integers(0, 2**40))
def test_any_safetensors_header_is_read_or_refused_as_data(tmp_path_factory, header, body, claimed):
    """Whatever a header says, opening the file either gives tensors that lie inside the file,
    one after another, or raises WeightsError: never another exception, never a read past the end."""
    from onnx_modular.errors import WeightsError
    from onnx_modular.weights.sources import WeightSource

    text = json.dumps(header).encode()
    path = tmp_path_factory.mktemp("st") / "w.safetensors"
    path.write_bytes(struct.pack("<Q", len(text) if claimed is None else claimed) + text + body)
    try:
        source = WeightSource.open(path)
    except WeightsError:
        return
    for key in source.keys():
        tensor = source.read(key)
        dtype, shape = source.spec(key)
        assert tuple(tensor.shape) == shape and tensor.dtype == dtype


_FORMAT = ("Cc", "Cf", "Zl", "Zp")


@settings(max_examples=500, deadline=None, derandomize=True)
@given(st.text() | st.binary() | st.text(alphabet=st.characters(categories=("Cc", "Cf", "Zl", "Zp", "Lo", "Mn"))))
def test_shown_names_hold_no_control_or_format_characters(value):
    """What the CLI prints of a name (``shown``) holds no control character (ANSI escapes, BEL)
    and no invisible format character that could reorder the line (U+202E) or hide text."""
    from onnx_modular.format.text import shown

    printed = shown(value)
    assert not any(unicodedata.category(c) in _FORMAT for c in printed), repr(printed)


# -- issue 25: hostile checkpoint folders through `export <folder>` ------------------------------


@pytest.mark.parametrize("cases", [4, pytest.param(16, marks=pytest.mark.slow)])  # the campaign itself: --runslow
def test_checkpoint_folders_find_no_new_failure_class(tmp_path, cases):
    """A fixed-seed sample of the ``checkpoint`` case kind (broken config.json, lying weights,
    code or pickles in the folder), each exported with and without --stream-weights: a typed
    error or a verified file, the folder unchanged, nothing from it run. The campaign is
    ``python scripts/fuzz_files.py --only checkpoint --cases 200 --timeout 120 --memory-mb 4096``."""
    pytest.importorskip("transformers")
    server = runner.ForkServer(torch=True)
    try:
        records = run_campaign(
            cases, seed=3, timeout=240, memory_mb=8192, only=["checkpoint"], workdir=tmp_path, server=server
        )
    finally:
        server.close()
    assert len(records) == cases and not any("generator_error" in r for r in records), records
    assert all(r["kind"] == "checkpoint" and len(r["results"]) == 2 for r in records)
    assert any(res["exitcode"] == 2 for r in records for res in r["results"])  # the breakage is reported
    new = runner.new_failures(records)
    assert not new, runner.summary(records)
    assert not (tmp_path / generators_export.PWNED).exists()  # no code from a folder ran
