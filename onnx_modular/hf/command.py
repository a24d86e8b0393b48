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
import contextlib
import json
import os
import pathlib
import shutil
import stat
import time
from collections.abc import Callable
from typing import Any

import transformers

from onnx_modular.check import verification
from onnx_modular.check.dispatch import verify_export
from onnx_modular.check.parity import user_tolerance
from onnx_modular.errors import CHECKPOINT_STAGES, InvalidInputError, ParityError
from onnx_modular.hf.cache_axes import IO_NAMINGS, generation_axis_names, optimum_io_names
from onnx_modular.hf.checkpoint import infer_task, model_and_inputs, resolve_task
from onnx_modular.hf.exporter import (
    ModularOnnxConfig,
    ModularOnnxExporter,
    modular_result,
)
from onnx_modular.hf.meta import checkpoint_weights
from onnx_modular.passes.export.dynamic_axes import RenameDynamicAxesPass
from onnx_modular.storage import folders, locks, save
from onnx_modular.storage.shared_data import share_external_data

__all__ = ["RUNTIME_FILES", "export_checkpoint", "streamed"]


#: The stages of a checkpoint export, in order (the live progress line names the one under way).
STAGES = CHECKPOINT_STAGES

#: Files of a checkpoint folder that a runtime needs beside the model (tokenizer, generation
#: settings, processors), copied into an output folder when present.
RUNTIME_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "preprocessor_config.json",
    "processor_config.json",
)


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
    dtype: str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    io_names: str = "transformers",
    log: Callable[[str], None] = lambda text: None,
    progress: Any = None,
) -> tuple[Any, dict[str, verification.ParityReport]]:
    """Export a checkpoint folder for ``task``; returns ``(ExportedModel, {component: report})``.

    ``task`` may be an Optimum name (``text-generation-with-past``); ``dtype`` (``float32``,
    ``float16``, ``bfloat16``; default: the checkpoint's) is the precision of the export; ``rtol``
    and ``atol`` override the per-dtype tolerances of the check. A folder output also gets the
    checkpoint's tokenizer files and ``generation_config.json`` (:data:`RUNTIME_FILES`), and its
    ``export.json`` records the check that was made. ``progress``: a
    :class:`~onnx_modular.cli.progress.Progress` (stage lines and the live line), else ``log``
    gets one line per stage.

    Raises:
        InvalidInputError: A bad output path (before any work).
        ParityError: A component differs from PyTorch beyond tolerance (nothing is written,
            unless ``keep_on_mismatch``: then everything is written and the error raised after).
            Its ``reports`` holds every component's report.
    """
    output = pathlib.Path(output)
    single_file = output.suffix == ".onnx"
    task = resolve_task(task)
    _check_arguments(output, task, generation=generation, flat_file=flat_file, io_names=io_names)
    # Before any work: the file's folder, or the output folder (or its parent), must exist and be writable.
    save.check_destination(output / "export.json" if output.is_dir() else output)
    check_checkpoint_links(source)
    stage = progress.stage if progress is not None else _logged_stage(log)
    tolerance = user_tolerance(rtol, atol)  # refuses NaN, infinite or negative values first
    with stage("load") as detail:
        model, inputs, shapes = model_and_inputs(source, task, static=static, generation=generation, dtype=dtype)
        detail.append(f"({type(model).__name__}, {str(next(model.parameters()).dtype).replace('torch.', '')})")
    config = ModularOnnxConfig(
        dynamic=not static, dynamic_shapes=shapes, opset_version=opset_version, dedupe=dedupe, verify=False
    )
    exporter = ModularOnnxExporter()
    with stage("export") as detail:
        if generation:
            exported = exporter.export_for_generation(model, inputs, config)
            for name in exported.components:  # Optimum's axis names, as the single-file path writes them
                component = modular_result(exported, name).model
                RenameDynamicAxesPass(generation_axis_names(component))(component)
        else:
            exported = exporter.export(model, inputs, config)
            if io_names == "optimum":  # before the check: its report names the file's outputs
                _rename_io(modular_result(exported).model, optimum_io_names)
        detail.append(f"({', '.join(exported.components)})")
    reports: dict[str, verification.ParityReport] = {}
    failure: ParityError | None = None
    if verify:
        with stage("verify"):
            for name in exported.components:
                result = modular_result(exported, name)
                try:
                    reports[name] = verify_export(result, tolerance=tolerance)
                except ParityError as e:
                    reports[name] = result.report
                    failure = failure or e
    _record_checks(exported, reports, tolerance, task)
    if failure is not None:
        failure.reports = reports  # every component's report, for the command line
    if failure is not None and not keep_on_mismatch:
        raise failure
    with stage("save"):
        if single_file:
            modular_result(exported).save(output, flat_file=flat_file, rtol=rtol, atol=atol)
        else:
            _save_folder(exported, source, output)
    if failure is not None:
        raise failure
    return exported, reports


def _check_arguments(output: pathlib.Path, task: str, *, generation: bool, flat_file: Any, io_names: str) -> None:
    """Refuse, before any work, options that do not fit the output (a file or a folder) or the task."""
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
    if io_names not in IO_NAMINGS:
        raise InvalidInputError(f"io_names={io_names!r}: expected one of {', '.join(IO_NAMINGS)}.")
    if io_names == "optimum" and task != "causal-lm-with-past":
        raise InvalidInputError(
            f"Optimum's input and output names (past_key_values.N.key, present.N.key) are those of a decoder with its "
            f"cache; task {task!r} has no cache.",
            hint="Use --task causal-lm-with-past (text-generation-with-past), or drop --io-names optimum.",
        )
    if io_names == "optimum" and not single_file:
        raise InvalidInputError(
            "Optimum's input and output names are for one .onnx file: a folder is loaded by ExportedModel.from_pretrained, "
            "which binds inputs by transformers' names.",
            hint="Give a file (-o model.onnx), or drop --io-names optimum.",
        )
    if output.is_file() and not single_file:
        raise InvalidInputError(f"{str(output)!r} is a file; the export of a checkpoint to a folder needs a folder.")


def _record_checks(exported: Any, reports: dict[str, verification.ParityReport], tolerance, task: str) -> None:
    """What was done, in each component's ``export.json``: whether it was checked, passed, and with which tolerance."""
    for name, component in exported.components.items():
        used = _tolerance_used(reports.get(name), tolerance)
        component.metadata.export_config.update(
            verify=name in reports,
            verified=bool(name in reports and reports[name].ok),
            rtol=None if used is None else used.rtol,
            atol=None if used is None else used.atol,
            task=task,
        )


def _rename_io(model: Any, naming: Callable[[list[str]], dict[str, str]]) -> None:
    """Rename the graph inputs and outputs of an ``onnx_ir.Model`` by ``naming(names)``."""
    values = [*model.graph.inputs, *model.graph.outputs]
    renamed = naming([value.name for value in values])
    for value in values:
        if value.name in renamed:
            value.name = renamed[value.name]


def _tolerance_used(report: verification.ParityReport | None, given: verification.Tolerance | None):
    """The tolerance the check applied: the user's, else the loosest per-dtype default of the
    report's outputs (``None`` when nothing was checked)."""
    if given is not None or report is None:
        return given
    used = [output.tolerance for output in report.outputs if output.tolerance is not None]
    if not used:
        return None
    return verification.Tolerance(atol=max(t.atol for t in used), rtol=max(t.rtol for t in used))


def _logged_stage(log: Callable[[str], None]):
    @contextlib.contextmanager
    def stage(name: str):
        started = time.perf_counter()
        detail: list[str] = []
        yield detail
        log(f"  {name:<11} {time.perf_counter() - started:7.2f}s" + (f"  {' '.join(detail)}" if detail else ""))

    return stage


def _save_folder(exported: Any, source: str, output: pathlib.Path) -> list[str]:
    """``save_pretrained`` into a private folder beside ``output``, the components' shared weights
    stored once (``decode.onnx`` reads the tensors it has in common with ``prefill.onnx`` from
    ``prefill.onnx.data``), the runtime files of the checkpoint copied there, then every file moved into ``output`` by :func:`~onnx_modular.storage.folders.publish_folder`
    (one commit: all or nothing, no other model's data overwritten, links in ``output`` replaced, not
    followed, modes kept)."""
    parent = output.parent if str(output.parent) else pathlib.Path(".")
    with locks.temp_folder(parent) as tmpdir:
        staged = tmpdir / "out"
        exported.save_pretrained(staged)
        if len(exported.components) > 1:  # prefill and decode: one copy of the weights they share
            manifest = json.loads((staged / "export.json").read_text(encoding="utf-8"))
            files = [manifest["components"][name]["file"] for name in exported.components]
            share_external_data(staged, files, keep_data_file=True)  # from_pretrained needs each <file>.data
        modes = _copy_runtime_files(source, staged)
        return folders.publish_folder(staged, output, modes=modes)


def check_checkpoint_links(source: str | os.PathLike) -> None:
    """Refuse a checkpoint folder whose ``config.json``, weights or runtime files are links out of it:
    their content would be read (and copied into the output) from wherever they point. The Hub
    cache's own links (``snapshots/<revision>/<file>`` to ``../../blobs/<hash>``) are followed."""
    folder = pathlib.Path(source)
    if not folder.is_dir():
        return
    root = pathlib.Path(os.path.realpath(folder))
    allowed = [root]
    if root.parent.name == "snapshots":
        allowed.append(root.parent.parent / "blobs")
    with os.scandir(folder) as entries:
        for entry in entries:
            if not entry.is_symlink():
                continue
            target = pathlib.Path(os.path.realpath(entry.path))
            if not any(target == place or place in target.parents for place in allowed):
                raise InvalidInputError(
                    f"{str(folder / entry.name)!r} is a link to a file outside the checkpoint folder; refusing to read it.",
                    hint="Copy the file into the folder (cp -L) if it belongs to this checkpoint.",
                )


def _copy_runtime_files(source: str, staged: pathlib.Path) -> dict[str, int]:
    """Copy :data:`RUNTIME_FILES` of the checkpoint folder ``source`` into the staged folder (regular
    files only, read without following a link or blocking on a FIFO); what ``save_pretrained`` wrote
    itself (``generation_config.json``) is kept. Returns ``{name: the source's permission bits}``
    (a private tokenizer file stays private in the output)."""
    folder = pathlib.Path(source)
    copied: dict[str, int] = {}
    if not folder.is_dir():
        return copied
    for name in RUNTIME_FILES:
        if os.path.lexists(staged / name):
            continue
        try:
            fd = os.open(folder / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue  # absent, a link or unreadable: not copied
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                continue
            with open(staged / name, "xb") as out, open(fd, "rb", closefd=False) as src:
                shutil.copyfileobj(src, out, 1 << 20)
        finally:
            os.close(fd)
        copied[name] = stat.S_IMODE(info.st_mode)
    return copied


def streamed(args: argparse.Namespace, log: Callable[[str], None] = lambda text: None) -> dict[str, Any]:
    """``--stream-weights``: what the CLI gives ``export_modular`` (``model`` on meta, ``kwargs``,
    ``dynamic_shapes``, ``weights`` = the folder) to export one .onnx file."""
    check_checkpoint_links(args.factory)
    task = _task(args, log)
    model, inputs, shapes = model_and_inputs(
        args.factory, task, static=args.static, generation=args.generation, stream_weights=True, dtype=args.dtype
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


def quiet_progress_bars(verbose: bool = False) -> None:
    """transformers' own progress bars ("Loading weights", "Writing model shards") would fight the
    CLI's live line, and fill logs when stderr is not a terminal: the CLI's display replaces them."""
    if not verbose:
        transformers.utils.logging.disable_progress_bar()


def _task(args: argparse.Namespace, log: Callable[[str], None]) -> str:
    """``--task`` (an Optimum name is accepted), else the task of ``config.architectures`` (printed)."""
    if args.task is not None:
        return resolve_task(args.task)
    if not pathlib.Path(args.factory).is_dir():
        raise InvalidInputError(
            f"{args.factory!r} is not a checkpoint folder: say what to export it for with --task.",
            hint="For example --task causal-lm-with-past (see onnx-modular export --help).",
        )
    task, architecture = infer_task(args.factory)
    log(f"Task: {task} (inferred from config.architectures: {architecture}; choose another with --task)")
    return task


def run(
    args: argparse.Namespace, log: Callable[[str], None], progress: Any = None
) -> tuple[Any, dict[str, verification.ParityReport]]:
    """The CLI's call (arguments as ``onnx_modular.cli`` parses them)."""
    return export_checkpoint(
        args.factory,
        _task(args, log),
        args.output,
        static=args.static,
        generation=args.generation,
        verify=not args.no_verify,
        keep_on_mismatch=args.keep_on_mismatch,
        opset_version=args.opset,
        dedupe=not args.no_dedupe,
        flat_file=getattr(args, "flat_file", None),
        dtype=args.dtype,
        rtol=args.rtol,
        atol=args.atol,
        io_names=getattr(args, "io_names", None) or "transformers",
        log=log,
        progress=progress,
    )
