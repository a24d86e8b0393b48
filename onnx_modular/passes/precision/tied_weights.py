"""A weight the LM head and the embedding share (tied embeddings), quantized once.

transformers ties ``lm_head.weight`` to ``embed_tokens.weight`` (Granite, Gemma, GPT-2, ...): one
main-graph initializer ``W`` (``[vocab, hidden]``) read by the embedding's ``Gather(W, ids)`` and by
the head's ``MatMul(x, Transpose(W))``. The export keeps the ``Transpose`` in the head's body (folding
it would store the table twice), so :mod:`.quantize_weights` alone leaves the head float32: the
largest weight of a small decoder, read whole at every token.

:func:`tied_uses` finds such a weight and every node reading it, down the call tree; then the head's
``MatMul`` becomes ``MatMulNBits`` on ``W`` packed as its transpose (the layout of a ``Gemm`` with
``transB``), and, at 4 bits (the builder's recipe), each embedding ``Gather`` becomes
``com.microsoft.GatherBlockQuantized`` reading the same packed table and scales (a ``Reshape`` of
the packed weight to ``[vocab, padded_hidden / 2]``, then a ``Slice`` back to ``hidden`` when the
hidden size is not a whole number of blocks), as onnxruntime-genai's builder does with
``shared_embeddings``. ``GatherBlockQuantized``'s default zero point for ``uint8`` data is
``2^(bits-1)``, the one symmetric ``MatMulNBits`` uses; asymmetric, both read the same packed zero points. The float table is then read by nothing and
goes: the weight is stored once, in 4 bits.

Entry: :func:`tied_uses` (the walk) and :func:`gather_block_quantized` (the embedding's nodes);
:class:`onnx_modular.passes.precision.quantize_weights.Quantizer` does the rewrite.
"""

from __future__ import annotations

import dataclasses

import onnx
import onnx.helper

from onnx_modular.passes.proto_bodies import Body, call_sites, function_id, node_id, uses

__all__ = ["TiedUses", "tied_uses", "gather_block_quantized", "TRANSPOSED_REASON"]

#: ``quantize_weights``' reason for a MatMul reading ``Transpose`` of a formal input.
TRANSPOSED_REASON = "its weight is transposed in the body (a weight tied to another use)"


@dataclasses.dataclass
class TiedUses:
    """Every read of one main-graph initializer, down the calls.

    Attributes:
        initializer: The weight's name in the main graph.
        heads: ``(body, formal, transpose node, MatMul nodes)``: ``MatMul(x, Transpose(formal))``.
        gathers: ``(body, formal, Gather node)``: ``Gather(formal, ids)`` on axis 0.
    """

    initializer: str
    heads: list[tuple[Body, str, onnx.NodeProto, list[onnx.NodeProto]]] = dataclasses.field(default_factory=list)
    gathers: list[tuple[Body, str, onnx.NodeProto]] = dataclasses.field(default_factory=list)


def _functions(model: onnx.ModelProto) -> dict:
    return {function_id(f): f for f in model.functions}


def _outputs(body: Body) -> set[str]:
    return set(body.output) if isinstance(body, onnx.FunctionProto) else {v.name for v in body.output}


def _origins(model: onnx.ModelProto, body: Body, name: str, depth: int = 0) -> set[str] | None:
    """The main-graph initializers ``name`` (a value of ``body``) stands for over every call; ``None``
    when some call passes anything else."""
    if body is model.graph:
        return {name} if any(t.name == name for t in model.graph.initializer) else None
    if name not in body.input or depth > 64:
        return None
    index = list(body.input).index(name)
    found: set[str] = set()
    sites = list(call_sites(model, function_id(body)))
    for caller, node in sites:
        if index >= len(node.input) or not node.input[index]:
            return None
        above = _origins(model, caller, node.input[index], depth + 1)
        if above is None:
            return None
        found |= above
    return found if sites else None


def _transposed_matmuls(body: Body, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """The MatMuls reading a 2-D ``Transpose``'s output as their weight, when nothing else reads it."""
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
    if perm != [1, 0]:
        return None
    readers = uses(body, node.output[0])
    if not readers or any(n.op_type != "MatMul" or n.domain not in ("", "ai.onnx") or i != 1 or len(n.input) != 2
                          for n, i in readers):
        return None
    if node.output[0] in _outputs(body):
        return None
    return [n for n, _ in readers]


def _walk(model: onnx.ModelProto, body: Body, name: str, found: TiedUses, seen: set) -> str | None:
    """Every read of ``name`` in ``body`` and below into ``found``; why the weight cannot be tied, or None."""
    functions = _functions(model)
    for node, index in uses(body, name):
        function = functions.get(node_id(node))
        if function is not None and index >= 0:
            if index >= len(function.input):
                return f"the call {node.name or node.op_type} passes it beyond its function's inputs"
            formal = function.input[index]
            if _origins(model, function, formal) != {found.initializer}:
                return f"{function.name} is called with other weights too"
            key = (function_id(function), formal)
            if key not in seen:
                seen.add(key)
                why = _walk(model, function, formal, found, seen)
                if why:
                    return why
            continue
        if node.op_type == "Gather" and index == 0 and node.domain in ("", "ai.onnx") \
                and all(a.i == 0 for a in node.attribute if a.name == "axis"):
            found.gathers.append((body, name, node))
            continue
        if node.op_type == "Transpose" and index == 0 and node.domain in ("", "ai.onnx"):
            matmuls = _transposed_matmuls(body, node)
            if matmuls is not None:
                found.heads.append((body, name, node, matmuls))
                continue
        return f"it is also read by {node.op_type}"
    if name in _outputs(body):
        return "it is an output of its body"
    return None


def tied_uses(model: onnx.ModelProto, body: Body, transpose: onnx.NodeProto) -> TiedUses | str:
    """The tied weight ``transpose`` (a ``Transpose`` of a formal input or initializer in ``body``)
    reads, with all its reads; or why it is not one: reads other than an embedding ``Gather`` and a
    head's ``MatMul(x, Transpose(W))``, a 2-D float32 initializer reached through every call."""
    origins = _origins(model, body, transpose.input[0])
    if origins is None or len(origins) != 1:
        return "its weight is not one initializer over every call"
    name = next(iter(origins))
    tensor = next(t for t in model.graph.initializer if t.name == name)
    if tensor.data_type != onnx.TensorProto.FLOAT or len(tensor.dims) != 2:
        return "its weight is not a 2-D float32 tensor"
    if name in {v.name for v in model.graph.input} | {v.name for v in model.graph.output}:
        return "its weight is a graph input or output"
    found = TiedUses(name)
    why = _walk(model, model.graph, name, found, set())
    return why or found


def gather_block_quantized(gather: onnx.NodeProto, parts: list[str], *, vocab: int, hidden: int, bits: int,
                           block_size: int, taken: set[str]) -> list[onnx.NodeProto]:
    """The nodes replacing ``Gather(W, ids)``: ``GatherBlockQuantized`` on the packed table ``parts``
    (``[W_Q4, W_scales]`` of ``MatMulNBits``, ``[vocab, blocks, block_size * bits / 8]``, and its packed
    zero points when asymmetric: ``[vocab, ceil(blocks * bits / 8)]``, the same packing), the
    ``Gather``'s output name and metadata kept."""
    blocks = (hidden + block_size - 1) // block_size
    padded = blocks * block_size
    base = gather.name or gather.output[0]

    def fresh(suffix: str) -> str:
        name, count = f"{base}.{suffix}", 0
        while name in taken:
            count += 1
            name = f"{base}.{suffix}_{count}"
        taken.add(name)
        return name

    shape_name, table = fresh("table_shape"), fresh("table")
    nodes = [
        onnx.helper.make_node("Constant", [], [shape_name], name=shape_name,
                              value=onnx.helper.make_tensor(shape_name, onnx.TensorProto.INT64, [2], [vocab, padded * bits // 8])),
        onnx.helper.make_node("Reshape", [parts[0], shape_name], [table], name=table),
    ]
    gathered = gather.output[0] if padded == hidden else fresh("padded")
    nodes.append(onnx.helper.make_node(
        "GatherBlockQuantized", [table, gather.input[1], *parts[1:]], [gathered], name=base + "_Q4" if bits == 4 else base,
        domain="com.microsoft", bits=bits, block_size=block_size, gather_axis=0, quantize_axis=1))
    if padded != hidden:
        starts, ends, axes = fresh("starts"), fresh("ends"), fresh("axes")
        for value_name, value in ((starts, 0), (ends, hidden), (axes, -1)):
            nodes.append(onnx.helper.make_node("Constant", [], [value_name], name=value_name,
                                               value=onnx.helper.make_tensor(value_name, onnx.TensorProto.INT64, [1], [value])))
        nodes.append(onnx.helper.make_node("Slice", [gathered, starts, ends, axes], [gather.output[0]], name=fresh("slice")))
    for node in nodes:
        node.metadata_props.extend(gather.metadata_props)
    return nodes
