"""Where torch's own export stops and export_modular goes on, each on a small model of
its class: complex values through shape ops (Llama-4-style rotary, its reshaped frequencies), a runtime check captured as
``aten._is_all_true`` (LLaVA's image-token count), and a data-dependent guard on a value of the
weights (a padding size kept as a tensor buffer, EnCodec-style), captured by
``torch.export.draft_export``; a guard on input values still fails the capture; BERT's sequence axis
without ``max`` takes torch's suggested bound; ops torchlib lacks or refuses
(``cummax``/``cummin``, ``histc`` over the data's range, ``erfinv``). Parity (onnxruntime
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


class ComplexReshapedFrequencies(ComplexRotary):
    """Complex frequencies reshaped for broadcasting (Llama 4's vision rotary; ``view`` becomes
    ``reshape`` under ``relax_view_strides``)."""

    def forward(self, x):
        pairs = torch.view_as_complex(self.proj(x).float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * self.freqs.reshape(1, 1, x.shape[2], -1)).flatten(3)


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


def test_complex_reshape(tmp_path):
    torch.manual_seed(0)
    model, x = ComplexReshapedFrequencies().eval(), torch.randn(2, 3, 6, 8)
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


def test_data_dependent_guard_on_inputs_still_fails_the_capture(capfd, caplog):
    import logging

    from onnx_modular.errors import CaptureError

    model = BranchOnInput().eval()
    with caplog.at_level(logging.DEBUG, logger="onnx_modular.capture.torch_export"):
        with pytest.raises(CaptureError, match=r"(?i)data-dependent") as caught:
            export_modular(model, (torch.randn(2, 4), torch.tensor([0, 1])))
    # torch.export prints the graph traced so far to stderr, twice, on this failure (a whole
    # transformers model's, in megabytes); it goes to the debug log, and stderr stays readable
    assert "def forward(" not in capfd.readouterr().err
    graphs = [r.getMessage() for r in caplog.records if "graph captured so far" in r.getMessage()]
    assert graphs and all("def forward(" in g and "aten.any" in g for g in graphs)
    # draft_export was tried and refused (its program assumes a branch on the input's values)
    assert [name for name, _ in caught.value.attempts] == ["torch.export", "draft_export"]
    assert "Capture strategies tried: torch.export" in str(caught.value)
    assert "computed from the inputs" in str(caught.value.attempts[1][1])


def test_bert_sequence_without_max_takes_torch_suggested_bound(tmp_path):
    """``Dim("seq")`` without ``max`` on BERT, which ``torch.onnx.export(dynamo=True)``
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


class ScansCountsQuantiles(nn.Module):
    """Grounding DINO's running max/min over token positions, a MoE router's ``histc`` over the
    data's range (``min == max == 0``), Gemma 3n's ``erfinv``, inside a Linear's module tree."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 3)

    def forward(self, x, ids, experts, p):
        y = self.proj(x)
        high, low = torch.cummax(ids, dim=1), torch.cummin(y, dim=-1)
        return high.values, high.indices, low.values, low.indices, torch.histc(experts, bins=4), torch.histc(experts, bins=3, min=0, max=3), torch.special.erfinv(p)


def test_scans_histograms_and_erfinv_torchlib_lacks(tmp_path):
    torch.manual_seed(0)
    model = ScansCountsQuantiles().eval()
    ids = torch.tensor([[0, 3, 3, 1, 5, 5, 2], [4, 1, 0, 4, 2, 6, 6]])  # ties: the last index, as torch
    experts = torch.tensor([0.0, 1, 1, 3, 3, 3, 2, 0])
    p = torch.tensor([-1.0, -0.999999, -0.9, -0.5, 0.0, 1e-6, 0.3, 0.95, 0.9999, 1.0])  # +-1: +-inf
    inputs = (torch.randn(2, 5, 3), ids, experts, p)
    with pytest.raises(Exception, match="cummax|histc|erf"):  # torch's own export stops here
        torch.onnx.export(model, inputs, dynamo=True, verbose=False)
    result = export_modular(model, inputs, tmp_path / "m.onnx")
    assert result.report.ok and [f.name for f in result.functions] == ["Linear"]
    names = [i.name for i in ort.InferenceSession(str(tmp_path / "m.onnx")).get_inputs()]
    got = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, dict(zip(names, [t.numpy() for t in inputs])))
    expected = model(*inputs)
    for g, e in zip(got[:6], expected[:6]):  # integer outputs exact, floats to float32 rounding
        np.testing.assert_allclose(g, e.detach().numpy(), atol=0 if e.dtype == torch.int64 else 1e-6, rtol=0)
    np.testing.assert_allclose(got[6], expected[6].numpy(), rtol=1e-6, atol=1e-6)  # float32 precision, infinities equal
    # constant data widens the range by one each way, as torch
    same = torch.full((5,), 2.0)
    again = export_modular(model, (inputs[0], ids, same, p), tmp_path / "c.onnx")
    assert again.report.ok
