"""``ModularExport`` is callable like torch's ``ONNXProgram``; execution providers; translations;
``--keep-on-mismatch``."""

from __future__ import annotations

import os
import textwrap

import onnxruntime as ort
import pytest
import torch
from onnxscript.onnx_opset import opset18 as op

from onnx_modular import ExecutionProviderError, export_modular
from onnx_modular.cli import main


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 5)

    def forward(self, x, scale):
        return torch.relu(self.linear(x)) * scale


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x, scale):
        return self.block(x, scale), x.sum(-1)


def _model():
    torch.manual_seed(0)
    return Model().eval()


def test_call_runs_onnxruntime_like_onnx_program():
    model = _model()
    x, scale = torch.randn(2, 4), torch.tensor(3.0)
    result = export_modular(model, (x,), kwargs={"scale": scale})
    other = torch.randn(2, 4)
    outputs = result(other, scale=torch.tensor(0.5))
    expected = model(other, torch.tensor(0.5))
    assert isinstance(outputs, list) and len(outputs) == 2 and all(isinstance(o, torch.Tensor) for o in outputs)
    torch.testing.assert_close(outputs[0], expected[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(outputs[1], expected[1], atol=1e-5, rtol=1e-4)
    # One session per provider, kept between calls; "cpu" and onnxruntime's own name are the same one.
    assert list(result._sessions) == ["CPUExecutionProvider"]
    result(other, scale=scale, execution_provider="CPUExecutionProvider")
    result(other, scale=scale, execution_provider="cpu")
    assert list(result._sessions) == ["CPUExecutionProvider"]


def test_unavailable_execution_provider_is_a_typed_error():
    model = _model()
    missing = next(p for p in ("CUDAExecutionProvider", "ROCMExecutionProvider", "DmlExecutionProvider")
                   if p not in ort.get_available_providers())
    result = export_modular(model, (torch.randn(2, 4),), kwargs={"scale": torch.tensor(1.0)}, verify=False)
    with pytest.raises(ExecutionProviderError, match="this build has: .*CPUExecutionProvider"):
        result(torch.randn(2, 4), scale=torch.tensor(1.0), execution_provider=missing)
    # Asked for the parity check, it fails before any export work.
    with pytest.raises(ExecutionProviderError):
        export_modular(model, (torch.randn(2, 4),), kwargs={"scale": torch.tensor(1.0)}, execution_provider=missing)
    report = result.verify(execution_provider="cpu")
    assert report.ok


def _relu_as_max(x):
    return op.Max(x, op.CastLike(op.Constant(value_float=0.0), x))


def test_custom_translation_table_replaces_torch_lowering():
    model = _model()
    args = (torch.randn(2, 4),)
    kwargs = {"scale": torch.tensor(2.0)}
    default = export_modular(model, args, kwargs=kwargs)
    custom = export_modular(model, args, kwargs=kwargs, custom_translation_table={torch.ops.aten.relu.default: _relu_as_max})

    def op_types(result):
        return {node.op_type for function in result.model.functions.values() for node in function}

    assert "Relu" in op_types(default) and "Max" not in op_types(default)
    assert "Max" in op_types(custom) and "Relu" not in op_types(custom)
    assert custom.report.ok
    assert [f.name for f in custom.functions] == [f.name for f in default.functions]


FACTORY = textwrap.dedent(
    """
    import torch

    class Noise(torch.nn.Module):
        def forward(self, x):
            return x + torch.rand_like(x)   # onnxruntime's random numbers are not torch's

    def noisy():
        return Noise().eval(), (torch.randn(8, 8),)
    """
)


def test_keep_on_mismatch_writes_the_file_and_exits_1(tmp_path, capsys):
    (tmp_path / "noisy_factory.py").write_text(FACTORY)
    factory = f"{tmp_path / 'noisy_factory.py'}:noisy"
    out = tmp_path / "m.onnx"
    assert main(["export", factory, "-o", str(out)]) == 1
    assert not out.exists()  # by default a mismatching export writes nothing
    capsys.readouterr()
    assert main(["export", factory, "-o", str(out), "--keep-on-mismatch"]) == 1
    captured = capsys.readouterr()
    assert "FAIL" in captured.out and "Kept" in captured.err
    assert out.exists() and sorted(os.listdir(tmp_path)) == ["m.onnx", "noisy_factory.py"]
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert session.run(None, {session.get_inputs()[0].name: torch.zeros(8, 8).numpy()})[0].shape == (8, 8)
