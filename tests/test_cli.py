"""End-to-end tests of the command line (``onnx_modular.cli``) on real exported files.

One tiny GPT-2 is exported once per module (``onnx_modular.hf.demo:gpt2``) and shared;
bad files (not ONNX, truncated, recursive functions, a missing function, a huge
dimension) are built by hand with ``onnx.helper``.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
import transformers
from helpers import DOMAIN_TORCH

from onnx_modular import files
from onnx_modular.cli import main
from onnx_modular.errors import InvalidModelFileError
from onnx_modular.format import metadata

# onnxruntime 1.2x reads IR version 10; onnx.helper would stamp its newest one.
IR_VERSION = 10
OPSETS = [oh.make_opsetid("", 18), oh.make_opsetid("pkg.test", 1)]
STAGES = ("capture", "decompose", "translate", "modularize", "optimize", "verify", "save")


def run_cli(*argv: str) -> tuple[int, str, str]:
    """``main(argv)`` -> (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(arg) for arg in argv])
    return code, out.getvalue(), err.getvalue()


def run_ort(path_or_model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    model = path_or_model.SerializeToString() if isinstance(path_or_model, onnx.ModelProto) else str(path_or_model)
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def reference_params(model: onnx.ModelProto, node_names: list[str]) -> int:
    """Weight elements flowing into the call reached through ``node_names`` (main graph first).

    A plain re-computation, independent of onnx_modular.files: the exporter's optimizer may fold
    constants into initializers or share equal ones, so the tests derive numbers from the file.
    """
    lifted = metadata.lifted_constants(model)  # not weights
    sizes = {t.name: 0 if t.name in lifted else math.prod(t.dims) for t in model.graph.initializer}
    functions = {(f.domain, f.name): f for f in model.functions}
    scope: dict[str, str | None] = {name: name for name in sizes}
    nodes, weights = model.graph.node, set()
    for name in node_names:
        node = next(n for n in nodes if n.name == name)
        function = functions[(node.domain, node.op_type)]
        actual = [scope.get(value) for value in node.input]
        weights = {a for a in actual if a}
        scope = dict(zip(function.input, actual))
        nodes = function.node
    return sum(sizes[w] for w in weights)


def function_body(model: onnx.ModelProto, name: str) -> onnx.FunctionProto:
    return next(f for f in model.functions if f.name == name)


def walk_calls(tree: dict) -> list[dict]:
    """Every call in the JSON tree, in node order."""
    calls, stack = [], list(reversed(tree["children"]))
    while stack:
        node = stack.pop()
        calls.append(node)
        stack.extend(reversed(node["children"]))
    return calls


def find_call(tree: dict, function: str) -> dict:
    """The first call of ``function`` in node order."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if node["function"] == function:
            return node
        stack.extend(reversed(node["children"]))
    raise AssertionError(f"no call of {function} in the tree")


# -- shared files ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The demo GPT-2, exported once through the CLI with --json (rc, stdout, stderr, path)."""
    path = tmp_path_factory.mktemp("export") / "gpt2.onnx"
    code, out, err = run_cli("export", "onnx_modular.hf.demo:gpt2", "-o", path, "--json", "-")
    return code, out, err, path


@pytest.fixture(scope="module")
def gpt2(exported) -> pathlib.Path:
    code, _, err, path = exported
    assert code == 0, err
    return path


@pytest.fixture(scope="module")
def input_ids() -> np.ndarray:
    return np.random.default_rng(1).integers(0, 100, size=(2, 8)).astype(np.int64)


def _function_model(functions, nodes, inputs, outputs, *, name="g") -> onnx.ModelProto:
    graph = oh.make_graph(nodes, name, inputs, outputs)
    return oh.make_model(graph, functions=functions, opset_imports=OPSETS, ir_version=IR_VERSION)


def _float_info(name: str, shape) -> onnx.ValueInfoProto:
    return oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)


def recursive_model() -> onnx.ModelProto:
    """pkg.test:Ping calls Pong, which calls Ping."""
    ping = oh.make_function(
        "pkg.test", "Ping", ["x"], ["y"], [oh.make_node("Pong", ["x"], ["y"], domain="pkg.test")], OPSETS
    )
    pong = oh.make_function(
        "pkg.test", "Pong", ["x"], ["y"], [oh.make_node("Ping", ["x"], ["y"], domain="pkg.test")], OPSETS
    )
    call = oh.make_node("Ping", ["X"], ["Y"], domain="pkg.test", name="ping")
    return _function_model([ping, pong], [call], [_float_info("X", [2])], [_float_info("Y", [2])])


def missing_function_model() -> onnx.ModelProto:
    """The main graph calls pkg.test:Missing, which is not defined."""
    call = oh.make_node("Missing", ["X"], ["Y"], domain="pkg.test", name="block.0")
    return _function_model([], [call], [_float_info("X", [2])], [_float_info("Y", [2])])


def huge_dim_model() -> onnx.ModelProto:
    relu = oh.make_node("Relu", ["X"], ["Y"])
    return _function_model([], [relu], [_float_info("X", [2**41, 4])], [_float_info("Y", [2**41, 4])])


def noisy_model() -> onnx.ModelProto:
    """pkg.test:Noisy adds unseeded random noise: two runs (modular, inlined) never agree."""
    noisy = oh.make_function(
        "pkg.test",
        "Noisy",
        ["x"],
        ["y"],
        [oh.make_node("RandomUniformLike", ["x"], ["r"]), oh.make_node("Add", ["x", "r"], ["y"])],
        OPSETS,
    )
    call = oh.make_node("Noisy", ["X"], ["Y"], domain="pkg.test", name="noise")
    return _function_model([noisy], [call], [_float_info("X", ["batch", 4])], [_float_info("Y", ["batch", 4])])


def if_model() -> onnx.ModelProto:
    """Calls inside both branches of an If, with a weight passed through formal inputs.

    main: If(cond) then Outer(X, W) else Inner(X, W); Outer calls Inner; W has 6 elements.
    """
    inner = oh.make_function("pkg.test", "Inner", ["x", "w"], ["y"], [oh.make_node("Add", ["x", "w"], ["y"])], OPSETS)
    outer = oh.make_function(
        "pkg.test",
        "Outer",
        ["x", "weight"],
        ["y"],
        [
            oh.make_node("Inner", ["x", "weight"], ["t"], domain="pkg.test", name="outer.inner"),
            oh.make_node("Relu", ["t"], ["y"]),
        ],
        OPSETS,
    )
    then_graph = oh.make_graph(
        [oh.make_node("Outer", ["X", "W"], ["a"], domain="pkg.test", name="then_outer")],
        "then",
        [],
        [_float_info("a", [2, 3])],
    )
    else_graph = oh.make_graph(
        [oh.make_node("Inner", ["X", "W"], ["b"], domain="pkg.test", name="else_inner")],
        "else",
        [],
        [_float_info("b", [2, 3])],
    )
    branch = oh.make_node("If", ["C"], ["Y"], then_branch=then_graph, else_branch=else_graph, name="branch")
    weight = oh.make_tensor("W", onnx.TensorProto.FLOAT, [2, 3], np.arange(6, dtype=np.float32))
    graph = oh.make_graph(
        [branch],
        "g",
        [oh.make_tensor_value_info("C", onnx.TensorProto.BOOL, []), _float_info("X", [2, 3])],
        [_float_info("Y", [2, 3])],
        initializer=[weight],
    )
    return oh.make_model(graph, functions=[outer, inner], opset_imports=OPSETS, ir_version=IR_VERSION)


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, gpt2) -> dict[str, pathlib.Path]:
    folder = tmp_path_factory.mktemp("bad")
    files = {
        "not_onnx": folder / "notes.onnx",
        "truncated": folder / "truncated.onnx",
        "recursive": folder / "recursive.onnx",
        "missing_function": folder / "missing.onnx",
        "huge_dim": folder / "huge.onnx",
        "absent": folder / "absent.onnx",
    }
    files["not_onnx"].write_text("These are my notes, not a model.\n")
    data = gpt2.read_bytes()
    files["truncated"].write_bytes(data[: len(data) // 2])
    onnx.save(recursive_model(), files["recursive"])
    onnx.save(missing_function_model(), files["missing_function"])
    onnx.save(huge_dim_model(), files["huge_dim"])
    return files


BAD_FILE_MESSAGES = {
    "not_onnx": "is not an ONNX model file (it looks like a text file)",
    "truncated": "is truncated",
    "recursive": "functions call each other recursively: pkg.test:Ping -> pkg.test:Pong -> pkg.test:Ping",
    "missing_function": "node 'block.0' in the main graph calls the function pkg.test:Missing, which the model does not define",
    "huge_dim": "declares a dimension of 2199023255552 (more than 2**40)",
    "absent": "does not exist",
}


# -- export ------------------------------------------------------------------------------


def test_export_prints_each_stage_then_report_and_tree(exported):
    code, out, err, path = exported
    assert code == 0, err
    assert path.is_file()
    stage_lines = [line.split() for line in err.splitlines() if line.startswith("  ")]
    assert [fields[0] for fields in stage_lines if fields[0] in STAGES] == [
        "capture",
        "decompose",
        "translate",
        "modularize",
        "optimize",
        "verify",
        "save",
    ]
    assert all(fields[1].endswith("s") and float(fields[1][:-1]) >= 0 for fields in stage_lines)
    summary = json.loads(out)
    assert summary["ok"] is True
    assert summary["report"]["ok"] is True
    assert set(summary["timings"]) == set(STAGES)
    assert summary["capture_strategy"] == "torch.export"  # the first capture strategy worked
    block = find_call(summary["tree"], "GPT2Block")
    assert block["calls"] == 2 and block["name"] == "h.0"


def test_export_text_output_and_flags(tmp_path):
    path = tmp_path / "nodedupe.onnx"
    code, out, err = run_cli(
        "export", "onnx_modular.hf.demo:gpt2", "-o", path, "--no-verify", "--no-dedupe", "--opset", "18"
    )
    assert code == 0, err
    assert "verify" not in err and "capture" in err and "save" in err
    # No dedupe: h.1 gets its own body, GPT2Block_2.
    assert "GPT2Block_2" in out and "h.1.attn" in out
    assert "Parity" not in out
    model = onnx.load(path, load_external_data=False)
    assert {o.version for o in model.opset_import if o.domain == ""} == {18}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("onnx_modular.hf.demo", "Expected 'package.module:factory'"),
        ("no_such_package_xyz.models:build", "Cannot import 'no_such_package_xyz.models'"),
        ("onnx_modular.hf.demo:nope", "has no attribute 'nope'"),
        ("onnx_modular.hf.demo:__doc__", "is not callable"),
        ("json:dumps", "The factory 'json:dumps' raised TypeError"),
        ("os:getcwd", "The factory 'os:getcwd' returned str"),
    ],
)
def test_export_bad_factory(tmp_path, spec, message):
    output = tmp_path / "m.onnx"
    code, out, err = run_cli("export", spec, "-o", output)
    assert code == 2
    assert err.startswith("error: [input] ") and message in err
    assert len(err.strip().splitlines()) == 1  # one line, no traceback
    assert not output.exists()


def test_export_factory_from_file(tmp_path):
    factory = tmp_path / "tiny.py"
    factory.write_text(
        "import torch\n"
        "class Tiny(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(3, 2)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x).relu()\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    return {'model': Tiny().eval(), 'args': (torch.randn(4, 3),)}\n"
    )
    output = tmp_path / "tiny.onnx"
    code, out, err = run_cli("export", f"{factory}:build", "-o", output, "--json", "-")
    assert code == 0, err
    tree = json.loads(out)["tree"]
    assert [(c["name"], c["function"], c["parameters"]) for c in tree["children"]] == [("fc", "Linear", 8)]


def test_export_parity_failure_exits_1_and_writes_nothing(tmp_path):
    factory = tmp_path / "noisy.py"
    factory.write_text(
        "import torch\n"
        "class Noisy(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x + torch.rand_like(x)\n"
        "def build():\n"
        "    return Noisy().eval(), (torch.zeros(2, 3),)\n"
    )
    output = tmp_path / "noisy.onnx"
    code, out, err = run_cli("export", f"{factory}:build", "-o", output)
    assert code == 1
    assert "FAIL: 1 output(s) beyond tolerance" in out
    assert "error: [verify] onnxruntime results differ from PyTorch" in err
    assert not output.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["noisy.py"]


def test_export_to_missing_folder_is_bad_input(tmp_path):
    code, _, err = run_cli("export", "onnx_modular.hf.demo:gpt2", "-o", tmp_path / "nope" / "m.onnx")
    assert code == 2
    assert "error: [save] The output folder" in err and "does not exist" in err


# -- tree --------------------------------------------------------------------------------


def test_tree_text(gpt2):
    model = onnx.load(gpt2, load_external_data=False)
    code, out, err = run_cli("tree", gpt2)
    assert code == 0, err
    lines = out.splitlines()
    lifted = metadata.lifted_constants(model)  # shapes and scalars lifted out of bodies: not parameters
    assert lifted and lifted <= {t.name for t in model.graph.initializer}
    total = sum(math.prod(t.dims) for t in model.graph.initializer if t.name not in lifted)
    assert lines[0].startswith("main_graph") and f"{total:,} params" in lines[0]
    h0 = next(line for line in lines if line.startswith("├─ h.0 "))
    assert h0.split()[2:6] == [
        "GPT2Block",
        f"[pkg.transformers.{transformers.__version__}]",
        "×2",
        str(len(function_body(model, "GPT2Block").node)),
    ]
    assert h0.endswith(f" {reference_params(model, ['h.0']):,} params")
    # The shared body names its nested calls after h.0; under h.1 they read h.1.*.
    assert any(line.startswith("│  ├─ h.1.attn ") and "GPT2Attention" in line for line in lines)
    c_fc = next(line for line in lines if "h.1.mlp.c_fc" in line)
    assert "Conv1D_3" in c_fc
    assert c_fc.endswith(f" {reference_params(model, ['h.1', 'mlp', 'c_fc']):,} params")
    assert reference_params(model, ["h.1", "mlp", "c_fc"]) >= 64 * 256  # at least the weight


def test_tree_depth_and_class_filter(gpt2):
    code, out, _ = run_cli("tree", gpt2, "--depth", "1")
    assert code == 0
    assert [line.split()[1] for line in out.splitlines()[1:]] == ["wte", "wpe", "drop", "h.0", "h.1", "ln_f"]

    code, out, _ = run_cli("tree", gpt2, "--class", "GPT2MLP")
    assert code == 0
    paths = [line.split()[-8] for line in out.splitlines()[1:]]
    assert paths == ["h.0", "h.0.mlp", "h.1", "h.1.mlp"]  # matches plus their ancestors

    # A class name matches every function of that class (Conv1D, Conv1D_2, ...), through metadata.
    code, out, _ = run_cli("tree", gpt2, "--class", "Conv1D", "--json", "-")
    tree = json.loads(out)
    leaves = [c for block in tree["children"] for sub in block["children"] for c in sub["children"]]
    assert {c["function"] for c in leaves} == {"Conv1D", "Conv1D_2", "Conv1D_3", "Conv1D_4"}
    assert {c["class"] for c in leaves} == {"transformers.pytorch_utils.Conv1D"}

    code, out, _ = run_cli("tree", gpt2, "--class", "NoSuchClass")
    assert code == 0 and "(no call matches 'NoSuchClass')" in out


def test_tree_json_structure(gpt2):
    model = onnx.load(gpt2, load_external_data=False)
    code, out, _ = run_cli("tree", gpt2, "--json", "-")
    assert code == 0
    tree = json.loads(out)
    assert tree["function"] is None
    lifted = metadata.lifted_constants(model)  # not parameters
    assert tree["parameters"] == sum(math.prod(t.dims) for t in model.graph.initializer if t.name not in lifted)
    assert [c["name"] for c in tree["children"]] == ["wte", "wpe", "drop", "h.0", "h.1", "ln_f"]
    h0, h1 = tree["children"][3], tree["children"][4]
    for block in (h0, h1):
        assert block["function"] == "GPT2Block"
        assert block["domain"] == f"pkg.transformers.{transformers.__version__}"
        assert block["class"] == "transformers.models.gpt2.modeling_gpt2.GPT2Block"
        assert block["calls"] == 2 and block["nodes"] == len(function_body(model, "GPT2Block").node)
        assert block["parameters"] == reference_params(model, [block["name"]])
    assert [c["path"] for c in h1["children"]] == ["h.1.ln_1", "h.1.attn", "h.1.ln_2", "h.1.mlp"]
    # node names inside the shared body are relative to it, so they fit every caller
    assert [c["name"] for c in h1["children"]] == ["ln_1", "attn", "ln_2", "mlp"]
    attention = h0["children"][1]
    assert attention["function"] == "GPT2Attention"
    assert attention["parameters"] == reference_params(model, ["h.0", "attn"]) >= 64 * 192 + 64 * 64
    # Dropout in eval computes nothing: no function, but every call is listed as a no-op call.
    dropouts = [c for c in walk_calls(tree) if (c["class"] or "").endswith(".Dropout")]
    assert len(dropouts) == 5 and all(c["function"] is None for c in dropouts)
    assert dropouts[0]["path"] == "drop"
    assert find_call(tree, "LayerNorm")["calls"] == 5

    code, out, _ = run_cli("tree", gpt2, "--json", "-", "--depth", "1")
    assert all(child["children"] == [] for child in json.loads(out)["children"])


def test_tree_follows_if_branches_and_formal_inputs(tmp_path):
    path = tmp_path / "if.onnx"
    onnx.save(if_model(), path)
    code, out, err = run_cli("tree", path, "--json", "-")
    assert code == 0, err
    tree = json.loads(out)
    # Subgraphs in attribute order (onnx.helper sorts attributes: else_branch, then_branch).
    assert [(c["name"], c["function"], c["parameters"]) for c in tree["children"]] == [
        ("else_inner", "Inner", 6),
        ("then_outer", "Outer", 6),
    ]
    nested = tree["children"][1]["children"]
    assert [(c["name"], c["path"], c["parameters"]) for c in nested] == [("outer.inner", "then_outer/outer.inner", 6)]
    assert find_call(tree, "Inner")["calls"] == 2


def test_tree_refuses_exponential_expansion():
    # F0 calls F1 twice, F1 calls F2 twice, ...: 1 + 2 + ... + 2**30 = 2**31 - 1 calls once expanded.
    functions = []
    for level in range(30):
        body = [
            oh.make_node(f"F{level + 1}", ["x"], ["t"], domain="pkg.test"),
            oh.make_node(f"F{level + 1}", ["t"], ["y"], domain="pkg.test"),
        ]
        functions.append(oh.make_function("pkg.test", f"F{level}", ["x"], ["y"], body, OPSETS))
    functions.append(oh.make_function("pkg.test", "F30", ["x"], ["y"], [oh.make_node("Relu", ["x"], ["y"])], OPSETS))
    call = oh.make_node("F0", ["X"], ["Y"], domain="pkg.test")
    model = _function_model(functions, [call], [_float_info("X", [2])], [_float_info("Y", [2])])
    with pytest.raises(InvalidModelFileError, match="expands to 2147483647 calls"):
        files.function_tree(model)


# -- inline ------------------------------------------------------------------------------


def test_inline_all_runs_like_the_modular_model(gpt2, tmp_path, input_ids):
    flat = tmp_path / "flat.onnx"
    code, out, err = run_cli("inline", gpt2, flat)
    assert code == 0, err
    functions = len(onnx.load(gpt2, load_external_data=False).functions)
    assert f"0 local functions left ({functions} inlined)" in out
    model = onnx.load(flat)
    assert len(model.functions) == 0
    assert all(not node.domain.startswith("pkg.") for node in model.graph.node)
    (expected,) = run_ort(gpt2, {"input_ids": input_ids})
    (actual,) = run_ort(flat, {"input_ids": input_ids})
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flat.onnx"]  # no temporary leftovers


def test_inline_optimize_shares_the_per_call_constants(gpt2, tmp_path, input_ids):
    plain, optimized = tmp_path / "flat.onnx", tmp_path / "deploy.onnx"
    assert run_cli("inline", gpt2, plain)[0] == 0
    code, out, err = run_cli("inline", gpt2, optimized, "--optimize")
    assert code == 0, err
    plain_model, model = onnx.load(plain), onnx.load(optimized)
    assert len(model.functions) == 0
    # The export lifted the bodies' constants to shared initializers already: no per-call copies.
    assert sum(node.op_type == "Constant" for node in plain_model.graph.node) == 0
    assert sum(node.op_type == "Constant" for node in model.graph.node) == 0
    assert len(model.graph.node) < len(plain_model.graph.node)
    (expected,) = run_ort(gpt2, {"input_ids": input_ids})
    (actual,) = run_ort(optimized, {"input_ids": input_ids})
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def test_inline_only_selected_functions(gpt2, tmp_path, input_ids):
    partial = tmp_path / "partial.onnx"
    code, out, err = run_cli("inline", gpt2, partial, "--only", "GPT2Block", f"{DOMAIN_TORCH}:Embedding")
    assert code == 0, err
    model = onnx.load(partial)
    names = {f.name for f in model.functions}
    assert "GPT2Block" not in names and "Embedding" not in names
    assert {"GPT2Attention", "GPT2MLP", "Embedding_2"} <= names
    top = {(node.op_type) for node in model.graph.node if node.domain.startswith("pkg.")}
    assert "GPT2Attention" in top and "GPT2Block" not in top
    (expected,) = run_ort(gpt2, {"input_ids": input_ids})
    (actual,) = run_ort(partial, {"input_ids": input_ids})
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def test_inline_failures_leave_no_file(gpt2, tmp_path):
    output = tmp_path / "out.onnx"
    code, _, err = run_cli("inline", gpt2, output, "--only", "NoSuchFunction")
    assert code == 2
    assert "error: [input] No local function matches 'NoSuchFunction'" in err
    code, _, err = run_cli("inline", gpt2, tmp_path / "missing" / "out.onnx")
    assert code == 2 and "does not exist" in err
    assert list(tmp_path.iterdir()) == []


def test_inline_keeps_external_data_next_to_the_copy(gpt2, tmp_path, input_ids):
    source = tmp_path / "src" / "ext.onnx"
    source.parent.mkdir()
    model = onnx.load(gpt2)
    onnx.save(model, source, save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, _, err = run_cli("inline", source, out_dir / "flat.onnx")
    assert code == 0, err
    names = sorted(p.name for p in out_dir.iterdir())
    assert len(names) == 2 and names[0] == "flat.onnx" and names[1] == "flat.onnx.data"
    (expected,) = run_ort(gpt2, {"input_ids": input_ids})
    (actual,) = run_ort(out_dir / "flat.onnx", {"input_ids": input_ids})
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


# -- verify ------------------------------------------------------------------------------


def test_verify_passes_on_random_inputs(gpt2):
    code, out, err = run_cli("verify", gpt2, "--seed", "3")
    assert code == 0, err
    assert "inputs: input_ids[2, 8] (random, seed 3)" in out and "PASS" in out
    code, out, _ = run_cli("verify", gpt2, "--json", "-")
    report = json.loads(out)
    assert code == 0 and report["ok"] is True
    assert report["inputs"] == {"input_ids": {"shape": [2, 8], "dtype": "int64"}}
    assert report["outputs"][0]["shape"] == [2, 8, 64] and report["outputs"][0]["modular_vs_flat_max_abs"] == 0.0


def test_verify_exits_1_when_modular_and_inlined_differ(tmp_path):
    path = tmp_path / "noisy.onnx"
    onnx.save(noisy_model(), path)
    code, out, err = run_cli("verify", path, "--dim", "batch=3", "--json", "-")
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False and report["inputs"]["X"]["shape"] == [3, 4]
    assert "error: outputs differ beyond tolerance: Y (atol=0.0001 rtol=0.001)" in err


def test_verify_against_expected_outputs(gpt2, tmp_path):
    import torch

    from onnx_modular.hf import demo

    model, (input_ids,) = demo.gpt2()
    with torch.no_grad():
        hidden = model(input_ids).last_hidden_state.numpy()
    output_name = onnx.load(gpt2, load_external_data=False).graph.output[0].name
    inputs, expected = tmp_path / "inputs.npz", tmp_path / "expected.npz"
    np.savez(inputs, input_ids=input_ids.numpy())
    np.savez(expected, **{output_name: hidden})
    code, out, err = run_cli("verify", gpt2, "--inputs", inputs, "--expected", expected)
    assert code == 0, err + out

    # Perturb one weight: modular and inlined still agree, the expected outputs do not.
    # (Random noise: a constant shift would vanish, since the LayerNorm before it has zero mean.)
    proto = onnx.load(gpt2)
    weight = next(t for t in proto.graph.initializer if t.name == "h.0.mlp.c_fc.weight")
    values = onnx.numpy_helper.to_array(weight)
    values = values + np.random.default_rng(0).normal(0, 0.5, values.shape).astype(values.dtype)
    weight.CopyFrom(onnx.numpy_helper.from_array(values, weight.name))
    corrupted = tmp_path / "corrupted.onnx"
    onnx.save(proto, corrupted)
    code, out, err = run_cli("verify", corrupted, "--inputs", inputs, "--expected", expected, "--json", "-")
    assert code == 1
    (result,) = json.loads(out)["outputs"]
    assert result["modular_vs_flat_max_abs"] == 0.0 and result["modular_max_abs"] > 0.01 and result["ok"] is False
    assert f"outputs differ beyond tolerance: {output_name} (atol=0.0001 rtol=0.001)" in err


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"input_ids": np.zeros((3, 8), np.int64)}, "Input 'input_ids' has shape [3, 8] but the model declares [2, 8]"),
        ({"input_ids": np.zeros((2, 8), np.int32)}, "Input 'input_ids' has dtype int32 but the model declares int64"),
        ({"tokens": np.zeros((2, 8), np.int64)}, "missing ['input_ids'], unexpected ['tokens']"),
    ],
)
def test_verify_rejects_mismatching_inputs(gpt2, tmp_path, arrays, message):
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, **arrays)
    code, out, err = run_cli("verify", gpt2, "--inputs", inputs)
    assert code == 2
    assert message in err and err.startswith("error: [input]")


def test_verify_positional_npz_and_bad_options(gpt2, tmp_path, input_ids):
    inputs = tmp_path / "positional.npz"
    np.savez(inputs, input_ids)  # saved as arr_0
    assert run_cli("verify", gpt2, "--inputs", inputs)[0] == 0
    code, _, err = run_cli("verify", gpt2, "--inputs", tmp_path / "none.npz")
    assert code == 2 and "--inputs" in err and "does not exist" in err
    code, _, err = run_cli("verify", gpt2, "--dim", "batch")
    assert code == 2 and "--dim expects name=size" in err
    code, _, err = run_cli("verify", gpt2, "--dim", "batch=4")
    assert code == 2 and "No input has a dimension named 'batch'" in err


# -- bad files, for every command that reads one ------------------------------------------


@pytest.mark.parametrize("kind", sorted(BAD_FILE_MESSAGES))
@pytest.mark.parametrize("command", ["tree", "inline", "verify", "view", "modularize"])
def test_bad_files_are_refused_with_a_clear_message(bad_files, tmp_path, command, kind):
    argv = [command, bad_files[kind]]
    if command == "inline":
        argv.append(tmp_path / "flat.onnx")
    if command == "modularize":
        argv += ["-o", tmp_path / "flat.onnx"]
    if command == "view":
        argv.append("--no-browser")
    code, out, err = run_cli(*argv)
    assert code == 2
    assert err.startswith("error: [load] ")
    assert BAD_FILE_MESSAGES[kind] in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 or (kind == "absent" and len(lines) == 2 and lines[1].startswith("What to do: "))  # no traceback
    assert out == ""
    assert not (tmp_path / "flat.onnx").exists()


def test_bad_files_with_the_library(bad_files):
    for kind, message in BAD_FILE_MESSAGES.items():
        with pytest.raises(InvalidModelFileError) as info:
            files.load_model_file(bad_files[kind])
        assert message in str(info.value), kind


def test_truncated_between_two_fields(gpt2, tmp_path):
    # Fields are written in order (graph, opset_import, ..., functions), so a model without
    # its functions is exactly a prefix of the file: a cut that protobuf cannot notice.
    model = onnx.load(gpt2)
    data = model.SerializeToString()
    del model.functions[:]
    prefix = model.SerializeToString()
    assert data.startswith(prefix)
    path = tmp_path / "cut.onnx"
    path.write_bytes(prefix)
    code, _, err = run_cli("tree", path)
    assert code == 2
    assert f"in the main graph calls the function {DOMAIN_TORCH}:Embedding, which the model does not define" in err
    assert "truncated" in err


def test_verbose_prints_the_traceback(bad_files):
    code, _, err = run_cli("tree", bad_files["recursive"], "--verbose")
    assert code == 2
    assert "Traceback (most recent call last)" in err and "InvalidModelFileError" in err


def test_usage_errors_exit_2():
    assert run_cli()[0] == 2
    assert run_cli("tree")[0] == 2
    assert run_cli("frobnicate")[0] == 2
    assert run_cli("tree", "m.onnx", "--depth", "-1")[0] == 2
    assert run_cli("--help")[0] == 0


# -- the module entry point and view ---------------------------------------------------------


def test_python_dash_m(gpt2, bad_files):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-m", "onnx_modular", "tree", str(gpt2), "--json", "-", "--class", "GPT2Block"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    tree = json.loads(done.stdout)
    assert [(c["name"], c["function"], c["calls"]) for c in tree["children"]] == [
        ("h.0", "GPT2Block", 2),
        ("h.1", "GPT2Block", 2),
    ]
    assert all(c["children"] == [] for c in tree["children"])

    done = subprocess.run(
        [sys.executable, "-m", "onnx_modular", "verify", str(bad_files["truncated"])],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: [load] ") and "is truncated" in done.stderr
    assert "Traceback" not in done.stderr


def test_view_serves_the_model_and_its_data_only(tmp_path):
    """`view` answers for the model and its own external data; a key file, a FIFO, a path out
    of the folder are 404s; SIGTERM stops it (exit 143) even after the FIFO was asked for."""
    pytest.importorskip("netron")
    import re
    import signal
    import urllib.error
    import urllib.request

    import onnx.numpy_helper

    weight = onnx.numpy_helper.from_array(np.ones((32, 32), dtype=np.float32), "w")
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 32])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 32])], [weight],
    )  # fmt: skip
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    (tmp_path / "key.pem").write_text("secret")
    os.mkfifo(tmp_path / "fifo")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen(
        [sys.executable, "-m", "onnx_modular", "view", "m.onnx", "--port", "0", "--no-browser"],
        cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stderr.readline()
        address = re.search(r"http://[^ ]+", line)
        assert address, line
        base = address.group(0)

        def status(path):
            try:
                with urllib.request.urlopen(base + path, timeout=10) as response:
                    return response.status, response.read()
            except urllib.error.HTTPError as e:
                return e.code, b""

        assert status("/")[0] == 200
        assert status("/data/m.onnx") == (200, (tmp_path / "m.onnx").read_bytes())
        assert status("/data/m.onnx.data") == (200, (tmp_path / "m.onnx.data").read_bytes())
        for path in ("/data/key.pem", "/data/fifo", "/data/../key.pem", "/data/%2e%2e/m.onnx", "/data//etc/hostname"):
            assert status(path)[0] == 404, path
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert "interrupted" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sorted(os.listdir(tmp_path)) == ["fifo", "key.pem", "m.onnx", "m.onnx.data"]


def _served_model(model_path: pathlib.Path, *flags: str) -> tuple[bytes, str]:
    """Start `view` on ``model_path`` in a child, fetch the model bytes Netron is given, stop it."""
    import re
    import signal
    import urllib.request

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen(
        [sys.executable, "-m", "onnx_modular", "view", str(model_path), "--port", "0", "--no-browser", *flags],
        env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stderr.readline()
        address = re.search(r"http://[^ ]+", line)
        assert address, line
        with urllib.request.urlopen(f"{address.group(0)}/data/{model_path.name}", timeout=30) as response:
            data = response.read()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return data, line


def test_view_shows_lifted_constants_in_their_bodies(gpt2):
    """`view` gives Netron a display copy with the lifted constants back in the bodies (the
    file keeps them lifted); `--as-stored` serves the file's own bytes."""
    pytest.importorskip("netron")

    def lifted_inputs(model: onnx.ModelProto) -> int:
        return sum(name.startswith("const_") for f in model.functions for name in f.input)

    assert lifted_inputs(onnx.load(str(gpt2), load_external_data=False)) > 10
    data, line = _served_model(gpt2)
    assert "lifted constants shown" in line
    shown = onnx.ModelProto.FromString(data)
    assert lifted_inputs(shown) == 0 and len(shown.functions) > 0
    data, line = _served_model(gpt2, "--as-stored")
    assert data == gpt2.read_bytes() and "lifted constants shown" not in line


def test_export_the_kv_cache_demo(tmp_path):
    """The KV-cache demo from the command line: named cache inputs/outputs, full names in the
    parity report, and a decode-step check at other sizes through `verify --dim`."""
    from helpers import cache_argument

    cache = cache_argument()  # `cache` from transformers 5.24, `past_key_values` before
    path = tmp_path / "llama_kv.onnx"
    code, out, err = run_cli("export", "onnx_modular.hf.demo:llama_kv", "-o", path, "--depth", "1")
    assert code == 0, err
    assert f"output.{cache}.layers.1.values [2, 2, 5, 16]" in out  # not cut to 24 characters
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = {i.name: i.shape for i in session.get_inputs()}
    assert inputs["attention_mask"] == ["batch", "total"]
    assert inputs[f"input.{cache}.layers.0.keys"] == ["batch", 2, "past", 16]
    code, out, err = run_cli("verify", path, "--dim", "past=3", "--dim", "seq=1", "--dim", "total=4")
    assert code == 0, err
    assert out.rstrip().endswith("PASS")


def test_long_names_are_shortened_in_the_middle():
    from onnx_modular.check.parity import fit_name, name_column_width

    name = "output.past_key_values.self_attention_cache.layers.11.values"
    width = name_column_width([name, "logits"])
    assert width == 56
    short = fit_name(name, width)
    assert len(short) == 56 and short.startswith("output.past_key") and short.endswith("layers.11.values")
    assert fit_name("logits", width) == "logits"
