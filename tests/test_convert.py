"""``convert`` (onnx_modular.files.convert.tool) on a real 2-layer Llama with its LM head.

One export per module (random weights, hidden 64). Structure (functions, dtypes of weights and
bodies, MatMulNBits inside bodies, metadata) and numerics (onnxruntime, the converted file against
the float32 file, and against onnxruntime's own quantizer on the flat copy) are checked.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np
import onnx
import onnx.helper
import pytest

from onnx_modular import export_modular
from onnx_modular.calls.flat import inline_model
from onnx_modular.cli import main
from onnx_modular.errors import InvalidInputError, InvalidModelFileError
from onnx_modular.files.convert.tool import convert
from onnx_modular.format import metadata
from onnx_modular.runtime import sessions as runtime
from onnx_modular.runtime.inputs import random_inputs

FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
NORM_WEIGHTS = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("llama") / "llama.onnx"
    export_modular(model, (torch.randint(0, 128, (1, 8)),), path)
    return path


@pytest.fixture(scope="module")
def feeds(llama):
    return random_inputs(onnx.load(str(llama)), seed=0)


@pytest.fixture(scope="module")
def half(llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("half") / "half.onnx"
    return convert(llama, out, dtype="float16", keep=["LlamaRMSNorm"]), out


def _functions(model: onnx.ModelProto, cls: str) -> list[onnx.FunctionProto]:
    return [f for f in model.functions if metadata.props(f).get(metadata.CLASS, "").endswith("." + cls)]


def _logits(path: pathlib.Path, feeds) -> np.ndarray:
    names, values = runtime.run(str(path), feeds, what="model")
    return values[names.index("logits")]


def test_float16_keeps_norms_and_one_decoder_layer(llama, half, feeds):
    report, out = half
    model = onnx.load(str(out))
    original = onnx.load(str(llama))
    # the hierarchy and dedupe survive: one shared decoder-layer body, one norm body, same call tree
    assert len(_functions(model, "LlamaDecoderLayer")) == 1
    assert len(_functions(model, "LlamaRMSNorm")) == 1
    assert len(model.functions) == len(original.functions)
    assert [f.name for f in model.functions] == [f.name for f in original.functions]
    assert metadata.module_paths(_functions(model, "LlamaDecoderLayer")[0]) == ["model.layers.0", "model.layers.1"]
    # norm weights float32, every other weight float16
    kinds = {t.name: t.data_type for t in model.graph.initializer}
    norms = [n for n in kinds if n.endswith(NORM_WEIGHTS)]
    assert len(norms) == 5 and all(kinds[n] == FLOAT for n in norms)
    matmul_weights = [n for n in kinds if n.endswith(".weight.T")] + ["model.embed_tokens.weight"]
    assert len(matmul_weights) == 16 and all(kinds[n] == FLOAT16 for n in matmul_weights)
    # graph inputs and outputs keep their types
    assert [(v.name, v.type.tensor_type.elem_type) for v in model.graph.input] == [
        (v.name, v.type.tensor_type.elem_type) for v in original.graph.input
    ]
    assert [(v.name, v.type.tensor_type.elem_type) for v in model.graph.output] == [
        (v.name, v.type.tensor_type.elem_type) for v in original.graph.output
    ]
    # the kept norm body computes in float32; the attention body casts nothing to float32
    norm = _functions(model, "LlamaRMSNorm")[0]
    assert not [n for n in norm.node if n.op_type == "Cast"]
    attention = _functions(model, "LlamaAttention")[0]
    assert not [n for n in attention.node if n.op_type == "Cast" and n.attribute[0].i == FLOAT]
    # Casts only where a converted module meets a kept one (norms: in and out), and at the outputs
    layer = _functions(model, "LlamaDecoderLayer")[0]
    assert sum(n.op_type == "Cast" for n in layer.node) == 4
    assert report.casts == sum(n.op_type == "Cast" and n.name.startswith("convert_cast_") for f in [model.graph, *model.functions] for n in f.node)
    assert json.loads(metadata.props(model)[metadata.CONVERTED])["dtype"] == "float16"
    # logits within 2% of the float32 file's range, measured again here
    expected, actual = _logits(llama, feeds), _logits(out, feeds)
    assert actual.dtype == np.float32
    assert np.abs(actual - expected).max() <= 0.02 * (expected.max() - expected.min())
    assert report.outputs["logits"][1] <= 0.02


def test_float16_report_per_call_and_class(half):
    report, _ = half
    calls = {c.call_name: c for c in report.calls}
    assert len(calls) == 31  # every module call of the file
    assert not calls["model.norm"].converted and calls["model.layers.0.self_attn"].converted
    assert calls["lm_head"].module_class == "Linear"
    assert {c.module_class for c in report.classes} >= {"LlamaRMSNorm", "LlamaAttention", "Linear", "Embedding"}
    assert report.classes == sorted(report.classes, key=lambda c: -c.drift)
    assert all(0 < c.drift < 0.02 for c in report.calls if c.converted)
    assert len(report.kept) == 5 and all("layernorm" in k or k == "model.norm" for k in report.kept)
    text = str(report)
    assert "model.layers.1.post_attention_layernorm" in text and "Per class" in text


def test_int4_matches_onnxruntime_quantizer_on_flat_copy(llama, feeds, tmp_path):
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    out = tmp_path / "q4.onnx"
    report = convert(llama, out, quantize="int4", exclude=["lm_head"], block_size=32)
    model = onnx.load(str(out))
    # MatMulNBits inside the bodies (7 per layer), none in the main graph; lm_head got its own MatMul body
    assert not [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    nbits = [n for f in model.functions for n in f.node if n.op_type == "MatMulNBits"]
    assert {n.domain for n in nbits} == {"com.microsoft"}
    assert len(report.quantized) == len(nbits) == 4  # one per Linear body: Linear, Linear_2, Linear_3, Linear_4
    assert report.split == ["lm_head"]
    head = next(n for n in model.graph.node if n.name == "lm_head")
    head_body = next(f for f in model.functions if f.name == head.op_type)
    assert [n.op_type for n in head_body.node] == ["MatMul"]
    assert len(_functions(model, "LlamaDecoderLayer")) == 1
    # onnxruntime's quantizer on the flat copy, same settings, lm_head excluded by its nodes' module path
    flat = inline_model(onnx.load(str(llama)))
    head_nodes = [n.name for n in flat.graph.node if {e.key: e.value for e in n.metadata_props}.get(metadata.MODULE_PATH) == "lm_head"]
    assert head_nodes
    quantizer = MatMulNBitsQuantizer(flat, bits=4, block_size=32, is_symmetric=False, nodes_to_exclude=head_nodes)
    quantizer.process()
    theirs = tmp_path / "flat_q4.onnx"
    onnx.save(quantizer.model.model, str(theirs))
    assert sum(n.op_type == "MatMulNBits" for n in quantizer.model.model.graph.node) == 14
    expected, ours, ort_q = _logits(llama, feeds), _logits(out, feeds), _logits(theirs, feeds)
    # the same packed weights and kernels: the two files agree to float32 rounding
    np.testing.assert_allclose(ours, ort_q, atol=1e-4, rtol=1e-4)
    spread = expected.max() - expected.min()
    ours_error = np.abs(ours - expected).max() / spread
    ort_error = np.abs(ort_q - expected).max() / spread
    assert 0 < ours_error < 0.5 and abs(ours_error - ort_error) <= 0.01 * ort_error + 1e-6


def test_int8_with_float16_and_path_keep(llama, feeds, tmp_path):
    out = tmp_path / "q8.onnx"
    report = convert(llama, out, dtype="float16", keep=["model.layers.1"], quantize="int8", symmetric=True)
    model = onnx.load(str(out))
    # the kept layer has bodies of its own, in float32; the converted one shares nothing with it
    layers = _functions(model, "LlamaDecoderLayer")
    assert len(layers) == 2
    assert sorted(json.dumps(metadata.module_paths(f)) for f in layers) == ['["model.layers.0"]', '["model.layers.1"]']
    # the kept chain shares its bodies as the export did: k_proj and v_proj of layer 1 one Linear_2 copy
    paths = [metadata.module_paths(f) for f in _functions(model, "Linear")]
    assert len(paths) == 8  # 4 bodies for layer 0 and lm_head, 4 for layer 1
    assert ["model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj"] in paths
    assert ["model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"] in paths
    assert "model.layers.1.self_attn.q_proj" in report.kept and "model.layers.0" not in report.kept
    nbits = [n for f in model.functions for n in f.node if n.op_type == "MatMulNBits"]
    assert nbits and all({a.name: a.i for a in n.attribute}["bits"] == 8 for n in nbits)
    kinds = {t.name: t.data_type for t in model.graph.initializer}
    assert kinds["model.layers.1.input_layernorm.weight"] == FLOAT
    assert kinds["model.layers.0.input_layernorm.weight"] == FLOAT16
    calls = {c.call_name: c for c in report.calls}
    assert not calls["model.layers.1.mlp"].converted and calls["model.layers.0.mlp"].converted
    assert report.outputs["logits"][1] < 0.05
    expected, actual = _logits(llama, feeds), _logits(out, feeds)
    assert np.abs(actual - expected).max() <= 0.05 * (expected.max() - expected.min())


def test_auto_keep_reaches_the_tolerance(llama, tmp_path):
    loose = convert(llama, tmp_path / "loose.onnx", dtype="float16", auto_keep=0.5)
    assert loose.auto_kept == [] and loose.max_drift <= 0.5  # float16 everywhere is within 50%
    tight = loose.max_drift / 2
    report = convert(llama, tmp_path / "auto.onnx", dtype="float16", auto_keep=tight)
    assert report.auto_kept, "nothing kept although the outputs were not within the tolerance"
    drifts = [d for _, d in report.auto_kept]
    assert drifts == sorted(drifts, reverse=True)  # the worst class first
    assert report.max_drift <= tight or len(report.auto_kept) == len({c.module_class for c in report.calls})
    data = json.loads(report.to_json())
    assert data["auto_kept"][0]["class"] == report.auto_kept[0][0] and data["tolerance"] == tight


def test_external_data_in_and_untouched(llama, tmp_path):
    source = tmp_path / "ext" / "m.onnx"
    source.parent.mkdir()
    onnx.save(onnx.load(str(llama)), str(source), save_as_external_data=True, location="m.data", size_threshold=1024)
    data = source.parent / "m.data"
    before = hashlib.sha256(data.read_bytes()).hexdigest()
    (tmp_path / "out").mkdir()
    report = convert(source, tmp_path / "out" / "m16.onnx", dtype="float16", keep=["LlamaRMSNorm"])
    assert hashlib.sha256(data.read_bytes()).hexdigest() == before
    assert report.outputs["logits"][1] <= 0.02
    model = onnx.load(str(tmp_path / "out" / "m16.onnx"))
    assert {t.name: t.data_type for t in model.graph.initializer}["model.norm.weight"] == FLOAT


def test_bad_input_is_typed_and_writes_nothing(llama, tmp_path):
    out = tmp_path / "bad.onnx"
    with pytest.raises(InvalidInputError, match="closest names: LlamaRMSNorm"):
        convert(llama, out, dtype="float16", keep=["LlamaRMSnorm"])
    with pytest.raises(InvalidInputError, match="Nothing to convert"):
        convert(llama, out)
    with pytest.raises(InvalidInputError, match="needs quantize"):
        convert(llama, out, dtype="float16", exclude=["lm_head"])
    with pytest.raises(InvalidInputError, match="block_size"):
        convert(llama, out, quantize="int4", block_size=24)
    # bfloat16: onnxruntime's CPU provider has no bfloat16 MatMul
    with pytest.raises(InvalidInputError, match="cannot run the bfloat16 model here"):
        convert(llama, out, dtype="bfloat16")
    flat = tmp_path / "flat.onnx"
    onnx.save(inline_model(onnx.load(str(llama))), str(flat))
    with pytest.raises(InvalidInputError, match="is a flat file"):
        convert(flat, out, dtype="float16")
    with pytest.raises(InvalidInputError, match="closest names: lm_head"):
        convert(flat, out, quantize="int4", exclude=["lm_heads"])
    bare = onnx.load(str(flat))
    for node in bare.graph.node:
        del node.metadata_props[:]
    onnx.save(bare, str(tmp_path / "bare.onnx"))
    with pytest.raises(InvalidModelFileError, match="do not name their modules"):
        convert(tmp_path / "bare.onnx", out, quantize="int4")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bare.onnx", "flat.onnx"]


def test_flat_file_quantized_by_node_metadata(llama, feeds, tmp_path):
    flat = tmp_path / "flat.onnx"
    onnx.save(inline_model(onnx.load(str(llama))), str(flat))
    report = convert(flat, tmp_path / "flat_q4.onnx", quantize="int4", exclude=["lm_head"])
    model = onnx.load(str(tmp_path / "flat_q4.onnx"))
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == len(report.quantized) == 14 and report.excluded == ["lm_head"]
    assert all({e.key: e.value for e in n.metadata_props}.get(metadata.MODULE_PATH) for n in nbits)  # labels kept
    assert {call for call, _ in report.quantized} >= {"model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"}
    assert [n.op_type for n in model.graph.node if {e.key: e.value for e in n.metadata_props}.get(metadata.MODULE_PATH) == "lm_head"] == ["MatMul"]
    modular = convert(llama, tmp_path / "modular_q4.onnx", quantize="int4", exclude=["lm_head"])
    np.testing.assert_allclose(_logits(tmp_path / "flat_q4.onnx", feeds), _logits(tmp_path / "modular_q4.onnx", feeds), atol=1e-4, rtol=1e-4)
    assert abs(report.outputs["logits"][1] - modular.outputs["logits"][1]) <= 1e-3


def test_cli(llama, feeds, tmp_path, capsys):
    out, report, arrays = tmp_path / "c.onnx", tmp_path / "c.json", tmp_path / "x.npz"
    np.savez(arrays, **feeds)
    code = main(["convert", str(llama), "-o", str(out), "--dtype", "float16", "--keep", "LlamaRMSNorm", "--json", str(report),
                 "--inputs", str(arrays)])
    assert code == 0 and out.exists()
    data = json.loads(report.read_text())
    assert data["dtype"] == "float16" and len(data["calls"]) == 31 and data["outputs"]["logits"]["drift"] <= 0.02
    assert "Per call" in capsys.readouterr().out
    assert main(["convert", str(llama), "-o", str(tmp_path / "d.onnx"), "--dtype", "float16", "--keep", "nope.layers"]) == 2
    assert not (tmp_path / "d.onnx").exists()


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """One layer, the embedding tied to lm_head: one initializer read by both."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("tied") / "tied.onnx"
    export_modular(transformers.LlamaForCausalLM(config).eval(), (torch.randint(0, 256, (1, 8)),), path)
    return path


def test_tied_weight_read_by_converted_and_kept_modules(tied, tmp_path):
    source = onnx.load(str(tied))
    assert [t.name for t in source.graph.initializer if t.name.startswith(("lm_head", "model.embed"))] == ["lm_head.weight"]
    out = tmp_path / "tied16.onnx"
    report = convert(tied, out, dtype="float16", keep=["lm_head"])
    model = onnx.load(str(out))
    # the kept lm_head reads it: it stays float32, and the converted embedding casts it where it reads it
    assert {t.name: t.data_type for t in model.graph.initializer}["lm_head.weight"] == FLOAT
    assert report.float32_weights == ["lm_head.weight"]
    embedding = _functions(model, "Embedding")[0]
    assert [n.op_type for n in embedding.node] == ["Cast", "Gather"]
    assert report.outputs["logits"][1] <= 0.02
    # quantization packs the tied weight once: lm_head's MatMulNBits, the embedding's GatherBlockQuantized
    # on the same int4 table (passes/precision/tied_weights.py), no float copy left
    quantized = convert(tied, tmp_path / "tied_q4.onnx", quantize="int4")
    assert quantized.skipped == []
    model = onnx.load(str(tmp_path / "tied_q4.onnx"))
    assert "GatherBlockQuantized" in [n.op_type for n in _functions(model, "Embedding")[0].node]
    assert "lm_head.weight" not in {t.name for t in model.graph.initializer}
    assert {"lm_head.weight_Q4", "lm_head.weight_scales"} <= {t.name for t in model.graph.initializer}


def test_without_verification_the_same_file_is_written_and_nothing_runs(llama, half, feeds, tmp_path):
    """verify=False (--no-verify, for files onnxruntime cannot hold): the same conversion, no drift
    report, and the file runs as the verified one does; auto_keep needs the measurement."""
    _, verified = half
    out = tmp_path / "f16.onnx"
    report = convert(llama, out, dtype="float16", keep=["LlamaRMSNorm"], verify=False)
    assert report.outputs == {} and report.calls == []
    np.testing.assert_array_equal(_logits(out, feeds), _logits(verified, feeds))
    with pytest.raises(InvalidInputError, match="needs verify"):
        convert(llama, tmp_path / "x.onnx", dtype="float16", auto_keep=0.01, verify=False)
    assert not (tmp_path / "x.onnx").exists()
