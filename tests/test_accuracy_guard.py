"""``optimize --quantize int4``: the builder's int4 recipe in one command, and the per-module accuracy
guard of ``MatMulNBits``' int8 compute (``accuracy_level=4``, onnxruntime #29849)."""

from __future__ import annotations

import functools
import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnx_modular.errors import InvalidInputError

#: The MLP whose input gets massive activations, and the channels (one per block of 32 of its 128).
MASSIVE_LAYER = 1
MASSIVE_CHANNELS = [3, 40, 77, 100]


def _export(folder, massive: bool):
    """A tiny Llama (random weights); with ``massive``, four channels of one MLP's down_proj input
    are 1,000x the others (up_proj rows x1e3, down_proj columns /1e3: float32 output unchanged)."""
    import torch
    import transformers

    from onnx_modular.cli import main

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if massive:
        mlp = model.model.layers[MASSIVE_LAYER].mlp
        with torch.no_grad():
            mlp.up_proj.weight[MASSIVE_CHANNELS] *= 1000.0
            mlp.down_proj.weight[:, MASSIVE_CHANNELS] /= 1000.0
    model.save_pretrained(folder / "ckpt")
    exported = folder / "m.onnx"
    assert main(["export", str(folder / "ckpt"), "--task", "causal-lm-with-past", "-o", str(exported),
                 "--io-names", "optimum", "--no-verify"]) == 0
    return exported


def _greedy(path, steps: int = 8) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    past = [i.name for i in session.get_inputs() if i.name.startswith("past_key_values")]
    cache = {name: np.zeros((1, 2, 0, 16), np.float32) for name in past}
    step = np.random.default_rng(0).integers(0, 96, (1, 16))
    tokens = []
    for _ in range(steps):
        length = cache[past[0]].shape[2] + step.shape[1]
        outputs = dict(zip(names, session.run(None, {"input_ids": step, "attention_mask": np.ones((1, length), np.int64),
                                                     **cache})))
        cache = {name: outputs[name.replace("past_key_values", "present")] for name in past}
        step = outputs["logits"][:, -1:].argmax(-1)
        tokens.append(int(step[0, 0]))
    return np.array(tokens)


def _levels(path) -> dict[str, list[int]]:
    """Per function (and the main graph): the accuracy_level of each MatMulNBits (0 when absent)."""
    model = onnx.load(str(path))
    found = {}
    for body in [model.graph, *model.functions]:
        levels = [next((a.i for a in n.attribute if a.name == "accuracy_level"), 0) for n in body.node
                  if n.op_type == "MatMulNBits"]
        if levels:
            found[getattr(body, "name", "<main graph>")] = levels
    return found


def _with_level(path, output, level: int) -> None:
    """``path`` with every MatMulNBits at ``level``."""
    from onnx_modular.files.optimize.accuracy_guard import set_accuracy_level

    onnx.save(set_accuracy_level(onnx.load(str(path)), level), str(output))


def _decoder_calls(path) -> dict[str, int]:
    model = onnx.load(str(path))
    calls: dict[str, int] = {}
    for body in [model.graph, *model.functions]:
        for node in body.node:
            if node.op_type.startswith("LlamaDecoderLayer"):
                calls[node.op_type] = calls.get(node.op_type, 0) + 1
    return calls


def test_guard_keeps_the_massive_activation_call_at_level_0(tmp_path, capsys):
    from onnx_modular import optimize
    from onnx_modular.cli import main
    from onnx_modular.files.optimize.accuracy_guard import GUARD_KEY, guard_accuracy
    from onnx_modular.files.optimize.tool import _prompt_feeds

    exported = _export(tmp_path, massive=True)
    capsys.readouterr()
    guarded = tmp_path / "m.q4.onnx"
    assert main(["optimize", str(exported), "-o", str(guarded), "--max-positions", "128", "--quantize", "int4",
                 "--no-verify", "--json", "-"]) == 0  # the fusions' own check is test_fused_kernels.py's
    report = json.loads(capsys.readouterr().out)
    quantization = report["quantization"]
    assert quantization["recipe"] == {"quantize": "int4", "block_size": 32, "symmetric": True, "accuracy_level": 4,
                                      "int8_lm_head": False, "guard": True, "calibration": None, "max_size": None}
    assert quantization["lm_head"] == "int4"
    guard = quantization["guard"]
    assert guard["candidates"] == 11  # 2 x (packed q/k/v in the attention body, o_proj, gate, up, down) + lm_head
    assert guard["flipped_unguarded"] > 0 and guard["flipped_guarded"] == 0
    assert guard["kept"] == [f"model.layers.{MASSIVE_LAYER}.mlp.down_proj"]

    # the file: that call's MatMulNBits at level 0 in a body of its own, every other at level 4
    levels = _levels(guarded)
    assert sorted(sum(levels.values(), [])) == [0] + [4] * 5
    assert _decoder_calls(guarded) == {"LlamaDecoderLayer": 1, "LlamaDecoderLayer_2": 1}  # layer 1 specialized
    recorded = {p.key: p.value for p in onnx.load(str(guarded)).metadata_props}
    assert json.loads(recorded[GUARD_KEY])["kept"] == guard["kept"]

    # greedy tokens: unguarded level 4 flips them; guarded = the level-0 file's (the same int4 weights)
    unguarded, level0 = tmp_path / "m.q4.unguarded.onnx", tmp_path / "m.q4.level0.onnx"
    optimize(exported, unguarded, max_positions=128, verify=False, quantize="int4", accuracy_guard=False)
    assert sorted(sum(_levels(unguarded).values(), [])) == [4] * 5
    _with_level(unguarded, level0, 0)
    expected = _greedy(level0)
    assert not np.array_equal(_greedy(unguarded), expected)
    np.testing.assert_array_equal(_greedy(guarded), expected)

    # no more than max_kept calls kept: past that, the whole file goes to level 0
    proto = onnx.load(str(unguarded), load_external_data=False)
    whole = guard_accuracy(proto, tmp_path, functools.partial(_prompt_feeds, ir.load(unguarded)), max_kept=0)
    assert whole.whole_file and len(whole.kept) == 11 and whole.flipped_unguarded > 0
    levels = [next((a.i for a in n.attribute if a.name == "accuracy_level"), 0)
              for body in [proto.graph, *proto.functions] for n in body.node if n.op_type == "MatMulNBits"]
    assert levels == [0] * 5
    assert "every MatMulNBits at accuracy_level=0" in whole.text()


def test_normal_model_keeps_every_call_at_level_4_and_int8_lm_head(tmp_path):
    from onnx_modular import optimize

    exported = _export(tmp_path, massive=False)
    output = tmp_path / "m.q4.onnx"
    report = optimize(exported, output, max_positions=128, quantize="int4", int8_lm_head=True, verify=False)
    guard = report.quantization.guard
    assert guard.kept == [] and guard.flipped_unguarded == 0 and guard.trials == 2  # the file and the reference
    assert report.quantization.lm_head == "int8"
    assert "within limits (0 flips): all 11 calls stay at accuracy_level=4" in report.text()
    assert sorted(sum(_levels(output).values(), [])) == [4] * 5
    model = onnx.load(str(output))
    head = [n for f in model.functions for n in f.node if n.op_type == "MatMulNBits"
            and any(a.name == "bits" and a.i == 8 for a in n.attribute)]
    assert len(head) == 1  # lm_head's
    assert _decoder_calls(output) == {"LlamaDecoderLayer": 2}  # still one function, called once per layer


@pytest.mark.parametrize("options, message", [
    ({"int8_lm_head": True}, "needs quantize"),
    ({"quantize": "int3"}, "quantize must be one of"),
    ({"quantize": "int4", "accuracy_level": 7}, "accuracy_level must be 0 to 4"),
])
def test_recipe_refused_before_any_work(tmp_path, options, message):
    from onnx_modular import optimize

    with pytest.raises(InvalidInputError, match=message):
        optimize(tmp_path / "absent.onnx", tmp_path / "out.onnx", **options)
    assert not (tmp_path / "out.onnx").exists()


def test_guard_on_calibration_ids_decides_on_measured_quality(tmp_path, capsys):
    """With --calibration, the trials run the calibration rows as prompts and the guard judges the
    mean next-token KL and top-1 agreement against level 0; kept calls come with their measured decode cost."""
    from onnx_modular.cli import main
    from onnx_modular.files.optimize.accuracy_guard import KL_LIMIT, TOP1_LIMIT

    exported = _export(tmp_path, massive=True)
    calibration = tmp_path / "calib.npz"
    np.savez(calibration, input_ids=np.random.default_rng(5).integers(0, 96, (3, 24)))
    capsys.readouterr()
    guarded = tmp_path / "m.q4.onnx"
    assert main(["optimize", str(exported), "-o", str(guarded), "--max-positions", "128", "--quantize", "int4",
                 "--no-verify", "--calibration", str(calibration)]) == 0
    text = capsys.readouterr().out
    assert "of calibration ids compared" in text
    assert "kept at accuracy_level=0" in text and f"model.layers.{MASSIVE_LAYER}.mlp.down_proj" in text
    assert "decode cost:" in text  # the terminal says what the kept calls cost
    assert "Measured on the calibration ids" in text
    report = onnx.load(str(guarded), load_external_data=False)
    assert sorted(sum(_levels(guarded).values(), [])).count(0) >= 1
    del report
    # what decided: past the limits unguarded, within them guarded (the report's own measures)
    from onnx_modular import optimize

    result = optimize(exported, tmp_path / "again.onnx", max_positions=128, quantize="int4", verify=False,
                      calibration=calibration).quantization.guard
    assert result.kl_unguarded > KL_LIMIT or result.top1_unguarded < TOP1_LIMIT
    assert result.kl_guarded <= KL_LIMIT and result.top1_guarded >= TOP1_LIMIT
    assert result.decode_cost is not None and result.decode_cost > 0
