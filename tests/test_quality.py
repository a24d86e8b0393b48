"""Quality measures of quantized decoders (``onnx_modular.quality``), the trained test decoder
(``onnx_modular.hf.trained``), k-quant packing, and ``optimize --quantize auto --calibration``.

The model: a tiny byte-level Llama trained here on ``pydoc_data.topics`` (hidden 64, 2 layers,
120 steps: seconds), exported with its cache and cached for the session.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import onnx
import pytest

from onnx_modular.errors import InvalidInputError


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """(folder, exported with-cache file, its fused float file, calibration .npz, held-out ids)."""
    from onnx_modular import optimize
    from onnx_modular.cli import main
    from onnx_modular.hf.trained import calibration_ids, held_out_ids, trained_checkpoint

    folder = tmp_path_factory.mktemp("quality")
    checkpoint = trained_checkpoint("llama", "tiny", cache=folder / "cache")
    exported = folder / "m.onnx"
    assert main(["export", str(checkpoint), "--task", "causal-lm-with-past", "--io-names", "optimum", "-o", str(exported),
                 "--no-verify"]) == 0
    fused = folder / "m.opt.onnx"
    optimize(exported, fused)
    calibration = folder / "calib.npz"
    np.savez(calibration, input_ids=calibration_ids(count=2, length=64))
    return folder, exported, fused, calibration, held_out_ids(count=4, length=64)


@pytest.fixture(scope="session")
def uniform(trained):
    """``optimize --quantize int4 --calibration``: the builder's recipe, measured on the calibration ids."""
    from onnx_modular import optimize

    folder, exported, _, calibration, _ = trained
    path = folder / "m.q4.onnx"
    report = optimize(exported, path, quantize="int4", calibration=calibration)
    return path, report.quantization


@pytest.fixture(scope="session")
def auto(trained):
    from onnx_modular import optimize

    folder, exported, _, calibration, _ = trained
    path = folder / "m.auto.onnx"
    report = optimize(exported, path, quantize="auto", calibration=calibration)
    return path, report.quantization


def test_byte_tokenizer_and_held_out_text(trained):
    import tokenizers

    from onnx_modular.hf.trained import calibration_ids, held_out_ids, text_ids

    folder = trained[0]
    checkpoint = next((folder / "cache").iterdir())
    text = "def f(x):\n    return x ** 2  # naïve\n"
    ids = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(text).ids
    assert ids == list(text.encode("utf-8"))  # id = byte value
    held, calib = held_out_ids(count=4, length=64), calibration_ids(count=4, length=64)
    assert held.shape == calib.shape == (4, 64) and held.dtype == np.int64
    whole = text_ids()
    cut = int(len(whole) * 0.9)
    # held-out windows come from the last 10%, never trained on
    assert all(any(np.array_equal(row, whole[s:s + 64]) for s in range(cut, len(whole) - 63, 64)) for row in held)


def test_training_is_deterministic_and_cached(tmp_path):
    from onnx_modular.hf.trained import TrainingRecipe, trained_checkpoint

    recipe = TrainingRecipe(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, steps=4, batch=2, sequence=32)
    first = trained_checkpoint("qwen3", "mini", cache=tmp_path / "a", recipe=recipe)
    second = trained_checkpoint("qwen3", "mini", cache=tmp_path / "b", recipe=recipe)
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert trained_checkpoint("qwen3", "mini", cache=tmp_path / "a", recipe=recipe) == first  # cached: not trained again
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert json.loads((first / "config.json").read_text())["model_type"] == "qwen3"
    with pytest.raises(InvalidInputError, match="shape must be one of"):
        trained_checkpoint("gpt9", "tiny", cache=tmp_path / "c")


def test_quality_of_a_file_against_itself_and_of_int4(trained, uniform):
    from onnx_modular import quality

    _, exported, fused, _, held = trained
    same = quality(fused, exported, held)  # fusion changes no number that matters
    assert same.kl_mean < 1e-7 and same.top1 == 1.0
    assert same.positions == held.size
    q4 = quality(uniform[0], fused, held)
    # trained 120 steps: far better than a uniform guess over 256 bytes, int4 a little worse than float
    assert q4.perplexity_reference < 40
    assert 1e-6 < q4.kl_mean < 1e-2, q4.kl_mean
    assert q4.top1 > 0.9
    assert abs(q4.perplexity / q4.perplexity_reference - 1) < 0.05
    assert q4.bytes == uniform[0].stat().st_size
    assert "mean KL" in q4.text()


def test_uniform_int4_report_measures_on_calibration_ids(trained, uniform):
    from onnx_modular import quality

    _, _, fused, calibration, _ = trained
    measured = uniform[1].quality
    assert measured is not None and measured.positions == 2 * 64
    again = quality(uniform[0], fused, calibration)
    assert measured.kl_mean == pytest.approx(again.kl_mean, rel=1e-3)
    assert measured.top1 == again.top1
    assert "Measured on the calibration ids" in uniform[1].text()


def _nbits(model: onnx.ModelProto) -> dict[str, list[dict]]:
    """Per call: the attributes of the MatMulNBits (or GatherBlockQuantized) in its own body, and whether it has zero points."""
    from onnx_modular.calls.targets import module_calls

    found = {}
    for name, call in module_calls(model).items():
        nodes = [n for n in call.function.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized")] \
            if call.function is not None else []
        if nodes:
            found[name] = [{**{a.name: a.i for a in n.attribute}, "op": n.op_type,
                            "zero_points": len(n.input) > 3 and bool(n.input[3])} for n in nodes]
    return found


def test_auto_chooses_per_call_within_the_uniform_size(trained, uniform, auto):
    from onnx_modular.files.optimize.auto import AUTO_KEY, CHOICES

    path, report = auto
    choices = {c.name: c for c in CHOICES}
    model = onnx.load(str(path), load_external_data=False)
    recorded = json.loads(next(p.value for p in model.metadata_props if p.key == AUTO_KEY))
    nbits = _nbits(model)
    assert set(recorded) == {r.call for r in report.auto.calls} and {"lm_head", "model.embed_tokens"} <= set(recorded)
    for call, name in recorded.items():  # each call's MatMulNBits (GatherBlockQuantized) is what the report says it chose
        if name == "float":
            assert call not in nbits
            continue
        choice = choices[name]
        for attributes in nbits[call]:
            assert attributes["bits"] == choice.bits and attributes["block_size"] == choice.block_size
            assert attributes["zero_points"] == (not choice.symmetric)
            if attributes["op"] == "MatMulNBits":  # a Gather has no compute type
                assert attributes.get("accuracy_level", 0) == choice.accuracy_level
    # within the budget: the uniform int4 file's size (1% for the two writers' own bytes)
    assert path.stat().st_size <= uniform[0].stat().st_size * 1.01
    assert report.auto.bytes <= report.auto.budget
    from onnx_modular.check.quality import file_bytes

    assert report.auto.bytes == file_bytes(path)  # the size the choice counted is the size written
    # measured on the calibration ids: no worse than the uniform file, and the sum of shares predicts it
    assert report.auto.measured.kl_mean <= report.auto.uniform.kl_mean
    assert report.auto.uniform.kl_mean == pytest.approx(uniform[1].quality.kl_mean, rel=0.05)
    assert 0.5 < report.auto.predicted_kl / report.auto.measured.kl_mean < 2.0
    text = report.text()
    assert "predicted" in text and "measured" in text and "lm_head" in text
    # every MatMul weight's k-quant rounding weighted by its input's importance (the embedding table's not)
    assert report.auto.weighted == len(report.auto.calls) - 1 and "for 11 weights" in text


def test_auto_on_held_out_text(trained, uniform, auto):
    from onnx_modular import quality

    _, _, fused, _, held = trained
    ours, theirs = quality(auto[0], fused, held), quality(uniform[0], fused, held)
    # held-out text the choice never saw: within 10% of the uniform file's KL or better
    assert ours.kl_mean <= theirs.kl_mean * 1.1, (ours.kl_mean, theirs.kl_mean)
    assert ours.top1 > 0.9


def test_auto_budget_larger_and_too_small(trained, auto):
    from onnx_modular.files.optimize.auto import quantize_auto

    _, _, fused, calibration, _ = trained
    ids = np.load(calibration)["input_ids"]
    model = onnx.load(str(fused))
    _, roomy = quantize_auto(model, ids, max_size=("ratio", 1.5))
    assert roomy.bytes <= roomy.budget == int(roomy.uniform_bytes * 1.5)
    assert roomy.measured.kl_mean < auto[1].auto.measured.kl_mean  # more bytes, less drift
    assert {r.choice for r in roomy.calls} & {"int8 b32 sym", "float"}
    with pytest.raises(InvalidInputError, match="fits in|smallest choice"):
        quantize_auto(model, ids, max_size=("bytes", 1000))


def test_optimize_auto_refusals_leave_nothing(trained, tmp_path):
    from onnx_modular import optimize
    from onnx_modular.cli import main

    _, exported, _, calibration, _ = trained
    out = tmp_path / "x.onnx"
    with pytest.raises(InvalidInputError, match="calibration"):
        optimize(exported, out, quantize="auto")
    with pytest.raises(InvalidInputError, match="for a quantized file"):
        optimize(exported, out, calibration=calibration)
    with pytest.raises(InvalidInputError, match="max_size is the budget"):
        optimize(exported, out, quantize="int4", max_size="1.1x")
    with pytest.raises(InvalidInputError, match="max_size must be"):
        optimize(exported, out, quantize="auto", calibration=calibration, max_size="big")
    assert main(["optimize", str(exported), "-o", str(out), "--quantize", "auto"]) != 0
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", ["float", "one_dim", "past_vocab", "negative", "no_key", "missing", "suffix", "txt_alone"])
def test_bad_calibration_files(trained, tmp_path, case):
    from onnx_modular import optimize

    _, exported, _, _, _ = trained
    calibration = tmp_path / "calib.npz"
    arrays = {"float": {"input_ids": np.zeros((2, 8), np.float32)}, "one_dim": {"input_ids": np.arange(8)},
              "past_vocab": {"input_ids": np.full((2, 8), 256)}, "negative": {"input_ids": np.full((2, 8), -1)},
              "no_key": {"ids": np.zeros((2, 8), np.int64)}}
    if case in arrays:
        np.savez(calibration, **arrays[case])
    elif case == "suffix":
        calibration = tmp_path / "calib.json"
        calibration.write_text("[]")
    elif case == "txt_alone":
        calibration = tmp_path / "calib.txt"
        calibration.write_text("text " * 100)
    expected = {"float": "integer token ids", "one_dim": r"\[n, seq\]", "past_vocab": "outside the model's vocabulary",
                "negative": "outside", "no_key": "no array named 'input_ids'", "missing": "does not exist",
                "suffix": ".npz", "txt_alone": "tokenizer.json"}[case]
    out = tmp_path / "out.onnx"
    with pytest.raises(InvalidInputError, match=expected):
        optimize(exported, out, quantize="auto", calibration=calibration)
    assert not out.exists()


def test_text_calibration_uses_the_tokenizer_beside_the_model(trained, tmp_path):
    import shutil

    from onnx_modular.check.quality import load_ids

    folder = trained[0]
    checkpoint = next((folder / "cache").iterdir())
    model = tmp_path / "m.onnx"
    model.write_bytes(b"")
    shutil.copy(checkpoint / "tokenizer.json", tmp_path / "tokenizer.json")
    text = "The quick brown fox. " * 20
    (tmp_path / "calib.txt").write_text(text)
    ids = load_ids(tmp_path / "calib.txt", vocab=256, beside=model, row=64)
    assert ids.shape == (len(text.encode()) // 64, 64)
    assert list(ids[0]) == list(text.encode()[:64])


@pytest.mark.parametrize(("bits", "block", "k", "n", "weighted"),
                         [(4, 32, 192, 24, False), (4, 64, 192, 24, True), (4, 16, 200, 7, True), (8, 32, 96, 16, False)])
def test_kquant_packing_computes_its_dequantized_weight(bits, block, k, n, weighted):
    """MatMulNBits on the packed k-quant weight computes x @ (q - zero) * scale, the rounding
    weighted_k_quant chose (with the channels' importance when given)."""
    import onnx.helper as h
    import onnxruntime as ort

    from onnx_modular.passes.precision.kquant import KQuantPacker, weighted_k_quant

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((k, n)).astype(np.float32)
    importance = rng.gamma(0.5, size=k).astype(np.float32) if weighted else None
    packed, scales, zeros = KQuantPacker(bits, block).qbits_block_quant(weight, importance)
    blocks = -(-k // block)
    rows = np.pad(importance if weighted else np.ones(k, np.float32), (0, blocks * block - k), constant_values=1.0)
    q, scale, zero = weighted_k_quant(np.pad(weight, ((0, blocks * block - k), (0, 0))).T.copy(),
                                      np.broadcast_to(rows, (n, rows.size)), bits, block)
    dequantized = ((q - zero[:, None]) * scale[:, None]).reshape(n, blocks * block)[:, :k].T
    node = h.make_node("MatMulNBits", ["x", "w", "s", "z"], ["y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=block)
    graph = h.make_graph([node], "g", [h.make_tensor_value_info("x", 1, [3, k])], [h.make_tensor_value_info("y", 1, [3, n])],
                         [onnx.numpy_helper.from_array(a, name) for a, name in ((packed, "w"), (scales, "s"), (zeros, "z"))])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])
    x = rng.standard_normal((3, k)).astype(np.float32)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x @ dequantized, atol=1e-4 * np.abs(x @ dequantized).max())


def test_choose_is_the_best_within_the_budget():
    from onnx_modular.files.optimize.auto import FLOAT, Choice, choose

    rng = np.random.default_rng(3)
    picks = [FLOAT, Choice("a", 4), Choice("b", 8)]
    options = {f"c{i}": [(c, int(b), float(kl)) for c, b, kl in zip(picks, sorted(rng.integers(100, 1000, 3))[::-1],
                                                                   [0.0, *sorted(rng.random(2))[::-1]])]
               for i in range(5)}
    budget = 2500
    chosen = choose(options, budget)
    cost = lambda pick: sum(next(b for c, b, _ in options[n] if c == pick[n]) for n in options)
    kl = lambda pick: sum(next(k for c, _, k in options[n] if c == pick[n]) for n in options)
    assert cost(chosen) <= budget
    every = [dict(zip(options, combo)) for combo in itertools.product(picks, repeat=len(options))]
    best = min((p for p in every if cost(p) <= budget), key=kl)
    assert kl(chosen) == pytest.approx(kl(best), abs=1e-12)


@pytest.mark.parametrize(("text", "parsed"), [("1.02x", ("ratio", 1.02)), ("3.6MB", ("bytes", 3.6e6)),
                                              ("3600000", ("bytes", 3.6e6)), ("1.5", ("ratio", 1.5))])
def test_max_size_forms(text, parsed):
    from onnx_modular.files.optimize.auto import parse_max_size

    assert parse_max_size(text)[0] == parsed[0]
    assert parse_max_size(text)[1] == pytest.approx(parsed[1])


def _embedding_quantized(fused, bits: int, algorithm: str, symmetric: bool, importance=None) -> onnx.ModelProto:
    """The fused file with its embedding table (the ``model.embed_tokens`` call) quantized, values filled in."""
    from onnx_modular.calls.targets import module_calls
    from onnx_modular.passes.precision.quantize_weights import QuantizeSettings, quantize_weights

    model = onnx.load(str(fused))
    call = module_calls(model)["model.embed_tokens"]
    done = quantize_weights(model, [(call.function, "model.embed_tokens")],
                            QuantizeSettings(bits, 32, symmetric, None, algorithm, embeddings=True), importance=importance)
    assert done.tied == [("model.embed_tokens", done.tied[0][1])] and not done.quantized
    made = {t.name: t for t in model.graph.initializer}
    for name, source in done.sources.items():
        made[name].CopyFrom(onnx.numpy_helper.from_array(np.asarray(source()).reshape(tuple(made[name].dims)), name))
    read = {i for n in model.graph.node for i in n.input}
    kept = [t for t in model.graph.initializer if t.name in read]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return model


@pytest.mark.parametrize(("bits", "algorithm", "symmetric", "bound"),
                         [(8, "rtn", True, 2e-5), (4, "rtn", True, 1e-3), (4, "k_quant", False, 1e-3)])
def test_embedding_table_as_gather_block_quantized(trained, tmp_path, bits, algorithm, symmetric, bound):
    """An untied embedding (the builder leaves it float32) read as GatherBlockQuantized from its own packed
    table: the float table is gone, the file is smaller by the table's difference, and its next-token KL
    against the float file on held-out text is within ``bound`` (measured here, the tiny trained Llama:
    int8 1.2e-6, int4 1.9e-4 round-to-nearest and 1.5e-4 k-quant nats; top-1 98-100%)."""
    from onnx_modular import quality
    from onnx_modular.calls.targets import module_calls

    _, _, fused, _, held = trained
    model = _embedding_quantized(fused, bits, algorithm, symmetric)
    table = next(t for t in onnx.load(str(fused)).graph.initializer if list(t.dims) == [256, 64])
    assert table.name not in {t.name for t in model.graph.initializer}  # the float table is gone
    body = module_calls(model)["model.embed_tokens"].function
    ops = [n for n in body.node if n.op_type == "GatherBlockQuantized"]
    assert len(ops) == 1 and not any(n.op_type == "Gather" for n in body.node)
    attributes = {a.name: a.i for a in ops[0].attribute}
    assert attributes == {"bits": bits, "block_size": 32, "gather_axis": 0, "quantize_axis": 1}
    assert (len(ops[0].input) > 3) == (not symmetric)
    packed = 256 * 64 * bits // 8 + 256 * 2 * 4 + (0 if symmetric else 256 * max(1, 2 * bits // 8))
    assert model.ByteSize() < onnx.load(str(fused)).ByteSize() - 256 * 64 * 4 + packed + 4096
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    report = quality(path, fused, held)
    assert 0 < report.kl_mean < bound and report.top1 > 0.97, (report.kl_mean, report.top1)


def test_weighted_k_quant_lowers_the_weighted_error():
    """The importance-weighted search (llama.cpp's importance matrix) has less importance-weighted error than the
    unweighted one on a fixed tensor; unweighted, its integer-zero-point search has less error than onnxruntime's."""
    from onnxruntime.quantization.neural_compressor.weight_only import quant_tensor_k_quant_cpu

    from onnx_modular.passes.precision.kquant import block_error, weighted_k_quant

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((64, 192)).astype(np.float32)
    importance = np.broadcast_to(rng.gamma(0.5, size=192).astype(np.float32), weight.shape)
    ones = np.ones_like(weight)
    for block in (16, 32, 64):
        weighted = block_error(weight, importance, *weighted_k_quant(weight, importance, 4, block), block)
        plain = block_error(weight, importance, *weighted_k_quant(weight, ones, 4, block), block)
        assert weighted < 0.93 * plain, (block, weighted, plain)
        ours = block_error(weight, ones, *weighted_k_quant(weight, ones, 4, block), block)
        theirs = block_error(weight, ones, *quant_tensor_k_quant_cpu(weight.copy(), 4, block), block)
        assert ours < 0.97 * theirs, (block, ours, theirs)


def test_call_values_over_several_runs_are_each_runs_values(trained):
    """``call_values_runs`` (what ``--quantize auto`` captures each MatMul's input with, for the importance of its
    channels): one copy, one result per run, each equal to ``call_values`` on that run's feeds alone."""
    from onnx_modular.calls.capture import call_values, call_values_runs
    from onnx_modular.runtime.generation import prompt_feeds
    from onnx_modular.runtime.sessions import session

    _, _, fused, calibration, _ = trained
    ids = np.load(calibration)["input_ids"]
    model = onnx.load(str(fused))
    wanted = {"model.layers.1.mlp.down_proj": [0]}
    feeds = [prompt_feeds(session(str(fused)), row[None, :]) for row in ids]
    runs = list(call_values_runs(model, wanted, lambda sess: (prompt_feeds(sess, row[None, :]) for row in ids),
                                 external_data_folder=str(fused.parent)))
    assert len(runs) == len(ids)
    for run, feed in zip(runs, feeds):
        inputs, outputs = run["model.layers.1.mlp.down_proj"]
        alone_inputs, alone_outputs = call_values(model, fused, wanted, feed)["model.layers.1.mlp.down_proj"]
        assert inputs[0].shape[:2] == (1, ids.shape[1]) and inputs[0].shape[2] > 64  # the MLP's inner width
        np.testing.assert_array_equal(inputs[0], alone_inputs[0])
        np.testing.assert_array_equal(outputs[0], alone_outputs[0])
