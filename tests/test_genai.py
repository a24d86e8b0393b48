"""``onnx-modular export CKPT --genai -o DIR``: a folder onnxruntime-genai loads and generates from,
its greedy tokens equal to transformers' ``generate``; ``onnx-modular genai M.onnx`` for a file
already exported; ``genai_config.json`` from a file's inputs and outputs (torch-free, from ONNX
text); refusals of what genai cannot drive, before any work. Tiny random-weight checkpoints with
a byte-level BPE tokenizer trained offline (genai's tokenizer reads ``tokenizer.json``)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx.parser
import pytest
import torch

transformers = pytest.importorskip("transformers")
og = pytest.importorskip("onnxruntime_genai")

from onnx_modular.cli import main  # noqa: E402
from onnx_modular.files.genai_config import GenaiError, decoder_io, genai_config, genai_type  # noqa: E402

STEPS = 20
PROMPT = "the quick brown fox"
SIZES = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def _tokenizer(folder) -> None:
    """A byte-level BPE of 300 tokens (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2), trained here, saved as
    transformers saves a tokenizer (``tokenizer.json``, ``tokenizer_config.json``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog", "onnxruntime genai runs it"] * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(folder)


def _checkpoint(folder, config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    _tokenizer(folder)
    return folder


def _genai_tokens(folder) -> tuple[list[int], list[int]]:
    """(prompt ids, genai's greedy sequence), the prompt encoded by genai's own tokenizer."""
    model = og.Model(str(folder))
    tokenizer = og.Tokenizer(model)
    prompt = [int(t) for t in tokenizer.encode(PROMPT)]
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + STEPS)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return prompt, [int(t) for t in generator.get_sequence(0)]


def _generate(checkpoint, prompt: list[int]) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=STEPS)[0].tolist()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    checkpoint = _checkpoint(root / "ckpt", transformers.LlamaConfig(**SIZES))
    out = root / "genai"
    assert main(["export", str(checkpoint), "--genai", "-o", str(out)]) == 0
    return checkpoint, out


def _assert_generates_as_transformers(checkpoint, out, capsys=None):
    prompt, tokens = _genai_tokens(out)
    expected = _generate(checkpoint, prompt)
    assert len(expected) > len(prompt) + 5  # the comparison covers real decoding steps
    assert tokens == expected


def test_llama_folder_generates_as_transformers(llama, capsys):
    checkpoint, out = llama
    assert sorted(p.name for p in out.iterdir()) == [
        "genai_config.json", "generation_config.json", "model.onnx", "tokenizer.json", "tokenizer_config.json"
    ]
    config = json.loads((out / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    assert config["model"]["type"] == "llama"
    assert (config["model"]["eos_token_id"], config["model"]["bos_token_id"], config["model"]["pad_token_id"]) == (2, 1, 0)
    assert (config["model"]["vocab_size"], config["model"]["context_length"]) == (300, 128)
    assert (decoder["num_hidden_layers"], decoder["num_attention_heads"], decoder["num_key_value_heads"]) == (3, 4, 2)
    assert (decoder["head_size"], decoder["hidden_size"], decoder["filename"]) == (16, 64, "model.onnx")
    assert decoder["inputs"] == {
        "input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
        "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value",
    }
    assert config["search"]["past_present_share_buffer"] is False and config["search"]["do_sample"] is False
    # The file stays modular: the three decoder layers share one function, called three times.
    saved = onnx.load(str(out / "model.onnx"), load_external_data=False)
    layers = [f for f in saved.functions if f.name.startswith("LlamaDecoderLayer")]
    assert len(layers) == 1 and [v.name for v in saved.graph.output][:2] == ["logits", "present.0.key"]
    # The Done-when of issue 48: genai loads the folder, its greedy tokens are generate's for 20 steps.
    _assert_generates_as_transformers(checkpoint, out)


def test_the_export_reports_the_generation_check(tmp_path, llama, capsys):
    """The check made at export time is in the report (--json: ``genai_check``); ``genai M.onnx``
    makes the same folder from the exported file."""
    checkpoint, out = llama
    again = tmp_path / "again"
    assert main(["genai", str(out / "model.onnx"), "--checkpoint", str(checkpoint), "-o", str(again), "--json", "-"]) == 0
    summary = json.loads(capsys.readouterr().out)
    check = summary["genai_check"]
    assert check["ok"] is True and check["equal"] == len(check["transformers"]) - len(check["prompt"]) > 5
    assert check["genai"] == check["transformers"]
    assert summary["genai_config"] == json.loads((out / "genai_config.json").read_text())
    assert (again / "model.onnx").read_bytes() == (out / "model.onnx").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (checkpoint / "tokenizer.json").read_bytes()


def test_the_optimized_folder_shares_the_cache_buffers_and_generates_as_transformers(tmp_path, llama, capsys):
    """``genai M.onnx --optimize``: the folder carries the fused file (GroupQueryAttention inside
    the attention body, the decoder layer still one function), genai shares the past and present
    buffers, and its greedy tokens are still ``generate``'s."""
    checkpoint, out = llama
    fused = tmp_path / "fused"
    assert main(["genai", str(out / "model.onnx"), "--checkpoint", str(checkpoint), "-o", str(fused), "--optimize",
                 "--json", "-"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["optimized"]["attention"] == "GroupQueryAttention"
    config = json.loads((fused / "genai_config.json").read_text())
    assert config["search"]["past_present_share_buffer"] is True
    saved = onnx.load(str(fused / "model.onnx"), load_external_data=False)
    layers = [f for f in saved.functions if f.name.startswith("LlamaDecoderLayer")]
    attention = [f for f in saved.functions if f.name.startswith("LlamaAttention")]
    assert len(layers) == 1 and len(attention) == 1
    assert [n.op_type for n in attention[0].node if n.domain == "com.microsoft"] == ["GroupQueryAttention"]
    _assert_generates_as_transformers(checkpoint, fused)


def test_olmo3_the_builder_refuses_generates_as_transformers(tmp_path, capsys):
    """Olmo3 (no builder class in onnxruntime-genai; sliding-window layers of 8 beside full ones):
    the window is masked in the graph over a whole cache, so genai drives it as a plain decoder."""
    config = transformers.Olmo3Config(**SIZES, sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    checkpoint = _checkpoint(tmp_path / "ckpt", config)
    out = tmp_path / "genai"
    assert main(["export", str(checkpoint), "--genai", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Generation: onnxruntime-genai (model.type 'llama')" in printed and "20 of 20 new tokens equal" in printed
    genai_config_ = json.loads((out / "genai_config.json").read_text())
    assert genai_config_["model"]["type"] == "llama" and "sliding_window" not in genai_config_["model"]["decoder"]
    saved = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert not [v.name for v in saved.graph.input if "sliding" in v.name]
    _assert_generates_as_transformers(checkpoint, out)


def test_what_genai_cannot_drive_is_refused_before_any_work(tmp_path, llama, capsys):
    checkpoint, out = llama
    # Convolution layers (LFM2): genai feeds such states only to its builder's own graphs.
    lfm2 = tmp_path / "lfm2"
    transformers.Lfm2Config(num_hidden_layers=2, full_attn_idxs=[1], architectures=["Lfm2ForCausalLM"]).save_pretrained(lfm2)
    assert main(["export", str(lfm2), "--genai", "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "conv layers" in err and "keys and values only" in err and "  load" not in err
    assert not (tmp_path / "o").exists()
    # Options that do not combine with a genai folder.
    for extra in (["--generation"], ["--static"], ["--task", "causal-lm"]):
        assert main(["export", str(checkpoint), "--genai", "-o", str(tmp_path / "o"), *extra]) == 2
        assert "--genai" in capsys.readouterr().err
    assert main(["export", str(checkpoint), "--genai", "-o", str(tmp_path / "m.onnx")]) == 2
    assert "must be a folder" in capsys.readouterr().err
    # A file with transformers' cache names: genai would not know what to feed.
    with pytest.raises(GenaiError, match="cannot feed"):
        decoder_io(_decoder_text(names=("input.past_key_values.layers.{i}.{kinds}", "output.past_key_values.layers.{i}.{kinds}")))
    assert not (tmp_path / "o").exists()


def _decoder_text(layers=2, head_sizes=(8, 8), gqa=False, value_sizes=None, names=("past_key_values.{i}.{kind}", "present.{i}.{kind}")) -> onnx.ModelProto:
    """A stand-in decoder: the inputs and outputs genai reads (a body that is never run), and with
    ``gqa`` a local function running ``com.microsoft.GroupQueryAttention``."""
    from onnx import TensorProto, helper

    def tensor(name, elem, dims):
        return helper.make_tensor_value_info(name, elem, dims)

    ins = [tensor("input_ids", TensorProto.INT64, ["b", "s"]), tensor("attention_mask", TensorProto.INT64, ["b", "t"])]
    outs = [tensor("logits", TensorProto.FLOAT, ["b", "s", 32])]
    for i in range(layers):
        for kind, kinds in (("key", "keys"), ("value", "values")):
            size = (value_sizes or head_sizes)[i] if kind == "value" else head_sizes[i]
            ins.append(tensor(names[0].format(i=i, kind=kind, kinds=kinds), TensorProto.FLOAT, ["b", 2, "p", size]))
            outs.append(tensor(names[1].format(i=i, kind=kind, kinds=kinds), TensorProto.FLOAT, ["b", 2, "t", size]))
    nodes = [helper.make_node("Cast", ["input_ids"], ["logits"], to=TensorProto.FLOAT)]
    functions = []
    if gqa:
        attention = helper.make_node("GroupQueryAttention", ["q", "k", "v"], ["o"], domain="com.microsoft")
        functions.append(helper.make_function("local", "Attn", ["q", "k", "v"], ["o"], [attention],
                                              [helper.make_opsetid("com.microsoft", 1)]))
    graph = helper.make_graph(nodes, "main", ins, outs)
    return helper.make_model(graph, functions=functions, opset_imports=[helper.make_opsetid("", 18)])


def test_genai_config_from_the_file_torch_free():
    """The config describes the file: cache geometry from its inputs, the share-buffer flag from the
    attention op in its functions (GroupQueryAttention: what `optimize` writes), search defaults
    from generation_config.json, the runtime's own type or the generic one."""
    hf = {"model_type": "olmo3", "hidden_size": 16, "num_attention_heads": 4, "max_position_embeddings": 64, "eos_token_id": 5}
    config = genai_config(_decoder_text(), hf, {"eos_token_id": [5, 6], "temperature": 0.7, "do_sample": True, "top_k": 20})
    model, decoder = config["model"], config["model"]["decoder"]
    assert (decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]) == (2, 2, 8)
    assert model["type"] == "llama" and model["vocab_size"] == 32 and model["eos_token_id"] == [5, 6] and model["pad_token_id"] == 5
    assert "position_ids" not in decoder["inputs"]  # the file does not take them: genai feeds none
    assert config["search"]["temperature"] == 0.7 and config["search"]["do_sample"] is True and config["search"]["top_k"] == 20
    assert config["search"]["past_present_share_buffer"] is False and config["search"]["max_length"] == 64
    fused = genai_config(_decoder_text(gqa=True), hf, intra_op_threads=1)
    assert fused["search"]["past_present_share_buffer"] is True
    assert fused["model"]["decoder"]["session_options"]["intra_op_num_threads"] == 1
    assert genai_config(_decoder_text(), hf, share_buffer=True)["search"]["past_present_share_buffer"] is True
    assert genai_type("qwen2") == "qwen2" and genai_type("gemma3_text") == "gemma3_text" and genai_type("olmo3") == "llama"
    # Layers of different head sizes: genai reads each layer's from the file, unless the buffer is shared.
    mixed = genai_config(_decoder_text(head_sizes=(8, 16)), hf)["model"]["decoder"]
    assert (mixed["head_size"], mixed["num_hidden_layers"]) == (8, 2)
    with pytest.raises(GenaiError, match="shared past/present buffer"):
        genai_config(_decoder_text(head_sizes=(8, 16), gqa=True), hf)
    with pytest.raises(GenaiError, match="one head size"):  # keys 8 wide, values 16 (latent attention)
        decoder_io(_decoder_text(head_sizes=(8, 8), value_sizes=(16, 16)))
    with pytest.raises(GenaiError, match="eos_token_id"):
        genai_config(_decoder_text(), {"model_type": "llama"})


SLOW_CONFIGS = {
    "qwen2": lambda: transformers.Qwen2Config(**SIZES),
    "phi3": lambda: transformers.Phi3Config(**SIZES),
    "gemma2": lambda: transformers.Gemma2Config(**SIZES, head_dim=16, sliding_window=8),
    "gemma3": lambda: transformers.Gemma3TextConfig(**SIZES, head_dim=16, sliding_window=8),
    # the builder has no class for these (it dispatches on config.architectures[0])
    "olmo2": lambda: transformers.Olmo2Config(**SIZES),
    "starcoder2": lambda: transformers.Starcoder2Config(**SIZES),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW_CONFIGS))
def test_more_decoders_generate_as_transformers(tmp_path, name, capsys):
    checkpoint = _checkpoint(tmp_path / "ckpt", SLOW_CONFIGS[name]())
    out = tmp_path / "genai"
    assert main(["export", str(checkpoint), "--genai", "-o", str(out)]) == 0
    assert "20 of 20 new tokens equal" in capsys.readouterr().out
    _assert_generates_as_transformers(checkpoint, out)


def test_different_tokens_write_nothing_unless_kept(tmp_path, llama, capsys):
    """The file checked against another checkpoint's weights: genai's tokens differ from
    ``generate``'s, so the folder is not written (exit 1), or written with --keep-on-mismatch (exit 1)."""
    checkpoint, out = llama
    other = tmp_path / "other"
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES)).eval().save_pretrained(other)
    assert main(["genai", str(out / "model.onnx"), "--checkpoint", str(other), "-o", str(tmp_path / "o")]) == 1
    assert "differ from transformers' generate" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert main(["genai", str(out / "model.onnx"), "--checkpoint", str(other), "-o", str(tmp_path / "o"), "--keep-on-mismatch"]) == 1
    assert (tmp_path / "o" / "genai_config.json").is_file() and (tmp_path / "o" / "model.onnx").is_file()
