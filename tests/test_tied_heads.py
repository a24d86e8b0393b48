"""``optimize --quantize int4`` on a decoder with tied embeddings (Granite): the LM head is int4 like
every projection, and the embedding reads the same packed table (``GatherBlockQuantized``), so the
table is stored once, in 4 bits. Greedy tokens of the int4 file (``--accuracy-level 0``: float
compute on the int4 weights) equal transformers' ``generate`` on the same model with every
quantized weight replaced by its int4 values unpacked from the file."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import pytest

from onnx_modular import generate

VOCAB, HIDDEN, KV_HEADS, HEAD = 256, 64, 2, 16  # vocab x hidden above the fold's 8192: the head keeps its Transpose


def _unpack(packed: np.ndarray, scales: np.ndarray, k: int) -> np.ndarray:
    """``MatMulNBits``' symmetric int4 ``[N, blocks, 16]`` + ``[N, blocks]`` -> ``[N, K]`` (torch's Linear layout)."""
    n, blocks, _ = packed.shape
    nibbles = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, blocks, -1).astype(np.float32)
    return ((nibbles - 8) * scales[:, :, None]).reshape(n, -1)[:, :k]


def _int4_state(path) -> dict[str, np.ndarray]:
    """Every packed weight of the file, unpacked, by the torch parameter it came from."""
    model = onnx.load(str(path))
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    state = {}
    for name, packed in arrays.items():
        if not name.endswith("_Q4"):
            continue
        base = name[: -len("_Q4")]
        weight = _unpack(packed, arrays[base + "_scales"], HIDDEN if "down_proj" not in base else packed.shape[1] * 32)
        parameter = base.removesuffix(".T")
        if "qkv_proj" in parameter:  # packed once per layer: [q | k | v] rows
            q = weight.shape[0] - 2 * KV_HEADS * HEAD
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), np.split(weight, [q, q + KV_HEADS * HEAD])):
                state[parameter.replace("qkv_proj", part)] = rows
        else:
            state[parameter] = weight
    return state


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    import torch
    import transformers

    from onnx_modular.cli import main

    folder = tmp_path_factory.mktemp("tied")
    torch.manual_seed(0)
    config = transformers.GraniteConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                                        tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder / "ckpt")
    exported = folder / "m.onnx"
    assert main(["export", str(folder / "ckpt"), "--task", "causal-lm-with-past", "-o", str(exported), "--io-names", "optimum",
                 "--no-verify"]) == 0
    return model, exported, folder


def test_the_tied_head_is_int4_and_the_embedding_reads_its_table(granite, capsys):
    import torch

    from onnx_modular import optimize

    model, exported, folder = granite
    path = folder / "m.q4.onnx"
    report = optimize(exported, path, quantize="int4", accuracy_level=0, max_positions=128)
    assert report.quantization.lm_head == "int4" and report.quantization.tied_embedding
    assert "tied: the embedding reads its table, GatherBlockQuantized" in report.text()

    written = onnx.load(str(path), load_external_data=False)
    bodies = {f.name: f for f in written.functions}
    embedding = bodies["Embedding"]
    gather = [n for n in embedding.node if n.op_type == "GatherBlockQuantized"]
    assert len(gather) == 1 and gather[0].domain == "com.microsoft"
    assert {a.name: a.i for a in gather[0].attribute} == {"bits": 4, "block_size": 32, "gather_axis": 0, "quantize_axis": 1}
    head_call = next(n for n in written.graph.node if n.input[-2:] == ["lm_head.weight_Q4", "lm_head.weight_scales"])
    assert [n.op_type for n in bodies[head_call.op_type].node] == ["MatMulNBits"]
    model_call = next(n for n in written.graph.node if n.op_type == "GraniteModel")
    formals = [bodies["GraniteModel"].input[list(model_call.input).index(name)]
               for name in ("lm_head.weight_Q4", "lm_head.weight_scales")]
    embed_call = next(n for n in bodies["GraniteModel"].node if n.op_type == "Embedding")
    assert list(embed_call.input[1:]) == formals  # the head's packed table and scales, passed down
    tables = [t.name for t in written.graph.initializer if list(t.dims) in ([VOCAB, HIDDEN], [HIDDEN, VOCAB])]
    assert tables == []  # no float table left: stored once, in 4 bits

    with torch.no_grad():  # transformers' model on the int4 weights the file holds
        state = {k: torch.from_numpy(v) for k, v in _int4_state(path).items()}
        state["model.embed_tokens.weight"] = state.pop("lm_head.weight")  # tied: one tensor
        assert model.load_state_dict(state, strict=False).unexpected_keys == []
        assert model.lm_head.weight is model.model.embed_tokens.weight
        prompt = np.array([[5, 17, 33, 2, 200, 91]])
        expected = model.generate(torch.tensor(prompt), do_sample=False, max_new_tokens=8, min_new_tokens=8,
                                  eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(generate(path, prompt, 8), expected.numpy())
