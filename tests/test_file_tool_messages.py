"""What the file tools tell their user, each on a small file: ``split --stages``
on a 4-layer Llama (no stage of a table alone; a note when the cuts go inside the decoder
layers), a missing path and a mistyped call (hints from the file itself), ``convert``'s report
(no INFO lines of other libraries, the outputs named once), ``diff``'s relative column near 0."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import models  # noqa: E402

import onnx_modular  # noqa: E402
from onnx_modular.cli import main  # noqa: E402
from onnx_modular.errors import InvalidInputError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    """A 4-layer LlamaModel (embeddings, rotary table, 4 decoder layers, final norm), modular."""
    model, args, _ = models.llama(n_layer=4)
    path = tmp_path_factory.mktemp("llama4") / "llama.onnx"
    onnx_modular.export_modular(model, args, path)
    return path


def _no_stage_of_a_table(result) -> bool:
    """Every stage stores more than 5 % of the bytes of the largest stage (a layer's matrices)."""
    largest = max(stage.weight_bytes for stage in result.stages)
    return all(stage.weight_bytes > 0.05 * largest for stage in result.stages)


def test_split_keeps_tables_with_the_next_layer(llama4, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # between the layers: no note
        result = onnx_modular.split(llama4, tmp_path / "five", stages=5, with_data=False)
    assert result.opened == [] and result.notes == []
    calls = [stage.calls for stage in result.stages]
    assert calls[0] == ["embed_tokens"]
    assert calls[1] == ["rotary_emb", "layers.0"]  # the rotary table is not a stage of its own
    assert calls[-1] == ["layers.3", "norm"]  # nor is the final norm
    assert _no_stage_of_a_table(result)


def test_split_says_when_the_cuts_go_inside_the_layers(llama4, tmp_path):
    with pytest.warns(UserWarning, match="6 stages outnumber the 5 that the main graph allows"):
        result = onnx_modular.split(llama4, tmp_path / "six", stages=6, with_data=False)
    assert any(name.startswith("layers.") for name in result.opened)
    assert "--at" in result.notes[0] and f"Note: {result.notes[0]}" in str(result)
    assert _no_stage_of_a_table(result)
    with pytest.raises(InvalidInputError, match="more than a table") as refused:
        onnx_modular.split(llama4, tmp_path / "many", stages=40, with_data=False)
    assert "stages or fewer" in refused.value.hint and not (tmp_path / "many").exists()


def test_a_mistyped_call_gets_examples_from_its_own_file(llama4, tmp_path):
    with pytest.raises(InvalidInputError, match="closest names: layers") as typo:
        onnx_modular.split(llama4, tmp_path / "typo", at=["layer.2"], with_data=False)
    assert "`layers.2`" in typo.value.hint and "`LlamaDecoderLayer`" in typo.value.hint
    assert "GPT2" not in typo.value.hint


def test_a_missing_path_gets_did_you_mean_and_what_to_do(llama4, capsys):
    missing = str(llama4.parent / "lama.onnx")
    assert main(["tree", missing]) == 2
    err = capsys.readouterr().err
    assert f"did you mean {str(llama4)!r}?" in err and "What to do:" in err
    assert main(["verify", str(llama4.parent / "other.onnx")]) == 2  # nothing close: the folder's files
    err = capsys.readouterr().err
    assert "does not exist." in err and "llama.onnx" in err.split("What to do:")[1]


def test_convert_prints_its_report_alone(llama4, tmp_path):
    """A fresh process (onnxruntime's quantizer turns INFO logging on when first imported)."""
    out = tmp_path / "q4.onnx"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    process = subprocess.run(
        [sys.executable, "-m", "onnx_modular", "convert", str(llama4), "-o", str(out), "--quantize", "int4"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert process.returncode == 0, process.stderr
    assert "[INFO]" not in process.stderr and "onnx_ir" not in process.stderr
    assert "per output" in process.stdout and "  last_hidden_state " in process.stdout
    assert not any(line.startswith("  output ") for line in process.stdout.splitlines())


def test_diff_relative_column_leaves_values_near_zero_to_the_absolute_one():
    from onnx_modular.files.diff.numerics import drift as _drift

    a = [np.array([1e-7, 1.0, -2.0], np.float32)]
    b = [np.array([1e-4, 1.001, -2.0], np.float32)]
    max_abs, max_rel, _ = _drift(a, b)
    assert max_abs == pytest.approx(1e-3, rel=1e-3)
    assert max_rel == pytest.approx(1e-3, rel=1e-3)  # 1e-7 off by 1e-4 would read 1e+03
    half = [x.astype(np.float16) for x in (np.array([5e-3, 1.0]), np.array([6e-3, 1.0]))]
    assert _drift([half[0]], [half[1]])[1] == 0.0  # float16: below its atol of 1e-2


class _TwoLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

    def forward(self, x):
        hidden = torch.relu(self.a(x))
        return self.b(hidden), hidden


def test_modularize_names_the_outputs_of_torch_s_flat_file(tmp_path):
    torch.manual_seed(0)
    flat = tmp_path / "flat.onnx"
    torch.onnx.export(_TwoLinear().eval(), (torch.randn(2, 4),), str(flat), dynamo=True)
    import onnx

    assert [v.name for v in onnx.load(str(flat)).graph.output] == ["linear_1", "relu"]  # torch's node names
    report = onnx_modular.modularize(flat, tmp_path / "m.onnx", output_names=["logits", "hidden"])
    saved = onnx.load(str(tmp_path / "m.onnx"))
    assert [v.name for v in saved.graph.output] == ["logits", "hidden"]
    assert [o.name for o in report.parity.outputs] == ["logits", "hidden"] and report.parity.ok
    assert len(saved.functions) == 2  # the calls are outlined as without the names
    for bad, message in ((["logits"], "2 distinct names"), (["x", "y"], "other values"), (["a", "a"], "distinct")):
        with pytest.raises(InvalidInputError, match=message):
            onnx_modular.modularize(flat, tmp_path / "bad.onnx", output_names=bad)
    assert not (tmp_path / "bad.onnx").exists()
    assert main(["modularize", str(flat), "-o", str(tmp_path / "cli.onnx"), "--output-names", "logits,hidden"]) == 0
    assert [v.name for v in onnx.load(str(tmp_path / "cli.onnx")).graph.output] == ["logits", "hidden"]
