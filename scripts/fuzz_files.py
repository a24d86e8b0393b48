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

Examples::

    python scripts/fuzz_files.py --cases 2000 --log fuzz_files.jsonl     # the campaign
    python scripts/fuzz_files.py --cases 1000 --first 1000 --log b.jsonl  # its second half, in parallel
    python scripts/fuzz_files.py --cases 50 --timeout 5                  # a quick run
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import hashlib
import io
import json
import os
import pathlib
import random
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable

import numpy
import onnx
from onnx import TensorProto, helper

COMMANDS = ("tree", "inline", "verify")  # the default; a case may give its own (convert, diff, split, run_stages, ...)
FAILURES = ("traceback", "signal", "timeout", "memory", "no-error-line", "raw-escape", "data-loss", "outside-ref")
#: Bytes that must never reach the terminal from a file's names: ESC, BEL, and the bidirectional
#: override that turns a line around (each is printed escaped, ``\\x1b``, ``\\u202e``).
RAW_ESCAPES = ("\x1b", "\x07", "\u202e", "\u2066")
#: A generator's promises about its case, checked after the commands (``case/.checks.json``):
#: ``keep`` files that must stay byte-identical (or stay FIFOs), ``inputs`` an .npz for verify,
#: ``optimize`` to run ``inline --optimize``.
CHECKS_FILE = ".checks.json"
DOMAIN = "pkg.fuzz"

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


# -- seeds: real exports ----------------------------------------------------------------

_SEED_SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn
    from onnx_modular import export_modular

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.proj = nn.Linear(8, 8)
        def forward(self, x):
            return x + torch.tanh(self.proj(self.norm(x)))

    class Net(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.blocks = nn.ModuleList([Block() for _ in range(2)])
            self.head = nn.Linear(8, width)
        def forward(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(x).softmax(-1)

    torch.manual_seed(0)
    folder = sys.argv[1]
    ids = torch.randint(0, 16, (2, 5))
    export_modular(Net(8).eval(), (ids,), folder + "/small.onnx")
    export_modular(Net(64).eval(), (ids,), folder + "/external/ext.onnx", external_data=True)
    """
)


def make_seeds(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """Export the seed models once (a subprocess: torch is needed only here)."""
    seeds = {"small": folder / "small.onnx", "external": folder / "external" / "ext.onnx"}
    if all(path.exists() for path in seeds.values()):
        return seeds
    (folder / "external").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", _SEED_SCRIPT, str(folder)], check=True, env=env, capture_output=True)
    return seeds


# -- case generators: each writes into ``case`` and returns the model file name ---------------

Generator = Callable[[random.Random, pathlib.Path, dict], str]


def _write(case: pathlib.Path, data: bytes, name: str = "m.onnx") -> str:
    (case / name).write_bytes(data)
    return name


def _seed_bytes(rng: random.Random, seeds: dict) -> bytes:
    return seeds["small"].read_bytes()


def gen_bitflips(rng, case, seeds):
    data = bytearray(_seed_bytes(rng, seeds))
    for _ in range(rng.choice([1, 2, 4, 8, 32])):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return _write(case, bytes(data))


def gen_byte_overwrite(rng, case, seeds):
    data = bytearray(_seed_bytes(rng, seeds))
    for _ in range(rng.choice([1, 3, 10])):
        pos = rng.randrange(len(data))
        chunk = bytes(rng.choice([0x00, 0xFF, 0x7F, 0x80, rng.randrange(256)]) for _ in range(rng.randint(1, 6)))
        data[pos : pos + len(chunk)] = chunk
    return _write(case, bytes(data))


def gen_truncate(rng, case, seeds):
    data = _seed_bytes(rng, seeds)
    return _write(case, data[: rng.randrange(len(data))])


def gen_splice(rng, case, seeds):
    data = _seed_bytes(rng, seeds)
    a, b = sorted(rng.randrange(len(data)) for _ in range(2))
    c = rng.randrange(len(data))
    return _write(case, data[:c] + data[a:b] + data[c:])


def gen_huge_varint(rng, case, seeds):
    data = bytearray(_seed_bytes(rng, seeds))
    pos = rng.randrange(len(data) - 10)
    data[pos : pos + 10] = b"\xff" * 9 + b"\x01"
    return _write(case, bytes(data))


def _seed_model(seeds: dict, which: str = "small") -> onnx.ModelProto:
    return onnx.load(str(seeds[which]), load_external_data=False)


def gen_huge_dim(rng, case, seeds):
    model = _seed_model(seeds)
    values = list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info)
    for value in rng.sample(values, min(len(values), rng.randint(1, 3))):
        dims = value.type.tensor_type.shape.dim
        if dims:
            dims[rng.randrange(len(dims))].dim_value = rng.choice([2**31, 2**40 - 1, 2**62, 0])
    return _write(case, model.SerializeToString())


def gen_bad_callee(rng, case, seeds):
    model = _seed_model(seeds)
    calls = [n for n in model.graph.node if n.domain.startswith("pkg.")]
    for function in model.functions:
        calls += [n for n in function.node if n.domain.startswith("pkg.")]
    node = rng.choice(calls)
    how = rng.randrange(3)
    if how == 0:
        node.op_type = "Missing" + node.op_type
    elif how == 1:
        node.domain = "pkg.nowhere"
    else:
        del node.input[:]  # a call with too few inputs
    return _write(case, model.SerializeToString())


def gen_shuffled_functions(rng, case, seeds):
    model = _seed_model(seeds)
    functions = list(model.functions)
    rng.shuffle(functions)
    del model.functions[:]
    model.functions.extend(functions)
    # and one body loses a node (a dangling value reference)
    function = rng.choice(model.functions)
    if len(function.node) > 1:
        del function.node[rng.randrange(len(function.node))]
    return _write(case, model.SerializeToString())


def gen_metadata(rng, case, seeds):
    model = _seed_model(seeds)
    targets = [model.metadata_props] + [f.metadata_props for f in model.functions]
    props = rng.choice(targets)
    value = rng.choice(
        [
            "[" * 100_000 + "]" * 100_000,
            '{"a": ' * 5000 + "1" + "}" * 5000,
            "not json",
            json.dumps([{"x": 1}, 2, None]),
            "\x1b[31mred\x1b[0m",
            json.dumps(["a" * 100_000]),
        ]
    )
    key = rng.choice(["pkg.onnx_modular.module_paths", "pkg.onnx_modular.class", "pkg.onnx_modular.call_count"])
    for prop in props:
        if prop.key == key:
            prop.value = value
            break
    else:
        props.add(key=key, value=value)
    return _write(case, model.SerializeToString())


def gen_bad_utf8(rng, case, seeds):
    """Invalid UTF-8 in names: protobuf (python) refuses to set it, so edit the bytes."""
    model = _seed_model(seeds)
    marker = "Q" * 12
    where = rng.randrange(4)
    if where == 0:
        model.functions[0].name = marker
        for f in model.functions[1:]:
            for node in f.node:
                if node.op_type == model.functions[0].name:
                    node.op_type = marker
        for node in model.graph.node:
            if node.op_type == model.functions[0].name:
                node.op_type = marker
    elif where == 1:
        model.graph.input[0].name = marker
    elif where == 2:
        model.functions[0].metadata_props.add(key="pkg.onnx_modular.module_paths", value=json.dumps([marker]))
    else:
        model.graph.node[0].name = marker
    data = model.SerializeToString().replace(marker.encode(), b"\xff\xfe" + b"q" * 10)
    return _write(case, data)


def gen_external(rng, case, seeds):
    """External data references: outside the folder, missing, absolute, huge offsets/lengths."""
    model = _seed_model(seeds, "external")
    source = seeds["external"].parent
    for entry in source.iterdir():
        if entry.name != seeds["external"].name:
            shutil.copy(entry, case / entry.name)
    tensors = [t for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    tensor = rng.choice(tensors)
    fields = {entry.key: entry for entry in tensor.external_data}
    how = rng.randrange(6)
    if how == 0:
        fields["location"].value = "../" * rng.randint(1, 4) + "outside.bin"
    elif how == 1:
        fields["location"].value = "/etc/hostname"
    elif how == 2:
        fields["location"].value = "missing.data"
    elif how == 3 and "offset" in fields:
        fields["offset"].value = str(rng.choice([2**40, 2**63 - 1, -5]))
    elif how == 4 and "length" in fields:
        fields["length"].value = str(rng.choice([2**40, 2**63 - 1, 0, -1]))
    else:
        fields["location"].value = rng.choice(["", ".", "sub/../../x", "a\x00b"])
    return _write(case, model.SerializeToString())


def gen_special_file(rng, case, seeds):
    how = rng.randrange(3)
    if how == 0:
        os.mkfifo(case / "m.onnx")
    elif how == 1:
        os.symlink("/dev/zero", case / "m.onnx")
    else:
        (case / "m.onnx").mkdir()
    return "m.onnx"


# -- issue 25: hidden external data, names for the terminal, npz inputs, destinations ------


def _checks(case: pathlib.Path, **checks) -> None:
    (case / CHECKS_FILE).write_text(json.dumps(checks))


def _fingerprint(path: pathlib.Path) -> str:
    if path.is_fifo():
        return "fifo"
    if not path.exists():
        return "missing"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _external_ref(tensor: onnx.TensorProto, location: str) -> None:
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    del tensor.external_data[:]
    tensor.external_data.add(key="location", value=location)


def gen_hidden_external(rng, case, seeds):
    """An external-data reference where a shallow check does not look: a sparse initializer's
    values or indices, a Constant's ``sparse_value``, an initializer of an If branch inside a
    function, a tensor attribute whose declared type says it is an int. The file it names is
    outside the folder, a FIFO (a read hangs: a timeout), or a link to ``/dev/zero``."""
    target = rng.choice(["fifo", "../outside.bin", "zero", "/etc/hostname", "link-out"])
    if target == "fifo":
        os.mkfifo(case / "fifo")
    elif target == "zero":
        os.symlink("/dev/zero", case / "zero")
    elif target == "link-out":
        os.symlink("../outside.bin", case / "link-out")
    (case.parent / "outside.bin").write_bytes(b"\0" * 64)
    values = helper.make_tensor("v", TensorProto.FLOAT, [2], [1.0, 2.0])
    indices = helper.make_tensor("i", TensorProto.INT64, [2], [0, 4])
    sparse = helper.make_sparse_tensor(values, indices, [2, 3])
    where = rng.randrange(5)
    _external_ref(values if rng.random() < 0.5 else indices, target)
    relu = [helper.make_node("Relu", ["x"], ["y"])]
    if where == 0:  # a sparse initializer of the main graph
        model = _model(relu, [])
        model.graph.sparse_initializer.append(sparse)
    elif where == 1:  # Constant sparse_value, in a function
        body = [helper.make_node("Constant", [], ["s"], sparse_value=sparse), helper.make_node("Relu", ["a"], ["b"])]
        model = _model([_call("f", ["x"], ["y"])], [helper.make_function(DOMAIN, "f", ["a"], ["b"], body, _opsets())])
    else:
        dense = helper.make_tensor("w", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])
        _external_ref(dense, target)
        if where == 2:  # an initializer of an If branch inside a function
            branch = helper.make_graph(
                [helper.make_node("Identity", ["w"], ["o"])], "then", [],
                [helper.make_tensor_value_info("o", TensorProto.FLOAT, [3])], [dense],
            )  # fmt: skip
            body = [
                helper.make_node("Constant", [], ["c"], value=helper.make_tensor("c", TensorProto.BOOL, [], [True])),
                helper.make_node("If", ["c"], ["k"], then_branch=branch, else_branch=branch),
                helper.make_node("Relu", ["a"], ["b"]),
            ]
            model = _model([_call("f", ["x"], ["y"])], [helper.make_function(DOMAIN, "f", ["a"], ["b"], body, _opsets())])
        else:  # a Constant whose tensor attribute claims another type
            attribute = helper.make_attribute("value", dense)
            if where == 4:
                attribute.type = onnx.AttributeProto.INT
            constant = helper.make_node("Constant", [], ["w2"])
            constant.attribute.append(attribute)
            model = _model([constant, helper.make_node("Relu", ["x"], ["y"])], [])
    _checks(case, no_outside_refs=["out.onnx"])
    return _write(case, model.SerializeToString())


_TERMINAL = ["\x1b[2J\x1b[H", "\x1b]0;owned\x07", "\u202eevil", "PASS\x1b[1A\x1b[2K", "\u2066x\u2069"]


def gen_terminal_names(rng, case, seeds):
    """Names that would drive the terminal (clear the screen, set the title, reverse a line)
    in graph inputs/outputs, node names and function names; the commands print them in the
    tree, the verify report and its error line. Any raw ESC/BEL/U+202E printed is a failure."""
    bad = rng.choice(_TERMINAL)
    nodes = [_call("f" + bad, ["x" + bad], ["y" + bad])]
    nodes[0].name = "node" + rng.choice(_TERMINAL)
    body = [helper.make_node("Relu", ["a"], ["b"])]
    if rng.random() < 0.5:  # a model that differs from its flat copy cannot: make verify fail differently
        body[0].name = rng.choice(_TERMINAL)
    functions = [helper.make_function(DOMAIN, "f" + bad, ["a"], ["b"], body, _opsets())]
    model = _model(
        nodes,
        functions,
        inputs=[helper.make_tensor_value_info("x" + bad, TensorProto.FLOAT, [2, 3])],
        outputs=[helper.make_tensor_value_info("y" + bad, TensorProto.FLOAT, [2, 3])],
    )
    if rng.random() < 0.3:
        model.graph.node[0].input[0] = "undefined" + bad  # onnxruntime refuses: an error line with the name
    return _write(case, model.SerializeToString())


def _npz_bytes(rng) -> bytes:
    buffer = io.BytesIO()
    how = rng.randrange(5)
    if how == 0:
        numpy.savez(buffer, x=numpy.array(["ab", "c"]))
    elif how == 1:
        numpy.savez(buffer, x=numpy.zeros(6, dtype="U0"))
    elif how == 2:
        numpy.savez(buffer, x=numpy.zeros(2, dtype=[("a", "f4"), ("b", "i4")]))
    else:
        numpy.savez(buffer, x=numpy.zeros((2, 3), dtype=numpy.float32))
    data = bytearray(buffer.getvalue())
    central = data.find(b"PK\x01\x02")
    if how == 3:  # an encrypted member
        data[6] |= 1
        data[central + 8] |= 1
    elif how == 4:  # a compression method zipfile does not know
        data[8] = data[central + 10] = rng.choice([1, 6, 97, 99])
    return bytes(data)


def gen_npz_inputs(rng, case, seeds):
    """``verify --inputs`` with an .npz holding strings, empty items, records, an encrypted
    member or an unknown compression method."""
    (case / "in.npz").write_bytes(_npz_bytes(rng))
    _checks(case, inputs="in.npz")
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [])
    return _write(case, model.SerializeToString())


def gen_destination(rng, case, seeds):
    """``inline`` to a destination that must not be replaced or followed: a FIFO, a link to a
    FIFO or to ``/dev/null``, or a lock-file name taken by a dangling link or a folder; and
    another model (``victim.onnx``) whose data file has the name the destination's data would
    take. The victim's files and the FIFO must come through unchanged."""
    source = seeds["external"].parent
    for entry in source.iterdir():
        shutil.copy(entry, case / entry.name)
    name = seeds["external"].name
    how = rng.randrange(5)
    if how == 0:
        os.mkfifo(case / "out.onnx")
    elif how == 1:
        os.mkfifo(case / "pipe")
        os.symlink("pipe", case / "out.onnx")
    elif how == 2:
        os.symlink("/dev/null", case / "out.onnx")
    else:
        lock = ".onnx_modular-lock-" + hashlib.sha256(b"out.onnx").hexdigest()[:16]
        if how == 3:
            os.symlink("../escaped-lock", case / lock)
        else:
            (case / lock).mkdir()
    # the victim: a renamed copy of the seed whose data file is named as out.onnx's would be
    victim = onnx.load(str(case / name), load_external_data=False)
    for tensor in victim.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                old = entry.value
                entry.value = "out.onnx.data"
    if (case / old).exists():
        shutil.copy(case / old, case / "out.onnx.data")
    onnx.save(victim, str(case / "victim.onnx"))
    keep = ["victim.onnx", "out.onnx.data"] + (["out.onnx"] if how == 0 else ["pipe"] if how == 1 else [])
    _checks(case, keep={path: _fingerprint(case / path) for path in keep}, outside="escaped-lock")
    return name


def gen_constant_bomb(rng, case, seeds):
    """A tiny file whose constant folds to a declared 1024**3 tensor (ConstantOfShape, Expand,
    Tile): ``inline --optimize`` must not allocate it (the memory limit catches it)."""
    shape = helper.make_tensor("s", TensorProto.INT64, [3], [1024, 1024, rng.choice([1024, 4096])])
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    how = rng.randrange(3)
    if how == 0:
        grow = [helper.make_node("ConstantOfShape", ["s"], ["big"], value=one)]
    elif how == 1:
        grow = [helper.make_node("Constant", [], ["o"], value=one), helper.make_node("Expand", ["o", "s"], ["big"])]
    else:
        grow = [
            helper.make_node("Constant", [], ["o"], value=helper.make_tensor("o", TensorProto.FLOAT, [1, 1, 1], [1.0])),
            helper.make_node("Tile", ["o", "s"], ["big"]),
        ]
    nodes = [
        helper.make_node("Constant", [], ["s"], value=shape),
        *grow,
        helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0),
        helper.make_node("Add", ["x", "total"], ["y"]),
    ]
    _checks(case, optimize=True)
    return _write(case, _model(nodes, []).SerializeToString())


# -- generated function graphs ----------------------------------------------------------


def _opsets():
    return [helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)]


def _model(nodes, functions, inputs=None, outputs=None):
    inputs = inputs or [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])]
    outputs = outputs or [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])]
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    model = helper.make_model(graph, opset_imports=_opsets(), functions=functions)
    model.ir_version = 10
    return model


def _call(name, inputs, outputs):
    return helper.make_node(name, inputs, outputs, domain=DOMAIN)


def bomb(depth: int = 24, fanout: int = 2, via_if: bool = False) -> onnx.ModelProto:
    """``f0`` is one Relu; ``f{i}`` calls ``f{i-1}`` ``fanout`` times (or in both If branches)."""
    functions = [helper.make_function(DOMAIN, "f0", ["a"], ["b"], [helper.make_node("Relu", ["a"], ["b"])], _opsets())]
    for level in range(1, depth):
        below = f"f{level - 1}"
        if via_if:
            def branch(tag):
                nodes = [_call(below, ["a"], [f"{tag}0"]), _call(below, [f"{tag}0"], [f"{tag}1"])]
                return helper.make_graph(nodes, tag, [], [helper.make_tensor_value_info(f"{tag}1", TensorProto.FLOAT, None)])

            nodes = [
                helper.make_node("ReduceSum", ["a"], ["s"], keepdims=0),
                helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("z", TensorProto.FLOAT, [], [0.0])),
                helper.make_node("Greater", ["s", "zero"], ["c"]),
                helper.make_node("If", ["c"], ["b"], then_branch=branch("t"), else_branch=branch("e")),
            ]
        else:
            nodes, current = [], "a"
            for i in range(fanout):
                out = "b" if i == fanout - 1 else f"t{i}"
                nodes.append(_call(below, [current], [out]))
                current = out
        functions.append(helper.make_function(DOMAIN, f"f{level}", ["a"], ["b"], nodes, _opsets()))
    return _model([_call(f"f{depth - 1}", ["x"], ["y"])], functions)


def gen_bomb(rng, case, seeds):
    model = bomb(depth=rng.choice([16, 24, 32]), fanout=rng.choice([2, 3]), via_if=rng.random() < 0.4)
    return _write(case, model.SerializeToString())


def gen_recursion(rng, case, seeds):
    n = rng.randint(1, 4)  # f0 -> f1 -> ... -> f{n-1} -> f0
    functions = [
        helper.make_function(DOMAIN, f"f{i}", ["a"], ["b"], [_call(f"f{(i + 1) % n}", ["a"], ["b"])], _opsets())
        for i in range(n)
    ]
    if rng.random() < 0.5:  # the cycle hidden in an If branch
        inner = helper.make_graph([_call("f0", ["a"], ["r"])], "t", [], [helper.make_tensor_value_info("r", TensorProto.FLOAT, None)])
        functions[0] = helper.make_function(
            DOMAIN,
            "f0",
            ["a", "c"],
            ["b"],
            [helper.make_node("If", ["c"], ["b"], then_branch=inner, else_branch=inner)],
            _opsets(),
        )
    return _write(case, _model([_call("f0", ["x"], ["y"])], functions).SerializeToString())


def gen_deep_chain(rng, case, seeds):
    depth = rng.choice([150, 250, 1000, 5000])
    functions = [helper.make_function(DOMAIN, "f0", ["a"], ["b"], [helper.make_node("Relu", ["a"], ["b"])], _opsets())]
    for level in range(1, depth):
        functions.append(helper.make_function(DOMAIN, f"f{level}", ["a"], ["b"], [_call(f"f{level - 1}", ["a"], ["b"])], _opsets()))
    return _write(case, _model([_call(f"f{depth - 1}", ["x"], ["y"])], functions).SerializeToString())


def gen_many_inputs(rng, case, seeds):
    count = rng.choice([8, 40, 200])
    side = rng.choice([4096, 8000])  # each input just under the per-input cap of 2**26 elements
    inputs = [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [side, side]) for i in range(count)]
    nodes, current = [], "x0"
    for i in range(1, count):
        nodes.append(helper.make_node("Add", [current, f"x{i}"], [f"s{i}"]))
        current = f"s{i}"
    nodes.append(helper.make_node("Identity", [current], ["y"]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [side, side])]
    return _write(case, _model(nodes, [], inputs, outputs).SerializeToString())


def gen_symbolic_dims(rng, case, seeds):
    """Inputs with symbolic or missing dims and odd dtypes (random inputs must cope or refuse)."""
    dtype = rng.choice([TensorProto.FLOAT, TensorProto.STRING, TensorProto.BFLOAT16, TensorProto.COMPLEX64, TensorProto.BOOL, 0])
    shape = rng.choice([None, ["batch", 3], [-1, 3], [0, 3], ["", 2**33]])
    inputs = [helper.make_tensor_value_info("x", dtype, shape)]
    node = helper.make_node("Identity", ["x"], ["y"])
    outputs = [helper.make_tensor_value_info("y", dtype, shape)]
    return _write(case, _model([node], [], inputs, outputs).SerializeToString())


# -- checkpoint folders (``export <folder>``) ---------------------------------------------------

#: A valid tiny Llama configuration; each case breaks it (or its weights) in one or two ways.
_TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64,
    "max_position_embeddings": 32, "dtype": "float32", "tie_word_embeddings": False,
}  # fmt: skip
_SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "vocab_size", "max_position_embeddings", "head_dim")  # fmt: skip
_ODD_SIZES = (-4, 0, 10**7, 10**9, 10**12, 2**63, 1.5, "8", None, [16], True, 5 * 10**8)
_ODD_DTYPES = ("float33", "Tensor", 5, ["float16"], "", "torch.float16", "object", "bfloat16")
#: Written by code in a checkpoint (``auto_map``'s module, a pickled ``pytorch_model.bin``) if it ever ran.
PWNED = "PWNED-by-checkpoint"
_EVIL_CODE = f"import pathlib\npathlib.Path(__file__).resolve().parent.parent.parent.joinpath({PWNED!r}).write_text('ran')\n"


def _evil_pickle() -> bytes:
    """A pickle that, when loaded, writes PWNED next to the case folder (the command runs in the
    case folder): ``torch.load`` without ``weights_only`` would run it."""
    import pickle

    class Evil:
        def __reduce__(self):
            return (exec, (f"open('../{PWNED}', 'w').write('ran')",))

    return pickle.dumps({"model.embed_tokens.weight": Evil()})


def _weights(config: dict, rng: random.Random) -> dict[str, numpy.ndarray]:
    h, i, v = 16, 32, 64
    tensors = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,), "self_attn.q_proj.weight": (h, h),
             "self_attn.k_proj.weight": (8, h), "self_attn.v_proj.weight": (8, h), "self_attn.o_proj.weight": (h, h),
             "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}  # fmt: skip
    tensors.update({f"model.layers.0.{name}": shape for name, shape in layer.items()})
    return {name: numpy.asarray(numpy.random.default_rng(rng.randrange(2**32)).standard_normal(shape), numpy.float32)
            for name, shape in tensors.items()}  # fmt: skip


def gen_checkpoint(rng, case, seeds):
    """A checkpoint folder for ``export <folder>`` (with and without ``--stream-weights``): a tiny
    Llama whose ``config.json`` is broken (not JSON, empty, a list, nested thousands deep, a missing,
    unknown or non-string ``model_type``, an ``auto_map`` pointing at code in the folder, sizes that
    are negative, zero, fractional, strings or huge enough to need terabytes, odd dtypes) and/or whose
    weights lie (shapes that contradict the config, a missing tensor, a safetensors header that is a
    list or claims gigabytes, negative offsets, an index whose ``weight_map`` is a list or maps to an
    int, or only a pickled ``pytorch_model.bin`` that runs code when unpickled). The folder must come
    through unchanged, nothing it holds may run (``PWNED`` appears next to the case), and each
    command ends in a result or a typed error within its time and memory."""
    import safetensors.numpy

    folder = case / "ckpt"
    folder.mkdir()
    config = dict(_TINY_LLAMA)
    weights = _weights(config, rng)
    text, pickled_only, lie = None, False, None
    for _ in range(rng.choice([1, 1, 2])):
        how = rng.randrange(12)
        if how == 0:
            text = rng.choice(["{not json", "", "[1, 2]", "7", '"llama"', "null", "[" * 40_000 + "]" * 40_000,
                               '{"a":' * 30_000 + "1" + "}" * 30_000, "\ufeff{}", json.dumps(config)[:-3]])  # fmt: skip
        elif how == 1:
            config["model_type"] = rng.choice([None, "no-such-model", 7, ["llama"], "", "llama\x1b[2J"])
            if config["model_type"] is None:
                del config["model_type"]
        elif how == 2:
            (folder / "evil.py").write_text(_EVIL_CODE)
            config["auto_map"] = rng.choice([{"AutoConfig": "evil.Config", "AutoModelForCausalLM": "evil.Model"},
                                             {"AutoModel": "evil.Model"}, ["evil.Model"]])  # fmt: skip
        elif how in (3, 4):
            config[rng.choice(_SIZE_KEYS)] = rng.choice(_ODD_SIZES)
        elif how == 5:
            config[rng.choice(["dtype", "torch_dtype"])] = rng.choice(_ODD_DTYPES)
        elif how == 6:  # shapes that contradict the config, or a missing tensor
            name = rng.choice(sorted(weights))
            if rng.random() < 0.3:
                del weights[name]
            else:
                weights[name] = numpy.zeros(tuple(d + rng.choice([1, 3]) for d in weights[name].shape) or (2,), numpy.float32)
        elif how == 7:
            config["architectures"] = rng.choice([["NoSuchForCausalLM"], "LlamaForCausalLM", [7], []])
        elif how == 8:
            pickled_only = True  # only a pickled pytorch_model.bin
        else:
            lie = how
    (folder / "config.json").write_text(text if text is not None else json.dumps(config))
    if pickled_only:
        (folder / "pytorch_model.bin").write_bytes(_evil_pickle())
    elif lie is not None:
        how = lie
        safetensors.numpy.save_file(weights, str(folder / "model.safetensors"))
        data = bytearray((folder / "model.safetensors").read_bytes())
        length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + length])
        if how == 9:  # the header lies about offsets or sizes
            name = rng.choice([k for k in header if k != "__metadata__"])
            header[name]["data_offsets"] = rng.choice([[-40, 8], [0, 3 * 2**30], [0], [8, 0], "0-8"])
            new = json.dumps(header).encode()
        elif how == 10:  # not a dict of entries
            new = rng.choice([b"[1, 2]", b"5", b'{"a": "x"}', b"[" * 5000 + b"]" * 5000])
        else:  # a sharded index that lies
            (folder / "model.safetensors.index.json").write_text(json.dumps(
                {"weight_map": rng.choice([["model.safetensors"], dict.fromkeys(header, 7), dict.fromkeys(header, "../outside.safetensors")])}
            ))  # fmt: skip
            new = json.dumps(header).encode()
        data = len(new).to_bytes(8, "little") + new + data[8 + length :]
        (folder / "model.safetensors").write_bytes(data)
    else:
        safetensors.numpy.save_file(weights, str(folder / "model.safetensors"))
    keep = {str(path.relative_to(case)): _fingerprint(path) for path in sorted(folder.iterdir())}
    commands = [["export", "ckpt", "-o", "out.onnx"], ["export", "ckpt", "-o", "out2.onnx", "--stream-weights"]]
    _checks(case, keep=keep, outside=PWNED, commands=commands, torch=True)
    return "ckpt"


# -- issue 38: the new surfaces (profile, extract, replace, the flat copy, the output folder, view) --

_BLOCK = "pkg.fuzz.block"


def block_model(function_name: str = "Blk", call_name: str = "/blk", weight: str = "w") -> onnx.ModelProto:
    """One call of ``function_name`` (``b = a + w``) on a 2x3 input; ``w`` a 2x3 initializer."""
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(_BLOCK, 1)]
    body = helper.make_function(_BLOCK, function_name, ["a", "w"], ["b"], [helper.make_node("Add", ["a", "w"], ["b"])], opsets[:1])
    call = helper.make_node(function_name, ["x", weight], ["y"], domain=_BLOCK, name=call_name)
    value = numpy.arange(6, dtype=numpy.float32).reshape(2, 3)
    graph = helper.make_graph(
        [call], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [onnx.numpy_helper.from_array(value, weight)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=opsets, functions=[body])
    model.ir_version = 10
    return model


def save_external(model: onnx.ModelProto, path: pathlib.Path, location: str) -> None:
    """``model`` at ``path`` with every initializer in the data file ``location`` (beside it)."""
    onnx.save(model, str(path), save_as_external_data=True, location=location, size_threshold=0)


def loop_model(trips: int, condition: bool = False) -> onnx.ModelProto:
    """A ``Loop`` of ``trips`` iterations adding 1 to the input (``condition``: a run-time condition)."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c2"]), helper.make_node("Add", ["v", "one"], ["v2"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("c2", TensorProto.BOOL, []), helper.make_tensor_value_info("v2", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])],
    )  # fmt: skip
    nodes = [helper.make_node("Loop", ["M", "go" if condition else "", "x"], ["y"], body=body, name="loop")]
    if condition:
        nodes.insert(0, helper.make_node("Greater", ["s", "zero"], ["go"]))
        nodes.insert(0, helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor("M", TensorProto.INT64, [], [trips]), helper.make_tensor("zero", TensorProto.FLOAT, [], [1e9])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


def chain_of_calls(calls: int) -> onnx.ModelProto:
    """``calls`` calls of one function ``Blk`` in a row in the main graph (a class of many calls)."""
    model = block_model()
    domain = model.graph.node[0].domain
    del model.graph.node[:]
    current = "x"
    for index in range(calls):
        output = "y" if index == calls - 1 else f"t{index}"
        model.graph.node.append(helper.make_node("Blk", [current, "w"], [output], domain=domain, name=f"/blk{index}"))
        current = output
    return model


def gen_many_calls(rng, case, seeds):
    """``extract --with-data`` of a class of 100 to 400 calls: linear in the calls (it was
    quadratic: 2,000 calls 75 s), within the timeout. Sizes that finish within the default
    suite's 8 s timeout on a loaded 2-core machine (2,000 calls took 17 s there, linear; the
    larger sizes are measured in docs/robustness.md)."""
    _write(case, chain_of_calls(rng.choice([100, 200, 400])).SerializeToString())
    _checks(case, commands=[["extract", "m.onnx", "Blk", "-o", "ex", "--with-data"]], must_succeed=[0])
    return "m.onnx"


def gen_report_neighbour(rng, case, seeds):
    """``profile --json/--html`` to a path where a model sits whose data file another model
    (``victim.onnx``) shares: the report replaces the file named, the victim keeps its data."""
    kind = rng.choice(["json", "html"])
    report = f"r.{kind}"
    save_external(block_model(), case / "victim.onnx", f"{report}.data")
    shutil.copy(case / "victim.onnx", case / report)
    _write(case, block_model().SerializeToString())
    keep = {name: _fingerprint(case / name) for name in ("victim.onnx", f"{report}.data")}
    commands = [["profile", "m.onnx", f"--{kind}", report, "--runs", "1", "--warmup", "0"], ["verify", "victim.onnx"]]
    _checks(case, keep=keep, commands=commands, must_succeed=[1])
    return "m.onnx"


def gen_own_data_name(rng, case, seeds):
    """``inline`` (or ``--flat-file``'s save) to a destination whose data-file name is the source's
    own, with an existing 0600 destination sharing it: the source still loads, the mode is kept."""
    destination = rng.choice(["out.onnx", "m.onnx"])
    save_external(block_model(), case / "m.onnx", f"{destination}.data")
    if destination != "m.onnx":
        shutil.copy(case / "m.onnx", case / destination)
    os.chmod(case / destination, 0o600)
    commands = [["inline", "m.onnx", destination], ["verify", "m.onnx"], ["verify", destination]]
    # in place (the source itself): refused before any work since issue 53, the source still verifies
    _checks(case, commands=commands, must_succeed=[1, 2] if destination == "m.onnx" else [0, 1, 2], modes={destination: 0o600})
    return "m.onnx"


def gen_surface_bomb(rng, case, seeds):
    """A call bomb given to ``extract``, ``replace`` and ``view``: refused at once, as ``tree`` refuses it."""
    model = bomb(depth=rng.choice([20, 24, 32]), fanout=2, via_if=rng.random() < 0.3)
    _write(case, model.SerializeToString())
    block = helper.make_graph([helper.make_node("Relu", ["a"], ["b"])], "blk", [helper.make_tensor_value_info("a", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)])  # fmt: skip
    block_file = helper.make_model(block, opset_imports=[helper.make_opsetid("", 18)])
    block_file.ir_version = 10
    _write(case, block_file.SerializeToString(), "block.onnx")
    target = rng.choice(["f0", "f1", "f*"])
    commands = [["extract", "m.onnx", target, "-o", "ex", *(["--with-data"] if rng.random() < 0.5 else [])],
                ["replace", "m.onnx", target, "block.onnx", "-o", "r.onnx"], ["view", "m.onnx", "--port", "0", "--no-browser"]]  # fmt: skip
    _checks(case, commands=commands)
    return "m.onnx"


def gen_loop_trips(rng, case, seeds):
    """A ``Loop`` whose constant trip count nothing can cut short (2**62, 10**5 steps), or one with a
    run-time condition: ``verify`` and ``profile`` refuse it up front or finish within bounds."""
    trips = rng.choice([2**62, 2**40, 10**5, 100])
    _write(case, loop_model(trips, condition=rng.random() < 0.25).SerializeToString())
    _checks(case, commands=[["verify", "m.onnx"], ["profile", "m.onnx", "--runs", "1", "--warmup", "0"]])
    return "m.onnx"


def gen_long_names(rng, case, seeds):
    """Function and call names past NAME_MAX (255 bytes) for ``extract``'s folder names."""
    function = "F" * rng.choice([250, 256, 300, 1000]) + rng.choice(["", "é" * 100, "/../x"])
    call = "/" + "c" * rng.choice([10, 300])
    _write(case, block_model(function, call).SerializeToString())
    target = rng.choice([function, call.lstrip("/")])
    _checks(case, commands=[["extract", "m.onnx", target, "-o", "ex", *(["--with-data"] if rng.random() < 0.5 else [])], ["tree", "m.onnx"]])
    return "m.onnx"


def gen_replace_lies(rng, case, seeds):
    """Replacement blocks that lie: an output no node computes, dims that contradict the function's
    declared ones, an output count that differs, a cycle, a wrong element type."""
    model = block_model()
    function = model.functions[0]
    function.value_info.extend([helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("a", "w", "b")])
    _write(case, model.SerializeToString())
    how = rng.randrange(5)
    shape = [7, 9] if how == 1 else [2, 3]
    elem = TensorProto.INT64 if how == 4 else TensorProto.FLOAT
    nodes = {0: [helper.make_node("Relu", ["a"], ["t"])], 3: [helper.make_node("Add", ["a", "b"], ["b"])]}.get(how, [helper.make_node("Sub", ["a", "w"], ["b"])])
    outputs = [helper.make_tensor_value_info("b", elem, shape)] + ([helper.make_tensor_value_info("a", TensorProto.FLOAT, shape)] if how == 2 else [])
    graph = helper.make_graph(nodes, "blk", [helper.make_tensor_value_info("a", elem, shape), helper.make_tensor_value_info("w", elem, shape)], outputs)
    block = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    block.ir_version = 10
    _write(case, block.SerializeToString(), "block.onnx")
    _checks(case, commands=[["replace", "m.onnx", "Blk", "block.onnx", "-o", "r.onnx"]])
    return "m.onnx"


def gen_tool_escapes(rng, case, seeds):
    """Call paths, function and output names with ESC, BEL, U+202E and zero-width characters, printed
    by ``extract``, ``replace`` and ``profile``: they reach the terminal escaped."""
    bad = rng.choice(_TERMINAL + ["a\u200bb", "\x07bell"])
    model = block_model("Blk" + bad, "/blk" + bad)
    model.graph.output[0].name = model.graph.node[0].output[0] = "y" + bad
    _write(case, model.SerializeToString())
    block = helper.make_graph([helper.make_node("Sub", ["a", "w"], ["b"])], "blk",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("a", "w")],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 3])])  # fmt: skip
    block_file = helper.make_model(block, opset_imports=[helper.make_opsetid("", 18)])
    block_file.ir_version = 10
    _write(case, block_file.SerializeToString(), "block.onnx")
    target = "Blk" + bad
    commands = [["extract", "m.onnx", target, "-o", "ex", "--with-data"], ["replace", "m.onnx", target, "block.onnx", "-o", "r.onnx"],
                ["profile", "m.onnx", "--runs", "1", "--warmup", "0"]]  # fmt: skip
    _checks(case, commands=commands)
    return "m.onnx"


def gen_odd_numbers(rng, case, seeds):
    """Numbers that lie: ``profile --threads`` far past any machine, an opset of 2**63-1, ``view``
    ports outside 0-65535."""
    model = block_model()
    if rng.random() < 0.5:
        model.opset_import[0].version = rng.choice([2**63 - 1, 2**31, 10_000])
    _write(case, model.SerializeToString())
    threads = str(rng.choice([100_000, 2**31, 2**63, 0, -1]))
    port = str(rng.choice([-1, 70_000, 65_536, 2**40]))
    commands = [["profile", "m.onnx", "--threads", threads, "--runs", "1"], ["profile", "m.onnx", "--runs", "1", "--warmup", "0"],
                ["view", "m.onnx", "--port", port, "--no-browser"], ["verify", "m.onnx"]]  # fmt: skip
    _checks(case, commands=commands)
    return "m.onnx"


def gen_sparse_external(rng, case, seeds):
    """A 32-byte weight at the start of a sparse external-data file of 20 GiB: every tool reads the
    bytes the tensor references, not the file (the memory limit catches a whole read)."""
    model = block_model()
    save_external(model, case / "m.onnx", "m.onnx.data")
    with open(case / "m.onnx.data", "r+b") as data:
        data.truncate(rng.choice([20, 8, 3]) * 2**30)
    block = helper.make_graph([helper.make_node("Sub", ["a", "w"], ["b"])], "blk",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("a", "w")],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 3])])  # fmt: skip
    block_file = helper.make_model(block, opset_imports=[helper.make_opsetid("", 18)])
    block_file.ir_version = 10
    _write(case, block_file.SerializeToString(), "block.onnx")
    commands = [["inline", "m.onnx", "out.onnx"], ["replace", "m.onnx", "Blk", "block.onnx", "-o", "r.onnx"],
                ["extract", "m.onnx", "Blk", "-o", "ex", "--with-data"], ["verify", "m.onnx"]]  # fmt: skip
    _checks(case, commands=commands, must_succeed=[0, 1, 2, 3])
    return "m.onnx"


def gen_report_destination(rng, case, seeds):
    """Reports (``profile --json/--html``) to a link to a file elsewhere, a dangling link, a FIFO, a
    link to a FIFO, or an existing private (0600) file: links are replaced, never followed, FIFOs
    refused without blocking, modes kept."""
    (case / "elsewhere").mkdir()
    (case / "elsewhere" / "target").write_text("not yours")
    _write(case, block_model().SerializeToString())
    report = rng.choice(["r.json", "r.html"])
    how = rng.randrange(5)
    checks: dict = {"keep": {"elsewhere/target": _fingerprint(case / "elsewhere" / "target")}}
    if how == 0:
        os.symlink("elsewhere/target", case / report)
    elif how == 1:
        os.symlink("elsewhere/new", case / report)
        checks["absent"] = ["elsewhere/new"]
    elif how == 2:
        os.mkfifo(case / report)
        checks["keep"][report] = "fifo"
    elif how == 3:
        os.mkfifo(case / "elsewhere" / "pipe")
        os.symlink("elsewhere/pipe", case / report)
    else:
        (case / report).write_text("old report")
        os.chmod(case / report, 0o600)
        checks["modes"] = {report: 0o600}
    checks["commands"] = [["profile", "m.onnx", f"--{report.split('.')[1]}", report, "--runs", "1", "--warmup", "0"]]
    _checks(case, **checks)
    return "m.onnx"


def gen_output_folder(rng, case, seeds):
    """``export ckpt -o out`` (a tiny Llama checkpoint) into a folder holding another model's
    ``model.onnx.data``, entries that are links (to a file elsewhere, dangling), a FIFO, a private
    (0600) tokenizer file; or a checkpoint whose ``config.json`` / tokenizer links out of it.
    Nothing outside ``out`` may change or appear, the other model's data stays, modes are kept."""
    import safetensors.numpy

    folder, out, elsewhere = case / "ckpt", case / "out", case / "elsewhere"
    for path in (folder, out, elsewhere):
        path.mkdir()
    (elsewhere / "target").write_text(json.dumps(_TINY_LLAMA))
    (folder / "config.json").write_text(json.dumps(_TINY_LLAMA))
    safetensors.numpy.save_file(_weights(_TINY_LLAMA, rng), str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}))
    os.chmod(folder / "tokenizer.json", 0o600)
    save_external(block_model(), out / "other.onnx", "model.onnx.data")
    checks: dict = {"keep": {}, "absent": [], "modes": {}}
    for _ in range(rng.choice([1, 2, 3])):
        how = rng.randrange(6)
        if how == 0:
            with contextlib.suppress(FileExistsError):
                os.symlink("../elsewhere/target", out / rng.choice(["config.json", "export.json", "model.onnx", "generation_config.json"]))
        elif how == 1:
            with contextlib.suppress(FileExistsError):
                os.symlink("../elsewhere/new", out / rng.choice(["export.json", "tokenizer.json", "model.onnx.data"]))
            checks["absent"].append("elsewhere/new")
        elif how == 2:
            with contextlib.suppress(FileExistsError):
                os.mkfifo(out / rng.choice(["export.json", "tokenizer.json"]))
        elif how == 3:
            (folder / "config.json").unlink()
            os.symlink("../elsewhere/target", folder / "config.json")
        elif how == 4:
            (folder / "tokenizer.json").unlink()
            os.symlink("../elsewhere/target", folder / "tokenizer.json")
        elif not os.path.lexists(out / "tokenizer.json"):  # a link placed above is not written through
            with contextlib.suppress(FileExistsError):
                (out / "tokenizer.json").write_text("{}")
                os.chmod(out / "tokenizer.json", 0o640)
                # written over: the copy of a private (0600) file stays private; a refused export
                # leaves the file as it was, its 0640 included
                checks["private_copies"] = {"out/tokenizer.json": (_fingerprint(out / "tokenizer.json"), 0o640)}
    for path in [*elsewhere.iterdir(), *(p for p in out.iterdir() if p.name != "tokenizer.json" or p.is_fifo())]:
        if path.name in ("target", "other.onnx", "model.onnx.data") or path.is_fifo():
            checks["keep"][str(path.relative_to(case))] = _fingerprint(path)
    checks["keep"]["out/model.onnx.data"] = _fingerprint(out / "model.onnx.data")
    checks["commands"] = [["export", "ckpt", "-o", "out", "--no-verify"], ["verify", "out/other.onnx"]]
    checks["must_succeed"] = [1]
    checks["torch"] = True
    _checks(case, **checks)
    return "ckpt"


# -- issue 53: convert, diff, split and run_stages, modularize, generation folders ----------


def _three_models(case: pathlib.Path) -> dict:
    for name in ("m", "a", "b"):
        save_external(block_model(), case / f"{name}.onnx", f"{name}.onnx.data")
    return {path.name: _fingerprint(path) for path in sorted(case.iterdir()) if path.is_file()}


_GUARDED = [
    ["convert", "m.onnx", "-o", "m.onnx", "--dtype", "float16"],
    ["convert", "m.onnx", "-o", "m.onnx.data", "--dtype", "float16"],
    ["convert", "a.onnx", "-o", "b.onnx.data", "--dtype", "float16"],
    ["convert", "m.onnx", "-o", "x.onnx", "--dtype", "float16", "--json", "m.onnx.data"],
    ["convert", "m.onnx", "-o", "x.onnx", "--quantize", "int8", "--json", "a.onnx.data"],
    ["diff", "a.onnx", "a.onnx", "--html", "a.onnx.data"],
    ["diff", "a.onnx", "b.onnx", "--json", "b.onnx.data"],
    ["diff", "a.onnx", "b.onnx", "--json", "a.onnx", "--structure-only"],
    ["modularize", "a.onnx", "-o", "a.onnx.data"],
    ["modularize", "a.onnx", "-o", "m.onnx.data"],
    ["inline", "m.onnx", "m.onnx.data"],
    ["inline", "m.onnx", "m.onnx"],
    ["inline", "a.onnx", "b.onnx.data"],
    ["profile", "m.onnx", "--json", "m.onnx.data", "--runs", "1", "--warmup", "0"],
    ["profile", "m.onnx", "--html", "b.onnx.data", "--runs", "1", "--warmup", "0"],
    ["replace", "m.onnx", "Blk", "a.onnx", "-o", "a.onnx.data"],
]


def gen_guard_outputs(rng, case, seeds):
    """Every tool's outputs over the input, its data or another model's data: refused before any
    work, every file byte-identical, every model still verifying (issue 53, class 1)."""
    keep = _three_models(case)
    commands = [rng.choice(_GUARDED), rng.choice(_GUARDED), ["verify", "m.onnx"], ["verify", "a.onnx"], ["verify", "b.onnx"]]
    _checks(case, keep=keep, commands=commands, must_succeed=[2, 3, 4], absent=["x.onnx"])
    return "m.onnx"


def gen_generation_guard(rng, case, seeds):
    """A generation folder: ``decode.onnx`` reads ``prefill.onnx.data``; no output may replace it."""
    save_external(block_model(), case / "prefill.onnx", "prefill.onnx.data")
    shutil.copy(case / "prefill.onnx", case / "decode.onnx")
    keep = {name: _fingerprint(case / name) for name in ("prefill.onnx", "prefill.onnx.data", "decode.onnx")}
    source = rng.choice(["decode.onnx", "prefill.onnx"])
    command = rng.choice([
        ["convert", source, "-o", "prefill.onnx.data", "--dtype", "float16"],
        ["inline", source, "prefill.onnx.data"],
        ["diff", "decode.onnx", "prefill.onnx", "--json", "prefill.onnx.data"],
        ["modularize", source, "-o", "prefill.onnx.data"],
        ["convert", source, "-o", source, "--dtype", "float16"],
    ])  # fmt: skip
    _checks(case, keep=keep, commands=[command, ["verify", "decode.onnx"], ["verify", "prefill.onnx"]], must_succeed=[1, 2])
    return source


def _stage_file(path: pathlib.Path, nodes, inputs, outputs) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    graph = helper.make_graph(
        nodes, "stage", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in outputs],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    _write(path.parent, model.SerializeToString(), path.name)


def gen_manifest(rng, case, seeds):
    """A split folder whose ``manifest.json`` or stage files are hostile (issue 53, class 4):
    nesting, wrong types, unknown outputs, paths out of the folder, links, FIFOs, a file shared by
    two stages, feeds as a list or named like a stage output, a bomb or an endless Loop as a stage."""
    folder = case / "split"
    _stage_file(folder / "stage_0" / "model.onnx", [helper.make_node("Relu", ["x"], ["t"])], ["x"], ["t"])
    _stage_file(folder / "stage_1" / "model.onnx", [helper.make_node("Add", ["t", "x"], ["y"])], ["t", "x"], ["y"])
    stages = [{"file": "stage_0/model.onnx", "inputs": {"x": "x"}, "outputs": ["t"]},
              {"file": "stage_1/model.onnx", "inputs": {"t": "stage_0/t", "x": "x"}, "outputs": ["y"]}]  # fmt: skip
    manifest: object = {"stages": stages, "outputs": {"y": "stage_1/y"}}
    how = rng.choice(["valid", "nesting", "list_name", "unknown_output", "outside", "absolute", "link", "fifo", "shared",
                      "list_feeds", "shadow", "bomb", "loop", "not_object", "huge_stages", "bad_json"])  # fmt: skip
    feeds = {"list_feeds": "list", "shadow": "shadow"}.get(how, "dict")
    text = None
    if how == "nesting":
        depth = rng.choice([20, 1000, 100_000])
        text = '{"stages": ' + "[" * depth + "]" * depth + ', "outputs": {}}'
    elif how == "list_name":
        manifest["outputs"] = {"y": ["stage_1/y"]}
    elif how == "unknown_output":
        manifest["outputs"] = {"y": rng.choice(["stage_7/y", "nothing", "stage_1/z"])}
    elif how in ("outside", "absolute"):
        stages[1]["file"] = "../elsewhere.onnx" if how == "outside" else str(case / "elsewhere.onnx")
        _stage_file(case / "elsewhere.onnx", [helper.make_node("Add", ["t", "x"], ["y"])], ["t", "x"], ["y"])
    elif how == "link":
        shutil.move(folder / "stage_1", case / "elsewhere")
        os.symlink(case / "elsewhere", folder / "stage_1")
    elif how == "fifo":
        os.unlink(folder / "stage_1" / "model.onnx")
        os.mkfifo(folder / "stage_1" / "model.onnx")
    elif how == "shared":
        stages[1]["file"] = "stage_0/model.onnx"
    elif how == "bomb":
        _write(folder / "stage_1", bomb(depth=rng.choice([20, 24])).SerializeToString(), "model.onnx")
    elif how == "loop":
        _write(folder / "stage_1", loop_model(rng.choice([2**62, 10**6]), condition=rng.random() < 0.5).SerializeToString(), "model.onnx")
    elif how == "not_object":
        manifest = rng.choice([[1, 2], "stages", 3, None])
    elif how == "huge_stages":
        manifest["stages"] = stages * 5000
    elif how == "bad_json":
        text = rng.choice(['{"stages": [', None, '{"stages": NaN}'])
    data = b"\xff\xfe{}" if how == "bad_json" and text is None else (text if text is not None else json.dumps(manifest)).encode()
    (folder / "manifest.json").write_bytes(data)  # the None of bad_json: bytes that are not UTF-8
    _checks(case, commands=[["run_stages", "split", feeds]], must_succeed=[0] if how == "valid" else [])
    return "split"


def _symbolic_model(expression: str) -> onnx.ModelProto:
    model = block_model()
    for value in (model.graph.input[0], model.graph.output[0]):
        value.type.tensor_type.shape.dim[0].dim_param = expression
    return model


def gen_long_dims(rng, case, seeds):
    """A symbolic dimension named by a 4 KB (or longer) expression (``a+a+...``) in convert, diff,
    split and modularize: a typed error or a result, never a traceback (issue 53, class 3)."""
    term = rng.choice(["a", "batch", "(a)", "a*2"])
    expression = term + ("+" + term) * rng.choice([500, 2000, 20_000])
    _write(case, _symbolic_model(expression).SerializeToString())
    command = rng.choice([["convert", "m.onnx", "-o", "c.onnx", "--dtype", "float16"], ["diff", "m.onnx", "m.onnx"],
                          ["split", "m.onnx", "-o", "s", "--stages", "2"], ["modularize", "m.onnx", "-o", "mm.onnx"],
                          ["verify", "m.onnx"]])  # fmt: skip
    _checks(case, commands=[command])
    return "m.onnx"


def gen_tool_bounds(rng, case, seeds):
    """Work a file or an option asks for: ``--runs 1e9``, ``--stages 10000``, a call bomb or a Loop of
    2**62 trips given to convert, split and diff: refused before the work (issue 53, class 2)."""
    how = rng.choice(["runs", "diff_runs", "stages", "bomb", "loop", "block_size"])
    if how == "bomb":
        _write(case, bomb(depth=rng.choice([20, 24]), via_if=rng.random() < 0.3).SerializeToString())
    elif how == "loop":
        _write(case, loop_model(rng.choice([2**62, 10**6]), condition=rng.random() < 0.5).SerializeToString())
    else:
        _write(case, chain_of_calls(rng.choice([3, 50])).SerializeToString())
    commands = {
        "runs": [["profile", "m.onnx", "--runs", str(rng.choice([10**9, 10**6])), "--warmup", "0"]],
        "diff_runs": [["diff", "m.onnx", "m.onnx", "--profile", "--runs", str(rng.choice([10**9, 10**6]))]],
        "stages": [["split", "m.onnx", "-o", "s", "--stages", str(rng.choice([10000, 2000, 40]))]],
        "bomb": [["convert", "m.onnx", "-o", "c.onnx", "--dtype", "float16"], ["split", "m.onnx", "-o", "s", "--stages", "2"],
                 ["diff", "m.onnx", "m.onnx"]],
        "loop": [["convert", "m.onnx", "-o", "c.onnx", "--dtype", "float16"], ["diff", "m.onnx", "m.onnx"], ["verify", "m.onnx"]],
        "block_size": [["convert", "m.onnx", "-o", "c.onnx", "--quantize", "int4", "--block-size", str(rng.choice([512, 2**26, 2**40, 8]))]],
    }[how]  # fmt: skip
    _checks(case, commands=commands)
    return "m.onnx"


def gen_diff_trailing(rng, case, seeds):
    """External references without ``length`` into data files with trailing bytes (or sparse and
    far larger): ``diff`` of a file and its copy finds them the same (issue 53, class 6)."""
    model = block_model()
    save_external(model, case / "a.onnx", "a.onnx.data")
    saved = onnx.load(str(case / "a.onnx"), load_external_data=False)
    for tensor in saved.graph.initializer:
        kept = [(e.key, e.value) for e in tensor.external_data if e.key != "length"]
        del tensor.external_data[:]
        for key, value in kept:
            tensor.external_data.add(key=key, value=value)
    _write(case, saved.SerializeToString(), "a.onnx")
    _write(case, saved.SerializeToString(), "b.onnx")
    for tensor in saved.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "b.onnx.data"
    _write(case, saved.SerializeToString(), "b.onnx")
    shutil.copy(case / "a.onnx.data", case / "b.onnx.data")
    with open(case / "b.onnx.data", "r+b") as data:
        if rng.random() < 0.3:
            data.truncate(rng.choice([2**30, 20 * 2**30]))
        else:
            data.seek(0, 2)
            data.write(bytes(rng.randrange(1, 4096)))
    _checks(case, commands=[["diff", "a.onnx", "b.onnx"], ["diff", "a.onnx", "b.onnx", "--structure-only"]], must_succeed=[0, 1])
    return "a.onnx"


def gen_small_external(rng, case, seeds):
    """A small model with external data converted (issue 51's first item): the save must succeed."""
    save_external(chain_of_calls(rng.choice([1, 3])), case / "m.onnx", "m.onnx.data")
    command = rng.choice([["convert", "m.onnx", "-o", "c.onnx", "--dtype", "float16"], ["inline", "m.onnx", "c.onnx"]])
    _checks(case, commands=[command, ["verify", "c.onnx"]], must_succeed=[0, 1])
    return "m.onnx"


GENERATORS: dict[str, tuple[Generator, float]] = {
    # name: (generator, weight)
    "bitflips": (gen_bitflips, 20),
    "byte_overwrite": (gen_byte_overwrite, 12),
    "truncate": (gen_truncate, 8),
    "splice": (gen_splice, 8),
    "huge_varint": (gen_huge_varint, 6),
    "huge_dim": (gen_huge_dim, 5),
    "bad_callee": (gen_bad_callee, 6),
    "shuffled_functions": (gen_shuffled_functions, 4),
    "metadata": (gen_metadata, 5),
    "bad_utf8": (gen_bad_utf8, 4),
    "external": (gen_external, 6),
    "special_file": (gen_special_file, 2),
    "bomb": (gen_bomb, 3),
    "recursion": (gen_recursion, 3),
    "deep_chain": (gen_deep_chain, 2),
    "many_inputs": (gen_many_inputs, 2),
    "symbolic_dims": (gen_symbolic_dims, 3),
    "hidden_external": (gen_hidden_external, 4),
    "terminal_names": (gen_terminal_names, 3),
    "npz_inputs": (gen_npz_inputs, 2),
    "destination": (gen_destination, 3),
    "constant_bomb": (gen_constant_bomb, 2),
    # issue 38: the new surfaces
    "report_neighbour": (gen_report_neighbour, 2),
    "own_data_name": (gen_own_data_name, 2),
    "surface_bomb": (gen_surface_bomb, 2),
    "loop_trips": (gen_loop_trips, 2),
    "long_names": (gen_long_names, 2),
    "replace_lies": (gen_replace_lies, 2),
    "tool_escapes": (gen_tool_escapes, 2),
    "odd_numbers": (gen_odd_numbers, 2),
    "sparse_external": (gen_sparse_external, 2),
    "report_destination": (gen_report_destination, 2),
    "many_calls": (gen_many_calls, 1),
    # issue 53: convert, diff, split / run_stages, modularize, generation folders
    "guard_outputs": (gen_guard_outputs, 3),
    "generation_guard": (gen_generation_guard, 2),
    "manifest": (gen_manifest, 3),
    "long_dims": (gen_long_dims, 2),
    "tool_bounds": (gen_tool_bounds, 2),
    "diff_trailing": (gen_diff_trailing, 2),
    "small_external": (gen_small_external, 2),
    # Run ``export`` (torch and transformers in the children): only with ``--only checkpoint output_folder``.
    "checkpoint": (gen_checkpoint, 0),
    "output_folder": (gen_output_folder, 0),
}

# issue 65: the newest surfaces (the path guard, generate, optimize's options, modularize's bounds, --in-place)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from fuzz_surfaces import GENERATORS as _SURFACES  # noqa: E402

GENERATORS.update(_SURFACES)

_VERIFY_EXTRAS = [[], [], [], ["--seed", "-1"], ["--rtol", "nan"], ["--atol", "-1"], ["--dim", "batch=0"]]


def commands_for(rng: random.Random, name: str, checks: dict | None = None) -> list[list[str]]:
    checks = checks or {}
    if "commands" in checks:  # a case with commands of its own (checkpoint folders: export)
        return checks["commands"]
    verify = ["--inputs", checks["inputs"]] if "inputs" in checks else rng.choice(_VERIFY_EXTRAS)
    return [
        ["tree", name],
        ["inline", name, "out.onnx", *(["--optimize"] if checks.get("optimize") else [])],
        ["verify", name, *verify],
    ]


def check_promises(case: pathlib.Path, checks: dict, results: list[dict]) -> None:
    """Files a case's generator said must survive (``keep``) or must not appear (``outside``,
    next to the case folder): a difference marks the last command ``data-loss``."""
    changed = [path for path, before in checks.get("keep", {}).items() if _fingerprint(case / path) != before]
    changed += [path for path in checks.get("absent", []) if os.path.lexists(case / path)]
    for path, mode in checks.get("modes", {}).items():
        if os.path.isfile(case / path) and stat.S_IMODE(os.stat(case / path).st_mode) != mode:
            changed.append(f"{path} mode {oct(stat.S_IMODE(os.stat(case / path).st_mode))}, was {oct(mode)}")
    for path, (before, mode_before) in checks.get("private_copies", {}).items():
        if os.path.isfile(case / path):
            mode = stat.S_IMODE(os.stat(case / path).st_mode)
            untouched = _fingerprint(case / path) == before
            if (untouched and mode != mode_before) or (not untouched and mode & 0o077):
                changed.append(f"{path} mode {oct(mode)} ({'untouched, was ' + oct(mode_before) if untouched else 'a copy of a 0600 file'})")
    for index in checks.get("must_succeed", []):
        if index < len(results) and results[index]["outcome"] == "ok" and results[index]["exitcode"] != 0:
            results[index].update(outcome="data-loss", exception="a file the command needs was lost or damaged")
    outside = checks.get("outside")
    if outside and os.path.lexists(case.parent / outside):
        changed.append("../" + outside)
        os.unlink(case.parent / outside)
    if changed and results:
        results[-1].update(outcome="data-loss", exception="changed: " + ", ".join(changed))
    for written in checks.get("no_outside_refs", []):
        leaks = _outside_references(case, case / written)
        if leaks and results:  # the inline that wrote it
            results[1].update(outcome="outside-ref", exception=f"{written} refers to {leaks[0]!r}")


def _outside_references(case: pathlib.Path, path: pathlib.Path) -> list[str]:
    """External-data locations of a written file that leave its folder (a read or a later
    write through them would too), or name something other than a regular file."""
    if not path.is_file():
        return []
    model = onnx.load(str(path), load_external_data=False)
    protos = [model.graph, *model.functions]
    found = []
    while protos:
        proto = protos.pop()
        tensors = list(getattr(proto, "initializer", []))
        for sparse in getattr(proto, "sparse_initializer", []):
            tensors += [sparse.values, sparse.indices]
        for node in proto.node:
            for attribute in node.attribute:
                tensors += [attribute.t, *attribute.tensors]
                for sparse in [attribute.sparse_tensor, *attribute.sparse_tensors]:
                    tensors += [sparse.values, sparse.indices]
                protos += [attribute.g, *attribute.graphs]
        for tensor in tensors:
            for entry in tensor.external_data:
                if entry.key == "location":
                    target = os.path.realpath(case / entry.value)
                    if os.path.dirname(target) != os.path.realpath(case) or not os.path.isfile(target):
                        found.append(entry.value)
    return found


# -- the campaign -------------------------------------------------------------------------


def run_campaign(
    cases: int,
    *,
    seed: int = 0,
    first: int = 0,
    timeout: float = 20.0,
    memory_mb: int = 2048,
    only: list[str] | None = None,
    log: pathlib.Path | None = None,
    workdir: pathlib.Path | None = None,
    progress: Callable[[int, dict], None] | None = None,
    server: ForkServer | None = None,
) -> list[dict]:
    """Run ``cases`` cases (3 commands each); returns one record per case."""
    names = only or [name for name, (_, weight) in GENERATORS.items() if weight]
    weights = [GENERATORS[name][1] or 1 for name in names]
    records = []
    with contextlib.ExitStack() as stack:
        if server is None:
            server = ForkServer(torch=bool({"checkpoint", "output_folder"} & set(names)))
            stack.callback(server.close)
        root = workdir or pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fuzz_files-")))
        seeds = make_seeds(root / "seeds")
        log_file = stack.enter_context(open(log, "a")) if log else None
        for index in range(first, first + cases):
            rng = random.Random(f"{seed}:{index}")
            kind = rng.choices(names, weights)[0]
            case = root / f"case{index}"
            case.mkdir()
            try:
                file_name = GENERATORS[kind][0](rng, case, seeds)
            except Exception as e:
                record = {"case": index, "kind": kind, "generator_error": repr(e)}
            else:
                checks = json.loads((case / CHECKS_FILE).read_text()) if (case / CHECKS_FILE).exists() else {}
                results = [
                    run_command(server, argv, case, timeout, memory_mb << 20)
                    for argv in commands_for(rng, file_name, checks)
                ]
                check_promises(case, checks, results)
                record = {"case": index, "kind": kind, "seed": seed, "results": results}
            records.append(record)
            if log_file:
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
            if progress:
                progress(index, record)
            shutil.rmtree(case, ignore_errors=True)
    return records


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
