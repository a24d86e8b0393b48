"""The file fuzzer's generators for issue 53's surfaces: ``convert``, ``diff``, ``split`` and
``run_stages`` (manifests), ``modularize``, the output guard, generation folders, tool bounds.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import onnx
from onnx import TensorProto, helper

from fuzzing.builders import _checks, _fingerprint, _write, block_model, bomb, chain_of_calls, loop_model, save_external

# -- issue 53: convert, diff, split and run_stages, modularize, generation folders ----------


def _three_models(case: pathlib.Path) -> dict:
    for name in ("m", "a", "b"):
        save_external(block_model(), case / f"{name}.onnx", f"{name}.onnx.data")
    return {path.name: _fingerprint(path) for path in sorted(case.iterdir()) if path.is_file()}


_GUARDED = [
    ["convert", "m.onnx", "-o", "m.onnx", "--dtype", "float16"],
    ["convert", "m.onnx", "-o", "m.onnx.data", "--dtype", "float16"],
    ["convert", "a.onnx", "-o", "b.onnx.data", "--dtype", "float16"],
    ["convert", "m.onnx", "-o", "x.onnx", "--dtype", "float16", "--json", "m.onnx.data"],
    ["convert", "m.onnx", "-o", "x.onnx", "--quantize", "int8", "--json", "a.onnx.data"],
    ["diff", "a.onnx", "a.onnx", "--html", "a.onnx.data"],
    ["diff", "a.onnx", "b.onnx", "--json", "b.onnx.data"],
    ["diff", "a.onnx", "b.onnx", "--json", "a.onnx", "--structure-only"],
    ["modularize", "a.onnx", "-o", "a.onnx.data"],
    ["modularize", "a.onnx", "-o", "m.onnx.data"],
    ["inline", "m.onnx", "m.onnx.data"],
    ["inline", "m.onnx", "m.onnx"],
    ["inline", "a.onnx", "b.onnx.data"],
    ["profile", "m.onnx", "--json", "m.onnx.data", "--runs", "1", "--warmup", "0"],
    ["profile", "m.onnx", "--html", "b.onnx.data", "--runs", "1", "--warmup", "0"],
    ["replace", "m.onnx", "Blk", "a.onnx", "-o", "a.onnx.data"],
]


def gen_guard_outputs(rng, case, seeds):
    """Every tool's outputs over the input, its data or another model's data: refused before any
    work, every file byte-identical, every model still verifying (issue 53, class 1)."""
    keep = _three_models(case)
    commands = [rng.choice(_GUARDED), rng.choice(_GUARDED), ["verify", "m.onnx"], ["verify", "a.onnx"], ["verify", "b.onnx"]]
    _checks(case, keep=keep, commands=commands, must_succeed=[2, 3, 4], absent=["x.onnx"])
    return "m.onnx"


def gen_generation_guard(rng, case, seeds):
    """A generation folder: ``decode.onnx`` reads ``prefill.onnx.data``; no output may replace it."""
    save_external(block_model(), case / "prefill.onnx", "prefill.onnx.data")
    shutil.copy(case / "prefill.onnx", case / "decode.onnx")
    keep = {name: _fingerprint(case / name) for name in ("prefill.onnx", "prefill.onnx.data", "decode.onnx")}
    source = rng.choice(["decode.onnx", "prefill.onnx"])
    command = rng.choice([
        ["convert", source, "-o", "prefill.onnx.data", "--dtype", "float16"],
        ["inline", source, "prefill.onnx.data"],
        ["diff", "decode.onnx", "prefill.onnx", "--json", "prefill.onnx.data"],
        ["modularize", source, "-o", "prefill.onnx.data"],
        ["convert", source, "-o", source, "--dtype", "float16"],
    ])  # fmt: skip
    _checks(case, keep=keep, commands=[command, ["verify", "decode.onnx"], ["verify", "prefill.onnx"]], must_succeed=[1, 2])
    return source


def _stage_file(path: pathlib.Path, nodes, inputs, outputs) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    graph = helper.make_graph(
        nodes, "stage", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in outputs],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    _write(path.parent, model.SerializeToString(), path.name)


def gen_manifest(rng, case, seeds):
    """A split folder whose ``manifest.json`` or stage files are hostile (issue 53, class 4):
    nesting, wrong types, unknown outputs, paths out of the folder, links, FIFOs, a file shared by
    two stages, feeds as a list or named like a stage output, a bomb or an endless Loop as a stage."""
    folder = case / "split"
    _stage_file(folder / "stage_0" / "model.onnx", [helper.make_node("Relu", ["x"], ["t"])], ["x"], ["t"])
    _stage_file(folder / "stage_1" / "model.onnx", [helper.make_node("Add", ["t", "x"], ["y"])], ["t", "x"], ["y"])
    stages = [{"file": "stage_0/model.onnx", "inputs": {"x": "x"}, "outputs": ["t"]},
              {"file": "stage_1/model.onnx", "inputs": {"t": "stage_0/t", "x": "x"}, "outputs": ["y"]}]  # fmt: skip
    manifest: object = {"stages": stages, "outputs": {"y": "stage_1/y"}}
    how = rng.choice(["valid", "nesting", "list_name", "unknown_output", "outside", "absolute", "link", "fifo", "shared",
                      "list_feeds", "shadow", "bomb", "loop", "not_object", "huge_stages", "bad_json"])  # fmt: skip
    feeds = {"list_feeds": "list", "shadow": "shadow"}.get(how, "dict")
    text = None
    if how == "nesting":
        depth = rng.choice([20, 1000, 100_000])
        text = '{"stages": ' + "[" * depth + "]" * depth + ', "outputs": {}}'
    elif how == "list_name":
        manifest["outputs"] = {"y": ["stage_1/y"]}
    elif how == "unknown_output":
        manifest["outputs"] = {"y": rng.choice(["stage_7/y", "nothing", "stage_1/z"])}
    elif how in ("outside", "absolute"):
        stages[1]["file"] = "../elsewhere.onnx" if how == "outside" else str(case / "elsewhere.onnx")
        _stage_file(case / "elsewhere.onnx", [helper.make_node("Add", ["t", "x"], ["y"])], ["t", "x"], ["y"])
    elif how == "link":
        shutil.move(folder / "stage_1", case / "elsewhere")
        os.symlink(case / "elsewhere", folder / "stage_1")
    elif how == "fifo":
        os.unlink(folder / "stage_1" / "model.onnx")
        os.mkfifo(folder / "stage_1" / "model.onnx")
    elif how == "shared":
        stages[1]["file"] = "stage_0/model.onnx"
    elif how == "bomb":
        _write(folder / "stage_1", bomb(depth=rng.choice([20, 24])).SerializeToString(), "model.onnx")
    elif how == "loop":
        _write(folder / "stage_1", loop_model(rng.choice([2**62, 10**6]), condition=rng.random() < 0.5).SerializeToString(), "model.onnx")
    elif how == "not_object":
        manifest = rng.choice([[1, 2], "stages", 3, None])
    elif how == "huge_stages":
        manifest["stages"] = stages * 5000
    elif how == "bad_json":
        text = rng.choice(['{"stages": [', None, '{"stages": NaN}'])
    data = b"\xff\xfe{}" if how == "bad_json" and text is None else (text if text is not None else json.dumps(manifest)).encode()
    (folder / "manifest.json").write_bytes(data)  # the None of bad_json: bytes that are not UTF-8
    _checks(case, commands=[["run_stages", "split", feeds]], must_succeed=[0] if how == "valid" else [])
    return "split"


def _symbolic_model(expression: str) -> onnx.ModelProto:
    model = block_model()
    for value in (model.graph.input[0], model.graph.output[0]):
        value.type.tensor_type.shape.dim[0].dim_param = expression
    return model


def gen_long_dims(rng, case, seeds):
    """A symbolic dimension named by a 4 KB (or longer) expression (``a+a+...``) in convert, diff,
    split and modularize: a typed error or a result, never a traceback (issue 53, class 3)."""
    term = rng.choice(["a", "batch", "(a)", "a*2"])
    expression = term + ("+" + term) * rng.choice([500, 2000, 20_000])
    _write(case, _symbolic_model(expression).SerializeToString())
    command = rng.choice([["convert", "m.onnx", "-o", "c.onnx", "--dtype", "float16"], ["diff", "m.onnx", "m.onnx"],
                          ["split", "m.onnx", "-o", "s", "--stages", "2"], ["modularize", "m.onnx", "-o", "mm.onnx"],
                          ["verify", "m.onnx"]])  # fmt: skip
    _checks(case, commands=[command])
    return "m.onnx"


def gen_tool_bounds(rng, case, seeds):
    """Work a file or an option asks for: ``--runs 1e9``, ``--stages 10000``, a call bomb or a Loop of
    2**62 trips given to convert, split and diff: refused before the work (issue 53, class 2)."""
    how = rng.choice(["runs", "diff_runs", "stages", "bomb", "loop", "block_size"])
    if how == "bomb":
        _write(case, bomb(depth=rng.choice([20, 24]), via_if=rng.random() < 0.3).SerializeToString())
    elif how == "loop":
        _write(case, loop_model(rng.choice([2**62, 10**6]), condition=rng.random() < 0.5).SerializeToString())
    else:
        _write(case, chain_of_calls(rng.choice([3, 50])).SerializeToString())
    commands = {
        "runs": [["profile", "m.onnx", "--runs", str(rng.choice([10**9, 10**6])), "--warmup", "0"]],
        "diff_runs": [["diff", "m.onnx", "m.onnx", "--profile", "--runs", str(rng.choice([10**9, 10**6]))]],
        "stages": [["split", "m.onnx", "-o", "s", "--stages", str(rng.choice([10000, 2000, 40]))]],
        "bomb": [["convert", "m.onnx", "-o", "c.onnx", "--dtype", "float16"], ["split", "m.onnx", "-o", "s", "--stages", "2"],
                 ["diff", "m.onnx", "m.onnx"]],
        "loop": [["convert", "m.onnx", "-o", "c.onnx", "--dtype", "float16"], ["diff", "m.onnx", "m.onnx"], ["verify", "m.onnx"]],
        "block_size": [["convert", "m.onnx", "-o", "c.onnx", "--quantize", "int4", "--block-size", str(rng.choice([512, 2**26, 2**40, 8]))]],
    }[how]  # fmt: skip
    _checks(case, commands=commands)
    return "m.onnx"


def gen_diff_trailing(rng, case, seeds):
    """External references without ``length`` into data files with trailing bytes (or sparse and
    far larger): ``diff`` of a file and its copy finds them the same (issue 53, class 6)."""
    model = block_model()
    save_external(model, case / "a.onnx", "a.onnx.data")
    saved = onnx.load(str(case / "a.onnx"), load_external_data=False)
    for tensor in saved.graph.initializer:
        kept = [(e.key, e.value) for e in tensor.external_data if e.key != "length"]
        del tensor.external_data[:]
        for key, value in kept:
            tensor.external_data.add(key=key, value=value)
    _write(case, saved.SerializeToString(), "a.onnx")
    _write(case, saved.SerializeToString(), "b.onnx")
    for tensor in saved.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "b.onnx.data"
    _write(case, saved.SerializeToString(), "b.onnx")
    shutil.copy(case / "a.onnx.data", case / "b.onnx.data")
    with open(case / "b.onnx.data", "r+b") as data:
        if rng.random() < 0.3:
            data.truncate(rng.choice([2**30, 20 * 2**30]))
        else:
            data.seek(0, 2)
            data.write(bytes(rng.randrange(1, 4096)))
    _checks(case, commands=[["diff", "a.onnx", "b.onnx"], ["diff", "a.onnx", "b.onnx", "--structure-only"]], must_succeed=[0, 1])
    return "a.onnx"


def gen_small_external(rng, case, seeds):
    """A small model with external data converted (issue 51's first item): the save must succeed."""
    save_external(chain_of_calls(rng.choice([1, 3])), case / "m.onnx", "m.onnx.data")
    command = rng.choice([["convert", "m.onnx", "-o", "c.onnx", "--dtype", "float16"], ["inline", "m.onnx", "c.onnx"]])
    _checks(case, commands=[command, ["verify", "c.onnx"]], must_succeed=[0, 1])
    return "m.onnx"
