"""Hostile input on the newest surfaces (issue 65): the path guard of every command (outputs over a
factory's source, two outputs on one file, a report inside an output folder, editing in place only
when asked), ``generate`` (ids, ``max_new_tokens``, ``export.json`` out of the folder, bombs,
renamed logits, typed API errors), ``optimize``'s options and bounds, the genai folder's config,
``modularize`` of nameless files with cycles, the accuracy guard's trials.

One test (or a few) per failure class of the issue; each class also has a generator in
``tests/fuzzing/surfaces.py`` (named in the docstring). Tiny files built with onnx.helper; torch only
for ``export`` (a two-layer factory) and transformers only for the checkpoint's config checks.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import sys

import numpy as np
import onnx
import pytest
from fuzzing import runner, surfaces
from fuzzing.cases import run_campaign
from onnx import helper

import onnx_modular
from onnx_modular.cli import main
from onnx_modular.errors import InvalidInputError, InvalidModelFileError
from onnx_modular.storage import guard, save

decoder_model, block_model, flat_model = surfaces.decoder_model, surfaces.block_model, surfaces.flat_model

FACTORY = """import torch
def factory():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval(), (torch.randn(2, 4),)
"""


def run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(arg) for arg in argv])
    return code, out.getvalue(), err.getvalue()


def model_with_data(folder: pathlib.Path) -> pathlib.Path:
    path = folder / "m.onnx"
    onnx.save(block_model(), str(path), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    onnx.save(surfaces.replacement_block(), str(folder / "block.onnx"))
    return path


def snapshot(folder: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# -- 1. a user's files destroyed ------------------------------------------------------------------


@pytest.mark.parametrize("options", [["-o", "tiny.py"], ["-o", "t.onnx", "--json", "tiny.py"],
                                     ["-o", "t.onnx", "--flat-file", "tiny.py"]])
def test_export_never_writes_over_its_factory_source(tmp_path, monkeypatch, options):
    """``export tiny.py:factory -o tiny.py`` (or ``--json``/``--flat-file`` on it) overwrote the user's
    Python source with exit 0 (generator ``output_collisions``)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.py").write_text(FACTORY)
    code, _, err = run_cli("export", "tiny.py:factory", *options, "--no-verify")
    assert code == 2 and "tiny.py" in err and "Traceback" not in err, err
    assert (tmp_path / "tiny.py").read_text() == FACTORY
    assert not (tmp_path / "t.onnx").exists()


def test_a_module_factory_s_source_is_never_an_output(tmp_path, monkeypatch):
    """``export tinymod:factory -o tinymod.py``: the source found as a module (not named as a file) is
    still refused: every Python file the program imported is protected."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "tinymod.py").write_text(FACTORY)
    code, _, err = run_cli("export", "tinymod:factory", "-o", "tinymod.py", "--no-verify")
    assert code == 2 and "tinymod.py" in err, err
    assert (tmp_path / "tinymod.py").read_text() == FACTORY
    sys.modules.pop("tinymod", None)


@pytest.mark.parametrize("command", [
    ["inline", "m.onnx", "o.onnx", "--json", "o.onnx"],
    ["convert", "m.onnx", "-o", "o.onnx", "--dtype", "float16", "--json", "./o.onnx"],
    ["optimize", "m.onnx", "-o", "o.onnx", "--json", "o.onnx"],
    ["modularize", "m.onnx", "-o", "o.onnx", "--json", "o.onnx"],
    ["replace", "m.onnx", "Blk", "block.onnx", "-o", "o.onnx", "--json", "o.onnx"],
    ["split", "m.onnx", "--stages", "2", "-o", "st", "--json", "st/manifest.json"],
    ["extract", "m.onnx", "Blk", "-o", "ex", "--json", "ex/Blk/model.onnx"],
    ["profile", "m.onnx", "--json", "p.json", "--html", "p.json"],
])  # fmt: skip
def test_two_outputs_of_one_command_are_never_one_file(tmp_path, monkeypatch, command):
    """``--json`` naming ``-o`` (or a file inside the ``-o`` folder, or ``--html``) wrote the report
    over the model the command had just written, exit 0 (generator ``output_collisions``)."""
    monkeypatch.chdir(tmp_path)
    model_with_data(tmp_path)
    before = snapshot(tmp_path)
    code, _, err = run_cli(*command)
    assert code == 2 and ("same file" in err or "overlaps" in err), err
    assert snapshot(tmp_path) == before  # nothing written, nothing changed
    assert not any((tmp_path / name).exists() for name in ("o.onnx", "st", "ex", "p.json"))


def test_a_file_the_command_wrote_is_never_replaced_by_its_next_output(tmp_path):
    """Inside one command, the writer records what it wrote: a second write there is refused."""
    with guard.command_outputs({"-o": tmp_path / "a.json", "--json": tmp_path / "b.json"}):
        save.write_text(tmp_path / "a.json", "first")
        with pytest.raises(InvalidInputError, match="one command never writes two outputs to one file"):
            save.write_text(tmp_path / "a.json", "second")
    assert (tmp_path / "a.json").read_text() == "first"
    save.write_text(tmp_path / "a.json", "next command")  # outside the command: a new write
    with pytest.raises(InvalidInputError, match="same file"):
        guard.check_distinct({"-o": "x/../a.onnx", "--json": "a.onnx"})


def test_genai_report_over_the_checkpoints_config_is_refused(tmp_path, monkeypatch):
    """``export CKPT --genai -o DIR --json CKPT/config.json``: refused before the export."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text('{"model_type": "llama"}')
    code, _, err = run_cli("export", "ckpt", "--genai", "-o", "out", "--json", "ckpt/config.json")
    assert code == 2 and "input folder" in err, err
    assert (tmp_path / "ckpt" / "config.json").read_text() == '{"model_type": "llama"}'


# -- 4. replace --in-place --------------------------------------------------------------------------


def test_replace_edits_in_place_only_when_asked(tmp_path, monkeypatch):
    """``replace m.onnx F block.onnx -o m.onnx`` is refused with a hint to ``--in-place``; with it
    the file is edited atomically, runs, and keeps one data file (generator ``in_place``)."""
    monkeypatch.chdir(tmp_path)
    model_with_data(tmp_path)
    before = snapshot(tmp_path)
    code, _, err = run_cli("replace", "m.onnx", "Blk", "block.onnx", "-o", "m.onnx")
    assert code == 2 and "--in-place" in err, err
    assert snapshot(tmp_path) == before
    code, _, err = run_cli("replace", "m.onnx", "Blk", "block.onnx", "-o", "other.onnx", "--in-place")
    assert code == 2 and not (tmp_path / "other.onnx").exists(), err
    code, out, err = run_cli("replace", "m.onnx", "Blk", "block.onnx", "--in-place")
    assert code == 0, err
    model = onnx.load(str(tmp_path / "m.onnx"))  # its data included
    assert [n.op_type for f in model.functions for n in f.node] == ["Mul"]
    assert len([p for p in tmp_path.iterdir() if p.name.endswith(".data")]) <= 1
    assert run_cli("verify", "m.onnx")[0] == 0


# -- 2. generate: the folder, the ids, the bounds, typed API errors -----------------------------------


def _generation_folder(tmp_path: pathlib.Path, decode: object) -> pathlib.Path:
    folder = tmp_path / "gen"
    folder.mkdir()
    for name in ("prefill.onnx", "decode.onnx"):
        onnx.save(decoder_model(), str(folder / name))
    onnx.save(decoder_model(), str(tmp_path / "outside.onnx"))
    components = {"prefill": {"file": "prefill.onnx"}, "decode": {"file": decode}}
    (folder / "export.json").write_text(json.dumps({"components": components}))
    return folder


@pytest.mark.parametrize("decode", ["../outside.onnx", "ABSOLUTE", "link.onnx", 7, "."])
def test_generate_never_opens_a_file_outside_its_folder(tmp_path, decode):
    """An ``export.json`` naming ``../``, an absolute path or a link out of the folder made
    ``generate`` open that file (its path in the error); some exited 0 (generator ``generate_folder``)."""
    if decode == "ABSOLUTE":
        decode = str(tmp_path / "outside.onnx")
    folder = _generation_folder(tmp_path, decode)
    if decode == "link.onnx":
        os.symlink(tmp_path / "outside.onnx", folder / "link.onnx")
    with pytest.raises(InvalidInputError, match="export.json's file of 'decode'"):
        onnx_modular.generate(folder, [[1, 2]], max_new_tokens=2)
    code, _, err = run_cli("generate", folder, "--input-ids", "1,2")
    assert code == 2 and "Traceback" not in err and str(tmp_path / "outside.onnx") not in err.replace(str(decode), ""), err


@pytest.mark.parametrize("text", ['{"components": ', "[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]", '["prefill.onnx"]', '{"components": []}'])
def test_generate_reads_export_json_as_untrusted(tmp_path, text):
    folder = _generation_folder(tmp_path, "decode.onnx")
    (folder / "export.json").write_text(text)
    code, _, err = run_cli("generate", folder, "--input-ids", "1,2")
    assert code == 2 and "generation manifest" in err and "Traceback" not in err, err


def test_generate_checks_ids_against_the_vocabulary_and_int64(tmp_path):
    """Negative ids and ids past the vocabulary were taken (onnxruntime's Gather wraps negative
    ones); ids past int64 were a traceback (generator ``generate_arguments``)."""
    onnx.save(decoder_model(), str(tmp_path / "dec.onnx"))
    for ids, fragment in (("-1,2", "negative id -1"), ("1,8", f"past the vocabulary of {surfaces.VOCAB}"),
                          ("1,99999999999999999999", "int64")):
        code, _, err = run_cli("generate", tmp_path / "dec.onnx", f"--input-ids={ids}")
        assert code == 2 and fragment in err and "Traceback" not in err, (ids, err)
    code, out, err = run_cli("generate", tmp_path / "dec.onnx", "--input-ids", "1,7", "--max-new-tokens", "3")
    assert code == 0 and out.startswith("prompt 1,7 -> new "), err


@pytest.mark.parametrize("ids, new, fragment", [
    ([[1, 2], [3]], 2, "equal length"),
    ([["a", "b"]], 2, "integers"),
    ([[1.5, 2.0]], 2, "integers"),
    ([[True, False]], 2, "integers"),
    ([[2**70]], 2, "int64"),
    ([[]], 2, "length >= 1"),
    ([[1, 2]], "5", "max_new_tokens must be an integer"),
    ([[1, 2]], 2.0, "max_new_tokens must be an integer"),
    ([[1, 2]], True, "max_new_tokens must be an integer"),
    ([[1, 2]], -1, ">= 0"),
    ([[1, 2]], 10**9, "MAX_NEW_TOKENS"),
])  # fmt: skip
def test_generate_api_arguments_are_typed_errors(tmp_path, ids, new, fragment):
    """Ragged or string ids, a string or float max_new_tokens were numpy's TypeError/ValueError."""
    onnx.save(decoder_model(), str(tmp_path / "dec.onnx"))
    with pytest.raises(InvalidInputError, match=fragment):
        onnx_modular.generate(tmp_path / "dec.onnx", ids, max_new_tokens=new)


def test_generate_path_must_be_a_path():
    with pytest.raises(InvalidInputError, match="path must be a file or folder path"):
        onnx_modular.generate(None, [[1, 2]])


def test_generate_is_bounded_by_the_positions_of_the_file(tmp_path):
    """``--max-new-tokens 1000000000`` ran with no bound; a file that says its positions bounds the run."""
    onnx.save(decoder_model(positions=6), str(tmp_path / "dec.onnx"))
    assert onnx_modular.generate(tmp_path / "dec.onnx", [[1, 2]], max_new_tokens=4).shape == (1, 6)
    with pytest.raises(InvalidInputError, match="at most 6 positions"):
        onnx_modular.generate(tmp_path / "dec.onnx", [[1, 2]], max_new_tokens=5)
    code, _, err = run_cli("generate", tmp_path / "dec.onnx", "--input-ids", "1", "--max-new-tokens", "1000000000")
    assert code == 2 and "ONNX_MODULAR_MAX_NEW_TOKENS" in err or "positions" in err, err


@pytest.mark.parametrize("how", ["loop", "bomb", "cycle"])
def test_generate_refuses_bombs_endless_loops_and_cycles_before_running(tmp_path, how):
    """A call bomb or a 2**62-trip Loop in ``generate`` was killed at 60 s (generator ``generate_bounds``)."""
    model = {"loop": lambda: decoder_model(loop_trips=2**62), "bomb": lambda: decoder_model(bomb_depth=24),
             "cycle": lambda: decoder_model(cycle=True)}[how]()
    onnx.save(model, str(tmp_path / "dec.onnx"))
    with pytest.raises(InvalidModelFileError, match={"loop": "Loop", "bomb": "expand", "cycle": "cycle"}[how]):
        onnx_modular.generate(tmp_path / "dec.onnx", [[1, 2]], max_new_tokens=2)


def test_generate_finds_renamed_logits_or_says_it_cannot(tmp_path):
    """Logits renamed were taken as ``outputs[0]`` (a cache: a traceback)."""
    onnx.save(decoder_model(logits="scores_out"), str(tmp_path / "one.onnx"))
    assert onnx_modular.generate(tmp_path / "one.onnx", [[1, 2]], max_new_tokens=2).shape == (1, 4)
    onnx.save(decoder_model(logits="out", extra_output=True), str(tmp_path / "two.onnx"))
    with pytest.raises(InvalidInputError, match="cannot tell which gives the next token"):
        onnx_modular.generate(tmp_path / "two.onnx", [[1, 2]], max_new_tokens=2)


# -- 3. options needing options, bounds of optimize ---------------------------------------------------


@pytest.mark.parametrize("options, fragment", [
    (["--accuracy-level", "0"], "only applies with --quantize"),
    (["--no-accuracy-guard"], "only applies with --quantize"),
    (["--max-positions", "268435456"], "ONNX_MODULAR_MAX_POSITIONS"),
    (["--max-positions", "1099511627776"], "ONNX_MODULAR_MAX_POSITIONS"),
    (["--max-positions", "0"], ">= 1"),
])  # fmt: skip
def test_optimize_options_are_checked_before_any_work(tmp_path, options, fragment):
    """``--accuracy-level``/``--no-accuracy-guard`` without ``--quantize`` were ignored (exit 0);
    ``--max-positions 2**28`` died with signal 11, ``2**40`` a MemoryError (generator ``optimize_options``)."""
    model_with_data(tmp_path)
    code, _, err = run_cli("optimize", tmp_path / "m.onnx", "-o", tmp_path / "o.onnx", *options)
    assert code == 2 and fragment in err, err
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("command, fragment", [
    (["convert", "m.onnx", "-o", "c.onnx", "--dtype", "float16", "--symmetric"], "--symmetric only applies with --quantize"),
    (["convert", "m.onnx", "-o", "c.onnx", "--dtype", "float16", "--accuracy-level", "4"], "--accuracy-level only applies"),
    (["convert", "m.onnx", "-o", "c.onnx", "--dtype", "float16", "--block-size", "64"], "--block-size only applies"),
    (["genai", "m.onnx", "--checkpoint", "ckpt", "-o", "g", "--no-check", "--steps", "5"], "--steps only applies to what --no-check skips"),
    (["genai", "m.onnx", "--checkpoint", "ckpt", "-o", "g", "--no-check", "--keep-on-mismatch"], "--keep-on-mismatch only"),
])  # fmt: skip
def test_options_that_need_another_option_say_so(tmp_path, monkeypatch, command, fragment):
    """Options that mean nothing without another one were ignored with exit 0."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    model_with_data(tmp_path)
    code, _, err = run_cli(*command)
    assert code == 2 and fragment in err, err
    assert not (tmp_path / "c.onnx").exists() and not (tmp_path / "g").exists()


def test_optimize_api_positions_are_typed(tmp_path):
    model_with_data(tmp_path)
    for value in ("4096", 2.5, -3, True):
        with pytest.raises(InvalidInputError, match="max_positions must be a positive integer"):
            onnx_modular.optimize(tmp_path / "m.onnx", tmp_path / "o.onnx", max_positions=value)
    model = block_model()
    helper.set_model_props(model, {"max_position_embeddings": "many"})
    onnx.save(model, str(tmp_path / "meta.onnx"))
    with pytest.raises(InvalidModelFileError, match="max_position_embeddings"):
        onnx_modular.optimize(tmp_path / "meta.onnx", tmp_path / "o.onnx")


@pytest.mark.parametrize("how", ["loop", "bomb"])
def test_optimize_refuses_bombs_and_endless_loops(tmp_path, how):
    """A call bomb or a 2**62-trip Loop in ``optimize`` was killed at 60 s."""
    model = decoder_model(loop_trips=2**62) if how == "loop" else decoder_model(bomb_depth=24)
    onnx.save(model, str(tmp_path / "m.onnx"))
    with pytest.raises(InvalidModelFileError, match="Loop" if how == "loop" else "expand"):
        onnx_modular.optimize(tmp_path / "m.onnx", tmp_path / "o.onnx")


# -- 6. modularize of nameless files: cycles, endless loops -------------------------------------------


@pytest.mark.parametrize("how", ["cycle", "loop"])
def test_modularize_refuses_cycles_and_endless_loops_of_nameless_files(tmp_path, how):
    """A capture cycle in a nameless file ran over 120 s; a 2**62-trip Loop was killed at 60 s
    (generator ``modularize_bounds``)."""
    model = flat_model(cycle=how == "cycle", loop_trips=2**62 if how == "loop" else None)
    onnx.save(model, str(tmp_path / "flat.onnx"))
    code, _, err = run_cli("modularize", tmp_path / "flat.onnx", "-o", tmp_path / "m.onnx", "--infer", "always")
    assert code == 2 and ("cycle" if how == "cycle" else "Loop") in err, err
    assert not (tmp_path / "m.onnx").exists()
    onnx.save(flat_model(), str(tmp_path / "plain.onnx"))  # the same file without them is modularized
    assert run_cli("modularize", tmp_path / "plain.onnx", "-o", tmp_path / "m.onnx")[0] == 0


def test_the_accuracy_guard_does_not_try_every_call_of_a_large_file(monkeypatch):
    """All 501 calls flipping ran the guard over 240 s (one run per call): past MAX_GUARD_TRIALS
    candidates the whole file goes to the safe level after one trial."""
    from onnx_modular.files.optimize import accuracy_guard

    class Trials:  # the search's view of the runs: every set of calls at level 4 flips a token
        runs = 0
        last = (0, 0.0, 1.0)  # (flips, KL, top-1) of the last trial, as the guard's own trials keep them

        def flipped(self, at_level):
            self.runs += 1
            self.last = (1, 0.0, 0.5) if at_level else (0, 0.0, 1.0)
            return self.last[0]

        def drift(self, at_level):
            self.runs += 1
            return 1.0

    monkeypatch.setenv("ONNX_MODULAR_MAX_GUARD_TRIALS", "16")
    trials = Trials()
    kept, whole, unguarded, _ = accuracy_guard._search(trials, [f"c{i}" for i in range(501)], accuracy_guard.MAX_KEPT)
    assert whole and len(kept) == 501 and unguarded == 1 and trials.runs == 1
    trials = Trials()
    accuracy_guard._search(trials, [f"c{i}" for i in range(8)], accuracy_guard.MAX_KEPT)
    assert trials.runs > 8  # below the bound, each call is ranked alone


# -- genai folders genai cannot use, hostile checkpoint configs -----------------------------------------


def _genai_decoder(rows: int | None = None) -> onnx.ModelProto:
    model = decoder_model()
    if rows is not None:  # optimize's rotary caches: a Constant of positions 0 .. rows - 1
        positions = onnx.numpy_helper.from_array(np.arange(rows, dtype=np.int64)[None], "gqa.positions")
        model.graph.node.append(helper.make_node("Constant", [], ["gqa.positions"], value=positions, name="gqa.positions"))
    return model


@pytest.mark.parametrize("config, generation, fragment", [
    ({"eos_token_id": "2"}, {}, "eos_token_id"),
    ({"eos_token_id": ["2", "3"]}, {}, "eos_token_id"),
    ({"eos_token_id": []}, {}, "eos_token_id"),
    ({}, {"eos_token_id": -1}, "eos_token_id"),
    ({"eos_token_id": 2, "pad_token_id": "x"}, {}, "pad_token_id"),
    ({"eos_token_id": 2, "max_position_embeddings": "64"}, {}, "context length"),
    ({"eos_token_id": 2, "max_position_embeddings": -5}, {}, "context length"),
    ({"eos_token_id": 2, "hidden_size": [64]}, {}, "hidden_size"),
    ({"eos_token_id": 2, "num_attention_heads": 0}, {}, "num_attention_heads"),
    ({"eos_token_id": 2}, {"temperature": "hot"}, "temperature"),
    ({"eos_token_id": 2}, {"do_sample": "yes"}, "do_sample"),
])  # fmt: skip
def test_genai_config_refuses_what_genai_cannot_read(config, generation, fragment):
    """13 hostile checkpoint configs were tracebacks or folders genai cannot use, written without a word."""
    from onnx_modular.files.genai_config import GenaiError, genai_config

    with pytest.raises(GenaiError, match=fragment):
        genai_config(_genai_decoder(), {"model_type": "llama", **config}, generation)


def test_genai_config_refuses_a_context_past_the_rotary_caches():
    """A folder for 16 positions (``optimize --max-positions 16``) with a context of 64: genai's
    attention would read past its caches. A negative context length is refused too."""
    from onnx_modular.files.genai_config import GenaiError, genai_config

    config = {"model_type": "llama", "eos_token_id": 2, "max_position_embeddings": 64}
    with pytest.raises(GenaiError, match="hold 16 positions"):
        genai_config(_genai_decoder(rows=16), config)
    assert genai_config(_genai_decoder(rows=16), config, context_length=16)["model"]["context_length"] == 16
    assert genai_config(_genai_decoder(rows=64), config)["search"]["max_length"] == 64
    with pytest.raises(GenaiError, match="positive integer"):
        genai_config(_genai_decoder(), config, context_length=-5)


def test_checkpoint_configs_and_tokenizer_links_are_refused_before_any_work(tmp_path):
    """Token ids as strings or past int64, a size of 0 (ZeroDivisionError in transformers), a list
    for a size: typed errors before transformers reads the config; a tokenizer that is a link would
    be left out of the genai folder without a word."""
    pytest.importorskip("transformers")
    from onnx_modular.hf.genai import _check_checkpoint

    folder = tmp_path / "ckpt"
    folder.mkdir()
    for bad, fragment in (({"eos_token_id": "2"}, "token id"), ({"bos_token_id": 10**30}, "token id"),
                          ({"num_attention_heads": 0}, "at least one"), ({"hidden_size": [64]}, "non-negative integer"),
                          ({"intermediate_size": [64, -1]}, "non-negative integer"), ({"intermediate_size": []}, "non-negative integer")):
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", **bad}))
        with pytest.raises(InvalidInputError, match=fragment):
            _check_checkpoint(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": [1, 2]}))
    _check_checkpoint(folder)
    # a width per layer (Gemma 3n's intermediate_size) is a list of sizes
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3n_text", "intermediate_size": [64, 128]}))
    _check_checkpoint(folder)
    (folder / "tokenizer.real.json").write_text("{}")
    os.symlink("tokenizer.real.json", folder / "tokenizer.json")
    with pytest.raises(InvalidInputError, match="is a link"):
        _check_checkpoint(folder)


# -- the fuzzer's new generators ----------------------------------------------------------------------


def test_the_new_generators_find_no_failure(tmp_path):
    """A few cases of each new generator through the forked CLI (the 3,000-case campaign is slow)."""
    records = run_campaign(14, seed=65, timeout=60, only=list(surfaces.GENERATORS), workdir=tmp_path)
    assert not runner.failure_classes(records), runner.summary(records)


@pytest.mark.slow
def test_the_campaign_on_the_newest_surfaces(tmp_path):
    """The campaign of docs/robustness.md (issue 65): 3,000 cases of the new generators, none failing."""
    records = run_campaign(3000, seed=0, timeout=60, only=list(surfaces.GENERATORS), workdir=tmp_path)
    assert len(records) == 3000 and not runner.failure_classes(records), runner.summary(records)


# -- 5. verification that cannot be vacuous --------------------------------------------------------------


def test_the_long_prompt_passes_every_window_the_file_holds():
    """A body that differs from a sliding window only past the 6-token prompt was fused as a window
    (logits 0.785 off): the check now runs a prompt past the largest small constant of the file."""
    import onnx_ir as ir

    from onnx_modular.files.optimize.reference_runs import long_prompt_length

    model = decoder_model()
    model.graph.node.append(helper.make_node("Constant", [], ["window"], value=helper.make_tensor("w", onnx.TensorProto.INT64, [], [40])))
    assert long_prompt_length(ir.from_proto(model), 4096) == 42
    assert long_prompt_length(ir.from_proto(model), 41) == 41  # never past the rotary caches
    assert long_prompt_length(ir.from_proto(decoder_model()), 4096) == 17


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> pathlib.Path:
    """A one-layer random Llama exported with its cache (transformers' names)."""
    transformers = pytest.importorskip("transformers")
    import torch

    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder / "ckpt")
    code, _, err = run_cli("export", folder / "ckpt", "--task", "causal-lm-with-past", "-o", folder / "kv.onnx", "--no-verify")
    assert code == 0, err
    return folder / "kv.onnx"


def test_optimize_never_calls_verified_what_differs_on_a_left_padded_batch(tmp_path, tiny_llama):
    """optimize said "each step verified" on a decoder whose left-padded batch of two then gave logits
    0.6 off the input file's: the steps are now checked on a long prompt and a right-padded batch too,
    and the report says how far a left-padded batch is, instead of calling it verified."""
    import shutil

    shutil.copy(tiny_llama, tmp_path / "kv.onnx")
    report = onnx_modular.optimize(tmp_path / "kv.onnx", tmp_path / "opt.onnx")
    assert "GroupQueryAttention" in (report.attention or "")
    assert report.left_padding is not None and report.left_padding > 1e-3
    assert "NOT on left-padded batches" in report.text() and "each step verified in onnxruntime)" not in report.text()
    import onnxruntime as ort

    ids = np.random.default_rng(0).integers(0, 96, (2, 9))
    mask = np.ones((2, 9), np.int64)
    mask[1, 6:] = 0  # right padding: the contract the check holds the rewrite to
    logits = []
    for name in ("kv.onnx", "opt.onnx"):
        session = ort.InferenceSession(str(tmp_path / name), providers=["CPUExecutionProvider"])
        feeds = {"input_ids": ids, "attention_mask": mask}
        feeds.update({i.name: np.zeros((2, i.shape[1], 0, i.shape[3]), np.float32) for i in session.get_inputs() if len(i.shape) == 4})
        logits.append(session.run(None, feeds)[0])
    assert np.abs(logits[0] - logits[1]).max() < 1e-4


def _not_attention(model: onnx.ModelProto, how: str) -> None:
    """Edit the tiny Llama's attention (or its mask) into a body GroupQueryAttention does not compute."""
    body = next(f for f in model.functions if f.name == "LlamaAttention")
    softmax = next(n for n in body.node if n.op_type == "Softmax")
    producer = {o: n for n in body.node for o in n.output}
    mask_add = producer[softmax.input[0]]
    assert mask_add.op_type == "Add"
    halves = [n for n in body.node if n.op_type == "Concat" and n.input[0] in producer and producer[n.input[0]].op_type == "Neg"]
    assert len(halves) == 2  # rotate_half of the query, then of the key
    cache = [n for n in body.node if n.op_type == "Concat" and n.output[0] in body.output]
    if how == "softmax_axis":
        softmax.attribute[0].i = 2
    elif how == "squared":
        scores = mask_add.input[0]
        body.node.insert(list(body.node).index(mask_add), helper.make_node("Mul", [scores, scores], ["squared"]))
        mask_add.input[0] = "squared"
    elif how == "no_mask":
        softmax.input[0] = mask_add.input[0]
    elif how == "strictly_causal":  # kv <= q becomes kv < q: each position no longer sees itself
        outer = next(f for f in model.functions if f.name == "LlamaModel")
        next(n for n in outer.node if n.op_type == "LessOrEqual").op_type = "Less"
    elif how in ("key_sign", "query_sign"):  # concat(x1, -x2): the rotation the other way
        concat = halves[1 if how == "key_sign" else 0]
        concat.input[0], concat.input[1] = concat.input[1], concat.input[0]
    elif how == "query_scaled":  # the rotated query times cos: a value per channel, not one number a position
        turned = next(n for n in body.node if n.op_type == "Mul" and halves[0].output[0] in n.input)
        rotated = next(n for n in body.node if n.op_type == "Add" and turned.output[0] in n.input)
        factor = next(n for n in body.node if n.op_type == "Unsqueeze" and n.input[0].startswith("position_embeddings_0")).output[0]
        for node in body.node:
            node.input[:] = ["scaled_query" if name == rotated.output[0] else name for name in node.input]
        body.node.insert(list(body.node).index(rotated) + 1, helper.make_node("Mul", [rotated.output[0], factor], ["scaled_query"]))
    else:  # the value turned by the rotary's cos before the cache
        value = cache[1]
        cos = next(n for n in body.node if n.op_type == "Mul" and n.input[0] == producer[halves[1].input[1]].input[0]).input[1]
        body.node.insert(list(body.node).index(value), helper.make_node("Mul", [value.input[1], cos], ["turned_value"]))
        value.input[1] = "turned_value"


@pytest.mark.parametrize("how, reason", [
    ("softmax_axis", "not over the keys"), ("squared", "with themselves"), ("no_mask", "no mask"),
    ("strictly_causal", "with Less"), ("key_sign", "not rotate-half rotary"),
    ("query_sign", "the query is not turned by the key's rotary"), ("value_rotated", "the value is changed"),
    ("query_scaled", "not one number a position"),
])
def test_unverified_recognition_refuses_what_is_not_attention(tmp_path, tiny_llama, how, reason):
    """With --no-verify, bodies that are not attention (softmax over another axis, squared scores, no
    mask, a strictly causal mask, rotary with the sign on the other half, the query turned otherwise than
    the key, the value turned) were fused as attention: recognition now proves them by structure."""
    import onnxruntime as ort

    model = onnx.load(str(tiny_llama), load_external_data=False)
    _not_attention(model, how)
    onnx.save(model, str(tmp_path / "hostile.onnx"))
    ids = np.array([[3, 14, 15, 9, 2]], np.int64)
    session = ort.InferenceSession(str(tmp_path / "hostile.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    feeds.update({i.name: np.zeros((1, 2, 0, 16), np.float32) for i in session.get_inputs() if len(i.shape) == 4})
    assert np.isfinite(session.run(None, feeds)[0]).any()  # the edited file runs: a model, not a broken file
    report = onnx_modular.optimize(tmp_path / "hostile.onnx", tmp_path / "opt.onnx", verify=False, steps=("attention",))
    attention = [f for f in report.fusions if f.step == "attention"]
    assert attention and not any(f.fused for f in attention), report.text()
    assert reason in attention[0].reason, attention[0].reason
    report = onnx_modular.optimize(tiny_llama, tmp_path / "plain.onnx", verify=False, steps=("attention",))
    assert report.attention == "GroupQueryAttention"  # the same body untouched is fused
