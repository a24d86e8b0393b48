"""Saves under real crashes, races and signals: the destination always loads and runs.

Each scenario runs in a child process that is really killed (SIGKILL at a chosen
step of the save, or SIGTERM); afterwards the file at the destination is run in
onnxruntime and compared with the PyTorch model it must hold.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn

from onnx_modular import InvalidInputError, SaveError, export_modular
from onnx_modular.storage import locks, save

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH = 256  # 256 KiB of weights per model: external data is a real second file

# The children save a prepared model through ``files.save.staged_save``, the writer every export uses.
# They load ``onnx_modular`` as a bare namespace (its ``__init__`` would import torch: seconds
# per child, for nothing the save needs).
CHILD = textwrap.dedent(
    """
    import os, signal, sys, time, types
    package = types.ModuleType("onnx_modular")
    package.__path__ = [{package!r}]
    sys.modules["onnx_modular"] = package
    import onnx_ir as ir
    from onnx_modular.storage import save as files_save

    def save(seed, path):
        with files_save.staged_save(ir.load(os.path.join({sources!r}, str(seed), "m.onnx")), path, external_data=True):
            pass

    def kill_at(function_name, when):
        original = getattr(os, function_name)
        def patched(*args, **kwargs):
            if when(*args):
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)
        setattr(os, function_name, patched)
    """
)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Modular exports of the models of seeds 1 and 2 (with external data), for the children."""
    folder = tmp_path_factory.mktemp("sources")
    for seed in (1, 2):
        (folder / str(seed)).mkdir()
        export_here(seed, folder / str(seed) / "m.onnx")
    return folder


def child_code(sources, body: str) -> str:
    return CHILD.format(package=os.path.join(ROOT, "onnx_modular"), sources=str(sources)) + textwrap.dedent(body)


def run_child(sources, body: str, *, check_code: int | None = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", child_code(sources, body)], env=env, capture_output=True, text=True, timeout=300)
    if check_code is not None:
        assert proc.returncode == check_code, proc.stderr[-3000:]
    return proc


def expected(seed: int) -> np.ndarray:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()).eval()
    with torch.no_grad():
        return model(torch.ones(2, WIDTH)).numpy()


def run_destination(path) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (name,) = [i.name for i in session.get_inputs()]
    return session.run(None, {name: np.ones((2, WIDTH), np.float32)})[0]


def assert_holds(path, seed: int) -> None:
    np.testing.assert_allclose(run_destination(path), expected(seed), rtol=1e-5, atol=1e-6)


def export_here(seed: int, path) -> None:
    """Export the model of ``seed`` (what the children save), in this process."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()).eval()
    export_modular(model, (torch.ones(2, WIDTH),), path, external_data=True)


def listing(folder) -> list[str]:
    return sorted(os.listdir(folder))


def assert_one_pair(folder, name="m.onnx") -> None:
    files = listing(folder)
    assert len(files) == 2 and files[0] == name and re.fullmatch(re.escape(name) + r"(\.[0-9a-f]{8})?\.data", files[1]), files


def test_kill_between_data_and_model_keeps_the_previous_pair(tmp_path, sources):
    dest = tmp_path / "m.onnx"
    export_here(1, dest)
    run_child(
        sources,
        f"""
        kill_at("replace", lambda src, dst: os.fspath(dst) == {str(dest)!r})  # after the data file moved
        save(2, {str(dest)!r})
        """,
        check_code=-signal.SIGKILL,
    )
    assert_holds(dest, 1)  # the old model with its own data, not the new data
    assert any(name.startswith(save.TEMP_PREFIX) for name in listing(tmp_path)), listing(tmp_path)
    # The next save removes what the killed one left (its temp folder and its data file).
    export_here(3, dest)
    assert_holds(dest, 3)
    assert_one_pair(tmp_path)


def test_kill_after_the_model_moved_gives_the_new_pair(tmp_path, sources):
    dest = tmp_path / "m.onnx"
    export_here(1, dest)
    run_child(
        sources,
        f"""
        kill_at("unlink", lambda path, *a: os.fspath(path).endswith(".data"))  # before the old data goes
        save(2, {str(dest)!r})
        """,
        check_code=-signal.SIGKILL,
    )
    assert_holds(dest, 2)
    export_here(3, dest)
    assert_holds(dest, 3)
    assert_one_pair(tmp_path)


def test_kill_while_writing_leaves_a_temp_folder_the_next_save_removes(tmp_path, sources):
    dest = tmp_path / "m.onnx"
    export_here(1, dest)
    run_child(
        sources,
        f"""
        import onnx.checker
        onnx.checker.check_model = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        save(2, {str(dest)!r})
        """,
        check_code=-signal.SIGKILL,
    )
    stale = [name for name in listing(tmp_path) if name.startswith(save.TEMP_PREFIX)]
    assert len(stale) == 1 and os.listdir(tmp_path / stale[0]), listing(tmp_path)  # partial files inside
    assert_holds(dest, 1)
    export_here(3, dest)
    assert_holds(dest, 3)
    assert_one_pair(tmp_path)


def test_a_live_owners_temp_folder_is_kept(tmp_path):
    live = tmp_path / f"{save.TEMP_PREFIX}{os.getpid()}-abc"
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"{save.TEMP_PREFIX}{int(dead_pid.stdout)}-abc"
    other = tmp_path / ".m.onnx.abc.tmp"  # not our naming: never touched
    for folder in (live, dead, other):
        folder.mkdir()
        (folder / "partial").write_bytes(b"x")
    assert locks.remove_stale_temp_folders(tmp_path) == [dead.name]
    assert listing(tmp_path) == sorted([live.name, other.name])


def test_sigterm_during_a_save_cleans_up_like_sigint(tmp_path, sources):
    dest = tmp_path / "m.onnx"
    export_here(1, dest)
    proc = run_child(
        sources,
        f"""
        import onnx.checker
        def terminate(*a, **k):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler interrupts this
        onnx.checker.check_model = terminate
        try:
            save(2, {str(dest)!r})
        except KeyboardInterrupt as e:
            print("interrupted", type(e).__name__)
        """
    )
    assert "interrupted Terminated" in proc.stdout
    assert_holds(dest, 1)
    assert_one_pair(tmp_path)


# SIGTERM at each step around the commit (issue 25: one run in 12 left an unreferenced data file
# beside the old pair). The signal is sent from inside the step, so it lands exactly there.
TERM_AT = {
    # before the commit: the staged files are being made durable -> the old pair stays
    "fsync of the staged files": ("fsync", "lambda fd: True", 1),
    # inside the commit (signals deferred): the journal, the data file's move, the model's rename
    "journal written": ("open", "lambda path, *a: os.path.basename(path).startswith(files_save.JOURNAL_PREFIX)", 2),
    "model renamed": ("replace", "lambda src, dst: os.fspath(dst) == DEST", 2),
}


@pytest.mark.parametrize("step", list(TERM_AT))
def test_sigterm_around_the_commit_leaves_one_whole_pair(tmp_path, sources, step):
    dest = tmp_path / "m.onnx"
    export_here(1, dest)
    function_name, when, seed = TERM_AT[step]
    proc = run_child(
        sources,
        f"""
        DEST = {str(dest)!r}
        original = os.{function_name}
        sent = []
        def patched(*args, **kwargs):
            if not sent and ({when})(*args):
                sent.append(1)
                os.kill(os.getpid(), signal.SIGTERM)
            return original(*args, **kwargs)
        os.{function_name} = patched
        try:
            save(2, DEST)
            print("saved")
        except KeyboardInterrupt as e:
            print("interrupted", type(e).__name__)
        print("sent", len(sent))
        """,
    )
    assert "sent 1" in proc.stdout, proc.stdout  # the signal was sent at that step
    assert "interrupted Terminated" in proc.stdout, proc.stdout  # and never lost
    assert_holds(dest, seed)  # before the commit: the old pair; inside it: the commit finishes first
    assert_one_pair(tmp_path)  # no stray data file, journal, lock or temp folder


def test_sigterm_in_the_cli_exits_143_and_cleans_up(tmp_path):
    dest = tmp_path / "m.onnx"
    factory = tmp_path / "factory_mod.py"
    factory.write_text(
        "import torch, torch.nn as nn\n"
        f"def make():\n    torch.manual_seed(1)\n    return nn.Sequential(nn.Linear({WIDTH}, {WIDTH}), nn.Tanh()).eval(), "
        f"(torch.ones(2, {WIDTH}),)\n"
    )
    code = f"""if True:
        import os, signal, sys, time
        sys.path.insert(0, {str(tmp_path)!r})
        import onnx.checker
        def terminate(*a, **k):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        onnx.checker.check_model = terminate
        from onnx_modular.cli import main
        sys.exit(main(["export", "factory_mod:make", "-o", {str(dest)!r}]))
        """
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    assert "interrupted" in proc.stderr
    assert listing(tmp_path) == ["factory_mod.py"] or listing(tmp_path) == ["__pycache__", "factory_mod.py"]


def test_racing_saves_serialize(tmp_path, sources):
    dest = tmp_path / "m.onnx"
    go = tmp_path / "go"
    body = """
        model = ir.load(os.path.join({sources!r}, str({seed}), "m.onnx"))
        open({go!r} + ".ready{seed}", "w").close()
        while not os.path.exists({go!r}):  # both start saving at once
            time.sleep(0.001)
        for _ in range(25):
            with files_save.staged_save(model, {dest!r}, external_data=True):
                pass
        """
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", child_code(sources, body.format(seed=seed, go=str(go), dest=str(dest), sources=str(sources)))],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    while not all(os.path.exists(f"{go}.ready{seed}") for seed in (1, 2)) and all(p.poll() is None for p in procs):
        time.sleep(0.01)
    go.touch()
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    for leftover in (go, f"{go}.ready1", f"{go}.ready2"):
        os.unlink(leftover)
    result = run_destination(dest)
    assert any(np.allclose(result, expected(seed), rtol=1e-5, atol=1e-6) for seed in (1, 2))
    assert_one_pair(tmp_path)


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x)


@pytest.mark.parametrize("external_data", [False, True])
def test_longest_valid_file_name_is_written(tmp_path, external_data):
    name = "m" * (os.pathconf(tmp_path, "PC_NAME_MAX") - 5) + ".onnx"
    dest = tmp_path / name
    model, x = Small().eval(), torch.randn(2, 8)
    result = export_modular(model, (x,), dest, external_data=external_data)
    assert result.report.ok
    files = listing(tmp_path)
    assert name in files and len(files) == (2 if external_data else 1), files
    session = ort.InferenceSession(str(dest), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(got, model(x).numpy(), rtol=1e-5, atol=1e-6)


class Unexportable(nn.Module):
    def forward(self, x):
        raise AssertionError("the export started before the destination was checked")


def test_too_long_file_name_is_refused_before_the_export(tmp_path):
    name = "m" * os.pathconf(tmp_path, "PC_NAME_MAX") + ".onnx"
    with pytest.raises(SaveError, match="file name is .* bytes long"):
        export_modular(Unexportable(), (torch.randn(2, 8),), tmp_path / name)
    assert listing(tmp_path) == []


def test_a_file_object_is_a_typed_error():
    with pytest.raises(InvalidInputError, match="must be a file path .* not BytesIO"):
        export_modular(Unexportable(), (torch.randn(2, 8),), io.BytesIO())


@pytest.mark.parametrize("external_data", [False, True])
def test_undecodable_file_name_is_written(tmp_path, external_data):
    dest = os.path.join(tmp_path, os.fsdecode(b"m\xff\n.onnx"))  # how Python spells undecodable names
    model, x = Small().eval(), torch.randn(2, 8)
    assert export_modular(model, (x,), dest, external_data=external_data).report.ok
    files = set(os.listdir(os.fsencode(tmp_path)))
    assert b"m\xff\n.onnx" in files and len(files) == (2 if external_data else 1), files
    if external_data:  # the data file's name is a valid UTF-8 location
        assert any(name == b"m_\n.onnx.data" for name in files), files
    loaded = onnx.load(dest)  # external data resolved next to the file
    session = ort.InferenceSession(loaded.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(got, model(x).numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["", "out/", "sub/..", "."])
def test_a_path_without_a_file_name_is_refused_before_the_export(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SaveError, match="has no file name"):
        export_modular(Unexportable(), (torch.randn(2, 8),), name)
    assert listing(tmp_path) == []


def test_inline_uses_the_same_writer(tmp_path, sources):
    """``onnx-modular inline`` with external data: per-write data names, long names, bad paths."""
    from onnx_modular.cli import main

    source = sources / "1" / "m.onnx"
    dest = tmp_path / "flat.onnx"
    for _ in range(2):  # the second write replaces the pair and removes the first data file
        assert main(["inline", str(source), str(dest)]) == 0
    assert_one_pair(tmp_path, "flat.onnx")
    assert_holds(dest, 1)
    long_name = "f" * (os.pathconf(tmp_path, "PC_NAME_MAX") - 5) + ".onnx"
    assert main(["inline", str(source), str(tmp_path / long_name)]) == 0
    assert_holds(tmp_path / long_name, 1)
    assert main(["inline", str(source), str(tmp_path / "out") + "/"]) == 2  # no file name: refused
    assert len(listing(tmp_path)) == 4


def test_data_file_name_is_conventional_unless_the_current_model_uses_it(tmp_path):
    """<name>.data on a first write (as torch.onnx.export names it); a write over a model that uses
    it goes to <name>.<hex>.data, and the one after returns to <name>.data; one pair each time."""
    dest = tmp_path / "m.onnx"
    names = []
    for seed in (1, 2, 3):
        export_here(seed, dest)
        assert_holds(dest, seed)
        assert_one_pair(tmp_path)
        names.append(listing(tmp_path)[1])
    assert names[0] == names[2] == "m.onnx.data"
    assert re.fullmatch(r"m\.onnx\.[0-9a-f]{8}\.data", names[1]), names


# -- a folder published over another (a genai folder written again) ------------------------------------

def _publish_killed_at(staged, out, kill_at: int) -> int:
    """``publish_folder(staged, out)`` in a forked child that kills itself (SIGKILL) at its
    ``kill_at``-th file-system call (replace, rename, link, unlink, rmdir); the child's exit status."""
    from onnx_modular.storage import folders

    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        try:
            calls = [0]

            def counted(original):
                def patched(*args, **kwargs):
                    calls[0] += 1
                    if calls[0] == kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return original(*args, **kwargs)
                return patched

            for name in ("replace", "rename", "link", "unlink", "rmdir"):
                setattr(os, name, counted(getattr(os, name)))
            folders.publish_folder(staged, out)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _genai_like_folder(folder, version: int) -> None:
    """A model with its weights in a data file, and the JSON files a genai folder holds, all of ``version``."""
    from onnx import TensorProto, helper, numpy_helper

    folder.mkdir()
    weight = numpy_helper.from_array(np.full((WIDTH,), float(version), np.float32), "w")
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [WIDTH])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(model, str(folder / "model.onnx"), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    for name in ("genai_config.json", "tokenizer.json", "export.json"):
        (folder / name).write_text(f'{{"version": {version}}}')


def _versions(folder) -> set[int]:
    import json

    found = {json.loads((folder / name).read_text())["version"] for name in ("genai_config.json", "tokenizer.json", "export.json")}
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    found.add(int(session.run(None, {"x": np.zeros(WIDTH, np.float32)})[0][0]))
    return found


def test_a_kill_while_a_folder_is_published_over_another_leaves_one_whole_folder(tmp_path):
    """A genai folder written again over an existing one, the writer killed (SIGKILL) at each file-system
    call in turn: the folder is the old one whole or the new one whole, never a mix of the two (its
    model and JSON files of one version). The new folder takes the old one's place in one rename
    (``RENAME_EXCHANGE``); the file-by-file commit (``folders._renameat2 = lambda: None``) gave mixes here."""
    staged = tmp_path / "staged"
    _genai_like_folder(staged, 2)
    outcomes = []
    for kill_at in range(1, 60):
        out = tmp_path / f"out{kill_at}"
        _genai_like_folder(out, 1)
        code = _publish_killed_at(staged, out, kill_at)
        versions = _versions(out)
        assert len(versions) == 1, (kill_at, versions)  # never a mix
        outcomes.append(versions)
        if code == 0:
            assert versions == {2}
            break
        assert code == -signal.SIGKILL, code
    else:
        pytest.fail("the publish never finished within 59 moves")
    assert {1} in outcomes and {2} in outcomes and len(outcomes) > 5, outcomes  # killed before the swap, and after it
