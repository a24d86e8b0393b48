"""``onnx-modular export <checkpoint> --task TASK``: a local transformers checkpoint to modular ONNX.

``-o m.onnx`` writes one file; ``-o folder`` (or ``--generation``, which needs a folder) writes
what ``ExportedModel.save_pretrained`` writes: one ``.onnx`` per component, ``export.json`` and
the configs, which ``ExportedModel.from_pretrained`` loads back. Parity is checked on every
component; with ``--keep-on-mismatch`` a mismatching export is written anyway (exit code 1).

``--stream-weights`` (:func:`streamed`) never loads the weights whole: the model is built on the
meta device and ``export_modular(..., weights=<folder>)`` streams them one tensor at a time into
the file's external data and verifies block by block.
"""

from __future__ import annotations

import argparse
import pathlib
import time
from collections.abc import Callable
from typing import Any

from onnx_modular.check import verification
from onnx_modular.errors import InvalidInputError, ParityError
from onnx_modular.hf.checkpoint import model_and_inputs
from onnx_modular.hf.exporter import (
    ModularOnnxConfig,
    ModularOnnxExporter,
    modular_result,
)
from onnx_modular.hf.meta import checkpoint_weights

__all__ = ["export_checkpoint", "streamed"]


def export_checkpoint(
    source: str,
    task: str,
    output: str | pathlib.Path,
    *,
    static: bool = False,
    generation: bool = False,
    verify: bool = True,
    keep_on_mismatch: bool = False,
    opset_version: int | None = None,
    dedupe: bool = True,
    flat_file: bool | str | None = None,
    log: Callable[[str], None] = lambda text: None,
) -> tuple[Any, dict[str, verification.ParityReport]]:
    """Export a checkpoint folder for ``task``; returns ``(ExportedModel, {component: report})``.

    Raises:
        ParityError: A component differs from PyTorch beyond tolerance (nothing is written,
            unless ``keep_on_mismatch``: then everything is written and the error raised after).
            Its ``reports`` holds every component's report.
    """
    output = pathlib.Path(output)
    single_file = output.suffix == ".onnx"
    if generation and single_file:
        raise InvalidInputError(
            f"--generation writes several components, so {str(output)!r} must be a folder, not a .onnx file.",
            hint="Give a folder: -o out/ (prefill.onnx, decode.onnx, export.json, config.json).",
        )
    if flat_file and not single_file:
        raise InvalidInputError(
            "--flat-file writes the flat copy beside one .onnx file; a folder export writes several.",
            hint="Give a file (-o model.onnx), or run `onnx-modular inline --optimize` on a file of the folder.",
        )
    if output.is_file() and not single_file:
        raise InvalidInputError(f"{str(output)!r} is a file; the export of a checkpoint to a folder needs a folder.")
    started = time.perf_counter()
    model, inputs, shapes = model_and_inputs(source, task, static=static, generation=generation)
    log(f"  load        {time.perf_counter() - started:7.2f}s  ({type(model).__name__})")
    config = ModularOnnxConfig(
        dynamic=not static, dynamic_shapes=shapes, opset_version=opset_version, dedupe=dedupe, verify=False
    )
    exporter = ModularOnnxExporter()
    started = time.perf_counter()
    if generation:
        exported = exporter.export_for_generation(model, inputs, config)
    else:
        exported = exporter.export(model, inputs, config)
    log(f"  export      {time.perf_counter() - started:7.2f}s  ({', '.join(exported.components)})")
    reports: dict[str, verification.ParityReport] = {}
    failure: ParityError | None = None
    if verify:
        started = time.perf_counter()
        for name in exported.components:
            result = modular_result(exported, name)
            result.report = reports[name] = result.verify()
            try:
                verification.assert_parity(result.report, result=result)
            except ParityError as e:
                failure = failure or e
        log(f"  verify      {time.perf_counter() - started:7.2f}s")
    if failure is not None:
        failure.reports = reports  # every component's report, for the command line
    if failure is not None and not keep_on_mismatch:
        raise failure
    if single_file:
        modular_result(exported).save(output, flat_file=flat_file)
    else:
        exported.save_pretrained(output)
    if failure is not None:
        raise failure
    return exported, reports


def streamed(args: argparse.Namespace) -> dict[str, Any]:
    """``--stream-weights``: what the CLI gives ``export_modular`` (``model`` on meta, ``kwargs``,
    ``dynamic_shapes``, ``weights`` = the folder) to export one .onnx file."""
    _check_task_given(args)
    model, inputs, shapes = model_and_inputs(
        args.factory, args.task, static=args.static, generation=args.generation, stream_weights=True
    )
    if pathlib.Path(args.output).suffix != ".onnx":
        raise InvalidInputError(
            f"--stream-weights writes one .onnx file (and its .onnx.data), so {args.output!r} must end with .onnx.",
            hint="Give a file: -o model.onnx.",
        )
    if shapes is not None:  # torch.export wants a key per keyword input (None: not dynamic)
        shapes = {name: shapes.get(name) for name in inputs}
    weights = checkpoint_weights(args.factory, model)  # under the model's names, as from_pretrained renames
    return {"model": model, "args": (), "kwargs": inputs, "dynamic_shapes": shapes, "weights": weights}


def _check_task_given(args: argparse.Namespace) -> None:
    if args.task is None:
        raise InvalidInputError(
            f"{args.factory!r} is a checkpoint folder: say what to export it for with --task.",
            hint="For example --task causal-lm-with-past (see onnx-modular export --help).",
        )


def run(args: argparse.Namespace, log: Callable[[str], None]) -> tuple[Any, dict[str, verification.ParityReport]]:
    """The CLI's call (arguments as ``onnx_modular.cli`` parses them)."""
    _check_task_given(args)
    return export_checkpoint(
        args.factory,
        args.task,
        args.output,
        static=args.static,
        generation=args.generation,
        verify=not args.no_verify,
        keep_on_mismatch=args.keep_on_mismatch,
        opset_version=args.opset,
        dedupe=not args.no_dedupe,
        flat_file=getattr(args, "flat_file", None),
        log=log,
    )
