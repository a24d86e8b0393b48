"""A conversion that flips a selection: a two-stage head ranks near-tied proposals with ``TopK``
and gathers their boxes; int8 weights reorder the ties, every slot gets another box. convert
says so, names the call feeding the scores, and ``auto_keep`` (with ``quantize`` alone) leaves
that call unquantized so that the outputs pass. The same for selections inside module bodies,
each call's apart: a residual codebook quantizer whose every stage picks its nearest code with
its own codebook MatMul (DAC's, issue 51's sweep)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onnx_modular import convert, export_modular


class _Proposals(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(16, 16)
        self.score = torch.nn.Linear(16, 8)
        self.box = torch.nn.Linear(16, 4)
        self.anchors = torch.nn.Parameter(torch.randn(1, 24, 4))  # each proposal's own box

    def forward(self, x):
        h = self.encoder(x)
        scores = self.score(h).max(-1).values  # (batch, proposals)
        picked = scores.topk(scores.shape[-1]).indices  # every proposal, by score: the order is the selection
        boxes = (self.box(h) + self.anchors).sigmoid()
        return torch.gather(boxes, 1, picked[..., None].expand(-1, -1, 4))


@pytest.fixture(scope="module")
def proposals(tmp_path_factory):
    folder = tmp_path_factory.mktemp("selection")
    torch.manual_seed(0)
    base = torch.randn(1, 1, 16)
    x = base + 1e-3 * torch.randn(2, 24, 16)  # 24 proposals each, near ties (apart by more than float32 rounding)
    export_modular(_Proposals().eval(), (x,), folder / "proposals.onnx")
    return folder / "proposals.onnx", {"x": x.numpy()}


def test_a_flipped_selection_is_named_with_the_call_that_feeds_it(proposals, tmp_path):
    path, feeds = proposals
    report = convert(path, tmp_path / "q.onnx", quantize="int8", block_size=16, inputs=feeds)
    assert report.max_drift > 0.25  # whole boxes swapped
    assert [(s.op_type, s.same_members) for s in report.selections] == [("TopK", True)]
    selection = report.selections[0]
    assert 0 < selection.changed <= selection.total == 48
    assert selection.feeding[:2] == ["score", "encoder"]  # nearest first
    text = str(report)
    assert "selection flipped: TopK" in text and "its scores come from score, encoder" in text
    assert report.to_dict()["selections"][0]["feeding"][0] == "score"


def test_auto_keep_leaves_the_feeding_calls_unquantized(proposals, tmp_path):
    path, feeds = proposals
    report = convert(path, tmp_path / "q.onnx", quantize="int8", block_size=16, inputs=feeds, auto_keep=0.25)
    assert report.max_drift <= 0.25 and report.selections == []
    assert {name for name, _ in report.auto_kept} <= set(report.excluded)
    assert report.auto_kept[0][0] == "score" and "box" not in report.excluded
    assert any(call == "box" for call, _ in report.quantized)  # the rest is still quantized
    assert "auto-keep left unquantized score: it feeds the scores of a selection" in str(report)
    np.testing.assert_array_equal(report.flipped_before[0].feeding[:1], ["score"])


class _Ranked(_Proposals):
    def forward(self, x):  # the indices themselves are an output of the model
        scores = self.score(self.encoder(x)).max(-1).values
        return scores.topk(scores.shape[-1]).indices


def test_a_selection_whose_indices_are_a_model_output_is_named(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(1, 1, 16) + 1e-3 * torch.randn(2, 24, 16)  # near ties, apart by more than float32 rounding
    export_modular(_Ranked().eval(), (x,), tmp_path / "ranked.onnx")
    report = convert(tmp_path / "ranked.onnx", tmp_path / "q.onnx", quantize="int8", block_size=16, inputs={"x": x.numpy()})
    assert report.max_drift > 0.25
    assert [s.op_type for s in report.selections] == ["TopK"] and report.selections[0].feeding[:2] == ["score", "encoder"]


class _Codebook(torch.nn.Module):
    """One stage of a residual vector quantizer: the nearest code by a distance computed with its
    own codebook MatMul, as DAC's ``DacVectorQuantize`` does."""

    def __init__(self, codes: torch.Tensor):
        super().__init__()
        self.project = torch.nn.Linear(16, 16)
        self.codebook = torch.nn.Parameter(codes)

    def forward(self, x):
        z = self.project(x)
        distance = (z * z).sum(-1, keepdim=True) - 2 * z @ self.codebook.t() + (self.codebook * self.codebook).sum(-1)
        index = distance.argmin(-1)
        return z - self.codebook[index], index


class _Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        codes = torch.randn(1, 16) + 1e-3 * torch.randn(32, 16)  # 32 codes, near ties for any input
        self.stages = torch.nn.ModuleList([_Codebook(codes.clone()) for _ in range(2)])
        self.decode = torch.nn.Linear(16, 16)  # after the codes: quantized whatever they are

    def forward(self, x):
        picked = []
        for stage in self.stages:
            x, index = stage(x)
            picked.append(index)
        return self.decode(x), torch.stack(picked, -1)


def test_selections_inside_module_bodies_are_watched_per_call(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 24, 16)
    export_modular(_Residual().eval(), (x,), tmp_path / "codec.onnx")
    feeds = {"x": x.numpy()}
    report = convert(tmp_path / "codec.onnx", tmp_path / "q.onnx", quantize="int8", block_size=16, inputs=feeds)
    assert report.max_drift > 0.25  # other codes picked: the indices output moves by whole codes
    inner = [s for s in report.selections if s.node.startswith("stages.")]
    assert inner and {s.op_type for s in inner} == {"ArgMin"}
    first = min(inner, key=lambda s: s.node)
    # nearest first: the stage itself (its codebook MatMul computes the distances) and its projection
    assert first.node.startswith("stages.0/") and set(first.feeding[:2]) == {"stages.0.project", "stages.0"}
    kept = convert(tmp_path / "codec.onnx", tmp_path / "k.onnx", quantize="int8", block_size=16, inputs=feeds, auto_keep=0.25)
    assert kept.max_drift <= 0.25 and kept.selections == []
    assert kept.auto_kept[0][0] in ("stages.0.project", "stages.0")
    assert [call for call, _ in kept.quantized] == ["decode"]  # what no selection reads stays quantized


class _Cancelling(torch.nn.Module):
    """Two projections that nearly cancel (their difference is 1e-3 of either) beside a plain one:
    int8 weights move the difference by far more than its range; the plain one moves nothing."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(16, 16) for _ in range(3))
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight + 1e-3 * torch.randn(16, 16))
            self.b.bias.copy_(self.a.bias)

    def forward(self, x):
        return x + (self.a(x) - self.b(x)) + 1e-4 * self.c(x)


class _Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Cancelling() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x) - x  # the outputs are the differences alone
        return x


def test_auto_keep_with_quantize_alone_leaves_the_worst_roles_unquantized(tmp_path):
    # no selection: auto_keep ranks roles (a class's calls under one attribute, every block's),
    # each quantized alone, and leaves the worst unquantized first (VideoPrism's int8 was 0.256)
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    export_modular(_Blocks().eval(), (x,), tmp_path / "blocks.onnx")
    feeds = {"x": x.numpy()}
    plain = convert(tmp_path / "blocks.onnx", tmp_path / "q.onnx", quantize="int8", block_size=16, inputs=feeds)
    assert plain.max_drift > 0.25 and plain.selections == []
    kept = convert(tmp_path / "blocks.onnx", tmp_path / "k.onnx", quantize="int8", block_size=16, inputs=feeds, auto_keep=0.25)
    assert kept.max_drift <= 0.25
    roles = [name for name, _ in kept.auto_kept]
    assert set(roles) <= {"_Cancelling.a", "_Cancelling.b"} and roles  # the pair, never the plain projection
    assert "blocks.0.c" in {call for call, _ in kept.quantized}  # the shared body of every block's c
    assert not any(call.endswith(".c") for call in kept.excluded)
    assert set(kept.excluded) >= {f"blocks.{i}.{roles[0].split('.')[-1]}" for i in (0, 1)}  # a role: every block's call
    assert f"auto-keep left unquantized {roles[0]}: quantized alone, it moves the outputs by" in str(kept)
