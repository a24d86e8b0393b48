"""Writes are atomic: a failure leaves no partial file, no stray external data, and never
replaces an existing file. Disk-full is real: a tiny tmpfs (skipped where mounting is not allowed)."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
import torch.nn as nn

from onnx_modular import ParityError, SaveError, export_modular


class Big(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(256, 256)  # 256 KiB of weights: larger than the tiny disk

    def forward(self, x):
        return self.proj(x)


class Random(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        return self.proj(x) + torch.rand_like(x)


@pytest.fixture
def tiny_disk(tmp_path):
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


@pytest.mark.parametrize("external_data", [False, True])
def test_disk_full_leaves_nothing_and_keeps_existing_file(tiny_disk, external_data):
    target = tiny_disk / "m.onnx"
    target.write_bytes(b"previous export")
    with pytest.raises(SaveError, match="No space left|Writing"):
        export_modular(Big().eval(), (torch.randn(2, 256),), target, external_data=external_data)
    assert target.read_bytes() == b"previous export"
    assert sorted(os.listdir(tiny_disk)) == ["m.onnx"]


def test_failed_verification_leaves_no_external_data(tmp_path):
    target = tmp_path / "m.onnx"
    with pytest.raises(ParityError):
        export_modular(Random().eval(), (torch.randn(4, 64),), target, external_data=True)
    assert os.listdir(tmp_path) == []


def test_external_data_export_is_complete(tmp_path):
    target = tmp_path / "m.onnx"
    result = export_modular(Big().eval(), (torch.randn(2, 256),), target, external_data=True)
    model_file, data_file = sorted(os.listdir(tmp_path))
    assert model_file == "m.onnx" and data_file == "m.onnx.data"  # a first write: the conventional name
    assert (tmp_path / data_file).stat().st_size >= 256 * 256 * 4
    assert result.report.ok
    # The saved pair loads and runs from another working directory.
    report = result.verify()
    assert report.ok
