"""The ``onnx-modular`` command line: a thin layer over the library.

Subcommands::

    onnx-modular export package.module:factory -o m.onnx   # export_modular + report + tree
    onnx-modular tree m.onnx [--depth N] [--class NAME]    # the function-call tree
    onnx-modular inline m.onnx flat.onnx [--only NAME ...] [--optimize]  # onnx.inliner, atomically
    onnx-modular verify m.onnx [--inputs x.npz]            # onnxruntime: modular vs inlined copy
    onnx-modular view m.onnx [--port P]                    # Netron on localhost

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

import numpy as np

from onnx_modular.cli.progress import EXPORT_STAGES, Progress
from onnx_modular.errors import InvalidInputError, OnnxModularError, ParityError
from onnx_modular.files import (
    check_feeds,
    function_tree,
    inline_file,
    load_model_file,
    model_inputs,
    random_inputs,
    save,
)
from onnx_modular.files.inputs import load_arrays
from onnx_modular.files.parity import Tolerance
from onnx_modular.format.text import shown

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_MISMATCH", "EXIT_USAGE", "EXIT_INTERNAL"]

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3


class _Mismatch(Exception):
    """Verification ran and found differences beyond tolerance (exit code 1)."""


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


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
        except (Exception, SystemExit) as e:
            raise InvalidInputError(f"Running {module_name!r} failed: {type(e).__name__}: {e}") from e
    else:
        # Like `python -m`, find modules in the current folder (console scripts do not).
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise InvalidInputError(f"Cannot import {module_name!r}: {e}") from e
        except (Exception, SystemExit) as e:
            raise InvalidInputError(f"Importing {module_name!r} failed: {type(e).__name__}: {e}") from e
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise InvalidInputError(f"{module_name!r} has no attribute {attribute!r}.")
        target = getattr(target, part)
    if not callable(target):
        raise InvalidInputError(f"{spec!r} is not callable (a factory returning (model, args) is expected).")
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
    except Exception as e:
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
                "tree": tree.to_dict(),
            }
        )
    else:
        if result.report is not None:
            print(result.blocks if result.blocks is not None else result.report)
        size = pathlib.Path(args.output).stat().st_size
        print(f"Wrote {args.output} ({size / 1e6:.1f} MB): {result.summary().splitlines()[0]}")
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
            print(report)


def _print_tree(args: argparse.Namespace, tree, path: str) -> None:
    print(tree.format(max_depth=args.depth or None))
    if args.depth and tree.height > args.depth:
        print(f"(calls deeper than {args.depth} not shown; see them with: onnx-modular tree {path})")


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
            print(reports[name])
        size = file.stat().st_size + sum(f.stat().st_size for f in file.parent.glob(file.name + ".data"))
        print(f"Wrote {file} ({size / 1e6:.1f} MB)")
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
        print(tree.format(max_depth=depth, class_filter=args.class_name))
    return EXIT_OK


def _inline(args: argparse.Namespace) -> int:
    source = load_model_file(args.model)
    flat = inline_file(args.model, args.output, only=args.only, optimize=args.optimize, opset_version=args.opset)
    inlined = len(source.functions) - len(flat.functions)
    print(
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
        if not sep or not name or size < 0:
            raise InvalidInputError(f"--dim expects name=size with size >= 0, got {item!r}.")
        dims[name] = size
    return dims


def _feeds_from_npz(model, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [value.name for value in model_inputs(model)]
    positional = [f"arr_{i}" for i in range(len(arrays))]
    if sorted(arrays) == sorted(positional) and not set(arrays) & set(names):
        arrays = {name: arrays[f"arr_{i}"] for i, name in enumerate(names) if f"arr_{i}" in arrays}
    check_feeds(model, arrays)
    return arrays


def _verify(args: argparse.Namespace) -> int:
    from onnx_modular.files.parity import check_file

    tolerance = Tolerance(args.atol, args.rtol)  # refuses NaN, infinite or negative values first
    model = load_model_file(args.model)
    dims = _parse_dims(args.dim)
    if args.inputs:
        if dims:
            raise InvalidInputError("--dim sizes random inputs; it cannot be combined with --inputs.")
        feeds = _feeds_from_npz(model, load_arrays(args.inputs, "--inputs"))
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
        print(f"inputs: {shapes or '(none)'}" + ("" if args.inputs else f" (random, seed {args.seed})"))
        print(report)
    if not report.ok:
        failed = ", ".join(o.name for o in report.outputs if not o.ok)
        raise _Mismatch(f"outputs differ beyond atol={args.atol:g} rtol={args.rtol:g}: {failed}")
    return EXIT_OK


# -- view --------------------------------------------------------------------------------


def _view(args: argparse.Namespace) -> int:
    load_model_file(args.model)
    try:
        import netron
    except ImportError:
        raise InvalidInputError("Viewing needs the netron package: pip install netron") from None
    # netron logs its own "Serving ..." line (configuring the root logger if nobody did); one is enough.
    logging.getLogger("netron").setLevel(logging.WARNING)
    try:
        address = netron.start(str(args.model), address=(args.host, args.port), browse=not args.no_browser)
    except OSError as e:
        raise InvalidInputError(f"Netron cannot listen on {args.host}:{args.port}: {e.strerror or e}") from e
    host, port = address if isinstance(address, tuple) else (args.host, address)
    _stderr(f"Netron is serving {args.model} at http://{host}:{port} (Ctrl+C to stop)")
    netron.wait()
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
        help="size of a symbolic dimension in random inputs (default 2); repeatable",
    )
    verify.add_argument("--atol", type=float, default=1e-4, help="absolute tolerance (default 1e-4)")
    verify.add_argument("--rtol", type=float, default=1e-3, help="relative tolerance (default 1e-3)")
    verify.add_argument("--json", action="store_true", help="print the report as JSON")
    verify.set_defaults(run=_verify)

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
    view.set_defaults(run=_view)
    return parser


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
            return args.run(args)
    except _Mismatch as e:
        _stderr(f"error: {e}")
        return EXIT_MISMATCH
    except OnnxModularError as e:
        if verbose:
            traceback.print_exc()
        # The whole message: what failed, the module involved, and "What to do:"; names from
        # the file cannot drive the terminal.
        _stderr("error: " + "\n".join(shown(line) for line in str(e).split("\n")))
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
