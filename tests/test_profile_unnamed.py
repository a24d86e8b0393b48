"""``profile`` attributes the kernels of nodes onnxruntime leaves unnamed (``Cast_<index>``
from folded constants: a GroupNorm's reshaped weight and bias, an attention's scale), which are
not in the optimized graph by name: a Conv + GroupNorm + attention model, batch dynamic."""

from __future__ import annotations

import re

import models
import pytest
import torch

from onnx_modular import export_modular
from onnx_modular.profiling.run import profile


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("prof") / "conv_attn.onnx"
    batch = torch.export.Dim("batch", min=1, max=8)
    export_modular(models.ConvAttention().eval(), (torch.randn(2, 4, 8, 8),), path, dynamic_shapes=({0: batch},))
    return profile(path, runs=2, warmup=1, threads=1)


def test_unnamed_cast_kernels_are_attributed(report):
    unnamed = [k for k in report.kernels if re.fullmatch(r"Cast_\d+", k.name)]
    assert len(unnamed) >= 2  # the model this test is about: onnxruntime made unnamed Casts
    assert report.counts["unattributed"] == 0
    keys = {call.key for call in report.tree.walk()}
    assert all(k.call in keys for k in report.kernels)
    # the norm's weight and bias are told from the attention's scale by their input shapes
    assert sorted(k.call for k in unnamed).count("attn.norm") == 2
    assert {k.call for k in unnamed} <= {"attn", "attn.norm"}
    attributed = sum(item.self_us for item in report.times.values())
    assert attributed == pytest.approx(report.total_us, rel=0.02)
