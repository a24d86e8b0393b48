"""The file-tool fuzzer's generators for the newest surfaces (issue 65): every path a command names
(``-o`` and ``--json`` on one file, a report inside an output folder, editing in place), ``generate``
(hostile ids, ``max_new_tokens``, ``export.json`` manifests that leave the folder, decoders that are
bombs, endless ``Loop`` s, cycles or lie about their logits), ``optimize`` (options needing
``--quantize``, ``--max-positions`` past every bound, bombs), ``modularize`` of nameless files with
cycles and endless loops, and ``replace --in-place``.

Torch-free: the decoder is built with ``onnx.helper`` (:func:`decoder_model`: an embedding, a cache
that grows by the new tokens, logits ``[batch, sequence, vocabulary]``). Imported by
:mod:`fuzzing.cases` (its ``GENERATORS``) and by ``tests/test_hostile_decoding_tools.py``; it imports
nothing of the other fuzzing modules (whose helpers it repeats in a few lines).
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy
import onnx
from onnx import TensorProto, helper

from fuzzing.builders import DOMAIN, _checks, _fingerprint

VOCAB = 8


def _save(model: onnx.ModelProto, path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())


# -- models --------------------------------------------------------------------------------------


def decoder_model(*, logits: str = "logits", extra_output: bool = False, positions: int | None = None,
                  loop_trips: int | None = None, cycle: bool = False, bomb_depth: int = 0,
                  names: tuple[str, str] = ("past_key_values.0.{kind}", "present.0.{kind}")) -> onnx.ModelProto:
    """A with-cache decoder ``generate`` runs: ``input_ids [b, s]``, ``attention_mask``, a one-layer
    cache ``[b, 1, past, 2]`` that grows by the new tokens' embeddings, logits ``[b, s, VOCAB]``.

    ``logits``: the logits output's name; ``extra_output``: a second rank-3 output; ``positions``:
    ``max_position_embeddings`` metadata; ``loop_trips``: a ``Loop`` of that many trips on the way to
    the logits; ``cycle``: two nodes reading each other; ``bomb_depth``: a chain of functions each
    calling the one below twice (``2**depth`` calls when expanded) on the way to the logits."""
    past_in, present_out = names
    table = numpy.random.default_rng(0).standard_normal((VOCAB, 2)).astype(numpy.float32)
    head = numpy.random.default_rng(1).standard_normal((2, VOCAB)).astype(numpy.float32)
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["emb"], name="embed"),
        helper.make_node("Unsqueeze", ["emb", "axis1"], ["kv"], name="kv"),
    ]
    for kind in ("key", "value"):
        nodes.append(helper.make_node("Concat", [past_in.format(kind=kind), "kv"], [present_out.format(kind=kind)], axis=2))
    hidden = "emb"
    functions = []
    if loop_trips is not None:
        body = helper.make_graph(
            [helper.make_node("Identity", ["c"], ["c2"]), helper.make_node("Identity", ["v"], ["v2"])], "body",
            [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("c", TensorProto.BOOL, []),
             helper.make_tensor_value_info("v", TensorProto.FLOAT, None)],
            [helper.make_tensor_value_info("c2", TensorProto.BOOL, []), helper.make_tensor_value_info("v2", TensorProto.FLOAT, None)],
        )  # fmt: skip
        nodes.append(helper.make_node("Loop", ["trips", "", hidden], ["looped"], body=body, name="loop"))
        hidden = "looped"
    if bomb_depth:
        opsets = [helper.make_opsetid("", 18)]
        functions.append(helper.make_function(DOMAIN, "f0", ["a"], ["b"], [helper.make_node("Identity", ["a"], ["b"])], opsets))
        for level in range(1, bomb_depth):
            calls = [helper.make_node(f"f{level - 1}", ["a"], ["t"], domain=DOMAIN),
                     helper.make_node(f"f{level - 1}", ["t"], ["b"], domain=DOMAIN)]
            functions.append(helper.make_function(DOMAIN, f"f{level}", ["a"], ["b"], calls, opsets))
        nodes.append(helper.make_node(f"f{bomb_depth - 1}", [hidden], ["bombed"], domain=DOMAIN, name="bomb"))
        hidden = "bombed"
    if cycle:
        nodes += [helper.make_node("Add", [hidden, "spin_b"], ["spin_a"], name="spin_a"),
                  helper.make_node("Relu", ["spin_a"], ["spin_b"], name="spin_b")]
        hidden = "spin_a"
    nodes.append(helper.make_node("MatMul", [hidden, "head"], [logits], name="lm_head"))
    outputs = [helper.make_tensor_value_info(logits, TensorProto.FLOAT, ["batch", "sequence", VOCAB])]
    if extra_output:
        nodes.append(helper.make_node("Identity", [logits], ["scores"], name="scores"))
        outputs.append(helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", "sequence", VOCAB]))
    outputs += [helper.make_tensor_value_info(present_out.format(kind=k), TensorProto.FLOAT, ["batch", 1, "total", 2])
                for k in ("key", "value")]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"])]
    inputs += [helper.make_tensor_value_info(past_in.format(kind=k), TensorProto.FLOAT, ["batch", 1, "past", 2])
               for k in ("key", "value")]
    initializers = [onnx.numpy_helper.from_array(table, "table"), onnx.numpy_helper.from_array(head, "head"),
                    onnx.numpy_helper.from_array(numpy.array([1], numpy.int64), "axis1")]
    if loop_trips is not None:
        initializers.append(helper.make_tensor("trips", TensorProto.INT64, [], [loop_trips]))
    graph = helper.make_graph(nodes, "decoder", inputs, outputs, initializers)
    opsets = [helper.make_opsetid("", 18)] + ([helper.make_opsetid(DOMAIN, 1)] if functions else [])
    model = helper.make_model(graph, opset_imports=opsets, functions=functions)
    model.ir_version = 10
    if positions is not None:
        helper.set_model_props(model, {"max_position_embeddings": str(positions)})
    return model


def block_model() -> onnx.ModelProto:
    """One call of ``Blk`` (``b = a + w``) on a 2x3 input (as ``fuzzing.builders.block_model``)."""
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)]
    body = helper.make_function(DOMAIN, "Blk", ["a", "w"], ["b"], [helper.make_node("Add", ["a", "w"], ["b"])], opsets[:1])
    graph = helper.make_graph(
        [helper.make_node("Blk", ["x", "w"], ["y"], domain=DOMAIN, name="/blk")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [onnx.numpy_helper.from_array(numpy.arange(6, dtype=numpy.float32).reshape(2, 3), "w")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=opsets, functions=[body])
    model.ir_version = 10
    return model


def replacement_block() -> onnx.ModelProto:
    """A block for ``replace m.onnx Blk``: ``b = a * w``."""
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("a", "w")]
    graph = helper.make_graph([helper.make_node("Mul", ["a", "w"], ["b"])], "blk", inputs,
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


def flat_model(blocks: int = 6, cycle: bool = False, loop_trips: int | None = None) -> onnx.ModelProto:
    """A nameless flat file of ``blocks`` repeated blocks (MatMul, Relu, Mul, Tanh, Add) that
    ``modularize`` infers calls from; ``cycle``: the first block reads the last block's output;
    ``loop_trips``: a ``Loop`` of that many trips at the end."""
    nodes, values, previous = [], [], "x"
    for i in range(blocks):
        nodes += [helper.make_node("MatMul", [previous, "w"], [f"a{i}"]), helper.make_node("Relu", [f"a{i}"], [f"r{i}"]),
                  helper.make_node("Mul", [f"r{i}", "w2"], [f"m{i}"]), helper.make_node("Tanh", [f"m{i}"], [f"t{i}"]),
                  helper.make_node("Add", [f"t{i}", previous], [f"s{i}"])]
        values += [helper.make_tensor_value_info(f"{p}{i}", TensorProto.FLOAT, [3, 3]) for p in "armts"]
        previous = f"s{i}"
    if cycle:
        nodes[0].input[0] = f"s{blocks - 1}"
    initializers = [onnx.numpy_helper.from_array(numpy.eye(3, dtype=numpy.float32), n) for n in ("w", "w2")]
    if loop_trips is not None:
        body = helper.make_graph(
            [helper.make_node("Identity", ["c"], ["c2"]), helper.make_node("Identity", ["v"], ["v2"])], "body",
            [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("c", TensorProto.BOOL, []),
             helper.make_tensor_value_info("v", TensorProto.FLOAT, [3, 3])],
            [helper.make_tensor_value_info("c2", TensorProto.BOOL, []), helper.make_tensor_value_info("v2", TensorProto.FLOAT, [3, 3])],
        )  # fmt: skip
        nodes.append(helper.make_node("Loop", ["trips", "", previous], ["looped"], body=body, name="loop"))
        initializers.append(helper.make_tensor("trips", TensorProto.INT64, [], [loop_trips]))
        previous = "looped"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
                              [helper.make_tensor_value_info(previous, TensorProto.FLOAT, [3, 3])], initializers, value_info=values)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


def _three_files(case: pathlib.Path) -> dict:
    """``m.onnx`` with its data in ``m.onnx.data``, the replacement block; their fingerprints."""
    onnx.save(block_model(), str(case / "m.onnx"), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    onnx.save(replacement_block(), str(case / "block.onnx"))
    return {name: _fingerprint(case / name) for name in ("m.onnx", "m.onnx.data", "block.onnx")}


# -- generators ------------------------------------------------------------------------------------


def gen_output_collisions(rng, case, seeds):
    """Two outputs of one command on one file (``-o`` and ``--json``), a report inside an output
    folder, or a report over the input: refused before any work, every file as it was."""
    keep = _three_files(case)
    command = rng.choice([
        ["inline", "m.onnx", "o.onnx", "--json", "o.onnx"],
        ["inline", "m.onnx", "o.onnx", "--json", "./o.onnx"],
        ["convert", "m.onnx", "-o", "o.onnx", "--dtype", "float16", "--json", "o.onnx"],
        ["optimize", "m.onnx", "-o", "o.onnx", "--json", "o.onnx"],
        ["optimize", "m.onnx", "-o", "o.onnx", "--json", "m.onnx"],
        ["modularize", "m.onnx", "-o", "o.onnx", "--json", "o.onnx"],
        ["replace", "m.onnx", "Blk", "block.onnx", "-o", "o.onnx", "--json", "o.onnx"],
        ["replace", "m.onnx", "Blk", "block.onnx", "-o", "o.onnx", "--json", "block.onnx"],
        ["extract", "m.onnx", "Blk", "-o", "ex", "--json", "ex/report.json"],
        ["split", "m.onnx", "--stages", "2", "-o", "st", "--json", "st/manifest.json"],
        ["profile", "m.onnx", "--json", "p.json", "--html", "p.json", "--runs", "1"],
        ["diff", "m.onnx", "m.onnx", "--json", "d.json", "--html", "d.json"],
        ["inline", "m.onnx", "o.onnx", "--json", "m.onnx.data"],
        ["generate", "m.onnx", "--input-ids", "1", "--json", "m.onnx"],
    ])  # fmt: skip
    _checks(case, keep=keep, commands=[command, ["verify", "m.onnx"]], must_succeed=[1],
            absent=["o.onnx", "ex", "st", "p.json", "d.json"])
    return "m.onnx"


def gen_in_place(rng, case, seeds):
    """``replace`` over its own input: refused unless ``--in-place``; with it, the file is edited,
    still runs, and keeps one data file."""
    keep = _three_files(case)
    how = rng.choice(["refused", "in_place", "in_place_o", "in_place_other", "no_output"])
    command = {
        "refused": ["replace", "m.onnx", "Blk", "block.onnx", "-o", "m.onnx"],
        "in_place": ["replace", "m.onnx", "Blk", "block.onnx", "--in-place"],
        "in_place_o": ["replace", "m.onnx", "Blk", "block.onnx", "-o", "./m.onnx", "--in-place"],
        "in_place_other": ["replace", "m.onnx", "Blk", "block.onnx", "-o", "o.onnx", "--in-place"],
        "no_output": ["replace", "m.onnx", "Blk", "block.onnx"],
    }[how]
    edits = how in ("in_place", "in_place_o")
    _checks(case, keep={"block.onnx": keep["block.onnx"]} if edits else keep, commands=[command, ["verify", "m.onnx"]],
            must_succeed=[0, 1] if edits else [1], absent=["o.onnx"])
    return "m.onnx"


_IDS = ["1,2,3", "-1,2", "0", "7", "8", "1,99999999999999999999", "a,b", "", ",", "1.5", "1,,2", "9223372036854775807",
        "-9223372036854775809", "0x10", " 3 ", "1e3"]
_NEW = ["0", "1", "3", "-1", "1000000000", "2", "1.5", "abc", "99999999999999999999999"]


def gen_generate_arguments(rng, case, seeds):
    """``generate`` with hostile ids (negative, past the vocabulary, past int64, not numbers,
    rows of different lengths) and ``--max-new-tokens`` (huge, negative, not a number)."""
    _save(decoder_model(positions=rng.choice([None, 6, 64])), case / "dec.onnx")
    rows = [rng.choice(_IDS) for _ in range(rng.choice([1, 1, 2, 3]))]
    command = ["generate", "dec.onnx", *(f"--input-ids={row}" for row in rows), "--max-new-tokens", rng.choice(_NEW)]
    _checks(case, commands=[command, ["generate", "dec.onnx", "--input-ids", "1,2", "--max-new-tokens", "2"]], must_succeed=[1])
    return "dec.onnx"


def gen_generate_folder(rng, case, seeds):
    """A ``--generation`` folder whose ``export.json`` is hostile: files outside the folder
    (``../``, absolute), through a link, a FIFO, not JSON, nested, wrong types."""
    folder = case / "gen"
    _save(decoder_model(), folder / "prefill.onnx")
    _save(decoder_model(), folder / "decode.onnx")
    _save(decoder_model(), case / "outside.onnx")
    components: object = {"prefill": {"file": "prefill.onnx"}, "decode": {"file": "decode.onnx"}}
    how = rng.choice(["valid", "dotdot", "absolute", "link", "fifo", "not_json", "nested", "list", "file_number",
                      "components_list", "huge", "backslash", "nul", "folder", "missing"])  # fmt: skip
    text = None
    if how == "dotdot":
        components["decode"]["file"] = "../outside.onnx"
    elif how == "absolute":
        components["decode"]["file"] = str(case / "outside.onnx")
    elif how == "link":
        os.symlink(case / "outside.onnx", folder / "linked.onnx")
        components["decode"]["file"] = "linked.onnx"
    elif how == "fifo":
        os.mkfifo(folder / "fifo.onnx")
        components["decode"]["file"] = "fifo.onnx"
    elif how == "not_json":
        text = rng.choice(['{"components": ', "\xff\xfe", "NaN"])
    elif how == "nested":
        depth = rng.choice([50, 100_000])
        text = '{"components": ' + "[" * depth + "]" * depth + "}"
    elif how == "list":
        text = json.dumps([components])
    elif how == "file_number":
        components["decode"]["file"] = 7
    elif how == "components_list":
        components = ["prefill.onnx", "decode.onnx"]
    elif how == "huge":
        text = json.dumps({"components": components, "pad": "x" * (17 << 20)})
    elif how == "backslash":
        components["decode"]["file"] = "..\\outside.onnx"
    elif how == "nul":
        components["decode"]["file"] = "decode.onnx\x00.txt"
    elif how == "folder":
        components["decode"]["file"] = "."
    elif how == "missing":
        components["decode"]["file"] = "nothing.onnx"
    data = text if text is not None else json.dumps({"components": components})
    (folder / "export.json").write_bytes(data.encode("utf-8", "surrogateescape"))
    keep = {"outside.onnx": _fingerprint(case / "outside.onnx")}
    _checks(case, keep=keep, commands=[["generate", "gen", "--input-ids", "1,2", "--max-new-tokens", "2"]],
            must_succeed=[0] if how == "valid" else [])
    return "gen"


def gen_generate_bounds(rng, case, seeds):
    """Decoders ``generate`` must refuse or bound: a ``Loop`` of 2**62 trips, a call bomb, a cycle,
    logits renamed (alone: found by rank; beside another rank-3 output: refused), a run longer
    than the positions the file declares."""
    how = rng.choice(["loop", "bomb", "cycle", "renamed", "ambiguous", "positions", "transformers_names"])
    model = {
        "loop": lambda: decoder_model(loop_trips=rng.choice([2**62, 2**40, 10**6])),
        "bomb": lambda: decoder_model(bomb_depth=rng.choice([20, 24, 30])),
        "cycle": lambda: decoder_model(cycle=True),
        "renamed": lambda: decoder_model(logits="next_token_scores"),
        "ambiguous": lambda: decoder_model(logits="out", extra_output=True),
        "positions": lambda: decoder_model(positions=rng.choice([1, 4, 5])),
        "transformers_names": lambda: decoder_model(names=("input.past_key_values.layers.0.{kind}s",
                                                           "output.past_key_values.layers.0.{kind}s")),
    }[how]()
    _save(model, case / "dec.onnx")
    _checks(case, commands=[["generate", "dec.onnx", "--input-ids", "1,2,3", "--max-new-tokens", rng.choice(["2", "5", "40000"])]],
            must_succeed=[])
    return "dec.onnx"


def gen_optimize_options(rng, case, seeds):
    """``optimize`` with options that need ``--quantize``, ``--max-positions`` past every bound, on
    files that are bombs, endless loops or cycles: refused before any work, nothing written."""
    which = rng.choice(["block", "loop", "bomb", "cycle"])
    model = {"block": block_model, "loop": lambda: flat_model(loop_trips=2**62),
             "bomb": lambda: decoder_model(bomb_depth=24), "cycle": lambda: decoder_model(cycle=True)}[which]()
    _save(model, case / "m.onnx")
    option = rng.choice([["--accuracy-level", "0"], ["--accuracy-level", "4"], ["--no-accuracy-guard"], ["--int8-lm-head"],
                         ["--max-positions", rng.choice(["268435456", "1099511627776", "0", "-1", "abc", "99999999999999999999"])],
                         ["--quantize", "int4", "--accuracy-level", "9"], []])  # fmt: skip
    keep = {"m.onnx": _fingerprint(case / "m.onnx")}
    _checks(case, keep=keep, commands=[["optimize", "m.onnx", "-o", "o.onnx", *option]],
            absent=[] if which == "block" and not option else ["o.onnx"])
    return "m.onnx"


def gen_modularize_bounds(rng, case, seeds):
    """``modularize`` of nameless flat files (calls inferred from repeated blocks) with a cycle or
    an endless ``Loop``: refused at once."""
    how = rng.choice(["plain", "cycle", "loop"])
    model = flat_model(blocks=rng.choice([4, 6, 9]), cycle=how == "cycle", loop_trips=2**62 if how == "loop" else None)
    _save(model, case / "flat.onnx")
    infer = rng.choice(["auto", "always"])
    _checks(case, keep={"flat.onnx": _fingerprint(case / "flat.onnx")},
            commands=[["modularize", "flat.onnx", "-o", "m.onnx", "--infer", infer]],
            must_succeed=[0] if how == "plain" else [], absent=[] if how == "plain" else ["m.onnx"])
    return "flat.onnx"


GENERATORS = {
    "output_collisions": (gen_output_collisions, 3),
    "in_place": (gen_in_place, 2),
    "generate_arguments": (gen_generate_arguments, 3),
    "generate_folder": (gen_generate_folder, 3),
    "generate_bounds": (gen_generate_bounds, 3),
    "optimize_options": (gen_optimize_options, 2),
    "modularize_bounds": (gen_modularize_bounds, 2),
}

__all__ = ["GENERATORS", "decoder_model", "block_model", "replacement_block", "flat_model"]
