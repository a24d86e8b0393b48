"""float16 ``convert`` of a mixture of experts whose router counts tokens with ``histc``
(tests/models.HistcMoE): the converted file does not run (a count rounds, Split refuses); the
error names the router and what to keep, nothing is written, and ``auto_keep`` finds it."""

from __future__ import annotations

import math

import models
import onnx
import pytest

from onnx_modular import export_modular
from onnx_modular.errors import VerificationError
from onnx_modular.files.convert import convert


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    model, args, _ = models.histc_moe()
    path = tmp_path_factory.mktemp("moe") / "moe.onnx"
    export_modular(model, args, path)
    assert any("Histc" in f.name or "Router" in f.name for f in onnx.load(str(path)).functions)
    return path


def test_float16_refusal_names_the_module_to_keep(moe, tmp_path):
    out = tmp_path / "moe.f16.onnx"
    with pytest.raises(VerificationError) as caught:
        convert(moe, out, dtype="float16")
    text = str(caught.value)
    assert "Module 'router' (HistcRouter)" in text and "converting it alone already makes the file fail" in text
    assert "--keep HistcRouter" in text and "--auto-keep" in text
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_keep_and_auto_keep_write_a_file_that_runs(moe, tmp_path):
    kept = convert(moe, tmp_path / "kept.onnx", dtype="float16", keep=["HistcRouter"])
    assert kept.kept == ["router", "router.gate"] and kept.max_drift < 0.01
    auto = convert(moe, tmp_path / "auto.onnx", dtype="float16", auto_keep=0.01)
    assert auto.auto_kept[0] == ("HistcRouter", math.inf)
    assert auto.max_drift <= 0.01
    assert "converted alone, the file does not run in onnxruntime" in str(auto)
