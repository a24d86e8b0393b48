"""Bad input gets a typed error that names the stage and module, and never a partial file."""

from __future__ import annotations

import os

import models
import pytest
import torch
import torch.nn as nn

from onnx_modular import (
    CaptureError,
    InvalidInputError,
    ModularExport,
    OnnxModularError,
    ParityError,
    SaveError,
    TranslationError,
    export_modular,
)


class Wrap(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) + 1


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # torch.export cannot trace Python control flow on values
            return x * 2
        return x


class Unsupported(nn.Module):
    def forward(self, x):
        # no ONNX implementation in torch's registry, nor in onnx_modular's (capture/translations.py)
        return torch.searchsorted(torch.sort(x.flatten()).values, x)


class Random(nn.Module):
    def forward(self, x):
        return x + torch.rand_like(x)  # eager and onnxruntime draw different numbers


def test_not_a_module():
    with pytest.raises(InvalidInputError, match="needs a torch.nn.Module, got function"):
        export_modular(lambda x: x, (torch.randn(2),))


def test_args_do_not_match_forward():
    with pytest.raises(InvalidInputError, match=r"do not match Wrap.forward\(x\)") as info:
        export_modular(Wrap(nn.Identity()), (torch.randn(2), torch.randn(2)))
    assert info.value.module_path == ""
    assert "What to do:" in str(info.value)


def test_torch_export_rejection_names_the_module():
    with pytest.raises(CaptureError, match="torch.export could not capture") as info:
        export_modular(Wrap(DataDependent()), (torch.randn(3),))
    assert info.value.module_path == "inner"
    assert "Module: inner" in str(info.value)
    assert info.value.__cause__ is not None


def test_unsupported_op_names_the_module():
    with pytest.raises(TranslationError, match="aten.searchsorted") as info:
        export_modular(Wrap(Unsupported()), (torch.randn(4, 4),))
    assert info.value.module_path == "inner"
    assert info.value.stage == "translate"
    assert isinstance(info.value, OnnxModularError)


def test_missing_output_folder_fails_before_export(tmp_path):
    target = tmp_path / "missing" / "m.onnx"
    with pytest.raises(SaveError, match="does not exist"):
        export_modular(models.Scale().eval(), (torch.randn(2, 4),), target)
    assert not target.parent.exists()


def test_unwritable_folder(tmp_path):
    # /proc refuses new files even for root: a real read-only location.
    with pytest.raises(SaveError, match="Cannot write|not writable"):
        export_modular(models.Scale().eval(), (torch.randn(2, 4),), "/proc/m.onnx")


def test_failed_export_keeps_existing_file(tmp_path):
    target = tmp_path / "m.onnx"
    target.write_bytes(b"precious")
    with pytest.raises(ParityError) as info:
        export_modular(Wrap(Random()).eval(), (torch.randn(64, 64),), target)
    assert target.read_bytes() == b"precious"
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]  # no temporary files left behind
    error = info.value
    assert error.report is not None and not error.report.ok
    assert isinstance(error.result, ModularExport)
    # The unverified model can still be kept for debugging, on request.
    kept = error.result.save(tmp_path / "debug.onnx")
    assert kept.exists()


def test_failed_capture_writes_nothing(tmp_path):
    target = tmp_path / "m.onnx"
    with pytest.raises(CaptureError):
        export_modular(Wrap(DataDependent()), (torch.randn(3),), target)
    assert os.listdir(tmp_path) == []


def test_unsupported_opset_is_refused_before_export():
    with pytest.raises(InvalidInputError, match="opset_version=16 cannot be written: the possible opsets are 17 to"):
        export_modular(models.Scale().eval(), (torch.randn(2, 4),), opset_version=16)
    result = export_modular(models.Scale().eval(), (torch.randn(2, 4),), opset_version=18)
    assert result.model.opset_imports[""] == 18


def test_optimizer_keeps_each_layers_own_weights():
    """Equal-valued weights (fresh LayerNorms) must not be merged across layers."""
    model, args, _ = models.gpt2(n_layer=2)
    result = export_modular(model, args)
    second = next(node for node in result.model.graph if node.name == "h.1")
    names = [value.name for value in second.inputs]
    assert "h.1.ln_1.weight" in names and "h.0.ln_1.weight" not in names


def test_library_error_at_save_is_a_typed_error_naming_the_module(tmp_path, monkeypatch):
    # issue 21: onnx_ir.serde.SerdeError reached the user untyped. Here a weight fold computed
    # at save (a weight above the fold's eager size) cannot give the shape it was typed with: the
    # serializer raises inside onnx_ir, which must surface as SaveError naming the module.
    import onnx_ir
    import onnx_ir.serde

    from onnx_modular.passes.export import fold_weights

    infer = fold_weights._infer_shapes

    def wrong_transpose_shape(nodes, inputs, opset):
        infer(nodes, inputs, opset)
        for node in nodes:
            if node.op_type == "Transpose":
                node.outputs[0].shape = onnx_ir.Shape([1, 128 * 96])

    monkeypatch.setattr(fold_weights, "_infer_shapes", wrong_transpose_shape)
    model = Wrap(nn.Sequential(nn.Linear(96, 128), nn.ReLU())).eval()  # 12288 weights > INPUT_SIZE_LIMIT
    existing = tmp_path / "m.onnx"
    existing.write_bytes(b"keep")
    with pytest.raises(SaveError) as info:
        export_modular(model, (torch.randn(2, 3, 96),), existing)  # 3-D: MatMul(x, Transpose(w))
    assert isinstance(info.value.__cause__, onnx_ir.serde.SerdeError)
    assert info.value.module_path == "inner.0"
    assert "SerdeError" in str(info.value) and info.value.hint
    assert existing.read_bytes() == b"keep"
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]


def test_axis_torch_specialized_is_fixed_with_a_warning(tmp_path):
    # issue 21 (RWKV, Funnel, Mamba2, Zamba2 with Dim.AUTO): torch.export specializes an axis the
    # model only traces for; the file must fix it, not declare a symbol named "8"
    import numpy as np
    import onnxruntime as ort
    from torch.export import Dim

    from onnx_modular.passes.export.specialized_dims import SpecializedAxisWarning

    class FixedLength(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x.reshape(x.shape[0], 2, 4))

    torch.manual_seed(0)
    model = FixedLength().eval()
    with pytest.warns(SpecializedAxisWarning, match=r"Axis 1 of input 'x'.*specialized it to 8"):
        result = export_modular(model, (torch.randn(3, 8),), tmp_path / "m.onnx", dynamic_shapes={"x": {0: Dim.AUTO, 1: Dim.AUTO}})
    dims = list(result.model.graph.inputs[0].shape.dims)
    assert isinstance(dims[0], onnx_ir_symbolic()) and dims[1] == 8
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    x = torch.randn(5, 8)  # another batch size still runs
    np.testing.assert_allclose(session.run(None, {"x": x.numpy()})[0], model(x).detach().numpy(), atol=1e-5)
    with pytest.raises(Exception, match=r"(?i)invalid dimensions"):  # rejected at the input, not inside
        session.run(None, {"x": np.ones((3, 16), np.float32)})


def onnx_ir_symbolic():
    import onnx_ir

    return onnx_ir.SymbolicDim
