"""What the ``GroupQueryAttention`` fusion reads on the scores of an attention body, beside its
projections: the scale and soft-cap around ``q @ k`` (Gemma 2's ``c * tanh(scores / c)`` is the op's
``softcap``), the formal inputs that only mask the scores, and the sliding window of a mask (the op's
``local_window_size``), read in the body that computes it. Used by :mod:`onnx_modular.passes.fusions.gqa`.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx_ir as ir

from onnx_modular.passes.fusions import base as _fusion


def producers_bfs(start: ir.Value, stop) -> Iterable[ir.Node]:
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


def ancestors(value: ir.Value) -> set[int]:
    return {id(node) for node in producers_bfs(value, lambda n: False)}


def _factor(model: ir.Model, node: ir.Node, index: int) -> float | None:
    """The constant factor ``node`` (a ``Mul``, or a ``Div`` of its first input) applies to its input ``index``."""
    if node.op_type not in ("Mul", "Div") or (node.op_type == "Div" and index != 0):
        return None
    number = _fusion.scalar_of(model, node.inputs[1 - index])
    if number is None or number == 0:
        return None
    return number if node.op_type == "Mul" else 1.0 / number


def _only_use(value: ir.Value) -> tuple[ir.Node, int] | None:
    uses = list(value.uses())
    return (uses[0].node, uses[0].idx) if len(uses) == 1 else None


def scale_and_softcap(model: ir.Model, scores: ir.Node) -> tuple[float, float]:
    """The product of the constant factors on the query and key before ``q @ k`` and on the scores
    after it, and the soft-cap ``c`` of ``c * tanh(scores / c)`` on the scaled scores (0: none)."""
    scale, softcap = 1.0, 0.0
    for operand in scores.inputs:
        producer = operand.producer() if operand is not None else None
        if producer is not None and producer.op_type == "Mul":
            for factor in producer.inputs:
                number = _fusion.scalar_of(model, factor)
                if number is not None:
                    scale *= number
    value, last = scores.outputs[0], None
    while (use := _only_use(value)) is not None:
        node, index = use
        if node.op_type == "Tanh":
            after = _only_use(node.outputs[0])
            cap = _factor(model, *after) if after is not None else None
            if softcap or last is None or cap is None or cap <= 0 or abs(cap * last - 1.0) > 1e-6:
                raise _fusion.Refused("a Tanh on the scores that is not softcap * tanh(scores / softcap)")
            scale /= last  # the division by the cap is not part of the scale
            softcap, value, last = cap, after[0].outputs[0], None
            continue
        factor = _factor(model, node, index)
        if factor is None:
            break
        if softcap:
            raise _fusion.Refused("a factor on the scores after the soft-cap (GroupQueryAttention scales before it)")
        scale, last, value = scale * factor, factor, node.outputs[0]
    return scale, softcap  # no factor at all: the body computes softmax(q @ k) unscaled (Granite's multiplier 1)


def check_scores(softmax: ir.Node, scores: ir.Node) -> None:
    """What the op computes, proven on the structure (not left to verification, which ``--no-verify``
    skips): a ``Softmax`` over the last axis (the keys), scores that are a linear function of ``q @ k``
    (no ``Pow``, nothing multiplied by itself), and a mask on them (an ``Add`` or ``Where`` of a value
    that does not come from the scores): the op masks, a body without one does not."""
    rank = len(softmax.inputs[0].shape) if softmax.inputs[0].shape is not None else None
    axis = softmax.attributes.get_int("axis", -1)
    if axis != -1 and (rank is None or axis != rank - 1):
        raise _fusion.Refused(f"a Softmax over axis {axis}, not over the keys (the last axis)")
    behind = ancestors(softmax.inputs[0])
    path, queue, masked = {id(scores.outputs[0])}, [scores.outputs[0]], False
    while queue:
        for use in queue.pop().uses():
            node = use.node
            if id(node) not in behind and node is not softmax:
                continue
            from_scores = [v for v in node.inputs if v is not None and id(v) in path]
            if node.op_type == "Pow" or (node.op_type in ("Mul", "Div") and len(node.inputs) == 2 and len(from_scores) == 2):
                raise _fusion.Refused(f"the scores go through {node.op_type} with themselves (not q @ k scaled)")
            if node.op_type in ("Add", "Where") and len(from_scores) < len([v for v in node.inputs if v is not None]):
                masked = True
            if node is softmax:
                continue
            for output in node.outputs:
                if id(output) not in path:
                    path.add(id(output))
                    queue.append(output)
    if not masked:
        raise _fusion.Refused("no mask on the scores (the op masks them causally)")


def mask_formals(model: ir.Model, function: ir.Function, softmax: ir.Node, scores: ir.Node) -> tuple[int, ...]:
    """The formal inputs that reach the scores only after ``q @ k`` (the attention mask), not constants."""
    between = ancestors(softmax.inputs[0]) - ancestors(scores.outputs[0])
    found = []
    for index, formal in enumerate(function.inputs):
        if any(id(use.node) in between for use in formal.uses()) and _fusion.constant_of(model, formal) is None:
            found.append(index)
    return tuple(found)


#: A mask whose window cannot be read (:func:`window_of`): the calls are left unfused.
UNREADABLE = "unreadable"
#: Comparisons of a key position with ``query position - c``: (the operand holding the ``Sub``, window - c).
WINDOW_COMPARISONS = {"Greater": (1, 0), "GreaterOrEqual": (1, 1), "Less": (0, 0), "LessOrEqual": (0, 1)}


def window_of(model: ir.Model, mask: ir.Value) -> int | str | None:
    """The sliding window ``W`` of a mask computed in its body (keys with ``kv > q - W``:
    transformers' ``sliding_window_overlay``), ``None`` without one, :data:`UNREADABLE` when the
    mask compares positions with a constant offset in another way or divides them (chunked attention)."""
    windows = set()
    for node in producers_bfs(mask, lambda n: False):
        dtype = node.outputs[0].dtype
        if node.op_type == "Mod" or (node.op_type == "Div" and (dtype is None or not dtype.is_floating_point())):
            return UNREADABLE  # positions divided: chunked attention (Llama 4), or a type the body does not say
        if node.op_type not in WINDOW_COMPARISONS:
            continue
        side, extra = WINDOW_COMPARISONS[node.op_type]
        for index, operand in enumerate(node.inputs):
            producer = operand.producer() if operand is not None else None
            if producer is None or producer.op_type != "Sub":
                continue
            offset = _fusion.scalar_of(model, producer.inputs[1])
            if offset is None:
                continue
            if index != side or offset != int(offset):
                return UNREADABLE
            windows.add(int(offset) + extra)
    if len(windows) > 1:
        return UNREADABLE
    return windows.pop() if windows else None


def _position_axis(model: ir.Model, value: ir.Value | None, depth: int = 0) -> tuple[int, int] | None:
    """``(rank, axis)`` of a tensor of positions (a ``Range``, offset by a scalar, cast, unsqueezed): the
    axis its positions run along, or ``None`` when ``value`` is not read as such."""
    node = value.producer() if value is not None else None
    if node is None or depth > 16:
        return None
    if node.op_type == "Range":
        return 1, 0
    if node.op_type in ("Cast", "Identity"):
        return _position_axis(model, node.inputs[0], depth + 1)
    if node.op_type == "Add" and len(node.inputs) == 2:  # a position plus a scalar (the past length)
        out = node.outputs[0].shape
        for index, other in enumerate(node.inputs):
            inner = _position_axis(model, node.inputs[1 - index], depth + 1) if other is not None else None
            if inner is None:
                continue
            scalar = other.shape is not None and len(other.shape) <= inner[0] and all(d == 1 for d in other.shape)
            if scalar or (other.shape is None and out is not None and len(out) == inner[0]):
                return inner
        return None
    if node.op_type != "Unsqueeze" or len(node.inputs) < 2:
        return None
    inner, axes = _position_axis(model, node.inputs[0], depth + 1), _fusion.constant_of(model, node.inputs[1])
    if inner is None or axes is None:
        return None
    rank = inner[0] + axes.numpy().size
    inserted = {int(a) % rank for a in axes.numpy().reshape(-1)}
    kept = [i for i in range(rank) if i not in inserted]
    return rank, kept[inner[1]]


#: Comparisons of key positions (the mask's last axis) with query positions (the one before) that
#: keep every key at or before its query: (the op, whether the key positions are its first operand).
CAUSAL_COMPARISONS = {("LessOrEqual", True), ("GreaterOrEqual", False)}


def causal_refusal(model: ir.Model, mask: ir.Value) -> str | None:
    """Why the mask computed behind ``mask`` is not the op's causal mask (a key at or before its query),
    read by structure: a comparison of key positions with query positions (no offset: the window is
    :func:`window_of`'s) the other way round, or strict (the diagonal masked); ``None`` when every such
    comparison is causal, or when none can be read (then the fused calls are checked by running them)."""
    for node in producers_bfs(mask, lambda n: False):
        if node.op_type not in ("Less", "LessOrEqual", "Greater", "GreaterOrEqual") or len(node.inputs) != 2:
            continue
        if any(v is None or (v.producer() is not None and v.producer().op_type == "Sub") for v in node.inputs):
            continue
        axes = [_position_axis(model, v) for v in node.inputs]
        if any(a is None for a in axes):
            continue
        sides = [axis - rank for rank, axis in axes]  # from the end: -1 the keys, -2 the queries
        if sorted(sides) != [-2, -1]:
            continue
        if (node.op_type, sides[0] == -1) not in CAUSAL_COMPARISONS:
            return (f"the mask compares key and query positions with {node.op_type} ({node.name}): not a key at or "
                    "before its query, the op's causal mask")
    return None


def head_sink(function: ir.Function, softmax: ir.Node) -> ir.Value | None:
    """The per-head sink logit of ``softmax(s) @ v * sigmoid(logsumexp(s) - sink)`` (attention sinks:
    the softmax over the scores and one learned logit per head, the sink's column dropped), which is
    ``GroupQueryAttention``'s ``head_sink``; ``None`` without a ``ReduceLogSumExp``."""
    sums = [n for n in function if n.op_type == "ReduceLogSumExp"]
    if not sums:
        return None
    if len(sums) != 1 or sums[0].inputs[0] is not softmax.inputs[0]:
        raise _fusion.Refused("a ReduceLogSumExp that is not over the scores the Softmax takes")
    use = _only_use(sums[0].outputs[0])
    if use is None or use[0].op_type != "Sub" or use[1] != 0:
        raise _fusion.Refused("a ReduceLogSumExp of the scores that is not the log-sum-exp minus a sink logit")
    sub = use[0]
    chain = _only_use(sub.outputs[0])
    if chain is None or chain[0].op_type != "Sigmoid":
        raise _fusion.Refused("attention sinks in a form other than sigmoid(logsumexp(scores) - sink)")
    return sub.inputs[1]
