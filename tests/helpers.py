"""Helpers that read the structure of an exported modular model."""

from __future__ import annotations

import importlib.metadata

import onnx
import onnx_ir as ir

from onnx_modular.format import metadata


def _domain(package: str) -> str:
    """The function domain of a package's classes, from its installed version (no local label)."""
    return f"pkg.{package}.{importlib.metadata.version(package).split('+', 1)[0]}"


DOMAIN_TORCH = _domain("torch")
DOMAIN_TRANSFORMERS = _domain("transformers")

CALL_METADATA_KEYS = metadata.CALL_METADATA_KEYS


def without_lifted_constants(values) -> list:
    """The values (or names) other than the ``const_...`` formal inputs of constants that
    FoldWeightsPass lifted out of the bodies (docs/metadata.md)."""
    return [v for v in values if not (v if isinstance(v, str) else v.name).startswith("const_")]


def functions_by_name(model: ir.Model) -> dict[str, ir.Function]:
    return {f.name: f for f in model.functions.values()}


def is_call(node: ir.Node, model: ir.Model) -> bool:
    """A call of a module-call function (torch's own helper functions excluded)."""
    return metadata.is_module_function(model.functions.get(node.op_identifier()))


def expanded_calls(model: ir.Model) -> list[tuple[str, str, int]]:
    """Every module call reachable from the main graph, expanded through shared bodies.

    Returns (call name, function name, depth) in execution order, from
    :func:`onnx_modular.format.metadata.expanded_calls` (the same walk the tree and localization use).
    """
    proto = ir.serde.serialize_model(model)
    return [(call.call_name, call.function.name, call.depth) for call in metadata.expanded_calls(proto)]


def max_depth(model: ir.Model) -> int:
    return max((depth for _, _, depth in expanded_calls(model)), default=0)


def top_level_calls(model: ir.Model) -> list[str]:
    return [node.name for node in model.graph if is_call(node, model)]


def call_nodes(model: ir.Model) -> list[ir.Node]:
    """Call nodes in the main graph and in every function body."""
    nodes = [n for n in ir.traversal.RecursiveGraphIterator(model.graph) if is_call(n, model)]
    for function in model.functions.values():
        nodes += [n for n in ir.traversal.RecursiveGraphIterator(function) if is_call(n, model)]
    return nodes


def torch_value_names_in_signatures(result) -> list[str]:
    """``function.input/output:name`` for every formal name that is a torch value name.

    Torch value names are the FX node names of the exported program (``add_8``,
    ``linear_3``; the user inputs' placeholders excepted, as those are forward()'s own
    parameter names) and the translator's ``val_N``. Also checks that every name not from
    forward() (``unbound_*``, ``size_*``) is explained in the function's doc string.
    """
    import re

    program = result.exported_program
    user_inputs = {
        spec.arg.name for spec in program.graph_signature.input_specs if spec.kind.name == "USER_INPUT"
    }
    fx_names = {node.name for node in program.graph.nodes if node.op != "output" and node.name not in user_inputs}
    found = []
    for function in result.functions:
        for kind, values in (("input", function.inputs), ("output", function.outputs)):
            for value in values:
                if value.name in fx_names or re.fullmatch(r"val_\d+", value.name):
                    found.append(f"{function.name}.{kind}:{value.name}")
                if re.fullmatch(r"(unbound_(input|output)|size)_\d+", value.name):
                    assert value.name in (function.doc_string or ""), (function.name, value.name)
    return found


def graph_bytes(path) -> int:
    """Serialized size of the model file without weights (initializer data dropped)."""
    proto = onnx.load(str(path), load_external_data=False)
    for tensor in proto.graph.initializer:
        for field in ("raw_data", "float_data", "external_data", "int64_data", "int32_data", "data_location"):
            tensor.ClearField(field)
    return proto.ByteSize()


def cache_argument() -> str:
    """The name transformers' causal LMs take and return their KV cache under in the installed
    release (``cache`` from 5.24, ``past_key_values`` before), read from the forward signature:
    the files name the cache's tensors after it (``input.<name>.layers.0.keys``)."""
    import transformers

    from onnx_modular.hf.versions import cache_argument as from_signature

    return from_signature(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1)))


def returned_cache(outputs):
    """The cache a forward returned, in either release."""
    from onnx_modular.hf.versions import returned_cache as returned

    return returned(outputs)


def export_and_optimize(model, folder, capsys, max_positions: int = 128) -> tuple:
    """``model`` (a transformers decoder) saved into ``folder/ckpt``, exported with its cache under
    Optimum's names (``export --task causal-lm-with-past --io-names optimum``) and ``optimize``d:
    ``(exported, optimized, the optimize report as JSON)``."""
    import json

    from onnx_modular.cli import main

    model.save_pretrained(folder / "ckpt")
    exported, optimized = folder / "m.onnx", folder / "m.opt.onnx"
    assert main(["export", str(folder / "ckpt"), "--task", "causal-lm-with-past", "-o", str(exported),
                 "--io-names", "optimum", "--no-verify"]) == 0
    capsys.readouterr()
    assert main(["optimize", str(exported), "-o", str(optimized), "--max-positions", str(max_positions), "--json", "-"]) == 0
    return exported, optimized, json.loads(capsys.readouterr().out)

