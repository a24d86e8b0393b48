"""Where torch's own export stops and export_modular goes on (issue 21), each on a small model of
its class: complex values through shape ops (Llama-4-style rotary), a runtime check captured as
``aten._is_all_true`` (LLaVA's image-token count), and a data-dependent guard on a value of the
weights (a padding size kept as a tensor buffer, EnCodec-style), captured by
``torch.export.draft_export``; a guard on input values still fails the capture; BERT's sequence axis
without ``max`` takes torch's suggested bound (issue 37). Parity (onnxruntime
vs PyTorch, float32 atol 1e-4 / rtol 1e-3) is asserted inside export_modular and again here."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

from onnx_modular import export_modular
from onnx_modular.capture.strategies import DataDependentCaptureWarning


class ComplexRotary(nn.Module):
    """Rotary embedding on complex frequencies, as Llama 4 computes it."""

    def __init__(self, dim: int = 8, length: int = 6):
        super().__init__()
        angles = torch.outer(torch.arange(length, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles), persistent=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):  # x: [batch, heads, length, dim]
        pairs = torch.view_as_complex(self.proj(x).float().reshape(*x.shape[:-1], -1, 2))
        freqs = self.freqs.unsqueeze(0).unsqueeze(0).expand(x.shape[0], x.shape[1], -1, -1)
        return torch.view_as_real(pairs * freqs).flatten(3)


class CheckedTokens(nn.Module):
    """A runtime check on tensor values (torch._check_tensor_all, transformers' torch_compilable_check)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)

    def forward(self, ids):
        torch._check_tensor_all(ids < 10)
        return self.embed(ids)


class PaddedByBuffer(nn.Module):
    """A padding size kept as a tensor buffer, tested against 1 (EnCodec-style)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("padding", torch.tensor(2))
        self.conv = nn.Conv1d(2, 2, 3)

    def forward(self, x):
        padding = int(self.padding.item())
        if padding == 1:
            return self.conv(x)
        return self.conv(nn.functional.pad(x, (padding, padding)))


def _run(path, feeds):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_complex_rotary_unsqueeze_and_expand(tmp_path):
    torch.manual_seed(0)
    model, x = ComplexRotary().eval(), torch.randn(2, 3, 6, 8)
    with pytest.raises(Exception, match="complex"):  # torch's own export stops here
        torch.onnx.export(model, (x,), dynamo=True, verbose=False)
    result = export_modular(model, (x,), tmp_path / "m.onnx")
    assert result.report.ok and [f.name for f in result.functions] == ["Linear"]
    np.testing.assert_allclose(_run(tmp_path / "m.onnx", {"x": x.numpy()}), model(x).detach().numpy(), atol=1e-5)


def test_runtime_check_on_tensor_values(tmp_path):
    torch.manual_seed(0)
    model, ids = CheckedTokens().eval(), torch.tensor([[1, 2, 3], [4, 5, 9]])
    with pytest.raises(Exception, match="_is_all_true"):
        torch.onnx.export(model, (ids,), dynamo=True, verbose=False)
    result = export_modular(model, (ids,), tmp_path / "m.onnx")
    assert result.report.ok and [f.name for f in result.functions] == ["Embedding"]


def test_data_dependent_guard_is_captured_by_draft_export(tmp_path):
    torch.manual_seed(0)
    model, x = PaddedByBuffer().eval(), torch.randn(2, 2, 5)
    with pytest.raises(Exception, match=r"(?i)data-dependent"):
        torch.export.export(model, (x,), strict=False)
    with pytest.warns(DataDependentCaptureWarning, match="draft_export"):
        result = export_modular(model, (x,), tmp_path / "m.onnx")
    assert result.report.ok and [f.name for f in result.functions] == ["Conv1d"]
    assert result.capture_strategy == "draft_export"
    np.testing.assert_allclose(_run(tmp_path / "m.onnx", {"x": x.numpy()}), model(x).detach().numpy(), atol=1e-5)


class BranchOnInput(nn.Module):
    """A branch on a value of the input (Longformer's is_global_attn): no single graph is right."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, mask):
        if int(mask.any().item()) == 1:
            return self.proj(x)
        return x


def test_data_dependent_guard_on_inputs_still_fails_the_capture():
    from onnx_modular.errors import CaptureError

    model = BranchOnInput().eval()
    with pytest.raises(CaptureError, match=r"(?i)data-dependent") as caught:
        export_modular(model, (torch.randn(2, 4), torch.tensor([0, 1])))
    # draft_export was tried and refused (its program assumes a branch on the input's values)
    assert [name for name, _ in caught.value.attempts] == ["torch.export", "draft_export"]
    assert "Capture strategies tried: torch.export" in str(caught.value)
    assert "computed from the inputs" in str(caught.value.attempts[1][1])


def test_bert_sequence_without_max_takes_torch_suggested_bound(tmp_path):
    """Issue 37, item 3: ``Dim("seq")`` without ``max`` on BERT, which ``torch.onnx.export(dynamo=True)``
    accepts; torch.export refuses it and suggests ``Dim('seq', max=64)`` (the position table), which
    the suggested-fixes strategy applies. The axes stay named and dynamic: checked at other sizes."""
    transformers = pytest.importorskip("transformers")
    from torch.export import Dim

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=40,
        max_position_embeddings=64,
    )
    model, ids = transformers.BertModel(config).eval(), torch.randint(0, 96, (2, 8))
    result = export_modular(model, (ids,), tmp_path / "bert.onnx", dynamic_shapes=({0: Dim("batch"), 1: Dim("seq")},))
    assert result.report.ok and result.capture_strategy == "suggested-fixes"
    assert {"BertEmbeddings", "BertLayer"} <= {f.name for f in result.functions}
    session = ort.InferenceSession(str(tmp_path / "bert.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == ["batch", "seq"]
    other = torch.randint(0, 96, (3, 13))
    (hidden, _) = session.run(None, {session.get_inputs()[0].name: other.numpy()})
    with torch.no_grad():
        expected = model(other).last_hidden_state
    np.testing.assert_allclose(hidden, expected.numpy(), atol=1e-4, rtol=1e-3)
