"""A call given a body of its own (``convert --keep`` one call of a module called twice,
calls/targets.specialize) keeps the call names of the calls it makes: the body's nested call
nodes carry the indices of the call it now serves (``inner@2``), so the file has no duplicate call
names and ``diff`` pairs every call (no added / removed ones)."""

from __future__ import annotations

import models
import onnx
import pytest
import torch

from onnx_modular import export_modular
from onnx_modular.files.convert.tool import convert
from onnx_modular.files.diff.tool import diff
from onnx_modular.format import metadata


@pytest.fixture(scope="module")
def twice(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("twice") / "twice.onnx"
    export_modular(models.TwiceTwice().eval(), (torch.randn(2, 4),), path)
    return path


def _names(path) -> list[str]:
    return [call.call_name for call in metadata.expanded_calls(onnx.load(str(path)))]


def test_the_model_calls_each_module_more_than_once(twice):
    assert _names(twice) == [
        "block", "block.inner", "block.inner.linear", "block.inner@1", "block.inner.linear@1",
        "block@1", "block.inner@2", "block.inner.linear@2", "block.inner@3", "block.inner.linear@3",
    ]


@pytest.mark.parametrize("keep", ["block@1", "block", "block.inner@3", "block.inner@1", "block.inner.linear@2"])
def test_kept_call_keeps_the_names_below_it(twice, tmp_path, keep):
    out = tmp_path / "f16.onnx"
    report = convert(twice, out, dtype="float16", keep=[keep])
    assert report.split  # the kept call was given bodies of its own
    names = _names(out)
    assert names == _names(twice)  # same names, same order, none duplicated
    result = diff(twice, out)
    counts = result.counts()
    assert counts["added"] == 0 and counts["removed"] == 0, str(result)
    assert sum(counts.values()) == len(names)
