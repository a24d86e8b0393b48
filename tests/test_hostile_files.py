"""Hostile ONNX files and ``verify`` arguments get typed errors, bounded work and no traceback (issue 12).

One test (or a few) per class the file fuzzer (``tests/fuzzing/``) found: special files,
call-expansion bombs, many large inputs, bad external-data references, undecodable names,
nested metadata JSON, ``verify`` arguments, call chains deeper than the inliner accepts, calls
with more inputs than their function declares, and names with terminal escapes. Torch-free.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import random as random_module
import sys
import zipfile

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
from fuzzing import builders, generators_graphs
from onnx import TensorProto, helper

from onnx_modular.check.parity import Tolerance
from onnx_modular.cli import main
from onnx_modular.errors import InvalidInputError, InvalidModelFileError
from onnx_modular.files import load_model_file
from onnx_modular.format import metadata
from onnx_modular.runtime import inputs as file_inputs
from onnx_modular.storage.checks import check_expanded_size, expanded_size

DOMAIN = builders.DOMAIN


def run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(arg) for arg in argv])
    return code, out.getvalue(), err.getvalue()


def assert_clean_error(code: int, err: str, fragment: str) -> None:
    assert code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert fragment in err, err


def chain(depth: int) -> onnx.ModelProto:
    """``f{depth-1}`` calls ... calls ``f0`` (one Relu): calls nest ``depth`` levels."""
    functions = [helper.make_function(DOMAIN, "f0", ["a"], ["b"], [helper.make_node("Relu", ["a"], ["b"])], builders._opsets())]
    for level in range(1, depth):
        body = [builders._call(f"f{level - 1}", ["a"], ["b"])]
        functions.append(helper.make_function(DOMAIN, f"f{level}", ["a"], ["b"], body, builders._opsets()))
    return builders._model([builders._call(f"f{depth - 1}", ["x"], ["y"])], functions)


@pytest.fixture(scope="module")
def external_model(tmp_path_factory) -> pathlib.Path:
    """A model with two external initializers in ``data.bin`` (a MatMul and an Add)."""
    folder = tmp_path_factory.mktemp("ext")
    weight = onnx.numpy_helper.from_array(np.eye(3, dtype=np.float32), "w")
    bias = onnx.numpy_helper.from_array(np.ones(3, dtype=np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["t"]), helper.make_node("Add", ["t", "b"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [weight, bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    onnx.save(model, folder / "m.onnx", save_as_external_data=True, location="data.bin", size_threshold=0)
    return folder / "m.onnx"


def _edit_external(source: pathlib.Path, folder: pathlib.Path, **fields: str) -> pathlib.Path:
    """A copy of ``source`` (and its data) in ``folder``, with the first initializer's reference edited."""
    model = onnx.load(str(source), load_external_data=False)
    (folder / "data.bin").write_bytes((source.parent / "data.bin").read_bytes())
    entries = model.graph.initializer[0].external_data
    for key, value in fields.items():
        for entry in entries:
            if entry.key == key:
                entry.value = value
                break
        else:
            entries.add(key=key, value=value)
    onnx.save(model, folder / "m.onnx")
    return folder / "m.onnx"


# -- 1. special files ------------------------------------------------------------------------


def test_special_files_are_refused_without_reading(tmp_path):
    os.mkfifo(tmp_path / "fifo.onnx")  # reading it would block forever
    os.symlink("/dev/zero", tmp_path / "zero.onnx")  # reading it would never end
    for name in ("fifo.onnx", "zero.onnx"):
        with pytest.raises(InvalidModelFileError, match="is not a regular file"):
            load_model_file(tmp_path / name)
        for argv in (["tree", name], ["inline", name, "out.onnx"], ["verify", name]):
            code, _, err = run_cli(*[tmp_path / a if a.endswith(".onnx") else a for a in argv])
            assert_clean_error(code, err, "is not a regular file")
    assert not (tmp_path / "out.onnx").exists()


def test_external_data_in_a_special_file_is_refused(external_model, tmp_path):
    path = _edit_external(external_model, tmp_path)
    (tmp_path / "data.bin").unlink()
    os.mkfifo(tmp_path / "data.bin")
    with pytest.raises(InvalidModelFileError, match="'data.bin', which is not a regular file"):
        load_model_file(path)


# -- 2. call-expansion bombs -------------------------------------------------------------------


def test_expanded_size_is_counted_without_expanding():
    assert expanded_size(builders.bomb(depth=3, fanout=2)) == (4, 7)  # 4 Relu; 1 + 2 + 4 calls
    nodes, calls = expanded_size(builders.bomb(depth=24, fanout=2))
    assert (nodes, calls) == (2**23, 2**24 - 1)
    # Through If branches: each level is 3 nodes + an If whose two branches call the level below twice.
    nodes, _ = expanded_size(builders.bomb(depth=3, fanout=2, via_if=True))
    assert nodes == 4 + 4 * (4 + 4 * 1)


@pytest.mark.parametrize("via_if", [False, True])
def test_bombs_are_refused_before_anything_expands_them(tmp_path, via_if):
    path = tmp_path / "bomb.onnx"
    onnx.save(builders.bomb(depth=24, fanout=2, via_if=via_if), path)
    code, _, err = run_cli("inline", path, tmp_path / "out.onnx")
    assert_clean_error(code, err, "ONNX_MODULAR_MAX_EXPANDED_")
    assert "its function calls expand to" in err
    code, _, err = run_cli("verify", path)
    assert_clean_error(code, err, "its function calls expand to")
    assert not (tmp_path / "out.onnx").exists()


def test_tree_refuses_sixteen_levels_of_fan_out_two(tmp_path):
    path = tmp_path / "bomb.onnx"
    onnx.save(builders.bomb(depth=16, fanout=2), path)  # 65,535 calls
    code, _, err = run_cli("tree", path)
    assert_clean_error(code, err, "expands to 65535 calls")


def test_the_expansion_limit_can_be_raised(monkeypatch):
    model = builders.bomb(depth=8, fanout=2)  # 255 calls, 128 nodes
    assert check_expanded_size(model) == (128, 255)
    monkeypatch.setenv("ONNX_MODULAR_MAX_EXPANDED_CALLS", "200")
    with pytest.raises(InvalidModelFileError, match="expand to 255 calls .*ONNX_MODULAR_MAX_EXPANDED_CALLS=255"):
        check_expanded_size(model)
    monkeypatch.setenv("ONNX_MODULAR_MAX_EXPANDED_CALLS", "255")
    monkeypatch.setenv("ONNX_MODULAR_MAX_EXPANDED_NODES", "100")
    with pytest.raises(InvalidModelFileError, match="expand to 128 nodes"):
        check_expanded_size(model)


# -- 3. generated inputs: a total bound -----------------------------------------------------------


def test_random_inputs_are_bounded_in_total_before_any_is_made():
    inputs = [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [4096, 4096]) for i in range(40)]
    model = builders._model([helper.make_node("Identity", ["x0"], ["y"])], [], inputs)
    with pytest.raises(InvalidInputError, match=r"'x4' would hold 16777216 elements .*, 83886080 with the inputs before it"):
        file_inputs.random_inputs(model)
    small = [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [64, 64]) for i in range(3)]
    model = builders._model([helper.make_node("Identity", ["x0"], ["y"])], [], small)
    with pytest.raises(InvalidInputError, match="'x2' would hold 4096 elements"):
        file_inputs.random_inputs(model, max_elements=3 * 4096 - 1)
    assert sum(a.size for a in file_inputs.random_inputs(model, max_elements=3 * 4096).values()) == 3 * 4096


# -- 4. external-data references -----------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"location": "../outside.bin"}, "outside the model's folder"),
        ({"location": "/etc/hostname"}, "outside the model's folder"),
        ({"location": "missing.data"}, "cannot be read: No such file"),
        ({"location": "a\x00b"}, "names no valid file"),
        ({"location": "."}, "which is not a regular file"),
        ({"offset": "-5"}, "offset '-5' is not a non-negative integer"),
        ({"offset": str(2**40)}, "reads bytes 1099511627776 to"),
        ({"length": str(2**63 - 1)}, "holds 48 bytes"),
        ({"length": "-1"}, "length '-1' is not a non-negative integer"),
    ],
)
def test_bad_external_data_is_refused_in_one_place(external_model, tmp_path, fields, message):
    (tmp_path / "outside.bin").write_bytes(b"\0" * 64)
    folder = tmp_path / "model"
    folder.mkdir()
    path = _edit_external(external_model, folder, **fields)
    with pytest.raises(InvalidModelFileError, match=message):
        load_model_file(path)
    for argv in (["inline", path, folder / "out.onnx"], ["verify", path], ["tree", path]):
        code, _, err = run_cli(*argv)
        assert_clean_error(code, err, message.split(" '")[0])
    assert sorted(p.name for p in folder.iterdir()) == ["data.bin", "m.onnx"]


def test_good_external_data_still_inlines_and_verifies(external_model, tmp_path):
    code, out, err = run_cli("inline", external_model, tmp_path / "flat.onnx")
    assert code == 0, err
    code, out, err = run_cli("verify", external_model)
    assert code == 0 and "PASS" in out, err


def test_inline_destination_problems_are_typed(external_model, tmp_path):
    code, _, err = run_cli("inline", external_model, tmp_path / ("x" * 250 + ".onnx"))  # 255 bytes: fits
    assert code == 0, err
    assert load_model_file(tmp_path / ("x" * 250 + ".onnx"), load_external_data=True).graph.initializer[0].raw_data
    code, _, err = run_cli("inline", external_model, tmp_path / ("x" * 251 + ".onnx"))
    assert_clean_error(code, err, "bytes long; this file system allows")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root writes anywhere
        pytest.skip("running as root")
    code, _, err = run_cli("inline", external_model, locked / "out.onnx")
    assert code == 2 and "Traceback" not in err and err.startswith("error: "), err


# -- 5. names that are not UTF-8, and names with terminal escapes ------------------------------------


@pytest.mark.parametrize("where", ["function", "input", "node"])
def test_names_that_are_not_utf8_are_refused_and_shown_escaped(tmp_path, where):
    model = chain(2)
    marker = "Q" * 12
    if where == "function":
        model.functions[0].name = marker
        model.functions[1].node[0].op_type = marker
    elif where == "input":
        model.graph.input[0].name = marker
        model.graph.node[0].input[0] = marker
    else:
        model.graph.node[0].name = marker
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString().replace(marker.encode(), b"\xff\xfe" + b"q" * 10))
    for argv in (["tree", path], ["inline", path, tmp_path / "out.onnx"], ["verify", path]):
        code, _, err = run_cli(*argv)
        assert_clean_error(code, err, "'\\xff\\xfeqqqqqqqqqq' is not valid UTF-8")


def test_terminal_escapes_in_names_are_printed_escaped(tmp_path):
    model = chain(2)
    model.graph.node[0].name = "\x1b[2J\x1b[31mred\nline"
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    code, out, err = run_cli("tree", path)
    assert code == 0, err
    assert "\x1b" not in out and "\\x1b[2J\\x1b[31mred\\x0aline" in out
    model.graph.node[0].input[0] = "\x1b[31mnowhere"  # an undefined value: onnxruntime refuses
    onnx.save(model, path)
    code, _, err = run_cli("verify", path)
    assert code == 2 and "\x1b" not in err, err


# -- 6. metadata JSON ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    ["[" * 100_000 + "]" * 100_000, '{"a": ' * 5000 + "1" + "}" * 5000, json.dumps([{"x": 1}, 2])],
    ids=["nested-lists", "nested-objects", "not-strings"],
)
def test_odd_module_paths_metadata_is_ignored(tmp_path, value):
    model = chain(2)
    model.functions[0].metadata_props.add(key=metadata.MODULE_PATHS, value=value)
    model.functions[0].metadata_props.add(key=metadata.CLASS, value="m.C")
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    code, out, err = run_cli("tree", path)
    assert code == 0, err
    assert "f1" in out and "f0" in out


# -- 7. verify arguments -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("small") / "m.onnx"
    onnx.save(chain(2), path)
    return path


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--seed", "-1"], "seed of the random inputs must be an integer >= 0, got -1"),
        (["--rtol", "nan"], "The tolerance rtol=nan must be a finite number >= 0"),
        (["--atol", "-1"], "The tolerance atol=-1.0 must be a finite number >= 0"),
        (["--atol", "inf"], "The tolerance atol=inf"),
    ],
)
def test_verify_refuses_bad_seeds_and_tolerances(small_model, extra, message):
    code, out, err = run_cli("verify", small_model, *extra)
    assert_clean_error(code, err, message)
    assert "PASS" not in out
    with pytest.raises(InvalidInputError):
        Tolerance(atol=float("nan"), rtol=1e-3)


def test_verify_inputs_that_are_not_npz(small_model, tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((2, 3), np.float32))
    code, _, err = run_cli("verify", small_model, "--inputs", tmp_path / "x.npy")
    assert_clean_error(code, err, "a single array saved with np.save")
    code, _, err = run_cli("verify", small_model, "--inputs", tmp_path)
    assert_clean_error(code, err, "is not a regular file")


def test_npz_headers_are_checked_before_allocating(small_model, tmp_path):
    """A member whose header claims 2**40 float32 elements: refused from the header alone."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (2**20, 2**20)})
    with zipfile.ZipFile(tmp_path / "big.npz", "w") as archive:
        archive.writestr("x.npy", header.getvalue() + b"\0" * 64)
    code, _, err = run_cli("verify", small_model, "--inputs", tmp_path / "big.npz")
    assert_clean_error(code, err, "declares shape [1048576, 1048576] of float32 (4398046511104 bytes)")


def test_npz_sizes_are_checked_from_the_zip_directory(tmp_path):
    """A compressed member larger than the bound is refused before it is decompressed."""
    np.savez_compressed(tmp_path / "zeros.npz", x=np.zeros(1 << 20, np.float32))  # 4 MiB, a few KiB on disk
    assert (tmp_path / "zeros.npz").stat().st_size < 100_000
    with pytest.raises(InvalidInputError, match=r"holds 4194\d+ bytes once decompressed, more than 1000000"):
        file_inputs.load_arrays(tmp_path / "zeros.npz", max_bytes=1_000_000)
    assert file_inputs.load_arrays(tmp_path / "zeros.npz")["x"].shape == (1 << 20,)


# -- found by the fuzzer: depth beyond the inliner, calls with too many inputs ------------------------------


def test_call_depth_is_limited_where_the_inliner_stops(tmp_path):
    path = tmp_path / "deep.onnx"
    onnx.save(chain(101), path)
    for argv in (["tree", path], ["inline", path, tmp_path / "out.onnx"], ["verify", path]):
        code, _, err = run_cli(*argv)
        assert_clean_error(code, err, "function calls nest 101 levels deep (more than 100")
    onnx.save(chain(100), path)
    code, _, err = run_cli("inline", path, tmp_path / "out.onnx")
    assert code == 0, err


def test_a_call_with_more_inputs_than_its_function_is_refused(tmp_path):
    model = chain(2)
    model.graph.node[0].input.append("x")
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    code, _, err = run_cli("inline", path, tmp_path / "out.onnx")
    assert_clean_error(code, err, "with 2 inputs and 1 outputs, but the function declares 1 inputs and 1 outputs")


# -- verify writes nothing next to the model ---------------------------------------------------------


def test_verify_with_external_data_writes_nothing_next_to_the_model(external_model, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    path = _edit_external(external_model, folder)
    before = (sorted(p.name for p in folder.iterdir()), os.stat(folder).st_mtime_ns)
    code, out, err = run_cli("verify", path)
    assert code == 0 and "PASS" in out, err
    # A file created and removed in the folder would change its modification time.
    assert (sorted(p.name for p in folder.iterdir()), os.stat(folder).st_mtime_ns) == before


def test_verify_against_pytorch_with_external_data_writes_nothing_next_to_the_model(tmp_path):
    """The instrumented copy (per-module localization) is run from memory too."""
    import torch

    from onnx_modular import export_modular, verify

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).eval()
    path = tmp_path / "m.onnx"
    export_modular(model, (torch.randn(2, 4),), path, external_data=True)
    before = (sorted(p.name for p in tmp_path.iterdir()), os.stat(tmp_path).st_mtime_ns)
    report = verify(path, model)
    assert report.ok and report.checks[0].modules is not None
    assert [m.module_path for m in report.checks[0].modules.modules] == ["0", "1", "2"]
    assert (sorted(p.name for p in tmp_path.iterdir()), os.stat(tmp_path).st_mtime_ns) == before


def test_the_tree_limit_is_the_same_and_can_be_raised(tmp_path, monkeypatch):
    path = tmp_path / "bomb.onnx"
    onnx.save(builders.bomb(depth=8, fanout=2), path)  # 255 calls
    monkeypatch.setenv("ONNX_MODULAR_MAX_EXPANDED_CALLS", "254")
    code, _, err = run_cli("tree", path)
    assert_clean_error(code, err, "expands to 255 calls (more than 254)")
    assert "ONNX_MODULAR_MAX_EXPANDED_CALLS=255" in err
    monkeypatch.setenv("ONNX_MODULAR_MAX_EXPANDED_CALLS", "255")
    code, out, err = run_cli("tree", path)
    assert code == 0, err
    assert len(out.splitlines()) == 1 + 255


# -- issue 25: every tensor goes through the one external-data check ---------------------------


def _hidden_reference(where: str, location: str) -> onnx.ModelProto:
    """A model whose only external reference sits at ``where``."""
    values = helper.make_tensor("v", TensorProto.FLOAT, [2], [1.0, 2.0])
    indices = helper.make_tensor("i", TensorProto.INT64, [2], [0, 4])
    dense = helper.make_tensor("w", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])
    target = indices if where == "sparse-indices" else dense if where in ("function-if", "mislabelled") else values
    builders._external_ref(target, location)
    sparse = helper.make_sparse_tensor(values, indices, [2, 3])
    relu = [helper.make_node("Relu", ["x"], ["y"])]
    if where in ("sparse-values", "sparse-indices"):
        model = builders._model(relu, [])
        model.graph.sparse_initializer.append(sparse)
        return model
    if where == "constant-sparse-value":
        body = [helper.make_node("Constant", [], ["s"], sparse_value=sparse), helper.make_node("Relu", ["a"], ["b"])]
    elif where == "function-if":
        branch = helper.make_graph(
            [helper.make_node("Identity", ["w"], ["o"])], "then", [], [helper.make_tensor_value_info("o", TensorProto.FLOAT, [3])], [dense]
        )
        body = [
            helper.make_node("Constant", [], ["c"], value=helper.make_tensor("c", TensorProto.BOOL, [], [True])),
            helper.make_node("If", ["c"], ["k"], then_branch=branch, else_branch=branch),
            helper.make_node("Relu", ["a"], ["b"]),
        ]
    else:  # a tensor attribute whose declared type says INT
        attribute = helper.make_attribute("value", dense)
        attribute.type = onnx.AttributeProto.INT
        body = [helper.make_node("Constant", [], ["w2"]), helper.make_node("Relu", ["a"], ["b"])]
        body[0].attribute.append(attribute)
    function = helper.make_function(DOMAIN, "f", ["a"], ["b"], body, builders._opsets())
    return builders._model([builders._call("f", ["x"], ["y"])], [function])


HIDDEN = ["sparse-values", "sparse-indices", "constant-sparse-value", "function-if", "mislabelled"]


@pytest.mark.parametrize("where", HIDDEN)
def test_references_in_every_tensor_are_checked(tmp_path, where):
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "secret.bin").write_bytes(b"\x01" * 64)
    os.symlink("../secret.bin", folder / "link.bin")  # a link out of the folder
    os.mkfifo(folder / "fifo.bin")
    for location, message in (
        ("../secret.bin", "outside the model's folder"),
        ("link.bin", "outside the model's folder"),
        ("fifo.bin", "which is not a regular file"),
    ):
        path = folder / "m.onnx"
        path.write_bytes(_hidden_reference(where, location).SerializeToString())
        with pytest.raises(InvalidModelFileError, match=message):
            load_model_file(path)
        if location != "fifo.bin":  # (a missed FIFO would hang: the load above proves the check)
            for argv in (["tree", path], ["inline", path, folder / "out.onnx"], ["verify", path]):
                assert_clean_error(*run_cli(*argv)[::2], message)
    assert sorted(os.listdir(folder)) == ["fifo.bin", "link.bin", "m.onnx"]


def test_hidden_references_inside_the_folder_are_loaded(tmp_path):
    """The same places, pointing at a good file, load through the bounded loader (inline keeps them)."""
    from onnx_modular.storage.load import load_external_data

    for where in HIDDEN:
        (tmp_path / "d.bin").write_bytes(np.array([5.0, 6.0, 7.0], dtype=np.float32).tobytes())
        model = _hidden_reference(where, "d.bin")
        if where == "sparse-indices":
            (tmp_path / "d.bin").write_bytes(np.array([0, 4], dtype=np.int64).tobytes())
        elif where in ("sparse-values", "constant-sparse-value"):
            (tmp_path / "d.bin").write_bytes(np.array([5.0, 6.0], dtype=np.float32).tobytes())
        load_external_data(model, tmp_path)
        from onnx_modular.storage.proto import all_tensors, uses_external_data

        assert not uses_external_data(model), where
        assert any(t.raw_data for t in all_tensors(model)), where


# -- issue 25: npz inputs, --dim, names on the terminal -----------------------------------------


@pytest.mark.parametrize("how", range(5), ids=["strings", "U0", "records", "encrypted", "compression"])
def test_odd_npz_inputs_are_typed_errors(small_model, tmp_path, how):
    class Fixed(random_module.Random):
        def randrange(self, n):
            return how

        def choice(self, seq):
            return seq[-1]

    (tmp_path / "in.npz").write_bytes(generators_graphs._npz_bytes(Fixed()))
    code, _, err = run_cli("verify", small_model, "--inputs", tmp_path / "in.npz")
    assert_clean_error(code, err, "is not a readable .npz file")


def test_a_zero_dimension_is_refused_as_documented(small_model):
    assert_clean_error(*run_cli("verify", small_model, "--dim", "batch=0")[::2], "size >= 1")


def test_names_are_escaped_in_every_report(tmp_path):
    bad = "\x1b[2J\x07\u202eevil"
    model = builders._model(
        [builders._call("f", ["x" + bad], ["y" + bad])],
        [helper.make_function(DOMAIN, "f", ["a"], ["b"], [helper.make_node("Relu", ["a"], ["b"])], builders._opsets())],
        inputs=[helper.make_tensor_value_info("x" + bad, TensorProto.FLOAT, [2, 3])],
        outputs=[helper.make_tensor_value_info("y" + bad, TensorProto.FLOAT, [2, 3])],
    )
    model.graph.node[0].name = "call\u202eeman"
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    raw = ("\x1b", "\x07", "\u202e")
    for argv in (["tree", path], ["verify", path], ["inline", path, tmp_path / "out.onnx"]):
        code, out, err = run_cli(*argv)
        assert code == 0, err
        assert not any(c in out + err for c in raw), (argv, out, err)
    assert "\\u202eeman" in run_cli("tree", path)[1]
    assert "y\\x1b[2J\\x07\\u202eevil" in run_cli("verify", path)[1]  # the report's output column
    # the mismatch line names the outputs too: expected values that differ
    np.savez(tmp_path / "expected.npz", **{"y" + bad: np.full((2, 3), 99.0, dtype=np.float32)})
    np.savez(tmp_path / "in.npz", **{"x" + bad: np.ones((2, 3), dtype=np.float32)})
    code, out, err = run_cli("verify", path, "--inputs", tmp_path / "in.npz", "--expected", tmp_path / "expected.npz")
    assert code == 1 and err.startswith("error: outputs differ"), err
    assert not any(c in out + err for c in raw) and "\\u202eevil" in err


# -- issue 25: memory follows the file's real size ----------------------------------------------


def test_a_file_is_held_once_while_read(tmp_path):
    import tracemalloc

    from onnx_modular.storage.load import read_regular_file

    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(1 << 20) * 48)  # 48 MiB
    tracemalloc.start()
    try:
        data = read_regular_file(path, "big.bin", limit=1 << 30)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(data) == 48 << 20
    assert peak < 1.1 * (48 << 20), peak  # joined chunks would peak at twice the size


def test_inline_optimize_does_not_fold_declared_giant_constants(tmp_path):
    """A 150-byte file whose constant folds to 1024**3 floats: the fold is refused before it is
    evaluated (onnxscript evaluates, then checks the size), so nothing of 4 GiB is allocated."""
    import subprocess

    for how in range(3):
        case = tmp_path / f"case{how}"
        case.mkdir()

        class Fixed(random_module.Random):
            kind = how

            def randrange(self, n):
                return self.kind

            def choice(self, seq):
                return seq[0]

        name = generators_graphs.gen_constant_bomb(Fixed(), case, {})
        code = (
            "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30));"
            f"from onnx_modular.cli import main; sys.exit(main(['inline', {name!r}, 'out.onnx', '--optimize']))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=case, capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "Unable to allocate" not in done.stderr and "MemoryError" not in done.stderr, done.stderr[-2000:]
        assert (case / "out.onnx").stat().st_size < 10_000


# -- issue 25: memory follows what a tool needs, not what the file stores ---------------------


def test_tree_holds_a_big_file_once(tmp_path):
    """``tree`` reads names and shapes only: the weights stored in the file are not parsed, so a
    file near protobuf's 2 GiB limit is never held twice (it was: bytes plus parsed model)."""
    size = 160 * 2**20  # 160 MiB of float32 in one initializer, inside the .onnx file
    weight = onnx.numpy_helper.from_array(np.random.default_rng(0).random(size // 4, dtype=np.float32), "w")
    node = helper.make_node("Mul", ["x", "w"], ["y"])
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size // 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size // 4])], [weight],
    )
    path = tmp_path / "big.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    del weight, graph
    # VmHWM, not ru_maxrss: the latter keeps the parent's peak across fork and exec.
    code = (
        "import re\n"
        "from onnx_modular.cli import main\n"
        "def peak(): return int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
        "before = peak()\n"
        f"assert main(['tree', {str(path)!r}]) == 0\n"
        "print('peak-growth-kib', peak() - before)\n"
    )
    proc = __import__("subprocess").run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{size // 4:,} params" in proc.stdout, proc.stdout
    growth = int(proc.stdout.split("peak-growth-kib")[1]) * 1024
    file_size = path.stat().st_size
    assert growth < 1.3 * file_size, f"tree grew by {growth / file_size:.2f}x the file size"
    # The structure read without the values is the structure read with them.
    from onnx_modular.files import function_tree

    with_values = function_tree(load_model_file(path)).to_dict()
    assert function_tree(load_model_file(path, values=False)).to_dict() == with_values
    stripped = load_model_file(path, values=False).graph.initializer[0]
    assert (stripped.name, list(stripped.dims), stripped.data_type, stripped.raw_data) == ("w", [size // 4], 1, b"")
