"""Structures at the edge of the export: NamedTuple inputs and outputs, a module whose name ends like
a call index, scaled-dot-product attention of rank other than 4; the transformers releases admitted
and the cache argument read from the forward signature."""

from __future__ import annotations

import typing

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from helpers import expanded_calls

from onnx_modular import export_modular
from onnx_modular.calls.tree import function_tree
from onnx_modular.format import metadata
from onnx_modular.storage.load import load_model_file


class Pair(typing.NamedTuple):
    hidden: torch.Tensor
    gate: torch.Tensor


class Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, pair: Pair) -> Pair:
        return Pair(self.proj(pair.hidden), torch.sigmoid(pair.gate))


class NamedTupleModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x, pair: Pair) -> Pair:
        out = self.inner(Pair(x + pair.hidden, pair.gate))
        return Pair(out.hidden * out.gate, out.gate)


def test_a_namedtuple_taken_and_returned_exports_with_field_names(tmp_path):
    """torch's pytree flattens every NamedTuple; torch.onnx.export exports it, and so do we."""
    model = NamedTupleModel().eval()
    x = torch.randn(2, 4)
    pair = Pair(torch.randn(2, 4), torch.randn(2, 4))
    result = export_modular(model, (x, pair), tmp_path / "m.onnx")
    assert result.report.ok
    assert [v.name for v in result.model.graph.inputs] == ["x", "pair.hidden", "pair.gate"]
    assert [v.name for v in result.model.graph.outputs] == ["hidden", "gate"]
    calls = [(name, function) for name, function, _ in expanded_calls(result.model)]
    assert calls == [("inner", "Inner"), ("inner.proj", "Linear")]
    with torch.no_grad():
        expected = model(x, pair)
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x.numpy(), "pair.hidden": pair.hidden.numpy(), "pair.gate": pair.gate.numpy()})
    np.testing.assert_allclose(got[0], expected.hidden.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], expected.gate.numpy(), rtol=1e-5, atol=1e-6)


def test_a_module_named_like_a_call_index_keeps_its_own_name_and_parameters(tmp_path):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.d = torch.nn.ModuleDict({"lin": torch.nn.Linear(4, 4), "lin@0": torch.nn.Linear(4, 3)})

        def forward(self, x):
            return self.d["lin@0"](self.d["lin"](x))

    result = export_modular(Model().eval(), (torch.randn(2, 4),), tmp_path / "m.onnx")
    assert result.report.ok
    tree = function_tree(load_model_file(tmp_path / "m.onnx"))
    calls = {c.call_name: c for c in tree.walk() if not c.is_root}
    assert set(calls) == {"d.lin", "d.lin@0@0"}
    assert calls["d.lin@0@0"].module_path == "d.lin@0" and calls["d.lin@0@0"].call_index == 0
    assert calls["d.lin@0@0"].parameters == 15 and calls["d.lin"].parameters == 20
    assert metadata.split_call_name(metadata.call_name("d.lin@0", 0)) == ("d.lin@0", 0)
    assert metadata.split_call_name(metadata.call_name("d.lin@0", 2)) == ("d.lin@0", 2)
    assert metadata.call_name("h.0", 0) == "h.0" and metadata.call_name("shared", 1) == "shared@1"


class WindowAttention(torch.nn.Module):
    """Attention over windows: q, k, v of shape (batch, windows, heads, tokens, head_dim)."""

    def __init__(self, mask: str | None = None, rank: int = 5):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)
        self.mask, self.rank = mask, rank

    def forward(self, x):
        b, w, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, w, n, 3, 2, 4).permute(3, 0, 1, 4, 2, 5)
        if self.rank == 3:  # (batch * windows * heads, tokens, head_dim)
            q, k, v = (t.reshape(b * w * 2, n, 4) for t in (q, k, v))
        mask = None
        if self.mask == "bool":
            mask = torch.ones(n, n, dtype=torch.bool).tril()
        elif self.mask == "float":
            mask = torch.arange(n, dtype=x.dtype)[None, :].expand(w, 1, n, n) * -0.1
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.mask == "causal")
        return o.reshape(b, w, 2, n, 4).transpose(2, 3).reshape(b, w, n, 8)


@pytest.mark.parametrize(
    "mask, rank, opset",
    [(None, 5, 18), ("bool", 5, 18), ("float", 5, 18), ("causal", 5, 18), (None, 3, 18), ("float", 5, 23)],
)
def test_attention_of_rank_other_than_4_exports_with_parity(tmp_path, mask, rank, opset):
    model = WindowAttention(mask, rank).eval()
    x = torch.randn(2, 3, 5, 8)
    batch = torch.export.Dim("batch", max=64)
    result = export_modular(model, (x,), tmp_path / "m.onnx", opset_version=opset, dynamic_shapes={"x": {0: batch}})
    assert result.report.ok, result.report
    ops = [node.op_type for node in result.model.graph] + [n.op_type for f in result.model.functions.values() for n in f]
    assert ("Attention" in ops) == (opset >= 23)
    other = torch.randn(3, 3, 5, 8)  # another batch size: the leading dims are restored, not fixed
    with torch.no_grad():
        expected = model(other).numpy()
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"x": other.numpy()})
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_only_tested_transformers_releases_are_admitted():
    from onnx_modular.errors import MissingDependencyError
    from onnx_modular.hf.versions import TESTED, check_transformers_version

    for release in TESTED:
        check_transformers_version(f"{release}.0")
        check_transformers_version(f"{release}.3+local")
    for version in ("5.22.0", "5.25.0", "6.0.0", "4.57.1"):
        with pytest.raises(MissingDependencyError, match=rf"tested with transformers .*this environment has {version}"):
            check_transformers_version(version)


def test_the_cache_argument_is_read_from_the_forward_signature():
    from onnx_modular.hf.versions import cache_argument, returned_cache

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs):
            return {"logits": input_ids, "cache": "new"}

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return {"logits": input_ids, "past_key_values": "old"}

    assert cache_argument(New()) == "cache" and cache_argument(Old()) == "past_key_values"
    assert returned_cache(New()(1)) == "new" and returned_cache(Old()(1)) == "old"
