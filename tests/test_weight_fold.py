"""FoldWeightsPass end to end: what bodies compute from weights alone (Linear's Transpose,
LSTM's gate re-ordering) is stored folded across function calls, as onnxscript's folder stores
it in a flat graph; parity is asserted inside export_modular (onnxruntime vs torch, float32
atol 1e-4) and again here. Weights above onnxscript's input size limit (8192 elements) fold only
when nothing else reads them; smaller ones always fold, as in a flat graph."""

from __future__ import annotations

import helpers
import models
import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
import torch
from torch import nn

from onnx_modular import export_modular
from onnx_modular.format import metadata


def _bodies(result) -> dict[str, list[str]]:
    return {f.name: [node.op_type for node in f] for f in result.functions}


def test_linear_weights_are_stored_transposed(tmp_path):
    model, args, kwargs = models.llama(n_layer=2)
    result = export_modular(model, args, tmp_path / "llama.onnx", kwargs=kwargs)
    linears = {name: ops for name, ops in _bodies(result).items() if name.startswith("Linear")}
    assert linears and all(ops == ["MatMul"] for ops in linears.values()), linears
    for f in result.functions:
        if f.name.startswith("Linear"):
            assert [v.name for v in f.inputs] == ["input", "weight.T"]
    initializers = result.model.graph.initializers
    q = initializers["layers.0.self_attn.q_proj.weight.T"]
    assert list(q.shape) == list(model.layers[0].self_attn.q_proj.weight.shape[::-1])
    np.testing.assert_array_equal(q.const_value.numpy(), model.layers[0].self_attn.q_proj.weight.detach().numpy().T)
    assert "layers.0.self_attn.q_proj.weight" not in initializers
    assert result.report.ok

    # inlined back to flat: no Transpose of a weight is left for onnxruntime to do at load
    flat = onnx.inliner.inline_local_functions(onnx.load(tmp_path / "llama.onnx"))
    weights = {i.name for i in flat.graph.initializer}
    assert not [n for n in flat.graph.node if n.op_type == "Transpose" and n.input[0] in weights]


def test_tied_weights_are_left_alone(tmp_path):
    import transformers

    torch.manual_seed(0)
    # vocabulary 300 x 32 > INPUT_SIZE_LIMIT: a large tied weight (a small one folds, as flat)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=300, n_positions=32, use_cache=False)
    model = transformers.GPT2LMHeadModel(config).eval()
    result = export_modular(model, (torch.randint(0, 300, (2, 8)),), tmp_path / "gpt2.onnx")
    # lm_head.weight is wte.weight: Gather reads it untransposed, so the lm_head body transposes
    call = next(n for n in result.model.graph if n.metadata_props.get(metadata.MODULE_PATH) == "lm_head")
    lm_head = result.model.functions[call.op_identifier()]
    assert "Transpose" in [node.op_type for node in lm_head]
    names = set(result.model.graph.initializers)
    assert "lm_head.weight" in names and "lm_head.weight.T" not in names  # one tensor, both uses
    assert result.report.ok


class _TimesTransposed(nn.Module):
    def forward(self, x, w):
        return x @ w.t()


class _SharedBodyMixedArguments(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.a = _TimesTransposed()
        self.b = _TimesTransposed()

    def forward(self, x):
        return self.a(x, self.w) + self.b(x, x.t() @ x)  # one call gets a weight, one a computed value


def test_not_folded_when_a_call_passes_a_computed_value(tmp_path):
    model = _SharedBodyMixedArguments().eval()
    x = torch.randn(3, 4)
    path = tmp_path / "m.onnx"
    result = export_modular(model, (x,), path)
    bodies = _bodies(result)
    assert len([name for name in bodies if name.startswith("_TimesTransposed")]) == 1  # one shared body
    assert "Transpose" in bodies["_TimesTransposed"]
    assert "w" in result.model.graph.initializers
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"x": x.numpy()})
    np.testing.assert_allclose(out, model(x).detach().numpy(), atol=1e-5)


def test_optimize_false_keeps_transposes(tmp_path):
    model, args, kwargs = models.llama(n_layer=1)
    result = export_modular(model, args, tmp_path / "llama.onnx", kwargs=kwargs, optimize=False)
    assert any("Transpose" in ops for name, ops in _bodies(result).items() if name.startswith("Linear"))


_WIDTH = 96  # 96 x 96 weights: above INPUT_SIZE_LIMIT, so the ownership rules apply


class _Block(nn.Module):
    def __init__(self, width: int = _WIDTH):
        super().__init__()
        self.proj = nn.Linear(width, width, bias=False)

    def forward(self, x):
        return torch.tanh(self.proj(x))


class _SharedWeight(nn.Module):
    """Two blocks (one shared body) and a third Linear reading block a's weight."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _Block(), _Block()
        self.tied = nn.Linear(_WIDTH, _WIDTH, bias=False)
        self.tied.weight = self.a.proj.weight

    def forward(self, x):
        return self.tied(self.b(self.a(x)))


class _UntransposedUse(nn.Module):
    """Block a's weight is also used as it is (x @ W): it must stay untransposed."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _Block(), _Block()

    def forward(self, x):
        return self.b(self.a(x)) + x @ self.a.proj.weight


def test_weight_shared_by_calls_is_folded_once(tmp_path):
    model = _SharedWeight().eval()
    result = export_modular(model, (torch.randn(2, 3, _WIDTH),), tmp_path / "m.onnx")  # parity asserted inside
    names = set(result.model.graph.initializers)
    # torch keeps one name for the tied weight (a.proj.weight is tied.weight)
    assert len(names) == 2 and "b.proj.weight.T" in names and all(name.endswith(".T") for name in names)
    assert all("Transpose" not in ops for ops in _bodies(result).values())


def test_weight_also_used_untransposed_is_not_folded(tmp_path):
    model = _UntransposedUse().eval()
    result = export_modular(model, (torch.randn(2, 3, _WIDTH),), tmp_path / "m.onnx")  # parity asserted inside
    names = set(result.model.graph.initializers)
    assert "a.proj.weight" in names and "a.proj.weight.T" not in names
    # block b shares a's body, so b's weight cannot be folded either: one body, one layout
    assert "b.proj.weight" in names
    assert any("Transpose" in ops for ops in _bodies(result).values())


def test_recurrent_weights_are_folded_like_flat(tmp_path):
    """LSTM/GRU bodies re-order their weights' gates (Slice, Concat, Unsqueeze): folded at
    export, the bodies keep only the recurrent ops and the shape logic, and the file is
    within 1.1x torch's flat file in graph bytes (weights excluded)."""
    model, args, _ = models.recurrent()
    path = tmp_path / "modular.onnx"
    result = export_modular(model, args, path)  # parity asserted inside (float32: atol 1e-4)
    bodies = _bodies(result)
    assert {"LSTM", "GRU"} <= set(bodies)
    for name in ("LSTM", "GRU"):
        function = next(f for f in result.functions if f.name == name)
        weights = helpers.without_lifted_constants(function.inputs[1:])
        assert weights and all(v.name.endswith(".folded") for v in weights), [v.name for v in function.inputs]
        assert "Concat" not in bodies[name] or bodies[name].count("Concat") <= 2  # shape logic only
        weights = set(weights)
        assert not [n for n in function if n.op_type != name and any(v in weights for v in n.inputs)]
    # LSTM B = [b_ih, b_hh] for layer 0, folded from both biases
    bias = result.model.graph.initializers["lstm.bias_ih_l0+lstm.bias_hh_l0.folded"].const_value.numpy()
    expected = np.concatenate([model.lstm.bias_ih_l0.detach().numpy(), model.lstm.bias_hh_l0.detach().numpy()])
    assert bias.shape == (1, expected.size)
    np.testing.assert_array_equal(np.sort(bias.ravel()), np.sort(expected))  # gates re-ordered i,o,f,c
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"x": args[0].numpy()})
    np.testing.assert_allclose(out, model(*args).detach().numpy(), atol=1e-5)

    flat = tmp_path / "flat.onnx"
    torch.onnx.export(model, args, str(flat), dynamo=True, verbose=False)
    assert helpers.graph_bytes(path) <= 1.1 * helpers.graph_bytes(flat)


def test_recurrent_shape_logic_is_folded_like_flat(tmp_path):
    """A short sequence of few features: torch's LSTM/GRU translation reshapes each layer's
    output through Shape/Slice/Mul/Concat, which the flat optimizer folds from static shapes.
    Every call passes one static shape, so the bodies fold the same way: each keeps the ops the
    flat graph keeps (plus the batch-first Transposes the flat graph cancels across calls)."""
    torch.manual_seed(0)
    model, args = models.Recurrent(features=8, hidden=32).eval(), (torch.randn(2, 5, 8),)
    path = tmp_path / "modular.onnx"
    result = export_modular(model, args, path)  # parity asserted inside
    bodies = _bodies(result)
    assert bodies["LSTM"] == ["Transpose", "LSTM", "Transpose", "Reshape", "LSTM", "Transpose", "Reshape", "Transpose"]
    assert bodies["GRU"] == ["Transpose", "GRU", "Transpose", "Reshape", "Transpose"]
    flat = tmp_path / "flat.onnx"
    torch.onnx.export(model, args, str(flat), dynamo=True, verbose=False)
    flat_ops = [n.op_type for n in onnx.load(str(flat)).graph.node]
    assert sum(len(ops) for ops in bodies.values()) == len(flat_ops) + 2
    # 2.4x before the fold; what is left above the flat file is the hierarchy's metadata
    assert helpers.graph_bytes(path) <= 1.25 * helpers.graph_bytes(flat)


def test_scalar_computed_from_weights_is_folded_with_its_shape(tmp_path):
    # spectral norm's sigma = u . (W v) is a scalar computed from weights alone; it was folded
    # to shape (1,) and the save failed (issue 21, also DeBERTa-v2's relative attention)
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8)), nn.ReLU()).eval()
    x = torch.randn(2, 8)
    result = export_modular(model, (x,), tmp_path / "sn.onnx")
    assert result.report.ok
    folded = [i for i in onnx.load(tmp_path / "sn.onnx").graph.initializer if i.name.endswith(".folded")]
    assert [list(i.dims) for i in folded] == [[]]
    session = ort.InferenceSession(str(tmp_path / "sn.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"input": x.numpy()})[0], model(x).detach().numpy(), atol=1e-5)


def test_bodies_import_the_domains_of_folded_nodes_moved_into_them():
    # ZayaModel (transformers): the fold moves a weight-only Unsqueeze into a decoder layer's
    # body that otherwise only makes calls; that body must import the default domain, or
    # onnxruntime refuses the file ("No opset registered for domain '' in function ...")
    from catalogue import building

    model, inputs, _ = building.build("zaya", "ZayaModel")
    result = export_modular(model, (), kwargs=inputs)
    assert result.report.ok, str(result.report)  # onnxruntime loaded and ran both files
    moved = 0
    for function in result.model.functions.values():
        used = {node.domain for node in function}
        assert used <= set(function.opset_imports), (function.name, used, dict(function.opset_imports))
        moved += function.name.startswith("ZayaDecoderLayer") and "" in used
    assert moved  # the case of the bug is still there: a layer body with a moved default-domain op
