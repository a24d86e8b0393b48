"""Linear projections inside attention bodies, read and packed: what the GroupQueryAttention and
MultiHeadAttention passes share (``x @ W (+ b)``, as a ``MatMul`` or a call of a linear module)."""

from __future__ import annotations

import onnx_ir as ir

from onnx_modular.format import metadata
from onnx_modular.passes.fusions import base as _fusion

__all__ = ["is_projection", "linear_parts", "packed_projection"]


def is_projection(node: ir.Node, model: ir.Model) -> bool:
    """A ``MatMul`` or a call of a linear module (``x @ W (+ b)``)."""
    if node.op_identifier() in model.functions:
        return linear_parts(model, node) is not None
    return node.op_type == "MatMul" and node.domain in ("", "ai.onnx")


def linear_parts(model: ir.Model, projection: ir.Node) -> tuple[ir.Value, ir.Value | None] | None:
    """(weight, bias) as the attention body passes them to a projection ``x @ W (+ b)``, else ``None``."""
    if projection.op_type == "MatMul" and projection.op_identifier() not in model.functions:
        return projection.inputs[1], None
    callee = model.functions.get(projection.op_identifier())
    if callee is None:
        return None
    nodes, formals = list(callee), list(callee.inputs)
    conv1d = _conv1d_parts(callee)
    if conv1d is not None:
        return tuple(projection.inputs[formals.index(v)] for v in conv1d)  # type: ignore[return-value]
    matmul = nodes[0] if nodes and nodes[0].op_type == "MatMul" else None
    if matmul is None or len(nodes) > 2 or matmul.inputs[0] is not formals[0] or matmul.inputs[1] not in formals:
        return None
    weight = projection.inputs[formals.index(matmul.inputs[1])]
    if len(nodes) == 1:
        return (weight, None) if callee.outputs[0] is matmul.outputs[0] else None
    add = nodes[1]
    if add.op_type != "Add" or callee.outputs[0] is not add.outputs[0] or matmul.outputs[0] not in add.inputs:
        return None
    bias = next((v for v in add.inputs if v is not matmul.outputs[0]), None)
    if bias not in formals:
        return None
    return weight, projection.inputs[formals.index(bias)]


def _conv1d_parts(callee: ir.Function) -> tuple[ir.Value, ir.Value] | None:
    """(weight, bias) formals of GPT-2's ``Conv1D`` (``addmm(b, x.view(-1, d), W).view(..., n)``: a
    ``Gemm`` of the input flattened to 2-D, reshaped back), else ``None``; the other nodes compute
    the shape only."""
    nodes, formals = list(callee), list(callee.inputs)
    gemms = [n for n in nodes if n.op_type == "Gemm" and n.domain in ("", "ai.onnx")]
    if len(gemms) != 1 or len(callee.outputs) != 1:
        return None
    gemm = gemms[0]
    attributes = {name: gemm.attributes.get_int(name, 0) for name in ("transA", "transB")}
    scales = [gemm.attributes.get_float(name, 1.0) for name in ("alpha", "beta")]
    flat, out = gemm.inputs[0].producer() if gemm.inputs[0] is not None else None, callee.outputs[0].producer()
    if any(attributes.values()) or scales != [1.0, 1.0] or len(gemm.inputs) != 3 or flat is None or out is None:
        return None
    if flat.op_type != "Reshape" or flat.inputs[0] is not formals[0] or out.op_type != "Reshape" or out.inputs[0] is not gemm.outputs[0]:
        return None
    if gemm.inputs[1] not in formals or gemm.inputs[2] not in formals:
        return None
    if any(n.op_type not in ("Reshape", "Concat", "Gemm") for n in nodes):
        return None
    return gemm.inputs[1], gemm.inputs[2]


def packed_projection(model: ir.Model, function: ir.Function, attention) -> list[ir.Node] | None:
    """One ``x @ W_qkv (+ b_qkv)`` for the three projections of one input (``attention``'s ``q_proj``,
    ``k_proj``, ``v_proj`` nodes; weights concatenated once, in the main graph), or ``None`` when they
    cannot be packed (then the fused op takes q, k, v apart)."""
    parts = [linear_parts(model, p) for p in (attention.q_proj, attention.k_proj, attention.v_proj)]
    if any(p is None for p in parts) or len({p[1] is None for p in parts}) != 1:
        return None
    weight = _fusion.pack_formals(model, function, [p[0] for p in parts], "qkv_proj.weight.T")
    bias = None
    if weight is not None and parts[0][1] is not None:
        bias = _fusion.pack_formals(model, function, [p[1] for p in parts], "qkv_proj.bias")
        if bias is None:
            return None
    if weight is None:
        return None
    paths = ",".join(p.metadata_props.get(metadata.MODULE_PATH, p.name or p.op_type)
                     for p in (attention.q_proj, attention.k_proj, attention.v_proj))
    matmul = ir.node("MatMul", [attention.q_proj.inputs[0], weight], name="qkv_proj.MatMul",
                     metadata_props={_fusion.FUSED_FROM_KEY: paths})
    matmul.outputs[0].name = "qkv_proj"
    if bias is None:
        return [matmul]
    add = ir.node("Add", [matmul.outputs[0], bias], name="qkv_proj.Add", metadata_props={_fusion.FUSED_FROM_KEY: paths})
    add.outputs[0].name = "qkv_proj_bias"
    return [matmul, add]
