"""The command line's subcommands: one function per command, taking the parsed arguments and
returning the exit code (:mod:`onnx_modular.cli.parser` binds each to its subcommand). ``export``
and ``genai`` are in :mod:`onnx_modular.cli.exporting`."""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Sequence

from onnx_modular.check.parity import user_tolerance
from onnx_modular.cli.output import EXIT_MISMATCH, EXIT_OK, Mismatch, emit_json, stderr, stdout
from onnx_modular.cli.pipeline import run_pipeline, uses_pipeline
from onnx_modular.errors import InvalidInputError
from onnx_modular.files import function_tree, inline_file, load_model_file, random_inputs
from onnx_modular.runtime.inputs import feeds_from_arrays, load_arrays
from onnx_modular.storage import save
from onnx_modular.storage.checks import check_expanded_size
from onnx_modular.storage.display import display_bytes


def needs_option(args: argparse.Namespace, needed: str, options: Sequence[str], *, when_false: bool = False) -> None:
    """Refuse options that only mean something with ``--needed`` (``when_false``: with what
    ``--needed`` skips, as ``--steps`` with ``--no-check``), given without it: an error, never ignored."""
    missing = bool(getattr(args, needed)) if when_false else not getattr(args, needed)
    given = [f"--{o.replace('_', '-')}" for o in options if getattr(args, o, None) not in (None, False)]
    if missing and given:
        flag = f"--{needed.replace('_', '-')}"
        applies = f"appl{'ies' if len(given) == 1 else 'y'}"
        raise InvalidInputError(
            f"{' and '.join(given)} only {applies} " + (f"to what {flag} skips" if when_false else f"with {flag}")
            + "; it would be ignored.",
            hint=f"Drop {' '.join(given)}" + (f", or {flag}." if when_false else f", or add {flag}."),
        )


# -- tree, inline ------------------------------------------------------------------------


def run_tree(args: argparse.Namespace) -> int:
    model = load_model_file(args.model, values=False)  # names and shapes: the weights are not parsed
    tree = function_tree(model)
    depth = args.depth or None  # 0 = all, as for export --depth
    if not emit_json(args.json, tree.filtered(depth, args.class_name)):
        stdout(tree.format(max_depth=depth, class_filter=args.class_name))
    return EXIT_OK


def run_inline(args: argparse.Namespace) -> int:
    source = load_model_file(args.model)
    flat = inline_file(args.model, args.output, only=args.only, optimize=args.optimize, opset_version=args.opset)
    inlined = len(source.functions) - len(flat.functions)
    data = {"path": str(args.model), "output": str(args.output), "nodes": len(flat.graph.node),
            "functions_left": len(flat.functions), "functions_inlined": inlined}
    if emit_json(args.json, data):
        return EXIT_OK
    stdout(
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




def run_verify(args: argparse.Namespace) -> int:
    from onnx_modular.check.parity import check_file

    # None: per output dtype, as the export's check; NaN, infinite or negative values are refused first
    tolerance = user_tolerance(args.rtol, args.atol)
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
    data = {
        "path": str(args.model),
        "inputs": {name: {"shape": list(a.shape), "dtype": str(a.dtype)} for name, a in feeds.items()},
        **report.to_dict(),
    }
    if not emit_json(args.json, data):
        shapes = ", ".join(f"{name}{list(a.shape)}" for name, a in feeds.items())
        stdout(f"inputs: {shapes or '(none)'}" + ("" if args.inputs else f" (random, seed {args.seed})"))
        stdout(report)
    if not report.ok:
        failed = ", ".join(
            f"{o.name} (shape mismatch)" if o.shape_mismatch else f"{o.name} (atol={o.tolerance.atol:g} rtol={o.tolerance.rtol:g})"
            for o in report.outputs
            if not o.ok
        )
        raise Mismatch(f"outputs differ beyond tolerance: {failed}")
    return EXIT_OK


# -- profile -------------------------------------------------------------------------------


def run_profile(args: argparse.Namespace) -> int:
    from onnx_modular.profiling.run import profile

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
        stderr(f"Wrote {path}")
    if to_stdout:
        print(report.to_json())  # JSON escapes every control character itself
    else:
        stdout(report.format(max_depth=args.depth or None, top=args.top))  # call paths from the file: escaped
    return EXIT_OK


# -- extract, replace ----------------------------------------------------------------------


def _npz_feeds(args: argparse.Namespace) -> dict | None:
    if not args.inputs:
        return None
    return feeds_from_arrays(load_model_file(args.model), load_arrays(args.inputs, "--inputs"))


def run_extract(args: argparse.Namespace) -> int:
    from onnx_modular.files.extract import extract

    if args.inputs and not args.with_data:
        raise InvalidInputError("--inputs gives the whole model's inputs for the test data: add --with-data.")
    result = extract(args.model, args.call, args.output, with_data=args.with_data, inputs=_npz_feeds(args))
    if emit_json(args.json, result):
        return EXIT_OK
    stdout(f"Wrote {len(result.models)} model(s) into {args.output}")
    stdout(result)  # call paths and output names come from the file: escaped
    return EXIT_OK


def run_split(args: argparse.Namespace) -> int:
    from onnx_modular.files.split.tool import split

    with warnings.catch_warnings():  # the plan's notes end the report
        warnings.simplefilter("ignore", UserWarning)
        result = split(
            args.model, args.output, stages=args.stages, at=args.at, balance=args.balance, inputs=_npz_feeds(args),
            with_data=not args.no_data,
        )
    if not emit_json(args.json, result):
        stdout(result)  # stage, call and tensor names come from the file: escaped
    return EXIT_OK


def run_generate(args: argparse.Namespace) -> int:
    from onnx_modular.runtime.generation import generate

    try:
        rows = [[int(token) for token in ids.split(",") if token.strip()] for ids in args.input_ids]
    except ValueError:
        raise InvalidInputError(
            f"--input-ids takes comma-separated integers, not {args.input_ids!r}.", hint="--input-ids 1,306,4966"
        ) from None
    if len({len(row) for row in rows}) != 1 or not rows[0]:
        raise InvalidInputError("Every --input-ids needs the same number of tokens (one or more).", hint="--input-ids 1,2,3 --input-ids 4,5,6")
    if uses_pipeline(args):  # a split folder's stages, here or on Ray workers (docs/pipeline.md)
        return run_pipeline(args, rows)
    from onnx_modular.cli.progress import TokenProgress

    tokens = generate(args.model, rows, max_new_tokens=args.max_new_tokens, progress=TokenProgress())
    data = [{"prompt": ids, "new": [int(t) for t in row[len(ids):]]} for row, ids in zip(tokens, rows)]
    if emit_json(args.json, data):
        return EXIT_OK
    for row, ids in zip(tokens, rows):
        stdout(f"prompt {','.join(map(str, ids))} -> new {','.join(str(int(t)) for t in row[len(ids):])}")
    return EXIT_OK


def run_replace(args: argparse.Namespace) -> int:
    from onnx_modular.files.replace import replace

    if args.output is None and not args.in_place:
        raise InvalidInputError("replace needs -o NEW.onnx, or --in-place to edit the model itself.")
    output = args.model if args.output is None else args.output
    result = replace(args.model, args.target, args.block, output, inputs=_npz_feeds(args), in_place=args.in_place)
    if not emit_json(args.json, result):
        stdout(result)  # names escaped
    return EXIT_OK


# -- diff --------------------------------------------------------------------------------


def run_diff(args: argparse.Namespace) -> int:
    from onnx_modular.files.diff.tool import diff

    outputs = {"json": None if args.json == "-" else args.json, "html": args.html}
    for path in outputs.values():
        if path is not None:
            save.check_destination(path)  # a bad path fails before the models run
    if args.structure_only and (args.inputs or args.profile):
        raise InvalidInputError("--structure-only runs nothing: it cannot be combined with --inputs or --profile.")
    result = diff(
        args.a,
        args.b,
        inputs=args.inputs,
        numerics=not args.structure_only,
        profile=args.profile,
        runs=args.runs,
        threads=args.threads,
        seed=args.seed,
    )
    for path in result.save(**outputs):  # written first: a reader that stops early (| head) does not lose them
        stderr(f"Wrote {path}")
    if args.json == "-":
        print(result.to_json())
    else:
        stdout(result.format(max_depth=args.depth or None, top=args.top))
    return EXIT_MISMATCH if result.differs else EXIT_OK


# -- convert -----------------------------------------------------------------------------


def run_convert(args: argparse.Namespace) -> int:
    from onnx_modular.files.convert.tool import convert

    if args.json not in (None, "-"):
        save.check_destination(args.json, reads=[args.model])  # before the work, as the model's path
    needs_option(args, "quantize", ("block_size", "symmetric", "accuracy_level"))
    result = convert(
        args.model, args.output, dtype=args.dtype, keep=args.keep, quantize=args.quantize, exclude=args.exclude,
        block_size=32 if args.block_size is None else args.block_size, symmetric=args.symmetric, accuracy_level=args.accuracy_level,
        auto_keep=args.auto_keep, inputs=args.inputs, verify=not args.no_verify,
    )
    if not emit_json(args.json, result):
        stdout(str(result))
    return EXIT_OK


# -- optimize ----------------------------------------------------------------------------


def run_optimize(args: argparse.Namespace) -> int:
    from onnx_modular.files.optimize.tool import optimize

    report = optimize(args.model, args.output, verify=not args.no_verify, max_positions=args.max_positions,
                      quantize=args.quantize, accuracy_level=args.accuracy_level, int8_lm_head=args.int8_lm_head,
                      accuracy_guard=not args.no_accuracy_guard, inputs=args.inputs,
                      weight_only=args.int8_weight_only, int8_tolerance=args.int8_tolerance,
                      calibration=args.calibration, max_size=args.max_size)
    if not emit_json(args.json, report):
        stdout(report.text())
    return EXIT_OK


# -- modularize --------------------------------------------------------------------------


def run_modularize(args: argparse.Namespace) -> int:
    from onnx_modular.files.modularize.tool import modularize

    if args.depth is not None and args.classes:
        raise InvalidInputError("--depth and --classes both choose the calls to outline: give one of them.")
    # --depth as for tree: 0 = every call, N = calls down to depth N (1: the root's children)
    modules = args.depth if args.depth else (args.classes or "all")
    if args.inputs and args.no_verify:
        raise InvalidInputError("--inputs are the inputs of the comparison with the flat file: drop --no-verify.")
    output_names = args.output_names.split(",") if args.output_names is not None else None
    report = modularize(
        args.model, args.output, dedupe=not args.no_dedupe, modules=modules, inputs=_npz_feeds(args), verify=not args.no_verify,
        infer=args.infer,
        output_names=output_names,
    )
    if not emit_json(args.json, report):
        stdout(report)  # call paths and classes come from the file: escaped
    return EXIT_OK


# -- view --------------------------------------------------------------------------------


def run_view(args: argparse.Namespace) -> int:
    from onnx_modular.files.view import serve

    model = load_model_file(args.model)  # bounded, checked, external-data references included
    check_expanded_size(model, name=repr(args.model))  # what tree refuses is not served either
    try:
        import netron  # noqa: F401 - its static files are served
    except ImportError:
        raise InvalidInputError("Viewing needs the netron package: pip install netron") from None
    # Lifted constants back in their bodies (storage/display.py), unless --as-stored.
    shown = None if args.as_stored else display_bytes(model)
    note = "" if shown is None else " with its lifted constants shown in their bodies (--as-stored: the file as it is)"
    with serve(args.model, model, address=(args.host, args.port), browse=not args.no_browser, shown=shown) as (host, port):
        stderr(f"Netron is serving {args.model}{note} at http://{host}:{port} (Ctrl+C to stop)")
        while True:
            time.sleep(0.1)
    return EXIT_OK


# -- parser and main -----------------------------------------------------------------------
