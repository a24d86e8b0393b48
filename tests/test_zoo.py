"""The model zoo (tests/zoo.py) exported with parity. A representative subset runs by default; ``--runslow`` runs all.

Every model must export, pass parity (onnxruntime modular and flat vs torch, float32
defaults atol=1e-4 rtol=1e-3, asserted inside export_modular) and keep its hierarchy:
the repeated layer class is a function called once per layer, under the root. No function
signature holds a torch value name.
"""

from __future__ import annotations

import pytest
import torch
import zoo
from helpers import expanded_calls, torch_value_names_in_signatures

from onnx_modular import export_modular
from onnx_modular.format import metadata


def _params(dynamic: bool = False):
    for name, entry in zoo.ZOO.items():
        if dynamic and not entry.dynamic:
            continue
        marks = [] if entry.default else [pytest.mark.slow]
        yield pytest.param(name, marks=marks, id=name)


def _calls_of_class(result, class_name: str) -> int:
    return sum(
        int(f.metadata_props[metadata.CALL_COUNT])
        for f in result.functions
        if f.metadata_props[metadata.CLASS].rsplit(".", 1)[-1] == class_name
    )


@pytest.mark.parametrize("name", list(_params()))
def test_zoo_static(name, tmp_path):
    entry = zoo.ZOO[name]
    model, args, kwargs = zoo.build(name)
    result = export_modular(model, args, tmp_path / f"{name}.onnx", kwargs=kwargs)
    assert result.report.ok
    assert _calls_of_class(result, entry.layer_class) == entry.layer_calls
    assert len(expanded_calls(result.model)) == len([c for c in result.hierarchy.walk() if c.function])
    assert result.hierarchy.max_depth >= 3
    assert torch_value_names_in_signatures(result) == []  # formal names come from forward()


@pytest.mark.parametrize("name", list(_params(dynamic=True)))
def test_zoo_dynamic(name, tmp_path):
    entry = zoo.ZOO[name]
    model, args, kwargs = zoo.build(name)
    dims = ({0: torch.export.Dim("batch", max=16), 1: torch.export.Dim("seq", min=2, max=32)},)
    result = export_modular(model, args, tmp_path / f"{name}.onnx", kwargs=kwargs, dynamic_shapes=dims)
    assert _calls_of_class(result, entry.layer_class) == entry.layer_calls
    assert torch_value_names_in_signatures(result) == []  # symbolic sizes are size_0, ... too
    report = result.verify((torch.randint(0, 100, (3, 11)),), model=model)
    assert report.ok, str(report)
