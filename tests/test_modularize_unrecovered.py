"""``modularize`` of torch's flat export says what it could not recover: the Conv whose nodes
torch's optimizer fused with the BatchNorm after it, and the two calls of a module called twice,
merged into one (tests/models.FusedAndShared)."""

from __future__ import annotations

import models
import pytest
import torch

from onnx_modular.cli import main
from onnx_modular.files.modularize.tool import modularize


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


class HyphenatedBlocks(torch.nn.Module):
    """torchvision's RegNet names its blocks ``block1-0`` (``add_module`` takes any name without
    a dot): the fused Conv of such a block is reported like any other."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Sequential()
        for i in range(2):
            self.trunk.add_module(f"block1-{i}", torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3, padding=1), torch.nn.BatchNorm2d(3)))

    def forward(self, x):
        return self.trunk(x)


def test_a_fused_conv_of_a_hyphenated_block_is_reported(tmp_path):
    torch.manual_seed(0)
    model = HyphenatedBlocks().eval()
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
    torch.onnx.export(model, (torch.randn(1, 3, 8, 8),), str(tmp_path / "flat.onnx"), dynamo=True, optimize=True)
    report = modularize(tmp_path / "flat.onnx", tmp_path / "m.onnx")
    assert report.parity.ok
    recovered = {c.module_path for c in report.tree.walk() if not c.is_root}
    assert {"trunk", "trunk.block1-0", "trunk.block1-1", "trunk.block1-0.1", "trunk.block1-1.1"} <= recovered
    fused = sorted(line.split(":", 1)[0] for line in report.unrecovered)
    assert fused == ["trunk.block1-0.0", "trunk.block1-1.0"], report.unrecovered
