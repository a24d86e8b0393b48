"""``export_modular``: run the pipeline stages in order; the stages and passes live elsewhere.

    nn.Module + example inputs
      capture      eager run (calls, signatures) + torch.export (non-strict)  -> ExportedProgram
      decompose    torch's ONNX decompositions            -> decomposed ExportedProgram
      translate    torch's FX -> ONNX translator          -> flat onnx_ir.Model
      modularize   module selection (selection.py), then our passes (passes/):
                   OutlineModuleCallsPass                 -> nested local functions
                   DeduplicateFunctionsPass               -> identical calls share a function
                   NameFunctionsPass                      -> names, doc strings, metadata
      optimize     onnxscript optimizer per body (inline=False), no-op calls dropped and
                   recorded (RecordNoOpCallsPass), opset conversion (below 18), FoldWeightsPass
                   (weight-only computations folded and body constants lifted across calls),
                   StripConstantMetadataPass, unused removal
      save         atomic write + onnx.checker(full_check=True)
      verify       onnxruntime(modular) vs onnxruntime(flat) vs torch eager (verification.py)

The result object is in ``result.py``; errors are located by ``diagnostics.py``.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import os
import pathlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import onnx
import onnx_ir as ir
import torch

from onnx_modular.files import save

from onnx_modular.capture import torch_compat

from onnx_modular.capture import diagnostics

from onnx_modular.capture import reference_run

from onnx_modular.capture import pytree_io

from onnx_modular.passes import opset

from onnx_modular.capture import selection

from onnx_modular.weights import streaming

from onnx_modular.check import verification
from onnx_modular.errors import (
    CaptureError,
    DecompositionError,
    InvalidInputError,
    ModularizeError,
    OnnxModularError,
    TranslationError,
)
from onnx_modular.files import runtime
from onnx_modular.files.tree import count_from_model
from onnx_modular.capture.fx_call_tree import build_call_tree
from onnx_modular.passes import cleanup
from onnx_modular.passes.dedupe import DeduplicateFunctionsPass
from onnx_modular.passes.io_names import NameGraphInputsOutputsPass
from onnx_modular.passes.modularize import OutlineModuleCallsPass
from onnx_modular.passes.naming import NameFunctionsPass
from onnx_modular.passes.constant_metadata import StripConstantMetadataPass
from onnx_modular.passes.fold_weights import FoldWeightsPass
from onnx_modular.passes.no_op_calls import RecordNoOpCallsPass
from onnx_modular.result import ModularExport, model_file
from onnx_modular.capture.selection import ModuleSelector

__all__ = ["export_modular", "ModularExport", "ModuleSelector"]

logger = logging.getLogger(__name__)


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
            (:mod:`onnx_modular.passes.opset`). Every function imports the same version.
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
        rtol: Relative tolerance (default per output dtype, see ``verification.default_tolerance``).
        atol: Absolute tolerance (default per output dtype).
        progress: Called as ``progress(stage, seconds)`` after each stage.
        exported_program: A ``torch.export`` program already captured from ``model`` on these
            inputs (by another exporter's pipeline); the capture stage then only records the
            module calls in eager mode.
        program_fixes: ``fix(graph_module)`` callables run on the decomposed program before
            translation (transformers' FX node fixes).
        execution_provider: onnxruntime provider of the parity check (CPU by default; ``"cuda"``,
            ... when this onnxruntime build has it, else ``ExecutionProviderError`` before exporting).

    Returns:
        A :class:`ModularExport` with the model, the call tree and the parity report.

    Example::

        from onnx_modular import export_modular
        result = export_modular(model, (input_ids,), "gpt2.onnx")
        print(result.hierarchy)
        print(result.report)
    """
    torch_compat.check_torch_version()
    args, kwargs = _check_inputs(model, args, kwargs)
    if verify:
        runtime.execution_providers(execution_provider)  # an unknown provider fails before the export
    if f is not None:
        save.check_destination(f)
    if weights is None:
        streaming.check_model_device(model)
        stream = None
    else:  # names, shapes and the blocks are checked before any export work
        stream = streaming.Stream(model, weights, verify, max_block_bytes)
        external_data = True if external_data is None else external_data
    select = selection.selector(modules, model)
    target_opset = opset.check_opset(opset_version, default=torch_compat.default_opset())
    translated_opset = max(target_opset, torch_compat.default_opset())
    if custom_translation_table is not None and not isinstance(custom_translation_table, Mapping):
        raise InvalidInputError("custom_translation_table must be a dict {torch op: onnxscript function}.")
    try:
        registry = torch_compat.registry(translated_opset, custom_translation_table)
    except Exception as e:
        raise InvalidInputError(f"custom_translation_table could not be registered: {type(e).__name__}: {e}") from e
    if model.training:
        logger.warning("Exporting a model in training mode; call model.eval() first for inference graphs.")

    timer = _Timer()

    def done(stage: str) -> None:
        if progress is not None:
            progress(stage, timer.timings.get(stage, 0.0))

    with timer("capture"):
        # Both runs get their own copy of the inputs: a forward pass may update its inputs in
        # place (a KV cache appends to itself), and the user's objects must stay as given.
        try:
            with stream.eager() if stream is not None else contextlib.nullcontext():
                expected_outputs, signatures, eager_calls = reference_run.run(model, *verification.copy_inputs(args, kwargs))
        except Exception as e:
            raise CaptureError(
                f"The model failed to run in PyTorch on the example inputs: {type(e).__name__}: {e}",
                module_path=diagnostics.module_path_from_traceback(e, model),
                hint="Check that the example inputs have the shapes and dtypes forward() expects.",
            ) from e
        pytree_io.register_input_types(model, {"args": args, "kwargs": kwargs, "output": expected_outputs})
        pytree_io.check_outputs(expected_outputs)
        dynamic_shapes = pytree_io.expand_dynamic_shapes(model, args, kwargs, dynamic_shapes)
        try:
            if exported_program is not None:
                program = exported_program
            elif stream is not None:
                program = stream.capture(torch_compat.capture, args, kwargs, dynamic_shapes)
            else:
                program = torch_compat.capture(model, args, kwargs, dynamic_shapes)
        except Exception as e:
            path = diagnostics.module_path_from_traceback(e, model)
            raise CaptureError(
                f"torch.export could not capture the model: {type(e).__name__}: {diagnostics.first_line(e)}",
                module_path=path,
                hint="Make the code traceable by torch.export (see the cause below), "
                "or check dynamic_shapes against the inputs." + diagnostics.suggested_fixes(e),
            ) from e
    done("capture")

    with timer("decompose"):
        try:
            program = torch_compat.decompose(program, registry)
            for fix in program_fixes:
                fix(program.graph_module)
        except Exception as e:
            raise DecompositionError(
                f"torch's ONNX decompositions failed: {type(e).__name__}: {diagnostics.first_line(e)}",
                module_path=diagnostics.module_path_from_fx_node(e),
                hint="The cause below names the operator; report it with the model.",
            ) from e
    done("decompose")

    with timer("translate"):
        try:
            model_ir = torch_compat.translate(program, registry)
            torch_compat.rename_dynamic_axes(model_ir, dynamic_shapes)
            if stream is not None:
                stream.attach(model_ir)  # before any pass renames an initializer
        except Exception as e:
            raise TranslationError(
                f"torch's translator failed: {type(e).__name__}: {diagnostics.first_line(e)}",
                module_path=diagnostics.module_path_from_fx_node(e),
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
            selection.annotate_stacks(model_ir, tree, select)
            cleanup.inline_helper_functions(model_ir)
            cleanup.remove_unused(model_ir)
            OutlineModuleCallsPass(tree, signatures, value_of=reference_run.lazy_values(program, args, kwargs, stream and stream.loaders()))(model_ir)
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
            opset.set_default_opset(model_ir, translated_opset)
            if optimize:
                cleanup.optimize_functions(model_ir)
                opset.fuse_standard_ops(model_ir)  # at 23: RMSNormalization for hand-written norms
            # Calls that compute nothing: no function, recorded. Before the weight fold, so that a
            # call whose computation is folded into stored weights (rotary tables) stays a call.
            RecordNoOpCallsPass(tree)(model_ir)
            cleanup.remove_unused(model_ir)
            torch_compat.add_opset_imports(model_ir)
            opset.set_default_opset(model_ir, translated_opset)
            opset.ConvertOpsetPass(target_opset)(model_ir)  # converts only below 18
            if optimize:
                # What the optimizer folds and lifts flat, across calls. After the conversion, which
                # needs the bodies' constant inputs (axes) in place to turn them into attributes.
                FoldWeightsPass()(model_ir)
                StripConstantMetadataPass()(model_ir)  # the constants left cost what flat initializers cost
                cleanup.remove_unused(model_ir)
            model_ir.producer_name = "onnx_modular"
            model_ir.producer_version = _version()
        except OnnxModularError:
            raise
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
    tolerance = verification.tolerance(rtol, atol)

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
                result.report = verification.verify_file(
                    path, inputs, expected, flat=verify_flat, tolerance=tolerance, execution_provider=execution_provider
                )
        done("verify")
        verification.assert_parity(result.report, result=result)

    if f is not None:
        with timer("save"):
            with save.staged_save(model_ir, f, external_data=external_data) as staged:
                check(staged)
        result.path = pathlib.Path(f)
        timer.timings["save"] -= timer.timings.get("verify", 0.0)  # verification ran inside the staged save
        done("save")
    elif verify:
        with model_file(result) as path:
            check(path)
    # The tree's counts are those of the final model, as `onnx-modular tree` reads them from the
    # file (a saved file is read without its external weights; only their shapes count).
    final = (
        onnx.load(str(result.path), load_external_data=False)
        if result.path is not None
        else ir.serde.serialize_model(model_ir)
    )
    count_from_model(tree, final)
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
        list(input_names) if input_names is not None else pytree_io.input_leaf_names(model, args, kwargs),
        list(output_names) if output_names is not None else pytree_io.output_leaf_names(outputs),
    )(model_ir)

def _version() -> str:
    from onnx_modular import __version__

    return __version__
