"""Run-time profile on the call tree (onnx_modular.profile, profiling/run.py, profiling/attribution.py).

Structure only, no timed assertions: every kernel is attributed to a call of the tree, the calls'
self times add up to the profiler's kernel total, a planted cost is ranked first, identical calls
get their own times, and the outputs (JSON, Chrome trace, HTML) have the promised shape.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn
from models import gpt2

import onnx_modular
from onnx_modular import export_modular
from onnx_modular.cli import main
from onnx_modular.errors import ExecutionProviderError, InvalidInputError, ProfileError
from onnx_modular.files import load_model_file
from onnx_modular.format import metadata as file_metadata
from onnx_modular.profiling.attribution import tagged_copy

_KERNEL = "_kernel_time"


@pytest.fixture(scope="module")
def gpt2_12(tmp_path_factory):
    """A 12-layer GPT-2 (width 32), exported and saved."""
    model, args, _ = gpt2(n_layer=12, d=32)
    path = tmp_path_factory.mktemp("gpt2") / "gpt2.onnx"
    export_modular(model, args, path)
    return path


@pytest.fixture(scope="module")
def gpt2_report(gpt2_12):
    return onnx_modular.profile(gpt2_12, runs=3, warmup=1, threads=1)


class Layer(nn.Module):
    def __init__(self, heavy: bool = False):
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.heavy = heavy
        if heavy:  # ten times the work of a sibling's Linear, in the layer's own body
            self.up = nn.Parameter(torch.randn(64, 320) / 8)
            self.down = nn.Parameter(torch.randn(320, 64) / 18)

    def forward(self, x):
        x = torch.relu(self.linear(x))
        if self.heavy:
            x = x + (x @ self.up) @ self.down
        return x


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(heavy=(i == 2)) for i in range(4)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    torch.manual_seed(0)
    model = Stack().eval()
    x = torch.randn(256, 64)
    path = tmp_path_factory.mktemp("planted") / "planted.onnx"
    result = export_modular(model, (x,), path)
    return model, x, result, path


def _kernel_ops(events) -> list[str]:
    return [e["args"]["op_name"] for e in events if e.get("cat") == "Node" and e["name"].endswith(_KERNEL)]


def test_tagged_copy_runs_the_kernels_of_the_modular_file(gpt2_12, tmp_path):
    """The route chosen: the profiled flat copy and onnxruntime's own inlining of the modular file
    run the same kernels in the same order, and every node of the copy knows its call."""
    model = load_model_file(gpt2_12)
    copy, origins = tagged_copy(model)
    tree_keys = {call.key for call in onnx_modular.files.function_tree(model).walk()}
    assert {origin.call for origin in origins.values()} <= tree_keys
    assert {node.name for node in copy.graph.node} == set(origins)
    assert origins["h.3.attn.c_attn/node_addmm"].call == "h.3.attn.c_attn"
    feeds = {"input_ids": np.zeros((2, 8), dtype=np.int64)}
    sequences = []
    for name, source in (("modular", str(gpt2_12)), ("copy", copy.SerializeToString())):
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(tmp_path / name)
        options.intra_op_num_threads = 1
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(gpt2_12.parent))
        session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        session.run(None, feeds)
        sequences.append(_kernel_ops(json.loads(open(session.end_profiling()).read())))
    assert sequences[0] == sequences[1] and len(sequences[0]) > 300


def test_every_kernel_is_attributed_and_self_times_add_up(gpt2_report):
    report = gpt2_report
    keys = {call.key for call in report.tree.walk()}
    counts = report.counts
    assert counts["unattributed"] == 0
    assert all(kernel.call in keys for kernel in report.kernels)
    assert counts["node"] + counts["fused"] + counts["inserted"] == len(report.kernels)
    # Per run: the calls' self times (the main graph's own nodes included) against the
    # profiler's kernel total of that run, taken from its events.
    for run, total in enumerate(report.kernel_us):
        attributed = sum(item.self_runs_us[run] for item in report.times.values())
        assert attributed == pytest.approx(total, rel=0.02)
    assert sum(item.self_us for item in report.times.values()) == pytest.approx(report.total_us, rel=0.02)
    assert report.root.inclusive_us == pytest.approx(report.total_us)


def test_fusion_across_a_module_boundary_goes_to_the_innermost_common_call(gpt2_report):
    """onnxruntime fuses the last block's residual Add with ln_f's LayerNormalization."""
    crossing = [kernel for kernel in gpt2_report.kernels if kernel.crosses]
    assert crossing and all(kernel.kind == "fused" for kernel in crossing)
    skip = [kernel for kernel in crossing if kernel.op_type == "SkipLayerNormalization"]
    assert len(skip) == 1
    assert skip[0].call == ""  # h.11 and ln_f meet in the main graph
    assert {part.split("/")[0] for part in skip[0].parts} == {"h.11", "ln_f"}
    fused_inside = [kernel for kernel in gpt2_report.kernels if kernel.kind == "fused" and not kernel.crosses]
    assert any(kernel.op_type == "FastGelu" and kernel.call.endswith("mlp.act") for kernel in fused_inside)
    assert gpt2_report.times[""].fused_across >= 1


def test_identical_calls_are_timed_apart(gpt2_report):
    blocks = [item for item in gpt2_report.calls() if item.label == "GPT2Block"]
    assert [item.key for item in blocks] == [f"h.{i}" for i in range(12)]
    assert all(item.inclusive_us > 0 and item.kernels > 20 for item in blocks)
    group = next(group for group in gpt2_report.classes() if group.label == "GPT2Block")
    assert group.calls == 12 and group.min_us <= group.median_us <= group.max_us
    assert group.slowest in {item.key for item in blocks}


def test_planted_cost_is_ranked_first_by_self_time(planted):
    _, _, _, path = planted
    report = onnx_modular.profile(path, runs=5, warmup=1, threads=1)
    first = report.by_self(1)[0]
    assert first.key == "layers.2"
    assert first.label == "Layer"
    assert "layers.2" in str(report).split("Slowest calls by self time:")[1].splitlines()[1]


def test_result_profile_and_join_with_drift(planted):
    model, x, result, _ = planted
    report = result.profile(runs=2, warmup=0)  # the export's example inputs
    assert report.settings["inputs"] == {"x": {"shape": [256, 64], "dtype": "float32"}}
    joined = report.join(result.localize(model))
    rows = {row["call"]: row for row in joined.table()}
    assert rows["layers.2"]["ok"] is True and rows["layers.2"]["max_abs"] is not None
    assert rows["layers.2.linear"]["self_ms"] >= 0
    assert "max abs" in joined.format().splitlines()[3]
    assert joined.to_dict()["tree"]["children"][0]["drift"]["ok"] is True
    assert report.drift is None  # join returns a new report


def test_cli_outputs(gpt2_12, tmp_path, capsys):
    paths = {kind: tmp_path / f"p.{kind}" for kind in ("json", "trace", "html")}
    code = main(["profile", str(gpt2_12), "--runs", "2", "--warmup", "0", "--depth", "1",
                 "--json", str(paths["json"]), "--trace", str(paths["trace"]), "--html", str(paths["html"])])
    assert code == 0
    out = capsys.readouterr().out
    assert "h.11" in out and "h.0.attn" not in out.split("Slowest")[0]  # --depth 1

    data = json.loads(paths["json"].read_text())
    assert {"path", "settings", "kernel_ms", "tree", "classes", "op_types", "kernels", "attribution"} <= set(data)
    blocks = [child for child in data["tree"]["children"] if child["class"] and child["class"].endswith("GPT2Block")]
    assert len(blocks) == 12 and all(block["children"] for block in blocks)
    assert {"call", "inclusive_ms", "self_ms", "share", "kernels"} <= set(blocks[0])
    keys = set()
    stack = [data["tree"]]
    while stack:
        node = stack.pop()
        keys.add(node["call"])
        stack.extend(node["children"])
    assert all(kernel["call"] in keys for kernel in data["kernels"])

    trace = json.loads(paths["trace"].read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in spans} == {"run", "module", "kernel"}
    _assert_nested(spans)
    # A kernel of h.3.attn.c_attn lies inside spans of h.3.attn.c_attn, h.3.attn and h.3.
    kernel = next(e for e in spans if e["cat"] == "kernel" and e["args"]["call"] == "h.3.attn.c_attn")
    around = {e["name"] for e in spans if e["cat"] == "module" and e["ts"] <= kernel["ts"]
              and kernel["ts"] + kernel["dur"] <= e["ts"] + e["dur"]}
    assert {"h.3", "h.3.attn", "h.3.attn.c_attn"} <= around

    page = paths["html"].read_text()
    assert page.startswith("<!doctype html>") and "<svg" in page and "profile-data" in page
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|\bhref=|@import|url\(", page)
    assert set(re.findall(r"https?://[^\s'\"<]+", page)) <= {"http://www.w3.org/2000/svg"}


def _assert_nested(spans) -> None:
    """Spans on one thread nest properly (as Perfetto and speedscope require)."""
    ordered = sorted(spans, key=lambda e: (e["ts"], -e["dur"]))
    stack: list[dict] = []
    for event in ordered:
        while stack and event["ts"] >= stack[-1]["ts"] + stack[-1]["dur"] - 1e-6:
            stack.pop()
        if stack:
            parent = stack[-1]
            assert event["ts"] + event["dur"] <= parent["ts"] + parent["dur"] + 1e-3, (event["name"], parent["name"])
        stack.append(event)


def test_cli_json_to_stdout(planted, capsys):
    _, _, _, path = planted
    assert main(["profile", str(path), "--runs", "1", "--warmup", "0", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [child["call"] for child in data["tree"]["children"]] == [f"layers.{i}" for i in range(4)]


def _flat_model(path):
    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 8])
    y = oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 8])
    nodes = [oh.make_node("Relu", ["x"], ["a"], name="relu"), oh.make_node("Add", ["a", "x"], ["y"], name="add")]
    onnx.save(oh.make_model(oh.make_graph(nodes, "flat", [x], [y]), opset_imports=[oh.make_opsetid("", 18)]), path)


def test_file_without_functions_is_profiled_by_op_type(tmp_path):
    path = tmp_path / "flat.onnx"
    _flat_model(path)
    report = onnx_modular.profile(path, runs=2, warmup=0)
    assert "no local functions" in report.note and len(report.note.splitlines()) == 1
    assert not report.tree.root.children and report.calls() == []
    assert {row[0] for row in report.by_op_type()} == {"Relu", "Add"}
    text = str(report)
    assert "Per op type:" in text and "note:" in text


def test_bad_inputs_raise_typed_errors_and_write_nothing(planted, tmp_path, capsys):
    _, _, _, path = planted
    out = tmp_path / "out.json"
    with pytest.raises(ExecutionProviderError):
        onnx_modular.profile(path, execution_provider="NoSuchExecutionProvider")
    assert main(["profile", str(path), "--provider", "nosuch", "--json", str(out)]) == 2
    with pytest.raises(InvalidInputError, match="missing"):
        onnx_modular.profile(path, {"wrong": np.zeros((256, 64), np.float32)})
    with pytest.raises(InvalidInputError, match="shape"):
        onnx_modular.profile(path, [np.zeros((256, 3), np.float32)])
    np.savez(tmp_path / "bad.npz", x=np.zeros((256, 64), np.int64))
    assert main(["profile", str(path), "--inputs", str(tmp_path / "bad.npz"), "--html", str(out)]) == 2
    with pytest.raises(InvalidInputError):
        onnx_modular.profile(path, runs=0)
    bf16 = tmp_path / "bf16.onnx"  # valid ONNX, but onnxruntime's CPU provider has no bfloat16 Cos
    value = oh.make_tensor_value_info("x", onnx.TensorProto.BFLOAT16, [2])
    result = oh.make_tensor_value_info("y", onnx.TensorProto.BFLOAT16, [2])
    graph = oh.make_graph([oh.make_node("Cos", ["x"], ["y"])], "g", [value], [result])
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)]), bf16)
    with pytest.raises(ProfileError, match="onnxruntime cannot load"):
        onnx_modular.profile(bf16)
    assert main(["profile", str(bf16), "--trace", str(out)]) == 2
    assert "error: [profile]" in capsys.readouterr().err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.npz", "bf16.onnx"]


def test_profile_is_torch_free(tmp_path):
    path = tmp_path / "flat.onnx"
    _flat_model(path)
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import onnx_modular\n"
        f"report = onnx_modular.profile({str(path)!r}, runs=1, warmup=0)\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print(len(report.kernels))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2"


def test_repeated_calls_and_control_flow(tmp_path):
    """A module called twice gets two rows (``shared``, ``shared@1``, as the tree names them); the
    kernels of an If's branches are charged to their call once (the If's own time excludes them)."""
    from models import CondNet, SameInstanceTwice

    torch.manual_seed(0)
    path = tmp_path / "twice.onnx"
    export_modular(SameInstanceTwice().eval(), (torch.randn(2, 4),), path)
    report = onnx_modular.profile(path, runs=2, warmup=0)
    assert [item.key for item in report.calls()] == ["shared", "shared.linear", "shared@1", "shared.linear@1"]
    assert all(item.kernels >= 1 for item in report.calls())

    path = tmp_path / "cond.onnx"
    export_modular(CondNet().eval(), (torch.randn(2, 4),), path)
    report = onnx_modular.profile(path, runs=3, warmup=0)
    branch = report.times["branch"]
    names = [kernel.name for kernel in report.kernels if kernel.call == "branch"]
    assert any(kernel.op_type == "If" for kernel in report.kernels if kernel.call == "branch")
    assert len(names) > 2  # the If and the nodes of the branch it took
    assert branch.inclusive_us <= report.total_us
    for run, total in enumerate(report.kernel_us):
        assert sum(item.self_runs_us[run] for item in report.times.values()) == pytest.approx(total, rel=0.02)


_TWO_CALLS = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[2] x) => (float[2] y) {
  [first] a = pkg.test.Scale (x)
  [second] b = pkg.test.Scale (a)
  [relu] y = Relu (b)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Scale (t) => (u) {
  [two] c = Constant <value = float {2.0}> ()
  [mul] m = Mul (t, c)
  [neg] u = Neg (m)
}
"""


def test_attribution_rules_on_onnx_text():
    """Torch-free: the tagged copy names each node after its call (a shared body expanded per call),
    and the optimized graph's new nodes go to the innermost call holding their parts (fused) or
    their neighbours (inserted)."""
    import onnx.parser

    from onnx_modular.files import function_tree
    from onnx_modular.profiling.attribution import attribute

    model = onnx.parser.parse_model(_TWO_CALLS)
    tree = function_tree(model)
    copy, origins = tagged_copy(model)
    nodes = {node.name: node for node in copy.graph.node}
    assert list(nodes) == ["first/two", "first/mul", "first/neg", "second/two", "second/mul", "second/neg", "relu"]
    assert origins["second/mul"].call == "second" and origins["relu"].call == ""
    assert not any(node.metadata_props for node in copy.graph.node)  # the tags are gone

    def node(op, inputs, outputs, name):
        return oh.make_node(op, inputs, outputs, name=name)

    # onnxruntime-like rewrites: first/neg + second/mul fused into one node (across the two
    # calls); first/two and second/two folded away; an Identity inserted inside `second`
    # (between second/mul's replacement and second/neg) and one between `second` and relu.
    fused_out = nodes["second/mul"].output[0]
    optimized_nodes = [
        nodes["first/mul"],
        node("FusedNegMul", [nodes["first/mul"].output[0]], [fused_out], "FusedNegMul"),
        node("Identity", [fused_out], ["inside"], "Identity_1"),
        node("Neg", ["inside"], [nodes["second/neg"].output[0]], "second/neg"),
        node("Identity", [nodes["second/neg"].output[0]], ["between"], "Identity_2"),
        node("Relu", ["between"], ["y"], "relu"),
    ]
    optimized = onnx.ModelProto()
    optimized.CopyFrom(copy)
    del optimized.graph.node[:]
    optimized.graph.node.extend(optimized_nodes)
    result = attribute(copy, origins, optimized, tree)
    assert result["first/mul"].call == "first" and result["first/mul"].kind == "node"
    fused = result["FusedNegMul"]
    assert (fused.kind, fused.call, fused.crosses) == ("fused", "", True)
    assert set(fused.parts) == {"first/neg", "second/mul", "second/two"}  # the constant it absorbed too
    assert (result["Identity_1"].kind, result["Identity_1"].call) == ("inserted", "")  # fused (main graph) and second/neg
    assert (result["Identity_2"].kind, result["Identity_2"].call) == ("inserted", "")
    assert result["second/neg"].call == "second"


def test_flat_copy_is_attributed_by_its_module_path_metadata(tmp_path, capsys):
    """The flat copy (`flat_file=True`) has no functions, but each node records its module call
    (`pkg.onnx_modular.module_path`): the profile attributes by it, shows no call that ran no op
    (GPT-2's Dropout in eval), and prints the op-type view its note promises."""
    model, args, _ = gpt2(n_layer=2, d=32)
    path = tmp_path / "g.onnx"
    result = export_modular(model, args, path, flat_file=True)
    flat = result.flat_path
    flat_model = load_model_file(flat, values=False)
    assert not flat_model.functions
    # the optimizer folded some lifted constants away: the list names only those still there
    lifted = file_metadata.lifted_constants(flat_model)
    assert lifted and lifted <= {tensor.name for tensor in flat_model.graph.initializer}
    report = onnx_modular.profile(flat, runs=2, warmup=1, threads=1)
    keys = {call.key for call in report.tree.walk()}
    assert {"h.0", "h.0.attn", "h.1.mlp", "h.1.attn.c_attn", "wte", "ln_f"} <= keys
    assert not any("drop" in key for key in keys)  # no phantom call: its module ran no op
    assert report.tree.find("h.0.attn").class_name == "GPT2Attention"
    assert report.tree.find("h.1").parent is report.tree.root
    kernels = {call: sum(1 for k in report.kernels if k.call == call) for call in keys}
    assert all(kernels[f"h.{i}.attn.c_attn"] >= 1 for i in (0, 1))  # each block's Linear is its own
    assert all(k.call in keys for k in report.kernels)
    assert report.times["h.0"].inclusive_us > 0 and report.times["h.1"].inclusive_us > 0
    # most kernels run under a module call (counted, not timed: one preempted kernel on a loaded
    # machine can hold most of a 4 ms run)
    assert kernels.get("", 0) < len(report.kernels) / 2, kernels
    assert file_metadata.MODULE_PATH in report.note
    assert main(["profile", str(flat), "--runs", "2", "--warmup", "1"]) == 0
    printed = capsys.readouterr().out
    assert "Per op type:" in printed and "Per class" in printed and "GPT2Block" in printed
