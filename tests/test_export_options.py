"""Options a user of torch.onnx.export or Optimum expects, without transformers: dynamic shapes as
torch.onnx.export takes them, bfloat16 models checked on a float32-widened copy, ``--depth 0``,
the permissions of an inlined file's data, and the command line's live progress line."""

from __future__ import annotations

import io
import os
import pty
import stat
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from onnx_modular import export_modular
from onnx_modular.cli import main
from onnx_modular.cli.progress import Progress


class _Prefix(torch.nn.Module):
    """Slices a fixed prefix: torch.export needs ``seq >= 16``, which ``Dim("seq")`` does not say."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x)[:, :16] * 2


@pytest.mark.parametrize("axis", [torch.export.Dim("seq"), "seq"], ids=["Dim-without-min", "string"])
def test_dynamic_shapes_as_torch_onnx_export_takes_them(tmp_path, axis):
    model, x = _Prefix().eval(), torch.randn(2, 20, 4)
    shapes = {"x": {0: "batch", 1: axis}}
    torch.onnx.export(model, (x,), dynamic_shapes=shapes, dynamo=True)  # torch accepts them
    result = export_modular(model, (x,), tmp_path / "m.onnx", dynamic_shapes=shapes)
    assert result.report.ok
    dims = [d.dim_param or d.dim_value for d in onnx.load(str(tmp_path / "m.onnx")).graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "seq", 4]
    other = torch.randn(3, 25, 4)  # other sizes than the example's
    (actual,) = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": other.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(actual, model(other).numpy(), atol=1e-5, rtol=1e-4)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x))) + x


def test_bfloat16_model_is_verified_on_a_float32_widened_copy(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block()).eval().to(torch.bfloat16)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    result = export_modular(model, (x,), tmp_path / "bf16.onnx")
    saved = onnx.load(str(tmp_path / "bf16.onnx"))
    assert saved.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16  # the file stays bfloat16
    report = result.report
    assert report.ok and report.reference == "PyTorch float32" and "float32-widened" in report.note
    assert report.outputs[0].dtype == "float32" and report.outputs[0].modular_max_abs < 1e-4
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # the model is given back as it was
    assert result.verify().ok  # again, from the stored float32 reference


def test_bfloat16_check_catches_a_wrong_file(tmp_path):
    torch.manual_seed(0)
    model = _Block().eval().to(torch.bfloat16)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    result = export_modular(model, (x,), verify=False)
    weight = next(v for v in result.model.graph.initializers.values() if v.const_value.dtype.name == "BFLOAT16")
    import ml_dtypes
    import onnx_ir as ir

    weight.const_value = ir.tensor((weight.const_value.numpy().astype(np.float32) + 0.5).astype(ml_dtypes.bfloat16))
    result.save(tmp_path / "wrong.onnx")
    assert not result.verify().ok


def _small_file(tmp_path, external=False):
    model = torch.nn.Sequential(torch.nn.Linear(600 if external else 4, 4), torch.nn.ReLU()).eval()
    path = tmp_path / "m.onnx"
    export_modular(model, (torch.randn(2, 600 if external else 4),), path, external_data=external, verify=False)
    return path


def test_tree_depth_zero_means_all_as_for_export(tmp_path, capsys):
    path = str(_small_file(tmp_path))
    assert main(["tree", path]) == 0
    everything = capsys.readouterr().out
    assert main(["tree", path, "--depth", "0"]) == 0
    assert capsys.readouterr().out == everything
    assert main(["tree", path, "--depth", "1"]) == 0 and capsys.readouterr().out.count("\n") >= 2


def test_inline_data_file_has_the_model_file_permissions(tmp_path):
    path = _small_file(tmp_path, external=True)
    flat = tmp_path / "flat.onnx"
    assert main(["inline", str(path), str(flat)]) == 0
    data = tmp_path / "flat.onnx.data"
    assert data.is_file()
    assert stat.S_IMODE(data.stat().st_mode) == stat.S_IMODE(flat.stat().st_mode) == stat.S_IMODE(path.stat().st_mode)


# -- the progress display ---------------------------------------------------------------------------


def _read_all(master: int) -> str:
    """Everything written to the terminal (its writer closed), then the master closed."""
    shown = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the other side is closed and everything was read
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    return shown.decode()


def _slow_stages(progress):
    progress("capture", 0.5)
    time.sleep(0.6)  # long enough for several redraws of the live line
    progress("decompose", 0.1)


def test_progress_is_quiet_when_not_a_terminal():
    stream = io.StringIO()
    with Progress(stream, ("capture", "decompose"), interval=0.05) as progress:
        assert not progress.live
        _slow_stages(progress)
    assert stream.getvalue() == "  capture        0.50s\n  decompose      0.10s\n"  # stage lines only


def test_progress_shows_a_live_line_on_a_terminal():
    master, slave = pty.openpty()
    with os.fdopen(slave, "w") as terminal, Progress(terminal, ("capture", "decompose", "save"), interval=0.05) as progress:
        assert progress.live
        _slow_stages(progress)
    shown = _read_all(master)
    assert "\r\x1b[K" in shown  # redrawn in place
    assert "decompose" in shown.split("capture        0.50s")[1]  # the live line names the stage under way
    assert "total" in shown and "  decompose      0.10s" in shown


def test_cli_export_progress_in_a_pty_and_in_a_pipe(tmp_path, monkeypatch, capsys):
    factory = tmp_path / "factory.py"
    factory.write_text(
        "import torch\n"
        "def make():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval(), (torch.randn(2, 4),)\n"
    )
    assert main(["export", f"{factory}:make", "-o", str(tmp_path / "piped.onnx")]) == 0
    assert "\x1b[K" not in capsys.readouterr().err  # not a terminal: stage lines only
    master, slave = pty.openpty()
    with os.fdopen(slave, "w") as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        assert main(["export", f"{factory}:make", "-o", str(tmp_path / "tty.onnx")]) == 0
        monkeypatch.undo()
    text = _read_all(master)
    assert "  capture" in text and "  total" in text and "\r\x1b[K" in text


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 7, 3, 4, 8).unbind(2)
        y = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(2, 7, 32))


def test_bfloat16_check_allows_the_file_s_own_rounded_constants(tmp_path):
    """torch writes SDPA's scale split over q and k as a bfloat16 constant (sqrt(1/sqrt(8)) = 0.5946
    stored as 0.59375): with outputs of magnitude ~10 (N(0,1) weights) the widened copy differs
    from PyTorch in float32 by ~3e-2, beyond float32's atol, though the file is right. The widened
    check's atol follows the outputs' scale at bfloat16's resolution; a wrong file still fails."""
    from onnx_modular.check.verification import BFLOAT16_RESOLUTION

    torch.manual_seed(0)
    model = _Attention().eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
    model = model.to(torch.bfloat16)
    x = torch.randn(2, 7, 32).to(torch.bfloat16)
    result = export_modular(model, (x,), tmp_path / "attn.onnx")
    row = result.report.outputs[0]
    with torch.no_grad():
        scale = float(model.float()(x.float()).abs().max())
    model.to(torch.bfloat16)
    assert row.tolerance.atol == pytest.approx(BFLOAT16_RESOLUTION * scale, rel=1e-6) and row.tolerance.atol > 1e-2
    assert 1e-4 < row.modular_max_abs < row.tolerance.atol  # beyond float32's atol, within the file's resolution
    assert "the file's own constants are bfloat16" in result.report.note
    # A wrong weight still fails: the difference is of the outputs' own order.
    wrong = export_modular(model, (x,), verify=False)
    bf16 = [v for v in wrong.model.graph.initializers.values() if v.const_value is not None and v.const_value.dtype.name == "BFLOAT16"]
    weight = max(bf16, key=lambda v: v.const_value.size)  # the qkv weight
    import ml_dtypes
    import onnx_ir as ir

    weight.const_value = ir.tensor((weight.const_value.numpy().astype(np.float32) + 0.5).astype(ml_dtypes.bfloat16))
    wrong.save(tmp_path / "wrong.onnx")
    assert not wrong.verify().ok
