"""Sizes torch proved equal are one symbol and one node, so that equal layers share one function.

torch.export keeps a shared ``Dim`` apart when an earlier guard already implied the equality:
with a cache ``Dim("past")`` shared by every layer and a sample sequence longer than the past,
``Eq(seq + past_k, seq + past_v)`` is solved for ``seq`` (the largest hint), fails, and no
replacement is recorded, so each layer kept its own past-length symbol and read it from its
own input (capture/symbols.py). Plain torch, no transformers: the same happens to a Llama
checkpoint traced by transformers' exporter (tests/test_hf_command.py).

Numerics: onnxruntime against torch eager, float32, atol 1e-5 (measured ~1e-6), at the sample
sizes (export_modular's own check) and at sizes the export never saw.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers import expanded_calls, functions_by_name

from onnx_modular import export_modular
from onnx_modular.format import metadata

LAYERS = 3
ATOL = 1e-5
Dim = torch.export.Dim


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x, mask, k, v):
        k = torch.cat([k, self.proj(x)], dim=1)  # [n, past + seq, 4]
        v = torch.cat([v, x], dim=1)
        # reshapes that take the grown length as a size, as attention heads do
        kk = k.reshape(k.shape[0], k.shape[1], 2, 2).transpose(2, 3).reshape(k.shape[0], k.shape[1], 4)
        vv = v.reshape(v.shape[0], v.shape[1], 2, 2).transpose(2, 3).reshape(v.shape[0], v.shape[1], 4)
        scores = torch.softmax(torch.bmm(x, kk.transpose(1, 2)) + mask, dim=-1)
        return torch.bmm(scores, vv), k, v


class _Stack(torch.nn.Module):
    """A decoder in miniature: the parent sizes a mask ``[seq, past + seq]`` from one cache
    tensor (as a Llama model sizes its causal mask), each layer grows its own cache."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(LAYERS))

    def forward(self, x, cache):
        mask = torch.zeros(x.shape[1], cache[-1][0].shape[1] + x.shape[1])
        present = []
        for layer, (k, v) in zip(self.layers, cache):
            x, k, v = layer(x, mask, k, v)
            present.append((k, v))
        return x, present


def _inputs(batch: int, seq: int, past: int):
    generator = torch.Generator().manual_seed(seq * 10 + past)
    x = torch.randn(batch, seq, 4, generator=generator)
    cache = [tuple(torch.randn(batch, past, 4, generator=generator) for _ in range(2)) for _ in range(LAYERS)]
    return x, cache


def _dims(value) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


@pytest.fixture(scope="module")
def stacked(tmp_path_factory):
    torch.manual_seed(0)
    model = _Stack().eval()
    batch, seq, past = Dim("batch"), Dim("seq"), Dim("past")
    shapes = ({0: batch, 1: seq}, [({0: batch, 1: past}, {0: batch, 1: past})] * LAYERS)
    # The sequence (7) longer than the past (4): what made torch keep the past symbols apart.
    x, cache = _inputs(2, 7, 4)
    path = tmp_path_factory.mktemp("symbols") / "stack.onnx"
    result = export_modular(model, (x, cache), path, dynamic_shapes=shapes, rtol=0, atol=ATOL)
    return model, result, path


def test_torch_keeps_the_shared_dim_apart_without_the_fix(stacked):
    """The premise: torch's program itself has several symbols for the one ``past`` Dim. If a
    torch release stops doing so, this test says the workaround has nothing left to do."""
    model, _, _ = stacked
    x, cache = _inputs(2, 7, 4)
    batch, seq, past = Dim("batch"), Dim("seq"), Dim("past")
    shapes = ({0: batch, 1: seq}, [({0: batch, 1: past}, {0: batch, 1: past})] * LAYERS)
    program = torch.export.export(model, (x, cache), dynamic_shapes=shapes, strict=False)
    cache_inputs = program.graph_signature.user_inputs[1:]
    pasts = {str(node.meta["val"].shape[1]) for node in program.graph.find_nodes(op="placeholder") if node.name in cache_inputs}
    assert len(pasts) > 1, pasts


def test_layers_share_one_function_and_one_past_symbol(stacked):
    _, result, path = stacked
    assert result.report.ok and result.report.max_abs < ATOL
    functions = functions_by_name(result.model)
    layers = [name for name in functions if name.startswith("_Layer")]
    assert layers == ["_Layer"], layers  # one definition for the three layers
    assert int(functions["_Layer"].metadata_props[metadata.CALL_COUNT]) == LAYERS
    assert [name for _, name, _ in expanded_calls(result.model) if name == "_Layer"] == ["_Layer"] * LAYERS
    saved = onnx.load(str(path))
    inputs = {v.name: _dims(v) for v in saved.graph.input}
    assert {tuple(dims) for name, dims in inputs.items() if name != "x"} == {("batch", "past", 4)}
    # the past length is read once in the main graph, not once per layer
    assert sum(1 for node in saved.graph.node if node.op_type == "Shape") <= 3


def test_unseen_sizes_match_torch(stacked):
    """Prefill (past 0), a decode step, and a batch the export never saw."""
    model, _, path = stacked
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    for batch, seq, past in ((3, 5, 0), (1, 1, 9), (4, 2, 2)):
        x, cache = _inputs(batch, seq, past)
        feed = dict(zip(names, [t.numpy() for t in torch.utils._pytree.tree_leaves((x, cache))]))
        got = session.run(None, feed)
        with torch.no_grad():
            expected = [t.numpy() for t in torch.utils._pytree.tree_leaves(model(x, cache))]
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


def test_symbols_torch_did_not_prove_equal_stay_apart(tmp_path):
    """Two Dims the model never ties together keep their own names: nothing is merged on the
    strength of equal sample sizes alone."""

    class Two(torch.nn.Module):
        def forward(self, a, b):
            return torch.cat([a, a], dim=1).sum(1), torch.cat([b, b], dim=1).sum(1)

    a, b = torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    shapes = ({1: Dim("left")}, {1: Dim("right")})
    path = tmp_path / "two.onnx"
    result = export_modular(Two(), (a, b), path, dynamic_shapes=shapes)
    assert result.report.ok
    inputs = {v.name: _dims(v) for v in onnx.load(str(path)).graph.input}
    assert sorted(dims[1] for dims in inputs.values()) == ["left", "right"]
