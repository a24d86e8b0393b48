"""ONNX IR pass: encoder self-attention and cross-attention bodies into ``com.microsoft.Attention`` / ``MultiHeadAttention``.

A body is recognised by what it computes, not by its class: a ``Softmax`` over ``query @ key``
(times constant factors, plus at most one additive bias: the mask), ``softmax @ value``, the heads
merged back to ``[batch, seq, heads * head]``; query, key and value each a per-head reshape and
``[0, 2, 1, 3]`` transpose of a projection (a call of a linear module or a ``MatMul``). BERT,
RoBERTa, ViT, CLIP and Whisper's encoder all spell it so (torch's decomposition of
``scaled_dot_product_attention``, the scale split as ``sqrt(scale)`` on each side; with static shapes
a NaN guard ``Where(IsNaN(p), 0, p)`` on the probabilities, read through; eager attention's
``key.transpose(2, 3)`` merged into the heads' transpose, ``[0, 2, 3, 1]``, and a ``Cast`` of the
probabilities to float32). Bodies with a
KV cache (a past input concatenated and returned as present) are the GroupQueryAttention step's
and are skipped without a reason.

The rewrite, inside the body:

- when query, key and value project one input with weights and biases the body reads as formal
  inputs, their weights and biases are concatenated once per call site in the main graph
  (``...query.weight.T`` -> ``...qkv_proj.weight.T``, as the GroupQueryAttention step packs
  them) and ``com.microsoft.Attention`` takes the input, the packed weights and the packed bias:
  the op runs the one GEMM and writes its output in the head layout itself (on a BERT-base layer
  at 128 tokens, one thread: 10.9 ms against 13.0 ms for ``MatMul`` + ``Split`` +
  ``MultiHeadAttention`` or the unfused ops). Without biases (``attention_op=False`` too) one
  ``MatMul`` and a ``Split`` in three feed ``MultiHeadAttention``. Otherwise (cross-attention: the
  key and value read the encoder's states; a projection without a bias, Whisper's ``k_proj``)
  ``MultiHeadAttention`` takes the three projections' outputs as they are.
- the additive mask (``softmax(q @ k * scale + mask)``) becomes the op's ``attention_bias``
  (``[batch or 1, 1, seq, total]``: what torch's boolean mask becomes, ``-3.4e38`` where masked);
- torch's guard for rows with every key masked (``Where(all masked, 0, attention)``) is kept,
  applied to the op's ``[batch, seq, hidden]`` output;
- ``scale`` is the product of the constant factors on the query, the key and the scores.

This pass does not check the numbers: ``onnx_modular.files.optimize.tool`` runs the rewrite on the
file's real calls and keeps it only when the outputs agree. ``reasons`` says why a body with a
``Softmax`` was not rewritten.

Example::

    FuseMultiHeadAttentionPass()(model)
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import onnx_ir as ir

from onnx_modular.passes.fusions import base as _fusion
from onnx_modular.passes.fusions.projections import is_projection as _is_projection
from onnx_modular.passes.fusions.projections import linear_parts as _linear_parts
from onnx_modular.passes.fusions.projections import packed_projection as _packed_projection

__all__ = ["FuseMultiHeadAttentionPass"]

#: Ops that move the query/key data without changing a number (followed on the data input).
_MOVES = {"Reshape", "Transpose", "Identity", "Squeeze", "Unsqueeze"}
_HEADS_PERM = [0, 2, 1, 3]
_KEY_PERM = [0, 2, 3, 1]


@dataclasses.dataclass
class _Side:
    projection: ir.Node  # the projection whose output is reshaped into heads
    head_shape: ir.Node  # the Reshape to [batch, seq, heads, head]
    factor: float  # constant factors on the way (the query's and key's share of the scale)


@dataclasses.dataclass
class _Attention:
    query: _Side
    key: _Side
    value: _Side
    merged: ir.Value  # [batch, seq, heads * head]: what the op's output replaces
    guard: ir.Value | None  # the condition of torch's all-masked-row Where ([batch, 1, seq, 1]), if any
    bias: ir.Value | None  # the additive mask
    scale: float
    num_heads: int
    widths: list[int] | None  # the query's, key's and value's projection widths (None: not all known)


def _is_op(node: ir.Node | None, *types_: str) -> bool:
    return node is not None and node.op_type in types_ and node.domain in ("", "ai.onnx")


def _perm(node: ir.Node) -> list[int] | None:
    perm = node.attributes.get_ints("perm", None)
    return list(perm) if perm is not None else None


def _number(model: ir.Model, value: ir.Value | None) -> float | None:
    """The constant scalar ``value`` holds, looking through a ``Cast``/``CastLike`` of it."""
    producer = value.producer() if value is not None else None
    if _is_op(producer, "Cast", "CastLike"):
        value = producer.inputs[0]
    return _fusion.scalar_of(model, value)


def _constant_factor(model: ir.Model, node: ir.Node) -> tuple[ir.Value, float] | None:
    """(the other operand, the factor) for ``x * c`` or ``x / c`` with a constant scalar ``c``."""
    if not _is_op(node, "Mul", "Div"):
        return None
    for index in ((1, 0) if node.op_type == "Mul" else (1,)):
        number = _number(model, node.inputs[index])
        if number is not None and number != 0:
            return node.inputs[1 - index], (number if node.op_type == "Mul" else 1.0 / number)
    return None


def _side(model: ir.Model, value: ir.Value, role: str) -> _Side:
    """Follow the query/key/value back through moves and constant factors to its projection."""
    factor = 1.0
    for _ in range(16):
        node = value.producer()
        if node is None:
            break
        scaled = _constant_factor(model, node)
        if scaled is not None:
            value, number = scaled
            factor *= number
            continue
        # the heads ([0, 2, 1, 3]); for the key, eager attention's ``key.transpose(2, 3)`` merged into it ([0, 2, 3, 1])
        if _is_op(node, "Transpose") and (_perm(node) == _HEADS_PERM or (role == "key" and _perm(node) == _KEY_PERM)):
            reshape = node.inputs[0].producer()
            projection = reshape.inputs[0].producer() if _is_op(reshape, "Reshape") else None
            scaled = _constant_factor(model, projection) if projection is not None else None
            if scaled is not None:  # Whisper scales the query's projection before the heads
                factor *= scaled[1]
                projection = scaled[0].producer()
            if projection is None or not _is_projection(projection, model):
                raise _fusion.Refused(f"the {role}'s heads are not a reshape of a projection")
            return _Side(projection, reshape, factor)
        if not _is_op(node, *_MOVES):
            break
        value = node.inputs[0]
    raise _fusion.Refused(f"no per-head reshape and [0, 2, 1, 3] transpose of a projection behind the {role}")


def _scores(model: ir.Model, softmax: ir.Node) -> tuple[ir.Node, float, ir.Value | None]:
    """The ``q @ k`` MatMul behind the Softmax, the constant factors after it, and the additive mask."""
    if softmax.attributes.get_int("axis", -1) not in (-1, 3):
        raise _fusion.Refused("the Softmax is not over the last axis")
    value, factor, bias = softmax.inputs[0], 1.0, None
    for _ in range(8):
        node = value.producer()
        if _is_op(node, "MatMul"):
            return node, factor, bias
        scaled = _constant_factor(model, node) if node is not None else None
        if scaled is not None:
            value, number = scaled
            factor *= number
        elif _is_op(node, "Add") and bias is None:
            scores_side = [v for v in node.inputs if v.producer() is not None and _reaches_matmul(v)]
            if len(scores_side) != 1:
                raise _fusion.Refused("cannot tell the scores from the mask in the Add before the Softmax")
            value = scores_side[0]
            bias = next(v for v in node.inputs if v is not value)
        elif _is_op(node, "Cast", "Identity"):
            value = node.inputs[0]
        elif _is_op(node, "Gemm", "TopK"):  # x @ W^T or its top k: a mixture-of-experts router's softmax, no attention
            raise _fusion.NotApplicable(f"a Softmax of a {node.op_type} (a router's logits), not of q @ k")
        else:
            what = node.op_type if node is not None else "a formal input"
            raise _fusion.Refused(f"{what} between q @ k and the Softmax (a scale and one additive mask expected)")
    raise _fusion.Refused("no MatMul before the Softmax")


def _reaches_matmul(value: ir.Value) -> bool:
    for _ in range(8):
        node = value.producer()
        if node is None:
            return False
        if _is_op(node, "MatMul"):
            return True
        if not _is_op(node, "Mul", "Div", "Cast", "Identity"):
            return False
        value = node.inputs[0]
    return False


def _merged(model: ir.Model, attention_output: ir.Value) -> tuple[ir.Value, ir.Value | None]:
    """The ``[batch, seq, hidden]`` value the heads of ``softmax @ v`` are merged into, and torch's
    all-masked-row guard on the way (the condition of ``Where(cond, 0, x)``), if any."""
    value, guard, transposed = attention_output, None, False
    for _ in range(8):
        uses = list(value.uses())
        if len(uses) != 1:
            break
        node = uses[0].node
        if _is_op(node, "Where") and uses[0].idx == 2 and _fusion.scalar_of(model, node.inputs[1]) == 0.0 and guard is None:
            guard = node.inputs[0]
        elif _is_op(node, "Transpose") and _perm(node) == _HEADS_PERM and not transposed:
            transposed = True
        elif _is_op(node, "Reshape") and transposed:
            return node.outputs[0], guard
        elif not _is_op(node, "Reshape", "Identity"):
            break
        value = node.outputs[0]
    raise _fusion.Refused("the heads of softmax @ value are not merged back to [batch, seq, heads * head]")


def _past_nan_guard(model: ir.Model, probabilities: ir.Value) -> ir.Value:
    """The value after torch's NaN guard on the softmax, ``Where(IsNaN(p), 0, p)`` (its decomposition
    of ``scaled_dot_product_attention`` with static shapes), or ``probabilities`` when there is none;
    a ``Cast`` to float32 or an ``Identity`` on the way is passed (eager attention's ``.to(query.dtype)``).
    The guard zeroes rows whose scores are all ``-inf``; torch's masks are finite (``-3.4e38``), so
    such rows only come from inputs already holding NaN or infinity, which the fused op leaves as they are."""
    for _ in range(2):
        uses = list(probabilities.uses())
        node = uses[0].node if len(uses) == 1 else None
        if not (_is_op(node, "Identity") or (_is_op(node, "Cast") and node.attributes.get_int("to", 0) == ir.DataType.FLOAT)):
            break
        probabilities = node.outputs[0]
    uses = {(use.node.op_type, use.idx): use.node for use in probabilities.uses() if use.node.domain in ("", "ai.onnx")}
    isnan, where = uses.get(("IsNaN", 0)), uses.get(("Where", 2))
    if len(uses) != 2 or isnan is None or where is None or where.inputs[0] is not isnan.outputs[0]:
        return probabilities
    if _fusion.scalar_of(model, where.inputs[1]) != 0.0 or len(list(isnan.outputs[0].uses())) != 1:
        return probabilities
    return where.outputs[0]


def _head_count(model: ir.Model, side: _Side) -> int:
    """The heads of the per-head reshape: its shape constant's third entry, or the weight width
    divided by its fourth (the shape is often ``Concat(batch, seq, -1, head)``)."""
    shape = side.head_shape.inputs[1]
    tensor = _fusion.constant_of(model, shape)
    entries: list[float | None]
    if tensor is not None:
        entries = [float(v) for v in np.asarray(tensor.numpy()).reshape(-1)]
    else:
        concat = shape.producer()
        if not _is_op(concat, "Concat") or len(concat.inputs) != 4:
            raise _fusion.Refused("the per-head reshape's shape is neither a constant nor a Concat of four")
        entries = [_fusion.scalar_of(model, v) for v in concat.inputs]
    if len(entries) != 4:
        raise _fusion.Refused("the per-head reshape is not to four dimensions")
    heads, head = entries[2], entries[3]
    if heads is not None and heads > 0:
        return int(heads)
    if head is None or head <= 0:
        raise _fusion.Refused("the number of heads is not a constant of the body")
    return _width(model, side.projection) // int(head)


def _width(model: ir.Model, projection: ir.Node) -> int:
    """The output width of a projection, from its weight's shape in the main graph."""
    parts = _linear_parts(model, projection)
    sources = _fusion.sources_of(model, parts[0]) if parts is not None else []
    shapes = {tuple(s.shape) for s in sources if s.shape is not None}
    if len(shapes) != 1 or not isinstance(next(iter(shapes))[-1], int):
        raise _fusion.Refused("the projection's width is not known from the main graph")
    return next(iter(shapes))[-1]


def _analyse(model: ir.Model, function: ir.Function) -> _Attention:
    nodes = list(function)
    if not any(_is_op(n, "MatMul") for n in nodes) and any(_is_op(n, "TopK", "ArgMax") for n in nodes):
        raise _fusion.NotApplicable("a Softmax picking experts (TopK or ArgMax, no MatMul): a router, not attention")
    if any(_is_op(n, "Tanh") for n in nodes):
        raise _fusion.Refused("soft-capped scores (Tanh) are not fused")
    softmaxes = [n for n in nodes if _is_op(n, "Softmax")]
    if len(softmaxes) != 1:
        raise _fusion.Refused(f"{len(softmaxes)} Softmax nodes (one expected)")
    softmax = softmaxes[0]
    uses = list(_past_nan_guard(model, softmax.outputs[0]).uses())
    if not any(_is_op(use.node, "MatMul") for use in uses):  # first: a router's softmax is no attention left unfused
        raise _fusion.NotApplicable("the Softmax weights no values (a router or a classifier, not attention)")
    scores, after, bias = _scores(model, softmax)
    if len(uses) != 1 or not _is_op(uses[0].node, "MatMul") or uses[0].idx != 0:
        raise _fusion.Refused("the Softmax does not feed softmax @ value alone (attention weights returned?)")
    weighted = uses[0].node
    query, key = _side(model, scores.inputs[0], "query"), _side(model, scores.inputs[1], "key")
    value = _side(model, weighted.inputs[1], "value")
    if value.factor != 1.0:
        raise _fusion.Refused("the value is scaled")
    merged, guard = _merged(model, weighted.outputs[0])
    num_heads = _head_count(model, query)
    try:
        widths = [_width(model, side.projection) for side in (query, key, value)]
    except _fusion.Refused:
        widths = None  # not packed then
    return _Attention(query, key, value, merged, guard, bias, query.factor * key.factor * after, num_heads, widths)


def _has_cache(function: ir.Function) -> bool:
    formals, outputs = list(function.inputs), list(function.outputs)
    return any(_is_op(n, "Concat") and n.outputs[0] in outputs and any(v in formals for v in n.inputs) for n in function)


def _constant(name: str, array: np.ndarray) -> ir.Node:
    node = ir.node("Constant", [], attributes={"value": ir.tensor(array, name=name)}, name=name)
    node.outputs[0].name = name
    return node


class FuseMultiHeadAttentionPass(_fusion.FusionPass):
    """Attention bodies without a KV cache into one ``com.microsoft.Attention`` or ``MultiHeadAttention`` each.

    Attributes after a run: ``fused`` (the rewritten functions), ``reasons`` (function -> why not),
    ``packed`` (those whose query, key and value projections became one GEMM on packed weights),
    ``ops`` (function -> the op written).
    """

    def __init__(self, functions: set[ir.OperatorIdentifier] | None = None, pack_qkv: bool = True,
                 attention_op: bool = True):
        super().__init__(functions)
        self.pack_qkv = pack_qkv
        self.attention_op = attention_op  # packed projections with biases: com.microsoft.Attention

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.reset()
        for key, function in list(model.functions.items()):
            if not self.applies_to(key):
                continue
            if not any(_is_op(node, "Softmax") for node in function) or _has_cache(function):
                continue
            try:
                attention = _analyse(model, function)
                self._rewrite(model, function, attention)
            except _fusion.NotApplicable as skipped:
                self.skipped[key] = str(skipped)
                continue
            except _fusion.Refused as refused:
                self.reasons[key] = str(refused)
                continue
            self.fused.append(key)
        if self.fused:
            model.opset_imports.setdefault("com.microsoft", 1)
        if self.fused or self.reasons:  # formals the rewrites (or a refused packing) left unread
            _fusion.drop_unused_formals(model)
        return ir.passes.PassResult(model, modified=bool(self.fused))

    def _projections(self, model, function, attention: _Attention) -> tuple[list[ir.Node], list[ir.Value | None]]:
        """New nodes and the op's (query, key, value, bias): packed when the three read one input.
        For ``Attention`` (packed weights and biases), the (input, weights, bias) it takes instead."""
        q, k, v = (s.projection for s in (attention.query, attention.key, attention.value))
        one_input = q.inputs[0] is k.inputs[0] is v.inputs[0] and len({id(q), id(k), id(v)}) == 3
        if self.pack_qkv and one_input and attention.widths is not None:
            packed = _packed_projection(model, function, types.SimpleNamespace(q_proj=q, k_proj=k, v_proj=v))
            if packed:
                bias = packed[1].inputs[1] if len(packed) == 2 else None
                matmul = packed[0]
                self.packed.append(function.identifier())
                if self.attention_op and bias is not None:  # the GEMM inside the op, written in its head layout
                    return [], [matmul.inputs[0], matmul.inputs[1], bias]
                sizes = _constant("qkv_proj.split", np.array(attention.widths, np.int64))
                split = ir.node("Split", [matmul.outputs[0], sizes.outputs[0]], attributes={"axis": -1}, num_outputs=3,
                                name="qkv_proj.Split", metadata_props=dict(matmul.metadata_props))
                for output, role in zip(split.outputs, "qkv"):
                    output.name = f"qkv_proj_{role}"
                return [matmul, sizes, split], [*split.outputs, bias]
        return [], [q.outputs[0], k.outputs[0], v.outputs[0], None]

    def _rewrite(self, model: ir.Model, function: ir.Function, attention: _Attention) -> None:
        new, operands = self._projections(model, function, attention)
        attributes = {"num_heads": attention.num_heads, "scale": attention.scale}
        if len(operands) == 3:  # Attention(input, packed weights, packed bias, mask_index, past, attention_bias)
            op, inputs = "Attention", [*operands, None, None, attention.bias]
            if len(set(attention.widths)) != 1:
                attributes["qkv_hidden_sizes"] = attention.widths
        else:  # MultiHeadAttention(query, key, value, bias, key_padding_mask, attention_bias)
            op, inputs = "MultiHeadAttention", [*operands, None, attention.bias]
        mha = ir.node(op, inputs, attributes=attributes, domain="com.microsoft", name=op)
        self.ops[function.identifier()] = f"com.microsoft.{op}"
        new.append(mha)
        result = mha.outputs[0]
        if attention.guard is not None:  # torch's rows with every key masked give 0: [b, 1, s, 1] -> [b, s, 1]
            perm = ir.node("Transpose", [attention.guard], attributes={"perm": _HEADS_PERM}, name="mha.guard_rows")
            shape = _constant("mha.guard_shape", np.array([0, 0, -1], np.int64))
            rows = ir.node("Reshape", [perm.outputs[0], shape.outputs[0]], name="mha.guard")
            zero = _constant("mha.zero", np.array(0.0, np.float32))
            where = ir.node("Where", [rows.outputs[0], zero.outputs[0], result], name="mha.masked_rows")
            for node in (perm, rows, where):
                node.outputs[0].name = node.name
            new += [perm, shape, rows, zero, where]
            result = where.outputs[0]
        merged = attention.merged
        anchor = merged.producer()
        function.insert_before(anchor, new)
        name = merged.name
        ir.convenience.replace_all_uses_with(merged, result, replace_graph_outputs=True)
        _fusion.remove_dead_nodes(function)
        merged.name = f"{name}_unfused"
        result.name = name
        function.opset_imports.setdefault("com.microsoft", 1)
