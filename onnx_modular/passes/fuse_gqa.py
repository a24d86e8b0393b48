"""ONNX IR pass: decoder self-attention bodies into onnxruntime's ``GroupQueryAttention``, in place.

An attention body is recognised by what it computes, not by its class: three projections of one
input (calls or ``MatMul``), a key and a value appended to the past cache (``Concat`` on the
sequence axis, returned as the present cache), a ``Softmax`` over ``query @ key`` and an output
projection of ``softmax @ value``. Rotary (``x * cos + rotate_half(x) * sin`` on the key, with
``cos``/``sin`` formal inputs) goes inside the op (``do_rotary=1``) with cos/sin caches made by a
second call of the file's own rotary module on positions ``0 .. max_positions - 1`` (onnxruntime
folds it into a constant when it builds the session), so any rotary variant the module computes
(scaling, partial frequencies) is the one the op uses.

The body becomes: one ``MatMul`` (and ``Add``) on the query, key and value weights (and biases)
concatenated once per layer in the main graph (``model.layers.N.self_attn.qkv_proj.weight.T``,
as the builder packs them; or the three projection calls when they cannot be packed), one
``com.microsoft.GroupQueryAttention`` taking the packed projection, the output projection call. The op takes the mask as
``seqlens_k`` (``sum(attention_mask) - 1``, int32) and ``total_sequence_length`` (the mask's width,
int32), computed once in the main graph from its 2-D ``attention_mask`` and passed down the call
chain as new formal inputs (:data:`SEQLENS_K`, :data:`TOTAL_SEQUENCE_LENGTH`); formal inputs no
body reads any more (the 4-D mask, the per-call cos/sin) are then dropped with what computed them.

This pass does not check the numbers: ``onnx_modular.files.optimize`` runs each rewrite on the
file's real calls and keeps it only when the outputs agree. ``reasons`` says why a body with a
``Softmax`` was not rewritten.

Example::

    FuseGroupQueryAttentionPass(max_positions=4096)(model)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir

from onnx_modular.passes import _fusion

__all__ = ["FuseGroupQueryAttentionPass", "SEQLENS_K", "TOTAL_SEQUENCE_LENGTH"]

SEQLENS_K = "seqlens_k"
TOTAL_SEQUENCE_LENGTH = "total_sequence_length"
_SOFTMAX_SIDE = {"Add", "Mul", "Div", "Where", "Cast", "Sub"}


class _Refused(Exception):
    """Why a body is not rewritten."""


@dataclasses.dataclass
class _Attention:
    q_proj: ir.Node
    k_proj: ir.Node
    v_proj: ir.Node
    o_proj: ir.Node
    heads: list[ir.Value]  # query, key, value as [batch, seq, heads, head_size] (after any q/k norm)
    plain: bool  # each is a reshape of its projection's output (no norm between): GQA takes the projections
    past_key: ir.Value
    past_value: ir.Value
    present_key_index: int
    present_value_index: int
    num_heads: int
    kv_num_heads: int
    head_size: int
    scale: float
    cos: ir.Value | None
    sin: ir.Value | None


def _is_projection(node: ir.Node, model: ir.Model) -> bool:
    """A ``MatMul`` or a call of a linear module (``x @ W (+ b)``)."""
    if node.op_identifier() in model.functions:
        return _linear_parts(model, node) is not None
    return node.op_type == "MatMul" and node.domain in ("", "ai.onnx")


def _heads(start: ir.Value) -> ir.Value:
    """The ``[batch, seq, heads, head_size]`` value transposed to ``[batch, heads, seq, head_size]`` behind ``start``."""
    for node in _producers_bfs(start, lambda n: n.op_type == "Transpose"):
        perm = node.attributes.get_ints("perm", None) if node.op_type == "Transpose" else None
        if perm is not None and list(perm) == [0, 2, 1, 3]:
            return node.inputs[0]
    raise _Refused("no transpose from [batch, seq, heads, head] to [batch, heads, seq, head] behind the query/key/value")


def _gqa_input(heads: ir.Value, projection: ir.Node) -> ir.Value | None:
    """The projection's output when ``heads`` is just its reshape (then it can be packed), else ``None``."""
    producer = heads.producer()
    if producer is not None and producer.op_type == "Reshape" and producer.inputs[0] is projection.outputs[0]:
        return projection.outputs[0]
    return None


def _producers_bfs(start: ir.Value, stop) -> Iterable[ir.Node]:
    seen: set[int] = set()
    queue = [start]
    while queue:
        value = queue.pop(0)
        node = value.producer() if value is not None else None
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        if not stop(node):
            queue.extend(v for v in node.inputs if v is not None)


def _first_projection(model: ir.Model, start: ir.Value) -> ir.Node:
    for node in _producers_bfs(start, lambda n: _is_projection(n, model)):
        if _is_projection(node, model):
            return node
    raise _Refused("no projection found behind the key/value/query")


def _ancestors(value: ir.Value) -> set[int]:
    return {id(node) for node in _producers_bfs(value, lambda n: False)}


def _formal_behind(value: ir.Value, formals: list[ir.Value]) -> ir.Value | None:
    while value is not None and value not in formals:
        node = value.producer()
        if node is None or node.op_type not in ("Unsqueeze", "Cast", "Identity", "Reshape"):
            return None
        value = node.inputs[0]
    return value


def _static_shape(model: ir.Model, value: ir.Value) -> list:
    sources = _fusion.sources_of(model, value)
    shapes = [tuple(s.shape) if s.shape is not None else None for s in sources]
    if not shapes or shapes[0] is None or any(s != shapes[0] for s in shapes):
        raise _Refused(f"the shape of {value.name!r} is not known from the main graph")
    return [d if isinstance(d, int) else None for d in shapes[0]]


def _weight_columns(model: ir.Model, projection: ir.Node) -> int:
    if len(projection.inputs) < 2 or projection.inputs[1] is None:
        raise _Refused("a projection without a weight input")
    shape = _static_shape(model, projection.inputs[1])
    if len(shape) != 2 or shape[1] is None:
        raise _Refused("a projection weight that is not a 2-D matrix")
    return shape[1]


def _scale(model: ir.Model, scores: ir.Node) -> float:
    """The product of the constant factors on the query and key before ``q @ k`` and on the scores after it."""
    scale = 1.0
    for operand in scores.inputs:
        producer = operand.producer() if operand is not None else None
        if producer is not None and producer.op_type == "Mul":
            for factor in producer.inputs:
                number = _fusion.scalar_of(model, factor)
                if number is not None:
                    scale *= number
    for use in scores.outputs[0].uses():
        if use.node.op_type in ("Mul", "Div"):
            number = _fusion.scalar_of(model, use.node.inputs[1 - use.idx])
            if number is not None:
                scale = scale * number if use.node.op_type == "Mul" else scale / number
    return scale  # no factor at all: the body computes softmax(q @ k) unscaled (Granite's multiplier 1)


def _rotary(new_key: ir.Value, formals: list[ir.Value]) -> tuple[ir.Value | None, ir.Value | None]:
    add = new_key.producer()
    if add is None or add.op_type != "Add":
        return None, None
    muls = [v.producer() for v in add.inputs]
    if any(m is None or m.op_type != "Mul" for m in muls):
        return None, None
    cos = sin = None
    for mul in muls:
        for index, operand in enumerate(mul.inputs):
            formal = _formal_behind(operand, formals)
            if formal is None:
                continue
            other = mul.inputs[1 - index].producer()
            rotated = other is not None and other.op_type == "Concat" and any(
                v is not None and v.producer() is not None and v.producer().op_type == "Neg" for v in other.inputs
            )
            if rotated:
                sin = formal
            else:
                cos = formal
    if cos is None or sin is None:
        raise _Refused("the key goes through a product with cos/sin that is not rotate-half rotary")
    return cos, sin


def _analyse(model: ir.Model, function: ir.Function) -> _Attention:
    nodes = list(function)
    if any(n.op_type == "Tanh" for n in nodes):
        raise _Refused("soft-capped scores (Tanh) are not fused")
    softmaxes = [n for n in nodes if n.op_type == "Softmax"]
    if len(softmaxes) != 1:
        raise _Refused(f"{len(softmaxes)} Softmax nodes (one expected)")
    softmax = softmaxes[0]
    formals = list(function.inputs)
    outputs = list(function.outputs)
    concats = [
        n for n in nodes
        if n.op_type == "Concat" and n.outputs[0] in outputs and len(n.inputs) == 2 and n.inputs[0] in formals
        and n.attributes.get_int("axis", 0) in (-2, 2)
    ]
    if len(concats) != 2:
        raise _Refused("no key/value cache (two Concat of a past input returned as present)")
    behind_softmax = _ancestors(softmax.outputs[0])
    keyed = [c for c in concats if id(c) in behind_softmax]
    if len(keyed) != 1:
        raise _Refused("cannot tell the key cache from the value cache")
    key, value = keyed[0], next(c for c in concats if c is not keyed[0])
    scores = next((n for n in _producers_bfs(softmax.inputs[0], lambda n: n.op_type == "MatMul")
                   if n.op_type == "MatMul"), None)
    if scores is None:
        raise _Refused("no MatMul before the Softmax")
    k_proj = _first_projection(model, key.inputs[1])
    v_proj = _first_projection(model, value.inputs[1])
    q_side = [v for v in scores.inputs if id(key) not in _ancestors(v)]
    if len(q_side) != 1:
        raise _Refused("cannot tell the query from the key in the scores")
    q_proj = _first_projection(model, q_side[0])
    if not (q_proj.inputs[0] is k_proj.inputs[0] is v_proj.inputs[0]):
        raise _Refused("query, key and value do not project one input (cross-attention is not fused)")
    heads = [_heads(v) for v in (q_side[0], key.inputs[1], value.inputs[1])]
    plain = [_gqa_input(h, p) for h, p in zip(heads, (q_proj, k_proj, v_proj))]
    o_proj = outputs[0].producer()
    if o_proj is None or not _is_projection(o_proj, model) or id(softmax) not in _ancestors(o_proj.inputs[0]):
        raise _Refused("the first output is not a projection of the attention")
    past_shape = _static_shape(model, key.inputs[0])
    if len(past_shape) != 4 or past_shape[1] is None or past_shape[3] is None:
        raise _Refused("the past key is not [batch, kv_heads, past, head_size] with static heads")
    kv_heads, head_size = past_shape[1], past_shape[3]
    q_columns = _weight_columns(model, q_proj)
    one_projection = q_proj is k_proj is v_proj  # Phi-3's qkv_proj: GQA takes it whole ([q | k | v])
    if one_projection:
        q_columns -= 2 * kv_heads * head_size
    if q_columns <= 0 or q_columns % head_size or (
        not one_projection and _weight_columns(model, k_proj) != kv_heads * head_size
    ):
        raise _Refused("the projection widths do not match the cache's heads")
    cos, sin = _rotary(key.inputs[1], formals)
    return _Attention(
        q_proj, k_proj, v_proj, o_proj, heads, all(v is not None for v in plain) or one_projection,
        key.inputs[0], value.inputs[0],
        outputs.index(key.outputs[0]), outputs.index(value.outputs[0]),
        q_columns // head_size, kv_heads, head_size, _scale(model, scores), cos, sin,
    )


def _mask_values(model: ir.Model) -> tuple[ir.Value, ir.Value]:
    """seqlens_k and total_sequence_length computed once in the main graph from ``attention_mask``."""
    graph = model.graph
    existing = {v.name: v for node in graph for v in node.outputs}
    if SEQLENS_K in existing and TOTAL_SEQUENCE_LENGTH in existing:
        return existing[SEQLENS_K], existing[TOTAL_SEQUENCE_LENGTH]
    masks = [v for v in graph.inputs if v.name == "attention_mask" and v.shape is not None and len(v.shape) == 2]
    if not masks:
        raise _Refused("the main graph has no 2-D attention_mask input")
    mask = masks[0]

    def constant(name, array):
        node = ir.node("Constant", [], attributes={"value": ir.tensor(np.asarray(array), name=name)}, name=name)
        node.outputs[0].name = name
        return node

    one, axis = constant("gqa.one", np.array([1], np.int64)), constant("gqa.axis", np.array(1, np.int64))
    total = ir.node("ReduceSum", [mask, one.outputs[0]], attributes={"keepdims": 0}, name="gqa.mask_sum")
    minus = ir.node("Sub", [total.outputs[0], one.outputs[0]], name="gqa.mask_sum_minus_one")
    seqlens = ir.node("Cast", [minus.outputs[0]], attributes={"to": ir.DataType.INT32}, name="gqa.seqlens_k")
    shape = ir.node("Shape", [mask], name="gqa.mask_shape")
    width = ir.node("Gather", [shape.outputs[0], axis.outputs[0]], attributes={"axis": 0}, name="gqa.mask_width")
    length = ir.node("Cast", [width.outputs[0]], attributes={"to": ir.DataType.INT32}, name="gqa.total_sequence_length")
    new = [one, axis, total, minus, seqlens, shape, width, length]
    for node in new[2:]:
        node.outputs[0].name = node.name
    seqlens.outputs[0].name, length.outputs[0].name = SEQLENS_K, TOTAL_SEQUENCE_LENGTH
    seqlens.outputs[0].dtype = length.outputs[0].dtype = ir.DataType.INT32
    first = next(iter(graph), None)
    if first is None:
        graph.extend(new)
    else:
        graph.insert_before(first, new)
    return seqlens.outputs[0], length.outputs[0]


def _linear_parts(model: ir.Model, projection: ir.Node) -> tuple[ir.Value, ir.Value | None] | None:
    """(weight, bias) as the attention body passes them to a projection ``x @ W (+ b)``, else ``None``."""
    if projection.op_type == "MatMul" and projection.op_identifier() not in model.functions:
        return projection.inputs[1], None
    callee = model.functions.get(projection.op_identifier())
    if callee is None:
        return None
    nodes, formals = list(callee), list(callee.inputs)
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


def _packed_projection(model: ir.Model, function: ir.Function, attention: _Attention) -> list[ir.Node] | None:
    """One ``x @ W_qkv (+ b_qkv)`` for the three projections of one input (weights concatenated once,
    in the main graph), or ``None`` when they cannot be packed (then GQA takes q, k, v apart)."""
    parts = [_linear_parts(model, p) for p in (attention.q_proj, attention.k_proj, attention.v_proj)]
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
    paths = ",".join(p.metadata_props.get("pkg.onnx_modular.module_path", p.name or p.op_type)
                     for p in (attention.q_proj, attention.k_proj, attention.v_proj))
    matmul = ir.node("MatMul", [attention.q_proj.inputs[0], weight], name="qkv_proj.MatMul",
                     metadata_props={_fusion.FUSED_FROM_KEY: paths})
    matmul.outputs[0].name = "qkv_proj"
    if bias is None:
        return [matmul]
    add = ir.node("Add", [matmul.outputs[0], bias], name="qkv_proj.Add", metadata_props={_fusion.FUSED_FROM_KEY: paths})
    add.outputs[0].name = "qkv_proj_bias"
    return [matmul, add]


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


def _caches(model: ir.Model, attention: _Attention, max_positions: int) -> tuple[ir.Value, ir.Value]:
    """cos/sin caches ``[max_positions, head_size / 2]`` from a second call of the rotary module."""
    ends = []
    for formal in (attention.cos, attention.sin):
        sources = {id(s): s for s in _fusion.sources_of(model, formal)}
        if len(sources) != 1:
            raise _Refused("cos/sin do not come from one rotary call")
        ends.append(next(iter(sources.values())))
    rotary = ends[0].producer()
    if rotary is None or rotary is not ends[1].producer() or rotary.op_identifier() not in model.functions:
        raise _Refused("cos/sin are not the outputs of one module call (the rotary embedding)")
    computed = _computed_inputs(model, rotary)
    if len(computed) != 1:
        raise _Refused(f"the rotary call takes {len(computed)} computed inputs (position ids alone expected)")
    positions = ir.node(
        "Constant", [], attributes={"value": ir.tensor(np.arange(max_positions, dtype=np.int64)[None], name="gqa.positions")},
        name="gqa.positions",
    )
    positions.outputs[0].name = "gqa.positions"
    arguments = list(rotary.inputs)
    arguments[computed[0]] = positions.outputs[0]
    cache_call = ir.node(
        rotary.op_type, arguments, domain=rotary.domain, overload=rotary.overload,
        num_outputs=len(rotary.outputs), name=f"{rotary.name or rotary.op_type}.gqa_cache",
        metadata_props=dict(rotary.metadata_props),  # the original call usually goes: nothing reads it any more
    )
    half = attention.head_size // 2
    shape = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([-1, half], np.int64))}, name="gqa.cache_shape")
    bounds = [ir.node("Constant", [], attributes={"value": ir.tensor(np.array([v], np.int64))}, name=f"gqa.cache_{role}")
              for v, role in ((0, "start"), (half, "end"), (2, "axis"))]
    new = [positions, cache_call, shape, *bounds]
    caches = []
    for end, name in zip(ends, ("cos_cache", "sin_cache")):
        index = list(rotary.outputs).index(end)
        sliced = ir.node("Slice", [cache_call.outputs[index], bounds[0].outputs[0], bounds[1].outputs[0], bounds[2].outputs[0]],
                         name=f"gqa.{name}_half")
        flat = ir.node("Reshape", [sliced.outputs[0], shape.outputs[0]], name=f"gqa.{name}")
        sliced.outputs[0].name, flat.outputs[0].name = f"gqa.{name}_half", f"gqa.{name}"
        new += [sliced, flat]
        caches.append(flat.outputs[0])
    for node in (shape, *bounds):
        node.outputs[0].name = node.name
    for index, output in enumerate(cache_call.outputs):
        output.name = f"gqa.rotary_{index}"
    rotary.graph.insert_after(rotary, new)
    return caches[0], caches[1]


def _thread(model: ir.Model, function: ir.Function, name: str, value: ir.Value) -> ir.Value:
    formal = _fusion.thread_value(model, function, name, lambda graph: value if graph is value.graph else None)
    if formal is None:
        raise _Refused(f"a chain of calls to the attention does not reach the body that computes {name}")
    return formal


class FuseGroupQueryAttentionPass(ir.passes.InPlacePass):
    """Self-attention bodies with a KV cache into one ``com.microsoft.GroupQueryAttention`` each.

    Attributes after a run: ``fused`` (the rewritten functions), ``reasons`` (function -> why not),
    ``packed`` (those whose query, key and value projections became one ``MatMul`` on weights
    concatenated once in the main graph, so that ``convert`` quantizes one MatMul, not three).
    """

    def __init__(self, max_positions: int = 4096, functions: set[ir.OperatorIdentifier] | None = None,
                 pack_qkv: bool = True):
        super().__init__()
        self.pack_qkv = pack_qkv
        self.max_positions = max_positions
        self.functions = functions
        self.fused: list[ir.OperatorIdentifier] = []
        self.reasons: dict[ir.OperatorIdentifier, str] = {}
        self.packed: list[ir.OperatorIdentifier] = []  # bodies whose q, k, v projections became one MatMul

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.fused, self.reasons, self.packed = [], {}, []
        found = []
        for key, function in list(model.functions.items()):
            if self.functions is not None and key not in self.functions:
                continue
            if not any(node.op_type == "Softmax" for node in function):
                continue
            try:
                found.append((key, function, _analyse(model, function)))
            except _Refused as refused:
                self.reasons[key] = str(refused)
        if not found:
            return ir.passes.PassResult(model, modified=False)
        windows = [v.name for v in model.graph.inputs if "sliding_window" in v.name]
        if windows:  # the file's mask applies the window; GroupQueryAttention would need local_window_size
            self.reasons.update({key: f"sliding-window attention ({windows[0]}) is not fused" for key, _, _ in found})
            return ir.passes.PassResult(model, modified=False)
        try:
            seqlens, total = _mask_values(model)
        except _Refused as refused:
            self.reasons.update({key: str(refused) for key, _, _ in found})
            return ir.passes.PassResult(model, modified=False)
        for key, function, attention in found:
            try:
                self._rewrite(model, function, attention, seqlens, total)
            except _Refused as refused:
                self.reasons[key] = str(refused)
                continue
            self.fused.append(key)
        if self.fused:
            model.opset_imports.setdefault("com.microsoft", 1)
        _fusion.drop_unused_formals(model)
        return ir.passes.PassResult(model, modified=True)

    def _rewrite(self, model, function, attention: _Attention, seqlens, total) -> None:
        cos_cache = sin_cache = None
        if attention.cos is not None:
            cos_cache, sin_cache = _caches(model, attention, self.max_positions)
            cos_cache = _thread(model, function, "cos_cache", cos_cache)
            sin_cache = _thread(model, function, "sin_cache", sin_cache)
        seqlens = _thread(model, function, SEQLENS_K, seqlens)
        total = _thread(model, function, TOTAL_SEQUENCE_LENGTH, total)
        attributes = {
            "num_heads": attention.num_heads, "kv_num_heads": attention.kv_num_heads, "scale": attention.scale,
            "do_rotary": int(cos_cache is not None), "rotary_interleaved": 0, "local_window_size": -1, "softcap": 0.0,
        }
        one_projection = attention.q_proj is attention.k_proj
        packed = _packed_projection(model, function, attention) if self.pack_qkv and attention.plain and not one_projection else None
        if one_projection:
            query, key, value = attention.q_proj.outputs[0], None, None
        elif packed:
            self.packed.append(function.identifier())
            function.insert_before(attention.o_proj, packed)
            query, key, value = packed[-1].outputs[0], None, None
        elif attention.plain:
            query, key, value = (p.outputs[0] for p in (attention.q_proj, attention.k_proj, attention.v_proj))
        else:  # a norm between projection and heads (Qwen3's q_norm/k_norm): merge the heads back
            shape = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([0, 0, -1], np.int64))}, name="gqa.merge_heads")
            shape.outputs[0].name = "gqa.merge_heads"
            merged = [ir.node("Reshape", [h, shape.outputs[0]], name=f"gqa.{role}") for h, role in zip(attention.heads, "qkv")]
            for node in merged:
                node.outputs[0].name = node.name
            function.insert_before(attention.o_proj, [shape, *merged])
            query, key, value = (node.outputs[0] for node in merged)
        gqa = ir.node(
            "GroupQueryAttention",
            [query, key, value, attention.past_key, attention.past_value, seqlens, total, cos_cache, sin_cache],
            attributes=attributes, domain="com.microsoft", num_outputs=3, name="GroupQueryAttention",
        )
        names = [f"{attention.o_proj.inputs[0].name}_gqa", function.outputs[attention.present_key_index].name,
                 function.outputs[attention.present_value_index].name]
        function.insert_before(attention.o_proj, gqa)
        attention.o_proj.replace_input_with(0, gqa.outputs[0])
        function.outputs[attention.present_key_index] = gqa.outputs[1]
        function.outputs[attention.present_value_index] = gqa.outputs[2]
        function.opset_imports.setdefault("com.microsoft", 1)
        _fusion.remove_dead_nodes(function)
        for output, name in zip(gqa.outputs, names):
            output.name = name
