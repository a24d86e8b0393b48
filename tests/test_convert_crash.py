"""A converted file onnxruntime crashes on (a signal while it creates the session, not an error) is
opened in a child first (``runtime/sessions.opens_in_child``): ``convert`` refuses it with a typed
error that names the module to keep, leaves nothing behind, and ``auto_keep`` keeps that module.

The real case is onnxruntime's NCHWc transformer on a float16 ``MatMul -> Reshape -> Transpose ->
MatMul`` chain (Gemma 3n audio's relative position term; tests/models.RelativeAttention). Whether
an onnxruntime has that bug is measured here, not assumed: the plain chain is opened in a child."""

from __future__ import annotations

import math
import subprocess
import sys

import models
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_modular import export_modular
from onnx_modular.errors import RuntimeCrashError, VerificationError
from onnx_modular.files.convert.tool import convert
from onnx_modular.runtime import sessions

_SEGFAULT = "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"


def _chain(path) -> None:
    """The float16 chain alone, as onnx.helper writes it."""
    value = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT16, shape)
    weight = numpy_helper.from_array(np.random.default_rng(0).random((32, 32)).astype(np.float16), "w")
    shape = numpy_helper.from_array(np.array([13, 8, 4], np.int64), "shape")
    nodes = [helper.make_node("MatMul", ["table", "w"], ["projected"]),
             helper.make_node("Reshape", ["projected", "shape"], ["heads"]),
             helper.make_node("Transpose", ["heads"], ["keys"], perm=[1, 2, 0]),
             helper.make_node("MatMul", ["queries", "keys"], ["scores"])]
    graph = helper.make_graph(nodes, "chain", [value("table", [13, 32]), value("queries", [2, 8, 24, 4])],
                              [value("scores", None)], [weight, shape])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))


def _crashes(path) -> bool:
    code = "import sys, onnxruntime as ort; ort.set_default_logger_severity(4); ort.InferenceSession(sys.argv[1])"
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True).returncode < 0


@pytest.fixture(scope="module")
def relative(tmp_path_factory):
    folder = tmp_path_factory.mktemp("relative")
    model, args, _ = models.relative_attention()
    export_modular(model, args, folder / "relative.onnx")
    _chain(folder / "chain.onnx")
    return folder / "relative.onnx", _crashes(folder / "chain.onnx")


def test_a_child_that_dies_by_a_signal_is_a_typed_error(relative, monkeypatch):
    path, _ = relative
    sessions.opens_in_child(path)  # the float32 file opens
    monkeypatch.setattr(sessions, "_OPEN", _SEGFAULT)
    with pytest.raises(RuntimeCrashError, match="crashes \\(signal SIGSEGV\\) creating a session for the model"):
        sessions.opens_in_child(path)


def test_a_file_onnxruntime_cannot_load_keeps_its_message(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(VerificationError, match="onnxruntime cannot load the model: .*") as caught:
        sessions.opens_in_child(bad)
    assert not isinstance(caught.value, RuntimeCrashError)


def test_convert_refuses_a_file_onnxruntime_crashes_on_and_leaves_nothing(relative, tmp_path, monkeypatch):
    path, _ = relative
    monkeypatch.setattr(sessions, "_OPEN", _SEGFAULT)  # every file, every trial: no module to name
    out = tmp_path / "out.onnx"
    with pytest.raises(VerificationError, match="crashes \\(signal SIGSEGV\\)") as caught:
        convert(path, out, dtype="float16")
    assert "Keep modules in float32" in str(caught.value)
    assert list(tmp_path.iterdir()) == []  # no file, no scratch folder, no lock


def test_float16_relative_position_names_the_module_onnxruntime_crashes_on(relative, tmp_path):
    path, crashes = relative
    out = tmp_path / "relative.f16.onnx"
    if not crashes:  # an onnxruntime without the NCHWc bug: the whole file converts and runs
        report = convert(path, out, dtype="float16")
        assert report.max_drift < 0.01 and out.exists()
        return
    with pytest.raises(VerificationError) as caught:
        convert(path, out, dtype="float16")
    text = str(caught.value)
    assert "onnxruntime crashes (signal SIGSEGV)" in text and "Module 'relative' (RelativePosition)" in text
    assert "--keep RelativePosition" in text and list(tmp_path.iterdir()) == []
    auto = convert(path, out, dtype="float16", auto_keep=0.01)
    assert auto.auto_kept == [("RelativePosition", math.inf)] and auto.max_drift <= 0.01
    converted = {c.call_name: c.converted for c in auto.calls}
    assert converted["relative"] is False and converted["q_proj"] is True
    sessions.opens_in_child(out)
