"""Units of ``onnx_modular.capture`` without whole exports: the call tree from module stacks,
pytree names, module selection, stage errors and the capture strategies.

Models are a few ``nn.Linear``; the only torch.export runs are the strategies' own (a two-layer
model, well under a second each). Everything else is built by hand: module stacks as torch.export
records them (``{key: (module path, class)}``), exceptions raised inside a module's ``forward``.
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from onnx_modular.capture import diagnostics, pytree_io, selection, strategies
from onnx_modular.capture.fx_call_tree import build_call_tree, package_of
from onnx_modular.errors import (
    CaptureError,
    DecompositionError,
    InvalidInputError,
    ModularizeError,
    SaveError,
    TranslationError,
    VerificationError,
)

TORCH_VERSION = torch.__version__.split("+")[0]
LINEAR = "torch.nn.modules.linear.Linear"


class _Shared(torch.nn.Module):
    """``first``, then ``shared`` twice, then ``skip`` (an Identity: no op in a graph)."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.shared = torch.nn.Linear(4, 4)
        self.skip = torch.nn.Identity()

    def forward(self, x):
        return self.skip(self.shared(self.shared(self.first(x))))


def _stacks():
    """Module stacks of _Shared's ops in graph order, as torch.export records them."""
    root = {"L__self__": ("", _Shared)}
    return [
        {**root, "L__self___first": ("first", torch.nn.Linear)},
        {**root, "L__self___first": ("first", torch.nn.Linear)},  # a second op of the same call
        {**root, "L__self___shared": ("shared", torch.nn.Linear)},
        {**root, "_empty_nn_module_stack_from_metadata_hook": ("_empty", torch.nn.Module)},  # a hoisted size
        {**root, "L__self___shared@1": ("shared", torch.nn.Linear)},
    ]


# -- the call tree from module stacks ----------------------------------------------------------


def test_call_tree_from_stacks_keys_repeated_calls_apart():
    model = _Shared()
    tree, key_of_call = build_call_tree(_stacks(), model)
    calls = [(c.module_path, c.call_index, c.qualified_class, c.depth) for c in tree.walk() if not c.is_root]
    assert calls == [("first", 0, LINEAR, 1), ("shared", 0, LINEAR, 1), ("shared", 1, LINEAR, 1)]
    assert tree.root.qualified_class.endswith("test_capture_units._Shared")
    assert [c.call_name for c in tree.root.children] == ["first", "shared", "shared@1"]
    shared = tree.find("shared", 1)
    assert (shared.package, shared.version) == ("torch", TORCH_VERSION)
    assert shared.source and shared.source.rsplit(":", 1)[1].isdigit()  # file:line of the class
    # the n-th call of each instance -> its (module path, call index)
    assert key_of_call[(id(model.shared), 1)] == ("shared", 1)
    assert key_of_call[(id(model), 0)] == ("", 0)


def test_call_tree_nests_by_stack_order():
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    stack = {"L__self___0": ("0", torch.nn.Sequential), "L__self___0_0": ("0.0", torch.nn.Linear)}
    tree, _ = build_call_tree([stack], model)
    (outer,) = tree.root.children
    (inner,) = outer.children
    assert (outer.module_path, inner.module_path, inner.depth) == ("0", "0.0", 2)
    assert inner.parent is outer and tree.height == 2


def test_call_tree_adds_calls_known_only_from_the_eager_run():
    model = _Shared()
    eager = [
        (id(model.first), 0, "first", (id(model), 0)),
        (id(model.shared), 0, "shared", (id(model), 0)),
        (id(model.shared), 1, "shared", (id(model), 0)),
        (id(model.skip), 0, "skip", (id(model), 0)),  # nn.Identity: no op, no stack entry
    ]
    tree, key_of_call = build_call_tree(_stacks(), model, eager)
    skip = tree.find("skip")
    assert skip.parent is tree.root and skip.qualified_class == "torch.nn.modules.linear.Identity"
    assert skip.key.startswith("eager:")
    assert key_of_call[(id(model.skip), 0)] == ("skip", 0)
    assert [c.module_path for c in tree.root.children] == ["first", "shared", "shared", "skip"]


def test_call_tree_refuses_a_key_shared_by_two_paths():
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleDict({"x": torch.nn.Linear(2, 2), "x@1": torch.nn.Linear(2, 2)})
    stacks = [
        {"L__self___blocks_x@1": ("blocks.x", torch.nn.Linear)},  # the second call of blocks.x
        {"L__self___blocks_x@1": ("blocks.x@1", torch.nn.Linear)},  # the module named "x@1"
    ]
    with pytest.raises(ModularizeError, match="share torch.export's call key") as caught:
        build_call_tree(stacks, model)
    assert caught.value.module_path == "blocks.x@1"
    assert "Rename the submodule" in caught.value.hint


def test_package_of_names_the_distribution_and_local_code():
    assert package_of("torch.nn.modules.linear") == ("torch", TORCH_VERSION)
    assert package_of("__main__") == ("main", "local")  # underscores stripped, no distribution


# -- pytree names --------------------------------------------------------------------------------


class _Cache:
    """A plain object holding tensors (as transformers' caches do), registered as a pytree below."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values


torch.utils._pytree.register_pytree_node(
    _Cache,
    lambda c: ([c.keys, c.values], None),
    lambda children, _: _Cache(*children),
    serialized_type_name=f"{__name__}._Cache",
    flatten_with_keys_fn=lambda c: ([(torch.utils._pytree.SequenceKey(0), c.keys), (torch.utils._pytree.SequenceKey(1), c.values)], None),
)


def test_leaf_names_follow_containers_and_attributes():
    t = torch.zeros(1)
    named = [("x", t.clone()), ("pair", (t.clone(), [t.clone(), t.clone()])), ("d", {"a": t.clone()})]
    assert pytree_io.leaf_names(named) == ["x", "pair.0", "pair.1.0", "pair.1.1", "d.a"]
    cache = _Cache([t.clone(), t.clone()], [t.clone(), t.clone()])
    # attribute paths, not the flattened index (past.0.0, ...; pytree order: keys, then values)
    assert pytree_io.leaf_names([("past", cache)]) == ["past.keys.0", "past.keys.1", "past.values.0", "past.values.1"]


def test_input_and_output_leaf_names():
    class TwoInputs(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, extra=None):
            return input_ids

    t = torch.zeros(1)
    names = pytree_io.input_leaf_names(TwoInputs(), (t, t), {"extra": [t.clone(), t.clone()]})
    assert names == ["input_ids", "attention_mask", "extra.0", "extra.1"]
    assert pytree_io.output_leaf_names(t) == ["output"]
    assert pytree_io.output_leaf_names((t, t)) == ["output.0", "output.1"]
    assert pytree_io.output_leaf_names({"logits": t, "hidden": (t,)}) == ["logits", "hidden.0"]


def test_outputs_onnx_cannot_return_are_refused():
    with pytest.raises(InvalidInputError, match=r"type int at output\.1"):
        pytree_io.check_outputs((torch.zeros(1), 3))
    with pytest.raises(InvalidInputError, match="no tensor"):
        pytree_io.check_outputs((None,))
    pytree_io.check_outputs((torch.zeros(1), None))  # None inside a container is dropped by torch


def test_unflattenable_input_is_named():
    class Opaque:
        pass

    with pytest.raises(InvalidInputError, match=r"`kwargs\.state\.0`.*cannot flatten") as caught:
        pytree_io.register_input_types(torch.nn.Linear(1, 1), {"kwargs": {"state": [Opaque()]}})
    assert "register_pytree_node" in caught.value.hint


def test_one_axes_spec_spreads_over_a_cache():
    class WithCache(torch.nn.Module):
        def forward(self, x, past):
            return x

    t = torch.zeros(2, 3, 4)
    batch = Dim("batch")
    cache = [t, t, torch.zeros(2)]
    shapes = pytree_io.expand_dynamic_shapes(WithCache(), (t,), {"past": cache}, {"x": {0: batch}, "past": {2: batch}})
    assert shapes["x"] == {0: batch}
    assert shapes["past"] == [{2: batch}, {2: batch}, None]  # rank 1: the axis does not exist
    assert pytree_io.expand_dynamic_shapes(WithCache(), (t,), {"past": cache}, None) is None


# -- module selection ----------------------------------------------------------------------------


def test_selector_by_depth_class_and_predicate():
    model = _Shared()
    assert selection.selector("all", model)("anything", 9)
    by_depth = selection.selector(1, model)
    assert by_depth("first", 1) and not by_depth("a.b", 2)
    by_class = selection.selector({torch.nn.Identity}, model)
    assert by_class("skip", 1) and not by_class("first", 1) and not by_class("missing", 1)
    by_predicate = selection.selector(lambda path, module: path.startswith("sh"), model)
    assert by_predicate("shared", 1) and not by_predicate("first", 1)


@pytest.mark.parametrize(
    ("modules", "message"),
    [(True, "not a bool"), (-1, ">= 0"), (["Linear"], "nn.Module classes"), (3.5, "Unsupported value")],
)
def test_selector_refuses_bad_values(modules, message):
    with pytest.raises(InvalidInputError, match=message):
        selection.selector(modules, _Shared())


def test_selected_calls_marks_the_tree():
    model = _Shared()
    tree, _ = build_call_tree(_stacks(), model)
    keys = selection.selected_calls(tree, lambda path, depth: path == "shared")
    assert keys == {"L__self___shared", "L__self___shared@1"}
    assert [c.selected for c in tree.root.children] == [False, True, True]


# -- stage errors --------------------------------------------------------------------------------


class _Broken(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Sequential(_Raises())

    def forward(self, x):
        return self.inner(x)


class _Raises(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        raise RuntimeError("boom in forward\nsecond line")


def _raised(function, *args):
    try:
        function(*args)
    except Exception as error:
        return error
    raise AssertionError("nothing raised")


def test_stage_errors_are_typed_and_name_the_module():
    model = _Broken()
    error = _raised(model, torch.zeros(1))
    assert diagnostics.module_path_from_traceback(error, model) == "inner.0"
    run = diagnostics.stage_error("run", error, model)
    assert isinstance(run, CaptureError) and run.module_path == "inner.0" and "example inputs" in run.hint
    capture = diagnostics.stage_error("capture", error, model)
    assert isinstance(capture, CaptureError) and capture.attempts == []
    assert str(capture).splitlines()[0] == (
        "[capture] torch.export could not capture the model: RuntimeError: boom in forward"
    )
    assert isinstance(diagnostics.stage_error("save", error, model), SaveError)
    assert isinstance(diagnostics.stage_error("verify", error, model), VerificationError)
    assert isinstance(diagnostics.stage_error("optimize", error, model), ModularizeError)
    assert isinstance(diagnostics.stage_error("modularize", error, model), ModularizeError)


def test_stage_errors_of_translation_name_the_fx_node_module():
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    node.meta["nn_module_stack"] = {"L__self___a": ("a", torch.nn.Linear), "L__self___a_b": ("a.b", torch.nn.Linear)}

    def translate(node):  # the translator has the FX node in a local called "node"
        raise NotImplementedError("no translation for aten::frobnicate")

    error = _raised(translate, node)
    assert diagnostics.module_path_from_fx_node(error) == "a.b"
    translation = diagnostics.stage_error("translate", error, _Broken())
    assert isinstance(translation, TranslationError) and translation.module_path == "a.b"
    assert "aten::frobnicate" in str(translation)
    assert isinstance(diagnostics.stage_error("decompose", error, _Broken()), DecompositionError)


def test_save_errors_name_the_module_of_a_weight():
    error = ValueError("initializer inner.0.weight is too large")
    assert diagnostics.module_path_from_names(error, _Broken()) == "inner.0"
    assert diagnostics.stage_error("save", error, _Broken()).module_path == "inner.0"


def test_suggested_fixes_are_read_from_torch_message():
    message = (
        "Constraints violated (seq)!\n  - Not all values of seq ...\n"
        "Suggested fixes:\n  seq = Dim('seq', max=64)\n  batch = Dim('batch', min=2)\n\nThe error above occurred ..."
    )
    assert diagnostics.suggested_fixes(RuntimeError(message)) == (
        " torch suggests: seq = Dim('seq', max=64); batch = Dim('batch', min=2)"
    )
    assert diagnostics.suggested_fixes(RuntimeError("other")) == ""
    assert diagnostics.suggested_fixes(None) == ""


# -- capture strategies --------------------------------------------------------------------------


class _Fails(strategies.CaptureStrategy):
    def __init__(self, name, error):
        self.name, self.error, self.calls = name, error, 0

    def export(self, call, dynamic_shapes=None):
        self.calls += 1
        raise self.error


class _Records(strategies.CaptureStrategy):
    """Succeeds with a sentinel program and records the call it got."""

    name = "records"

    def __init__(self):
        self.seen = []

    def export(self, call, dynamic_shapes=None):
        self.seen.append(call)
        return "program"


class _TwoLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class _Positions(torch.nn.Module):
    """A table of 8 positions, as BERT's: a sequence axis without ``max`` is refused by torch.export."""

    def __init__(self):
        super().__init__()
        self.register_buffer("positions", torch.randn(1, 8, 4))

    def forward(self, x):
        return x + self.positions[:, : x.shape[1]]


def test_a_failing_strategy_falls_through_and_the_winner_is_recorded():
    failing, winning = _Fails("first", RuntimeError("no")), _Records()
    captured = strategies.capture(_TwoLinear(), (torch.zeros(2, 4),), None, None, strategies=[failing, winning])
    assert (captured.program, captured.strategy) == ("program", "records")
    assert [(a.name, a.ok) for a in captured.attempts] == [("first", False), ("records", True)]
    assert str(captured.attempts[0]) == "first: RuntimeError: no"
    assert winning.seen[0].args[0].shape == (2, 4) and winning.seen[0].kwargs == {}


def test_all_strategies_failing_give_one_capture_error_listing_each():
    first, second = ValueError("first reason\nmore"), RuntimeError("second reason")
    tried = [_Fails("one", first), _Fails("two", second)]
    with pytest.raises(CaptureError) as caught:
        strategies.capture(_TwoLinear(), (torch.zeros(2, 4),), None, None, strategies=tried)
    error = caught.value
    assert error.__cause__ is first  # the capture as asked: its traceback is the one to read
    assert [(name, exc) for name, exc in error.attempts] == [("one", first), ("two", second)]
    lines = str(error).splitlines()
    assert lines[0] == "[capture] torch.export could not capture the model: ValueError: first reason"
    assert lines[1] == "Capture strategies tried: one (ValueError: first reason); two (RuntimeError: second reason)"
    assert error.hint.startswith("Make the code traceable")


def test_later_strategies_run_only_where_they_can_help():
    # Not a constraint violation, not data-dependent, no suggested fixes: nothing else to try.
    plain = _Fails("plain", RuntimeError("unsupported op"))
    later = [plain, strategies.SizeOblivious(), strategies.SuggestedFixes(), strategies.DraftExport()]
    with pytest.raises(CaptureError) as caught:
        strategies.capture(_TwoLinear(), (torch.zeros(2, 4),), None, None, strategies=later)
    assert [name for name, _ in caught.value.attempts] == ["plain"]
    guard = RuntimeError("Could not guard on data-dependent expression Eq(u0, 1)")
    failed = [strategies.Attempt(plain, error=guard)]
    assert strategies.DraftExport().applies(failed) == hasattr(torch.export, "draft_export")
    assert not strategies.SizeOblivious().applies(failed)
    assert not strategies.SuggestedFixes().applies(failed)


def test_torch_export_wins_on_a_plain_model():
    model, x = _TwoLinear().eval(), torch.randn(3, 4)
    captured = strategies.capture(model, (x,), None, {"x": {0: Dim("batch")}})
    assert captured.strategy == "torch.export" and len(captured.attempts) == 1
    torch.testing.assert_close(captured.program.module()(x), model(x))
    assert strategies.strategies_for() == strategies.STRATEGIES
    assert [s.name for s in strategies.strategies_for(on_meta=True)][-2:] == ["meta:suggested-fixes", "meta:draft_export"]


def test_suggested_fixes_bound_an_axis_as_torch_onnx_export_does():
    """``Dim("seq")`` without ``max`` over a table of 8 positions: torch.export refuses it and
    suggests ``max=8``; the suggested-fixes strategy applies that (issue 37, BERT's case)."""
    model, x = _Positions().eval(), torch.randn(2, 5, 4)
    shapes = {"x": {0: Dim("batch"), 1: Dim("seq")}}
    captured = strategies.capture(model, (x,), None, shapes)
    assert captured.strategy == "suggested-fixes"
    names = [a.name for a in captured.attempts]
    assert names[0] == "torch.export" and names[-1] == "suggested-fixes"
    assert "Suggested fixes" in str(captured.attempts[0].error)
    assert captured.dynamic_shapes["x"][1].max == 8
    other = torch.randn(3, 7, 4)  # another batch and sequence length than the example's
    torch.testing.assert_close(captured.program.module()(other), model(other))


class _PositionsWithPast(torch.nn.Module):
    """A decoder's inputs in miniature: new tokens ``x`` over a table of 8 positions after a past, and
    a mask over both, whose width no ``Dim`` names (``Dim.DYNAMIC``, as a with-past mask's axis)."""

    def __init__(self, fixed: bool = False):
        super().__init__()
        self.register_buffer("positions", torch.randn(1, 8, 4))
        self.fixed = fixed

    def forward(self, x, past, mask):
        if self.fixed:  # a forward that specializes the new tokens' count (CPM-Ant's with a cache)
            x = x.reshape(x.shape[0], 3, 4)
        return x + self.positions[:, : x.shape[1]] + past.sum(1, keepdim=True) + mask.sum()


def _with_past_shapes():
    return {"x": {0: Dim("batch_size"), 1: Dim("sequence_length")}, "past": {0: Dim("batch_size"), 1: Dim("past_sequence_length")},
            "mask": {0: Dim("batch_size"), 1: Dim.DYNAMIC}}


def test_suggested_fixes_apply_beside_an_axis_named_by_no_dim():
    """torch's own refinement reads every leaf's name, which ``Dim.DYNAMIC`` has not (a with-past
    mask's ``past_sequence_length + sequence_length``): the fixes are applied around it, the hint kept
    (GPT-Neo's and XGLM's sequence and past bounded by their position tables)."""
    x, past, mask = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.ones(2, 8)
    model = _PositionsWithPast().eval()
    captured = strategies.capture(model, (x, past, mask), None, _with_past_shapes())
    assert captured.strategy == "suggested-fixes"
    assert captured.dynamic_shapes["x"][1].max == 8
    assert captured.dynamic_shapes["mask"][1] is Dim.DYNAMIC
    other = (torch.randn(3, 1, 4), torch.randn(3, 7, 4), torch.ones(3, 8))
    torch.testing.assert_close(captured.program.module()(*other), model(*other))


def test_suggested_fixes_never_make_a_decoders_sequence_a_constant():
    """A fix ``sequence_length = 3`` would give a with-past file that cannot decode one token a step: refused, saying so."""
    x, past, mask = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.ones(2, 8)
    with pytest.raises(CaptureError) as refused:
        strategies.capture(_PositionsWithPast(fixed=True).eval(), (x, past, mask), None, _with_past_shapes())
    assert "make sequence_length = 3 a constant" in str(refused.value)


def test_on_meta_runs_its_strategy_on_meta_inputs():
    inner = _Records()
    model = _TwoLinear()
    captured = strategies.capture(
        model, (torch.zeros(2, 4),), {"scale": torch.ones(1)}, None,
        strategies=[_Fails("cpu", RuntimeError("meta weights, cpu inputs")), strategies.OnMeta(inner)],
    )
    assert captured.strategy == "meta:records"
    (call,) = inner.seen
    assert call.args[0].device.type == "meta" and call.kwargs["scale"].device.type == "meta"
    # it sees the failures of meta attempts only: a meta size-oblivious waits for a meta violation
    violation = strategies.Attempt(strategies.TorchExport(), error=torch._dynamo.exc.UserError(
        torch._dynamo.exc.UserErrorType.CONSTRAINT_VIOLATION, "Constraints violated"))
    meta = strategies.OnMeta(strategies.SizeOblivious())
    assert strategies.SizeOblivious().applies([violation])
    assert not meta.applies([violation])
