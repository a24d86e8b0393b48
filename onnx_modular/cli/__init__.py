"""The ``onnx-modular`` command line: a thin layer over the library.

Subcommands::

    onnx-modular export package.module:factory -o m.onnx   # export_modular + report + tree
    onnx-modular tree m.onnx [--depth N] [--class NAME]    # the function-call tree
    onnx-modular inline m.onnx flat.onnx [--only NAME ...] [--optimize]  # onnx.inliner, atomically
    onnx-modular verify m.onnx [--inputs x.npz]            # onnxruntime: modular vs inlined copy
    onnx-modular profile m.onnx [--depth D] [--html P]     # time per module call (onnxruntime's profiler)
    onnx-modular view m.onnx [--port P]                    # Netron on localhost
    onnx-modular extract m.onnx h.1.attn -o OUT [--with-data]  # one call (or class) as its own model
    onnx-modular replace m.onnx GPT2Block block.onnx -o new.onnx  # a block as the body of a call / class

Exit codes: 0 success; 1 verification failure (outputs differ beyond tolerance);
2 usage error or bad input (unreadable model, bad factory, export failure, ...);
3 internal error (a bug: the traceback is printed). Errors of onnx_modular print
``error: ...`` on stderr with the module involved and the ``What to do:`` hint;
``--verbose`` adds the traceback first.

Example::

    python -m onnx_modular export onnx_modular.hf.demo:gpt2 -o gpt2.onnx
    python -m onnx_modular tree gpt2.onnx --depth 2
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import logging
import math
import os
import pathlib
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from typing import Any


from onnx_modular.cli.progress import EXPORT_STAGES, Progress
from onnx_modular.errors import InvalidInputError, OnnxModularError, ParityError
from onnx_modular.files import (
    function_tree,
    inline_file,
    load_model_file,
    random_inputs,
    save,
)
from onnx_modular.files.display import display_bytes
from onnx_modular.files.inputs import feeds_from_arrays, load_arrays
from onnx_modular.files.parity import Tolerance
from onnx_modular.format.text import shown

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_MISMATCH", "EXIT_USAGE", "EXIT_INTERNAL"]

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3


class _Mismatch(Exception):
    """Verification ran and found differences beyond tolerance (exit code 1)."""


def _safe(text: Any) -> str:
    """``text`` with every line escaped (:func:`~onnx_modular.format.text.shown`): names from a file
    (outputs, nodes, functions) cannot move the cursor, clear the screen or reorder the line."""
    return "\n".join(shown(line) for line in str(text).split("\n"))


def _stderr(text: str) -> None:
    print(_safe(text), file=sys.stderr, flush=True)


def _stdout(text: Any) -> None:
    print(_safe(text))


def _json_safe(value: Any) -> Any:
    """Infinities and NaNs (e.g. the difference of mismatched shapes) as strings: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def _print_json(data: Any) -> None:
    print(json.dumps(_json_safe(data), indent=2, allow_nan=False))


# -- export ------------------------------------------------------------------------------


def _load_factory(spec: str):
    """``package.module:factory`` or ``path/to/file.py:factory`` -> the callable."""
    module_name, sep, attribute = spec.rpartition(":")
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


def _export(args: argparse.Namespace) -> int:
    checkpoint = os.path.isdir(args.factory) or args.task is not None
    if checkpoint and not args.stream_weights:
        return _export_checkpoint(args)
    for option in ("static", "generation", "stream_weights", "dtype"):
        if getattr(args, option) and not checkpoint:
            raise InvalidInputError(f"--{option.replace('_', '-')} applies to a checkpoint folder.")
    from onnx_modular.export import export_modular  # imports torch: only when exporting

    if checkpoint:  # --stream-weights: the checkpoint's model on meta, its weights read from the folder
        command = importlib.import_module("onnx_modular.hf.command")  # imports transformers
        command.quiet_progress_bars(getattr(args, "verbose", False))
        values = command.streamed(args, _stderr)
    else:
        values = _call_factory(args.factory)
    started = time.perf_counter()
    _stderr(f"Exporting {args.factory} to {args.output}")
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
            )
    except ParityError as e:
        _report_mismatch(args, e, {"model": e.report} if e.report is not None else {})
        if args.keep_on_mismatch and e.result is not None:
            e.result.save(args.output)
            _stderr(f"Kept {args.output} (--keep-on-mismatch) although its outputs differ from PyTorch.")
        raise
    _stderr(f"  {'total':<11} {time.perf_counter() - started:7.2f}s")
    tree = result.hierarchy
    if args.json:
        _print_json(
            {
                "path": str(args.output),
                "ok": True if result.report is None else result.report.ok,
                "timings": result.timings,
                "report": None if result.report is None else result.report.to_dict(),
                "flat_path": None if result.flat_path is None else str(result.flat_path),
                "flat_report": None if result.flat_report is None else result.flat_report.to_dict(),
                "tree": tree.to_dict(),
            }
        )
    else:
        if result.report is not None:
            _stdout(result.blocks if result.blocks is not None else result.report)
        size = pathlib.Path(args.output).stat().st_size
        _stdout(f"Wrote {args.output} ({size / 1e6:.1f} MB): {result.summary().splitlines()[0]}")
        if result.flat_path is not None:
            if result.flat_report is not None:
                _stdout(f"Flat copy: {result.flat_report}")
            _stdout(f"Wrote {result.flat_path} ({result.flat_path.stat().st_size / 1e6:.1f} MB): every call inlined, optimized")
        _print_tree(args, tree, args.output)
    return EXIT_OK


def _report_mismatch(args: argparse.Namespace, error: ParityError, reports: dict) -> None:
    if args.json:
        kept = args.output if args.keep_on_mismatch and error.result is not None else None
        first = next(iter(reports.values()), None)
        _print_json(
            {
                "path": kept,
                "ok": False,
                "report": None if first is None else first.to_dict(),
                "reports": {name: report.to_dict() for name, report in reports.items()},
            }
        )
    else:
        for report in reports.values():
            _stdout(report)


def _print_tree(args: argparse.Namespace, tree, path: str) -> None:
    _stdout(tree.format(max_depth=args.depth or None))
    if args.depth and tree.height > args.depth:
        _stdout(f"(calls deeper than {args.depth} not shown; see them with: onnx-modular tree {path})")


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

    started = time.perf_counter()
    command.quiet_progress_bars(getattr(args, "verbose", False))
    _stderr(f"Exporting {args.factory} to {args.output}")
    try:
        with _quiet_warnings(args), Progress(sys.stderr, command.STAGES, output=args.output) as progress:
            exported, reports = command.run(args, progress.line, progress)
    except ParityError as e:
        reports = getattr(e, "reports", None) or ({"model": e.report} if e.report is not None else {})
        _report_mismatch(args, e, reports)
        if args.keep_on_mismatch:
            _stderr(f"Kept {args.output} (--keep-on-mismatch) although its outputs differ from PyTorch.")
        raise
    _stderr(f"  {'total':<11} {time.perf_counter() - started:7.2f}s")
    output = pathlib.Path(args.output)
    files = [output] if output.suffix == ".onnx" else [output / f"{name}.onnx" for name in exported.components]
    if args.json:
        _print_json(
            {
                "path": str(output),
                "ok": all(report.ok for report in reports.values()),
                "components": {
                    name: {
                        "file": str(file),
                        "report": reports[name].to_dict() if name in reports else None,
                        "tree": function_tree(load_model_file(file)).to_dict(),
                    }
                    for name, file in zip(exported.components, files)
                },
            }
        )
        return EXIT_OK
    for name, file in zip(exported.components, files):
        if name in reports:
            _stdout(reports[name])
        size = file.stat().st_size + sum(f.stat().st_size for f in file.parent.glob(file.name + ".data"))
        _stdout(f"Wrote {file} ({size / 1e6:.1f} MB)")
        _print_tree(args, function_tree(load_model_file(file)), str(file))
    return EXIT_OK


# -- tree, inline ------------------------------------------------------------------------


def _tree(args: argparse.Namespace) -> int:
    model = load_model_file(args.model)
    tree = function_tree(model)
    depth = args.depth or None  # 0 = all, as for export --depth
    if args.json:
        _print_json(tree.filtered(depth, args.class_name).to_dict())
    else:
        _stdout(tree.format(max_depth=depth, class_filter=args.class_name))
    return EXIT_OK


def _inline(args: argparse.Namespace) -> int:
    source = load_model_file(args.model)
    flat = inline_file(args.model, args.output, only=args.only, optimize=args.optimize, opset_version=args.opset)
    inlined = len(source.functions) - len(flat.functions)
    _stdout(
        f"Wrote {args.output}: {len(flat.graph.node)} nodes in the main graph, "
        f"{len(flat.functions)} local functions left ({inlined} inlined)"
    )
    return EXIT_OK


# -- verify ------------------------------------------------------------------------------


def _parse_dims(items: Sequence[str]) -> dict[str, int]:
    dims = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            size = int(value)
        except ValueError:
            size = -1
        if not sep or not name or size < 1:
            raise InvalidInputError(f"--dim expects name=size with size >= 1, got {item!r}.")
        dims[name] = size
    return dims




def _verify(args: argparse.Namespace) -> int:
    from onnx_modular.files.parity import check_file

    tolerance = Tolerance(args.atol, args.rtol)  # refuses NaN, infinite or negative values first
    model = load_model_file(args.model)
    dims = _parse_dims(args.dim)
    if args.inputs:
        if dims:
            raise InvalidInputError("--dim sizes random inputs; it cannot be combined with --inputs.")
        feeds = feeds_from_arrays(model, load_arrays(args.inputs, "--inputs"))
    else:
        feeds = random_inputs(model, dims=dims, seed=args.seed)
    expected = load_arrays(args.expected, "--expected") if args.expected else None
    report = check_file(args.model, feeds, expected=expected, tolerance=tolerance)
    if args.json:
        _print_json(
            {
                "path": str(args.model),
                "inputs": {name: {"shape": list(a.shape), "dtype": str(a.dtype)} for name, a in feeds.items()},
                **report.to_dict(),
            }
        )
    else:
        shapes = ", ".join(f"{name}{list(a.shape)}" for name, a in feeds.items())
        _stdout(f"inputs: {shapes or '(none)'}" + ("" if args.inputs else f" (random, seed {args.seed})"))
        _stdout(report)
    if not report.ok:
        failed = ", ".join(o.name for o in report.outputs if not o.ok)
        raise _Mismatch(f"outputs differ beyond atol={args.atol:g} rtol={args.rtol:g}: {failed}")
    return EXIT_OK


# -- profile -------------------------------------------------------------------------------


def _profile(args: argparse.Namespace) -> int:
    from onnx_modular.files.profile import profile

    outputs = {"json": args.json, "trace": args.trace, "html": args.html}
    to_stdout = outputs["json"] == "-"
    for path in outputs.values():
        if path is not None and path != "-":
            save.check_destination(path)  # a bad path fails before the model runs
    dims = _parse_dims(args.dim)
    if args.inputs and dims:
        raise InvalidInputError("--dim sizes random inputs; it cannot be combined with --inputs.")
    report = profile(
        args.model,
        args.inputs,
        runs=args.runs,
        warmup=args.warmup,
        execution_provider=args.provider,
        threads=args.threads,
        optimization=args.optimization,
        dims=dims or None,
        seed=args.seed,
    )
    written = report.save(**{kind: None if path == "-" else path for kind, path in outputs.items()})
    for path in written:  # written first: a reader that stops early (| head) does not lose them
        _stderr(f"Wrote {path}")
    print(report.to_json() if to_stdout else report.format(max_depth=args.depth or None, top=args.top))
    return EXIT_OK


# -- extract, replace ----------------------------------------------------------------------


def _npz_feeds(args: argparse.Namespace) -> dict | None:
    if not args.inputs:
        return None
    return feeds_from_arrays(load_model_file(args.model), load_arrays(args.inputs, "--inputs"))


def _extract(args: argparse.Namespace) -> int:
    from onnx_modular.files.extract import extract

    if args.inputs and not args.with_data:
        raise InvalidInputError("--inputs gives the whole model's inputs for the test data: add --with-data.")
    result = extract(args.model, args.call, args.output, with_data=args.with_data, inputs=_npz_feeds(args))
    print(f"Wrote {len(result.models)} model(s) into {args.output}")
    print(result)
    return EXIT_OK


def _replace(args: argparse.Namespace) -> int:
    from onnx_modular.files.replace import replace

    print(replace(args.model, args.target, args.block, args.output, inputs=_npz_feeds(args)))
    return EXIT_OK


# -- view --------------------------------------------------------------------------------


def _view(args: argparse.Namespace) -> int:
    from onnx_modular.files.view import serve

    model = load_model_file(args.model)  # bounded, checked, external-data references included
    try:
        import netron
    except ImportError:
        raise InvalidInputError("Viewing needs the netron package: pip install netron") from None
    # netron logs its own "Serving ..." line (configuring the root logger if nobody did); one is enough.
    logging.getLogger("netron").setLevel(logging.WARNING)
    # Lifted constants back in their bodies (files/display.py), unless --as-stored.
    shown = None if args.as_stored else display_bytes(model)
    note = "" if shown is None else " with its lifted constants shown in their bodies (--as-stored: the file as it is)"
    with serve(args.model, model, address=(args.host, args.port), browse=not args.no_browser, shown=shown) as (host, port):
        _stderr(f"Netron is serving {args.model}{note} at http://{host}:{port} (Ctrl+C to stop)")
        while netron.status((host, port)):
            time.sleep(0.1)
    return EXIT_OK


# -- parser and main -----------------------------------------------------------------------


def _positive(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="print tracebacks of errors"
    )
    parser = argparse.ArgumentParser(
        prog="onnx-modular",
        description="Export PyTorch models to ONNX with every module call as a nested local function, "
        "and inspect, inline, verify or view such files.",
        epilog="Exit codes: 0 ok, 1 verification failure, 2 usage error or bad input, 3 internal error.",
        parents=[common],
    )
    from onnx_modular import __version__

    parser.add_argument("--version", action="version", version=f"onnx-modular {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    export = commands.add_parser(
        "export",
        parents=[common],
        help="export a model from a factory function or a transformers checkpoint folder",
        description="Call FACTORY (package.module:function or file.py:function), which returns "
        "(model, args), (model, args, kwargs), (model, args, kwargs, dynamic_shapes) or a dict with "
        "those keys, and export the model with export_modular. Or export a transformers checkpoint "
        "(a folder with config.json and weights, or a model already in the local Hugging Face cache) "
        "for --task, with sample inputs built for the task, dynamic in batch and sequence; needs "
        "the [hf] extra. Nothing is downloaded.",
    )
    export.add_argument(
        "factory",
        metavar="FACTORY|CHECKPOINT",
        help="package.module:function, path/file.py:function, or a checkpoint folder (with --task)",
    )
    export.add_argument(
        "-o",
        "--output",
        required=True,
        help="the .onnx file to write; for a checkpoint, a folder instead writes what "
        "ExportedModel.save_pretrained writes (needed with --generation)",
    )
    export.add_argument(
        "--task",
        default=None,
        metavar="TASK",
        help="what to export a checkpoint for (which head, which sample inputs): feature-extraction, masked-lm, "
        "causal-lm, causal-lm-with-past, seq2seq-lm, image-classification, or Optimum's name (text-generation, "
        "text-generation-with-past, fill-mask, text2text-generation); default: inferred from config.architectures",
    )
    export.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "float16", "bfloat16"],
        help="checkpoint: the precision to export in (default: the checkpoint's); a bfloat16 file is checked on its "
        "float32-widened copy (onnxruntime's CPU provider has no bfloat16 kernels)",
    )
    export.add_argument("--static", action="store_true", help="checkpoint: fixed shapes (default: dynamic batch and sequence)")
    export.add_argument("--generation", action="store_true",
                        help="checkpoint: export the generation components (prefill, decode) into the -o folder")
    export.add_argument("--stream-weights", action="store_true", help="checkpoint: never load the weights whole "
                        "(model on meta, each tensor streamed to <output>.data, verified block by block)")
    export.add_argument("--keep-on-mismatch", action="store_true", help="write the model even when parity fails (exit code 1)")
    export.add_argument("--no-verify", action="store_true", help="skip the onnxruntime-vs-PyTorch parity check")
    export.add_argument("--no-dedupe", action="store_true", help="keep one function per call (no sharing)")
    export.add_argument("--atol", type=float, default=None, help="absolute tolerance of the check (default: per output dtype)")
    export.add_argument("--rtol", type=float, default=None, help="relative tolerance of the check (default: per output dtype)")
    export.add_argument(
        "--flat-file",
        nargs="?",
        const=True,
        default=None,
        metavar="PATH",
        help="also write the flat deployment copy (every call inlined, optimized, verified) to PATH "
        "(default <name>.flat.onnx beside -o), for runtimes without local functions (OpenVINO, TensorRT)",
    )
    export.add_argument(
        "--opset", type=int, default=None, metavar="N", help="ONNX opset of the default domain (17 to 23 and up; default 18)"
    )
    export.add_argument(
        "--depth",
        type=_positive,
        default=2,
        metavar="N",
        help="depth of the printed tree (default 2; 0 = all); --json always has the whole tree",
    )
    export.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    export.set_defaults(run=_export)

    tree = commands.add_parser(
        "tree",
        parents=[common],
        help="print the function-call tree of an ONNX file",
        description="Print the call hierarchy of the local functions of any ONNX file: call path, "
        "function, domain, calls of that function in the whole model, nodes in its body, and the "
        "weight elements flowing into the call.",
    )
    tree.add_argument("model", help="the .onnx file")
    tree.add_argument(
        "--depth", type=_positive, default=None, metavar="N", help="show calls down to depth N (0 = all, the default)"
    )
    tree.add_argument(
        "--class",
        dest="class_name",
        default=None,
        metavar="NAME",
        help="keep calls whose function or class matches NAME (a glob such as 'GPT2*'), and their ancestors",
    )
    tree.add_argument("--json", action="store_true", help="print the tree as JSON")
    tree.set_defaults(run=_tree)

    inline = commands.add_parser(
        "inline",
        parents=[common],
        help="inline local functions (all, or selected ones)",
        description="Write a copy with local functions inlined by onnx.inliner. The output is written "
        "atomically: a failure leaves no file behind.",
    )
    inline.add_argument("model", help="the .onnx file to read")
    inline.add_argument("output", help="the .onnx file to write")
    inline.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="NAME",
        help="inline only these functions (NAME or DOMAIN:NAME); calls nested in them stay calls",
    )
    inline.add_argument(
        "--optimize",
        action="store_true",
        help="then run onnxscript's optimizer on the result, as torch.onnx.export does "
        "(shares the per-call constants: a flat file for deployment)",
    )
    inline.add_argument(
        "--opset", type=int, default=None, metavar="N", help="convert the copy to this opset, body by body (17 and up)"
    )
    inline.set_defaults(run=_inline)

    verify = commands.add_parser(
        "verify",
        parents=[common],
        help="compare the model with its inlined copy in onnxruntime",
        description="Run the model and its inlined copy in onnxruntime on the same inputs (random "
        "from the declared shapes and types, or --inputs) and compare every output.",
    )
    verify.add_argument("model", help="the .onnx file")
    verify.add_argument("--inputs", default=None, metavar="FILE.npz", help="inputs by name (or arr_0, arr_1, ...)")
    verify.add_argument(
        "--expected", default=None, metavar="FILE.npz", help="expected outputs by name; the model must match them too"
    )
    verify.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    verify.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=SIZE",
        help="size (>= 1) of a symbolic dimension in random inputs (default 2); repeatable",
    )
    verify.add_argument("--atol", type=float, default=1e-4, help="absolute tolerance (default 1e-4)")
    verify.add_argument("--rtol", type=float, default=1e-3, help="relative tolerance (default 1e-3)")
    verify.add_argument("--json", action="store_true", help="print the report as JSON")
    verify.set_defaults(run=_verify)

    prof = commands.add_parser(
        "profile",
        parents=[common],
        help="time every module call in onnxruntime (its profiler, on the call tree)",
        description="Run the model in onnxruntime with its profiler and attribute every kernel to the "
        "module call it came from (nodes onnxruntime fuses across modules go to the innermost call "
        "holding all their parts). Prints the call tree with inclusive and self time (sums of the "
        "kernels' medians over the runs), share and kernels, the slowest calls by self time and the "
        "time per class. Inputs are random from the declared shapes unless --inputs is given.",
    )
    prof.add_argument("model", help="the .onnx file")
    prof.add_argument("--inputs", default=None, metavar="FILE.npz", help="inputs by name (or arr_0, arr_1, ...)")
    prof.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    prof.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE",
                      help="size of a symbolic dimension in random inputs (default 2); repeatable")
    prof.add_argument("--runs", type=int, default=10, metavar="N", help="measured runs (default 10)")
    prof.add_argument("--warmup", type=int, default=2, metavar="N", help="runs before them, not measured (default 2)")
    prof.add_argument("--threads", type=int, default=None, metavar="N",
                      help="onnxruntime intra-op threads (default: onnxruntime's)")
    prof.add_argument("--provider", default=None, metavar="EP", help="execution provider (default CPU; cuda, ...)")
    prof.add_argument("--optimization", default="all", choices=["all", "extended", "basic", "disabled"],
                      help="onnxruntime graph optimization level (default all, as onnxruntime)")
    prof.add_argument("--depth", type=_positive, default=None, metavar="N", help="show calls down to depth N")
    prof.add_argument("--top", type=_positive, default=10, metavar="N", help="slowest calls by self time to list (default 10)")
    prof.add_argument("--json", default=None, metavar="PATH", help="write the profile as JSON ('-': print it instead of the tree)")
    prof.add_argument("--trace", default=None, metavar="PATH", help="write a Chrome trace (Perfetto, speedscope)")
    prof.add_argument("--html", default=None, metavar="PATH", help="write a self-contained HTML page with a flame chart")
    prof.set_defaults(run=_profile)

    extract = commands.add_parser(
        "extract",
        parents=[common],
        help="write one module call (or every call of a class) as a model of its own",
        description="Write the function of a call (a module path such as h.1.attn) or of every call of a "
        "class (GPT2Block: one model per distinct function) as a model: the body as its graph, the formal "
        "inputs as inputs, the weights and constants the call receives as initializers. The output "
        "folder gets one test case per model in ONNX's layout (<case>/model.onnx, test_data_set_<n>/).",
    )
    extract.add_argument("model", help="the .onnx file")
    extract.add_argument("call", help="a module path (h.1.attn) or a class or function name (GPT2Block)")
    extract.add_argument("-o", "--output", required=True, metavar="OUT", help="a new or empty folder")
    extract.add_argument(
        "--with-data",
        action="store_true",
        help="also write each call's inputs and outputs from one onnxruntime run of the whole model "
        "(one data set per call), checked on the extracted model",
    )
    extract.add_argument(
        "--inputs", default=None, metavar="FILE.npz", help="the whole model's inputs for --with-data (default: random, seed 0)"
    )
    extract.set_defaults(run=_extract)

    replace = commands.add_parser(
        "replace",
        parents=[common],
        help="make a block's graph the body of a class's functions or of one call",
        description="Replace the body of every function of a class, or of one call path (which then gets "
        "a function of its own), by the graph of BLOCK (e.g. an extracted model after editing). The "
        "result is checked, compared with the original in onnxruntime, and written atomically.",
    )
    replace.add_argument("model", help="the .onnx file")
    replace.add_argument("target", help="a class or function name (GPT2Block) or a module path (h.1)")
    replace.add_argument("block", help="the .onnx file whose graph becomes the body")
    replace.add_argument("-o", "--output", required=True, metavar="NEW.onnx", help="the file to write")
    replace.add_argument(
        "--inputs", default=None, metavar="FILE.npz", help="inputs of the comparison with the original (default: random, seed 0)"
    )
    replace.set_defaults(run=_replace)

    view = commands.add_parser(
        "view",
        parents=[common],
        help="open the model in Netron (served on localhost)",
        description="Serve the model with Netron (pip install netron) and open it in a browser. "
        "In Netron, click the ƒ on a call node to enter its function.",
    )
    view.add_argument("model", help="the .onnx file")
    view.add_argument("--port", type=int, default=8080, help="port to serve on (default 8080)")
    view.add_argument("--host", default="localhost", help="address to serve on (default localhost)")
    view.add_argument("--no-browser", action="store_true", help="do not open a browser")
    view.add_argument(
        "--as-stored",
        action="store_true",
        help="show the file exactly as stored (by default, constants lifted out of the bodies for onnxruntime "
        "are shown back inside them, which reads like the module code)",
    )
    view.set_defaults(run=_view)
    return parser


def _import_what_runs(args: argparse.Namespace) -> None:
    """Import the heavy libraries the command uses (torch, onnxruntime, onnxscript) up front.

    A signal that lands while a C extension initialises aborts the process or leaves a
    half-imported module (an ImportError traceback): main() runs this with SIGINT/SIGTERM
    deferred, so they are handled right after, as a clean exit 130/143.
    """
    run = getattr(args, "run", None)
    if run is _export:
        importlib.import_module("onnx_modular.export")
        if os.path.isdir(args.factory) or args.task is not None:
            with contextlib.suppress(ImportError):  # without the [hf] extra, the command says so
                importlib.import_module("onnx_modular.hf.command")
    elif run is _verify:
        importlib.import_module("onnx_modular.files.parity")
        importlib.import_module("onnxruntime")
    elif run is _inline and (args.optimize or args.opset is not None):
        importlib.import_module("onnxscript.optimizer")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code.

    Example::

        main(["tree", "gpt2.onnx", "--depth", "1"])
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version and usage errors
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if getattr(args, "run", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    verbose = getattr(args, "verbose", False)
    try:
        with save.interrupt_on_sigterm():  # SIGTERM cleans up like Ctrl-C
            with save.signals_deferred():  # handled once the imports are done: exit 143, no abort
                _import_what_runs(args)
            return args.run(args)
    except _Mismatch as e:
        _stderr(f"error: {e}")
        return EXIT_MISMATCH
    except OnnxModularError as e:
        if verbose:
            traceback.print_exc()
        # The whole message: what failed, the module involved, and "What to do:"; names from
        # the file cannot drive the terminal.
        _stderr(f"error: {e}")
        return EXIT_MISMATCH if isinstance(e, ParityError) else EXIT_USAGE
    except KeyboardInterrupt as e:
        _stderr("interrupted")
        return 128 + getattr(e, "signum", 2)  # 130 for SIGINT, 143 for SIGTERM
    except BrokenPipeError:
        # The reader went away (`onnx-modular tree m.onnx | head`): not an error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except Exception:
        traceback.print_exc()
        _stderr("error: internal error (the traceback above); please report it with the command and the model.")
        return EXIT_INTERNAL
