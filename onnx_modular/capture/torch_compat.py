"""The only module that touches torch's private ONNX exporter API.

torch's public ``torch.onnx.export(dynamo=True)`` always inlines local
functions (its version converter runs an inline pass and ``optimize=True`` inlines
again), so onnx_modular drives the two private stages it needs directly:

* ``_core._prepare_exported_program_for_export`` (decompose), re-done step by step
  here so that :func:`onnx_modular.capture.fx_fixes.relax_view_strides` can run
  between the decomposition and the type-promotion interpreter;
* ``_core._exported_program_to_onnx_program`` (translate).

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
import warnings
from collections.abc import Callable, Mapping

import onnx_ir as ir
import torch

__all__ = [
    "ADMITTED_TORCH_VERSIONS",
    "TESTED_TORCH_VERSIONS",
    "TORCH_VERSION",
    "DataDependentCaptureWarning",
    "capture",
    "check_torch_version",
    "export_dims",
    "decompose",
    "default_opset",
    "dynamic_axis_names",
    "eager_control_flow",
    "fx_node_of",
    "library_translations",
    "module_stacks",
    "program_values",
    "refined_dynamic_shapes",
    "registry",
    "symbolic_expr",
    "torch_dtype_to_ir",
    "translate",
    "unify_equal_symbols",
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
    that torch cannot translate but an imported library can (:func:`library_translations`)
    are registered last, only where torch has no translation.
    """
    opset = max(opset_version or default_opset(), default_opset())
    libraries = tuple(library_translations().items())
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


def library_translations() -> dict[Callable, Callable]:
    """Translations that model libraries ship for their own custom ops, when already imported
    (:func:`onnx_modular.capture.library_hooks.translations`; transformers' in :mod:`onnx_modular.hf.hooks`)."""
    from onnx_modular.capture import library_hooks

    return library_hooks.translations()


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


class DataDependentCaptureWarning(UserWarning):
    """torch.export could not decide a branch on a tensor's value; the program assumes the
    example inputs' outcome there (``torch.export.draft_export``)."""


def _data_dependent(error: BaseException) -> bool:
    from torch.fx.experimental import symbolic_shapes

    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, symbolic_shapes.GuardOnDataDependentSymNode) or "data-dependent" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def capture(model: torch.nn.Module, args: tuple, kwargs: dict | None, dynamic_shapes) -> torch.export.ExportedProgram:
    """torch.export, non-strict; where that fails on a data-dependent guard, ``draft_export``.

    ``dynamic_shapes`` are taken as ``torch.onnx.export(dynamo=True)`` takes them (axis names as
    strings become ``Dim.DYNAMIC``); shapes torch.export rejects are retried as torch's own capture
    does (:func:`_export_non_strict`).

    torch's own exporter tries several strategies in turn (``_capture_strategies``: non-strict,
    strict, and ``draft_export`` behind a flag that is off by default). A data-dependent guard
    (``GuardOnDataDependentSymNode: Eq(u0, 1)``: Longformer's and EnCodec's padding sizes kept
    as tensors) fails non-strict and strict alike, because dynamo meets the same unbacked value;
    ``draft_export`` instead assumes, at each such guard, what the example inputs give and
    records it. That program is kept only when every data-dependent value it assumed comes from
    weights, buffers and constants alone (the same for every input, as a padding size kept in a
    buffer); a guard on values computed from the inputs (``if x.sum() > 0``) would make the file
    wrong for other inputs, so the original error is raised. The export warns with the guards
    assumed (:class:`DataDependentCaptureWarning`). Other failures are raised as they are
    (docs/design.md, "Capture strategies").
    """
    dynamic_shapes = export_dims(dynamic_shapes)
    try:
        return _export_non_strict(model, args, kwargs, dynamic_shapes)
    except Exception as first:
        if not _data_dependent(first) or not hasattr(torch.export, "draft_export"):
            raise
        try:
            with warnings.catch_warnings(), _quiet("torch.export._draft_export"):
                warnings.simplefilter("ignore")
                program = torch.export.draft_export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
        except Exception:
            raise first from None
        if _reads_user_inputs(program):  # a branch on input values: no single program is right
            raise
    report = getattr(program, "_report", None)
    failures = getattr(report, "failures", None) or []
    assumed = sorted({_first_line_of(getattr(f, "reason", None) or str(f)) for f in failures})
    warnings.warn(
        "torch.export could not trace a branch on tensor values (data-dependent guard); the program "
        "was captured with torch.export.draft_export, which assumes what the example inputs give there"
        + (": " + "; ".join(assumed[:4]) if assumed else "")
        + ". Inputs that take another branch may need another export.",
        DataDependentCaptureWarning,
        stacklevel=3,
    )
    return program


def _reads_user_inputs(program: torch.export.ExportedProgram) -> bool:
    """Whether a data-dependent value of the program (ops tagged ``data_dependent_output`` or
    ``dynamic_output_shape``: ``.item()``, ``nonzero``) is computed from a user input, not only
    from weights, buffers and constants. Only then can the assumed outcome differ between inputs."""
    data_dependent = {torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape}
    user_inputs = set(program.graph_signature.user_inputs)
    # where data-dependent values are born: ops tagged so (item, _local_scalar_dense, nonzero, ...)
    sources = [
        node
        for node in program.graph.nodes
        if node.op == "call_function" and data_dependent & set(getattr(node.target, "tags", ()))
    ]
    seen: set = set()
    stack = list(sources)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder" and node.name in user_inputs:
            return True
        stack.extend(node.all_input_nodes)
    return False


@contextlib.contextmanager
def _quiet(logger_name: str):
    """Silence a torch logger (draft_export logs its whole report as a warning)."""
    log = logging.getLogger(logger_name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _first_line_of(text: str) -> str:
    text = str(text).strip()
    return text.splitlines()[0][:200] if text else ""


def _export_non_strict(model, args, kwargs, dynamic_shapes) -> torch.export.ExportedProgram:
    """torch.export in non-strict mode. When it rejects the shapes (a constraint violation:
    ``Dim("seq")`` without the ``min`` the model needs), it captures again as torch's own capture
    strategy does (``_capture_strategies.TorchExportNonStrictStrategy``): sizes 0 and 1 not
    specialized (``backed_size_oblivious``), and torch's suggested fixes applied if it still
    refuses. A capture that works without that strategy is kept as it was (some bounded ``Dim``s
    only pass without it).
    """

    def export(shapes):
        return torch.export.export(model, args, kwargs, dynamic_shapes=shapes, strict=False)

    try:
        return export(dynamic_shapes)
    except torch._dynamo.exc.UserError as error:
        first = error
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        try:
            return export(dynamic_shapes)
        except torch._dynamo.exc.UserError as error:
            try:
                refined = torch.export.dynamic_shapes.refine_dynamic_shapes_from_suggested_fixes(error.msg, dynamic_shapes)
            except Exception:
                raise first from None
            try:
                return export(refined)
            except torch._dynamo.exc.UserError:
                raise first from None



def refined_dynamic_shapes(error: BaseException, dynamic_shapes):
    """``dynamic_shapes`` with torch's suggested fixes applied when ``error`` is torch.export's
    constraint violation (``Dim('sequence_length', max=64)`` for BERT's position table); ``None``
    when it is another error or the fixes cannot be applied."""
    if not isinstance(error, torch._dynamo.exc.UserError) or "Suggested fixes" not in str(error):
        return None
    try:
        return torch.export.dynamic_shapes.refine_dynamic_shapes_from_suggested_fixes(error.msg, dynamic_shapes)
    except Exception:
        return None


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
    from onnx_modular.capture.fx_fixes import relax_view_strides

    _, _fx_passes, _ = _exporter()
    with (
        torch.fx.experimental._config.patch(backed_size_oblivious=True),  # as torch does
        _rnn_decompositions(program),
    ):
        program = _fx_passes.decompose_with_registry(program, reg)
        graph_module = program.graph_module
        relax_view_strides(graph_module)
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


def unify_equal_symbols(program: torch.export.ExportedProgram) -> dict[str, str]:
    """Make input symbols that torch proved equal one symbol; returns ``{replaced: kept}``.

    torch.export gives every input axis its own symbol and merges two when it meets their
    equality (a ``Dim`` shared by several inputs, a ``cat`` of two tensors). When the equality
    was already implied by an earlier guard (``s70 + s81 == s70 + s85`` from a matmul), torch
    records the guard but no replacement, and the symbols stay apart: a Llama KV cache traced
    by transformers' exporter keeps one past-length symbol per layer although its ``Dim`` is
    shared, so each layer reads "its" length from another input and the layers stop looking
    alike. Every guard (and deferred runtime assert) that says ``k*a == k*b`` for two input
    symbols is read back, and the shape environment gets the replacement torch would have made:
    every fake value of the program then shows the kept symbol (the first in input order).
    Only equalities torch itself relies on are used, so the program means what it meant.
    """
    import sympy

    shape_env, inputs = None, []
    for node in program.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        for size in getattr(value, "shape", ()):
            if isinstance(size, torch.SymInt):
                shape_env = shape_env or size.node.shape_env
                inputs.extend(s for s in sorted(size.node.expr.free_symbols, key=str) if s not in inputs)
    if shape_env is None or len(inputs) < 2:
        return {}
    order = {symbol: i for i, symbol in enumerate(inputs)}
    facts = [guard.expr for guard in shape_env.guards]
    facts += [ra.expr for asserts in shape_env.deferred_runtime_asserts.values() for ra in asserts]
    # Each equality as "difference == 0", in the symbols torch kept, if it is linear in input symbols.
    differences = []
    for fact in facts:
        if isinstance(fact, sympy.Eq):
            difference = sympy.expand(shape_env.replace(fact.lhs - fact.rhs))
            terms = difference.as_coefficients_dict()
            if len(terms) >= 2 and all(term in order or term == 1 for term in terms):
                differences.append(difference)
    kept: dict = {}  # union-find over input symbols; the root is the first in input order

    def root(symbol):
        while symbol in kept:
            symbol = kept[symbol]
        return symbol

    merged = True
    while merged:  # k*a - k*b == 0 merges a and b; a merge may bring another difference to that form
        merged, remaining = False, []
        for difference in differences:
            if kept:
                difference = sympy.expand(difference.xreplace({s: root(s) for s in difference.free_symbols}))
            terms = difference.as_coefficients_dict()
            if len(terms) == 2 and 1 not in terms and sum(terms.values()) == 0:
                first, second = sorted(terms, key=order.__getitem__)
                kept[second], merged = first, True
            elif len(difference.free_symbols) > 1:
                remaining.append(difference)
        differences = remaining
    replaced = {}
    for symbol in inputs:
        target = root(symbol)
        if target == symbol:
            continue
        shape_env._set_replacement(symbol, target, "onnx_modular: proven equal to an input symbol")
        if shape_env.replace(symbol) != target:
            continue  # torch refused (incompatible value ranges): left as it is
        replaced[str(symbol)] = str(target)
        constraint = program.range_constraints.pop(symbol, None)
        if constraint is not None and target in program.range_constraints:
            program.range_constraints[target] = program.range_constraints[target] & constraint
    return replaced


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


def module_stacks(model: ir.Model) -> dict[ir.Node, tuple[str, ...]]:
    """Each main-graph node's module-call keys (its FX node's ``nn_module_stack``, outermost first),
    for :class:`~onnx_modular.passes.module_stacks.AnnotateStacksPass`."""
    stacks = {}
    for node in model.graph:
        fx_node = fx_node_of(node)
        stack = (fx_node.meta.get("nn_module_stack") or {}) if fx_node is not None else {}
        if stack:
            stacks[node] = tuple(stack)
    return stacks


def program_values(
    program: torch.export.ExportedProgram, args: tuple, kwargs: dict, loaders: dict | None = None
) -> dict[str, object]:
    """Run the (decomposed) program on real inputs; every FX node's result by node name.

    Uses the public ExportedProgram signature and ``torch.fx.Interpreter``. With
    ``loaders`` (state-dict name -> function returning the tensor), parameters are read
    when an op uses them and dropped after it, and only values that depend on the user
    inputs are recorded, so that weights are never all in memory at once.
    """
    from torch.export.graph_signature import InputKind

    leaves = iter(torch.utils._pytree.tree_leaves((tuple(args), dict(kwargs))))
    state = program.state_dict
    flat = []
    for spec in program.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            flat.append(next(leaves))
        elif loaders is not None and spec.target in loaders:
            flat.append(_Load(loaders[spec.target]))
        elif spec.target in state:
            flat.append(state[spec.target])
        else:
            flat.append(program.constants[spec.target])
    values: dict[str, object] = {}
    user_inputs = {
        node.name
        for node, spec in zip(program.graph.find_nodes(op="placeholder"), program.graph_signature.input_specs)
        if spec.kind == InputKind.USER_INPUT
    }
    depends: set[str] = set()

    class _Recorder(torch.fx.Interpreter):
        def fetch_args_kwargs_from_env(self, n):
            args_, kwargs_ = super().fetch_args_kwargs_from_env(n)
            if loaders is None:
                return args_, kwargs_
            return torch.utils._pytree.tree_map(lambda v: v() if isinstance(v, _Load) else v, (args_, kwargs_))

        def run_node(self, node):
            result = super().run_node(node)
            if loaders is not None:
                if node.name in user_inputs or any(i.name in depends for i in node.all_input_nodes):
                    depends.add(node.name)
                else:
                    return result  # a function of the weights alone: not recorded
            if isinstance(result, (tuple, list)):
                for i, item in enumerate(result):
                    values[f"{node.name}__{i}"] = item
            values[node.name] = result
            return result

    with torch.no_grad():
        _Recorder(program.graph_module).run(*flat)
    return values


class _Load:
    """A parameter read only when an op uses it (see :func:`program_values`)."""

    __slots__ = ("load",)

    def __init__(self, load):
        self.load = load

    def __call__(self):
        return self.load()


def fx_node_of(node: ir.Node) -> torch.fx.Node | None:
    """The FX node an ONNX node was translated from (set by torch's translator)."""
    return node.meta.get("node")
