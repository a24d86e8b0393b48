"""Opsets 17 to 23 with the functions kept, custom translations, and library translations.

Every export here verifies parity itself (onnxruntime modular and flat against PyTorch, default
float32 tolerance atol=1e-4, rtol=1e-3; a mismatch raises ParityError), so the tests check
the structure on top: the same functions at every opset, one version of the default domain in
every import, fused standard ops at 23, translated ops inside the right function.
"""

from __future__ import annotations

import collections

import models
import onnx
import onnx_ir as ir
import pytest
import torch
import torch.nn as nn
from helpers import DOMAIN_TORCH, DOMAIN_TRANSFORMERS, expanded_calls, functions_by_name

from onnx_modular import export_modular, files
from onnx_modular.errors import InvalidInputError, TranslationError
from onnx_modular.format import metadata
from onnx_modular.passes.export import opset_conversion as opset


def default_domain_imports(model: ir.Model) -> set[int]:
    """Every version of the default domain imported anywhere (model, main graph, functions)."""
    versions = {version for domain, version in model.opset_imports.items() if domain in ("", "ai.onnx")}
    for body in (model.graph, *model.functions.values()):
        versions |= {version for domain, version in body.opset_imports.items() if domain in ("", "ai.onnx")}
    return versions


def op_counts(function: ir.Function) -> collections.Counter:
    return collections.Counter(node.op_type for node in ir.traversal.RecursiveGraphIterator(function))


@pytest.fixture(scope="module")
def llama_at():
    model, args, kwargs = models.llama(n_layer=1)
    return {version: export_modular(model, args, kwargs=kwargs, opset_version=version) for version in (17, 18, 20, 23)}


@pytest.mark.parametrize("version", [17, 18, 20, 23])
def test_llama_exports_at_each_opset_with_its_functions(llama_at, version):
    result, reference = llama_at[version], llama_at[18]
    assert result.report.ok
    assert default_domain_imports(result.model) == {version}
    assert expanded_calls(result.model) == expanded_calls(reference.model)  # same calls, names, depths
    assert sorted(functions_by_name(result.model)) == sorted(functions_by_name(reference.model))
    norm = functions_by_name(result.model)["LlamaRMSNorm"]
    assert norm.domain == DOMAIN_TRANSFORMERS
    assert norm.metadata_props[metadata.CALL_COUNT] == "3"  # the layer's two norms and the last one share it
    onnx.checker.check_model(result.model_proto, full_check=True)


def test_llama_opset_23_attention_is_one_op(llama_at):
    attention = {version: op_counts(functions_by_name(llama_at[version].model)["LlamaAttention"]) for version in llama_at}
    assert attention[23]["Attention"] == 1
    assert attention[23]["Softmax"] == 0
    for version in (17, 18, 20):
        assert attention[version]["Attention"] == 0 and attention[version]["Softmax"] == 1
    # transformers' RMSNorm is written by hand (pow, mean, rsqrt); onnxscript's fusion rule makes
    # it one RMSNormalization at 23, inside the shared function body.
    norms = {version: op_counts(functions_by_name(llama_at[version].model)["LlamaRMSNorm"]) for version in llama_at}
    assert norms[23] == {"RMSNormalization": 1}
    assert all(norms[version]["RMSNormalization"] == 0 and norms[version]["ReduceMean"] == 1 for version in (17, 18, 20))


def test_opset_17_is_converted_body_by_body(llama_at):
    """Reduce ops take their axes as an attribute again, and nodes keep names and metadata."""
    norm = functions_by_name(llama_at[17].model)["LlamaRMSNorm"]
    (mean,) = [node for node in norm if node.op_type == "ReduceMean"]
    assert list(mean.attributes["axes"].as_ints()) == [-1]
    assert "noop_with_empty_axes" not in mean.attributes and len(mean.inputs) == 1
    before = {node.name: dict(node.metadata_props) for node in functions_by_name(llama_at[18].model)["LlamaRMSNorm"]}
    assert before[mean.name] == dict(mean.metadata_props)
    assert "namespace" in mean.metadata_props


class Attention(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, t, d)


class NormAttentionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(16)
        self.attn = Attention()

    def forward(self, x):
        return x + self.attn(self.norm(x))


def test_opset_23_fuses_sdpa_and_rms_norm_inside_their_functions():
    torch.manual_seed(0)
    model, x = NormAttentionBlock().eval(), torch.randn(2, 8, 16)
    ops = {}
    for version in (18, 23):
        result = export_modular(model, (x,), opset_version=version)
        assert default_domain_imports(result.model) == {version}
        ops[version] = {name: op_counts(function) for name, function in functions_by_name(result.model).items()}
    assert ops[23]["RMSNorm"] == {"RMSNormalization": 1}
    assert ops[23]["Attention"]["Attention"] == 1 and ops[23]["Attention"]["Softmax"] == 0
    assert ops[18]["RMSNorm"]["RMSNormalization"] == 0 and ops[18]["Attention"]["Attention"] == 0
    assert functions_by_name(result.model)["RMSNorm"].domain == DOMAIN_TORCH


class CountingModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        self.calls += 1
        return self.linear(x)


@pytest.mark.parametrize("version", [16, 0, "18", opset.max_opset() + 1])
def test_unreachable_opset_is_a_typed_error_before_any_work(version, tmp_path):
    model = CountingModule().eval()
    with pytest.raises(InvalidInputError, match=f"possible opsets are 17 to {opset.max_opset()}"):
        export_modular(model, (torch.randn(2, 4),), tmp_path / "m.onnx", opset_version=version)
    assert model.calls == 0  # not even the eager run
    assert list(tmp_path.iterdir()) == []


# -- custom translations -------------------------------------------------------------------


@torch.library.custom_op("onnx_modular_test::hard_swish", mutates_args=())
def hard_swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.clamp(x + 3, 0, 6) / 6


@hard_swish.register_fake
def _(x):
    return torch.empty_like(x)


def hard_swish_onnx(x):
    from onnxscript import opset18 as op

    return op.HardSwish(x)


class Activation(nn.Module):
    def forward(self, x):
        return hard_swish(x)


class CustomOpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 8), Activation())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.inner(x))


def test_custom_translation_lands_inside_the_calling_module():
    torch.manual_seed(0)
    model, x = CustomOpNet().eval(), torch.randn(3, 4)
    table = {torch.ops.onnx_modular_test.hard_swish.default: hard_swish_onnx}
    result = export_modular(model, (x,), custom_translation_table=table, opset_version=23)
    assert result.report.ok
    where = {
        name: count
        for name, function in functions_by_name(result.model).items()
        if (count := op_counts(function)["HardSwish"])
    }
    assert where == {"Activation": 1}
    assert not any(node.op_type == "HardSwish" for node in result.model.graph)
    assert default_domain_imports(result.model) == {23}


def test_custom_op_without_a_translation_names_its_module():
    with pytest.raises(TranslationError, match="hard_swish") as info:
        export_modular(CustomOpNet().eval(), (torch.randn(3, 4),))
    assert info.value.module_path == "inner.1"


def test_bad_custom_translation_table_is_a_typed_error():
    with pytest.raises(InvalidInputError, match="custom_translation_table"):
        export_modular(CustomOpNet().eval(), (torch.randn(3, 4),), custom_translation_table=[hard_swish_onnx])


# -- library translations: transformers' MoE experts ------------------------------------------


def qwen3_moe(n_layer: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=n_layer,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        use_cache=False, max_position_embeddings=64,
    )
    return transformers.Qwen3MoeModel(config).eval(), (torch.randint(0, 100, (2, 8)),)


def test_moe_experts_through_transformers_grouped_mm_fallback():
    """transformers runs the experts through its custom op ``grouped_mm_fallback`` under
    torch.export; torch has no translation for it, transformers' table has."""
    model, args = qwen3_moe(1)
    program = torch.export.export(model, args, strict=False)
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert "transformers.grouped_mm_fallback.default" in targets  # the case this test is about
    result = export_modular(model, args)
    assert result.report.ok
    functions = functions_by_name(result.model)
    experts = functions["Qwen3MoeExperts"]
    assert experts.domain == DOMAIN_TRANSFORMERS
    assert op_counts(experts)["MatMul"] >= 4  # one per expert and projection, unrolled inside the function
    assert [name for name, _, _ in expanded_calls(result.model) if name.endswith("experts")] == ["layers.0.mlp.experts"]


@pytest.mark.slow
@pytest.mark.parametrize("version", [18, 23])
def test_moe_two_layers_at_opsets(version):
    model, args = qwen3_moe(2)
    result = export_modular(model, args, opset_version=version)
    assert result.report.ok
    assert default_domain_imports(result.model) == {version}
    assert sum(1 for name, _, _ in expanded_calls(result.model) if name.endswith("mlp.experts")) == 2


# -- the conversion pass on its own (torch-free, from ONNX text) ---------------------------------

_OPSET_18_TEXT = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[2, 3] x) => (float[2, 1] y, float[2, 1] z) {
    [norm] y = pkg.test.Norm (x)
    axes = Constant <value_ints = [1]> ()
    z = ReduceMax <keepdims = 1> (x, axes)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Norm (x) => (y) {
    axes = Constant <value_ints = [1]> ()
    [mean] m = ReduceMean <keepdims = 1> (x, axes)
    y = Sqrt (m)
}
"""


def opset_18_model() -> ir.Model:
    model = ir.from_onnx_text(_OPSET_18_TEXT)
    (function,) = model.functions.values()
    function.metadata_props[metadata.CLASS] = "Norm"
    next(node for node in function if node.op_type == "ReduceMean").metadata_props["namespace"] = "norm/mean"
    return model


def test_convert_opset_pass_keeps_functions():
    model = opset_18_model()
    opset.ConvertOpsetPass(17)(model)
    assert default_domain_imports(model) == {17}
    (function,) = model.functions.values()
    assert function.name == "Norm" and function.metadata_props[metadata.CLASS] == "Norm"
    (mean,) = [node for node in function if node.op_type == "ReduceMean"]
    assert list(mean.attributes["axes"].as_ints()) == [1] and len(mean.inputs) == 1
    assert mean.name == "mean" and mean.metadata_props["namespace"] == "norm/mean"
    (reduce_max,) = [node for node in model.graph if node.op_type == "ReduceMax"]
    assert list(reduce_max.attributes["axes"].as_ints()) == [1]
    assert [node.op_type for node in model.graph if node.domain == "pkg.test"] == ["Norm"]
    onnx.checker.check_model(ir.to_proto(model), full_check=True)


def test_inline_converts_the_copy(tmp_path):
    source = tmp_path / "m.onnx"
    ir.save(opset_18_model(), source)
    flat = files.inline_file(source, tmp_path / "flat.onnx", opset_version=17)
    assert not flat.functions and {o.version for o in flat.opset_import if o.domain == ""} == {17}
    with pytest.raises(InvalidInputError, match="possible opsets"):
        files.inline_file(source, tmp_path / "bad.onnx", opset_version=16)
    assert not (tmp_path / "bad.onnx").exists()


def test_cli_inline_opset(tmp_path, capsys):
    from onnx_modular.cli import main

    source = tmp_path / "m.onnx"
    ir.save(opset_18_model(), source)
    assert main(["inline", str(source), str(tmp_path / "flat.onnx"), "--opset", "17"]) == 0
    assert {o.version for o in onnx.load(tmp_path / "flat.onnx").opset_import if o.domain == ""} == {17}
    assert main(["inline", str(source), str(tmp_path / "bad.onnx"), "--opset", "99"]) == 2
    assert "possible opsets are 17 to" in capsys.readouterr().err
    assert not (tmp_path / "bad.onnx").exists()


_SPLIT_18_TEXT = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[5, 3] x) => (float[3, 3] a, float[2, 3] b, float[3, 3] c, float[2, 3] d) {
    a, b = pkg.test.Halves (x)
    c, d = Split <axis = 0, num_outputs = 2> (x)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Halves (x) => (a, b) {
    a, b = Split <axis = 0, num_outputs = 2> (x)
}
"""


def test_split_num_outputs_converts_to_sizes_static_and_dynamic():
    """onnx's converter has no 18 -> 17 Split adapter: ``num_outputs`` becomes a sizes input,
    a constant where the dimension is known (main graph), computed where it is not (the
    function's input has no shape). 5 rows in 2 chunks: 3 + 2, as opset 18 splits them."""
    import numpy as np
    import onnxruntime as ort

    model = ir.from_onnx_text(_SPLIT_18_TEXT)
    before = ir.to_proto(model).SerializeToString()
    opset.ConvertOpsetPass(17)(model)
    assert default_domain_imports(model) == {17}
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    splits = [node for node in ir.traversal.RecursiveGraphIterator(model.graph) if node.op_type == "Split"]
    splits += [node for node in next(iter(model.functions.values())) if node.op_type == "Split"]
    assert all(len(node.inputs) == 2 and "num_outputs" not in node.attributes for node in splits)
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    expected = ort.InferenceSession(before).run(None, {"x": x})
    actual = ort.InferenceSession(proto.SerializeToString()).run(None, {"x": x})
    assert [a.shape for a in actual] == [(3, 3), (2, 3), (3, 3), (2, 3)]
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(a, e)
