"""Every call's outputs in bounded memory (onnx_modular.calls.capture.Instrumented): a budget small
enough to force several runs gives exactly the values of one run, alone and paired, and convert's
and diff's reports are the same whatever the budget; comparisons of large arrays in blocks equal
the whole-array ones."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from onnx_modular import convert, diff, export_modular
from onnx_modular.calls import capture
from onnx_modular.check import parity
from onnx_modular.files.convert import tool as convert_module
from onnx_modular.files.diff import numerics as diff_numerics


class _Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _Stack(torch.nn.Module):
    """Blocks in the main graph, a value (the scaled input) that every block reads, an output after them."""

    def __init__(self, width: int = 16, depth: int = 4):
        super().__init__()
        self.embed = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(_Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        skip = x * 0.5
        h = self.embed(x)
        for block in self.blocks:
            h = block(h) + skip
        return self.head(h).softmax(-1), h


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("batches")
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    export_modular(_Stack().eval(), (x,), folder / "stack.onnx")
    return folder / "stack.onnx", {"x": x.numpy()}


def _values(calls):
    return [(c.call_name, c.module_path, c.call_index, c.function, c.depth, c.outputs) for c in calls]


def _assert_same(got, expected):
    assert [g[:5] for g in got] == [e[:5] for e in expected]
    for g, e in zip(got, expected):
        assert len(g[5]) == len(e[5])
        for x, y in zip(g[5], e[5]):
            np.testing.assert_array_equal(x, y)


def test_a_tiny_budget_runs_several_segments_with_the_values_of_one_run(stack):
    path, feeds = stack
    model = onnx.load(path)
    outputs, whole = capture.call_outputs(model, feeds)
    assert len(whole) == 14  # embed, 4 x (up, down, block), head

    instrumented = capture.Instrumented(model, feeds)
    sizes = instrumented.call_bytes()
    assert sizes["blocks.0.up"] == 2 * 5 * 32 * 4  # float32 (2, 5, 32), from the declared shapes
    group = sizes["blocks.0.up"] + sizes["blocks.0.down"] + sizes["blocks.0"]
    batches = instrumented.batches(group)  # a block's three calls fit: one main-graph call's calls in one run
    assert [[c.call_name for c in batch] for batch in batches[1:4]] == [
        [f"blocks.{i}.up", f"blocks.{i}.down", f"blocks.{i}"] for i in (1, 2, 3)]
    assert len(batches) == 5 and [c.call_name for c in batches[0]] == ["embed", "blocks.0.up", "blocks.0.down", "blocks.0"]
    budget = group
    batched = list(capture.call_batches(instrumented, budget))
    _assert_same(_values(batched), _values(whole))
    assert instrumented.runs == 5  # one run per batch, each from where the last stopped
    assert instrumented._until == instrumented._main - 1  # the softmax after the head not run yet
    got = instrumented.model_outputs()
    assert list(got) == list(outputs) and instrumented.runs == 6
    for name in outputs:
        np.testing.assert_array_equal(got[name], outputs[name])


def test_a_main_graph_call_whose_calls_exceed_the_budget_is_cut(stack):
    # one call of the main graph holding every other (EfficientNet's encoder: 19 GB of outputs in one
    # run): its calls are cut into batches under the budget, each run making that call again
    path, feeds = stack
    model = onnx.load(path)
    _, whole = capture.call_outputs(model, feeds)
    instrumented = capture.Instrumented(model, feeds)
    sizes = instrumented.call_bytes()
    budget = sizes["blocks.0.up"] + sizes["blocks.0.down"]  # less than a block's three calls
    batches = instrumented.batches(budget)
    assert max(sum(sizes[c.call_name] for c in batch) for batch in batches) <= budget
    assert len([batch for batch in batches if any(c.call_name.startswith("blocks.0") for c in batch)]) == 2
    _assert_same(_values(list(capture.call_batches(instrumented, budget))), _values(whole))
    assert instrumented.runs == len(batches)


class _Wrapped(torch.nn.Module):
    """One call of the main graph holding every other (EfficientNet's ``encoder``)."""

    def __init__(self):
        super().__init__()
        self.encoder = _Stack()

    def forward(self, x):
        return self.encoder(x)


def test_a_main_graph_call_over_the_budget_is_opened_and_each_node_runs_once(stack, tmp_path):
    # EfficientNet's encoder held every block: each batch under the budget ran the whole network again
    # (22 runs of it for a diff); opened, a batch runs only the part of it that its calls need
    _, feeds = stack
    torch.manual_seed(0)
    export_modular(_Wrapped().eval(), (torch.from_numpy(feeds["x"]),), tmp_path / "wrapped.onnx")
    model = onnx.load(tmp_path / "wrapped.onnx")
    assert [n.op_type for n in model.graph.node] == ["_Stack"]
    outputs, whole = capture.call_outputs(model, feeds)
    instrumented = capture.Instrumented(model, feeds)
    sizes = instrumented.call_bytes()
    budget = sizes["encoder.blocks.0.up"] + sizes["encoder.blocks.0.down"] + sizes["encoder.blocks.0"]
    batches = instrumented.batches(budget)
    assert instrumented._main > 1 and "encoder.blocks.1" in {c.call_name for c in instrumented.calls}
    assert [[c.call_name for c in batch] for batch in batches[1:]] == [  # a block's calls in one run, as in the main graph
        [f"encoder.blocks.{i}.up", f"encoder.blocks.{i}.down", f"encoder.blocks.{i}"] for i in (1, 2, 3)] + [
        ["encoder.head", "encoder"]]
    _assert_same(_values(list(capture.call_batches(instrumented, budget))), _values(whole))
    assert instrumented.runs == len(batches) and instrumented.nodes_run <= instrumented._main  # each node once
    got = instrumented.model_outputs()
    for name in outputs:
        np.testing.assert_array_equal(got[name], outputs[name])
    unopened = capture.Instrumented(model, feeds)
    list(capture.call_batches(unopened, None))
    assert unopened._main == 1 and unopened.runs == 1  # no budget: nothing opened, one run


def test_paired_calls_under_a_budget_equal_one_run_of_each(stack):
    path, feeds = stack
    model = onnx.load(path)
    _, whole = capture.call_outputs(model, feeds)
    a, b = capture.Instrumented(model, feeds), capture.Instrumented(model, feeds)
    pairs = list(capture.paired_calls(a, b, budget=1, select=lambda x, _: x.call_name != "head"))
    assert a.runs == b.runs == 13  # every call its own run (a block's calls over the budget are cut); the head not asked for
    expected = [c for c in _values(whole) if c[0] != "head"]
    _assert_same(_values([x for x, _ in pairs]), expected)
    _assert_same(_values([y for _, y in pairs]), expected)


def test_convert_and_diff_reports_do_not_depend_on_the_budget(stack, tmp_path, monkeypatch):
    """float32 activations (int8 weights): the values are the same whatever the segments. (A float16
    file's are not bit for bit: onnxruntime removes Cast pairs within a run that a segment's edge
    keeps, one float16 step at a time.)"""
    path, feeds = stack
    reports = []
    for budget in (None, 1):
        monkeypatch.setattr(convert_module, "PROBE_BUDGET", budget)
        monkeypatch.setattr(diff_numerics, "PROBE_BUDGET", budget)
        conversion = convert(path, tmp_path / f"q-{budget}.onnx", quantize="int8", block_size=16, inputs=feeds)
        compared = diff(path, tmp_path / f"q-{budget}.onnx", inputs=feeds)
        reports.append((conversion.calls, conversion.outputs,
                        [(c.path, c.max_abs, c.max_rel, c.scaled_drift, c.order, c.first_drift) for c in compared.root.walk()]))
    assert reports[0] == reports[1]
    assert len(reports[0][0]) == 14 and max(c.max_abs for c in reports[0][0]) > 0  # int8 moved the calls a little


def test_differences_in_blocks_equal_the_whole_arrays(monkeypatch):
    rng = np.random.default_rng(0)
    expected = rng.normal(size=(7, 11, 13)).astype(np.float32)
    actual = expected + rng.normal(scale=1e-3, size=expected.shape).astype(np.float32)
    actual[3, 4, 5], expected[1, 2, 3], actual[1, 2, 3] = np.inf, np.nan, np.nan
    whole = parity.max_differences(actual, expected, rel_above=1e-4)
    close = parity.allclose(actual, expected, parity.Tolerance(1e-2, 1e-2))
    monkeypatch.setattr(parity, "BLOCK", 10)  # 101 blocks
    assert len(list(parity.blocks(actual, expected))) == 101
    assert parity.max_differences(actual, expected, rel_above=1e-4) == whole and whole[0] == np.inf
    assert parity.allclose(actual, expected, parity.Tolerance(1e-2, 1e-2)) == close is False
    actual[3, 4, 5] = expected[3, 4, 5]
    assert parity.allclose(actual, expected, parity.Tolerance(1e-2, 1e-2))
