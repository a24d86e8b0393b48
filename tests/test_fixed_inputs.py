"""``export_modular(fixed_inputs=...)``: layout inputs (an image grid) fixed into the program.

A vision tower splits its patches by the grid's values (``cu_seqlens``, Qwen-VL) and builds index
tables from ``torch.arange`` of them (Qwen2.5-VL's window index): torch.export stops there at a
data-dependent guard when the grid is an input. Fixed, the grid is a constant of the program and
what the forward computes from it is computed while capturing.
"""

from __future__ import annotations

import json

import onnx
import pytest
import torch

from onnx_modular import export_modular
from onnx_modular.errors import CaptureError, InvalidInputError
from onnx_modular.format import metadata


class Tower(torch.nn.Module):
    """Splits its patches per image by ``grid`` (t, h, w), as Qwen-VL's ``cu_seqlens``."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x, grid):
        cu = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]).cumsum(0, dtype=torch.int32)
        cu = torch.nn.functional.pad(cu, (1, 0), value=0)
        lengths = (cu[1:] - cu[:-1]).tolist()
        return torch.cat([self.proj(part).mean(0, keepdim=True) for part in torch.split(x, lengths, dim=0)])


class Windows(torch.nn.Module):
    """Reorders patches by a window index built from ``torch.arange`` of the grid's sizes and a
    boolean mask, as Qwen2.5-VL's ``get_vision_window_index``."""

    def forward(self, x, grid):
        tables = []
        for t, h, w in grid.tolist():
            index = torch.arange(t * h * w).reshape(t, h, w)
            padded = torch.nn.functional.pad(index, (0, w % 2, 0, h % 2), value=-100)
            kept = padded.reshape(-1)[padded.reshape(-1) != -100]
            tables.append(kept + sum(len(table) for table in tables))
        order = torch.cat(tables)
        return x[order] * 2


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.windows = Windows()
        self.tower = Tower()
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x, grid):
        return self.head(self.tower(self.windows(x, grid), grid))


GRID = torch.tensor([[1, 4, 4], [1, 2, 6]])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Model().eval()


class SameFactories(torch.nn.Module):
    """The factory calls ``Windows`` makes for ``GRID``, without a fixed input: they fill torch's
    fake-tensor dispatch cache, shared by the process, with entries that hold no value."""

    def forward(self, x):
        return x + torch.arange(16).reshape(1, 4, 4).sum() + torch.arange(12).reshape(1, 2, 6).sum()


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory):
    torch.export.export(SameFactories(), (torch.randn(2),), strict=False)  # an earlier export in the process
    path = tmp_path_factory.mktemp("fixed") / "m.onnx"
    x = torch.randn(28, 4)
    return export_modular(model, (), path, kwargs={"x": x, "grid": GRID.clone()}, fixed_inputs=["grid"]), x


def test_without_fixing_the_grid_capture_stops_at_a_data_dependent_guard(model):
    with pytest.raises(CaptureError, match="data-dependent") as error:
        export_modular(model, (), kwargs={"x": torch.randn(28, 4), "grid": GRID.clone()}, verify=False)
    assert "fixed_inputs=[name]" in error.value.hint  # the error says what to do


def test_fixed_grid_exports_with_parity_and_is_not_an_input(model, exported):
    result, x = exported
    assert result.report.ok
    assert [value.name for value in result.model.graph.inputs] == ["x"]
    # each module call is a function, nested as called; the tower's two calls of proj differ in rows
    assert {f.name for f in result.functions} >= {"Windows", "Tower", "Linear"}
    tower = result.hierarchy.find("tower")
    assert [child.module_path for child in tower.children] == ["tower.proj", "tower.proj"]
    assert (result(x=x)[0] - model(x, GRID)).abs().max().item() < 1e-5
    saved = onnx.load(result.path)
    fixed = json.loads({p.key: p.value for p in saved.metadata_props}[metadata.FIXED_INPUTS])
    assert fixed == {"grid": {"dtype": "int64", "shape": [2, 3], "values": GRID.tolist()}}
    assert "forward" not in vars(model)  # the model's own forward is given back


def test_fixed_grid_checks_new_data_and_refuses_another_grid(model, exported):
    result, _ = exported
    assert result.verify(kwargs={"x": torch.randn(28, 4)}, model=model).ok
    assert result.verify(kwargs={"x": torch.randn(28, 4), "grid": GRID.clone()}, model=model).ok
    with pytest.raises(InvalidInputError, match="fixed into the file"):
        result.verify(kwargs={"x": torch.randn(28, 4), "grid": torch.tensor([[1, 4, 4], [1, 4, 3]])}, model=model)
    assert result.localize(model).first_failure is None


def test_calling_the_result_takes_the_exported_grid_and_refuses_another(exported):
    import dataclasses

    from onnx_modular import result as result_module

    result, x = exported
    (alone,) = result(x=x)
    (with_grid,) = result(x=x, grid=GRID.clone())  # the value it was exported for: taken, not fed
    assert torch.equal(alone, with_grid)
    (as_array,) = result(x=x, grid=GRID.numpy())
    assert torch.equal(alone, as_array)
    other = torch.tensor([[1, 4, 4], [1, 4, 3]])  # same shape, another grid: the file cannot compute it
    with pytest.raises(InvalidInputError, match="fixed into the file"):
        result(x=x, grid=other)
    # a result without the export's tensors reads the values from the file's metadata
    assert torch.equal(result_module._fixed_from_metadata(result.model)["grid"], GRID)
    bare = dataclasses.replace(result, _fixed={}, _sessions={})
    with pytest.raises(InvalidInputError, match="fixed into the file"):
        bare(x=x, grid=other)
    assert torch.equal(bare(x=x, grid=GRID.clone())[0], alone)


@pytest.mark.parametrize(
    ("fixed", "shapes", "message"),
    [
        (["gird"], None, "not among the keyword inputs"),
        (["grid"], {"x": {0: torch.export.Dim("n")}, "grid": {0: torch.export.Dim("images")}}, "dynamic_shapes"),
    ],
)
def test_bad_fixed_inputs_are_refused_before_exporting(model, fixed, shapes, message):
    with pytest.raises(InvalidInputError, match=message):
        export_modular(
            model, (), kwargs={"x": torch.randn(28, 4), "grid": GRID.clone()}, fixed_inputs=fixed,
            dynamic_shapes=shapes, verify=False,
        )


def test_cli_fixed_input(tmp_path):
    import contextlib
    import io

    from onnx_modular.cli import main

    factory = tmp_path / "towers.py"
    factory.write_text(
        "import torch, test_fixed_inputs as t\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    return {'model': t.Model().eval(), 'kwargs': {'x': torch.randn(28, 4), 'grid': t.GRID.clone()}}\n"
    )
    output = tmp_path / "m.onnx"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["export", f"{factory}:build", "-o", str(output), "--fixed-input", "grid"])
    assert code == 0, err.getvalue()
    saved = onnx.load(output)
    assert [value.name for value in saved.graph.input] == ["x"]
    assert json.loads({p.key: p.value for p in saved.metadata_props}[metadata.FIXED_INPUTS])["grid"]["shape"] == [2, 3]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["export", f"{factory}:build", "-o", str(tmp_path / "n.onnx"), "--fixed-input", "gird"])
    assert code != 0 and "not among the keyword inputs" in err.getvalue()
    assert not (tmp_path / "n.onnx").exists()
