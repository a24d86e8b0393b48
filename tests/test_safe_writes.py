"""Writes are atomic: a failure leaves no partial file, no stray external data, and never
replaces an existing file. Disk-full is real: a tiny tmpfs (skipped where mounting is not allowed)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
import torch
import torch.nn as nn
from onnx import TensorProto, helper

from onnx_modular import ParityError, SaveError, export_modular
from onnx_modular.cli import main
from onnx_modular.files import inline_file
from onnx_modular.storage import locks
from onnx_modular.storage import save as _io


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
        # a file the failed save left open (a writer thread's handle not yet collected) keeps the
        # mount busy: detach it lazily then, rather than leave a mount under pytest's temp folder
        if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], check=False, capture_output=True)


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


# -- issue 25: a save replaces only the destination and the data it refers to ---------------





def external_pair(folder, name: str, location: str, value: float = 1.0):
    """``folder/name`` with one 32x32 initializer (all ``value``) in ``folder/location``
    (4 KiB: above the size onnx.save keeps inside the model)."""
    weight = onnx.numpy_helper.from_array(np.full((32, 32), value, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    onnx.save(model, str(folder / name), save_as_external_data=True, location=location, size_threshold=0)
    return folder / name


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_another_models_data_file_is_never_replaced(tmp_path):
    # old.onnx is a renamed model: it still refers to m.onnx.data, the name m.onnx's data would take.
    external_pair(tmp_path, "old.onnx", "m.onnx.data", value=1.0)
    source = external_pair(tmp_path, "src.onnx", "src.onnx.data", value=2.0)
    before = digest(tmp_path / "m.onnx.data")
    inline_file(source, tmp_path / "m.onnx")  # m.onnx does not exist yet
    assert digest(tmp_path / "m.onnx.data") == before
    assert len(_io.referenced_data(tmp_path / "m.onnx")) == 1
    assert _io.referenced_data(tmp_path / "m.onnx") != {"m.onnx.data"}
    old = onnx.load(str(tmp_path / "old.onnx"))  # its weights are still its own
    assert np.all(onnx.numpy_helper.to_array(old.graph.initializer[0]) == 1.0)
    new = onnx.load(str(tmp_path / "m.onnx"))
    assert np.all(onnx.numpy_helper.to_array(new.graph.initializer[0]) == 2.0)
    inline_file(source, tmp_path / "m.onnx")  # a second save retires only its own previous data
    assert digest(tmp_path / "m.onnx.data") == before
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["old.onnx", "m.onnx.data", "src.onnx", "src.onnx.data", "m.onnx", *_io.referenced_data(tmp_path / "m.onnx")]
    )


def test_clean_up_removes_no_file_by_its_name_alone(tmp_path):
    # A dated backup pair and an unreferenced file shaped like our temporary data names.
    external_pair(tmp_path, "m.onnx.20250101", "m.onnx.20250101.data")
    (tmp_path / "m.onnx.deadbeef.data").write_bytes(b"someone else's")
    source = external_pair(tmp_path, "src.onnx", "src.onnx.data")
    for _ in range(3):
        inline_file(source, tmp_path / "m.onnx")
    assert (tmp_path / "m.onnx.20250101.data").exists() and (tmp_path / "m.onnx.deadbeef.data").exists()
    assert len([n for n in os.listdir(tmp_path) if n.startswith("m.onnx") and n.endswith(".data")]) == 3


def test_an_interrupted_commit_is_finished_from_its_journal_only(tmp_path):
    dest = tmp_path / "m.onnx"
    source = external_pair(tmp_path, "src.onnx", "src.onnx.data")
    inline_file(source, dest)
    kept = _io.referenced_data(dest)
    # What a commit killed after moving its data leaves: a data file and the journal naming it,
    # plus names a planted journal cannot make us delete (not this destination's data names).
    (tmp_path / "m.onnx.0123abcd.data").write_bytes(b"orphan")
    (tmp_path / "precious.txt").write_bytes(b"keep")
    journal = locks.private_path(dest, _io.JOURNAL_PREFIX)
    journal.write_text(json.dumps(["m.onnx.0123abcd.data", "precious.txt", *kept]))
    inline_file(source, dest)
    assert not (tmp_path / "m.onnx.0123abcd.data").exists() and (tmp_path / "precious.txt").exists()
    assert not journal.exists()
    assert main(["verify", str(dest)]) == 0


def test_special_destinations_are_refused_before_any_work(tmp_path):
    source = external_pair(tmp_path, "src.onnx", "src.onnx.data")
    os.mkfifo(tmp_path / "fifo.onnx")
    os.symlink("fifo.onnx", tmp_path / "link.onnx")
    os.symlink("/dev/null", tmp_path / "null.onnx")
    listing = sorted(os.listdir(tmp_path))
    for name in ("fifo.onnx", "link.onnx", "null.onnx", "/dev/null", "/dev/zero"):
        with pytest.raises(SaveError, match="is not a regular file"):
            inline_file(source, tmp_path / name)
        with pytest.raises(SaveError, match="is not a regular file"):
            export_modular(Big().eval(), (torch.randn(2, 256),), tmp_path / name, verify=False)
    assert sorted(os.listdir(tmp_path)) == listing  # no lock, temp or data file left
    assert (tmp_path / "fifo.onnx").is_fifo() and os.path.realpath(tmp_path / "null.onnx") == "/dev/null"


@pytest.mark.parametrize("squatter", ["dangling-link", "folder", "fifo"])
def test_a_lock_name_taken_by_something_else_is_a_typed_error(tmp_path, squatter):
    source = external_pair(tmp_path, "src.onnx", "src.onnx.data")
    lock = locks.private_path(tmp_path / "m.onnx", locks.LOCK_PREFIX)
    outside = tmp_path.parent / f"{tmp_path.name}-escaped"
    if squatter == "dangling-link":
        os.symlink(outside, lock)
    elif squatter == "folder":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    with pytest.raises(SaveError, match="lock"):
        inline_file(source, tmp_path / "m.onnx")
    assert not outside.exists() and not (tmp_path / "m.onnx").exists()


def test_inline_in_place_is_refused_and_leaves_the_source_as_it_was(tmp_path, capsys):
    """The writer's guard (storage/guard.py): an output may not be the input or its data file."""
    path = external_pair(tmp_path, "m.onnx", "m.onnx.data", value=3.0)
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    for output in (path, tmp_path / "m.onnx.data"):
        assert main(["inline", str(path), str(output)]) == 2
        assert "the input" in capsys.readouterr().err
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before
    assert main(["verify", str(path)]) == 0
    model = onnx.load(str(path))
    assert np.all(onnx.numpy_helper.to_array(model.graph.initializer[0]) == 3.0)


def test_a_path_with_a_nul_byte_is_a_typed_error(tmp_path):
    with pytest.raises(SaveError, match="NUL"):
        export_modular(Big().eval(), (torch.randn(2, 256),), str(tmp_path / "a\x00b.onnx"), verify=False)
