"""A model that selects with ``torch.topk`` among exactly equal scores (a detection head on
untrained weights: every query's score is the bias): torch's CPU kernel returns the tied
elements in its own order, ONNX's TopK lowest index first, and the outputs differ by whole
units. The export is right; the ParityError says why (check/ties.py), and PyTorch with the ties
broken the ONNX way equals onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from onnx_modular import export_modular
from onnx_modular.check.ties import TieWatch
from onnx_modular.errors import ParityError
from onnx_modular.runtime import sessions as runtime


class Picker(nn.Module):
    """Scores every position, keeps the best ``k`` (RT-DETR's query selection), projects them."""

    def __init__(self, tied: bool, k: int = 16):
        super().__init__()
        self.k = k
        self.score = nn.Linear(8, 2)
        self.proj = nn.Linear(8, 8)
        if tied:  # untrained: the scores are the bias at every position
            nn.init.zeros_(self.score.weight)

    def forward(self, x):
        scores = self.score(x).max(-1).values
        _, index = torch.topk(scores, self.k, dim=1)
        picked = x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        return self.proj(picked)


def _inputs():
    return (torch.randn(2, 21, 8, generator=torch.Generator().manual_seed(0)),)


def _model(tied: bool) -> Picker:
    torch.manual_seed(0)
    return Picker(tied).eval()


def test_tie_watch_finds_the_tied_selection_only():
    (x,) = _inputs()
    with TieWatch() as watch, torch.no_grad():
        _model(True)(x)
    assert len(watch.ties) == 1 and (watch.ties[0].k, watch.ties[0].size) == (16, 21) and watch.ties[0].tied == 2 * 16
    with TieWatch() as watch, torch.no_grad():
        _model(False)(x)
    assert watch.ties == []


def test_distinct_scores_export_with_parity(tmp_path):
    result = export_modular(_model(False), _inputs(), tmp_path / "distinct.onnx")
    assert result.report.ok and result.report.ties is None


def test_tied_selection_error_names_the_tie_and_onnx_order_matches(tmp_path):
    model, inputs = _model(True), _inputs()
    path = tmp_path / "tied.onnx"
    with pytest.raises(ParityError) as caught:
        export_modular(model, inputs, path)
    report = caught.value.report
    assert report.ties and "torch.topk selects among exactly equal values (1 call(s): top 16 of 21" in report.ties
    assert report.to_dict()["ties"] == report.ties and report.ties in str(caught.value)
    assert "TieWatch(break_ties=True)" in caught.value.hint
    assert min(o.modular_max_abs for o in report.failures()) > 1e-2  # whole units off, not rounding
    # the same file, saved without the check: onnxruntime equals PyTorch with the ties broken lowest index first
    export_modular(model, inputs, path, verify=False)
    (actual,) = runtime.run(str(path), [inputs[0].numpy()], what="test")[1]
    with TieWatch(break_ties=True) as watch, torch.no_grad():
        expected = model(*inputs).numpy()
    assert len(watch.ties) == 1
    np.testing.assert_allclose(actual, expected, atol=1e-5, rtol=1e-4)
