"""Identical calls share one function at every level; users choose the modules.

Parity (onnxruntime modular and flat vs torch, atol=1e-4 rtol=1e-3) is asserted by
export_modular on every export here.
"""

from __future__ import annotations

import json

import models
import pytest
import torch
import torch.nn as nn
from helpers import expanded_calls, functions_by_name, top_level_calls

from onnx_modular import InvalidInputError, export_modular
from onnx_modular.format import metadata
from onnx_modular.passes.export.dedupe import function_fingerprint


@pytest.fixture(scope="module")
def gpt2_3():
    model, args, _ = models.gpt2(n_layer=3)
    return model, args


def calls_of(function) -> int:
    return int(function.metadata_props[metadata.CALL_COUNT])


def test_sharing_at_every_level(gpt2_3):
    model, args = gpt2_3
    result = export_modular(model, args)
    functions = functions_by_name(result.model)
    assert calls_of(functions["GPT2Block"]) == 3
    assert calls_of(functions["GPT2Attention"]) == 3
    assert calls_of(functions["GPT2MLP"]) == 3
    # Conv1D projections inside different parents share definitions, by shape:
    # c_attn (64->192), c_proj (64->64, used by attn and ... ), c_fc (64->256), mlp.c_proj (256->64).
    conv_calls = {name: calls_of(f) for name, f in functions.items() if name.startswith("Conv1D")}
    assert sum(conv_calls.values()) == 12 and len(conv_calls) == 4, conv_calls
    # One definition each, referenced from one parent body each.
    block_body_calls = [n.name for n in functions["GPT2Block"] if n.op_identifier() in result.model.functions]
    assert block_body_calls == ["ln_1", "attn", "ln_2", "mlp"]  # relative to the shared body
    # Every call is still reachable: 3 blocks x (ln_1, attn(c_attn, c_proj, resid_dropout), ln_2, mlp(4)) + 5 top.
    assert len(expanded_calls(result.model)) == len([c for c in result.hierarchy.walk() if c.function])
    paths = json.loads(functions["GPT2Block"].metadata_props[metadata.MODULE_PATHS])
    assert paths == ["h.0", "h.1", "h.2"]
    assert "3 calls: h.0, h.1, h.2" in functions["GPT2Block"].doc_string


def test_dedupe_off_keeps_one_function_per_call(gpt2_3):
    model, args = gpt2_3
    result = export_modular(model, args, dedupe=False)
    outlined = [c for c in result.hierarchy.walk() if c.function]
    assert len(result.functions) == len(outlined)
    assert all(calls_of(f) == 1 for f in result.functions)
    names = {f.name for f in result.functions}
    assert {"GPT2Block", "GPT2Block_2", "GPT2Block_3"} <= names
    # Leaf bodies (no nested calls) have the same fingerprints with and without dedupe,
    # so dedupe merged only equal bodies and lost none.
    deduped = export_modular(model, args)

    def leaf_prints(r):
        return {
            function_fingerprint(f)
            for f in r.functions
            if not any(n.op_identifier() in r.model.functions for n in f)
        }

    assert leaf_prints(deduped) == leaf_prints(result)
    assert len(deduped.functions) < len(result.functions)


def test_variants_of_one_class_get_stable_readable_names():
    result_a = export_modular(models.Containers().eval(), (torch.randn(2, 4),))
    result_b = export_modular(models.Containers().eval(), (torch.randn(2, 4),))
    names_a = {f.name: json.loads(f.metadata_props[metadata.MODULE_PATHS]) for f in result_a.functions}
    names_b = {f.name: json.loads(f.metadata_props[metadata.MODULE_PATHS]) for f in result_b.functions}
    assert names_a == names_b
    assert names_a["Linear"] == ["layers.0.linear", "layers.1.linear"]
    assert names_a["Linear_2"] == ["heads.left"]
    assert names_a["Linear_3"] == ["heads.right"]


def test_many_callers_are_summarised_in_the_doc_string():
    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([models.Scale() for _ in range(12)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    result = export_modular(Deep().eval(), (torch.randn(2, 4),))
    scale = functions_by_name(result.model)["Scale"]
    assert calls_of(scale) == 12
    assert "12 calls: layers.0, layers.1" in scale.doc_string
    assert "(4 more)" in scale.doc_string


def test_select_by_class(gpt2_3):
    import transformers

    model, args = gpt2_3
    result = export_modular(model, args, modules={transformers.models.gpt2.modeling_gpt2.GPT2Block})
    assert [f.name for f in result.functions] == ["GPT2Block"]
    assert top_level_calls(result.model) == ["h.0", "h.1", "h.2"]
    block = result.functions[0]
    # Unselected submodules are inlined but keep their namespace for viewers.
    namespaces = [n.metadata_props.get("namespace", "") for n in block]
    assert any("h.0.attn: transformers.models.gpt2.modeling_gpt2.GPT2Attention" in ns for ns in namespaces)
    assert result.hierarchy.find("h.0.attn").selected is False
    assert "not selected" in result.hierarchy.format()


def test_select_by_depth(gpt2_3):
    model, args = gpt2_3
    result = export_modular(model, args, modules=2)
    assert max(depth for _, _, depth in expanded_calls(result.model)) == 2
    assert "GPT2Attention" in functions_by_name(result.model)
    assert not any(name.startswith("Conv1D") for name in functions_by_name(result.model))


def test_select_by_predicate_keeps_linear_inline(gpt2_3):
    import transformers

    model, args = gpt2_3
    tiny = (nn.Dropout, nn.LayerNorm, transformers.pytorch_utils.Conv1D)
    result = export_modular(model, args, modules=lambda path, module: not isinstance(module, tiny))
    names = {f.name for f in result.functions}
    assert names == {"Embedding", "Embedding_2", "GPT2Block", "GPT2Attention", "GPT2MLP", "NewGELUActivation"}


def test_bad_selector():
    with pytest.raises(InvalidInputError, match="nn.Module classes"):
        export_modular(models.Scale().eval(), (torch.randn(2, 4),), modules=["Linear"])


def test_dedupe_with_dynamic_shapes():
    model, args, _ = models.gpt2(n_layer=3)
    dims = ({0: torch.export.Dim("batch", max=16), 1: torch.export.Dim("seq", min=2, max=32)},)
    result = export_modular(model, args, dynamic_shapes=dims)
    block = functions_by_name(result.model)["GPT2Block"]
    assert calls_of(block) == 3
    assert [str(d) for d in block.inputs[0].shape] == ["batch", "seq", "64"]
    report = result.verify((torch.randint(0, 100, (4, 19)),), model=model)
    assert report.ok, str(report)


def test_tied_weights_leave_no_unused_initializer():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=50, n_positions=16,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    result = export_modular(model, (torch.randint(0, 50, (1, 6)),))
    initializers = result.model.graph.initializers
    assert all(value.uses() for value in initializers.values())
    assert sum(1 for name in initializers if name.endswith("wte.weight") or name == "lm_head.weight") == 1


def test_optimize_keeps_functions(gpt2_3):
    model, args = gpt2_3
    plain = export_modular(model, args, optimize=False)
    optimized = export_modular(model, args)  # optimize=True is the default
    assert {f.name for f in optimized.functions} == {f.name for f in plain.functions}
    nodes = lambda r: sum(len(f) for f in r.model.functions.values()) + len(r.model.graph)
    assert nodes(optimized) < nodes(plain)
