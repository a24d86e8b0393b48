"""Hostile input on the surfaces added since issue 25 (issue 38): ``profile``, ``extract``,
``replace``, the flat copy and ``inline``, the checkpoint output folder, ``view``, reports.

One test (or a few) per failure class; each class also has a generator in
``tests/fuzzing/`` (named in the test's docstring). Tiny files built with onnx.helper;
torch only where the class is torch's (``custom_translation_table``).
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import os
import pathlib
import random
import socket
import stat
import threading

import numpy as np
import onnx
import pytest
from fuzzing import builders, generators_export, runner
from fuzzing.cases import run_campaign
from onnx import TensorProto, helper

from onnx_modular.cli import main
from onnx_modular.errors import InvalidInputError, InvalidModelFileError, SaveError
from onnx_modular.files import inline_file, load_model_file
from onnx_modular.storage import save
from onnx_modular.storage.checks import check_expanded_size

block_model, save_external, loop_model = builders.block_model, builders.save_external, builders.loop_model


def run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(arg) for arg in argv])
    return code, out.getvalue(), err.getvalue()


def fingerprint(path: pathlib.Path) -> bytes:
    return path.read_bytes()


def write_block(path: pathlib.Path, nodes, outputs=None, shape=(2, 3), elem=TensorProto.FLOAT) -> None:
    inputs = [helper.make_tensor_value_info(n, elem, list(shape)) for n in ("a", "w")]
    outputs = outputs or [helper.make_tensor_value_info("b", elem, list(shape))]
    model = helper.make_model(helper.make_graph(nodes, "blk", inputs, outputs), opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    onnx.save(model, str(path))


# -- data lost or damaged -----------------------------------------------------------------


def test_a_report_never_removes_the_data_of_the_file_it_replaces(tmp_path):
    """A report written over a model file whose data another model shares leaves that data
    (generator ``report_neighbour``): reports replace the file named and nothing else."""
    save_external(block_model(), tmp_path / "victim.onnx", "r.json.data")
    (tmp_path / "r.json").write_bytes((tmp_path / "victim.onnx").read_bytes())
    before = fingerprint(tmp_path / "r.json.data")
    save.write_text(tmp_path / "r.json", "{}")
    assert (tmp_path / "r.json").read_text() == "{}"
    assert fingerprint(tmp_path / "r.json.data") == before
    code, out, err = run_cli("verify", tmp_path / "victim.onnx")
    assert code == 0, err


@pytest.mark.parametrize("destination", ["out.onnx", "m.onnx"])
def test_inline_to_the_sources_own_data_name_keeps_the_source_loading(tmp_path, destination):
    """``inline`` over a destination that shares the source's data file (or is the source): the
    source's data is never retired, the existing file's mode (0600) is kept (``own_data_name``)."""
    save_external(block_model(), tmp_path / "m.onnx", f"{destination}.data")
    if destination != "m.onnx":
        (tmp_path / destination).write_bytes((tmp_path / "m.onnx").read_bytes())
    os.chmod(tmp_path / destination, 0o600)
    if destination == "m.onnx":  # the source itself: refused before any work (issue 53, storage/guard.py)
        with pytest.raises(InvalidInputError, match="is the input"):
            inline_file(tmp_path / "m.onnx", tmp_path / destination)
    else:
        inline_file(tmp_path / "m.onnx", tmp_path / destination)
    assert stat.S_IMODE(os.stat(tmp_path / destination).st_mode) == 0o600
    for name in {"m.onnx", destination}:
        code, _, err = run_cli("verify", tmp_path / name)
        assert code == 0, err


def test_a_file_written_over_another_keeps_its_mode(tmp_path):
    """The model, a report: what replaces a 0600 file stays 0600 (``report_destination``)."""
    onnx.save(block_model(), str(tmp_path / "m.onnx"))
    for name in ("out.onnx", "r.html"):
        (tmp_path / name).write_text("old")
        os.chmod(tmp_path / name, 0o600)
    inline_file(tmp_path / "m.onnx", tmp_path / "out.onnx")
    save.write_text(tmp_path / "r.html", "<p>new</p>")
    for name in ("out.onnx", "r.html"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600, name


def _staged_export(folder: pathlib.Path) -> None:
    """What ``save_pretrained`` writes: ``model.onnx`` + ``model.onnx.data``, ``export.json``, ``config.json``."""
    folder.mkdir()
    save_external(block_model(), folder / "model.onnx", "model.onnx.data")
    (folder / "export.json").write_text('{"components": {"model": {"file": "model.onnx"}}}')
    (folder / "config.json").write_text('{"model_type": "llama"}')


def test_a_folder_export_never_overwrites_another_models_data_or_follows_links(tmp_path):
    """The checkpoint output folder (``output_folder``): another model's ``model.onnx.data`` stays,
    links in the folder are replaced (their targets unchanged, a dangling one creates nothing
    outside), the moved model loads and runs, a copied file keeps the private mode it is given."""
    staged, out, elsewhere = tmp_path / "staged", tmp_path / "out", tmp_path / "elsewhere"
    _staged_export(staged)
    out.mkdir()
    elsewhere.mkdir()
    (elsewhere / "target").write_text("not yours")
    save_external(block_model(), out / "other.onnx", "model.onnx.data")
    other_data = fingerprint(out / "model.onnx.data")
    os.symlink("../elsewhere/target", out / "config.json")
    os.symlink("../elsewhere/new", out / "export.json")
    names = save.publish_folder(staged, out, modes={"config.json": 0o600})
    assert names == ["config.json", "export.json", "model.onnx"]
    assert (elsewhere / "target").read_text() == "not yours" and not (elsewhere / "new").exists()
    assert not (out / "config.json").is_symlink() and (out / "config.json").read_text() == '{"model_type": "llama"}'
    assert stat.S_IMODE(os.stat(out / "config.json").st_mode) == 0o600
    assert fingerprint(out / "model.onnx.data") == other_data
    written = save.referenced_data(out / "model.onnx")
    assert len(written) == 1 and written != {"model.onnx.data"}
    for name in ("model.onnx", "other.onnx"):
        code, _, err = run_cli("verify", out / name)
        assert code == 0, err
    # once the conventional name is free again, a second export takes it (transformers looks for it)
    (out / "model.onnx.data").unlink()
    (out / "other.onnx").unlink()
    save.publish_folder(staged, out)
    assert save.referenced_data(out / "model.onnx") == {"model.onnx.data"}
    assert sorted(p.name for p in out.iterdir() if p.name.endswith(".data")) == ["model.onnx.data"]


def test_a_folder_export_refuses_a_fifo_and_moves_nothing(tmp_path):
    staged, out = tmp_path / "staged", tmp_path / "out"
    _staged_export(staged)
    out.mkdir()
    os.mkfifo(out / "export.json")
    with pytest.raises(SaveError, match="not a regular file"):
        save.publish_folder(staged, out)
    assert sorted(p.name for p in out.iterdir()) == ["export.json"]


def test_checkpoint_links_out_of_the_folder_are_refused(tmp_path):
    """A ``config.json`` or tokenizer file that links outside the checkpoint is refused before it is
    read; the Hub cache's own layout (``snapshots/<rev>/x -> ../../blobs/<hash>``) is accepted."""
    pytest.importorskip("transformers")
    from onnx_modular.hf.command import _copy_runtime_files, check_checkpoint_links

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (tmp_path / "secret.json").write_text("{}")
    os.symlink("../secret.json", ckpt / "config.json")
    with pytest.raises(InvalidInputError, match="outside the checkpoint folder"):
        check_checkpoint_links(ckpt)
    cache = tmp_path / "models--x"
    (cache / "blobs").mkdir(parents=True)
    (cache / "snapshots" / "abc").mkdir(parents=True)
    (cache / "blobs" / "123").write_text("{}")
    os.symlink("../../blobs/123", cache / "snapshots" / "abc" / "config.json")
    check_checkpoint_links(cache / "snapshots" / "abc")
    # runtime files: a link or a FIFO is not copied (and does not block); a private file stays private
    (ckpt / "tokenizer.json").write_text("{}")
    os.chmod(ckpt / "tokenizer.json", 0o600)
    os.mkfifo(ckpt / "vocab.txt")
    os.symlink("../secret.json", ckpt / "merges.txt")
    staged = tmp_path / "staged"
    staged.mkdir()
    assert _copy_runtime_files(str(ckpt), staged) == {"tokenizer.json": 0o600}
    assert sorted(p.name for p in staged.iterdir()) == ["tokenizer.json"]


# -- read, written or served outside what was named ----------------------------------------


def test_reports_replace_links_and_refuse_fifos(tmp_path):
    """``profile``/``localize`` reports go through ``write_text`` (``report_destination``)."""
    (tmp_path / "target").write_text("not yours")
    os.symlink("target", tmp_path / "link.html")
    save.write_text(tmp_path / "link.html", "report")
    assert (tmp_path / "target").read_text() == "not yours"
    assert (tmp_path / "link.html").read_text() == "report" and not (tmp_path / "link.html").is_symlink()
    os.mkfifo(tmp_path / "pipe.html")
    with pytest.raises(SaveError, match="not a regular file"):
        save.write_text(tmp_path / "pipe.html", "report")
    onnx.save(block_model(), str(tmp_path / "m.onnx"))
    code, _, err = run_cli("profile", tmp_path / "m.onnx", "--json", tmp_path / "pipe.html", "--runs", "1")
    assert code == 2 and "not a regular file" in err and "Traceback" not in err


@contextlib.contextmanager
def viewer(path: pathlib.Path, model=None):
    pytest.importorskip("netron")
    from onnx_modular.files.view import serve

    model = model if model is not None else load_model_file(path)
    with serve(path, model, address=("127.0.0.1", 0), browse=False) as address:
        yield address


def request(address, path: str, host: str | None = None, method: str = "GET") -> tuple[int, dict, bytes]:
    connection = http.client.HTTPConnection(*address, timeout=30)
    headers = {"Host": host} if host else {}
    connection.request(method, path, headers=headers)
    response = connection.getresponse()
    body = response.read()
    connection.close()
    return response.status, dict(response.getheaders()), body


@pytest.fixture(scope="module")
def served_file(tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("view")
    name = '"><img src=x onerror=alert(1)>.onnx'
    save_external(block_model(), folder / name, "m.onnx.data")
    with open(folder / "m.onnx.data", "ab") as data:
        data.write(os.urandom(3 << 20))  # more than one CHUNK: streamed
    (folder / "key.pem").write_text("secret")
    return folder / name


def test_view_escapes_the_file_name_refuses_foreign_hosts_and_blocks_outside_connections(served_file):
    from onnx_modular.files.view import CONTENT_SECURITY_POLICY

    with viewer(served_file) as address:
        status, headers, page = request(address, "/")
        assert status == 200
        assert b"<img src=x" not in page and b"&lt;img src=x onerror=alert(1)&gt;" in page
        policy = headers["Content-Security-Policy"]
        assert policy == CONTENT_SECURITY_POLICY
        directives = dict(part.strip().split(" ", 1) for part in policy.split(";"))
        assert directives["connect-src"] == "'self'" and directives["default-src"] == "'self'"
        assert "analytics.google.com" not in policy and "ipinfo.io" not in policy
        # DNS rebinding: a page of evil.example resolved to 127.0.0.1 sends its own name as Host
        for host in ("evil.example", "evil.example:8080", "localhost.evil.example"):
            assert request(address, "/data/m.onnx.data", host=host)[0] == 403, host
        for host in (f"127.0.0.1:{address[1]}", f"localhost:{address[1]}", "[::1]"):
            assert request(address, "/", host=host)[0] == 200, host
        status, headers, data = request(address, "/data/m.onnx.data")
        assert status == 200 and data == (served_file.parent / "m.onnx.data").read_bytes()
        assert request(address, "/data/m.onnx.data", method="HEAD")[1]["Content-Length"] == str(len(data))
        for path in ("/data/key.pem", "/data/../key.pem", "/../../etc/hostname", "/data/%2e%2e/key.pem"):
            assert request(address, path)[0] == 404, path


def test_view_survives_a_browser_that_leaves_mid_response(served_file, capfd):
    """A client that closes the connection mid-stream ends that response quietly (no
    ``BrokenPipeError`` traceback); the server keeps answering; parallel requests all complete."""
    with viewer(served_file) as address:
        for _ in range(3):
            with socket.create_connection(address) as raw:
                raw.sendall(b"GET /data/m.onnx.data HTTP/1.0\r\nHost: localhost\r\n\r\n")
                raw.recv(1024)
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        results = []
        threads = [threading.Thread(target=lambda: results.append(request(address, "/data/m.onnx.data")[0])) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert results == [200] * 8
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err and "BrokenPipeError" not in captured.err


def test_view_refuses_what_tree_refuses_and_bad_ports(tmp_path):
    """``view`` of a call bomb fails at once (as ``tree``), a port outside 0-65535 is a typed
    error (``surface_bomb``, ``odd_numbers``)."""
    pytest.importorskip("netron")
    onnx.save(builders.bomb(24), str(tmp_path / "bomb.onnx"))
    code, _, err = run_cli("view", tmp_path / "bomb.onnx", "--port", "0", "--no-browser")
    assert code == 2 and "expand to" in err
    onnx.save(block_model(), str(tmp_path / "m.onnx"))
    for port in ("-1", "70000"):
        code, _, err = run_cli("view", tmp_path / "m.onnx", "--port", port, "--no-browser")
        assert code == 2 and err.startswith("error: ") and "not a TCP port" in err, err


# -- hangs and memory -----------------------------------------------------------------------


def test_extract_and_replace_refuse_call_bombs_at_once(tmp_path):
    """``surface_bomb``: the same expanded-size check as ``tree`` and ``verify``."""
    onnx.save(builders.bomb(24), str(tmp_path / "bomb.onnx"))
    write_block(tmp_path / "block.onnx", [helper.make_node("Relu", ["a"], ["b"])])
    for argv in (["extract", "bomb.onnx", "f0", "-o", "ex"], ["replace", "bomb.onnx", "f0", "block.onnx", "-o", "r.onnx"]):
        code, _, err = run_cli(*[tmp_path / a if a.endswith((".onnx", "ex")) else a for a in argv])
        assert code == 2 and "expand to" in err and "Traceback" not in err, err
    assert not (tmp_path / "ex").exists() and not (tmp_path / "r.onnx").exists()


def test_loops_nothing_can_stop_are_refused_up_front(tmp_path):
    """``loop_trips``: 2**62 or 10**5 constant trips with no condition are refused before running;
    a short loop is run; a long one whose run-time condition might stop it is refused too (issue 53)."""
    for trips in (2**62, 10**5):
        with pytest.raises(InvalidModelFileError, match="iterations"):
            check_expanded_size(loop_model(trips))
    check_expanded_size(loop_model(100))
    check_expanded_size(loop_model(100, condition=True))
    with pytest.raises(InvalidModelFileError, match="ONNX_MODULAR_MAX_LOOP_TRIPS"):  # a run-time condition may never stop it
        check_expanded_size(loop_model(2**62, condition=True))
    onnx.save(loop_model(2**62), str(tmp_path / "loop.onnx"))
    for command in ("verify", "profile"):
        code, _, err = run_cli(command, tmp_path / "loop.onnx")
        assert code == 2 and "ONNX_MODULAR_MAX_LOOP_TRIPS" in err, err


def test_external_data_reads_only_the_referenced_bytes(tmp_path):
    """``sparse_external``: a 32-byte weight at offset 0 of a sparse 20 GiB file is read as 24 bytes,
    by every tool (a whole read would take 20 GiB)."""
    save_external(block_model(), tmp_path / "m.onnx", "m.onnx.data")
    with open(tmp_path / "m.onnx.data", "r+b") as data:
        data.truncate(20 * 2**30)
    model = load_model_file(tmp_path / "m.onnx", load_external_data=True)
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(model.graph.initializer[0]), np.arange(6, dtype=np.float32).reshape(2, 3))
    write_block(tmp_path / "block.onnx", [helper.make_node("Sub", ["a", "w"], ["b"])])
    for argv in (["inline", "m.onnx", "out.onnx"], ["replace", "m.onnx", "Blk", "block.onnx", "-o", "r.onnx"]):
        code, _, err = run_cli(*[str(tmp_path / a) if a.endswith(".onnx") else a for a in argv])
        assert code == 0, err


def test_profile_threads_are_bounded(tmp_path):
    """``odd_numbers``: ``--threads 100000`` is a typed error, not a segmentation fault."""
    onnx.save(block_model(), str(tmp_path / "m.onnx"))
    code, _, err = run_cli("profile", tmp_path / "m.onnx", "--threads", "100000")
    assert code == 2 and "at most" in err


# -- tracebacks and spoofing ----------------------------------------------------------------


def test_names_past_name_max_extract_into_short_folders(tmp_path):
    """``long_names``: a 300-byte function name gives a folder name under 255 bytes."""
    function = "F" * 300
    onnx.save(block_model(function), str(tmp_path / "m.onnx"))
    code, out, err = run_cli("extract", tmp_path / "m.onnx", function, "-o", tmp_path / "ex")
    assert code == 0, err
    (folder,) = (tmp_path / "ex").iterdir()
    assert len(folder.name.encode()) < 255 and (folder / "model.onnx").is_file()


@pytest.mark.parametrize(
    "how, fragment",
    [("uncomputed", "no node computes its output 'b'"), ("dims", "declares dimension 0 as 7"), ("elem", "INT64")],
)
def test_replacement_blocks_that_lie_are_typed_errors(tmp_path, how, fragment):
    """``replace_lies``: an output no node computes, dims that contradict the function's."""
    model = block_model()
    model.functions[0].value_info.extend([helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("a", "w", "b")])
    onnx.save(model, str(tmp_path / "m.onnx"))
    if how == "uncomputed":
        write_block(tmp_path / "block.onnx", [helper.make_node("Relu", ["a"], ["t"])])
    elif how == "dims":
        write_block(tmp_path / "block.onnx", [helper.make_node("Sub", ["a", "w"], ["b"])], shape=(7, 9))
    else:
        write_block(tmp_path / "block.onnx", [helper.make_node("Sub", ["a", "w"], ["b"])], elem=TensorProto.INT64)
    code, _, err = run_cli("replace", tmp_path / "m.onnx", "Blk", tmp_path / "block.onnx", "-o", tmp_path / "r.onnx")
    assert code == 2 and fragment in err and "Traceback" not in err, err
    assert not (tmp_path / "r.onnx").exists()


def test_opsets_no_onnx_knows_are_refused(tmp_path):
    model = block_model()
    model.opset_import[0].version = 2**63 - 1
    onnx.save(model, str(tmp_path / "m.onnx"))
    for command in ("profile", "verify"):
        code, _, err = run_cli(command, tmp_path / "m.onnx")
        assert code == 2 and "opset 9223372036854775807" in err, err


@pytest.mark.parametrize("bad", ["\x1b[2J", "\x07", "\u202eevil", "a\u200bb"])
def test_extract_and_replace_print_names_escaped(tmp_path, bad):
    """``tool_escapes``: call paths, function and output names from the file reach the terminal escaped."""
    model = block_model("Blk" + bad, "/blk" + bad)
    onnx.save(model, str(tmp_path / "m.onnx"))
    write_block(tmp_path / "block.onnx", [helper.make_node("Sub", ["a", "w"], ["b"])])
    for argv in (
        ["extract", tmp_path / "m.onnx", "Blk" + bad, "-o", tmp_path / "ex"],
        ["replace", tmp_path / "m.onnx", "Blk" + bad, tmp_path / "block.onnx", "-o", tmp_path / "r.onnx"],
    ):
        code, out, err = run_cli(*argv)
        assert code == 0, err
        assert bad not in out + err and "Blk" in out


def test_custom_translation_table_keys_must_be_torch_ops():
    torch = pytest.importorskip("torch")
    from onnx_modular import export_modular

    with pytest.raises(InvalidInputError, match="not a torch op"):
        export_modular(torch.nn.Linear(2, 2).eval(), (torch.ones(1, 2),), None, custom_translation_table={1: 2})


def test_new_generators_find_no_failure(tmp_path):
    """A few cases of each new generator, through the fuzzer's child processes (limits, promises)."""
    kinds = ["report_neighbour", "own_data_name", "surface_bomb", "loop_trips", "long_names", "replace_lies",
             "tool_escapes", "odd_numbers", "sparse_external", "report_destination"]  # fmt: skip
    records = run_campaign(20, seed=38, timeout=120, memory_mb=2048, only=kinds, workdir=tmp_path)
    assert not runner.failure_classes(records), runner.summary(records)
    assert json.dumps(records)  # every record is loggable


def test_profile_events_are_slimmed_while_parsed(tmp_path):
    """``profile`` keeps per kernel event only what it reads (measured: 2,611 -> 658 bytes per event
    of a MatMul kernel with its shapes and thread statistics)."""
    from onnx_modular.profiling.run import read_events

    event = {"cat": "Node", "name": "/blk/Add_kernel_time", "ts": 5, "dur": 2, "ph": "X", "pid": 1, "tid": 1,
             "args": {"op_name": "Add", "provider": "CPUExecutionProvider", "input_type_shape": [{"float": [2, 3]}] * 2,
                      "thread_scheduling_stats": {"main_thread": {"thread_count": 1}}}}  # fmt: skip
    (tmp_path / "profile.json").write_text(json.dumps([event] * 3))
    events = read_events(tmp_path / "profile.json")
    assert events == [{"cat": "Node", "name": "/blk/Add_kernel_time", "ts": 5, "dur": 2,
                       "args": {"op_name": "Add", "provider": "CPUExecutionProvider"}}] * 3  # fmt: skip


def test_a_huge_head_dim_is_refused_before_the_model_is_built(tmp_path):
    """``checkpoint`` (``head_dim`` among the odd sizes): ``head_dim=5e8`` in a folder of kilobytes
    is refused by the size check (measured with ``--stream-weights``: 3.39 GB peak before, 447 MB
    after, the imports)."""
    pytest.importorskip("transformers")
    import safetensors.numpy

    from onnx_modular.hf.meta import check_checkpoint_folder

    config = dict(generators_export._TINY_LLAMA, head_dim=5 * 10**8)
    (tmp_path / "config.json").write_text(json.dumps(config))
    safetensors.numpy.save_file(generators_export._weights(config, random.Random(0)), str(tmp_path / "model.safetensors"))
    with pytest.raises(InvalidInputError, match="parameters"):
        check_checkpoint_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(generators_export._TINY_LLAMA, head_dim=8)))
    check_checkpoint_folder(tmp_path)


def test_extract_with_data_of_a_class_of_many_calls(tmp_path):
    """``many_calls``: one walk of the calls for all of them, the main graph's names computed once,
    probe names without copying the taken set (measured: 2,000 calls 78.7 s before, 17.4 s after,
    the CLI under load; 500 calls 14.9 s and 7.9 s)."""
    from onnx_modular.files.extract import extract

    onnx.save(builders.chain_of_calls(300), str(tmp_path / "m.onnx"))
    result = extract(tmp_path / "m.onnx", "Blk", tmp_path / "ex", with_data=True)
    (model,) = result.models
    assert len(model.call_names) == 300 and len(model.data_sets) == 300
    assert max(max(d.max_abs.values()) for d in model.data_sets) == 0.0


def test_a_recorded_value_past_protobufs_limit_is_a_typed_error(tmp_path, monkeypatch):
    """``extract --with-data``: a call input or output too large for one TensorProto (2 GiB) is a
    ``SaveError`` naming the value and the call, nothing written. (The limit is lowered here so
    that a 2x3 value crosses it: a 2 GiB array in a test would cost 2 GiB.)"""
    from onnx_modular.files import extract as extract_module

    onnx.save(block_model(), str(tmp_path / "m.onnx"))
    monkeypatch.setattr(extract_module, "MAX_RECORDED_BYTES", 16)
    with pytest.raises(SaveError, match=r"protobuf's 2 GiB limit"):
        extract_module.extract(tmp_path / "m.onnx", "Blk", tmp_path / "ex", with_data=True)
    assert not (tmp_path / "ex").exists()
