"""Rows of the transformers sweep where torch's own translation fails and export_modular goes past it:
a Python number first in an ATen op after decomposition (``1.0 - attention_mask`` on
an integer mask, XLNet and ProphetNet); a reshape to a shape with a size 0 (GLM-5's rotary part of
size 0), which ONNX ``Reshape`` reads as "copy this dimension". Parity (onnxruntime vs PyTorch) is asserted inside
export_modular at float32 atol 1e-4 / rtol 1e-3 and again here on other inputs."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from helpers import expanded_calls

from onnx_modular import export_modular
from onnx_modular.capture import torch_compat
from onnx_modular.capture.fx_fixes import empty_reshapes, scalars_to_tensors, squeeze_only_ones


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


class Keys(torch.nn.Module):
    """Keys of two heads from a projection split into a part without and a part with rotary, the
    rotary part of size ``rope`` (0 in GLM-5's ``k_rot.view(batch, 1, seq, qk_rope_head_dim)``)."""

    def __init__(self, rope: int = 0):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8 + rope)
        self.rope = rope

    def forward(self, x):
        b, s, _ = x.shape
        nope, rot = self.proj(x).split([8, self.rope], dim=-1)
        rot = rot.view(b, 1, s, self.rope).expand(-1, 2, -1, -1)
        return torch.cat([nope.view(b, 1, s, 8).expand(-1, 2, -1, -1), rot], dim=-1)


class EmptyRotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.keys = Keys()
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.keys(x))


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_reshape_to_a_size_0_loads_in_onnxruntime_with_parity(tmp_path, dynamic):
    """Unoptimized (the optimizer may fold an empty reshape, as it did not in GLM-5's attention),
    onnxruntime refused the file before the fix ("Invalid position of 0")."""
    model = EmptyRotary().eval()
    dynamic_shapes = {"x": {0: torch.export.Dim("batch", max=64)}} if dynamic else None
    result = export_modular(model, (torch.randn(2, 3, 8),), tmp_path / "m.onnx", optimize=False, dynamic_shapes=dynamic_shapes)
    assert result.report.ok, result.report
    calls = [(name, function) for name, function, _ in expanded_calls(result.model)]
    assert [name for name, _ in calls] == ["keys", "keys.proj", "out"]
    assert calls[0][1] == "Keys" and calls[1][1].startswith("Linear") and calls[2][1].startswith("Linear")
    x = torch.randn(3 if dynamic else 2, 3, 8)
    with torch.no_grad():
        expected = model(x).numpy()
    (got,) = _session(tmp_path / "m.onnx").run(None, {"x": x.numpy()})
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_empty_reshapes_rewrites_only_reshapes_to_a_size_0():
    model = Keys().eval()
    program = torch.export.export(model, (torch.randn(2, 3, 8),))
    graph_module = program.graph_module
    views = [n for n in graph_module.graph.nodes if n.target is torch.ops.aten.view.default]
    assert sorted(tuple(n.meta["val"].shape) for n in views) == [(2, 1, 3, 0), (2, 1, 3, 8)]
    for node in views:
        node.target = torch.ops.aten.reshape.default  # as relax_view_strides leaves them
    assert empty_reshapes(graph_module) == 1
    (full,) = [n for n in graph_module.graph.nodes if n.target is torch.ops.aten.full.default]
    assert full.args == ([2, 1, 3, 0], 0) and full.kwargs["dtype"] == torch.float32
    assert full.meta["val"].shape == (2, 1, 3, 0)
    reshapes = [n for n in graph_module.graph.nodes if n.target is torch.ops.aten.reshape.default]
    assert [tuple(n.meta["val"].shape) for n in reshapes] == [(2, 1, 3, 8)]
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), model(x))
    assert empty_reshapes(graph_module) == 0


@pytest.mark.slow
def test_glm5_next_with_a_size_0_rotary_part_exports_with_parity():
    """The sweep's Glm5NextTextModel (``qk_rope_head_dim`` 0 in its tiny config): our file failed to
    load in onnxruntime; parity is export_modular's own check. Minutes: slow."""
    from catalogue import building

    model, inputs, _, _ = building.build_with_tier("glm5_next", "Glm5NextTextModel")
    assert model.config.qk_rope_head_dim == 0
    result = export_modular(model, (), kwargs=inputs)
    assert result.report.ok, result.report
    calls = {name: function for name, function, _ in expanded_calls(result.model)}
    assert calls["layers.1.self_attn"].startswith("Glm5NextTextAttention")


class Joint(torch.nn.Module):
    """An RNNT joint's ``squeeze(2)`` over 4 symbols (Parakeet): a no-op in torch, an error in ONNX."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)  # (2, 3, 4, 8): dim 2 has size 4, dim 0 of y[:1] size 1
        return torch.ops.aten.squeeze.dims(y, [2]) + 1, torch.ops.aten.squeeze.dims(y[:1], [0, 2])


def test_squeeze_of_a_dimension_not_1_exports_with_parity(tmp_path):
    model = Joint().eval()
    x = torch.randn(2, 3, 4, 8)
    result = export_modular(model, (x,), tmp_path / "m.onnx")
    assert result.report.ok, result.report
    assert [name for name, _, _ in expanded_calls(result.model)] == ["lin"]
    with torch.no_grad():
        expected = [t.numpy() for t in model(x)]
    got = _session(tmp_path / "m.onnx").run(None, {"x": x.numpy()})
    assert [g.shape for g in got] == [(2, 3, 4, 8), (3, 4, 8)]
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_squeeze_only_ones_keeps_only_the_dimensions_of_size_1():
    model = Joint().eval()
    x = torch.randn(2, 3, 4, 8)
    graph_module = torch.export.export(model, (x,)).module()
    squeezes = [n for n in graph_module.graph.nodes if n.target is torch.ops.aten.squeeze.dims]
    assert [n.args[1] for n in squeezes] == [[2], [0, 2]]
    assert squeeze_only_ones(graph_module) == 2
    left = [n.args[1] for n in graph_module.graph.nodes if n.target is torch.ops.aten.squeeze.dims]
    assert left == [[0]]  # the first is a copy of its input, the second keeps dim 0
    assert sum(n.target is torch.ops.aten.clone.default for n in graph_module.graph.nodes) == 1
    with torch.no_grad():
        for got, want in zip(graph_module(x), model(x)):
            assert got.shape == want.shape and torch.equal(got, want)
