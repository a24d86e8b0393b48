"""``modularize`` of torch's flat export says what it could not recover: the Conv whose nodes
torch's optimizer fused with the BatchNorm after it, and the two calls of a module called twice,
merged into one (tests/models.FusedAndShared)."""

from __future__ import annotations

import models
import pytest
import torch

from onnx_modular.cli import main
from onnx_modular.files.modularize import modularize


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("flat") / "flat.onnx"
    torch.onnx.export(models.FusedAndShared().eval(), (torch.randn(1, 3, 8, 8),), str(path), dynamo=True, optimize=True)
    return path


def test_report_lists_what_is_lost(flat, tmp_path):
    report = modularize(flat, tmp_path / "m.onnx")
    assert report.parity.ok
    assert len(report.unrecovered) == 2, report.unrecovered
    merged, fused = report.unrecovered
    assert merged.startswith("shared: its body took in nodes of <root>") and "called more than once" in merged
    assert fused.startswith("conv: its weights (conv.weight, conv.bias)") and "read by nodes of bn" in fused
    assert "not recovered from the flat file (2):" in str(report)
    assert [c.call_name for c in report.tree.walk() if c.function is not None] == ["bn", "shared", "shared.linear"]


def test_cli_prints_it(flat, tmp_path, capsys):
    assert main(["modularize", str(flat), "-o", str(tmp_path / "m.onnx")]) == 0
    out = capsys.readouterr().out
    assert "not recovered from the flat file (2):" in out and "  conv: its weights" in out
