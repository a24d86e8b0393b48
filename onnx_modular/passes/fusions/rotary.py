"""Rotary embeddings for :mod:`onnx_modular.passes.fusions.gqa`: the rotary an attention body applies to its
key (rotate-half or interleaved, whole or partial), read from the body, and the cos/sin caches the fused
op takes, made by a second call of the file's own rotary module on positions ``0 .. max_positions - 1``.

A partial rotary whose cache width (rotary channels / 2) is not a multiple of 8 is refused by
onnxruntime's ``GroupQueryAttention`` (CPU); :func:`rotary_nodes` writes it as
``com.microsoft.RotaryEmbedding`` on the query and the key (``rotary_embedding_dim``, the same caches,
the position ids the rotary module was called with), before a ``GroupQueryAttention`` without
``do_rotary``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from onnx_modular.passes.fusions import base as _fusion
from onnx_modular.passes.fusions.attention_scores import producers_bfs as _producers_bfs

__all__ = ["rotary", "query_rotary", "checked_rotary", "caches", "rotary_source", "needs_rotary_op", "position_ids", "rotary_nodes"]


def _formal_behind(value: ir.Value, formals: list[ir.Value]) -> ir.Value | None:
    while value is not None and value not in formals:
        node = value.producer()
        if node is None or node.op_type not in ("Unsqueeze", "Cast", "Identity", "Reshape"):
            return None
        value = node.inputs[0]
    return value


def _repeated_half_behind(model: ir.Model, value: ir.Value, formals: list[ir.Value]) -> ir.Value | None:
    """The cos/sin formal behind ``cos[..., :d // 2].repeat_interleave(2, -1)`` (GLM's: ``Reshape`` of a
    ``Tile`` of an ``Unsqueeze`` of a ``Slice`` from 0 on the last axis), else ``None``: the module's
    rotate-half cos/sin made interleaved in the body."""
    reshape = value.producer() if value is not None else None
    tile = reshape.inputs[0].producer() if reshape is not None and reshape.op_type == "Reshape" else None
    unsqueeze = tile.inputs[0].producer() if tile is not None and tile.op_type == "Tile" else None
    sliced = unsqueeze.inputs[0].producer() if unsqueeze is not None and unsqueeze.op_type == "Unsqueeze" else None
    if sliced is None or sliced.op_type != "Slice" or len(sliced.inputs) < 4:
        return None
    start, axis = (_fusion.scalar_of(model, sliced.inputs[i]) for i in (1, 3))
    step = _fusion.scalar_of(model, sliced.inputs[4]) if len(sliced.inputs) > 4 and sliced.inputs[4] is not None else 1
    if start != 0 or axis not in (-1, 3) or step != 1:
        return None
    return _formal_behind(sliced.inputs[0], formals)


def rotary(model: ir.Model, new_key: ir.Value, formals: list[ir.Value], what: str = "key") -> tuple:
    """cos, sin and the rotary width of ``x * cos + rotate_half(x) * sin`` on the key (``None``s: no
    rotary); the width is ``None`` for the whole head, else the channels of a partial rotary
    (``concat(rotary(x[..., :d]), x[..., d:])``: Phi, StableLM, GPT-NeoX), and whether the pairs
    are interleaved (channels ``2i, 2i + 1``: Cohere) rather than the two halves."""
    add, width = new_key.producer(), None
    if add is not None and add.op_type == "Concat" and len(add.inputs) == 2 and add.attributes.get_int("axis", 0) in (-1, 3):
        rest = add.inputs[1].producer() if add.inputs[1] is not None else None
        start = _fusion.scalar_of(model, rest.inputs[1]) if rest is not None and rest.op_type == "Slice" else None
        if start is None:
            return None, None, None, False
        add, width = add.inputs[0].producer(), int(start)
    if add is None or add.op_type != "Add":
        return None, None, None, False
    muls = [v.producer() for v in add.inputs]
    if any(m is None or m.op_type != "Mul" for m in muls):
        return None, None, None, False
    cos = sin = None
    interleaved = repeated = False
    turned = {}  # "cos": the x of x * cos, "sin": the x of rotate_half(x) * sin
    for mul in muls:
        for index, operand in enumerate(mul.inputs):
            formal = _formal_behind(operand, formals)
            if formal is None and (formal := _repeated_half_behind(model, operand, formals)) is not None:
                repeated = True
            if formal is None:
                continue
            other = mul.inputs[1 - index]
            halves = _halves(model, other.producer() if other is not None else None)
            rotated = halves is not None
            if not rotated and _rotated_pairs(other.producer() if other is not None else None):
                rotated = interleaved = True
                halves = _pairs_source(other.producer())
            if rotated:
                sin, turned["sin"] = formal, halves
            else:
                cos, turned["cos"] = formal, other
    if cos is None or sin is None or (repeated and not interleaved):
        raise _fusion.Refused(f"the {what} goes through a product with cos/sin that is not rotate-half rotary")
    if _plain(turned["cos"]) is not _plain(turned["sin"]):
        raise _fusion.Refused(f"the {what}'s rotary: x * cos and rotate_half(x) * sin do not turn the same x")
    return cos, sin, width, "repeated" if repeated else interleaved


def _plain(value: ir.Value | None) -> ir.Value | None:
    while value is not None and value.producer() is not None and value.producer().op_type == "Identity":
        value = value.producer().inputs[0]
    return value


def _halves(model: ir.Model, node: ir.Node | None) -> ir.Value | None:
    """``x`` of ``rotate_half(x) = concat(-x[..., h:], x[..., :h])`` (two ``Slice``s or one ``Split`` of
    ``x``), or ``None``: any other concatenation (the sign on the other half, the halves swapped) is not
    the rotary the op computes."""
    if node is None or node.op_type != "Concat" or len(node.inputs) != 2 or any(v is None for v in node.inputs):
        return None
    neg, first = node.inputs[0].producer(), node.inputs[1].producer()
    if neg is None or neg.op_type != "Neg" or neg.inputs[0] is None or first is None:
        return None
    second = neg.inputs[0].producer()
    if second is None:
        return None
    if first.op_type == "Split" and second is first and len(first.outputs) == 2:
        return first.inputs[0] if (neg.inputs[0] is first.outputs[1] and node.inputs[1] is first.outputs[0]) else None
    if first.op_type != "Slice" or second.op_type != "Slice" or first.inputs[0] is not second.inputs[0]:
        return None
    start, end, half = (_fusion.scalar_of(model, v) for v in (first.inputs[1], first.inputs[2], second.inputs[1]))
    axes = [_fusion.scalar_of(model, s.inputs[3]) if len(s.inputs) > 3 else None for s in (first, second)]
    if start != 0 or half is None or half <= 0 or end != half or axes[0] != axes[1]:
        return None
    return first.inputs[0]


def _pairs_source(node: ir.Node) -> ir.Value | None:
    """``x`` of the interleaved rotate-half :func:`_rotated_pairs` recognised (the tensor its strided slices read)."""
    stack = node.inputs[0].producer()
    negated = stack.inputs[0].producer().inputs[0].producer().inputs[0]
    taken = negated.producer() if negated is not None else None
    return taken.inputs[0] if taken is not None and taken.op_type == "Slice" else None


def _rotated_pairs(node: ir.Node | None) -> bool:
    """``stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)``: the interleaved rotate-half (Cohere, GPT-J)."""
    if node is None or node.op_type != "Reshape" or node.inputs[0] is None:
        return False
    stack = node.inputs[0].producer()
    if stack is None or stack.op_type != "Concat" or len(stack.inputs) != 2:
        return False
    parts = [v.producer() if v is not None else None for v in stack.inputs]
    if any(p is None or p.op_type != "Unsqueeze" for p in parts):
        return False
    first = parts[0].inputs[0].producer()
    return first is not None and first.op_type == "Neg"


def checked_rotary(model: ir.Model, new_key: ir.Value, formals: list[ir.Value], head_size: int):
    """:func:`rotary`, refused where GroupQueryAttention cannot take it."""
    cos, sin, width, interleaved = rotary(model, new_key, formals)
    if cos is None and any(n.op_type == "Neg" for n in _producers_bfs(new_key, lambda n: False)):
        raise _fusion.Refused("the key's rotary is not the last step before the cache (a norm after it, or another form)")
    if width is not None and (width <= 0 or width % 2 or width > head_size):
        raise _fusion.Refused(f"a partial rotary over {width} of the head's {head_size} channels")
    return cos, sin, width, interleaved


def query_rotary(model: ir.Model, query: ir.Value, formals: list[ir.Value]) -> tuple[tuple, ir.Value | None]:
    """:func:`rotary` of the query the scores read (behind a scale by a constant, a transpose, a cast):
    ``GroupQueryAttention`` turns the query as it turns the key. And the factor of a query multiplied
    after its rotary by one number a position (``[batch, 1, seq, 1]``: Llama 4's attention scale,
    ``1 + beta * log(1 + floor(pos / original_max))``), else ``None``: the same number on every
    channel of a position commutes with the rotation, so the query can be scaled before the op."""
    value, factor = query, None
    while value is not None and value.producer() is not None:
        node = value.producer()
        scaled = node.op_type in ("Mul", "Div") and _fusion.scalar_of(model, node.inputs[1]) is not None
        if node.op_type in ("Mul", "Div") and not scaled and rotary(model, node.inputs[0], formals, "query")[0] is not None:
            shape = node.inputs[1].shape
            if node.op_type == "Div" or factor is not None or shape is None or len(shape) != 4 or shape[1] != 1 or shape[3] != 1:
                raise _fusion.Refused(f"the query is scaled after its rotary by a computed value ({node.op_type} by "
                                      f"{node.inputs[1].name}) that is not one number a position; the op takes no such scale")
            factor = node.inputs[1]
        elif not scaled and node.op_type not in ("Transpose", "Cast", "Identity"):
            break
        value = node.inputs[0]
    try:
        found = rotary(model, value, formals, "query")
    except _fusion.Refused as refused:
        raise _fusion.Refused(f"the query is not turned by the key's rotary ({refused})") from None
    if found[0] is None and any(n.op_type == "Neg" for n in _producers_bfs(value, lambda n: False)):
        return None, factor  # a Neg behind the query that is no rotary this module reads
    return found, factor


def needs_rotary_op(attention: Any) -> bool:
    """A partial rotary whose cos/sin caches onnxruntime's GroupQueryAttention refuses on CPU ("cos_cache
    dimension 1 must be <= head_size / 2 and a multiple of 8"): it goes in ``RotaryEmbedding`` nodes instead."""
    return attention.cos is not None and attention.rotary_dim < attention.head_size and (attention.rotary_dim // 2) % 8 != 0


def _computed_inputs(model: ir.Model, call: ir.Node) -> list[int]:
    """Indices of the call's arguments that are not weights or lifted constants."""
    computed = []
    for index, value in enumerate(call.inputs):
        if value is None:
            continue
        sources = _fusion.sources_of(model, value)
        if not sources or not all(s.is_initializer() for s in sources):
            computed.append(index)
    return computed


def _rotary_call(model: ir.Model, attention: Any) -> tuple[ir.Node, list[ir.Value], int]:
    """The rotary module's call whose outputs are the body's cos/sin, those outputs, and the index of
    its one computed input (the position ids)."""
    ends = []
    for formal in (attention.cos, attention.sin):
        sources = {id(s): s for s in _fusion.sources_of(model, formal)}
        if len(sources) != 1:
            raise _fusion.Refused("cos/sin do not come from one rotary call")
        ends.append(next(iter(sources.values())))
    rotary = ends[0].producer()
    if rotary is None or rotary is not ends[1].producer() or rotary.op_identifier() not in model.functions:
        raise _fusion.Refused("cos/sin are not the outputs of one module call (the rotary embedding)")
    computed = _computed_inputs(model, rotary)
    if len(computed) != 1:
        raise _fusion.Refused(f"the rotary call takes {len(computed)} computed inputs (position ids alone expected)")
    return rotary, ends, computed[0]


def position_ids(model: ir.Model, attention: Any) -> ir.Value:
    """The position ids the rotary module was called with (in the body that calls it)."""
    rotary, _, index = _rotary_call(model, attention)
    return rotary.inputs[index]


def caches(model: ir.Model, attention: Any, max_positions: int, made: dict) -> tuple[ir.Value, ir.Value]:
    """cos/sin caches ``[max_positions, rotary_dim / 2]`` from a second call of the rotary module
    (one per rotary call and width: ``made`` keeps those already written)."""
    rotary, ends, computed = _rotary_call(model, attention)
    half = attention.rotary_dim // 2
    memo = (id(rotary), tuple(list(rotary.outputs).index(e) for e in ends), half, attention.interleaved)
    # interleaved pairs: the module's cos/sin repeat each frequency twice (every other channel), or are
    # rotate-half's made interleaved in the body ("repeated": their first half)
    pairs = attention.interleaved is True
    if memo in made:
        return made[memo]
    tag = "gqa" if not made else f"gqa{len(made) + 1}"
    positions = ir.node(
        "Constant", [], attributes={"value": ir.tensor(np.arange(max_positions, dtype=np.int64)[None], name=f"{tag}.positions")},
        name=f"{tag}.positions",
    )
    positions.outputs[0].name = f"{tag}.positions"
    arguments = list(rotary.inputs)
    arguments[computed] = positions.outputs[0]
    cache_call = ir.node(
        rotary.op_type, arguments, domain=rotary.domain, overload=rotary.overload,
        num_outputs=len(rotary.outputs), name=f"{rotary.name or rotary.op_type}.{tag}_cache",
        metadata_props=dict(rotary.metadata_props),  # the original call usually goes: nothing reads it any more
    )
    shape = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([-1, half], np.int64))}, name=f"{tag}.cache_shape")
    bounds = [ir.node("Constant", [], attributes={"value": ir.tensor(np.array([v], np.int64))}, name=f"{tag}.cache_{role}")
              for v, role in ((0, "start"), (2 * half if pairs else half, "end"), (2, "axis"),
                              (2 if pairs else 1, "step"))]
    new = [positions, cache_call, shape, *bounds]
    caches = []
    for end, name in zip(ends, ("cos_cache", "sin_cache")):
        index = list(rotary.outputs).index(end)
        sliced = ir.node("Slice", [cache_call.outputs[index], *(b.outputs[0] for b in bounds)],
                         name=f"{tag}.{name}_half")
        flat = ir.node("Reshape", [sliced.outputs[0], shape.outputs[0]], name=f"{tag}.{name}")
        sliced.outputs[0].name, flat.outputs[0].name = f"{tag}.{name}_half", f"{tag}.{name}"
        new += [sliced, flat]
        caches.append(flat.outputs[0])
    for node in (shape, *bounds):
        node.outputs[0].name = node.name
    for index, output in enumerate(cache_call.outputs):
        output.name = f"{tag}.rotary_{index}"
    rotary.graph.insert_after(rotary, new)
    owner = _fusion.body_of(model, rotary.graph)
    if owner is not None:  # a body of calls only may import no standard opset (Gemma3TextModel)
        owner.opset_imports.setdefault("", model.opset_imports.get("", 18))
    made[memo] = (caches[0], caches[1])
    return caches[0], caches[1]


def rotary_source(value: ir.Value) -> int:
    producer = value.producer()
    return id(producer) if producer is not None else id(value)


def rotary_nodes(attention: Any, query: ir.Value, key: ir.Value, positions: ir.Value, cos_cache: ir.Value,
                 sin_cache: ir.Value) -> tuple[list[ir.Node], ir.Value, ir.Value]:
    """``com.microsoft.RotaryEmbedding`` on the query and the key (``[batch, seq, heads * head_size]``),
    turning the first ``rotary_dim`` channels of each head: the nodes, the rotated query and key.
    The position ids are expanded to ``[batch, seq]`` (the rotary module may take them as ``[1, seq]``)."""
    shape = ir.node("Shape", [query], attributes={"start": 0, "end": 2}, name="gqa.rotary_batch_seq")
    expanded = ir.node("Expand", [positions, shape.outputs[0]], name="gqa.rotary_positions")
    nodes = [shape, expanded]
    rotated = []
    for value, heads, role in ((query, attention.num_heads, "query"), (key, attention.kv_num_heads, "key")):
        node = ir.node("RotaryEmbedding", [value, expanded.outputs[0], cos_cache, sin_cache], domain="com.microsoft",
                       attributes={"num_heads": heads, "rotary_embedding_dim": attention.rotary_dim,
                                   "interleaved": int(bool(attention.interleaved))}, name=f"gqa.rotary_{role}")
        nodes.append(node)
        rotated.append(node.outputs[0])
    for node in nodes:
        node.outputs[0].name = node.name
    return nodes, rotated[0], rotated[1]
