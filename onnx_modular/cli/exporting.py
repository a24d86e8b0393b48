"""The ``export`` and ``genai`` commands: a factory (``package.module:function``), a checkpoint
folder (``--task``, ``--generation``, ``--stream-weights``) or an onnxruntime-genai folder
(``--genai``), with the parity report, the written files and the tree (``docs/cli.md``)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import pathlib
import sys
import time
import warnings
from typing import Any

from onnx_modular.cli.output import EXIT_OK, emit_json, stderr, stdout
from onnx_modular.cli.progress import EXPORT_STAGES, Progress
from onnx_modular.errors import InvalidInputError, ParityError
from onnx_modular.files import function_tree, load_model_file
from onnx_modular.storage import save
from onnx_modular.storage.load import stored_bytes

__all__ = ["run_export", "run_genai"]

# -- export ------------------------------------------------------------------------------


def _load_factory(spec: str):
    """``package.module:factory`` or ``path/to/file.py:factory`` -> the callable."""
    module_name, sep, attribute = spec.rpartition(":")
    if not sep and not _importable(spec):  # `export gpt2`, `export org/name`: a Hub id, or a missing folder
        raise InvalidInputError(
            f"{spec!r} is neither a checkpoint folder nor a factory ('package.module:function').",
            hint=f"onnx_modular never downloads: if {spec!r} is a Hub model, download it first "
            f"(hf download {spec} --local-dir {spec.rstrip('/').rsplit('/', 1)[-1]}) and pass that folder; "
            "a model already in the local Hugging Face cache exports by its id with --task.",
        )
    if not sep or not module_name or not attribute:
        raise InvalidInputError(f"Expected 'package.module:factory', got {spec!r}.")
    if module_name.endswith(".py"):
        file = pathlib.Path(module_name)
        if not file.is_file():
            raise InvalidInputError(f"The factory file {module_name!r} does not exist.")
        module_spec = importlib.util.spec_from_file_location(file.stem, file)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # SystemExit and others: the factory file's own doing
            raise InvalidInputError(f"Running {module_name!r} failed: {type(e).__name__}: {e}") from e
    else:
        # Like `python -m`, find modules in the current folder (console scripts do not).
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise InvalidInputError(f"Cannot import {module_name!r}: {e}") from e
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            raise InvalidInputError(f"Importing {module_name!r} failed: {type(e).__name__}: {e}") from e
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise InvalidInputError(f"{module_name!r} has no attribute {attribute!r}.")
        target = getattr(target, part)
    if not callable(target):
        raise InvalidInputError(f"{spec!r} is not callable (a factory returning (model, args) is expected).")
    if module_name == "builtins" or getattr(target, "__module__", None) == "builtins":
        raise InvalidInputError(
            f"{spec!r} is a Python builtin, not a factory: it cannot return a model.",
            hint="Name a function of your own that returns (model, args): 'package.module:make' or 'file.py:make'.",
        )
    return target


def _importable(name: str) -> bool:
    """Whether ``name``'s top-level package can be imported (``pkg.module`` given without ``:function``)."""
    try:
        return importlib.util.find_spec(name.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def _call_factory(spec: str) -> dict[str, Any]:
    """Call the factory and normalize its result to model/args/kwargs/dynamic_shapes."""
    factory = _load_factory(spec)
    try:
        result = factory()
    except SystemExit as e:
        raise InvalidInputError(
            f"The factory {spec!r} exited (SystemExit({e.code!r})) instead of returning a model.",
            hint="A factory must return (model, args) or a dict with 'model'; it must not call sys.exit().",
        ) from e
    except KeyboardInterrupt:
        raise  # Ctrl+C, or the factory's own: either way "interrupted", exit 130, nothing written
    except BaseException as e:  # an exception class of the factory's own, not derived from Exception
        raise InvalidInputError(f"The factory {spec!r} raised {type(e).__name__}: {e}") from e
    keys = ("model", "args", "kwargs", "dynamic_shapes")
    if isinstance(result, dict):
        unknown = sorted(set(result) - set(keys))
        if unknown or "model" not in result:
            raise InvalidInputError(
                f"The factory {spec!r} returned a dict with keys {sorted(result)}; expected 'model' and "
                f"optionally {', '.join(repr(k) for k in keys[1:])}."
            )
        values = {key: result.get(key) for key in keys}
    elif isinstance(result, (tuple, list)) and 2 <= len(result) <= 4:
        values = dict(zip(keys, result))
    else:
        raise InvalidInputError(
            f"The factory {spec!r} returned {type(result).__name__}; expected (model, args), "
            "(model, args, kwargs), (model, args, kwargs, dynamic_shapes) or a dict with those keys."
        )
    if values.get("args") is None:
        values["args"] = ()
    return values


def run_export(args: argparse.Namespace) -> int:
    checkpoint = os.path.isdir(args.factory) or args.task is not None
    if checkpoint and getattr(args, "fixed_input", None):
        raise InvalidInputError(
            "--fixed-input applies to a factory's keyword inputs, not to a checkpoint folder.",
            hint="Write a factory returning {'model': ..., 'kwargs': {...}} and name the input to fix.",
        )
    if getattr(args, "optimize", False) and not getattr(args, "genai", False):
        raise InvalidInputError(
            "export --optimize goes with --genai (the folder carries the fused file).",
            hint="Export, then run `onnx-modular optimize M.onnx -o M.opt.onnx` (docs/optimize.md).",
        )
    if getattr(args, "genai", False):
        return _export_genai(args, checkpoint)
    if checkpoint and not args.stream_weights:
        return _export_checkpoint(args)
    for option in ("static", "generation", "stream_weights", "dtype"):
        if getattr(args, option) and not checkpoint:
            raise InvalidInputError(f"--{option.replace('_', '-')} applies to a checkpoint folder.")
    if getattr(args, "io_names", "transformers") != "transformers":
        raise InvalidInputError(
            "--io-names optimum applies to a checkpoint exported in memory"
            + (" (not with --stream-weights)." if checkpoint else "."),
            hint="Export without --stream-weights, or name the inputs and outputs yourself: "
            "export_modular(..., input_names=[...], output_names=[...]).",
        )
    from onnx_modular.export import export_modular  # imports torch: only when exporting

    if checkpoint:  # --stream-weights: the checkpoint's model on meta, its weights read from the folder
        command = importlib.import_module("onnx_modular.hf.command")  # imports transformers
        command.quiet_progress_bars(getattr(args, "verbose", False))
        values = command.streamed(args, stderr)
    else:
        values = _call_factory(args.factory)
    started = time.perf_counter()
    stderr(f"Exporting {args.factory} to {args.output}")
    try:
        with _quiet_warnings(args), Progress(sys.stderr, EXPORT_STAGES, output=args.output) as progress:
            result = export_modular(
                values["model"],
                values["args"],
                args.output,
                kwargs=values.get("kwargs"),
                dynamic_shapes=values.get("dynamic_shapes"),
                weights=values.get("weights"),
                opset_version=args.opset,
                dedupe=not args.no_dedupe,
                verify=not args.no_verify,
                rtol=args.rtol,
                atol=args.atol,
                progress=progress,
                flat_file=args.flat_file,
                fixed_inputs=args.fixed_input or (),
            )
    except ParityError as e:
        _report_mismatch(args, e, {"model": e.report} if e.report is not None else {})
        if args.keep_on_mismatch and e.result is not None:
            e.result.save(args.output)
            stderr(f"Kept {args.output} (--keep-on-mismatch) although its outputs differ from PyTorch.")
        raise
    stderr(f"  {'total':<11} {time.perf_counter() - started:7.2f}s")
    tree = result.hierarchy
    if emit_json(
        args.json,
        {
            "path": str(args.output),
            "ok": True if result.report is None else result.report.ok,
            "timings": result.timings,
            "capture_strategy": result.capture_strategy,
            "report": None if result.report is None else result.report.to_dict(),
            "flat_path": None if result.flat_path is None else str(result.flat_path),
            "flat_report": None if result.flat_report is None else result.flat_report.to_dict(),
            "tree": tree.to_dict(),
        },
    ):
        return EXIT_OK
    if result.report is not None:
        stdout(result.blocks if result.blocks is not None else result.report)
    size = stored_bytes(args.output)  # the .data file included
    stdout(f"Wrote {args.output} ({size / 1e6:.1f} MB): {result.summary().splitlines()[0]}")
    if result.flat_path is not None:
        _print_flat(result.flat_path, result.flat_report)
    _print_tree(args, tree, args.output)
    return EXIT_OK


def _print_flat(path: pathlib.Path, report) -> None:
    """The flat copy's parity report and its "Wrote" line (``--flat-file``)."""
    if report is not None:
        stdout(f"Flat copy: {report}")
    stdout(f"Wrote {path} ({stored_bytes(path) / 1e6:.1f} MB): every call inlined, optimized")


def _report_mismatch(args: argparse.Namespace, error: ParityError, reports: dict) -> None:
    kept = args.output if args.keep_on_mismatch and error.result is not None else None
    first = next(iter(reports.values()), None)
    data = {
        "path": kept,
        "ok": False,
        "report": None if first is None else first.to_dict(),
        "reports": {name: report.to_dict() for name, report in reports.items()},
    }
    if not emit_json(args.json, data):
        for report in reports.values():
            stdout(report)


def _print_tree(args: argparse.Namespace, tree, path: str) -> None:
    stdout(tree.format(max_depth=args.depth or None))
    if args.depth and tree.height > args.depth:
        stdout(f"(calls deeper than {args.depth} not shown; see them with: onnx-modular tree {path})")


@contextlib.contextmanager
def _quiet_warnings(args: argparse.Namespace):
    """Hide torch's and transformers' deprecation notices (they say nothing about the user's model) unless -v."""
    with warnings.catch_warnings():
        if not getattr(args, "verbose", False):
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
        yield


def _export_checkpoint(args: argparse.Namespace) -> int:
    """A transformers checkpoint folder (``--task``): see :mod:`onnx_modular.hf.command`."""
    from onnx_modular.hf import (
        command,  # imports transformers: a clear error without the [hf] extra
    )
    from onnx_modular.hf.exporter import modular_result

    started = time.perf_counter()
    command.quiet_progress_bars(getattr(args, "verbose", False))
    stderr(f"Exporting {args.factory} to {args.output}")
    try:
        with _quiet_warnings(args), Progress(sys.stderr, command.STAGES, output=args.output) as progress:
            exported, reports = command.run(args, progress.line, progress)
    except ParityError as e:
        reports = getattr(e, "reports", None) or ({"model": e.report} if e.report is not None else {})
        _report_mismatch(args, e, reports)
        if args.keep_on_mismatch:
            stderr(f"Kept {args.output} (--keep-on-mismatch) although its outputs differ from PyTorch.")
        raise
    stderr(f"  {'total':<11} {time.perf_counter() - started:7.2f}s")
    output = pathlib.Path(args.output)
    files = [output] if output.suffix == ".onnx" else [output / f"{name}.onnx" for name in exported.components]
    flat = modular_result(exported) if output.suffix == ".onnx" and args.flat_file else None
    if emit_json(
        args.json,
        {
            "path": str(output),
            "ok": all(report.ok for report in reports.values()),
            "flat_path": None if flat is None or flat.flat_path is None else str(flat.flat_path),
            "flat_report": None if flat is None or flat.flat_report is None else flat.flat_report.to_dict(),
            "components": {
                name: {
                    "file": str(file),
                    "report": reports[name].to_dict() if name in reports else None,
                    "tree": function_tree(load_model_file(file, values=False)).to_dict(),
                }
                for name, file in zip(exported.components, files)
            },
        },
    ):
        return EXIT_OK
    written: set[str] = set()  # data files already counted: decode reads prefill's (one copy of shared weights)
    for name, file in zip(exported.components, files):
        if name in reports:
            stdout(reports[name])
        data = save.referenced_data(file)
        shared = sorted(data & written)
        if shared:
            shared_bytes = sum((file.parent / location).stat().st_size for location in shared)
            stdout(
                f"Wrote {file} ({(stored_bytes(file) - shared_bytes) / 1e6:.1f} MB; its other "
                f"{shared_bytes / 1e6:.1f} MB of weights are read from {', '.join(shared)}, stored once)"
            )
        else:
            stdout(f"Wrote {file} ({stored_bytes(file) / 1e6:.1f} MB)")
        written |= data
        if flat is not None and flat.flat_path is not None:
            _print_flat(flat.flat_path, flat.flat_report)
        _print_tree(args, function_tree(load_model_file(file, values=False)), str(file))
    return EXIT_OK


def _export_genai(args: argparse.Namespace, checkpoint: bool) -> int:
    """``export CKPT --genai -o DIR``: see :mod:`onnx_modular.hf.genai`."""
    conflicts = [f"--{o.replace('_', '-')}" for o in ("generation", "stream_weights", "static", "flat_file", "fixed_input")
                 if getattr(args, o, None)]
    task = args.task and args.task.replace("text-generation-with-past", "causal-lm-with-past")
    if not checkpoint or conflicts or task not in (None, "causal-lm-with-past"):
        raise InvalidInputError(
            "--genai exports a checkpoint folder's decoder with its cache (task causal-lm-with-past, Optimum's names) "
            f"into one folder; {' '.join(conflicts) or 'this export'} does not combine with it.",
            hint="onnx-modular export CKPT --genai -o DIR (docs/genai.md).",
        )
    from onnx_modular.hf import command, genai  # imports transformers: a clear error without the [hf] extra

    started = time.perf_counter()
    command.quiet_progress_bars(getattr(args, "verbose", False))
    stderr(f"Exporting {args.factory} to {args.output} for onnxruntime-genai")
    try:
        with _quiet_warnings(args), Progress(sys.stderr, genai.GENAI_STAGES, output=args.output) as progress:
            folder = genai.export_genai(
                args.factory, args.output, verify=not args.no_verify, keep_on_mismatch=args.keep_on_mismatch,
                opset_version=args.opset, dedupe=not args.no_dedupe, dtype=args.dtype, rtol=args.rtol,
                atol=args.atol, progress=progress, optimize=args.optimize,
            )
    except ParityError as e:
        if e.report is not None:
            stdout(e.report)
        raise
    stderr(f"  {'total':<11} {time.perf_counter() - started:7.2f}s")
    return _print_genai(args, folder)


def _print_genai(args: argparse.Namespace, folder: Any) -> int:
    model = pathlib.Path(folder.path) / "model.onnx"
    data = {
        "path": str(folder.path),
        "ok": (folder.report is None or folder.report.ok) and (folder.check is None or folder.check.ok),
        "report": None if folder.report is None else folder.report.to_dict(),
        "genai_check": None if folder.check is None else folder.check.to_dict(),
        "genai_config": folder.config,
        "optimized": None if folder.optimized is None else folder.optimized.to_dict(),
    }
    if emit_json(args.json, data):
        return EXIT_OK
    if folder.optimized is not None:
        stdout(folder.optimized.text())
    if folder.report is not None:
        stdout(folder.report)
    if folder.check is not None:
        stdout(f"Generation: {folder.check}")
    pipeline = folder.config["model"]["decoder"].get("pipeline")
    files = (f"{len(pipeline)} stages, decoder.pipeline" if pipeline else f"model.onnx {stored_bytes(model) / 1e6:.1f} MB")
    stdout(f"Wrote {folder.path}/ ({files}, genai_config.json: "
           f"type {folder.config['model']['type']!r}, past_present_share_buffer "
           f"{str(folder.config['search']['past_present_share_buffer']).lower()})")
    if hasattr(args, "depth") and not pipeline:
        _print_tree(args, function_tree(load_model_file(model, values=False)), str(model))
    return EXIT_OK


def run_genai(args: argparse.Namespace) -> int:
    """``genai M.onnx --checkpoint CKPT -o DIR``: the folder of a file already exported."""
    from onnx_modular.cli.commands import needs_option
    from onnx_modular.hf import command, genai  # imports transformers

    needs_option(args, "no_check", ("steps", "keep_on_mismatch"), when_false=True)  # both are the check's
    command.quiet_progress_bars(getattr(args, "verbose", False))
    with _quiet_warnings(args):
        folder = genai.write_genai_folder(
            args.model, args.checkpoint, args.output, check=not args.no_check, steps=20 if args.steps is None else args.steps,
            keep_on_mismatch=args.keep_on_mismatch, optimize=args.optimize,
        )
    return _print_genai(args, folder)
