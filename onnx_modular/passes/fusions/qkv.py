"""The query, key and value :mod:`onnx_modular.passes.fusions.gqa` gives ``GroupQueryAttention``
when the body does more to them than project: the query times a per-position factor (Llama 4's
attention scale, :func:`scaled_query`), and a packed projection split with the q/k norms moved onto
its parts (Qwen3, Olmo2: :func:`normed_parts`). ``attention`` is gqa's analysis of the body."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

__all__ = ["scaled_query", "normed_parts"]


def _constant(name: str, values) -> ir.Node:
    """An int64 ``Constant`` whose output has the node's name."""
    node = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(values, np.int64))}, name=name)
    node.outputs[0].name = name
    return node


def scaled_query(function: ir.Function, attention: Any, query: ir.Value, packed: bool) -> ir.Value:
    """The query (``[batch, seq, heads * head]``, or the first columns of a packed ``[q | k | v]``)
    times the body's per-position factor (``[batch, 1, seq, 1]``), before the op turns it: the same
    number on every channel of a position commutes with the rotation."""
    shape = _constant("gqa.query_factor_shape", [0, 0, 1])
    turned = ir.node("Transpose", [attention.query_factor], attributes={"perm": [0, 2, 1, 3]}, name="gqa.query_factor_bshd")
    flat = ir.node("Reshape", [turned.outputs[0], shape.outputs[0]], name="gqa.query_factor")
    nodes = [shape, turned, flat]
    if packed:
        q_columns = attention.num_heads * attention.head_size
        sizes = _constant("gqa.query_columns", [q_columns, 2 * attention.kv_num_heads * attention.head_size])
        split = ir.node("Split", [query, sizes.outputs[0]], attributes={"axis": -1}, num_outputs=2, name="gqa.query_apart")
        scaled = ir.node("Mul", [split.outputs[0], flat.outputs[0]], name="gqa.query_scaled")
        joined = ir.node("Concat", [scaled.outputs[0], split.outputs[1]], attributes={"axis": -1}, name="gqa.qkv_scaled")
        for output, name in zip(split.outputs, ("gqa.query_part", "gqa.key_value_part")):
            output.name = name
        nodes += [sizes, split, scaled, joined]
    else:
        joined = ir.node("Mul", [query, flat.outputs[0]], name="gqa.query_scaled")
        nodes.append(joined)
    for node in nodes:
        if node.op_type != "Split":
            node.outputs[0].name = node.name
    function.insert_before(attention.anchor, nodes)
    return joined.outputs[0]

def normed_parts(function: ir.Function, attention: Any, qkv: ir.Value) -> tuple:
    """Query, key and value ``[batch, seq, heads * head]`` from one packed projection: ``Split``, and on
    the query and the key their norm call where the body has it (moved here, its other inputs kept):
    on the ``[batch, seq, heads, head]`` view (``Reshape`` there and back, no transposes: Qwen3, as the
    builder writes it) or on the part itself (a norm before the view: Olmo2)."""
    head = attention.head_size
    sizes = _constant("gqa.qkv_sizes", [attention.num_heads * head] + [attention.kv_num_heads * head] * 2)
    split = ir.node("Split", [qkv, sizes.outputs[0]], attributes={"axis": -1}, num_outputs=3, name="gqa.qkv_split")
    to_heads, merge = _constant("gqa.to_heads", [0, 0, -1, head]), _constant("gqa.merge_heads", [0, 0, -1])
    nodes, parts = [sizes, split, to_heads, merge], []
    for role, part, chain in zip("qkv", split.outputs, attention.chains):
        part.name = f"gqa.{role}_split"
        kinds = ["call" if n.op_type != "Reshape" or n.domain not in ("", "ai.onnx") else "view" for n in chain]
        if "call" not in kinds:
            parts.append(part)
            continue
        call = chain[kinds.index("call")]
        function.remove(call, safe=False)
        if kinds[0] == "view":  # the norm on the heads: view, norm, merge
            view = ir.node("Reshape", [part, to_heads.outputs[0]], name=f"gqa.{role}_heads")
            view.outputs[0].name = view.name
            call.replace_input_with(0, view.outputs[0])
            merged = ir.node("Reshape", [call.outputs[0], merge.outputs[0]], name=f"gqa.{role}_normed")
            merged.outputs[0].name = merged.name
            nodes += [view, call, merged]
            parts.append(merged.outputs[0])
        else:  # the norm on the projection's output, before the view
            call.replace_input_with(0, part)
            nodes.append(call)
            parts.append(call.outputs[0])
    function.insert_before(attention.anchor, nodes)
    return tuple(parts)
