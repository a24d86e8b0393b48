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
    onnx-modular diff a.onnx b.onnx [--profile] [--html P]  # two files compared call by call (exit 1: differ)
    onnx-modular split m.onnx --stages 2 -o DIR [--balance time]  # stages cut at module boundaries (or --at PATH ...)
    onnx-modular modularize flat.onnx -o m.onnx [--depth D] [--classes NAME ...]  # hierarchy of a flat file
    onnx-modular genai m.onnx --checkpoint CKPT -o DIR     # onnxruntime-genai folder of a with-past file

Exit codes: 0 success; 1 verification failure (outputs differ beyond tolerance), or ``diff``
found a difference;
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
import os
import pathlib
import sys
import traceback
from collections.abc import Sequence

from onnx_modular.cli.commands import run_diff, run_inline, run_verify
from onnx_modular.cli.exporting import run_export
from onnx_modular.cli.output import (
    EXIT_INTERNAL,
    EXIT_MISMATCH,
    EXIT_OK,
    EXIT_USAGE,
    Mismatch,
    check_json_destination,
    stderr,
)
from onnx_modular.cli.parser import build_parser
from onnx_modular.errors import OnnxModularError, ParityError
from onnx_modular.storage.guard import command_outputs, reading
from onnx_modular.storage.signals import end_quiet_interrupt, interrupt_on_sigterm, signals_deferred

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_MISMATCH", "EXIT_USAGE", "EXIT_INTERNAL"]


def _import_what_runs(args: argparse.Namespace) -> None:
    """Import the heavy libraries the command uses (torch, onnxruntime, onnxscript) up front.

    A signal that lands while a C extension initialises aborts the process or leaves a
    half-imported module (an ImportError traceback): main() runs this with SIGINT/SIGTERM
    deferred, so they are handled right after, as a clean exit 130/143.
    """
    run = getattr(args, "run", None)
    if run is run_export:
        importlib.import_module("onnx_modular.export")
        if os.path.isdir(args.factory) or args.task is not None:
            with contextlib.suppress(ImportError):  # without the [hf] extra, the command says so
                importlib.import_module("onnx_modular.hf.command")
    elif run is run_verify or (run is run_diff and not args.structure_only):
        importlib.import_module("onnx_modular.check.parity")
        importlib.import_module("onnxruntime")
    elif run is run_inline and (args.optimize or args.opset is not None):
        importlib.import_module("onnxscript.optimizer")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code.

    Example::

        main(["tree", "gpt2.onnx", "--depth", "1"])
    """
    end_quiet_interrupt()  # from here Ctrl-C is a KeyboardInterrupt again: every cleanup runs
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
        with interrupt_on_sigterm():  # SIGTERM cleans up like Ctrl-C
            with signals_deferred():  # handled once the imports are done: exit 143, no abort
                _import_what_runs(args)
            # every write of the command refuses its inputs and its other outputs (storage/guard.py)
            with reading(_inputs_of(args)), command_outputs(_outputs_of(args)):
                check_json_destination(getattr(args, "json", None))  # before the command's work
                return args.run(args)
    except Mismatch as e:
        stderr(f"error: {e}")
        return EXIT_MISMATCH
    except OnnxModularError as e:
        if verbose:
            traceback.print_exc()
        # The whole message: what failed, the module involved, and "What to do:"; names from
        # the file cannot drive the terminal.
        stderr(f"error: {_for_the_command_line(e, args)}")
        return EXIT_MISMATCH if isinstance(e, ParityError) else EXIT_USAGE
    except KeyboardInterrupt as e:
        stderr("interrupted")
        return 128 + getattr(e, "signum", 2)  # 130 for SIGINT, 143 for SIGTERM
    except BrokenPipeError:
        # The reader went away (`onnx-modular tree m.onnx | head`): not an error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except Exception:
        traceback.print_exc()
        stderr("error: internal error (the traceback above); please report it with the command and the model.")
        return EXIT_INTERNAL


def _inputs_of(args: argparse.Namespace) -> list:
    """The files a command reads (its models, a checkpoint folder, ``--inputs``, ``--expected``,
    a factory's Python file); ``replace --in-place`` writes its model, so it is left out."""
    names = ("model", "a", "b", "block", "factory", "inputs", "expected", "folder", "checkpoint")
    skip = ("model",) if getattr(args, "in_place", False) else ()
    found = [value for name in names if name not in skip and isinstance(value := getattr(args, name, None), str)]
    factory = getattr(args, "factory", None)
    if isinstance(factory, str) and ":" in factory:  # file.py:make, or package.module:make run from here
        module = factory.rpartition(":")[0]
        found += [module, module.replace(".", os.sep) + ".py", os.path.join(module.replace(".", os.sep), "__init__.py")]
    return [value for value in found if os.path.exists(value)]


def _outputs_of(args: argparse.Namespace) -> dict:
    """The paths a command writes, by option: each its own file (storage/guard.check_distinct)."""
    named = {"-o": getattr(args, "output", None)}
    named.update({f"--{name.replace('_', '-')}": getattr(args, name, None) for name in ("json", "flat_file", "html", "trace")})
    if named["--flat-file"] is True and isinstance(named["-o"], str):  # its default, beside -o
        output = pathlib.Path(named["-o"])
        named["--flat-file"] = str(output.with_name(output.stem + ".flat.onnx")) if output.name else None
    return named


def _for_the_command_line(error: OnnxModularError, args: argparse.Namespace) -> str:
    """The error's text, its Python advice (``error.result.save(path)``) on a parity failure of
    ``export`` replaced by the options that do the same."""
    text = str(error)
    if isinstance(error, ParityError) and error.hint and hasattr(args, "keep_on_mismatch"):
        advice = (
            "The file was kept for inspection (onnx-modular verify FILE; onnx-modular tree FILE)."
            if args.keep_on_mismatch
            else "Rerun with --keep-on-mismatch to write the file anyway (exit code 1) and inspect it "
            "(onnx-modular verify FILE)."
        )
        text = text.replace(
            f"What to do: {error.hint}",
            f"What to do: {advice} If the drift is expected (e.g. float16), loosen --atol/--rtol.",
        )
    return text
