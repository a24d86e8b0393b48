"""Rows of the transformers sweep where torch's own translation fails and export_modular goes past it
(issue 36): a Python number first in an ATen op after decomposition (``1.0 - attention_mask`` on
an integer mask, XLNet and ProphetNet). Parity (onnxruntime vs PyTorch) is asserted inside
export_modular at float32 atol 1e-4 / rtol 1e-3 and again here on other inputs."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from helpers import expanded_calls

from onnx_modular import export_modular
from onnx_modular.capture import torch_compat
from onnx_modular.capture.fx_fixes import scalars_to_tensors


class InvertedMask(torch.nn.Module):
    """``1.0 - mask`` on an integer mask, as XLNet and ProphetNet compute their padding mask."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x, mask):
        return self.proj(x) * (1.0 - mask)[..., None]


def _session(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_a_number_minus_an_integer_mask_exports_with_parity(tmp_path, dtype):
    model = InvertedMask().eval()
    x, mask = torch.randn(2, 3, 4), torch.tensor([[1, 1, 0], [1, 0, 0]]).to(dtype)
    batch = torch.export.Dim("batch", max=64)
    result = export_modular(model, (x, mask), tmp_path / "m.onnx", dynamic_shapes={"x": {0: batch}, "mask": {0: batch}})
    assert result.report.ok, result.report
    assert [(name, function) for name, function, _ in expanded_calls(result.model)] == [("proj", "Linear")]
    other_x, other_mask = torch.randn(3, 3, 4), torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]]).to(dtype)
    with torch.no_grad():
        expected = model(other_x, other_mask).numpy()
    (got,) = _session(tmp_path / "m.onnx").run(None, {"x": other_x.numpy(), "mask": other_mask.numpy()})
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_scalars_to_tensors_gives_the_number_the_dtype_it_promoted_to():
    """After torch's decomposition ``aten.rsub.Scalar`` is ``aten.sub.Tensor(1.0, mask)``; the
    number becomes a 0-d tensor of the result dtype, and only that operand is rewritten."""
    program = torch.export.export(InvertedMask().eval(), (torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.int64)))
    from torch.onnx._internal.exporter import _fx_passes

    graph_module = _fx_passes.decompose_with_registry(program, torch_compat.registry()).graph_module
    subs = [n for n in graph_module.graph.nodes if n.target is torch.ops.aten.sub.Tensor]
    assert [n.args[0] for n in subs] == [1.0]
    assert scalars_to_tensors(graph_module) == 1
    (scalar,) = [n for n in graph_module.graph.nodes if n.target is torch.ops.aten.scalar_tensor.default]
    assert subs[0].args[0] is scalar and scalar.args == (1.0,) and scalar.kwargs["dtype"] == torch.float32
    assert scalar.meta["val"].shape == () and scalar.meta["val"].dtype == torch.float32
    assert scalars_to_tensors(graph_module) == 0  # nothing left to rewrite


@pytest.fixture(scope="module")
def xlnet():
    transformers = pytest.importorskip("transformers")
    config = transformers.XLNetConfig(
        vocab_size=64, d_model=32, n_layer=2, n_head=2, d_inner=64, mem_len=None, attn_type="bi"
    )
    torch.manual_seed(0)
    return transformers.XLNetModel(config).eval()


def test_xlnet_exports_with_parity_on_a_padded_mask(xlnet, tmp_path):
    """XLNet's ``input_mask = 1.0 - attention_mask`` failed torch's type promotion
    ("Cannot find a compatible OpOverload for aten.sub"); torch.onnx.export fails there too."""
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.int64)
    result = export_modular(xlnet, (), tmp_path / "m.onnx", kwargs={"input_ids": ids, "attention_mask": mask})
    assert result.report.ok, result.report
    calls = [(name, function) for name, function, _ in expanded_calls(result.model)]
    assert ("layer.0", "XLNetLayer") in calls and ("layer.1", "XLNetLayer") in calls
    assert ("layer.0.rel_attn", "XLNetRelativeAttention") in calls
    padded = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    with torch.no_grad():
        expected = xlnet(input_ids=ids, attention_mask=padded).last_hidden_state.numpy()
    session = _session(tmp_path / "m.onnx")
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask"]
    got = session.run(None, {"input_ids": ids.numpy(), "attention_mask": padded.numpy()})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4)
