"""Odd models and factories get typed errors that say what happened (issue 12)."""

from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch
import torch.nn as nn

from onnx_modular import InvalidInputError, ModularizeError, export_modular
from onnx_modular.cli import main


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(arg) for arg in argv])
    return code, out.getvalue(), err.getvalue()


class CallKeyCollision(nn.Module):
    """torch.export keys the second call of ``x`` as ``x@1``: the key of the module ``x@1``."""

    def __init__(self):
        super().__init__()
        self.d = nn.ModuleDict({"x": nn.Linear(4, 4), "x@1": nn.Linear(4, 4)})

    def forward(self, a):
        a = self.d["x"](a)
        a = self.d["x@1"](a)
        return self.d["x"](a)


def test_a_module_named_like_a_repeated_call_is_refused(tmp_path):
    with pytest.raises(ModularizeError, match=r"'d\.x@1' and 'd\.x' share torch\.export's call key") as info:
        export_modular(CallKeyCollision().eval(), (torch.randn(2, 4),), tmp_path / "m.onnx")
    assert info.value.module_path == "d.x@1"
    assert "Rename the submodule 'd.x@1'" in str(info.value)
    assert os.listdir(tmp_path) == []


class NoCollision(nn.Module):
    """The same names, called so that no key is shared: exported, three calls."""

    def __init__(self):
        super().__init__()
        self.d = nn.ModuleDict({"x": nn.Linear(4, 4), "x@1": nn.Linear(4, 4)})

    def forward(self, a):
        return self.d["x@1"](self.d["x"](a))


def test_names_with_at_sign_export_when_keys_do_not_collide():
    result = export_modular(NoCollision().eval(), (torch.randn(2, 4),), None)
    assert result.report.ok
    assert sorted(call.module_path for call in result.hierarchy.calls_with_functions()) == ["d.x", "d.x@1"]


class ReturnsNone(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        self.proj(x)


class ReturnsText(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return {"logits": self.proj(x), "label": "cat"}


class ReturnsSize(nn.Module):
    def forward(self, x):
        return x * 2, x.shape[0]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (ReturnsNone(), r"forward\(\) returned None, with no tensor in it"),
        (ReturnsText(), r"forward\(\) returned a value of type str at output\.label \('cat'\)"),
        (ReturnsSize(), r"forward\(\) returned a value of type int at output\.1 \(2\)"),
    ],
)
def test_non_tensor_outputs_are_named(tmp_path, model, message):
    with pytest.raises(InvalidInputError, match=message):
        export_modular(model.eval(), (torch.randn(2, 4),), tmp_path / "m.onnx")
    assert os.listdir(tmp_path) == []


def test_a_factory_that_exits_is_an_error(tmp_path):
    code, out, err = run_cli("export", "builtins:exit", "-o", tmp_path / "m.onnx")
    assert code == 2
    assert "error: [input] The factory 'builtins:exit' exited (SystemExit(None)) instead of returning a model." in err
    assert os.listdir(tmp_path) == []


def test_a_factory_module_that_exits_on_import_is_an_error(tmp_path):
    script = tmp_path / "make.py"
    script.write_text("import sys\nsys.exit(3)\n")
    code, _, err = run_cli("export", f"{script}:make", "-o", tmp_path / "m.onnx")
    assert code == 2
    assert "failed: SystemExit: 3" in err
    assert sorted(os.listdir(tmp_path)) == ["make.py"]
