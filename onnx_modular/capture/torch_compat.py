"""The only module that touches torch's private ONNX exporter API.

torch's public ``torch.onnx.export(dynamo=True)`` always inlines local
functions (its version converter runs an inline pass and ``optimize=True`` inlines
again), so onnx_modular drives the two private stages it needs directly:

* ``_core._prepare_exported_program_for_export`` (decompose), re-done step by step
  here so that :func:`onnx_modular.capture.fx_fixes.relax_view_strides` can run
  between the decomposition and the type-promotion interpreter;
* ``_core._exported_program_to_onnx_program`` (translate).

It also holds the few private hooks the capture strategies (:mod:`onnx_modular.capture.strategies`)
and the symbol sharing (:mod:`onnx_modular.capture.symbols`) need: constraint violations,
``backed_size_oblivious``, torch's suggested fixes, ``draft_export``'s report, the shape environment,
and the fake-tensor constants that fix an input's values into the program (:func:`fixed_values`).

Private API can change in any torch release: ``pyproject.toml`` admits torch
``>=2.13,<2.16`` (:data:`ADMITTED_TORCH_VERSIONS`), and where those releases differ this
module branches on :data:`TORCH_VERSION`. Each registry is built as ``torch.onnx.export``
builds it (``_compat.export_compat``): torchlib at the translation opset, then the
``custom_translation_table`` entries through ``ONNXRegistry.register_op``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import warnings
from collections.abc import Callable, Mapping

import onnx_ir as ir
import torch

__all__ = [
    "ADMITTED_TORCH_VERSIONS",
    "TESTED_TORCH_VERSIONS",
    "TORCH_VERSION",
    "check_torch_version",
    "constraint_violation",
    "data_dependent",
    "draft_export",
    "draft_export_assumptions",
    "export_dims",
    "decompose",
    "default_opset",
    "dynamic_axis_names",
    "eager_control_flow",
    "fx_node_of",
    "partial_graphs_logged",
    "refined_dynamic_shapes",
    "replace_symbol",
    "registry",
    "shape_env_of",
    "size_oblivious",
    "symbolic_expr",
    "torch_dtype_to_ir",
    "translate",
]

#: Releases the test suite ran against (``bash scripts/test-torch.sh <version>``).
TESTED_TORCH_VERSIONS = ("2.13.0", "2.15.0")
#: ``[low, high)`` as (major, minor), the range ``pyproject.toml`` admits.
ADMITTED_TORCH_VERSIONS = ((2, 13), (2, 16))


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


#: The installed torch as (major, minor): what the version branches below test.
TORCH_VERSION = _major_minor(torch.__version__)

logger = logging.getLogger(__name__)


def check_torch_version() -> None:
    """Warn if the installed torch is outside the admitted range (its private API may differ)."""
    low, high = ADMITTED_TORCH_VERSIONS
    if not low <= TORCH_VERSION < high:
        warnings.warn(
            f"onnx_modular supports torch >={low[0]}.{low[1]},<{high[0]}.{high[1]} "
            f"(tested: {', '.join(TESTED_TORCH_VERSIONS)}), found {torch.__version__}. "
            "It uses private torch.onnx internals that may have changed.",
            RuntimeWarning,
            stacklevel=3,
        )


def _exporter():
    from torch.onnx._internal.exporter import _core, _fx_passes, _registration

    return _core, _fx_passes, _registration


def registry(opset_version: int | None = None, custom_translation_table: Mapping[Callable, Callable] | None = None):
    """The registry ``torch.onnx.export`` would translate with, plus library translations.

    Built at ``max(opset_version, 18)``: torchlib picks, per op, the implementation for that
    opset (``Attention`` for SDPA at 23), and below 18 torch translates at 18 and converts
    (:class:`~onnx_modular.passes.opset_conversion.ConvertOpsetPass` does that per body). ``custom_translation_table`` entries
    are registered as ``torch.onnx.export`` registers them (they take precedence); ops
    that torch cannot translate but an imported library can (:func:`onnx_modular.capture.library_hooks.translations`;
    transformers' in :mod:`onnx_modular.hf.hooks`) are registered last, only where torch has none.
    """
    from onnx_modular.capture import library_hooks

    opset = max(opset_version or default_opset(), default_opset())
    libraries = tuple(library_hooks.translations().items())
    if not custom_translation_table:
        return _cached_registry(opset, libraries)
    reg = _new_registry(opset)
    for torch_op, onnx_op in custom_translation_table.items():
        if isinstance(onnx_op, (list, tuple)):  # as torch.onnx.export
            raise TypeError("The value in custom_translation_table should be a single callable, not a sequence")
        # register_op keys anything hashable: {1: 2} would be accepted and the export written without it.
        if not isinstance(torch_op, torch._ops.OpOverload | torch._ops.OpOverloadPacket) and not callable(torch_op):
            raise TypeError(f"the key {torch_op!r} is not a torch op (e.g. torch.ops.aten.add.Tensor)")
        if not callable(onnx_op):
            raise TypeError(f"the value for {torch_op!r} is {type(onnx_op).__name__}, not an onnxscript function")
        reg.register_op(torch_op, onnx_op, is_complex=False)
    _fill_gaps(reg, libraries)
    return reg


@functools.lru_cache(maxsize=8)
def _cached_registry(opset: int, libraries: tuple):
    """Cached (building takes ~0.3 s) and never mutated: a custom table gets a registry of its own."""
    reg = _new_registry(opset)
    _fill_gaps(reg, libraries)
    return reg


def _new_registry(opset: int):
    _, _, _registration = _exporter()
    # torchvision ops are registered only when torchvision imports; the warning is noise here.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    return _registration.ONNXRegistry.from_torchlib(opset_version=opset)


def _fill_gaps(reg, libraries: tuple) -> None:
    from onnx_modular.capture import translations

    for torch_op, onnx_op in libraries:
        if not reg.is_registered(torch_op):
            reg.register_op(torch_op, onnx_op, is_complex=False)
    for torch_op, onnx_op, is_complex in translations.translations():  # ops torchlib lacks
        if not any(decomp.is_complex == is_complex for decomp in reg.get_decomps(torch_op)):
            reg.register_op(torch_op, onnx_op, is_complex=is_complex)
    for torch_op, onnx_op in translations.refinements():  # torchlib's refuses some arguments
        reg.register_op(torch_op, onnx_op, is_complex=False)


def default_opset() -> int:
    """The opset torch's translator writes by default (torchlib's, 18)."""
    from torch.onnx._internal.exporter import _constants

    return _constants.TORCHLIB_OPSET


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
    constraint violation (``Dim('seq', max=64)`` for BERT's position table); ``None``
    when it is another error or the fixes cannot be applied."""
    if not constraint_violation(error) or "Suggested fixes" not in str(error):
        return None
    try:
        return torch.export.dynamic_shapes.refine_dynamic_shapes_from_suggested_fixes(error.msg, dynamic_shapes)
    except Exception:
        return None


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


def export_dims(dynamic_shapes):
    """``dynamic_shapes`` for ``torch.export``: axis names (strings) become ``Dim.DYNAMIC``, as in
    ``torch.onnx.export``; Dims, hints and the structure stay as given."""
    from torch.onnx._internal.exporter import _dynamic_shapes

    return _dynamic_shapes.convert_str_to_export_dim(dynamic_shapes)[0]


def decompose(program: torch.export.ExportedProgram, reg) -> torch.export.ExportedProgram:
    """torch's ONNX decompositions, with view strides relaxed before type promotion.

    Mirrors ``_core._prepare_exported_program_for_export``; see
    :mod:`onnx_modular.capture.fx_fixes` for why the extra step is needed. ``reg`` is a
    :func:`registry` (ops it translates, custom ones included, are not decomposed).
    """
    from onnx_modular.capture.fx_fixes import (
        attention_to_4d,
        empty_reshapes,
        relax_view_strides,
        scalars_to_tensors,
        squeeze_only_ones,
    )

    _, _fx_passes, _ = _exporter()
    with (
        size_oblivious(),  # as torch does
        _rnn_decompositions(program),
    ):
        program = _fx_passes.decompose_with_registry(program, reg)
        graph_module = program.graph_module
        relax_view_strides(graph_module)
        empty_reshapes(graph_module)
        attention_to_4d(graph_module)
        scalars_to_tensors(graph_module)
        squeeze_only_ones(graph_module)
        _fx_passes.insert_type_promotion_nodes(graph_module)
        graph_module = _fx_passes.remove_assertion_nodes(graph_module)
        program._graph_module = graph_module
    return program


def _rnn_decompositions(program: torch.export.ExportedProgram):
    """torch >= 2.15 decomposes LSTM/GRU into ``while_loop`` when shapes are dynamic, so that the
    sequence length is not specialized to the example's; 2.13 and 2.14 unroll the loop."""
    if TORCH_VERSION >= (2, 15):
        from torch.onnx._internal.exporter import _capture_strategies

        return _capture_strategies.patch_dynamic_shape_rnn_decompositions(program.range_constraints)
    return contextlib.nullcontext()


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


def translate(program: torch.export.ExportedProgram, reg) -> ir.Model:
    """FX -> ONNX IR with torch's translator. Every ONNX node keeps its FX node in ``meta``.

    The nodes are written at ``reg``'s opset; the default-domain import still says torchlib's
    (torch fixes it with a version converter that inlines): set it with
    :class:`~onnx_modular.passes.default_opset.SetDefaultOpsetPass`.
    """
    _core, _, _ = _exporter()
    onnx_program = _core._exported_program_to_onnx_program(program, registry=reg)
    return onnx_program.model


def torch_dtype_to_ir(dtype: torch.dtype) -> ir.DataType:
    """The translator's own dtype table, so that signatures match what it emits."""
    _core, _, _ = _exporter()
    return _core.torch_dtype_to_onnx_dtype(dtype)


def dynamic_axis_names(inputs: list[ir.Value], dynamic_shapes) -> dict[str, str]:
    """``{torch's symbol: the user's axis name}`` for the graph inputs (``s72`` -> ``batch``), for
    :class:`~onnx_modular.passes.dynamic_axes.RenameDynamicAxesPass`.

    torch renames only string axes; ``Dim`` objects carry a name too, and torch's own mapping
    function reads both.
    """
    if not dynamic_shapes:
        return {}
    from torch.onnx._internal.exporter import _dynamic_shapes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dict(_dynamic_shapes.create_rename_mapping(inputs, dynamic_shapes))


def fx_node_of(node: ir.Node) -> torch.fx.Node | None:
    """The FX node an ONNX node was translated from (set by torch's translator)."""
    return node.meta.get("node")
