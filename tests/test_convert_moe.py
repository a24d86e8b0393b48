"""float16 ``convert`` of a mixture of experts whose router counts tokens with ``histc``
(tests/models.HistcMoE). Its bin edges (``0 .. 3.0000002``) stay float32 and the comparisons run in
float32, so the float16 file counts as PyTorch does. With counts nudged where float16 rounds
(``floor(count * 0.9999) + 1``) the converted file does not run (a count is one off, Split refuses): the error names the router and
what to keep, nothing is written, and ``auto_keep`` finds it."""

from __future__ import annotations

import math

import models
import onnx
import onnx.numpy_helper
import pytest

from onnx_modular import export_modular
from onnx_modular.errors import VerificationError
from onnx_modular.files.convert.tool import convert


def _export(folder, nudge=None):
    model, args, _ = models.histc_moe(nudge)
    path = folder / "moe.onnx"
    export_modular(model, args, path)
    assert any("Histc" in f.name or "Router" in f.name for f in onnx.load(str(path)).functions)
    return path


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """Counts nudged by a constant that float16 rounds (0.9999 -> 1.0): one off in float16."""
    return _export(tmp_path_factory.mktemp("moe"), nudge=1e-4)


def test_histc_bin_edges_stay_float32_and_the_float16_file_counts_right(tmp_path):
    # The edges 0, 0.75, 1.5, 2.25, 3.0000002 rounded to 3.0 in float16, the last expert's
    # tokens dropped out of the count and Split refused (issue 51, Mixtral in the sweep).
    path = _export(tmp_path)
    report = convert(path, tmp_path / "moe.f16.onnx", dtype="float16")
    assert report.max_drift < 0.01 and not report.kept
    converted = onnx.load(str(tmp_path / "moe.f16.onnx"))
    edges = [onnx.numpy_helper.to_array(t) for t in converted.graph.initializer if math.prod(t.dims) == 5]
    assert len(edges) == 1 and edges[0].dtype == "float32" and edges[0][-1] > 3  # the bin edges, 3.0000002
    router = next(f for f in converted.functions if f.name.startswith("HistcRouter"))
    assert any(n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.FLOAT16 for n in router.node)  # converted


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
    assert "converted (alone, or with the rest), the file does not run in onnxruntime" in str(auto)
