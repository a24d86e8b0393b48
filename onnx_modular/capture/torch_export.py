"""torch.export's internals that capturing needs, beside the ONNX exporter's (:mod:`torch_compat`).

Private or experimental torch API outside ``torch.onnx._internal``, which may change in any torch
release as that does: higher-order ops run eagerly for the reference run, the classification of
torch.export's failures (constraint violations, data-dependent guards) and torch's suggested fixes,
``backed_size_oblivious``, the fake-tensor constants that fix an input's values into the program
(:func:`fixed_values`), ``draft_export`` and its report, the partial graphs of failed captures kept
off stderr, and the shape environment (symbols torch proved equal). :mod:`torch_compat` keeps the
translator (registry, decomposition, translation); the two are the only homes of version-dependent
torch internals in the package.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import warnings
from typing import Any

import torch

__all__ = [
    "FIXED_VALUE_ELEMENTS",
    "constraint_violation",
    "data_dependent",
    "draft_export",
    "draft_export_assumptions",
    "eager_control_flow",
    "fixed_values",
    "partial_graphs_logged",
    "refined_dynamic_shapes",
    "replace_symbol",
    "shape_env_of",
    "size_oblivious",
    "symbolic_expr",
]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def eager_control_flow():
    """Run ``torch.cond``, ``while_loop``, ``scan``, ``map`` as plain Python in eager mode.

    In eager mode torch runs these higher-order ops through ``torch.compile(fullgraph=True)``
    (``_higher_order_ops.utils._hop_compile_and_call``), and dynamo refuses branches that
    mutate state outside them: the forward hooks that record module calls
    (``UncapturedHigherOrderOpError ... Unsafe side effect``). Whether it refuses depended on
    dynamo's state left by earlier compilations in the process (issue 21). Called directly,
    each op dispatches to its eager implementation (``cond``: the branch the predicate picks),
    which computes the same values without dynamo; ``torch.export`` is not affected (it runs
    outside this context and traces both branches).
    """
    try:
        from torch._higher_order_ops import utils as hop_utils
    except ImportError:  # a torch without higher-order ops in Python: nothing to change
        yield
        return
    original = getattr(hop_utils, "_hop_compile_and_call", None)
    if original is None:
        yield
        return

    def call_directly(fn, args, kwargs=None):
        return fn(*args, **(kwargs or {}))

    hop_utils._hop_compile_and_call = call_directly
    try:
        yield
    finally:
        hop_utils._hop_compile_and_call = original


def constraint_violation(error: BaseException | None) -> bool:
    """Whether ``error`` is torch.export's refusal of the given ``dynamic_shapes`` (a constraint
    violation, ``torch._dynamo.exc.UserError``), which other settings or torch's fixes may lift."""
    return isinstance(error, torch._dynamo.exc.UserError)


def size_oblivious():
    """Sizes 0 and 1 not specialized while capturing (``backed_size_oblivious``), as torch's own
    capture and decomposition run."""
    return torch.fx.experimental._config.patch(backed_size_oblivious=True)


# The most elements a value derived from fixed inputs may have and still be computed while capturing
# (fake tensors compute on constants of at most 1 element by default): a 1,024-pixel image's patch
# positions, several times over.
FIXED_VALUE_ELEMENTS = 1 << 20


@contextlib.contextmanager
def fixed_values(tensors):
    """While capturing, ``tensors`` (held by the program as constants) are values, not shapes: the
    ops on them, and on what they compute, run on real data, so ``.tolist()`` and sizes drawn from
    them are plain integers (an image grid's ``split`` sizes, ``repeat_interleave`` lengths) instead
    of data-dependent symbols. torch.export's fake tensors keep such a ``constant`` only for tensors
    created inside the forward and of one element; this widens both while the context is open."""
    from torch._subclasses import fake_tensor

    held = {id(t) for t in tensors}
    if not held:
        yield
        return
    converter = fake_tensor.FakeTensorConverter
    original = converter.from_real_tensor

    @functools.wraps(original)
    def from_real_tensor(self, fake_mode, t, make_constant=False, *args, **kwargs):
        return original(self, fake_mode, t, make_constant or id(t) in held, *args, **kwargs)

    mode = fake_tensor.FakeTensorMode
    dispatch = mode._dispatch_impl

    @functools.wraps(dispatch)
    def dispatch_with_factories(self, func, types, args, kwargs):
        out = dispatch(self, func, types, args, kwargs)
        real = _factory_value(func, args, kwargs, out)
        if real is not None:
            out.constant = real
            self.fake_tensor_converter.add_constant_storage_mapping(out)  # written to: no longer constant
        return out

    limit = fake_tensor.CONSTANT_NUMEL_LIMIT
    converter.from_real_tensor = from_real_tensor
    mode._dispatch_impl = dispatch_with_factories
    fake_tensor.CONSTANT_NUMEL_LIMIT = max(limit, FIXED_VALUE_ELEMENTS)
    # torch's fake-tensor dispatch cache (shared by every fake mode of the process) answers a
    # factory call seen before without a value: off while the capture computes on values.
    try:
        with torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
            yield
    finally:
        converter.from_real_tensor = original
        mode._dispatch_impl = dispatch
        fake_tensor.CONSTANT_NUMEL_LIMIT = limit


# Factories whose result is known from their arguments alone (not ``empty``: its values are not).
_FACTORIES = frozenset({"arange", "zeros", "ones", "full", "eye", "linspace", "scalar_tensor"})


def _factory_value(func, args, kwargs, out):
    """The real value of a factory call whose arguments are all plain numbers (``torch.arange(n)``
    with ``n`` from a fixed input), for :func:`fixed_values`; ``None`` for anything else. Fake
    tensors keep no constant for factories, so an index table built from a fixed image grid
    (Qwen2.5-VL's window index) would lose its values at its first ``arange``."""
    from torch._subclasses.fake_tensor import FakeTensor, no_dispatch

    if not (
        isinstance(out, FakeTensor)
        and out.constant is None
        and getattr(getattr(func, "overloadpacket", None), "__name__", None) in _FACTORIES
        and out.device.type == "cpu"
        and not any(isinstance(size, torch.SymInt) for size in out.shape)  # before numel: no guard on a symbol
        and out.numel() <= FIXED_VALUE_ELEMENTS
    ):
        return None
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    if any(isinstance(leaf, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)) for leaf in leaves):
        return None
    with no_dispatch():
        return func(*args, **kwargs)


def refined_dynamic_shapes(error: BaseException | None, dynamic_shapes):
    """``dynamic_shapes`` with torch's suggested fixes applied when ``error`` is torch.export's
    constraint violation (``Dim('seq', max=64)`` for BERT's position table, ``max=2046`` for the
    sequence and past of GPT-Neo's); ``None`` when it is another error or the fixes cannot be applied.

    Raises:
        ValueError: The fixes would make a decoder's sequence or past length a constant.
    """
    if not constraint_violation(error) or "Suggested fixes" not in str(error):
        return None
    # torch's refinement reads every leaf's name, which a hint has not (Dim.DYNAMIC for a with-past
    # mask's ``past_sequence_length + sequence_length``): each hint stands in as a Dim of its own,
    # which no fix names, and is put back after
    hints: dict[int, Any] = {}

    def stand_in(leaf):
        if type(leaf).__name__ == "_DimHint":
            dim = torch.export.Dim(f"_hint{len(hints)}")
            hints[id(dim)] = leaf
            return dim
        return leaf

    def put_back(leaf):
        return hints.get(id(leaf), leaf)

    is_leaf = _is_dim_leaf
    try:
        standing = torch.utils._pytree.tree_map(stand_in, dynamic_shapes, is_leaf=is_leaf)
        refined = torch.export.dynamic_shapes.refine_dynamic_shapes_from_suggested_fixes(error.msg, standing)
        refined = torch.utils._pytree.tree_map(put_back, refined, is_leaf=is_leaf)
    except Exception:
        return None
    fixed = _decoding_axis_fixed(dynamic_shapes, refined)
    if fixed:
        raise ValueError(f"torch's suggested fixes make {fixed} a constant: the model's forward specializes it, "
                         "and a decoder with its cache runs at every length (a prompt, then one token a step)")
    return refined


#: The axes a decoder with its cache runs at every length (a prefill of the prompt, then one token a
#: step): a fix that makes one of them a constant gives a file that cannot decode, so it is not taken.
_DECODING_AXES = ("sequence_length", "past_sequence_length")


def _decoding_axis_fixed(before, after) -> str | None:
    """The decoding axis (:data:`_DECODING_AXES`) declared in ``before`` that ``after`` makes a constant,
    in shapes with a past axis (CPM-Ant's forward specializes its new tokens' count), or None."""
    leaves = torch.utils._pytree.tree_leaves(before, is_leaf=_is_dim_leaf)
    fixed = torch.utils._pytree.tree_leaves(after, is_leaf=_is_dim_leaf)
    if len(leaves) != len(fixed) or not any(getattr(leaf, "__name__", None) == _DECODING_AXES[1] for leaf in leaves):
        return None
    return next((f"{old.__name__} = {new}" for old, new in zip(leaves, fixed)
                 if getattr(old, "__name__", None) in _DECODING_AXES and isinstance(new, int)), None)


#: torch.export's private ``Dim`` and hint classes (read once; a release without one of them leaves it out).
_DIM_CLASSES = tuple(c for c in (getattr(torch.export.dynamic_shapes, n, None) for n in ("_DimHint", "_Dim")) if isinstance(c, type))


def _is_dim_leaf(value) -> bool:
    """A leaf of a ``dynamic_shapes`` tree: a ``Dim``, a hint, an int or None (not a dict of axes)."""
    return value is None or isinstance(value, (int, *_DIM_CLASSES))


def data_dependent(error: BaseException | None) -> bool:
    """Whether ``error`` (or an exception it was raised from) is a guard on a data-dependent value
    (``GuardOnDataDependentSymNode: Eq(u0, 1)``)."""
    from torch.fx.experimental import symbolic_shapes

    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, symbolic_shapes.GuardOnDataDependentSymNode) or "data-dependent" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


class _WithoutPartialGraphs:
    """``sys.stderr`` without the partial FX graphs of failed captures (:func:`partial_graphs_logged`)."""

    def __init__(self, stream):
        self._stream = stream
        self._dropped_graph = False

    def write(self, text: str) -> int:
        error = sys.exc_info()[1]  # per thread: the error torch's wrapper is handling, if any
        graph = getattr(error, "partial_fx_graph", None)
        if graph is not None and text == str(graph):
            logger.debug("torch.export failed (%s); the graph captured so far:\n%s", type(error).__name__, text)
            self._dropped_graph = True
            return len(text)
        if self._dropped_graph and text == "\n":  # the end of print()'s line
            self._dropped_graph = False
            return len(text)
        self._dropped_graph = False
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def partial_graphs_logged():
    """Keep torch.export's partial FX graph of a failed capture off stderr, logged at DEBUG instead.

    ``torch.export``'s ``_log_export_wrapper`` prints ``error.partial_fx_graph`` to ``sys.stderr``
    on every data-dependent failure, once per nested wrapper: two copies of the whole graph traced
    so far, megabytes on a transformers model, for an attempt that a later strategy may well
    replace. Everything else written to stderr meanwhile goes through as it was."""
    stream = sys.stderr
    sys.stderr = wrapper = _WithoutPartialGraphs(stream)
    try:
        yield
    finally:
        if sys.stderr is wrapper:  # not if someone replaced it meanwhile (pytest's capture, another thread)
            sys.stderr = stream


#: Loggers that ``draft_export`` floods: its report, and the shape environment, which warns
#: "Unable to find user code corresponding to {u0}" followed by the whole FX graph so far, once
#: per data-dependent guard (megabytes on a transformers model).
_DRAFT_EXPORT_LOGGERS = ("torch.export._draft_export", "torch.fx.experimental.symbolic_shapes")


def draft_export(model, args, kwargs, **options) -> torch.export.ExportedProgram:
    """``torch.export.draft_export`` with its logs and warnings silenced: what it assumed is read
    from the program's report (:func:`draft_export_assumptions`), and its failures are raised."""
    loggers = [logging.getLogger(name) for name in _DRAFT_EXPORT_LOGGERS]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.export.draft_export(model, args, kwargs, **options)
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def draft_export_assumptions(program: torch.export.ExportedProgram) -> list[str]:
    """What a ``draft_export`` program assumed (first line of each failure of its report)."""
    report = getattr(program, "_report", None)
    failures = getattr(report, "failures", None) or []
    reasons = (str(getattr(failure, "reason", None) or failure).strip() for failure in failures)
    return sorted({reason.splitlines()[0][:200] for reason in reasons if reason})


def replace_symbol(program: torch.export.ExportedProgram, symbol, target, reason: str) -> bool:
    """Make the shape environment replace input ``symbol`` by ``target`` everywhere (as torch does
    when it meets an equality itself), and merge their range constraints; ``False`` when torch
    refuses (incompatible value ranges). Used by :func:`onnx_modular.capture.symbols.unify_equal_symbols`."""
    shape_env = shape_env_of(program)
    shape_env._set_replacement(symbol, target, reason)
    if shape_env.replace(symbol) != target:
        return False
    constraint = program.range_constraints.pop(symbol, None)
    if constraint is not None and target in program.range_constraints:
        program.range_constraints[target] = program.range_constraints[target] & constraint
    return True


def shape_env_of(program: torch.export.ExportedProgram):
    """The shape environment of the program's symbolic input sizes, ``None`` when all are static."""
    for node in program.graph.find_nodes(op="placeholder"):
        for size in getattr(node.meta.get("val"), "shape", ()):
            if isinstance(size, torch.SymInt):
                return size.node.shape_env
    return None


def symbolic_expr(value: object):
    """The sympy expression of a ``SymInt``/``SymFloat``/``SymBool`` (``s70 + s16``), with the
    shape environment's replacements applied; ``None`` for anything else."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value.node.expr
    return None
