"""A conversion that flips a selection: a two-stage head ranks near-tied proposals with ``TopK``
and gathers their boxes; int8 weights reorder the ties, every slot gets another box. convert
says so, names the call feeding the scores, and ``auto_keep`` (with ``quantize`` alone) leaves
that call unquantized so that the outputs pass."""

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
    x = base + 1e-4 * torch.randn(2, 24, 16)  # 24 proposals each, near ties
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
    x = torch.randn(1, 1, 16) + 1e-4 * torch.randn(2, 24, 16)
    export_modular(_Ranked().eval(), (x,), tmp_path / "ranked.onnx")
    report = convert(tmp_path / "ranked.onnx", tmp_path / "q.onnx", quantize="int8", block_size=16, inputs={"x": x.numpy()})
    assert report.max_drift > 0.25
    assert [s.op_type for s in report.selections] == ["TopK"] and report.selections[0].feeding[:2] == ["score", "encoder"]
