"""``convert --quantize`` on weights that sit in Gemm and Conv nodes (a small CNN with a 2-layer
MLP head, 2-D activations so the Linears export as Gemm with ``transB=1``).

Gemm with a constant B becomes MatMulNBits (+ Add of its bias); Conv weights stay float32 and the
report and a QuantizationWarning list them with the reason.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn

from onnx_modular import export_modular
from onnx_modular.calls.flat import inline_model
from onnx_modular.files.convert.tool import QuantizationWarning, convert
from onnx_modular.runtime import sessions as runtime
from onnx_modular.runtime.inputs import random_inputs


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc(x)))


class ConvGemm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.head = Head()

    def forward(self, x):
        return self.head(self.pool(torch.relu(self.conv(x))).flatten(1))


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("cnn") / "cnn.onnx"
    export_modular(ConvGemm().eval(), (torch.randn(2, 3, 8, 8),), path)
    ops = {n.op_type for f in onnx.load(str(path)).functions for n in f.node}
    assert {"Gemm", "Conv"} <= ops  # the model this test is about
    return path


def _run(path, feeds):
    names, values = runtime.run(str(path), feeds, what="test")
    return dict(zip(names, values))


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_gemm_quantized_conv_reported(cnn, tmp_path, quantize):
    out = tmp_path / "q.onnx"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = convert(cnn, out, quantize=quantize)
    model = onnx.load(str(out))
    linear = [f for f in model.functions if f.name.startswith("Linear")]
    assert len(linear) == 2
    for function in linear:
        assert [n.op_type for n in function.node] == ["MatMulNBits", "Add"]
        nbits = function.node[0]
        attrs = {a.name: a.i for a in nbits.attribute}
        assert attrs["bits"] == int(quantize[3:])
        assert (attrs["K"], attrs["N"]) in {(64, 64), (64, 10)}  # [K, N]: the transpose of the Linear weight
    assert len(report.quantized) == 2
    assert [(call, reason.split(":")[0]) for call, _, reason in report.skipped] == [("conv", "a Conv weight")]
    assert "left: conv" in str(report) and "MatMul and Gemm" in str(report)
    assert [w for w in caught if issubclass(w.category, QuantizationWarning) and "1 weight(s) left" in str(w.message)]
    conv = next(f for f in model.functions if f.name == "Conv2d")
    assert [n.op_type for n in conv.node] == ["Conv"]
    feeds = random_inputs(onnx.load(str(cnn)), seed=0)
    expected, actual = _run(cnn, feeds), _run(out, feeds)
    (name,) = expected
    spread = float(expected[name].max() - expected[name].min())
    # weight-only quantization of two 64-wide layers: within 1% (int8) / 10% (int4) of the range
    assert np.abs(actual[name] - expected[name]).max() <= (0.01 if quantize == "int8" else 0.1) * spread
    assert report.max_drift == pytest.approx(np.abs(actual[name] - expected[name]).max() / spread, rel=1e-3)


def test_flat_file_reports_what_onnxruntime_left(cnn, tmp_path):
    flat = tmp_path / "flat.onnx"
    onnx.save(inline_model(onnx.load(str(cnn))), str(flat))
    with pytest.warns(QuantizationWarning, match="left float32"):
        report = convert(flat, tmp_path / "q.onnx", quantize="int8")
    reasons = sorted(reason.split(":")[0] for _, _, reason in report.skipped)
    # the Conv and the two Gemms onnxruntime's MatMul quantizer leaves
    assert reasons == ["a Conv weight", "a Gemm of a flat file", "a Gemm of a flat file"]
    assert sorted(call for call, _, _ in report.skipped) == ["conv", "head.fc", "head.fc2"]
    assert "WARNING: nothing was quantized" in str(report)
