"""``export_modular``: run the pipeline stages in order. No graph surgery happens here.

    nn.Module + example inputs
      capture      torch.export (non-strict)             -> ExportedProgram
      decompose    torch's ONNX decompositions            -> decomposed ExportedProgram
      translate    torch's FX -> ONNX translator          -> flat onnx_ir.Model
      modularize   OutlineModuleCallsPass (ours)          -> nested local functions
      dedupe       DeduplicateFunctionsPass (ours)        -> identical calls share a function
      name         NameFunctionsPass (ours)               -> names, doc strings, metadata
      cleanup      onnx_ir unused removal, opset imports  (optionally onnxscript optimizer, inline=False,
                   and FoldWeightTransposesPass: weights stored pre-transposed across calls)
      save         atomic write + onnx.checker(full_check=True)
      verify       onnxruntime(modular) vs onnxruntime(flat) vs torch eager
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import logging
import os
import pathlib
import tempfile
import time
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Union

import onnx
import onnx_ir as ir
import torch

from onnx_modular import _io, _torch_compat, model_io, streaming, verification
from onnx_modular.errors import (
    CaptureError,
    DecompositionError,
    InvalidInputError,
    ModularizeError,
    OnnxModularError,
    TranslationError,
)
from onnx_modular.hierarchy import CallTree, build_call_tree
from onnx_modular.passes import cleanup
from onnx_modular.passes.dedupe import DeduplicateFunctionsPass
from onnx_modular.passes.io_names import NameGraphInputsOutputsPass
from onnx_modular.passes.modularize import STACK_KEY, CallSignature, OutlineModuleCallsPass, TensorSpec
from onnx_modular.passes.naming import NameFunctionsPass
from onnx_modular.passes.weight_transposes import FoldWeightTransposesPass

__all__ = ["export_modular", "ModularExport", "ModuleSelector"]

logger = logging.getLogger(__name__)

#: Which module calls become functions: ``None``/``"all"``, a set of classes,
#: a maximum depth (1 = children of the root), or ``predicate(module_path, module)``.
ModuleSelector = Union[None, str, int, Iterable[type], Callable[[str, torch.nn.Module], bool]]

@dataclasses.dataclass
class ModularExport:
    """The result of :func:`export_modular`.

    Attributes:
        model: The modular ONNX model (``onnx_ir.Model``).
        hierarchy: The module-call tree; ``print(result.hierarchy)`` shows it.
        report: The parity report (``None`` when verification was off).
        timings: Seconds spent per stage.
        path: Where the model was written (``None`` if not saved yet).
    """

    model: ir.Model
    hierarchy: CallTree
    report: verification.ParityReport | None = None
    blocks: Any = None  # blockwise.BlockReport when verified block by block (weights=...)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    path: pathlib.Path | None = None
    exported_program: torch.export.ExportedProgram | None = dataclasses.field(default=None, repr=False)
    _reference: tuple[list[torch.Tensor], list[torch.Tensor]] | None = dataclasses.field(default=None, repr=False)
    _example: tuple[tuple, dict] | None = dataclasses.field(default=None, repr=False)

    @property
    def model_proto(self) -> onnx.ModelProto:
        """The model as an ``onnx.ModelProto`` (serialized on demand)."""
        return ir.serde.serialize_model(self.model)

    @property
    def functions(self) -> list[ir.Function]:
        """The module-call functions (torch's own helper functions excluded)."""
        return [f for f in self.model.functions.values() if "pkg.onnx_modular.class" in f.metadata_props]

    def save(self, path: str | os.PathLike, *, external_data: bool | None = None) -> pathlib.Path:
        """Write the model atomically (checked with onnx.checker, full_check=True)."""
        with _io.staged_save(self.model, path, external_data=external_data):
            pass
        self.path = pathlib.Path(path)
        return self.path

    def verify(
        self,
        args: tuple | None = None,
        kwargs: dict | None = None,
        *,
        model: torch.nn.Module | None = None,
        rtol: float | None = None,
        atol: float | None = None,
        flat: bool = True,
    ) -> verification.ParityReport:
        """Compare onnxruntime (modular and flat) with PyTorch on new inputs.

        With no arguments, re-checks the example inputs of the export. New inputs
        need the PyTorch ``model`` to compute the reference.
        """
        if args is None and kwargs is None:
            if self._reference is None:
                raise InvalidInputError("No reference outputs are stored; pass args and model.")
            inputs, expected = self._reference
        else:
            if model is None:
                raise InvalidInputError("Pass model=... to compute PyTorch outputs for new inputs.")
            args = args if isinstance(args, tuple) else (args,)
            inputs = verification.flatten_inputs(args, kwargs)
            expected = verification.torch_outputs(model, args, kwargs)
        tolerance = _tolerance(rtol, atol)
        with _model_file(self) as path:
            return verification.verify_file(path, inputs, expected, flat=flat, tolerance=tolerance)

    def localize(
        self,
        model: torch.nn.Module,
        args: tuple | None = None,
        kwargs: dict | None = None,
        *,
        rtol: float | None = None,
        atol: float | None = None,
    ):
        """Per-module parity: every module call's outputs, onnxruntime against ``model``.

        Returns a :class:`~onnx_modular.localization.LocalizationReport` whose
        ``first_failure`` names the first call (in completion order) beyond tolerance.
        Uses the example inputs of the export unless ``args``/``kwargs`` are given.
        """
        from onnx_modular.localization import localize

        if args is None and kwargs is None:
            args, kwargs = self._example or ((), {})
        args = args if isinstance(args, tuple) else (args,)
        with _model_file(self) as path:
            return localize(path, model, args, kwargs, tolerance=_tolerance(rtol, atol))

    def summary(self) -> str:
        functions = self.functions
        calls = sum(int(f.metadata_props.get("pkg.onnx_modular.call_count", "1")) for f in functions)
        lines = [
            f"{len(functions)} functions for {calls} module calls, max depth {self.hierarchy.max_depth}, "
            f"{sum(1 for _ in self.model.graph)} nodes in the main graph",
        ]
        if self.timings:
            lines.append("time: " + ", ".join(f"{stage} {seconds:.2f}s" for stage, seconds in self.timings.items()))
        return "\n".join(lines)


@contextlib.contextmanager
def _model_file(result: ModularExport) -> Iterator[pathlib.Path]:
    if result.path is not None and result.path.exists():
        yield result.path
        return
    with tempfile.TemporaryDirectory(prefix="onnx_modular-") as tmp:
        path = pathlib.Path(tmp) / "model.onnx"
        ir.save(result.model, path, external_data="model.onnx.data" if _io.wants_external_data(result.model, None) else None)
        yield path


def _tolerance(rtol: float | None, atol: float | None) -> verification.Tolerance | None:
    if rtol is None and atol is None:
        return None
    return verification.Tolerance(atol=atol if atol is not None else 1e-4, rtol=rtol if rtol is not None else 1e-3)


# -- inputs and eager reference ----------------------------------------------------


def _check_inputs(model: Any, args: Any, kwargs: dict | None) -> tuple[tuple, dict]:
    if isinstance(model, torch.export.ExportedProgram) or not isinstance(model, torch.nn.Module):
        raise InvalidInputError(
            f"export_modular needs a torch.nn.Module, got {type(model).__name__}.",
            hint="Pass the model object itself (not a function, ExportedProgram or ScriptModule).",
        )
    if not isinstance(args, tuple):
        args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
    kwargs = dict(kwargs or {})
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise InvalidInputError(
            f"The example inputs do not match {type(model).__name__}.forward{inspect.signature(model.forward)}: {e}",
            module_path="",
            hint="Pass args as a tuple of positional inputs and kwargs as a dict.",
        ) from None
    return args, kwargs


def _tensor_specs(prefix: str, value: Any) -> list[TensorSpec]:
    """Specs of the tensors in ``value``, each holding its tensor (dropped later unless needed)."""
    specs: list[TensorSpec] = []
    if isinstance(value, torch.Tensor):
        specs.append(TensorSpec(prefix, _torch_to_ir_dtype(value.dtype), tuple(value.shape), value))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            specs += _tensor_specs(f"{prefix}_{i}", item)
    elif isinstance(value, dict):
        for key, item in value.items():
            specs += _tensor_specs(f"{prefix}_{key}", item)
    else:
        leaves = torch.utils._pytree.tree_leaves(value)
        if any(isinstance(leaf, torch.Tensor) for leaf in leaves):
            for i, leaf in enumerate(leaf for leaf in leaves if isinstance(leaf, torch.Tensor)):
                specs.append(TensorSpec(f"{prefix}_{i}", _torch_to_ir_dtype(leaf.dtype), tuple(leaf.shape), leaf))
    return specs


def _keep_values_where_ambiguous(specs: list[TensorSpec], tensors: list[torch.Tensor]) -> list[TensorSpec]:
    """Keep a copy of a tensor only when another one of the call has the same dtype and shape."""
    counts: dict[tuple, int] = {}
    for spec in specs:
        counts[(spec.dtype, spec.shape)] = counts.get((spec.dtype, spec.shape), 0) + 1
    return [
        dataclasses.replace(spec, value=tensor.detach().clone() if counts[(spec.dtype, spec.shape)] > 1 else None)
        for spec, tensor in zip(specs, tensors)
    ]


def _torch_to_ir_dtype(dtype: torch.dtype) -> ir.DataType:
    return _torch_compat.torch_dtype_to_ir(dtype)


def _eager_run(model: torch.nn.Module, args: tuple, kwargs: dict):
    """Run the model once in PyTorch, recording every module call and its tensors.

    Calls are keyed by module *instance* and its n-th call: one instance can be reached
    under several attribute paths, and torch.export names each call by the path used,
    which :func:`onnx_modular.hierarchy.build_call_tree` resolves.

    Returns:
        (outputs, signatures per (id(instance), n), calls in order as
        (id(instance), n, first module path, parent (id, n) or None)).
    """
    signatures: dict[tuple[str, int], CallSignature] = {}
    calls: list[tuple[str, int, tuple[str, int] | None]] = []
    active: list[tuple[str, int]] = []
    counts: dict[int, int] = {}
    pending: dict[int, list[tuple[str, int, list[TensorSpec]]]] = {}
    handles = []

    def make_hooks(path: str, module: torch.nn.Module):
        try:
            parameters = inspect.signature(module.forward)
        except (TypeError, ValueError):
            parameters = None

        def pre_hook(mod, hook_args, hook_kwargs):
            index = counts.get(id(mod), 0)
            counts[id(mod)] = index + 1
            specs: list[TensorSpec] = []
            try:
                bound = parameters.bind(*hook_args, **hook_kwargs) if parameters else None
            except TypeError:
                bound = None
            if bound is not None:
                for name, value in bound.arguments.items():
                    kind = parameters.parameters[name].kind
                    if kind == inspect.Parameter.VAR_KEYWORD:
                        for key, item in value.items():
                            specs += _tensor_specs(key, item)
                    else:
                        specs += _tensor_specs(name, value)
            specs = _keep_values_where_ambiguous(specs, [spec.value for spec in specs])
            pending.setdefault(id(mod), []).append((path, index, specs))
            calls.append((id(mod), index, path, active[-1] if active else None))
            active.append((id(mod), index))

        def post_hook(mod, hook_args, hook_kwargs, output):
            path_, index, specs = pending[id(mod)].pop()
            active.pop()
            outputs = _tensor_specs("output", output)
            outputs = _keep_values_where_ambiguous(outputs, [spec.value for spec in outputs])
            signatures[(id(mod), index)] = CallSignature(specs, outputs)

        return pre_hook, post_hook

    for path, module in model.named_modules():
        pre_hook, post_hook = make_hooks(path, module)
        handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(module.register_forward_hook(post_hook, with_kwargs=True))
    try:
        with torch.no_grad():
            outputs = model(*args, **kwargs)
    except Exception as e:
        raise CaptureError(
            f"The model failed to run in PyTorch on the example inputs: {type(e).__name__}: {e}",
            module_path=_module_path_from_traceback(e, model),
            hint="Check that the example inputs have the shapes and dtypes forward() expects.",
        ) from e
    finally:
        for handle in handles:
            handle.remove()
    return outputs, signatures, calls


def _lazy_values(
    program: torch.export.ExportedProgram, args: tuple, kwargs: dict, loaders: dict | None = None
) -> Callable[[str], Any]:
    """``value_of(name)``: runs the program on the example inputs the first time it is asked.

    Only calls with several inputs (or outputs) of equal dtype and shape ask, so most
    exports never pay for the run.
    """
    cache: dict[str, Any] | None = None

    def value_of(name: str) -> Any:
        nonlocal cache
        if cache is None:
            try:
                cache = _torch_compat.program_values(program, *verification.copy_inputs(args, kwargs), loaders)
            except Exception as e:  # names stay unresolved; the export itself is unaffected
                logger.info("Could not evaluate the program to resolve equal-shaped inputs: %s", e)
                cache = {}
        return cache.get(name)

    return value_of


# -- locating the module behind an error -------------------------------------------


def _iter_frames(exc: BaseException) -> Iterator[types.FrameType]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        frames = []
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        yield from reversed(frames)  # innermost first
        exc = exc.__cause__ or exc.__context__


def _module_path_from_traceback(exc: BaseException, model: torch.nn.Module) -> str | None:
    """The innermost module of ``model`` whose forward() appears in the traceback."""
    paths = {id(module): path for path, module in model.named_modules()}
    for frame in _iter_frames(exc):
        candidate = frame.f_locals.get("self")
        if candidate is not None and id(candidate) in paths:
            return paths[id(candidate)]
    return None


def _module_path_from_fx_node(exc: BaseException) -> str | None:
    """The module path of the FX node being translated when ``exc`` was raised."""
    for frame in _iter_frames(exc):
        node = frame.f_locals.get("node")
        if isinstance(node, torch.fx.Node):
            stack = node.meta.get("nn_module_stack") or {}
            if stack:
                return list(stack.values())[-1][0]
            return ""
    return None


# -- module selection ---------------------------------------------------------------


def _selector(modules: ModuleSelector, model: torch.nn.Module) -> Callable[[str, int], bool]:
    """A predicate on (module path, depth) from the user's ``modules`` option."""
    if modules is None or modules == "all":
        return lambda path, depth: True
    if isinstance(modules, bool):
        raise InvalidInputError("modules must be 'all', a set of classes, a depth or a predicate, not a bool.")
    if isinstance(modules, int):
        if modules < 0:
            raise InvalidInputError(f"modules (max depth) must be >= 0, got {modules}.")
        return lambda path, depth: depth <= modules
    named = dict(model.named_modules(remove_duplicate=False))
    if callable(modules) and not isinstance(modules, type):
        predicate = modules
        return lambda path, depth: path in named and bool(predicate(path, named[path]))
    try:
        classes = tuple(modules) if not isinstance(modules, type) else (modules,)
    except TypeError:
        raise InvalidInputError(f"Unsupported value for modules: {modules!r}.") from None
    if not all(isinstance(cls, type) for cls in classes):
        raise InvalidInputError(f"modules must contain nn.Module classes, got {modules!r}.")
    return lambda path, depth: path in named and isinstance(named[path], classes)


def _annotate_stacks(model_ir: ir.Model, tree: CallTree, select: Callable[[str, int], bool]) -> None:
    """Set ``node.meta[STACK_KEY]``: the selected module-call keys each node ran under."""
    depth_of = {call.key: call.depth for call in tree.walk()}
    for call in tree.walk():
        if call.parent is not None:
            call.selected = select(call.module_path, depth_of[call.key])
    for node in model_ir.graph:
        fx_node = _torch_compat.fx_node_of(node)
        stack = (fx_node.meta.get("nn_module_stack") or {}) if fx_node is not None else {}
        node.meta[STACK_KEY] = tuple(
            key
            for key, (path, _) in stack.items()
            if key in tree and depth_of[key] > 0 and tree[key].selected
        )


# -- the pipeline ---------------------------------------------------------------------


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while our passes run.

    The passes allocate many small objects (IR nodes and values, which reference each other),
    and each allocation burst can trigger a full collection that walks the whole heap: the
    model, the exported program, earlier exports' leftovers. Measured at 48 layers, such
    collections tripled the stage's time (0.34 s -> 1.3 s) in a third export in one process.
    Objects freed meanwhile are collected when the collector resumes.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _Timer:
    def __init__(self):
        self.timings: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[stage] = self.timings.get(stage, 0.0) + time.perf_counter() - start


def export_modular(
    model: torch.nn.Module,
    args: tuple | torch.Tensor = (),
    f: str | os.PathLike | None = None,
    *,
    kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    opset_version: int | None = None,
    external_data: bool | None = None,
    modules: ModuleSelector = "all",
    dedupe: bool = True,
    optimize: bool = True,
    verify: bool | str = True,
    verify_flat: bool = True,
    weights: Any = None,
    max_block_bytes: int | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    progress: Callable[[str, float], None] | None = None,
) -> ModularExport:
    """Export ``model`` to ONNX with every module call as a nested local function.

    Args:
        model: The ``torch.nn.Module`` to export (put it in ``eval()`` mode first).
        args: Example positional inputs (a tuple, or a single tensor).
        f: Where to write the ``.onnx`` file; ``None`` keeps it in memory only.
        kwargs: Example keyword inputs.
        dynamic_shapes: As for ``torch.export.export`` (``torch.export.Dim`` objects). For a
            non-tensor input such as a KV cache, one ``{axis: Dim}`` applies to each of its
            tensors (``{"past_key_values": {0: batch, 2: past}}``).
        input_names: Names of the graph inputs, one per input tensor in flattening order.
            Default: forward()'s parameter names, dotted inside nested inputs
            (``past_key_values.layers.0.keys``).
        output_names: Names of the graph outputs. Default: the names in what forward
            returns (``logits``; ``output`` for a lone tensor). A name that is both an
            input and an output gets ``input.`` / ``output.`` in front.
        opset_version: ONNX opset of the default domain; only torch's translator opset (18)
            is supported, since version converters inline all functions.
        external_data: Store weights in ``<f>.data``; ``None`` decides by size (> 1.5 GiB).
        modules: Which module calls become functions: ``"all"`` (default), a set of
            module classes, a maximum depth (1 = children of the root), or a predicate
            ``(module_path, module) -> bool``. Unselected modules are inlined into
            their parent; their nodes keep the ``namespace`` metadata.
        dedupe: Identical calls share one function definition (at every level).
        optimize: Run onnxscript's optimizer on every body with ``inline=False`` (constant
            folding and simplification; the hierarchy is kept). On by default, as in
            ``torch.onnx.export``.
        verify: Compare onnxruntime (modular and flat) with PyTorch; raise
            :class:`~onnx_modular.errors.ParityError` beyond tolerance (no file is written then).
            With ``weights=`` and a model on ``meta``, the check runs block by block
            (``"blocks"``; ``"full"`` loads the whole file in onnxruntime instead).
        weights: Take the parameters' values from a safetensors file, a folder of shards
            (``model.safetensors.index.json``) or a state dict, read one tensor at a time;
            ``model`` may then be on the ``meta`` device. See :mod:`onnx_modular.weights`.
        max_block_bytes: With ``weights=``, the most weight bytes loaded at once in PyTorch
            and onnxruntime (default: a quarter of the weights, see ``streaming.choose_blocks``).
        verify_flat: Also run the inlined (flat) copy in verification.
        rtol: Relative tolerance (default per output dtype, see ``verification.default_tolerance``).
        atol: Absolute tolerance (default per output dtype).
        progress: Called as ``progress(stage, seconds)`` after each stage.

    Returns:
        A :class:`ModularExport` with the model, the call tree and the parity report.

    Example::

        from onnx_modular import export_modular
        result = export_modular(model, (input_ids,), "gpt2.onnx")
        print(result.hierarchy)
        print(result.report)
    """
    _torch_compat.check_torch_version()
    args, kwargs = _check_inputs(model, args, kwargs)
    if f is not None:
        _io.check_destination(f)
    if weights is None:
        streaming.check_model_device(model)
        stream = None
    else:  # names, shapes and the blocks are checked before any export work
        stream = streaming.Stream(model, weights, verify, max_block_bytes)
        external_data = True if external_data is None else external_data
    select = _selector(modules, model)
    if opset_version is not None and opset_version != _torch_compat.default_opset():
        # torch's translator emits opset 18; every available version converter (torch's,
        # onnxscript's) inlines all functions first, which would undo the hierarchy.
        raise InvalidInputError(
            f"opset_version={opset_version} is not supported: torch's translator writes opset "
            f"{_torch_compat.default_opset()}, and converting versions would inline every function.",
            hint=f"Use opset_version={_torch_compat.default_opset()} (or None).",
        )
    if model.training:
        logger.warning("Exporting a model in training mode; call model.eval() first for inference graphs.")

    timer = _Timer()

    def done(stage: str) -> None:
        if progress is not None:
            progress(stage, timer.timings.get(stage, 0.0))

    with timer("capture"):
        # Both runs get their own copy of the inputs: a forward pass may update its inputs in
        # place (a KV cache appends to itself), and the user's objects must stay as given.
        with stream.eager() if stream is not None else contextlib.nullcontext():
            expected_outputs, signatures, eager_calls = _eager_run(model, *verification.copy_inputs(args, kwargs))
        model_io.register_input_types(model, {"args": args, "kwargs": kwargs, "output": expected_outputs})
        dynamic_shapes = model_io.expand_dynamic_shapes(model, args, kwargs, dynamic_shapes)
        try:
            if stream is not None:
                program = stream.capture(_torch_compat.capture, args, kwargs, dynamic_shapes)
            else:
                program = _torch_compat.capture(model, args, kwargs, dynamic_shapes)
        except Exception as e:
            path = _module_path_from_traceback(e, model)
            raise CaptureError(
                f"torch.export could not capture the model: {type(e).__name__}: {_first_line(e)}",
                module_path=path,
                hint="Make the code traceable by torch.export (see the cause below), "
                "or check dynamic_shapes against the inputs." + _suggested_fixes(e),
            ) from e
    done("capture")

    with timer("decompose"):
        try:
            program = _torch_compat.decompose(program, opset_version)
        except Exception as e:
            raise DecompositionError(
                f"torch's ONNX decompositions failed: {type(e).__name__}: {_first_line(e)}",
                module_path=_module_path_from_fx_node(e),
                hint="The cause below names the operator; report it with the model.",
            ) from e
    done("decompose")

    with timer("translate"):
        try:
            model_ir = _torch_compat.translate(program, opset_version)
            _torch_compat.rename_dynamic_axes(model_ir, dynamic_shapes)
            if stream is not None:
                stream.attach(model_ir)  # before any pass renames an initializer
        except Exception as e:
            raise TranslationError(
                f"torch's translator failed: {type(e).__name__}: {_first_line(e)}",
                module_path=_module_path_from_fx_node(e),
                hint="An operator may have no ONNX implementation; the cause below names it. "
                "Rewrite that code or register a custom translation.",
            ) from e
        _name_inputs_outputs(model_ir, model, args, kwargs, expected_outputs, input_names, output_names)
    done("translate")

    with timer("modularize"), _gc_paused():
        try:
            stacks = [
                fx_node.meta["nn_module_stack"]
                for fx_node in program.graph.nodes
                if fx_node.op == "call_function" and fx_node.meta.get("nn_module_stack")
            ]
            tree, eager_key = build_call_tree(stacks, model, eager_calls)
            signatures = {eager_key[key]: signature for key, signature in signatures.items() if key in eager_key}
            _annotate_stacks(model_ir, tree, select)
            cleanup.inline_helper_functions(model_ir)
            cleanup.remove_unused(model_ir)
            OutlineModuleCallsPass(tree, signatures, value_of=_lazy_values(program, args, kwargs, stream and stream.loaders()))(model_ir)
            if dedupe:
                DeduplicateFunctionsPass()(model_ir)
            NameFunctionsPass(tree)(model_ir)
            cleanup.remove_unused(model_ir)
        except OnnxModularError:
            raise
        except Exception as e:
            raise ModularizeError(f"Building the function hierarchy failed: {type(e).__name__}: {e}") from e
    done("modularize")

    with timer("optimize"):  # onnxscript's optimizer, timed apart from onnx_modular's own passes
        try:
            if optimize:
                cleanup.optimize_functions(model_ir)
                FoldWeightTransposesPass()(model_ir)  # what the optimizer does flat, across calls
                cleanup.remove_unused(model_ir)
            cleanup.fix_opset_imports(model_ir)
            model_ir.producer_name = "onnx_modular"
            model_ir.producer_version = _version()
        except Exception as e:
            raise ModularizeError(
                f"Optimizing the function bodies failed: {type(e).__name__}: {e}",
                hint="Pass optimize=False to export without onnxscript's optimizer.",
            ) from e
    done("optimize")

    result = ModularExport(
        model=model_ir,
        hierarchy=tree,
        timings=timer.timings,
        exported_program=program,
        _reference=(verification.flatten_inputs(args, kwargs), verification.flatten_outputs(expected_outputs)),
        _example=(args, kwargs),
    )
    tolerance = _tolerance(rtol, atol)

    def check(path: pathlib.Path) -> None:
        if not verify:
            return
        with timer("verify"):
            inputs, expected = result._reference
            if stream is not None and stream.blockwise:
                result.blocks = stream.verify(path, inputs, expected, tolerance)
                result.report = result.blocks.outputs
                streaming.assert_blocks(result.blocks, result=result)
            else:
                result.report = verification.verify_file(path, inputs, expected, flat=verify_flat, tolerance=tolerance)
        done("verify")
        verification.assert_parity(result.report, result=result)

    if f is not None:
        with timer("save"):
            with _io.staged_save(model_ir, f, external_data=external_data) as staged:
                check(staged)
        result.path = pathlib.Path(f)
        timer.timings["save"] -= timer.timings.get("verify", 0.0)  # verification ran inside the staged save
        done("save")
    elif verify:
        with _model_file(result) as path:
            check(path)
    return result


def _name_inputs_outputs(
    model_ir: ir.Model,
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    outputs: Any,
    input_names: Sequence[str] | None,
    output_names: Sequence[str] | None,
) -> None:
    graph = model_ir.graph
    for given, values, what in ((input_names, graph.inputs, "input"), (output_names, graph.outputs, "output")):
        if given is not None and len(given) != len(values):
            raise InvalidInputError(
                f"{len(given)} {what}_names were given, but the graph has {len(values)} {what}s "
                f"({', '.join(value.name for value in values)}).",
                hint=f"Give one name per {what} tensor, in the order torch.export flattens them.",
            )
    NameGraphInputsOutputsPass(
        list(input_names) if input_names is not None else model_io.input_leaf_names(model, args, kwargs),
        list(output_names) if output_names is not None else model_io.output_leaf_names(outputs),
    )(model_ir)


def _suggested_fixes(exc: BaseException) -> str:
    """torch.export's own "Suggested fixes" for dynamic shapes (``total = Dim('total', min=4)``)."""
    text = str(exc)
    if "Suggested fixes:" not in text:
        return ""
    fixes = [line.strip() for line in text.split("Suggested fixes:", 1)[1].splitlines()]
    fixes = [line for line in fixes if line and "=" in line and not line.startswith("The error")]
    return " torch suggests: " + "; ".join(fixes[:8]) if fixes else ""


def _first_line(exc: BaseException) -> str:
    """The first line of the error, plus that of its innermost cause (which usually says why)."""

    def line(error: BaseException) -> str:
        text = str(error).strip()
        return text.splitlines()[0][:400] if text else type(error).__name__

    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    if root is exc:
        return line(exc)
    return f"{line(exc)} Cause: {type(root).__name__}: {line(root)}"


def _version() -> str:
    from onnx_modular import __version__

    return __version__
