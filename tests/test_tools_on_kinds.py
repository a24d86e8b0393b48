"""Every file tool on models of kinds outside transformers: torchvision, timm, diffusers and
hand-written structures (`tests/kinds.py`), each through the catalogue sweep's own tools phase
(`tests/catalogue/tools_phase.py`: the package's public API per tool, with the sweep's pass criteria).

Each model is exported twice (ours, and torch's flat file that ``modularize`` reads), then
convert float16 and int8, split into 2 stages chained, modularize, diff against itself and profile
must all pass. Three kinds run by default; the rest are ``slow``.
"""

from __future__ import annotations

import pathlib
import warnings

import kinds
import numpy as np
import onnxruntime as ort
import pytest
import torch
from catalogue import tools_phase

from onnx_modular import export_modular

ROOT = pathlib.Path(__file__).resolve().parent.parent

DEFAULT = ("timm_convnext", "detection_head", "recurrent_tagger")
PARAMS = [pytest.param(name, marks=() if name in DEFAULT else pytest.mark.slow) for name in kinds.KINDS]


def _files(name: str, folder: pathlib.Path) -> tuple[torch.nn.Module, dict]:
    """The three files of a sweep row: ours, torch's flat file, the inputs."""
    model, inputs = kinds.build(name)
    _files_of(model, inputs, folder)
    return model, inputs


def _files_of(model: torch.nn.Module, inputs: dict, folder: pathlib.Path) -> None:
    result = export_modular(model, (), folder / tools_phase.MODULAR, kwargs=inputs)
    assert result.report.ok, result.report
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (), kwargs=inputs, dynamo=True, verbose=False).save(str(folder / tools_phase.FLAT))
    tools_phase.save_inputs(folder, inputs)


@pytest.mark.parametrize("name", PARAMS)
def test_every_tool_passes_on_the_kind(name, tmp_path):
    model, inputs = _files(name, tmp_path)
    # the file itself: onnxruntime against PyTorch (float32 tolerance of the exporter)
    with torch.no_grad():
        expected = model(**inputs)
    expected = expected if isinstance(expected, tuple) else (expected,)
    session = ort.InferenceSession(str(tmp_path / tools_phase.MODULAR), providers=["CPUExecutionProvider"])
    got = session.run(None, {k: v.numpy() for k, v in inputs.items()})
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e.numpy(), rtol=1e-3, atol=1e-4)
    statuses = {tool: tools_phase.run_tool(tool, str(tmp_path))["status"] for tool in tools_phase.TOOLS}
    failed = {tool: status for tool, status in statuses.items() if not tools_phase.passed(status)}
    assert not failed, failed


class _Zeros(torch.nn.Module):
    """An attention without its kernel (MRA's on CPU): a projection whose result is dropped for
    ``zeros_like``."""

    def __init__(self):
        super().__init__()
        self.query = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.zeros_like(self.query(x))


class _ZerosThenDense(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = _Zeros()
        self.dense = torch.nn.Linear(8, 8)
        self.mlp = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.mlp(x) + self.dense(self.attention(x))


def test_calls_whose_outputs_ignore_the_inputs_are_not_counted_against_modularize(tmp_path):
    # torch's optimizer folds `attention` (a constant) and `dense` (reading it) into one constant:
    # no node of theirs is in the flat file for modularize to recover or report
    model = _ZerosThenDense().eval()
    _files_of(model, {"x": torch.randn(2, 8)}, tmp_path)
    import onnx

    ours = tools_phase._computing_paths(onnx.load(str(tmp_path / tools_phase.MODULAR), load_external_data=False))
    assert ours == {"mlp"}
    assert tools_phase.passed(tools_phase.run_tool("modularize", str(tmp_path))["status"])


def test_split_over_the_test_data_limit_follows_its_advice(tmp_path, monkeypatch):
    # the values crossing the cut are over the limit: split refuses with test data and says
    # --no-data; the sweep's split does that and chains the stages against the whole file itself
    model = _ZerosThenDense().eval()
    _files_of(torch.nn.Sequential(model, torch.nn.Linear(8, 8)).eval(), {"input": torch.randn(2, 8)}, tmp_path)
    monkeypatch.setenv("ONNX_MODULAR_MAX_TEST_DATA_BYTES", "8")
    status = tools_phase.run_tool("split", str(tmp_path))["status"]
    assert tools_phase.passed(status) and "--no-data" in status, status
