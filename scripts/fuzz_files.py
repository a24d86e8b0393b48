"""Fuzz the file tools (``tree``, ``inline``, ``verify``) with malformed ONNX files.

Each case is one file (sometimes a folder with external data, a FIFO or a device) made
from a real export (bytes mutated: flips, truncation, splices, huge varints; or the
protobuf edited: huge dims, bad external-data references, odd names and metadata) or
generated from scratch (local functions with recursion, missing callees, deep nesting,
call-expansion bombs of 24 functions each calling the one below twice, directly or
through ``If`` branches, many large inputs). Every command runs through the public CLI
entry point ``onnx_modular.cli.main([...])`` in its own child process, with a timeout
and an address-space limit (``RLIMIT_AS``), and its outcome is classified:

- ``ok``: exit 0, or exit 1/2 with an ``error:`` line and no traceback;
- failures: ``traceback`` (an uncaught exception, or exit 3 "internal error"),
  ``signal`` (killed by a signal: segfault, abort), ``timeout``, ``memory`` (the address
  space limit was hit: ``MemoryError`` or ``std::bad_alloc``), ``no-error-line``,
  ``raw-escape`` (a name from the file reached the terminal with its ESC/BEL/U+202E),
  ``data-loss`` (a file the case said must survive changed, or a lock link was followed out of
  the folder), ``outside-ref`` (``inline`` wrote a file referring to data outside its folder).

Children are forked from a server process that has already imported the CLI (and frozen
its objects out of the garbage collector), so a command costs its own work, not an
interpreter start.

The fork server, the case generators and the campaign are test code (``tests/fuzzing/``, which the
tests import); this file is their command line.

Examples::

    python scripts/fuzz_files.py --cases 2000 --log fuzz_files.jsonl     # the campaign
    python scripts/fuzz_files.py --cases 1000 --first 1000 --log b.jsonl  # its second half, in parallel
    python scripts/fuzz_files.py --cases 50 --timeout 5                  # a quick run
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "tests"):  # the package, and the fuzzer this command line runs
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from fuzzing.cases import GENERATORS, run_campaign  # noqa: E402
from fuzzing.runner import failure_classes, serve, summary  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--summarize", type=pathlib.Path, default=None, help="print the summary of a log and exit")
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first", type=int, default=0, help="number of the first case (to split a campaign)")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per command")
    parser.add_argument("--memory-mb", type=int, default=2048, help="address space per command above its start")
    parser.add_argument("--only", nargs="*", choices=list(GENERATORS), help="only these case kinds")
    parser.add_argument("--log", type=pathlib.Path, default=None, help="append one JSON line per case")
    parser.add_argument("--workdir", type=pathlib.Path, default=None, help="keep seeds here (default: a temp folder)")
    args = parser.parse_args(argv)
    if args.serve:
        serve()
        return 0
    if args.summarize:
        records = [json.loads(line) for line in args.summarize.read_text().splitlines() if line.strip()]
        print(summary(records))
        return 1 if failure_classes(records) else 0
    start = time.monotonic()

    def progress(index: int, record: dict) -> None:
        bad = [r["argv"][0] + ":" + r["outcome"] for r in record.get("results", []) if r["outcome"] != "ok"]
        if bad or index % 50 == 0:
            print(f"[{time.monotonic() - start:7.0f}s] case {index} {record['kind']}: {' '.join(bad) or 'ok'}", flush=True)

    records = run_campaign(
        args.cases,
        seed=args.seed,
        first=args.first,
        timeout=args.timeout,
        memory_mb=args.memory_mb,
        only=args.only,
        log=args.log,
        workdir=args.workdir,
        progress=progress,
    )
    print(summary(records))
    print(f"wall time {time.monotonic() - start:.0f} s")
    return 1 if failure_classes(records) else 0


if __name__ == "__main__":
    sys.exit(main())
