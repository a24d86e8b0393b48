"""Core coverage: real transformer models and a ResNet-like net, static and dynamic shapes.

Each export is checked for structure (function counts, nesting depth, names, domains,
call-node metadata, formal input names) and numerics (onnxruntime, both modular and
flat, against PyTorch eager within the default float32 tolerance atol=1e-4, rtol=1e-3).
"""

from __future__ import annotations

import dataclasses
import json

import models
import onnx
import pytest
import torch
from helpers import (
    CALL_METADATA_KEYS,
    DOMAIN_TRANSFORMERS,
    call_nodes,
    expanded_calls,
    functions_by_name,
    max_depth,
    top_level_calls,
)

from onnx_modular import export_modular
from onnx_modular.format import metadata

LOCAL = "pkg.models.local"  # classes defined in tests/models.py


@dataclasses.dataclass
class Expect:
    factory: object
    top_level: list[str]  # call nodes expected in the main graph, in order
    block: str  # the repeated block's function name
    block_domain: str
    block_calls: int
    block_inputs: list[str]  # leading formal inputs of the block function
    depth: int
    functions_min: int


EXPECT = {
    # GPT-2's ``drop`` (nn.Dropout in eval) computes nothing: no function, recorded as a no-op call.
    "gpt2": Expect(models.gpt2, ["wte", "wpe", "h.0", "h.1", "ln_f"], "GPT2Block", DOMAIN_TRANSFORMERS, 2,
                   ["hidden_states"], 3, 8),
    "llama": Expect(models.llama, ["embed_tokens", "rotary_emb", "layers.0", "layers.1", "norm"], "LlamaDecoderLayer",
                    DOMAIN_TRANSFORMERS, 2, ["hidden_states"], 3, 6),
    "bert": Expect(models.bert, ["embeddings", "encoder", "pooler"], "BertLayer", DOMAIN_TRANSFORMERS, 2,
                   ["hidden_states"], 5, 10),
    "vit": Expect(models.vit, ["embeddings", "layers.0", "layers.1", "layernorm", "pooler"], "ViTLayer",
                  DOMAIN_TRANSFORMERS, 2, ["hidden_states"], 3, 8),
    # T5's first block owns the relative position bias, so blocks 0 and 1 differ; their
    # feed-forward layers are identical and share one function.
    "t5": Expect(models.t5, ["encoder", "decoder"], "T5LayerFF", DOMAIN_TRANSFORMERS, 2, ["hidden_states"], 5, 10),
    "resnet": Expect(models.resnet, ["stem", "layers", "pool", "fc"], "BasicBlock", LOCAL, 2, ["x"], 5, 6),
}


@pytest.fixture(scope="module", params=sorted(EXPECT))
def exported(request, tmp_path_factory):
    name = request.param
    expect = EXPECT[name]
    model, args, kwargs = expect.factory()
    path = tmp_path_factory.mktemp(name) / f"{name}.onnx"
    result = export_modular(model, args, path, kwargs=kwargs)
    return name, expect, result, path


def test_file_is_valid_and_parity_holds(exported):
    name, _, result, path = exported
    onnx.checker.check_model(str(path), full_check=True)
    assert result.report is not None and result.report.ok, str(result.report)
    for output in result.report.outputs:
        assert output.modular_max_abs < 1e-4, (name, output)
        assert output.flat_max_abs is not None and output.flat_max_abs < 1e-4, (name, output)


def test_top_level_calls_and_depth(exported):
    name, expect, result, _ = exported
    top = top_level_calls(result.model)
    assert top == expect.top_level
    assert max_depth(result.model) == expect.depth
    assert result.hierarchy.max_depth == expect.depth


def test_block_function_identity(exported):
    _, expect, result, _ = exported
    functions = functions_by_name(result.model)
    block = functions[expect.block]
    assert block.domain == expect.block_domain
    assert int(block.metadata_props[metadata.CALL_COUNT]) == expect.block_calls
    assert [i.name for i in block.inputs][: len(expect.block_inputs)] == expect.block_inputs
    assert block.doc_string.startswith(f"{expect.block}: ")
    assert "calls:" in block.doc_string or "call:" in block.doc_string
    assert len(result.functions) >= expect.functions_min


def test_every_call_with_ops_is_a_function_call(exported):
    """Counts agree three ways: the call tree, the functions' call counts, the expanded graph."""
    _, _, result, _ = exported
    outlined = [call for call in result.hierarchy.walk() if call.function is not None]
    served = sum(int(f.metadata_props[metadata.CALL_COUNT]) for f in result.functions)
    assert len(outlined) == served == len(expanded_calls(result.model))
    expanded_names = sorted(name for name, _, _ in expanded_calls(result.model))
    # Call names (module path, @N for repeated calls) resolved through each caller: the
    # nodes of a shared body are named relative to it. A body shared by a module's calls
    # names its nested calls after the first one (index 0), hence a subset.
    assert set(expanded_names) <= {call.call_name for call in outlined}


def test_call_node_metadata(exported):
    _, _, result, _ = exported
    for node in call_nodes(result.model):
        assert CALL_METADATA_KEYS <= set(node.metadata_props), node.name
        function = result.model.functions[node.op_identifier()]
        # class, package and version have one home, the function; the source is on both
        assert not set(metadata.FUNCTION_ONLY_KEYS) & set(node.metadata_props), node.name
        assert node.metadata_props.get(metadata.SOURCE) == function.metadata_props.get(metadata.SOURCE)
        props = metadata.call_props(node, function)
        assert props[metadata.CLASS] == function.metadata_props[metadata.CLASS]
        assert function.domain == f"pkg.{props[metadata.PACKAGE]}.{props[metadata.PACKAGE_VERSION]}"
        assert props[metadata.MODULE_PATH] == node.metadata_props[metadata.MODULE_PATH]
        assert function.metadata_props[metadata.CLASS].endswith("." + function.name.split("_")[0]) or (
            function.metadata_props[metadata.CLASS].rsplit(".", 1)[-1] in function.name
        )
        paths = json.loads(function.metadata_props[metadata.MODULE_PATHS])
        assert len(paths) == int(function.metadata_props[metadata.CALL_COUNT])


def test_opset_imports_cover_every_domain(exported):
    _, _, result, _ = exported
    model = result.model
    for function in model.functions.values():
        for node in function:
            assert node.domain in function.opset_imports, (function.name, node.domain)
            assert node.domain in model.opset_imports
    for node in model.graph:
        assert node.domain in model.opset_imports


# -- dynamic shapes ------------------------------------------------------------------

DYNAMIC = {
    "gpt2": (models.gpt2, lambda: (torch.randint(0, 100, (3, 13)),), {}),
    "llama": (models.llama, lambda: (torch.randint(0, 100, (3, 13)),), {}),
    "t5": (models.t5, lambda: (), {"input_ids": (3, 11), "decoder_input_ids": (3, 6)}),
}


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_dynamic_batch_and_sequence(name, tmp_path):
    factory, other_args, other_kwarg_shapes = DYNAMIC[name]
    model, args, kwargs = factory()
    batch = torch.export.Dim("batch", min=1, max=32)
    if kwargs:
        dynamic_shapes = {k: {0: batch, 1: torch.export.Dim(f"seq_{k}", min=2, max=32)} for k in kwargs}
    else:
        dynamic_shapes = ({0: batch, 1: torch.export.Dim("seq", min=2, max=32)},)
    result = export_modular(model, args, tmp_path / "m.onnx", kwargs=kwargs, dynamic_shapes=dynamic_shapes)
    assert result.report.ok
    first_input = result.model.graph.inputs[0]
    assert str(first_input.shape[0]) == "batch"
    # Symbolic dims reach the function signatures.
    block = functions_by_name(result.model)[EXPECT[name].block]
    assert any(not isinstance(dim, int) for dim in block.inputs[0].shape)
    # Run at another shape and compare with torch.
    torch.manual_seed(1)
    new_kwargs = {k: torch.randint(0, 100, shape) for k, shape in other_kwarg_shapes.items()}
    report = result.verify(other_args(), new_kwargs or None, model=model)
    assert report.ok, str(report)
    assert report.outputs[0].shape[0] == 3
