"""One contract for every file command: ``--json PATH|-`` with the same meaning
everywhere, one JSON encoder, the same exit codes, names from the file escaped in every text."""

from __future__ import annotations

import contextlib
import io
import json
import math
import pathlib

import onnx
import pytest
import torch
from torch import nn

from onnx_modular import export_modular
from onnx_modular.cli import main
from onnx_modular.format import metadata, records

#: What a hostile file names its calls: a screen clear, a colour, a bell, markup, a reversed line.
HOSTILE = "\x1b[2J\x1b[31m<b>&\x07\u202e"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return x + self.norm(torch.relu(self.fc(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _hostile_names(model: onnx.ModelProto) -> None:
    """Every call's node name and module path start with :data:`HOSTILE` (main graph and bodies)."""
    graphs = [model.graph.node, *(function.node for function in model.functions)]
    for nodes in graphs:
        for node in nodes:
            if node.domain.startswith("pkg.") and node.domain != "pkg.onnx_modular":
                node.name = HOSTILE + node.name
                for prop in node.metadata_props:
                    if prop.key == metadata.MODULE_PATH:
                        prop.value = HOSTILE + prop.value
    for function in model.functions:
        for prop in function.metadata_props:
            if prop.key == metadata.MODULE_PATHS:
                prop.value = json.dumps([HOSTILE + path for path in json.loads(prop.value)])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, pathlib.Path]:
    folder = tmp_path_factory.mktemp("contract")
    torch.manual_seed(0)
    plain = folder / "net.onnx"
    export_modular(Net().eval(), (torch.randn(2, 5, 16),), plain)
    model = onnx.load(str(plain))
    _hostile_names(model)
    hostile = folder / "hostile.onnx"
    onnx.save(model, str(hostile))
    flat = folder / "flat.onnx"
    torch.onnx.export(Net().eval(), (torch.randn(2, 5, 16),), str(flat), dynamo=True, verbose=False)
    return {"plain": plain, "hostile": hostile, "flat": flat, "folder": folder}


def _run(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def _commands(files, out: pathlib.Path, model: pathlib.Path) -> dict[str, list]:
    """Every file command but ``view`` and ``export`` (tested on its own), on ``model``."""
    return {
        "tree": ["tree", model],
        "inline": ["inline", model, out / "inlined.onnx"],
        "verify": ["verify", model],
        "profile": ["profile", model, "--runs", "2", "--warmup", "1"],
        "extract": ["extract", model, "Block", "-o", out / "extracted"],
        "split": ["split", model, "--stages", "2", "-o", out / "stages"],
        "diff": ["diff", model, model],
        "convert": ["convert", model, "-o", out / "f16.onnx", "--dtype", "float16"],
        "modularize": ["modularize", files["flat"], "-o", out / "modular.onnx"],
    }


@pytest.mark.parametrize("command", ["tree", "inline", "verify", "profile", "extract", "split", "diff", "convert", "modularize"])
def test_json_dash_prints_only_json_and_a_path_gets_the_same_beside_the_text(files, tmp_path, command):
    dash, written = tmp_path / "dash", tmp_path / "written"
    dash.mkdir(), written.mkdir()
    code, out, _ = _run(*_commands(files, dash, files["plain"])[command], "--json", "-")
    assert code == 0
    data = json.loads(out)  # stdout is the JSON alone
    assert data
    report = written / "report.json"
    code, out, err = _run(*_commands(files, written, files["plain"])[command], "--json", report)
    assert code == 0 and out.strip() and not out.lstrip().startswith(("{", "["))  # the text, as without --json
    assert f"Wrote {report}" in err
    assert json.loads(report.read_text()).keys() == data.keys() if isinstance(data, dict) else json.loads(report.read_text())


@pytest.mark.parametrize("command", ["tree", "inline", "verify", "profile", "extract", "split", "diff", "convert"])
def test_names_from_the_file_are_escaped_in_every_text(files, tmp_path, command):
    code, out, err = _run(*_commands(files, tmp_path, files["hostile"])[command])
    assert code == 0, err
    for text in (out, err):
        assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    if command not in ("inline", "verify", "profile", "convert"):  # these name no call in their text
        assert "\\x1b[2J" in out, out


def test_a_json_destination_that_is_the_input_fails_before_any_work(files, tmp_path):
    data = pathlib.Path(str(files["plain"]) + ".data")
    target = files["plain"] if not data.exists() else data
    before = target.read_bytes()
    code, _, err = _run("tree", files["plain"], "--json", target)
    assert code == 2 and "error:" in err
    assert target.read_bytes() == before


def test_one_encoder_writes_infinities_as_strings_everywhere():
    import dataclasses

    @dataclasses.dataclass
    class Report:
        drift: float
        rows: dict
        path: pathlib.Path
        hidden: object = dataclasses.field(default=None, metadata=records.NOT_RECORDED)

    text = records.to_json(Report(math.inf, {1: -math.inf, "n": math.nan}, pathlib.Path("a/b"), hidden=object()))
    assert json.loads(text) == {"drift": "inf", "rows": {"1": "-inf", "n": "nan"}, "path": "a/b"}


def test_the_exit_codes_are_the_same_for_every_command(files, tmp_path):
    missing = tmp_path / "missing.onnx"
    for argv in (["tree", missing], ["verify", missing], ["profile", missing], ["diff", missing, missing],
                 ["convert", missing, "-o", tmp_path / "x.onnx", "--dtype", "float16"], ["split", missing, "--stages", "2", "-o", tmp_path / "s"],
                 ["extract", missing, "Block", "-o", tmp_path / "e"], ["modularize", missing, "-o", tmp_path / "m.onnx"],
                 ["inline", missing, tmp_path / "i.onnx"]):  # fmt: skip
        code, _, err = _run(*argv)
        assert code == 2 and "What to do" in err, (argv[0], err)
