"""The file fuzzer's generators for issue 38's surfaces: ``profile``, ``extract``, ``replace``, the
flat copy, reports and their destinations, long names, terminal escapes in tool output, odd numbers.
"""

from __future__ import annotations

import os
import shutil

from onnx import TensorProto, helper

from fuzzing.builders import (
    _TERMINAL,
    _checks,
    _fingerprint,
    _write,
    block_model,
    bomb,
    chain_of_calls,
    loop_model,
    save_external,
)


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
