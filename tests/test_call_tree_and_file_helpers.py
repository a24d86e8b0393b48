"""One call tree for the export, the file and the command line; verification and localization with
generated and keyword-only inputs; file tools without torch; the file-format helpers.

Numerics: onnxruntime (modular and flat) against PyTorch with the float32 defaults
(atol 1e-4, rtol 1e-3).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import models
import numpy as np
import onnx
import onnx.helper as oh
import pytest
import torch
import zoo

from onnx_modular import export_modular, verify
from onnx_modular.check.parity import REL_FLOOR, max_differences
from onnx_modular.cli import main
from onnx_modular.files import function_tree, load_model_file, random_inputs
from onnx_modular.format import metadata


def _qwen2():
    import transformers as T

    torch.manual_seed(0)
    config = T.Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    ids = torch.randint(0, 100, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.int64)
    return T.Qwen2Model(config).eval(), (), {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    model, args, kwargs = _qwen2()
    path = tmp_path_factory.mktemp("qwen2") / "qwen2.onnx"
    result = export_modular(model, args, path, kwargs=kwargs)
    return model, kwargs, result, path


# -- the file format ------------------------------------------------------------------


def test_call_names_round_trip():
    assert metadata.call_name("shared", 0) == "shared" and metadata.call_name("shared", 2) == "shared@2"
    assert metadata.split_call_name("shared@2") == ("shared", 2)
    assert metadata.split_call_name("h.0.attn") == ("h.0.attn", 0)
    # Only a trailing @digits is an index.
    assert metadata.split_call_name("a@b") == ("a@b", 0) and metadata.split_call_name("@3") == ("@3", 0)
    assert metadata.resolve_module_path("attn", "h.0.attn", "h.1", "h.0") == "h.1.attn"
    assert metadata.resolve_module_path("attn", "h.0.attn", "h.1@2", "h.0") == "h.1.attn"
    assert metadata.resolve_module_path("other", "elsewhere.other", "h.1", "h.0") == "elsewhere.other"
    assert metadata.resolve_module_path("then_x", None, "outer", None) == "outer/then_x"


def test_metadata_module_does_not_import_torch():
    code = "import sys, onnx_modular.format.metadata, onnx_modular.files; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- one tree, same counts --------------------------------------------------------------


def test_hierarchy_and_file_tree_agree(qwen2):
    """The issue's example: the attention function's node count is the final model's both ways."""
    _, _, result, path = qwen2
    file_tree = function_tree(load_model_file(path))
    assert str(result.hierarchy) == str(file_tree)
    attention = file_tree.find("layers.0.self_attn")
    proto = onnx.load(path, load_external_data=False)
    body = next(f for f in proto.functions if f.name == attention.function[1])
    assert result.hierarchy.find("layers.0.self_attn").num_nodes == attention.num_nodes == len(body.node)
    by_name = {call.call_name: call for call in file_tree.walk()}
    for call in result.hierarchy.walk():
        if not call.is_root and call.function is not None:
            mirrored = by_name[call.call_name]
            assert (call.num_nodes, call.parameters, call.call_count) == (
                mirrored.num_nodes,
                mirrored.parameters,
                mirrored.call_count,
            )


def test_export_cli_prints_the_hierarchy(tmp_path):
    path = tmp_path / "gpt2.onnx"
    code, out = _run_cli(["export", "onnx_modular.hf.demo:gpt2", "-o", str(path), "--depth", "0"])
    assert code == 0
    tree = str(function_tree(load_model_file(path)))
    assert tree in out  # the export's own tree, identical to the file's


# -- verification -----------------------------------------------------------------------


def test_relative_error_has_a_floor():
    _, rel = max_differences(np.array([1e-30, 1.0]), np.array([0.0, 1.0]))
    assert rel == pytest.approx(1e-30 / REL_FLOOR)
    _, rel = max_differences(np.array([2.0]), np.array([1.0]))
    assert rel == pytest.approx(1.0 / (1.0 + REL_FLOOR))


def test_generated_masks_keep_every_position():
    graph = oh.make_graph(
        [oh.make_node("Identity", ["attention_mask"], ["y"])],
        "g",
        [oh.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64, ["batch", "seq"])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.INT64, ["batch", "seq"])],
    )
    feeds = random_inputs(oh.make_model(graph), dims={"seq": 5})
    assert feeds["attention_mask"].shape == (2, 5) and (feeds["attention_mask"] == 1).all()


@pytest.mark.parametrize("name", [name for name, entry in zoo.ZOO.items() if entry.default] + ["qwen2"])
def test_verify_with_generated_inputs_passes_on_correct_exports(name, tmp_path, request):
    if name == "qwen2":
        model, _, _, path = request.getfixturevalue("qwen2")
    else:
        model, args, kwargs = zoo.build(name)
        path = tmp_path / f"{name}.onnx"
        export_modular(model, args, path, kwargs=kwargs)  # raises on a parity failure
    report = verify(path, model)
    assert report.ok, str(report)
    for check in report.checks:
        assert check.reference == "PyTorch" and check.modules is not None and check.modules.ok
        for output in check.outputs:
            assert output.modular_max_abs < 1e-4 and output.modular_max_rel < 1e3, output


def test_verify_and_localize_with_keyword_only_inputs(qwen2):
    model, kwargs, result, _ = qwen2
    ids = torch.randint(0, 100, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.int64)
    report = result.verify(kwargs={"input_ids": ids, "attention_mask": mask}, model=model)
    assert report.ok, str(report)
    assert report.max_abs < 1e-4
    modules = result.localize(model, kwargs={"input_ids": ids, "attention_mask": mask})
    assert modules.ok and modules.first_failure is None
    assert len(modules.modules) == len([c for c in result.hierarchy.walk() if c.function is not None])


# -- the command line -------------------------------------------------------------------


def _run_cli(argv):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(argv)
    return code, out.getvalue()


_NO_TORCH = textwrap.dedent(
    """
    import sys

    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is blocked in this test")
            return None

    sys.meta_path.insert(0, _NoTorch())
    from onnx_modular.cli import main
    code = main(sys.argv[1:])
    assert "torch" not in sys.modules
    sys.exit(code)
    """
)


def test_file_tools_work_without_torch(qwen2, tmp_path):
    _, _, _, path = qwen2
    flat = tmp_path / "flat.onnx"
    for argv in (["tree", path, "--depth", "2"], ["inline", path, flat], ["verify", path], ["verify", flat, "--json", "-"]):
        completed = subprocess.run(
            [sys.executable, "-c", _NO_TORCH, *map(str, argv)], capture_output=True, text=True, timeout=300
        )
        assert completed.returncode == 0, (argv, completed.stderr)
    assert flat.exists() and not onnx.load(flat, load_external_data=False).functions
    blocked = subprocess.run(
        [sys.executable, "-c", _NO_TORCH.replace("from onnx_modular.cli import main", "import torch")],
        capture_output=True,
        text=True,
    )
    assert blocked.returncode != 0 and "torch is blocked" in blocked.stderr  # the blocker works
    code = _NO_TORCH.replace(
        "code = main(sys.argv[1:])",
        f"import onnx_modular; report = onnx_modular.verify({str(path)!r}); print(report.ok); code = 0",
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0 and completed.stdout.strip() == "True", completed.stderr


def test_cli_prints_the_hint_and_traceback_on_request(tmp_path):
    factory = tmp_path / "bad_factory.py"
    factory.write_text(
        "import torch\n"
        "def make():\n"
        "    return torch.nn.Linear(2, 2), (torch.randn(1, 2), torch.randn(1, 2))\n"
    )
    import contextlib
    import io

    for verbose in (False, True):
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(["export", f"{factory}:make", "-o", str(tmp_path / "m.onnx")] + (["-v"] if verbose else []))
        text = err.getvalue()
        assert code == 2
        assert "error: [input] The inputs do not match Linear.forward" in text
        assert "What to do: Pass args as a tuple" in text
        assert ("Traceback (most recent call last)" in text) is verbose
    assert not (tmp_path / "m.onnx").exists()


def test_no_op_calls_are_recorded_and_shown(tmp_path):
    model, args, _ = models.gpt2(n_layer=1)
    path = tmp_path / "gpt2.onnx"
    result = export_modular(model, args, path)
    assert not [f for f in result.functions if f.name.startswith("Dropout")]
    file_tree = function_tree(load_model_file(path))
    dropouts = [c for c in file_tree.walk() if c.class_name == "Dropout"]
    assert [c.call_name for c in dropouts] == [
        c.call_name for c in result.hierarchy.walk() if c.class_name == "Dropout"
    ]
    assert dropouts and all(c.function is None for c in dropouts)
    assert re.search(r"─ drop +Dropout \(no ops\)", str(file_tree))
    props = {p.key: p.value for p in onnx.load(path, load_external_data=False).graph.metadata_props}
    entries = json.loads(props[metadata.NO_OP_CALLS])
    assert entries == [["drop", "torch.nn.modules.dropout.Dropout", 2, "drop", -1]]  # after wte and wpe


def test_localization_chart_shows_tolerance_and_keeps_ticks_inside(tmp_path):
    from onnx_modular.check.localization import LocalizationReport
    from onnx_modular.check.parity import Parity, Tolerance

    tolerance = Tolerance(1e-4, 1e-3)
    rows = [
        Parity("h.0.attn", kind="call", module_path="h.0.attn", function="GPT2Attention", depth=2,
               modular_max_abs=3e-6, modular_max_rel=1e-4, outputs_compared=1, ok=True, tolerance=tolerance),
        Parity("h.0", kind="call", module_path="h.0", function="GPT2Block", depth=1,
               modular_max_abs=0.5, modular_max_rel=2.0, outputs_compared=1, ok=False, tolerance=tolerance),
    ]
    page = LocalizationReport(rows, None).save_html(tmp_path / "chart.html").read_text()
    width = int(re.search(r'<svg [^>]*width="(\d+)"', page).group(1))
    tick_xs = [float(x) for x in re.findall(r'<line x1="([\d.]+)" y1="30"', page)]
    assert tick_xs and max(tick_xs) <= width
    labels = re.findall(r">1e(-?\d+)</text>", page)
    assert int(labels[-1]) >= 0  # the axis reaches past the largest error (0.5)
    tolerance = re.search(r'<line class="tolerance" x1="([\d.]+)"', page)
    assert tolerance and float(tolerance.group(1)) < max(tick_xs)
    assert "atol 1e-04" in page
