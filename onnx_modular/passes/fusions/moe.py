"""ONNX IR pass: mixture-of-experts blocks into onnxruntime's ``com.microsoft.MoE``, in place.

A sparse block is recognised by what its body computes, not by its class: a call of an *experts*
function on the tokens ``[tokens, hidden]``, the top-k expert indices and their weights, where

- the indices and the weights come from one *router* (a call or the block's own nodes): logits
  ``x @ W^T`` (``Gemm``/``MatMul``, ``W`` an initializer), ``Softmax`` over the experts, ``TopK``
  (largest); the weights are the top-k probabilities (``normalize_routing_weights=0``), divided by
  their sum (``1``), or a ``Softmax`` of the top-k logits (the same as ``1``);
- the experts body is transformers 5's grouped dispatch: the token copies sorted by expert
  (``TopK`` smallest), counted per expert (``CumSum``), one ``Gather`` + ``MatMul`` per expert on
  its rows (the ``Range`` of its count's bounds, in expert order) for the gate/up projection and
  again for the down projection, between them onnxruntime's swiglu of the gate and up halves (a
  ``Split`` in two, or ``Slice``s of step 2): ``G * sigmoid(alpha * G) * (L + beta)`` with
  ``G = min(gate, limit)``, ``L = clip(up, -limit, limit)`` (``SiLU(gate) * up``: alpha 1, beta 0, no
  limit; GPT-OSS: 1.702, 1, 7), each expert's bias added to its rows or not, the products weighted and
  summed over the top k.

The block becomes: the router's logits (one ``Gemm``), one ``com.microsoft.MoE`` (``k``,
``activation_type="swiglu"`` with ``swiglu_fusion=1`` and the alpha, beta and limit read) on the
experts' weights (and biases) stacked once per layer in the main
graph (gate and up rows interleaved, ``[experts, 2 * inter, hidden]``, the only layout onnxruntime's
CPU kernel takes; down ``[experts, hidden, inter]``). What else the router and experts calls return
(transformers' token counts, integers of the input's shape) is computed by copies of their nodes.

``--quantize int4`` then turns each ``MoE`` into ``QMoE`` (the experts packed per expert, blocks of
32, ``accuracy_level`` 4: :mod:`onnx_modular.passes.precision.quantize_weights`).

This pass does not check the numbers: ``onnx_modular.files.optimize.tool`` runs each rewrite on
the file's real calls and keeps it only when the outputs agree. ``reasons`` says why a block with
a router and experts was not rewritten.

Example::

    FuseMoEPass()(model)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from onnx_modular.passes.fusions import base as _fusion

__all__ = ["FuseMoEPass", "MOE_OP"]

MOE_OP = "com.microsoft.MoE"
#: Nodes the router may put between its ops (float32: casts to the same type, reshapes to [-1, hidden]).
_PASS_THROUGH = ("Cast", "Identity")
#: The most nodes copied to compute an output of a removed call (a shape's product).
_MAX_COPIED = 16


@dataclasses.dataclass
class _Router:
    call: ir.Node | None  # the router's call in the block (None: the block's own nodes)
    logits: ir.Node  # Gemm or MatMul computing the logits (in the router's body)
    k: int
    normalize: bool
    experts: int


@dataclasses.dataclass
class _Swiglu:
    """``act(gate) * up`` as MoE's swiglu: ``G * sigmoid(alpha * G) * (L + beta)``, ``G = min(gate, limit)``,
    ``L = clip(up, -limit, limit)``."""

    gate_first: bool = True  # [gate | up] halves: the gate is the first
    interleaved: bool = False  # gate and up columns alternate (GPT-OSS's [..., ::2] and [..., 1::2])
    alpha: float = 1.0
    beta: float = 0.0
    limit: float | None = None


@dataclasses.dataclass
class _Experts:
    call: ir.Node
    hidden: ir.Value  # in the block: the tokens [tokens, hidden]
    indices: ir.Value  # in the block: top-k expert indices
    weights: ir.Value  # in the block: top-k routing weights
    up: list[ir.Value]  # in the block: per expert [hidden, 2 * inter] (x @ W), in expert order
    down: list[ir.Value]  # in the block: per expert [inter, hidden]
    swiglu: _Swiglu
    output: int  # the experts call's output holding the result
    biases: tuple[ir.Value | None, ir.Value | None] = (None, None)  # in the block: [experts, 2 * inter], [experts, hidden]


def _callee(model: ir.Model, node: ir.Node | None) -> ir.Function | None:
    return None if node is None else model.functions.get(node.op_identifier())


def _outer(call: ir.Node | None, callee: ir.Function | None, value: ir.Value | None) -> ir.Value | None:
    """The caller's value for ``value`` of ``callee`` (a formal input), or ``value`` when there is no call."""
    if call is None or value is None:
        return value
    inputs = list(callee.inputs)
    if value not in inputs:
        return None
    index = inputs.index(value)
    return call.inputs[index] if index < len(call.inputs) else None


def _through(value: ir.Value | None, ops=_PASS_THROUGH) -> ir.Value | None:
    """``value`` behind any casts and identities."""
    while value is not None and value.producer() is not None and value.producer().op_type in ops:
        value = value.producer().inputs[0]
    return value


def _int(model: ir.Model, value: ir.Value | None) -> int | None:
    number = _fusion.scalar_of(model, value)
    return None if number is None or number != int(number) else int(number)


def _last_axis(node: ir.Node, default: int = -1) -> bool:
    axis = node.attributes.get_int("axis", default)
    rank = len(node.inputs[0].shape) if node.inputs[0] is not None and node.inputs[0].shape is not None else None
    return axis == -1 or (rank is not None and axis == rank - 1)


def _shape_of(model: ir.Model, value: ir.Value) -> tuple[int, ...]:
    """The one static shape every source of ``value`` has (initializers), else refused."""
    sources = _fusion.sources_of(model, value)
    if not sources or not all(s.is_initializer() and s.const_value is not None for s in sources):
        raise _fusion.Refused(f"a weight ({value.name!r}) is not an initializer of the file at every call")
    shapes = {tuple(s.const_value.shape) for s in sources}
    if len(shapes) != 1:
        raise _fusion.Refused(f"the calls pass weights of different shapes for {value.name!r}")
    return shapes.pop()


# -- the router --------------------------------------------------------------------------------

def _inside(model: ir.Model, value: ir.Value) -> tuple[ir.Value, ir.Node | None, ir.Function | None]:
    """The value computing ``value``: inside the callee when a call returns it."""
    node = value.producer()
    callee = _callee(model, node)
    if callee is None:
        return value, None, None
    return callee.outputs[list(node.outputs).index(value)], node, callee


def _softmax_of(value: ir.Value | None) -> ir.Node:
    node = _through(value).producer() if value is not None else None
    if node is None or node.op_type != "Softmax" or not _last_axis(node):
        raise _fusion.Refused("the router's top-k does not read a Softmax over the experts (last axis)")
    return node


def _router(model: ir.Model, indices: ir.Value, weights: ir.Value) -> tuple[_Router, ir.Value, ir.Value, ir.Value | None]:
    """The router behind the experts' indices and weights; with the block's values of its input, its weight and bias."""
    inner_i, call, callee = _inside(model, indices)
    inner_w, call_w, _ = _inside(model, weights)
    if call is not call_w:
        raise _fusion.Refused("the expert indices and the routing weights do not come from one router")
    topk = inner_i.producer()
    if topk is None or topk.op_type != "TopK" or topk.outputs[1] is not inner_i:
        kind = " (they are picked by ArgMax: a sparse mixer, PhiMoE's)" if callee is not None and any(
            n.op_type == "ArgMax" for n in callee) else ""
        raise _fusion.Refused(f"the expert indices are not the indices of a TopK{kind}; MoE takes a softmax top-k router")
    if not topk.attributes.get_int("largest", 1) or not _last_axis(topk):
        raise _fusion.Refused("the router's TopK does not take the largest over the experts")
    k = _int(model, topk.inputs[1])
    if k is None:
        raise _fusion.Refused("the router's k is not one constant")
    values = topk.outputs[0]
    weight_node = _through(inner_w).producer()
    if _through(inner_w) is values:  # the top-k probabilities as they are
        normalize, logits = False, _softmax_of(topk.inputs[0]).inputs[0]
    elif weight_node is not None and weight_node.op_type == "Div" and _through(weight_node.inputs[0]) is values:
        total = _through(weight_node.inputs[1]).producer()
        if total is None or total.op_type != "ReduceSum" or _through(total.inputs[0]) is not values or \
                not total.attributes.get_int("keepdims", 1) or _int(model, total.inputs[1]) not in (-1, 1):
            raise _fusion.Refused("the routing weights are divided by something other than their sum")
        normalize, logits = True, _softmax_of(topk.inputs[0]).inputs[0]
    elif weight_node is not None and weight_node.op_type == "Softmax" and _through(weight_node.inputs[0]) is values \
            and _last_axis(weight_node):  # the top-k logits softmaxed (Granite-MoE): normalized probabilities
        normalize, logits = True, topk.inputs[0]
    else:
        raise _fusion.Refused("the routing weights are not the top-k probabilities of a Softmax, normalized or not "
                              "(what MoE's normalize_routing_weights takes)")
    node = _through(logits).producer()
    if node is None or node.op_type not in ("Gemm", "MatMul"):
        raise _fusion.Refused("the router's logits are not a Gemm or MatMul of the tokens")
    transposed = node.op_type == "Gemm" and bool(node.attributes.get_int("transB", 0))
    if node.op_type == "Gemm" and (node.attributes.get_int("transA", 0) or node.attributes.get_float("alpha", 1.0) != 1.0
                                   or node.attributes.get_float("beta", 1.0) != 1.0):
        raise _fusion.Refused("the router's Gemm has transA, alpha or beta")
    outer = [_outer(call, callee, v) for v in node.inputs]
    if any(v is None for v in outer[1:]):
        raise _fusion.Refused("the router's weight is computed inside the router")
    tokens = _through(node.inputs[0], _PASS_THROUGH + ("Reshape",))
    hidden = _outer(call, callee, tokens)
    shape = _shape_of(model, outer[1])
    if len(shape) != 2:
        raise _fusion.Refused("the router's weight is not a matrix")
    router = _Router(call, node, k, normalize, shape[0] if transposed else shape[1])
    return router, hidden, outer[1], outer[2] if len(outer) > 2 else None


# -- the experts -------------------------------------------------------------------------------

def _is_silu(model: ir.Model, value: ir.Value, x: ir.Value) -> bool:
    """``value`` is ``x * sigmoid(x)`` (inline, or a call of a body computing just that)."""
    node = value.producer()
    callee = _callee(model, node)
    if callee is not None:
        nodes = list(callee)
        if len(nodes) != 2 or node.inputs[0] is not x or len(callee.outputs) != 1:
            return False
        return _silu_nodes(nodes, callee.inputs[0], callee.outputs[0])
    if node is None or node.op_type != "Mul":
        return False
    sigmoid = next((v.producer() for v in node.inputs if v.producer() is not None and v.producer().op_type == "Sigmoid"), None)
    return sigmoid is not None and _silu_nodes([sigmoid, node], x, value)


def _silu_nodes(nodes: list[ir.Node], x: ir.Value, output: ir.Value) -> bool:
    sigmoid, mul = sorted(nodes, key=lambda n: n.op_type != "Sigmoid")
    return (sigmoid.op_type == "Sigmoid" and sigmoid.inputs[0] is x and mul.op_type == "Mul"
            and set(map(id, mul.inputs)) == {id(x), id(sigmoid.outputs[0])} and mul.outputs[0] is output)


def _squeezed(value: ir.Value) -> ir.Value:
    node = value.producer()
    return node.inputs[0] if node is not None and node.op_type in ("Squeeze", "Reshape") else value


def _expert_rows(model: ir.Model, matmuls: list[ir.Node], what: str) -> ir.Value:
    """The value whose rows the MatMuls take, expert by expert: MatMul j reads ``Gather(rows, Range(b[j-1], b[j]))``
    with ``b`` the outputs of one ``Split`` of the experts' cumulative counts (``b[-1]`` = 0). Returns ``rows``."""
    rows, split = None, None
    for position, matmul in enumerate(matmuls):
        gather = matmul.inputs[0].producer() if matmul.inputs[0] is not None else None
        if gather is None or gather.op_type != "Gather" or gather.attributes.get_int("axis", 0) != 0:
            raise _fusion.Refused(f"the {what} projection of expert {position} does not take a Gather of its rows")
        ranged = gather.inputs[1].producer()
        if ranged is None or ranged.op_type != "Range":
            raise _fusion.Refused(f"the {what} rows of expert {position} are not a Range")
        end = _squeezed(ranged.inputs[1]).producer()
        split = split or end
        if end is None or end is not split or end.op_type != "Split" or _squeezed(ranged.inputs[1]) is not end.outputs[position]:
            raise _fusion.Refused(f"the {what} rows of expert {position} do not end at its count (the experts out of order)")
        start = _squeezed(ranged.inputs[0])
        if (position == 0 and _int(model, start) != 0) or (position and start is not end.outputs[position - 1]):
            raise _fusion.Refused(f"the {what} rows of expert {position} do not start where expert {position - 1}'s end")
        if rows is not None and gather.inputs[0] is not rows:
            raise _fusion.Refused(f"the experts' {what} projections read different tokens")
        rows = gather.inputs[0]
    counted = _through(split.inputs[0]).producer() if split is not None else None
    if counted is None or counted.op_type != "CumSum":
        raise _fusion.Refused(f"the {what} rows are not cut at the experts' cumulative counts (CumSum)")
    return rows


def _expert_matmuls(function: ir.Function) -> tuple[ir.Node, ir.Node]:
    """The two ``Concat`` (axis 0) of per-expert MatMuls: gate/up, then down."""
    concats = [n for n in function if n.op_type == "Concat" and n.attributes.get_int("axis", 0) == 0 and len(n.inputs) > 1
               and all(v is not None and v.producer() is not None and v.producer().op_type == "MatMul" for v in n.inputs)]
    if len(concats) != 2 or len(concats[0].inputs) != len(concats[1].inputs):
        raise _fusion.NotApplicable("no two groups of per-expert MatMuls (gate/up and down)")
    return concats[0], concats[1]


def _halves(model: ir.Model, value: ir.Value) -> tuple[ir.Value, ir.Value, bool]:
    """The two halves of the gate/up product: a ``Split`` in two (``[first | second]``), or two ``Slice``s of
    step 2 from 0 and 1 on the last axis (columns alternating). Returns (first, second, interleaved)."""
    users = [u for u, _ in value.uses()]
    split = next((u for u in users if u.op_type == "Split"), None)
    if split is not None and len(split.outputs) == 2 and _last_axis(split, 0) and (len(split.inputs) < 2 or split.inputs[1] is None):
        return split.outputs[0], split.outputs[1], False
    slices = {}
    for node in (u for u in users if u.op_type == "Slice" and len(u.inputs) == 5):
        start, end, axis, step = (_int(model, v) for v in node.inputs[1:])
        if step == 2 and axis in (-1, 1) and end is not None and end >= 2 ** 62:
            slices[start] = node.outputs[0]
    if set(slices) == {0, 1}:
        return slices[0], slices[1], True
    raise _fusion.Refused("the gate/up product is not cut into gate and up (a Split in two halves, or Slices of step 2)")


def _clipped(model: ir.Model, value: ir.Value, source: ir.Value) -> tuple[float | None, float | None] | None:
    """``value`` is ``source`` (``(None, None)``) or ``Clip(source, low, high)`` with constant bounds; else ``None``."""
    if value is source:
        return None, None
    node = value.producer()
    if node is None or node.op_type != "Clip" or node.inputs[0] is not source:
        return None
    given = [node.inputs[i] if len(node.inputs) > i else None for i in (1, 2)]
    bounds = [None if v is None else _fusion.scalar_of(model, v) for v in given]
    if any(v is not None and b is None for v, b in zip(given, bounds)):
        return None  # a bound computed in the body
    return bounds[0], bounds[1]


def _gate_side(model: ir.Model, value: ir.Value, gate: ir.Value) -> tuple[float, float | None] | None:
    """``value`` is ``G * sigmoid(alpha * G)`` with ``G`` the gate or ``min(gate, limit)``: (alpha, limit), else ``None``."""
    if _is_silu(model, value, gate):
        return 1.0, None
    node = value.producer()
    if node is not None and node.op_type == "QuickGelu" and node.domain == "com.microsoft":  # the activation step's
        bounds = _clipped(model, node.inputs[0], gate)
        if bounds is None or bounds[0] is not None:
            return None
        return node.attributes.get_float("alpha", 1.702), bounds[1]
    if node is None or node.op_type != "Mul":
        return None
    for clipped, sigmoid in (node.inputs, reversed(node.inputs)):
        sig = sigmoid.producer()
        bounds = _clipped(model, clipped, gate)
        if sig is None or sig.op_type != "Sigmoid" or bounds is None or bounds[0] is not None:
            continue
        inner = sig.inputs[0]
        if inner is clipped:
            return 1.0, bounds[1]
        scaled = inner.producer()
        if scaled is not None and scaled.op_type == "Mul" and clipped in scaled.inputs:
            alpha = _fusion.scalar_of(model, next((v for v in scaled.inputs if v is not clipped), None))
            if alpha is not None:
                return alpha, bounds[1]
    return None


def _up_side(model: ir.Model, value: ir.Value, up: ir.Value) -> tuple[float, tuple[float | None, float | None]] | None:
    """``value`` is ``L`` or ``L + beta`` with ``L`` the up half, clipped or not: (beta, (low, high)), else ``None``."""
    node = value.producer()
    beta = 0.0
    if node is not None and node.op_type == "Add" and _clipped(model, value, up) is None:
        other = [v for v in node.inputs if _clipped(model, v, up) is not None]
        if not other:
            return None
        beta = _fusion.scalar_of(model, next((v for v in node.inputs if v is not other[0]), None))
        if beta is None:
            return None
        value = other[0]
    bounds = _clipped(model, value, up)
    return None if bounds is None else (beta, bounds)


def _swiglu(model: ir.Model, gate_up: ir.Value, down_rows: ir.Value) -> _Swiglu:
    """What the down projections read, as MoE's swiglu of the gate/up product's halves, or refused."""
    first, second, interleaved = _halves(model, gate_up)
    product = down_rows.producer()
    if product is None or product.op_type != "Mul" or len(product.inputs) != 2:
        raise _fusion.Refused("the down projection does not read a product of the gate and the up halves")
    for gate_index in (0, 1):
        gate, up = (first, second) if gate_index == 0 else (second, first)
        for a, b in (product.inputs, list(reversed(product.inputs))):
            gated, lifted = _gate_side(model, a, gate), _up_side(model, b, up)
            if gated is None or lifted is None:
                continue
            (alpha, limit), (beta, (low, high)) = gated, lifted
            if (limit, low, high) != (None, None, None) and (limit is None or high != limit or low != -limit):
                raise _fusion.Refused("the gate and the up halves are clamped differently (MoE's swiglu_limit clamps the "
                                      "gate below limit and the up within [-limit, limit])")
            return _Swiglu(gate_index == 0, interleaved, alpha, beta, limit)
    raise _fusion.Refused("the experts' activation is not SiLU(gate) * up (MoE's swiglu takes only that, "
                          "with alpha, beta and a clamp)")


def _bias(model: ir.Model, value: ir.Value, sort: ir.Node, formals: list[ir.Value]) -> tuple[ir.Value, ir.Value | None]:
    """``value`` behind an ``Add`` of each row's expert bias (``GatherND`` of a formal by the sorted expert ids):
    (the sum, the bias formal); or (``value``, ``None``) when no bias is added."""
    add = next((u for u, _ in value.uses() if u.op_type == "Add"), None)
    if add is None or len(value.uses()) != 1:
        return value, None
    rows = next((v for v in add.inputs if v is not value), None)
    gather = rows.producer() if rows is not None else None
    if gather is None or gather.op_type != "GatherND" or gather.inputs[0] not in formals:
        raise _fusion.Refused("something other than each expert's bias is added to its projection")
    index = gather.inputs[1]
    for _ in range(4):  # Unsqueeze, Expand of the sorted expert ids
        if index is sort.outputs[0] or index.producer() is None:
            break
        index = index.producer().inputs[0]
    if index is not sort.outputs[0]:
        raise _fusion.Refused("the experts' biases are not taken by the sorted expert ids")
    return add.outputs[0], gather.inputs[0]


def _experts(model: ir.Model, call: ir.Node) -> _Experts:
    function = _callee(model, call)
    up, down = _expert_matmuls(function)
    nodes = list(function)
    if nodes.index(down) < nodes.index(up):
        up, down = down, up
    up_matmuls = [v.producer() for v in up.inputs]
    down_matmuls = [v.producer() for v in down.inputs]
    tokens = _expert_rows(model, up_matmuls, "gate/up")
    formals = list(function.inputs)
    if any(m.inputs[1] not in formals for m in up_matmuls + down_matmuls):
        raise _fusion.Refused("an expert's weight is computed inside the experts")
    sort = next((n for n in nodes if n.op_type == "TopK" and not n.attributes.get_int("largest", 1)), None)
    gathered = tokens.producer()
    if sort is None or gathered is None or gathered.op_type != "GatherND" or gathered.inputs[0] not in formals:
        raise _fusion.Refused("the experts do not take the tokens sorted by expert (TopK smallest, GatherND)")
    gate_up, up_bias = _bias(model, up.outputs[0], sort, formals)
    swiglu = _swiglu(model, gate_up, _expert_rows(model, down_matmuls, "down"))
    if up_bias is not None and not (swiglu.interleaved and swiglu.gate_first):
        raise _fusion.Refused("gate/up biases not laid out gate 0, up 0, gate 1, ... (only those are written)")
    result, down_bias = _bias(model, down.outputs[0], sort, formals)
    indices = _through(sort.inputs[0], _PASS_THROUGH + ("Reshape",))
    weighted = next((u for u, _ in result.uses() if u.op_type == "Mul"), None)
    weights = None
    if weighted is not None:
        other = next(v for v in weighted.inputs if v is not result)
        for _ in range(8):  # Unsqueeze, GatherND (by the sort), Reshape of the weights formal
            if other in formals or other.producer() is None:
                break
            other = other.producer().inputs[0]
        weights = other if other in formals else None
    if indices not in formals or weights is None or not any(n.op_type == "ReduceSum" for n in nodes):
        raise _fusion.Refused("the experts' outputs are not weighted by the routing weights and summed over the top k")
    output = next((i for i, v in enumerate(function.outputs) if v.dtype is not None and v.dtype.is_floating_point()), None)
    if output is None:
        raise _fusion.Refused("the experts return no tensor")
    return _Experts(call, _outer(call, function, gathered.inputs[0]), _outer(call, function, indices),
                    _outer(call, function, weights), [_outer(call, function, m.inputs[1]) for m in up_matmuls],
                    [_outer(call, function, m.inputs[1]) for m in down_matmuls], swiglu, output,
                    (_outer(call, function, up_bias), _outer(call, function, down_bias)))


# -- the rewrite -------------------------------------------------------------------------------

def _copies(call: ir.Node, callee: ir.Function, value: ir.Value) -> tuple[list[ir.Node], ir.Value]:
    """Copies (for the caller) of the callee's nodes computing ``value``: an output of a call that goes."""
    made: dict[int, ir.Value] = {id(f): a for f, a in zip(callee.inputs, call.inputs)}
    nodes: list[ir.Node] = []

    def copy(v: ir.Value) -> ir.Value:
        if id(v) in made:
            return made[id(v)]
        node = v.producer()
        if node is None or node.domain not in ("", "ai.onnx") or len(nodes) >= _MAX_COPIED:
            raise _fusion.Refused(f"the output {v.name!r} of a call that goes cannot be computed apart")
        inputs = [None if i is None else copy(i) for i in node.inputs]
        new = ir.Node(node.domain, node.op_type, inputs, attributes=list(node.attributes.values()),
                      num_outputs=len(node.outputs), name=f"moe.{node.name or node.op_type}")
        for old, out in zip(node.outputs, new.outputs):
            made[id(old)] = out
            out.name, out.dtype, out.shape = f"moe.{old.name}", old.dtype, old.shape
        nodes.append(new)
        return made[id(v)]

    return nodes, copy(value)


def _interleaved(arrays: list[np.ndarray], swiglu: _Swiglu) -> np.ndarray:
    """Per-expert ``[hidden, 2 * inter]`` (``x @ W``, [gate | up] columns, or alternating) -> ``[experts, 2 * inter,
    hidden]``, rows gate 0, up 0, gate 1, up 1, ... (``swiglu_fusion=1``)."""
    stacked = np.stack([a.T for a in arrays])
    if swiglu.interleaved and swiglu.gate_first:
        return stacked
    inter = stacked.shape[1] // 2
    if swiglu.interleaved:  # up 0, gate 0, up 1, ...
        gate, up = stacked[:, 1::2], stacked[:, 0::2]
    else:
        gate, up = (stacked[:, :inter], stacked[:, inter:]) if swiglu.gate_first else (stacked[:, inter:], stacked[:, :inter])
    result = np.empty_like(stacked)
    result[:, 0::2], result[:, 1::2] = gate, up
    return result


class FuseMoEPass(_fusion.FusionPass):
    """Sparse mixture-of-experts blocks (router + grouped experts) into one ``com.microsoft.MoE`` each.

    Attributes after a run: ``fused`` (the rewritten block functions), ``reasons`` (function -> why
    not), ``skipped`` (bodies with per-expert MatMuls that are no sparse block).
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.reset()
        found = []
        for key, function in list(model.functions.items()):
            if not self.applies_to(key):
                continue
            for node in function:
                callee = _callee(model, node)
                if callee is None or sum(n.op_type == "MatMul" for n in callee) < 2 or not any(n.op_type == "Concat" for n in callee):
                    continue
                try:
                    experts = _experts(model, node)
                    router, hidden, weight, bias = _router(model, experts.indices, experts.weights)
                    self._check(model, experts, router, hidden)
                except _fusion.NotApplicable:
                    continue
                except _fusion.Refused as refused:
                    self.reasons[key] = str(refused)
                    continue
                found.append((key, function, experts, router, weight, bias))
        removed: set[ir.OperatorIdentifier] = set()
        for key, function, experts, router, weight, bias in found:
            try:
                removed |= self._rewrite(model, function, experts, router, weight, bias)
            except _fusion.Refused as refused:
                self.reasons[key] = str(refused)
                continue
            self.fused.append(key)
        if self.fused:
            model.opset_imports.setdefault("com.microsoft", 1)
            _remove_uncalled(model, removed)
        if found:  # the per-expert weights' formals, and a refused rewrite's packed formals
            _fusion.drop_unused_formals(model)
        return ir.passes.PassResult(model, modified=bool(self.fused))

    @staticmethod
    def _check(model: ir.Model, experts: _Experts, router: _Router, hidden: ir.Value) -> None:
        if hidden is not experts.hidden:
            raise _fusion.Refused("the router and the experts read different tokens")
        if len(experts.up) != router.experts:
            raise _fusion.Refused(f"{len(experts.up)} experts but {router.experts} router columns")
        if not 0 < router.k <= router.experts:
            raise _fusion.Refused(f"k = {router.k} for {router.experts} experts")
        ups = {_shape_of(model, v) for v in experts.up}
        downs = {_shape_of(model, v) for v in experts.down}
        if len(ups) != 1 or len(downs) != 1:
            raise _fusion.Refused("the experts' weights differ in shape")
        (width, double), (inter, out) = ups.pop(), downs.pop()
        if double != 2 * inter or width != out:
            raise _fusion.Refused(f"gate/up weights {width}x{double} do not fit down weights {inter}x{out}")
        if experts.hidden.shape is not None and len(experts.hidden.shape) != 2:
            raise _fusion.Refused("the experts' tokens are not [tokens, hidden]")

    @staticmethod
    def _kept_outputs(experts: _Experts, router: _Router) -> list[tuple[ir.Node, int]]:
        """The outputs of the calls that go which something else reads: integers (token counts), copied."""
        result = experts.call.outputs[experts.output]
        kept = []
        for call in (c for c in (experts.call, router.call) if c is not None):
            for index, output in enumerate(call.outputs):
                users = [u for u, _ in output.uses() if u is not experts.call]
                if output is result or not (users or output.is_graph_output()):
                    continue
                if output.dtype is None or output.dtype.is_floating_point():
                    raise _fusion.Refused(f"the output {output.name!r} of the router or the experts is read by more than "
                                          "the experts (MoE returns only the block's result)")
                kept.append((call, index))
        return kept

    def _rewrite(self, model, function, experts: _Experts, router: _Router, weight, bias) -> set:
        kept = self._kept_outputs(experts, router)
        fc1 = _fusion.pack_formals(model, function, experts.up, "fc1_experts_weights",
                                   combine=lambda arrays: _interleaved(arrays, experts.swiglu))
        fc2 = _fusion.pack_formals(model, function, experts.down, "fc2_experts_weights",
                                   combine=lambda arrays: np.stack([a.T for a in arrays]))
        if fc1 is None or fc2 is None:
            raise _fusion.Refused("the experts' weights are not main-graph initializers at every call")
        made: list[ir.Node] = []
        if router.call is None:
            logits = router.logits.outputs[0]
        else:
            inputs = [experts.hidden, weight] + ([bias] if bias is not None else [])
            node = ir.Node("", router.logits.op_type, inputs, attributes=list(router.logits.attributes.values()),
                           name="moe.router_logits")
            node.outputs[0].name = "moe.router_logits"
            made.append(node)
            logits = node.outputs[0]
        swiglu = experts.swiglu
        attributes = {"k": router.k, "normalize_routing_weights": int(router.normalize), "activation_type": "swiglu",
                      "swiglu_fusion": 1, "activation_alpha": swiglu.alpha, "activation_beta": swiglu.beta, "use_sparse_mixer": 0}
        if swiglu.limit is not None:
            attributes["swiglu_limit"] = swiglu.limit
        moe = ir.node("MoE", [experts.hidden, logits, fc1, experts.biases[0], fc2, experts.biases[1]],
                      domain="com.microsoft", name="MoE", attributes=attributes)
        made.append(moe)
        result = experts.call.outputs[experts.output]
        moe.outputs[0].dtype, moe.outputs[0].shape = result.dtype, result.shape
        replaced = [(result, moe.outputs[0])]
        for call, index in kept:  # copies of the nodes computing them, from the call's arguments
            callee = _callee(model, call)
            nodes, value = _copies(call, callee, callee.outputs[index])
            made += nodes
            replaced.append((call.outputs[index], value))
        function.insert_before(experts.call, made)
        for old, new in replaced:
            old.replace_all_uses_with(new, replace_graph_outputs=True)
        function.opset_imports.setdefault("com.microsoft", 1)
        gone = [c for c in (experts.call, router.call) if c is not None]
        for call in gone:
            function.remove(call, safe=True)
        _fusion.remove_dead_nodes(function)
        for old, new in replaced:
            new.name = old.name
        return {c.op_identifier() for c in gone}


def _remove_uncalled(model: ir.Model, keys: set) -> None:
    """Drop the functions of ``keys`` (and what they call) no body calls any more."""
    for _ in range(8):
        sites = _fusion.call_sites(model)
        gone = [k for k in keys if k in model.functions and not sites.get(k)]
        if not gone:
            return
        for key in gone:
            keys |= {n.op_identifier() for n in model.functions[key] if n.op_identifier() in model.functions}
            del model.functions[key]
