#!/usr/bin/env python
"""Sweep every model type transformers ships: tiny config, random weights, valid inputs, then
``torch.onnx.export(dynamo=True)`` (flat) and ``export_modular``, each in a time- and
memory-bounded child process. Writes ``docs/coverage.md`` (totals first) and a JSON beside it.

    python scripts/sweep_transformers.py                       # every type: base models, then heads
    python scripts/sweep_transformers.py --sample              # the ~20 architectures of the test suite
    python scripts/sweep_transformers.py --types llama,bert --heads
    python scripts/sweep_transformers.py --compare old.json    # also list what regressed
    python scripts/sweep_transformers.py --resume              # keep rows already in the JSON
    python scripts/sweep_transformers.py --resume --redo failed --jobs 2   # sweep failed rows again, two at once

Each architecture gets a configuration shrunk from its default one by the rules of
:func:`tiny_config` (hidden sizes, layers, heads, experts, vocabulary, image and audio sizes),
with per-architecture :data:`OVERRIDES`; when the model does not run on its inputs at that size,
the depth alone is shrunk (``shallow``: default widths), then nothing (``default``), within
:data:`PARAMETER_BUDGET` (the row's ``config`` says which tier built it); random weights (seed 0) and inputs from
:func:`make_inputs` (token ids, pixels, videos, audio features, waveforms, a codec decoder's latents,
spectrograms, patches with their grid, past values, a policy's state and action noise, a trajectory's
states and returns, by the model's forward; features as wide as the model's feature extractor makes them; a vision- or audio-language model also gets images or audio as
its processor would give them, with as many image or audio tokens in its text as it makes
features; a model read from pixels that takes text gets its prompt; what a forward requires beside
its main input is given by the parameter's name and the config's keys). Each row
records the inputs fed and, where both exporters fail, a note naming the cause (:func:`classify`). The children
are forked from this process after it has paid what each would pay again (:func:`_warm_up`:
imports, the translation registry, transformers' model machinery, the exporters' first call); each has a time limit (``--timeout``) and an address-space limit (``--memory-gb``).
Nothing is downloaded.

The rules, builds, child jobs and report are the test suite's model catalogue (``tests/catalogue/``,
which the tests import); this file is its command line.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import warnings

ROOT = pathlib.Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "tests"):  # the package, and the catalogue this command line runs
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from catalogue import tools_phase  # noqa: E402
from catalogue.building import build_with_tier  # noqa: E402
from catalogue.coverage import (  # noqa: E402
    Row,
    differing,
    markdown_cell,
    read_rows,
    regressions,
    run_environment,
    totals,
    unique_rows,
    write_json,
    write_markdown,
)
from catalogue.jobs import architectures, sweep_one  # noqa: E402
from catalogue.overrides import SAMPLE  # noqa: E402


def _warm_up() -> None:
    """Pay once, in this process before it forks, what every child would pay again: torchlib's
    import and the translation registry (10-12 s), transformers' model machinery (the first model
    built, 8 s), the installed distributions that tag each function's package, and the first
    call of ``torch.export`` and of both exporters (4 s): about 20 s of a typical row's 40.

    With one thread, so that this process never starts OpenMP's pool (not fork-safe), and
    without onnxruntime (``verify=False``, no flat copy checked): the children start clean."""
    import torch
    import transformers  # noqa: F401

    from onnx_modular import export_modular
    from onnx_modular.capture import fx_call_tree, torch_compat

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch_compat.registry()
        for package in ("torch", "transformers"):
            fx_call_tree.package_of(package)
        model, inputs, _, _ = build_with_tier("bert", "BertModel")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            export_modular(model, (), kwargs=inputs, verify=False)
            torch.onnx.export(model, (), kwargs=inputs, dynamo=True, verbose=False)
    finally:
        torch.set_num_threads(threads)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", help="comma-separated model types (default: every type)")
    parser.add_argument("--sample", action="store_true", help="the sample of the default test suite")
    parser.add_argument("--heads", action="store_true", help="also task heads (default with no --types/--sample)")
    parser.add_argument("--no-heads", action="store_true", help="base models only")
    parser.add_argument("--limit", type=int, help="at most this many architectures")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per exporter and architecture")
    parser.add_argument("--memory-gb", type=float, default=6, help="address space per child beyond the parent's")
    parser.add_argument("--output", default=str(ROOT / "docs" / "coverage.md"))
    parser.add_argument("--json", help="default: the output with .json")
    parser.add_argument("--compare", help="an older JSON: list regressions")
    parser.add_argument("--resume", action="store_true", help="keep the rows already in the JSON, sweep the rest")
    parser.add_argument("--redo", help="with --resume: sweep again the kept rows whose modular stage is one of these "
                        "(comma-separated, e.g. capture,verify; 'failed' for every row not modular ok)")
    parser.add_argument("--redo-types", help="with --resume: sweep again the kept rows of these model types (comma-separated)")
    parser.add_argument("--redo-classes", help="with --resume: sweep again the kept rows of these classes (comma-separated)")
    parser.add_argument("--redo-differing", help="with --resume: sweep again the kept rows whose outcome or inputs differ from "
                        "the same row of this JSON (another torch's run on the current commit)")
    parser.add_argument("--no-tools", action="store_true", help="skip the tools phase (every file tool on a modular-ok row's files)")
    parser.add_argument("--redo-untooled", type=int, metavar="N",
                        help="with --resume: sweep again N kept modular-ok rows the tools phase has not run on "
                        "(a seeded random sample across model types)")
    parser.add_argument("--jobs", type=int, default=1, help="architectures swept at once (each in its own children)")
    parser.add_argument("--order", choices=("shuffled", "alphabetical"), default="shuffled",
                        help="shuffled (default): the sample, then base models, then heads, each in a fixed random order")
    parser.add_argument("--notes", default="", help="text put under the totals")
    parser.add_argument("--render", help="only write the Markdown from this JSON (with --notes), no sweep")
    return parser


def _planned(args: argparse.Namespace, heads: bool) -> list[tuple[str, str, str]]:
    """The rows to sweep, in order."""
    planned = architectures(heads=heads)
    if args.sample or args.types:
        wanted = list(SAMPLE) if args.sample else args.types.split(",")
        planned = [row for row in planned if row[0] in wanted]
    elif args.order == "shuffled":  # the sample first, then the rest in a fixed random order:
        import random  # a sweep cut short by its time budget still covers every kind of model

        rest = [row for row in planned if row[0] not in SAMPLE or row[2] != "base"]
        random.Random(0).shuffle(rest)
        base = [row for row in rest if row[2] == "base"]
        planned = [row for row in planned if row[0] in SAMPLE and row[2] == "base"] + base + [r for r in rest if r[2] != "base"]
    if args.limit:
        planned = planned[: args.limit]
    return planned


def _kept(args: argparse.Namespace, rows: list[Row]) -> list[Row]:
    """Of a resumed sweep's rows, those not to sweep again (``--redo*``)."""
    if args.redo:
        stages = set(args.redo.split(","))
        rows = [r for r in rows if not ("failed" in stages and not r.modular_ok or r.stage in stages)]
    if args.redo_types:
        again = set(args.redo_types.split(","))
        rows = [r for r in rows if r.model_type not in again]
    if args.redo_classes:  # a class (every model type it serves) or model_type/class
        again = set(args.redo_classes.split(","))
        rows = [r for r in rows if r.class_name not in again and f"{r.model_type}/{r.class_name}" not in again]
    if args.redo_untooled:
        import random

        untooled = [r.key for r in rows if r.modular_ok and not r.tools]
        again = set(random.Random(51).sample(untooled, min(args.redo_untooled, len(untooled))))
        print(f"{len(again)} of {len(untooled)} modular-ok rows without tools: swept again", flush=True)
        rows = [r for r in rows if r.key not in again]
    if args.redo_differing:
        again = set(differing(rows, read_rows(pathlib.Path(args.redo_differing))))
        print(f"{len(again)} rows differ from {args.redo_differing}: swept again", flush=True)
        rows = [r for r in rows if r.key not in again]
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.render:
        data = json.loads(pathlib.Path(args.render).read_text())
        rows = read_rows(pathlib.Path(args.render))
        write_markdown(pathlib.Path(args.output), rows, data["environment"], data["planned"], args.notes or data.get("notes", ""))
        return 0

    _warm_up()

    output = pathlib.Path(args.output)
    json_path = pathlib.Path(args.json) if args.json else output.with_suffix(".json")
    heads = not args.no_heads and (args.heads or not (args.types or args.sample))
    # a resumed sweep of some types keeps the whole catalogue's planned count and the notes of the table
    previous = json.loads(json_path.read_text()) if args.resume and json_path.exists() else {}
    notes = args.notes or previous.get("notes", "")
    planned = _planned(args, heads)
    rows: list[Row] = read_rows(json_path) if args.resume and json_path.exists() else []
    every = list(rows)  # a row swept again stays until its new row replaces it: a sweep cut short loses none
    rows = _kept(args, rows)
    done = {r.key for r in unique_rows(rows)}
    rows = unique_rows(every)
    environment = run_environment()
    todo = [row for row in planned if (row[0], row[1]) not in done]
    if args.redo_classes:  # in the order given: the most wanted first
        wanted_order = {name: i for i, name in enumerate(args.redo_classes.split(","))}
        todo.sort(key=lambda row: min(wanted_order.get(row[1], len(wanted_order)),
                                      wanted_order.get(f"{row[0]}/{row[1]}", len(wanted_order))))
    order = {(row[0], row[1]): i for i, row in enumerate(planned)}

    def finished(row: Row) -> None:  # in the main thread: rows, JSON and Markdown stay consistent
        row.commit = environment["commit"]
        rows[:] = [r for r in rows if r.key != row.key]
        rows.append(row)
        rows.sort(key=lambda r: order.get(r.key, len(order)))
        print(
            f"{row.model_type:24} {row.class_name:48} built={markdown_cell(row.built):3} flat={markdown_cell(row.flat_ok):3} "
            f"modular={markdown_cell(row.modular_ok):3} {row.seconds:5.0f}s {row.stage or ''} {(row.error or '')[:100]}"
            f"{' tools: ' + tools_phase.cell(row.tools)[:160] if row.tools else ''}",
            flush=True,
        )
        count = max(len(planned), previous.get("planned", 0)) if args.sample or args.types or args.limit else len(planned)
        write_json(json_path, rows, environment, count, notes)
        write_markdown(output, rows, environment, count, notes)

    if args.jobs <= 1:
        for model_type, class_name, task in todo:
            finished(sweep_one(model_type, class_name, task, args.timeout, args.memory_gb, not args.no_tools))
    else:  # threads only wait on their forked children: the exports run in parallel processes
        from concurrent.futures import ThreadPoolExecutor, as_completed

        with ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(sweep_one, *row, args.timeout, args.memory_gb, not args.no_tools) for row in todo]
            for future in as_completed(futures):
                finished(future.result())
    print(json.dumps(totals(rows)))
    if args.compare:
        found = regressions(read_rows(pathlib.Path(args.compare)), rows)
        print(f"{len(found)} regressions against {args.compare}")
        for line in found:
            print("  " + line)
        return 1 if found else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
