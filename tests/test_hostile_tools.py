"""Hostile input on convert, diff, split / run_stages, modularize and generation folders (issue 53).

One test (or a few) per failure class; each class also has a generator in
``tests/fuzzing/`` (named in the test's docstring). Tiny files built with onnx.helper.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import shutil
import sys

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from fuzzing import builders, runner
from fuzzing.cases import run_campaign
from onnx import TensorProto, helper

from onnx_modular.cli import main
from onnx_modular.errors import InvalidInputError, InvalidModelFileError
from onnx_modular.files.split.tool import run_stages
from onnx_modular.storage import commit, guard, save
from onnx_modular.storage.checks import check_expanded_size

block_model, save_external, loop_model = builders.block_model, builders.save_external, builders.loop_model


def run_cli(*argv, cwd: pathlib.Path | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    previous = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(arg) for arg in argv])
    finally:
        os.chdir(previous)
    return code, out.getvalue(), err.getvalue()


def snapshot(folder: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# -- 1. no output replaces a file a model reads --------------------------------------------


def test_outputs_never_replace_the_input_or_any_models_data(tmp_path):
    """``guard_outputs``: every tool's outputs (models, data files, JSON, HTML) are refused before any
    work when they are the input, its data, or another model's data; every file stays byte-identical."""
    for name in ("m", "a", "b"):
        save_external(block_model(), tmp_path / f"{name}.onnx", f"{name}.onnx.data")
    before = snapshot(tmp_path)
    cases = [
        (["convert", "m.onnx", "-o", "m.onnx", "--dtype", "float16"], "the input file 'm.onnx'"),
        (["convert", "m.onnx", "-o", "m.onnx.data", "--dtype", "float16"], "the external data of the input 'm.onnx'"),
        (["convert", "a.onnx", "-o", "b.onnx.data", "--dtype", "float16"], "the external data of 'b.onnx'"),
        (["convert", "m.onnx", "-o", "x.onnx", "--dtype", "float16", "--json", "m.onnx.data"], "m.onnx"),
        (["diff", "a.onnx", "a.onnx", "--html", "a.onnx.data"], "a.onnx"),
        (["diff", "a.onnx", "b.onnx", "--json", "b.onnx.data"], "b.onnx"),
        (["modularize", "a.onnx", "-o", "a.onnx.data"], "a.onnx"),
        (["modularize", "a.onnx", "-o", "b.onnx.data"], "b.onnx"),
        (["inline", "m.onnx", "m.onnx.data"], "m.onnx"),
        (["profile", "m.onnx", "--json", "m.onnx.data", "--runs", "1", "--warmup", "0"], "m.onnx"),
    ]
    for argv, owner in cases:
        code, _, err = run_cli(*argv, cwd=tmp_path)
        assert code == 2 and "[input] The output" in err and owner in err, (argv, err)
        assert snapshot(tmp_path) == before, argv
    assert not (tmp_path / "x.onnx").exists()  # convert's --json is checked before the model is written
    assert run_cli("verify", "m.onnx", cwd=tmp_path)[0] == 0


def test_a_generation_folder_is_guarded_as_a_unit(tmp_path):
    """``guard_outputs`` (generation): ``decode.onnx`` reads its weights from ``prefill.onnx.data``:
    no output may replace that file, whichever model is converted."""
    save_external(block_model(), tmp_path / "prefill.onnx", "prefill.onnx.data")
    shutil.copy(tmp_path / "prefill.onnx", tmp_path / "decode.onnx")  # reads prefill.onnx.data
    before = snapshot(tmp_path)
    for argv in (["convert", "decode.onnx", "-o", "prefill.onnx.data", "--dtype", "float16"],
                 ["inline", "decode.onnx", "prefill.onnx.data"]):  # fmt: skip
        code, _, err = run_cli(*argv, cwd=tmp_path)
        assert code == 2 and "prefill.onnx.data" in err, err
    with pytest.raises(InvalidInputError, match="decode.onnx|prefill.onnx"):
        guard.check_outputs([tmp_path / "prefill.onnx.data"])  # the neighbours alone, no input declared
    assert snapshot(tmp_path) == before
    assert guard.data_locations(tmp_path / "decode.onnx") == {"prefill.onnx.data"}


def test_a_folder_commit_moves_every_data_file_before_any_model(tmp_path, monkeypatch):
    """``kill -9`` during a folder publish: ``decode.onnx`` is moved in only once ``prefill``'s new data
    file is there (data files first, then models), so no model ever points at a missing file."""
    staged = tmp_path / "staged"
    staged.mkdir()
    save_external(block_model(), staged / "prefill.onnx", "prefill.onnx.data")
    model = onnx.load(str(staged / "prefill.onnx"), load_external_data=False)
    onnx.save(model, str(staged / "decode.onnx"))  # reads prefill.onnx.data
    out = tmp_path / "out"
    seen = []
    real = commit._move_model_in

    def checked(entry, **kwargs):  # the model about to move in reads only data files already in place
        for location in guard.data_locations(entry.staging.model_path):
            assert (entry.staging.destination.parent / location).is_file(), (entry.staging.destination.name, location)
        seen.append(entry.staging.destination.name)
        return real(entry, **kwargs)

    monkeypatch.setattr(commit, "_move_model_in", checked)
    save.publish_folder(staged, out)
    assert seen[:2] == ["decode.onnx", "prefill.onnx"]
    assert guard.data_locations(out / "decode.onnx") == guard.data_locations(out / "prefill.onnx")
    assert run_cli("verify", out / "decode.onnx")[0] == 0 and run_cli("verify", out / "prefill.onnx")[0] == 0


# -- 5. valid files that were refused or broken --------------------------------------------


def test_a_small_model_still_reading_external_data_is_saved_with_its_weights(tmp_path):
    """``small_external`` (issue 51's first item): a model small enough to hold its weights, whose
    tensors are still read from the source's data file (``convert --quantize int4`` of a small
    model), was refused by the checker at save ("should be stored in .onnx_modular-tmp-.../m.onnx.data,
    but it is not regular file")."""
    (tmp_path / "src").mkdir()
    save_external(block_model(), tmp_path / "src" / "m.onnx", "m.onnx.data")
    model = ir.load(tmp_path / "src" / "m.onnx")
    assert isinstance(model.graph.initializers["w"].const_value, ir.ExternalTensor)
    with save.staged_save(model, tmp_path / "out.onnx"):
        pass
    saved = onnx.load(str(tmp_path / "out.onnx"))
    assert not onnx.external_data_helper.uses_external_data(saved.graph.initializer[0])
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(saved.graph.initializer[0]), np.arange(6, dtype=np.float32).reshape(2, 3))


# -- 4. run_stages reads manifest.json as untrusted input ----------------------------------


def _stage(path: pathlib.Path, nodes, inputs, outputs) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    graph = helper.make_graph(
        nodes, "stage", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in outputs],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    onnx.save(model, str(path))


def split_folder(folder: pathlib.Path) -> dict:
    """Two stages: ``t = relu(x)``, then ``y = t + x``; the manifest split writes."""
    _stage(folder / "stage_0" / "model.onnx", [helper.make_node("Relu", ["x"], ["t"])], ["x"], ["t"])
    _stage(folder / "stage_1" / "model.onnx", [helper.make_node("Add", ["t", "x"], ["y"])], ["t", "x"], ["y"])
    manifest = {
        "stages": [
            {"file": "stage_0/model.onnx", "inputs": {"x": "x"}, "outputs": ["t"]},
            {"file": "stage_1/model.onnx", "inputs": {"t": "stage_0/t", "x": "x"}, "outputs": ["y"]},
        ],
        "outputs": {"y": "stage_1/y"},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def test_run_stages_checks_its_manifest_before_running(tmp_path):
    """``manifest``: nesting, types, unknown outputs, links out of the folder, FIFOs, shared files,
    feeds that are not a mapping or named like a stage output: each a typed error, nothing run."""
    folder = tmp_path / "split"
    manifest = split_folder(folder)
    x = np.array([[-1, 2, 3], [4, -5, 6]], dtype=np.float32)
    np.testing.assert_array_equal(run_stages(folder, {"x": x})["y"], np.maximum(x, 0) + x)
    bad = {
        "nesting": {"stages": [[[[[[[[[[[[1]]]]]]]]]]]], "outputs": {}},
        "a list for a name": {**manifest, "outputs": {"y": ["stage_1/y"]}},
        "unknown output": {**manifest, "outputs": {"y": "stage_7/y"}},
        "shared file": {**manifest, "stages": [manifest["stages"][0], {**manifest["stages"][1], "file": "stage_0/model.onnx"}]},
        "outside": {**manifest, "stages": [{**manifest["stages"][0], "file": "../elsewhere.onnx"}, manifest["stages"][1]]},
    }
    for _why, content in bad.items():
        (folder / "manifest.json").write_text(json.dumps(content))
        with pytest.raises(InvalidInputError, match="not a valid split manifest"):
            run_stages(folder, {"x": x})
    (folder / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InvalidInputError, match="nests more than"):
        run_stages(folder, {"x": x})
    (folder / "manifest.json").write_text(json.dumps(manifest))
    elsewhere = tmp_path / "elsewhere"
    shutil.move(folder / "stage_1", elsewhere)
    os.symlink(elsewhere, folder / "stage_1")  # a stage folder linking out of the split folder
    with pytest.raises(InvalidInputError, match="symbolic link"):
        run_stages(folder, {"x": x})
    os.unlink(folder / "stage_1")
    (folder / "stage_1").mkdir()
    os.mkfifo(folder / "stage_1" / "model.onnx")  # a FIFO must not hang the run
    with pytest.raises(InvalidInputError, match="not a regular file"):
        run_stages(folder, {"x": x})
    os.unlink(folder / "stage_1" / "model.onnx")
    shutil.copy(elsewhere / "model.onnx", folder / "stage_1" / "model.onnx")
    with pytest.raises(InvalidInputError, match="mapping"):
        run_stages(folder, [x])
    with pytest.raises(InvalidInputError, match="named like the output of stage 0"):
        run_stages(folder, {"x": x, "stage_0/t": x})


def test_run_stages_bounds_its_stage_files(tmp_path):
    """``manifest`` (bombs): a stage that is a call bomb, or a Loop of 2**62 trips, is refused before
    onnxruntime runs it."""
    folder = tmp_path / "split"
    split_folder(folder)
    onnx.save(builders.bomb(depth=24), str(folder / "stage_1" / "model.onnx"))
    with pytest.raises(InvalidModelFileError, match="stage 1"):
        run_stages(folder, {"x": np.ones((2, 3), np.float32)})
    onnx.save(loop_model(2**62, condition=True), str(folder / "stage_1" / "model.onnx"))
    with pytest.raises(InvalidModelFileError, match="ONNX_MODULAR_MAX_LOOP_TRIPS"):
        run_stages(folder, {"x": np.ones((2, 3), np.float32)})


# -- 2. bounds on work --------------------------------------------------------------------


def test_loops_over_the_limit_are_refused_and_run_time_ones_are_stopped(tmp_path, monkeypatch):
    """``loop_trips``, ``tool_bounds``: a constant trip count above the limit is refused whatever the
    condition; one computed from shapes is accepted; a ``while`` loop whose condition never turns
    false (decided by the data) is stopped after ``ONNX_MODULAR_LOOP_SECONDS`` with a typed error."""
    with pytest.raises(InvalidModelFileError, match="ONNX_MODULAR_MAX_LOOP_TRIPS"):
        check_expanded_size(loop_model(2**62, condition=True))
    shaped = loop_model(100)
    shaped.graph.node.insert(0, helper.make_node("Shape", ["x"], ["shape"]))
    shaped.graph.node.insert(1, helper.make_node("ReduceProd", ["shape"], ["M_run"], keepdims=0))
    shaped.graph.node[2].input[0] = "M_run"
    check_expanded_size(shaped)
    endless = loop_model(100, condition=True)
    endless.graph.node[2].input[0] = ""  # no trip count: while the condition holds
    for tensor in endless.graph.initializer:
        if tensor.name == "zero":
            tensor.float_data[:] = [-1e9]  # sum(x) > -1e9: always
    onnx.save(endless, str(tmp_path / "endless.onnx"))
    monkeypatch.setenv("ONNX_MODULAR_LOOP_SECONDS", "1")
    code, _, err = run_cli("verify", tmp_path / "endless.onnx")
    assert code == 2 and "ran longer than 1 s" in err and "ONNX_MODULAR_LOOP_SECONDS" in err, err
    monkeypatch.setenv("ONNX_MODULAR_MAX_LOOP_TRIPS", str(2**62))
    check_expanded_size(loop_model(2**62, condition=True))


# -- 6. silently wrong answers, Ctrl-C ----------------------------------------------------


def test_ctrl_c_while_the_command_line_imports_is_one_line(tmp_path):
    """``Ctrl-C`` in the first half second of ``python -m onnx_modular`` (numpy, onnx importing): exit
    130 and ``interrupted``, no import traceback; a library import keeps Python's KeyboardInterrupt."""
    import signal
    import subprocess

    code = ("import sys, os, signal, time; sys.orig_argv = [sys.executable, '-m', 'onnx_modular']; import onnx_modular; "
            "os.kill(os.getpid(), signal.SIGINT); time.sleep(30)")  # fmt: skip
    # the child starts with Ctrl-C's default action whatever the runner's is: a process started in the
    # background of a non-interactive shell (or by some test runners) inherits SIGINT ignored, which
    # Python and the command line rightly leave alone
    def child(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                              env={**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parent.parent)})  # fmt: skip

    done = child(code)
    assert done.returncode == 130 and done.stderr.strip() == "interrupted", done.stderr
    # imported as a library (in a child too: this runner's own SIGINT may be ignored, as above)
    library = child("import signal, onnx_modular; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)")
    assert library.returncode == 0 and library.stdout.strip() == "True", library.stderr


def test_diff_reads_an_external_tensor_without_length_by_its_size(tmp_path):
    """``diff_trailing``: a reference without ``length`` into a data file with trailing bytes (or a
    sparse 20 GiB one) reads the tensor's own bytes: the same weights are the same."""
    save_external(block_model(), tmp_path / "a.onnx", "a.onnx.data")
    model = onnx.load(str(tmp_path / "a.onnx"), load_external_data=False)
    for tensor in model.graph.initializer:
        kept = [(e.key, e.value) for e in tensor.external_data if e.key != "length"]
        del tensor.external_data[:]
        for key, value in kept:
            tensor.external_data.add(key=key, value=value if key != "location" else "b.onnx.data")
    onnx.save(model, str(tmp_path / "b.onnx"))
    shutil.copy(tmp_path / "a.onnx.data", tmp_path / "b.onnx.data")
    with open(tmp_path / "b.onnx.data", "ab") as data:
        data.write(b"\x01" * 100)
    code, out, err = run_cli("diff", "a.onnx", "b.onnx", "--structure-only", cwd=tmp_path)
    assert code == 0, out + err
    with open(tmp_path / "b.onnx.data", "r+b") as data:
        data.truncate(20 * 2**30)
    code, out, err = run_cli("diff", "a.onnx", "b.onnx", cwd=tmp_path)
    assert code == 0, out + err


def test_convert_keeps_one_of_two_calls_sharing_a_weight_in_functions_without_types(tmp_path):
    """``shared_weight``: ``w`` feeds a kept call and a converted one, and neither function declares
    the types of its values (a hand-written file): the save's checker refused the result."""
    from onnx_modular.files.convert.tool import convert

    domain = "pkg.fuzz.block"
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(domain, 1)]
    add = helper.make_function(domain, "A", ["a", "w"], ["b"], [helper.make_node("Add", ["a", "w"], ["b"])], opsets[:1])
    mul = helper.make_function(domain, "B", ["a", "w"], ["b"], [helper.make_node("Mul", ["a", "w"], ["b"])], opsets[:1])
    graph = helper.make_graph(
        [helper.make_node("A", ["x", "w"], ["t"], domain=domain, name="/a"), helper.make_node("B", ["t", "w"], ["y"], domain=domain, name="/b")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [onnx.numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=opsets, functions=[add, mul])
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "m.onnx"))
    for kept in ("A", "B"):
        report = convert(tmp_path / "m.onnx", tmp_path / f"{kept}.onnx", dtype="float16", keep=[kept])
        assert report.kept == [f"/{kept.lower()}"] and max(d for _, d in report.outputs.values()) < 1e-3
        onnx.checker.check_model(str(tmp_path / f"{kept}.onnx"), full_check=True)


def _scoped_loop(tmp_path: pathlib.Path) -> pathlib.Path:
    model = loop_model(5)
    model.graph.node[0].name = "/blk/Loop"
    model.graph.node.insert(0, helper.make_node("Relu", ["x"], ["x0"], name="/pre/Relu"))
    model.graph.node[1].input[2] = "x0"
    onnx.save(model, str(tmp_path / "loop.onnx"))
    return tmp_path / "loop.onnx"


def test_modularize_outlines_a_loop_whose_body_holds_an_initializer(tmp_path):
    """``loop_initializer``: the body's own initializer was taken for a value read from outside, and
    the call read it before anything defined it (the checker refused the file)."""
    from onnx_modular.files.modularize.tool import modularize

    report = modularize(_scoped_loop(tmp_path), tmp_path / "m.onnx")
    assert report.parity.ok
    model = onnx.load(str(tmp_path / "m.onnx"))
    assert sorted(f.name for f in model.functions) == ["blk", "pre"]
    assert [list(n.input) for n in model.graph.node if n.op_type == "blk"] == [["x0", "M"]]  # not the body's "one"


def test_a_value_computed_twice_is_a_typed_error_for_every_tool(tmp_path):
    """``duplicate_outputs``: two nodes (or one node twice) computing one name: modularize, convert,
    split and diff failed in onnx_ir with a traceback."""
    nodes = [helper.make_node("Relu", ["x"], ["t"], name="/a/Relu"), helper.make_node("Neg", ["x"], ["t"], name="/b/Neg"),
             helper.make_node("Add", ["t", "x"], ["y"], name="/c/Add")]  # fmt: skip
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), str(tmp_path / "d.onnx"))
    for argv in (["modularize", "d.onnx", "-o", "m.onnx"], ["convert", "d.onnx", "-o", "c.onnx", "--quantize", "int8"],
                 ["diff", "d.onnx", "d.onnx"], ["split", "d.onnx", "-o", "s", "--stages", "2"]):  # fmt: skip
        code, _, err = run_cli(*argv, cwd=tmp_path)
        assert code == 2 and "computed twice" in err, (argv, err)


def test_convert_says_which_calls_overflow_when_the_outputs_hide_it(tmp_path):
    """``overflow``: a call overflows float16 (inf on its row) while a later ``Tanh`` brings the output
    back: the summary said a drift of a fraction of a percent and nothing else; it names the call.
    Since issue 51 convert measures the values on the original run and keeps such calls float32
    itself (it says so); a call that still overflows is named by the same line."""
    from onnx_modular.files.convert.tool import convert

    domain = "pkg.fuzz.block"
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(domain, 1)]
    big = helper.make_function(domain, "Big", ["a", "w"], ["b"], [helper.make_node("Mul", ["a", "w"], ["c"]), helper.make_node("Mul", ["c", "w"], ["b"])], opsets[:1])
    squash = helper.make_function(domain, "Squash", ["a"], ["b"], [helper.make_node("Tanh", ["a"], ["b"])], opsets[:1])
    graph = helper.make_graph(
        [helper.make_node("Big", ["x", "w"], ["t"], domain=domain, name="/big"), helper.make_node("Squash", ["t"], ["y"], domain=domain, name="/squash")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [onnx.numpy_helper.from_array(np.full((2, 3), 1e3, dtype=np.float32), "w")],  # x * 1e6: past float16's 65504
    )  # fmt: skip
    from onnx_modular.format import metadata

    for function in (big, squash):  # module functions, as onnx_modular writes them (their class)
        function.metadata_props.add(key=metadata.CLASS, value=function.name)
    model = helper.make_model(graph, opset_imports=opsets, functions=[big, squash])
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "m.onnx"))
    report = convert(tmp_path / "m.onnx", tmp_path / "f16.onnx", dtype="float16")
    text = str(report)
    assert [c for c, _ in report.range_kept] == ["/big", "/squash"] and report.max_drift == 0, text
    assert "2 calls kept float32 for it (/big, /squash; values up to" in text, text
    import dataclasses

    overflowed = dataclasses.replace(report, calls=[dataclasses.replace(c, overflow=c.call_name == "/big") for c in report.calls])
    text = str(overflowed)
    assert "1 calls overflow" in text and "/big" in text.split("calls overflow", 1)[1].splitlines()[0], text


def test_issue53_generators_find_no_failure(tmp_path):
    """One case of each issue 53 kind (seed 69 draws each once in 7 cases), through the fuzzer's
    child processes (limits, promises)."""
    kinds = ["guard_outputs", "generation_guard", "manifest", "long_dims", "tool_bounds", "diff_trailing", "small_external"]
    records = run_campaign(7, seed=69, timeout=120, memory_mb=2048, only=kinds, workdir=tmp_path)
    assert sorted(r["kind"] for r in records) == sorted(kinds)
    assert not runner.failure_classes(records), runner.summary(records)


def test_split_bounds_the_values_crossing_its_cuts(tmp_path, monkeypatch):
    """``tool_bounds`` (split): a large activation crossing a cut (1 GiB took 15 times its size in
    memory, then a traceback) is a typed error naming the limit, before the stages are written."""
    domain = "pkg.fuzz.block"
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(domain, 1)]
    big = helper.make_function(domain, "Big", ["a", "s"], ["b"], [helper.make_node("Expand", ["a", "s"], ["b"])], opsets[:1])
    red = helper.make_function(domain, "Red", ["a"], ["b"], [helper.make_node("ReduceSum", ["a"], ["b"], keepdims=0)], opsets[:1])
    graph = helper.make_graph(
        [helper.make_node("Big", ["x", "s"], ["t"], domain=domain, name="/big"), helper.make_node("Red", ["t"], ["y"], domain=domain, name="/red")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        [onnx.numpy_helper.from_array(np.array([4096], np.int64), "s")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=opsets, functions=[big, red])
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "m.onnx"))
    monkeypatch.setenv("ONNX_MODULAR_MAX_TEST_DATA_BYTES", "1000")
    code, _, err = run_cli("split", "m.onnx", "-o", "s", "--at", "/red", cwd=tmp_path)
    assert code == 2 and "ONNX_MODULAR_MAX_TEST_DATA_BYTES" in err and "16,392" in err, err
    assert not (tmp_path / "s").exists()
    monkeypatch.delenv("ONNX_MODULAR_MAX_TEST_DATA_BYTES")
    code, _, err = run_cli("split", "m.onnx", "-o", "s", "--at", "/red", cwd=tmp_path)
    assert code == 0, err
