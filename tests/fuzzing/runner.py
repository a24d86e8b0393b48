"""Running one command of the file-tool fuzzer in a limited child, and classifying its outcome.

:func:`serve` is the fork server (started by :class:`ForkServer` as ``python tests/fuzzing/runner.py
--serve``): it imports the CLI once, then forks one child per request, each with a timeout and an
address-space limit (``RLIMIT_AS``), running ``onnx_modular.cli.main([...])`` (or ``run_stages``).
:func:`classify` and :func:`run_command` turn a child's exit and output into an outcome (``ok`` or
one of :data:`FAILURES`); :func:`failure_classes`, :func:`open_item` and :func:`summary` group a
campaign's failures into classes.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import pathlib
import re
import resource
import signal
import subprocess
import sys
import time

import numpy

COMMANDS = ("tree", "inline", "verify")  # the default; a case may give its own (convert, diff, split, run_stages, ...)
FAILURES = ("traceback", "signal", "timeout", "memory", "no-error-line", "raw-escape", "data-loss", "outside-ref")
#: Bytes that must never reach the terminal from a file's names: ESC, BEL, and the bidirectional
#: override that turns a line around (each is printed escaped, ``\\x1b``, ``\\u202e``).
RAW_ESCAPES = ("\x1b", "\x07", "\u202e", "\u2066")


# -- running one command in a limited child --------------------------------------------


def _child(argv: list[str], cwd: str, memory_bytes: int) -> None:
    """In the forked child: limits, redirections, then the CLI; never returns."""
    os.chdir(cwd)
    for fd, name in ((0, os.devnull), (1, ".stdout"), (2, ".stderr")):
        handle = os.open(name, os.O_RDONLY) if fd == 0 else os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    with open("/proc/self/statm") as statm:
        limit = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    code = 4
    try:
        from onnx_modular.cli import main

        code = _run_stages_command(argv) if argv[0] == "run_stages" else main(argv)
    except BaseException:
        import traceback

        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 4)


def _run_stages_command(argv: list[str]) -> int:
    """``run_stages FOLDER FEEDS`` (no CLI command runs it): ``FEEDS`` is ``dict``, ``list`` or
    ``shadow`` (an input named like a stage output); errors as the CLI prints them."""
    from onnx_modular.errors import OnnxModularError
    from onnx_modular.files.split.tool import run_stages

    x = numpy.ones((2, 3), numpy.float32)
    feeds = {"dict": {"x": x}, "list": [x], "shadow": {"x": x, "stage_0/t": x}}[argv[2]]
    try:
        run_stages(argv[1], feeds)
    except OnnxModularError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def serve() -> None:
    """The fork server: import the CLI once, then fork one child per request line.

    Request (stdin, one JSON line): ``{"argv": [...], "cwd": ..., "timeout": s, "memory": bytes}``;
    answer (stdout): ``{"exitcode": n (negative: signal), "timed_out": bool, "seconds": s}``.
    """
    import onnx.inliner  # noqa: F401 - everything the commands import, imported once
    import onnxruntime  # noqa: F401

    import onnx_modular.cli

    if os.environ.get("FUZZ_FILES_IMPORT_TORCH") == "1":
        import onnx_modular.export
        import onnx_modular.hf.command  # noqa: F401 - transformers

    gc.freeze()  # children would otherwise copy every inherited page on their first collection
    requests, answers = sys.stdin, sys.stdout
    for line in requests:
        request = json.loads(line)
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(request["argv"], request["cwd"], request["memory"])
        timed_out, status = False, 0
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() - start > request["timeout"]:
                timed_out = True
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.005)
        exitcode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        answers.write(json.dumps({"exitcode": exitcode, "timed_out": timed_out, "seconds": time.monotonic() - start}) + "\n")
        answers.flush()


class ForkServer:
    """A ``serve()`` process; restarted if it dies. ``torch=True``: it also imports what
    ``export`` needs (torch, transformers), once, instead of in every child."""

    def __init__(self, torch: bool = False):
        self.process = None
        self.torch = torch

    def _start(self):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        if self.torch:
            env["FUZZ_FILES_IMPORT_TORCH"] = "1"
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def run(self, argv: list[str], cwd: pathlib.Path, timeout: float, memory_bytes: int) -> dict:
        if self.process is None or self.process.poll() is not None:
            self._start()
        request = {"argv": argv, "cwd": str(cwd), "timeout": timeout, "memory": memory_bytes}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the fork server died")
        return json.loads(line)

    def close(self):
        if self.process is not None:
            self.process.stdin.close()
            self.process.wait()


def classify(exitcode: int | None, stderr: str, timed_out: bool) -> str:
    if timed_out:
        return "timeout"
    if "MemoryError" in stderr or "bad_alloc" in stderr or "Unable to allocate" in stderr:
        return "memory"
    if exitcode is not None and exitcode < 0:
        return "signal"
    if "Traceback (most recent call last)" in stderr:
        return "traceback"
    if exitcode == 0:
        return "ok"
    if exitcode in (1, 2) and re.search(r"^(onnx-modular [a-z_]+: )?error: ", stderr, re.M):  # ours, or argparse's usage error
        return "ok"
    return "no-error-line"


def _exception_of(stderr: str) -> str:
    """The last ``SomeError: ...`` line of a traceback (type only), or the signal text."""
    for line in reversed(stderr.splitlines()):
        match = re.match(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|bad_alloc)):?", line.strip())
        if match:
            return match.group(1)
    if "bad_alloc" in stderr:
        return "std::bad_alloc"
    return ""


def run_command(server: ForkServer, argv: list[str], cwd: pathlib.Path, timeout: float, memory_bytes: int) -> dict:
    answer = server.run(argv, cwd, timeout, memory_bytes)
    err, out = cwd / ".stderr", cwd / ".stdout"
    stderr = err.read_text(errors="replace") if err.exists() else ""
    stdout = out.read_text(errors="replace") if out.exists() else ""
    outcome = classify(answer["exitcode"], stderr, answer["timed_out"])
    if outcome == "ok" and any(raw in stdout or raw in stderr for raw in RAW_ESCAPES):
        outcome = "raw-escape"  # a name from the file reached the terminal unescaped
    result = {"argv": argv, "outcome": outcome, "exitcode": answer["exitcode"], "seconds": round(answer["seconds"], 2)}
    if outcome != "ok":
        result["exception"] = _exception_of(stderr) if outcome != "signal" else f"signal {-answer['exitcode']}"
        result["stderr_tail"] = stderr[-600:]
    return result




# Failure classes known to be open, mapped to their issue item: a failure no rule matches
# is a new finding (``NEW`` in the summary). Issue 12's items 1-7 are fixed, so none is left;
# add a rule only for a class that is reported and left open on purpose.
# Rules on the error text come first (a random byte flip can hit any item), then the case kind.
OPEN_BY_TEXT: list[tuple[str, int]] = []
OPEN_BY_KIND: dict[tuple[str, str], int] = {}


def command_label(argv: list[str]) -> str:
    """``tree``, ``inline``, ``verify``, or ``verify --seed`` when an extra flag was given."""
    if argv[0] == "verify" and len(argv) > 2:
        return f"verify {argv[2]}"
    return argv[0]


def open_item(kind: str, result: dict) -> int | None:
    """The issue-12 item a failing result belongs to, or None for a new finding."""
    text = result.get("stderr_tail", "")
    for fragment, item in OPEN_BY_TEXT:
        if fragment in text:
            return item
    command = result["argv"][0]
    for key in ((kind, command), (kind, "*")):
        if key in OPEN_BY_KIND:
            return OPEN_BY_KIND[key]
    return None


def failure_classes(records: list[dict]) -> dict[tuple, list[int]]:
    """(item or None, kind, command label, outcome, exception) -> case numbers."""
    classes: dict[tuple, list[int]] = collections.defaultdict(list)
    for record in records:
        for result in record.get("results", []):
            if result["outcome"] != "ok":
                key = (
                    open_item(record["kind"], result),
                    record["kind"],
                    command_label(result["argv"]),
                    result["outcome"],
                    result.get("exception", ""),
                )
                classes[key].append(record["case"])
    return dict(classes)


def new_failures(records: list[dict]) -> dict[tuple, list[int]]:
    """The failure classes that match no open item."""
    return {key: cases for key, cases in failure_classes(records).items() if key[0] is None}


def summary(records: list[dict]) -> str:
    lines = []
    commands = sum(len(r.get("results", [])) for r in records)
    failing = sum(1 for r in records for x in r.get("results", []) if x["outcome"] != "ok")
    lines.append(f"{len(records)} cases, {commands} commands, {failing} failing commands")
    errors = [r for r in records if "generator_error" in r]
    if errors:
        lines.append(f"{len(errors)} generator errors, e.g. {errors[0]['kind']}: {errors[0]['generator_error']}")
    kinds = collections.Counter(r["kind"] for r in records)
    lines.append("cases per kind: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    classes = failure_classes(records)
    lines.append(f"  {'count':>5s}  {'item':4s} {'kind':18s} {'command':15s} {'outcome':13s} exception")
    for (item, kind, command, outcome, exception), cases in sorted(classes.items(), key=lambda c: (c[0][0] or 99, -len(c[1]))):
        lines.append(
            f"  {len(cases):5d}  {item or 'NEW':>4} {kind:18s} {command:15s} {outcome:13s} {exception} e.g. case {cases[:5]}"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # what ForkServer starts: ``python tests/fuzzing/runner.py --serve``
    if sys.argv[1:] != ["--serve"]:
        sys.exit("usage: runner.py --serve (the fuzzer's fork server; python scripts/fuzz_files.py runs campaigns)")
    serve()
