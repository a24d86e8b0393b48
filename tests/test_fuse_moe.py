"""``optimize``'s ``moe`` step on a tiny random-weight Mixtral (transformers 5's router and grouped
experts, exported with a cache): each layer's sparse block becomes one ``com.microsoft.MoE`` inside
the block's function, called from the layer's function; the report says fused with the call-by-call
drift; the fused file's logits match the unfused file's in onnxruntime and its greedy tokens are
``generate``'s on the unfused file. A body whose experts are not SiLU-gated, or whose routing weights
are not what ``normalize_routing_weights`` expresses, stays unfused with its reason. With
``--quantize int4`` each ``MoE`` becomes ``QMoE`` (experts packed inside the op, accuracy level 4).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnx_modular import generate
from onnx_modular.passes.fusions.moe import FuseMoEPass

LAYERS, EXPERTS, TOP_K, HIDDEN = 2, 4, 2, 64
#: The fused block against the unfused one, per call (the verified runs) and on the file's logits.
ATOL = 1e-5


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """(unfused file, fused file, optimize's JSON report)."""
    import torch
    import transformers

    from onnx_modular.cli import main

    folder = tmp_path_factory.mktemp("mixtral")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=96, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder / "ckpt")
    exported, optimized = folder / "m.onnx", folder / "m.opt.onnx"
    assert main(["export", str(folder / "ckpt"), "--task", "causal-lm-with-past", "-o", str(exported),
                 "--io-names", "optimum", "--no-verify"]) == 0
    report = _optimize(exported, optimized)
    return exported, optimized, report


def _optimize(source, target, *extra) -> dict:
    import contextlib
    import io

    from onnx_modular.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["optimize", str(source), "-o", str(target), "--max-positions", "128", "--json", "-", *extra]) == 0
    return json.loads(out.getvalue())


def _calls(model: onnx.ModelProto, name: str) -> list[str]:
    """The function names ``name``'s body calls, recursively (itself included)."""
    functions = {f.name: f for f in model.functions}
    found, stack = [], [name]
    while stack:
        current = stack.pop()
        found.append(current)
        stack += [n.op_type for n in functions[current].node if n.op_type in functions and n.domain != "com.microsoft"]
    return found


def _ops(model: onnx.ModelProto, function: str, op: str) -> list[onnx.NodeProto]:
    functions = {f.name: f for f in model.functions}
    return [n for name in _calls(model, function) for n in functions[name].node if n.op_type == op and n.domain == "com.microsoft"]


def test_each_layer_runs_its_experts_as_one_moe_op_inside_its_function(mixtral):
    _, optimized, report = mixtral
    moe = [f for f in report["fusions"] if f["step"] == "moe"]
    assert len(moe) == LAYERS and all(f["fused"] and f["op"] == "com.microsoft.MoE" for f in moe)
    assert all(f["module_class"] == "MixtralSparseMoeBlock" and f["max_abs_diff"] < ATOL and f["calls"] >= 2 for f in moe)
    assert report["attention"] == "GroupQueryAttention"  # the routers' Softmax is no attention left unfused

    written = onnx.load(str(optimized), load_external_data=False)
    layers = [f.name for f in written.functions if f.name.startswith("MixtralDecoderLayer")]
    assert len(layers) == LAYERS
    for layer in layers:
        ops = _ops(written, layer, "MoE")
        assert len(ops) == 1  # the router and the experts: one op, in a function the layer calls
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in ops[0].attribute}
        assert attributes == {"k": TOP_K, "normalize_routing_weights": 1, "activation_type": b"swiglu", "swiglu_fusion": 1,
                              "activation_alpha": 1.0, "activation_beta": 0.0, "use_sparse_mixer": 0}
        assert ops[0].input[0] == ops[0].input[0] and ops[0].input[3] == ""  # no expert biases
    names = {f.name for f in written.functions}
    assert not any("Experts" in n or "TopKRouter" in n or "SiLU" in n for n in names)  # the calls went with their bodies
    weights = {t.name: tuple(t.dims) for t in written.graph.initializer}
    fc1 = [d for n, d in weights.items() if n.endswith("fc1_experts_weights")]
    fc2 = [d for n, d in weights.items() if n.endswith("fc2_experts_weights")]
    assert fc1 == [(EXPERTS, 2 * 64, HIDDEN)] * LAYERS and fc2 == [(EXPERTS, HIDDEN, 64)] * LAYERS
    assert not any("folded" in n for n in weights)  # the per-expert weights are gone


def test_the_fused_file_computes_and_decodes_as_the_unfused_one(mixtral):
    exported, optimized, _ = mixtral
    np.testing.assert_allclose(_logits(optimized), _logits(exported), atol=ATOL, rtol=0)
    prompt = np.array([[5, 17, 33, 2, 61, 8]])
    np.testing.assert_array_equal(generate(optimized, prompt, 12), generate(exported, prompt, 12))


def _refused(path, edit) -> dict:
    model = ir.load(path)
    ir.external_data.load_to_model(model)
    edit(model)
    fusion = FuseMoEPass()
    fusion(model)
    assert not fusion.fused
    return {key[1]: reason for key, reason in fusion.reasons.items()}


def test_experts_with_another_activation_stay_unfused_with_the_reason(mixtral, tmp_path):
    exported, _, _ = mixtral

    def tanh_gate(model):  # SiLU's sigmoid made a tanh: x * tanh(x) is no swiglu
        silu = next(f for f in model.functions.values() if f.name == "SiLUActivation")
        next(n for n in silu if n.op_type == "Sigmoid").op_type = "Tanh"

    reasons = _refused(exported, tanh_gate)
    assert set(reasons) == {"MixtralSparseMoeBlock", "MixtralSparseMoeBlock_2"}
    assert all("not SiLU(gate) * up" in r for r in reasons.values())

    from onnx_modular.files.optimize.tool import optimize

    model = ir.load(exported)  # the same, through optimize: the report says why
    ir.external_data.load_to_model(model)
    tanh_gate(model)
    ir.save(model, tmp_path / "tanh.onnx")
    report = optimize(tmp_path / "tanh.onnx", tmp_path / "tanh.opt.onnx", steps=("moe",))
    refused = [f for f in report.fusions if f.step == "moe"]
    assert len(refused) == LAYERS and not any(f.fused for f in refused)
    assert all("not SiLU(gate) * up" in f.reason for f in refused)
    written = onnx.load(str(tmp_path / "tanh.opt.onnx"), load_external_data=False)
    assert not any(n.op_type == "MoE" for f in written.functions for n in f.node)


def test_routing_weights_the_op_cannot_express_stay_unfused(mixtral):
    exported, _, _ = mixtral

    def scaled(model):  # top-k probabilities times their sum: neither normalized nor as they are
        for function in model.functions.values():
            for node in function:
                if node.op_type == "Div" and any(n.op_type == "TopK" for n in function):
                    node.op_type = "Mul"

    reasons = _refused(exported, scaled)
    assert reasons and all("routing weights" in r for r in reasons.values())

    def unsorted_experts(model):  # experts 0 and 1 swapped in the gate/up projections: not in expert order
        for function in model.functions.values():
            concat = next((n for n in function if n.op_type == "Concat" and len(n.inputs) == EXPERTS  # gate/up: the first
                           and all(v.producer() is not None and v.producer().op_type == "MatMul" for v in n.inputs)), None)
            if concat is not None:
                first, second = concat.inputs[0], concat.inputs[1]
                concat.replace_input_with(0, second)
                concat.replace_input_with(1, first)

    reasons = _refused(exported, unsorted_experts)
    assert reasons and all("out of order" in r or "do not start" in r for r in reasons.values())


def _logits(path) -> np.ndarray:
    rng = np.random.default_rng(3)
    feeds = {"input_ids": rng.integers(0, 96, (1, 7)), "attention_mask": np.ones((1, 7), np.int64)}
    for index in range(LAYERS):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{index}.{kind}"] = np.zeros((1, 2, 0, 16), np.float32)
    return ort.InferenceSession(str(path)).run(None, feeds)[0]


@pytest.mark.slow
@pytest.mark.parametrize(("quantize", "bits", "error"), [("int4", 4, 0.25), ("int8", 8, 0.03)])
def test_quantize_packs_the_experts_inside_qmoe(mixtral, tmp_path, quantize, bits, error):
    """The experts' weights quantized inside ``QMoE``; the logits within ``error`` (relative, measured 0.13
    in int4 and 0.011 in int8 on this random model) of the fused float file's: a wrong layout would be ~1."""
    exported, optimized, _ = mixtral
    target = tmp_path / f"m.{quantize}.onnx"
    report = _optimize(exported, target, "--quantize", quantize)
    written = onnx.load(str(target), load_external_data=False)
    for layer in [f.name for f in written.functions if f.name.startswith("MixtralDecoderLayer")]:
        ops = _ops(written, layer, "QMoE")
        assert len(ops) == 1 and not _ops(written, layer, "MoE")
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in ops[0].attribute}
        assert attributes["expert_weight_bits"] == bits and attributes["block_size"] == 32
        assert attributes["weights_prepacked"] == 0 and attributes["k"] == TOP_K and attributes["accuracy_level"] == 4
    assert report["quantization"]["qmoe"] == LAYERS
    assert any("router" in why for _, _, why in report["quantization"]["skipped"])  # the router's Gemm stays float
    expected, got = _logits(optimized), _logits(target)
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < error
    assert generate(target, np.array([[5, 17, 33, 2, 61, 8]]), 6).shape == (1, 12)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "block", "normalize"), [
    ("qwen2_moe", "Qwen2MoeSparseMoeBlock", 0),  # its shared expert stays a call beside the op
    ("qwen3_moe", "Qwen3MoeSparseMoeBlock", 0),
    ("olmoe", "OlmoeSparseMoeBlock", 0),
    ("granitemoe", "GraniteMoeMoE", 1),  # top-k of the logits, then a softmax: normalized probabilities
    ("phimoe", "PhimoeSparseMoeBlock", None),  # a sparse mixer (ArgMax): refused
    ("gpt_oss", "GptOssMLP", 1),  # biases, gate/up alternating, a clamped swiglu (alpha 1.702, up + 1, limit 7)
])
def test_other_mixtures_of_experts_as_transformers_writes_them(kind, block, normalize, tmp_path):
    import torch
    import transformers

    from onnx_modular.cli import main
    from onnx_modular.files.optimize.tool import optimize

    torch.manual_seed(0)
    small = {"vocab_size": 96, "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": LAYERS,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "num_experts_per_tok": TOP_K}
    experts = {"num_local_experts": EXPERTS} if kind in ("granitemoe", "phimoe", "gpt_oss") else {"num_experts": EXPERTS}
    extra = {"moe_intermediate_size": 32} if kind.startswith("qwen") else {}
    if kind == "gpt_oss":  # full attention in every layer (a sliding cache is another export's)
        extra = {"head_dim": 16, "layer_types": ["full_attention"] * LAYERS}
    config = transformers.AutoConfig.for_model(kind, **small, **experts, **extra)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(tmp_path / "ckpt")
    exported, optimized = tmp_path / "m.onnx", tmp_path / "m.opt.onnx"
    assert main(["export", str(tmp_path / "ckpt"), "--task", "causal-lm-with-past", "-o", str(exported),
                 "--io-names", "optimum", "--no-verify"]) == 0
    report = optimize(exported, optimized, max_positions=128)
    moe = [f for f in report.fusions if f.step == "moe"]
    assert len(moe) == LAYERS and {f.module_class for f in moe} == {block}
    written = onnx.load(str(optimized), load_external_data=False)
    ops = [n for f in written.functions for n in f.node if n.op_type == "MoE"]
    if normalize is None:
        assert not ops and all("ArgMax" in f.reason for f in moe)
    else:
        assert all(f.fused and f.max_abs_diff < ATOL for f in moe) and len(ops) == LAYERS
        assert {onnx.helper.get_attribute_value(a) for n in ops for a in n.attribute
                if a.name == "normalize_routing_weights"} == {normalize}
    if kind == "gpt_oss":
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in ops[0].attribute}
        assert attributes["swiglu_limit"] == 7.0 and attributes["activation_beta"] == 1.0
        assert abs(attributes["activation_alpha"] - 1.702) < 1e-6 and ops[0].input[3] and ops[0].input[5]  # biases
    else:  # (GPT-OSS's attention sinks drift in GroupQueryAttention: not this step's)
        assert report.attention == "GroupQueryAttention"  # a router's softmax is no attention refused
    prompt = np.array([[5, 17, 33, 2, 61, 8]])
    np.testing.assert_array_equal(generate(optimized, prompt, 10), generate(exported, prompt, 10))
