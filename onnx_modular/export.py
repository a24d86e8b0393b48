"""``export_modular``: check the options, then run the stages in order; each stage lives elsewhere.

    nn.Module + example inputs
      capture      eager reference run, calls recorded (capture/reference_run.py)
                   + capture strategies, torch.export non-strict first
                     (capture/strategies.py; the winner: result.capture_strategy) -> ExportedProgram
      decompose    torch's ONNX decompositions + FX fixes                   -> decomposed program
      translate    torch's FX -> ONNX translator, then passes/export/pipeline.translated_passes
                   (axis names, weights, input/output names, one opset)     -> flat onnx_ir.Model
      modularize   the call tree from FX (capture/fx_call_tree.py), module selection
                   (capture/selection.py), then pipeline.modularize_passes  -> nested functions
      optimize     pipeline.optimize_passes: onnxscript's optimizer per body (inline=False),
                   no-op calls recorded, opset conversion (below 18), weight fold
      save         functions callee-first, atomic write + onnx.checker(full_check=True)
                   (storage/save.py); with flat_file=, the flat deployment copy beside it
                   (calls/flat.py), both written or neither
      verify       check.verify_export (check/dispatch.py): onnxruntime (modular, flat, the flat
                   copy) vs PyTorch, float32-widened for bfloat16, or block by block for streamed
                   weights, inside the staged save

Data flows forward: each stage takes what the earlier ones returned. The call tree is built
once (modularize), completed by the passes (functions, no-op calls) and, at the end, by the
counts of the final in-memory model (:func:`onnx_modular.calls.tree.count_from_ir`). An
unexpected exception in a stage becomes that stage's typed error
(:func:`onnx_modular.capture.diagnostics.stage_error`), in one place: :class:`_Stages`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import pathlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import onnx_ir as ir
import torch

from onnx_modular.calls import flat as flat_files
from onnx_modular.calls.tree import count_from_ir
from onnx_modular.capture import (
    diagnostics,
    pytree_io,
    reference_run,
    selection,
    strategies,
    symbols,
    tensors,
    torch_compat,
    torch_export,
)
from onnx_modular.capture.fx_call_tree import build_call_tree, module_stacks
from onnx_modular.capture.selection import ModuleSelector
from onnx_modular.check import verification
from onnx_modular.check.dispatch import assert_verified, verify_export
from onnx_modular.check.parity import Tolerance, user_tolerance
from onnx_modular.errors import EXPORT_STAGES, InvalidInputError, OnnxModularError
from onnx_modular.format import metadata
from onnx_modular.format.calltree import CallTree
from onnx_modular.passes.export import pipeline
from onnx_modular.passes.export.opset_conversion import check_opset
from onnx_modular.result import ModularExport, model_file
from onnx_modular.runtime import sessions as runtime
from onnx_modular.storage import save
from onnx_modular.weights import streaming
from onnx_modular.weights.sources import has_meta_tensors

__all__ = ["export_modular", "ModularExport", "ModuleSelector"]

logger = logging.getLogger(__name__)


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
    custom_translation_table: Mapping[Callable, Callable] | None = None,
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
    exported_program: torch.export.ExportedProgram | None = None,
    program_fixes: Sequence[Callable[[torch.fx.GraphModule], None]] = (),
    execution_provider: str | None = None,
    flat_file: bool | str | os.PathLike | None = None,
    fixed_inputs: Sequence[str] = (),
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
        opset_version: ONNX opset of the default domain, 17 to the newest the installed onnx
            knows (default 18). From 18 up torch's translator writes that opset directly
            (``Attention``, ``RMSNormalization`` at 23); 17 is converted from 18 body by body
            (:class:`~onnx_modular.passes.export.opset_conversion.ConvertOpsetPass`). Every function imports the same version.
        custom_translation_table: ``{torch op: onnxscript function}``, as in
            ``torch.onnx.export``: the functions translate those ops (aten or
            ``torch.library`` custom ops), inside the module functions that call them.
        external_data: Store weights in ``<f>.data``; ``None`` decides by size (> 1 MiB of weights).
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
        verify_flat: Also run the inlined (flat) copy in verification.
        weights: Take the parameters' values from a safetensors file, a folder of shards
            (``model.safetensors.index.json``) or a state dict, read one tensor at a time;
            ``model`` may then be on the ``meta`` device. With a model on ``meta`` the parity
            check runs block by block (``verify="blocks"``; ``"full"`` loads the whole file in
            onnxruntime instead). See :mod:`onnx_modular.weights.sources` and ``docs/user-guide.md``.
        max_block_bytes: With ``weights=``, the most weight bytes loaded at once in PyTorch
            and onnxruntime (default: a quarter of the weights, see ``streaming.choose_blocks``).
        rtol: Relative tolerance (default per output dtype, see ``check.parity.default_tolerance``).
        atol: Absolute tolerance (default per output dtype).
        progress: Called as ``progress(stage, seconds)`` after each stage.
        exported_program: A ``torch.export`` program already captured from ``model`` on these
            inputs (by another exporter's pipeline); the capture stage then only records the
            module calls in eager mode.
        program_fixes: ``fix(graph_module)`` callables run on the decomposed program before
            translation (transformers' FX node fixes).
        execution_provider: onnxruntime provider of the parity check (CPU by default; ``"cuda"``,
            ... when this onnxruntime build has it, else ``ExecutionProviderError`` before exporting).
        flat_file: Also write the deployment copy: every call inlined and onnxscript's optimizer
            run (as ``onnx-modular inline --optimize``), for runtimes that do not read local
            functions (OpenVINO; ``docs/compatibility.md``). ``True`` writes
            ``<stem>.flat.onnx`` beside ``f``, or give a path. It is verified against PyTorch like
            the modular file (``result.flat_report``), and the two files are written together or
            not at all. Its nodes keep torch's ``namespace`` per call (Model Explorer's layers).
        fixed_inputs: Names of keyword inputs whose values are fixed into the program: the file
            does not take them, and what the forward computes from their values (sizes, split
            points, position tables) is computed while capturing, as plain integers. For inputs
            that describe the example's layout rather than its data, such as a vision-language
            model's image grid (``image_grid_thw``, ``image_sizes``): torch.export cannot trace a
            ``split`` by their values (a data-dependent guard), and a deployment at one image
            resolution does not need to. The file then serves only inputs of that layout; the
            values are recorded in its metadata (``pkg.onnx_modular.fixed_inputs``).

    Returns:
        A :class:`ModularExport` with the model, the call tree and the parity report.

    Example::

        from onnx_modular import export_modular
        result = export_modular(model, (input_ids,), "gpt2.onnx")
        print(result.hierarchy)
        print(result.report)
    """
    torch_compat.check_torch_version()
    plan = _Plan.check(
        model, args, kwargs, f, weights=weights, verify=verify, max_block_bytes=max_block_bytes, modules=modules,
        opset_version=opset_version, custom_translation_table=custom_translation_table, external_data=external_data,
        execution_provider=execution_provider, rtol=rtol, atol=atol, flat_file=flat_file, fixed_inputs=fixed_inputs,
    )
    # The export runs the model (reference run, torch.export): the user gets it back exactly as
    # given, buffers (BatchNorm statistics) and training flags included, even on failure.
    with reference_run.kept_as_given(model) as restore:
        args, kwargs, stream, fixed = plan.args, plan.kwargs, plan.stream, plan.fixed
        stages = _Stages(model, progress)
        # The eager run and the capture get their own copy of the inputs: a forward pass may update
        # its inputs in place (a KV cache appends to itself), and the user's objects stay as given.
        with stages("capture", "run", report=False), stream.eager() if stream else contextlib.nullcontext():
            expected, signatures, eager_calls = reference_run.run(model, *tensors.copy_inputs(args, {**kwargs, **fixed}))
        expected = reference_run.unaliased(model, expected)  # an output that is a buffer keeps the values it had
        restore()  # a forward that updates its own buffers: torch.export captures the state the reference ran from
        with stages("capture"):
            dynamic_shapes = _check_io(model, args, kwargs, expected, dynamic_shapes, fixed)
            if exported_program is None:
                captured = strategies.capture(
                    model, args, kwargs, dynamic_shapes, on_meta=stream is not None and has_meta_tensors(model),
                    fixed=fixed,
                )
                program, capture_strategy = captured.program, captured.strategy
            else:
                program, capture_strategy = exported_program, None
        captured_program = program  # decompose makes a new program and leaves this one as captured
        with stages("decompose"), torch_export.fixed_values(fixed.values()):
            program = torch_compat.decompose(program, plan.registry)
            for fix in program_fixes:
                fix(program.graph_module)
            symbols.share_equal_sizes(program)  # one symbol, one node, per size torch proved equal
        with stages("translate"):
            model_ir = torch_compat.translate(program, plan.registry)
            names = _io_names(model_ir, model, args, kwargs, expected, input_names, output_names)
            pipeline.run(
                pipeline.translated_passes(
                    axis_names=torch_compat.dynamic_axis_names(model_ir.graph.inputs, dynamic_shapes),
                    input_names=names[0], output_names=names[1], opset=plan.translated_opset,
                    weights=stream.attach_pass() if stream else None,
                ),
                model_ir,
            )
        with stages("modularize"), _gc_paused():
            tree = _modularize(model_ir, model, program, plan, eager_calls, signatures, dedupe=dedupe)
        with stages("optimize"):
            passes = pipeline.optimize_passes(
                tree=tree, opset=plan.translated_opset, target_opset=plan.target_opset, optimize=optimize
            )
            pipeline.run(passes, model_ir)
            model_ir.producer_name, model_ir.producer_version = "onnx_modular", _version()
            if fixed:
                model_ir.metadata_props[metadata.FIXED_INPUTS] = metadata.fixed_inputs_prop(fixed)
        result = ModularExport(
            model=model_ir, hierarchy=tree, timings=stages.timings, exported_program=program,
            capture_strategy=capture_strategy, _example=(args, kwargs), _fixed=fixed,
            _reference=(tensors.flatten_inputs(args, kwargs), tensors.flatten_outputs(expected)),
            _captured=captured_program,
        )
        if stream is None and verification.uses_bfloat16(model_ir):  # the reference of its float32-widened check
            restore()
            result._reference_float32 = verification.float32_reference(model, args, kwargs, fixed)
        _save_and_verify(result, f, plan, stages, verify=bool(verify), flat=verify_flat)
        result._captured = None  # verified (a ParityError keeps it in error.result)
        count_from_ir(tree, model_ir)  # the tree's counts are those of the final model
        return result


# -- options ------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Plan:
    """The checked options, before any export work: what the stages need."""

    args: tuple
    kwargs: dict
    stream: streaming.Stream | None
    select: Callable[[str, int], bool]
    target_opset: int
    translated_opset: int
    registry: Any
    external_data: bool | None
    execution_provider: str | None
    tolerance: Tolerance | None
    flat_path: pathlib.Path | None = None  # where flat_file= writes the flat copy
    fixed: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # fixed_inputs=, out of kwargs

    @classmethod
    def check(cls, model, args, kwargs, f, *, weights, verify, max_block_bytes, modules, opset_version,
              custom_translation_table, external_data, execution_provider, rtol, atol, flat_file=None,
              fixed_inputs=()) -> _Plan:
        args, kwargs = _check_inputs(model, args, kwargs)
        kwargs, fixed = _fixed_inputs(kwargs, fixed_inputs)
        if not (isinstance(verify, bool) or verify in ("blocks", "full")):
            raise InvalidInputError(f"verify must be True, False, 'blocks' or 'full', not {verify!r}.")
        if max_block_bytes is not None and (
            isinstance(max_block_bytes, bool) or not isinstance(max_block_bytes, int) or max_block_bytes <= 0
        ):
            raise InvalidInputError(f"max_block_bytes must be a positive number of bytes, not {max_block_bytes!r}.")
        if verify:
            runtime.execution_providers(execution_provider)  # an unknown provider fails before the export
        if f is not None:
            save.check_destination(f)
        flat_path = flat_files.flat_file_path(f, flat_file, streamed=weights is not None)
        if weights is None:
            streaming.check_model_device(model)
            stream = None
        else:  # names, shapes and the blocks are checked before any export work
            stream = streaming.Stream(model, weights, verify, max_block_bytes)
            external_data = True if external_data is None else external_data
        select = selection.selector(modules, model)
        target_opset = check_opset(opset_version, default=torch_compat.default_opset())
        translated_opset = max(target_opset, torch_compat.default_opset())
        if custom_translation_table is not None and not isinstance(custom_translation_table, Mapping):
            raise InvalidInputError("custom_translation_table must be a dict {torch op: onnxscript function}.")
        try:
            registry = torch_compat.registry(translated_opset, custom_translation_table)
        except Exception as e:
            raise InvalidInputError(
                f"custom_translation_table could not be registered: {type(e).__name__}: {e}"
            ) from e
        if model.training:
            logger.warning("Exporting a model in training mode; call model.eval() first for inference graphs.")
        return cls(args, kwargs, stream, select, target_opset, translated_opset, registry, external_data,
                   execution_provider, user_tolerance(rtol, atol), flat_path, fixed)


def _fixed_inputs(kwargs: dict, names: Sequence[str]) -> tuple[dict, dict[str, torch.Tensor]]:
    """``kwargs`` without the inputs ``fixed_inputs`` names, and those inputs (checked)."""
    if isinstance(names, str):
        names = (names,)
    fixed = {}
    for name in names:
        if name not in kwargs:
            raise InvalidInputError(
                f"fixed_inputs names {name!r}, which is not among the keyword inputs "
                f"({', '.join(kwargs) or 'none'}).",
                hint="Pass the input to fix in kwargs={...} (not positionally), with the value the program keeps.",
            )
        if not isinstance(kwargs[name], torch.Tensor):
            raise InvalidInputError(
                f"fixed_inputs names {name!r}, a {type(kwargs[name]).__name__}: only tensors are fixed "
                "(torch.export already keeps other values as constants).",
                hint=f"Leave {name!r} out of fixed_inputs.",
            )
        if kwargs[name].device.type == "meta":
            raise InvalidInputError(f"fixed_inputs names {name!r}, a tensor on 'meta': a fixed input needs its values.")
        fixed[name] = kwargs[name]
    return {key: value for key, value in kwargs.items() if key not in fixed}, fixed


def _check_inputs(model: Any, args: Any, kwargs: dict | None) -> tuple[tuple, dict]:
    if isinstance(model, torch.export.ExportedProgram) or not isinstance(model, torch.nn.Module):
        raise InvalidInputError(
            f"export_modular needs a torch.nn.Module, got {type(model).__name__}.",
            hint="Pass the model object itself (not a function, ExportedProgram or ScriptModule).",
        )
    return tensors.normalize_inputs(args, kwargs, model)


# -- stages -------------------------------------------------------------------------------------


class _Stages:
    """Times each stage, reports it to ``progress``, and turns an unexpected exception into the
    stage's typed error (:func:`~onnx_modular.capture.diagnostics.stage_error`); typed errors pass."""

    def __init__(self, model: torch.nn.Module, progress: Callable[[str, float], None] | None):
        self.model = model
        self.progress = progress
        self.timings: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str, failure: str | None = None, *, report: bool = True) -> Iterator[None]:
        assert stage in EXPORT_STAGES, stage  # one home of stage names: onnx_modular.errors
        start = time.perf_counter()
        try:
            yield
        except OnnxModularError:
            raise
        except Exception as e:
            if failure == "":
                raise
            raise diagnostics.stage_error(failure or stage, e, self.model) from e
        finally:
            self.timings[stage] = self.timings.get(stage, 0.0) + time.perf_counter() - start
        if report and self.progress is not None:
            self.progress(stage, self.timings[stage])


def _check_io(model: torch.nn.Module, args: tuple, kwargs: dict, expected: Any, dynamic_shapes: Any, fixed=()) -> Any:
    """Inputs and outputs torch.export can flatten; ``dynamic_shapes`` expanded to their tensors."""
    if isinstance(dynamic_shapes, Mapping) and set(dynamic_shapes) & set(fixed):
        name = sorted(set(dynamic_shapes) & set(fixed))[0]
        raise InvalidInputError(
            f"dynamic_shapes gives axes for {name!r}, which fixed_inputs fixes into the program.",
            hint=f"Drop {name!r} from dynamic_shapes (a fixed input has one value, so one shape).",
        )
    pytree_io.register_input_types(model, {"args": args, "kwargs": kwargs, "output": expected})
    pytree_io.check_outputs(expected)
    return pytree_io.expand_dynamic_shapes(model, args, kwargs, dynamic_shapes)


def _io_names(model_ir: ir.Model, model, args, kwargs, outputs, input_names, output_names) -> tuple[list, list]:
    """The graph's input and output names: the user's (one per tensor), else forward()'s."""
    graph = model_ir.graph
    for given, values, what in ((input_names, graph.inputs, "input"), (output_names, graph.outputs, "output")):
        if given is not None and len(given) != len(values):
            raise InvalidInputError(
                f"{len(given)} {what}_names were given, but the graph has {len(values)} {what}s "
                f"({', '.join(value.name for value in values)}).",
                hint=f"Give one name per {what} tensor, in the order torch.export flattens them.",
            )
    return (
        list(input_names) if input_names is not None else pytree_io.input_leaf_names(model, args, kwargs),
        list(output_names) if output_names is not None else pytree_io.output_leaf_names(outputs),
    )


def _modularize(model_ir: ir.Model, model, program, plan: _Plan, eager_calls, signatures, *, dedupe: bool) -> CallTree:
    """The call tree from the program's module stacks, then the passes that outline it into functions."""
    stacks = [node.meta["nn_module_stack"] for node in program.graph.nodes
              if node.op == "call_function" and node.meta.get("nn_module_stack")]
    tree, eager_key = build_call_tree(stacks, model, eager_calls)
    signatures = {eager_key[key]: signature for key, signature in signatures.items() if key in eager_key}
    loaders = plan.stream.loaders() if plan.stream else None
    passes = pipeline.modularize_passes(
        stacks=module_stacks(model_ir),
        selected=selection.selected_calls(tree, plan.select),
        tree=tree,
        signatures=signatures,
        value_of=reference_run.lazy_values(program, plan.args, plan.kwargs, loaders),
        dedupe=dedupe,
    )
    pipeline.run(passes, model_ir)
    return tree


def _save_and_verify(result: ModularExport, f, plan: _Plan, stages: _Stages, *, verify: bool, flat: bool) -> None:
    """Write ``f`` atomically with the parity check inside (no file on a mismatch), or only check."""

    def check(path: pathlib.Path, staged_flat: pathlib.Path | None = None) -> None:
        if not verify:
            return
        with stages("verify"):
            if plan.stream is not None and verification.uses_bfloat16(result.model):
                # onnxruntime's CPU provider has no bfloat16 kernels: the file is checked widened to
                # float32, against PyTorch in float32 on the same weights, streamed once more.
                with plan.stream.eager(widen=True):
                    result._reference_float32 = verification.float32_reference(stages.model, *result._example, result._fixed)
            verify_export(
                result, path, flat=flat, flat_copy=staged_flat, tolerance=plan.tolerance,
                execution_provider=plan.execution_provider,
                blocks=plan.stream.blocks if plan.stream is not None and plan.stream.blockwise else None,
                check=False,
            )
        assert_verified(result)  # after the stage: progress shows the verify stage, then the error

    if f is not None:
        with stages("save", report=False):
            with flat_files.staged_with_flat(result.model, f, plan.flat_path, external_data=plan.external_data) as staged:
                check(*staged)
        result.path, result.flat_path = pathlib.Path(f), plan.flat_path
        stages.timings["save"] -= stages.timings.get("verify", 0.0)  # verification ran inside the staged save
        if stages.progress is not None:
            stages.progress("save", stages.timings["save"])
    elif verify:
        try:
            with model_file(result) as path:  # a temporary file for the check
                check(path)
        except OnnxModularError:
            raise
        except Exception as e:  # a library's exception writing the temporary file
            raise diagnostics.stage_error("save", e, stages.model) from e


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


def _version() -> str:
    from onnx_modular._version import __version__

    return __version__
