"""Issue 7: minimal regressions for the bugs the fuzzer (tests/test_fuzz.py) found.

Each test is a hand-written reduction of a shrunk fuzz example (see docs/robustness.md).
All of these bugs are fixed; each test keeps its reduction so that they stay fixed. Bugs 1 and 2 were fixed in 201cd1e while the fuzzing ran; their tests stay as
regressions.
"""

from __future__ import annotations

import json

import onnx
import pytest
import torch
import torch.nn as nn
from helpers import (
    expanded_calls,
    functions_by_name,
    top_level_calls,
    without_lifted_constants,
)

from onnx_modular import export_modular
from onnx_modular.format import metadata


def export(model: nn.Module, *args: torch.Tensor, **options):
    torch.manual_seed(0)
    result = export_modular(model.eval(), args, **options)
    assert result.report.ok, str(result.report)
    return result


def outlined_calls(result) -> list[str]:
    return [call.call_name for call in result.hierarchy.walk() if call.function is not None]


# -- bug 1 (fixed in 201cd1e): the optimizer merged two calls of one function on one input ---


class SameCallTwice(nn.Module):
    """Shrunk from a fuzz example: ``linear(x)`` twice (plus unrelated calls)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x) + self.linear(x)


def test_two_calls_on_the_same_input_stay_two_call_nodes():
    # With dedupe both calls use one function on the same input: common-subexpression
    # elimination after outlining merged the two call nodes, while the hierarchy and the
    # function metadata still counted two calls.
    result = export(SameCallTwice(), torch.randn(2, 4))
    assert outlined_calls(result) == ["linear", "linear@1"]
    linear = functions_by_name(result.model)["Linear"]
    assert json.loads(linear.metadata_props[metadata.MODULE_PATHS]) == ["linear", "linear@1"]
    assert top_level_calls(result.model) == ["linear", "linear@1"]
    assert len(expanded_calls(result.model)) == len(outlined_calls(result))


# -- bug 2 (fixed in 201cd1e): equal-shaped inputs/outputs followed use order, not forward() --


class ComputesSecondFirst(nn.Module):
    """``forward(a, b)`` reads ``b`` first and computes its second output first."""

    def forward(self, a, b):
        second = b * 3
        first = a + 1
        return first, second


class CallsComputesSecondFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = ComputesSecondFirst()

    def forward(self, x, y):
        first, second = self.inner(x, y)
        return first - second


def test_formal_inputs_of_equal_shape_bind_their_forward_parameter():
    # Inputs of equal shape and dtype were matched to forward() parameters in order of first
    # use, so the formal 'a' received y.
    result = export(CallsComputesSecondFirst(), torch.randn(2, 4), torch.randn(2, 4))
    inner = functions_by_name(result.model)["ComputesSecondFirst"]
    call = next(node for node in result.model.graph if node.name == "inner")
    bound = {formal.name: actual.name for formal, actual in zip(inner.inputs, call.inputs)}
    assert {k: bound[k] for k in without_lifted_constants(bound)} == {"a": "x", "b": "y"}
    # Inside the body, 'a' feeds the Add (a + 1) and 'b' the Mul (b * 3).
    users = {value.name: sorted(use.node.op_type for use in value.uses()) for value in without_lifted_constants(inner.inputs)}
    assert users == {"a": ["Add"], "b": ["Mul"]}


def test_outputs_of_equal_shape_keep_the_return_order():
    # Outputs of equal shape and dtype kept the order they were computed in.
    result = export(CallsComputesSecondFirst(), torch.randn(2, 4), torch.randn(2, 4))
    inner = functions_by_name(result.model)["ComputesSecondFirst"]
    # forward() returns (a + 1, b * 3).
    assert [output.producer().op_type for output in inner.outputs] == ["Add", "Mul"]


# -- bug 3: an instance shared by two parents gets a phantom call and loses its signature ----


class Wrap(nn.Module):
    def __init__(self, shared: nn.Module):
        super().__init__()
        self.shared = shared

    def forward(self, x):
        return torch.tanh(self.shared(x))


class SharedByTwoParents(nn.Module):
    """One ``nn.Linear`` instance reachable as ``a.shared`` and as ``b.shared``."""

    def __init__(self):
        super().__init__()
        shared = nn.Linear(4, 4)
        self.a = Wrap(shared)
        self.b = Wrap(shared)

    def forward(self, x):
        return self.b(self.a(x))


class CalledThroughItsSecondName(nn.Module):
    """Shrunk from a fuzz example: one Linear under two attribute names, called by the second."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = self.first

    def forward(self, x):
        return self.second(x)




def test_instance_shared_by_two_parents_is_listed_once_per_call():
    result = export(SharedByTwoParents(), torch.randn(2, 4))
    assert [call.call_name for call in result.hierarchy.walk()][1:] == ["a", "a.shared", "b", "b.shared"]


def test_instance_called_through_its_second_name_is_one_call():
    result = export(CalledThroughItsSecondName(), torch.randn(2, 4))
    assert [call.call_name for call in result.hierarchy.walk()][1:] == ["second"]


def test_instance_shared_by_two_parents_keeps_forward_parameter_names():
    result = export(SharedByTwoParents(), torch.randn(2, 4), dedupe=False)
    linears = [f for f in result.functions if f.metadata_props[metadata.CLASS] == "torch.nn.modules.linear.Linear"]
    assert len(linears) == 2
    assert [f.inputs[0].name for f in linears] == ["input", "input"]


# -- bug 4: a model without ops has no default opset import ----------------------------------


class ReturnsItsInput(nn.Module):
    """Shrunk from a fuzz example: the root returns an input (its child's result is unused)."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(4, 4)

    def forward(self, x, y):
        _ = self.unused(x)
        return y


@pytest.mark.parametrize("optimize", [True, False])
def test_model_without_ops_keeps_the_default_opset_import(tmp_path, optimize):
    path = tmp_path / "model.onnx"
    result = export(ReturnsItsInput(), torch.randn(2, 4), torch.randn(2, 4), f=path, optimize=optimize)
    assert "" in result.model.opset_imports
    onnx.checker.check_model(str(path), full_check=True)
