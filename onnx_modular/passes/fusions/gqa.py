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
``com.microsoft.GroupQueryAttention`` taking the packed projection, the output projection call. With a
norm call between projection and heads (Qwen3's ``q_norm``/``k_norm`` on ``[batch, seq, heads, head]``,
Olmo2's on the projection) the packed projection is ``Split`` into q, k, v and each norm call moves onto
its part (``Reshape`` to heads and back, no transposes, as the builder writes it): onnxruntime's CPU op
takes no q/k norm weights, so the norms stay outside it. The op takes the mask as
``seqlens_k`` (``sum(attention_mask) - 1``, int32) and ``total_sequence_length`` (the mask's width,
int32), computed once in the main graph from its 2-D ``attention_mask`` and passed down the call
chain as new formal inputs (:data:`SEQLENS_K`, :data:`TOTAL_SEQUENCE_LENGTH`); formal inputs no
body reads any more (the 4-D mask, the per-call cos/sin) are then dropped with what computed them.

This pass does not check the numbers: ``onnx_modular.files.optimize.tool`` runs each rewrite on the
file's real calls and keeps it only when the outputs agree. ``reasons`` says why a body with a
``Softmax`` was not rewritten.

Example::

    FuseGroupQueryAttentionPass(max_positions=4096)(model)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from onnx_modular.passes.fusions import base as _fusion
from onnx_modular.passes.fusions.attention_scores import UNREADABLE as _UNREADABLE
from onnx_modular.passes.fusions.attention_scores import ancestors as _ancestors
from onnx_modular.passes.fusions.attention_scores import causal_refusal as _causal_refusal
from onnx_modular.passes.fusions.attention_scores import check_scores as _check_scores
from onnx_modular.passes.fusions.attention_scores import head_sink as _head_sink
from onnx_modular.passes.fusions.attention_scores import mask_formals as _mask_formals
from onnx_modular.passes.fusions.attention_scores import producers_bfs as _producers_bfs
from onnx_modular.passes.fusions.attention_scores import scale_and_softcap as _scale
from onnx_modular.passes.fusions.attention_scores import window_of as _window_of
from onnx_modular.passes.fusions.projections import is_projection as _is_projection
from onnx_modular.passes.fusions.projections import packed_projection as _packed_projection
from onnx_modular.passes.fusions.qkv import normed_parts as _normed_parts
from onnx_modular.passes.fusions.qkv import scaled_query as _scaled_query
from onnx_modular.passes.fusions.rotary import caches as _caches
from onnx_modular.passes.fusions.rotary import checked_rotary as _checked_rotary
from onnx_modular.passes.fusions.rotary import needs_rotary_op as _needs_rotary_op
from onnx_modular.passes.fusions.rotary import position_ids as _position_ids
from onnx_modular.passes.fusions.rotary import query_rotary as _query_rotary
from onnx_modular.passes.fusions.rotary import rotary_nodes as _rotary_nodes
from onnx_modular.passes.fusions.rotary import rotary_source as _rotary_source

__all__ = ["FuseGroupQueryAttentionPass", "SEQLENS_K", "TOTAL_SEQUENCE_LENGTH"]

SEQLENS_K = "seqlens_k"
TOTAL_SEQUENCE_LENGTH = "total_sequence_length"
_SOFTMAX_SIDE = {"Add", "Mul", "Div", "Where", "Cast", "Sub"}


@dataclasses.dataclass
class _Attention:
    q_proj: ir.Node
    k_proj: ir.Node
    v_proj: ir.Node
    o_proj: ir.Node | None  # None: the body returns the merged heads, projected by its caller (BERT's self-output)
    heads: list[ir.Value]  # query, key, value as [batch, seq, heads, head_size] (after any q/k norm)
    transposed: list[bool]  # those heads [batch, heads, seq, head_size] instead (a norm after the transpose)
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
    rotary_dim: int = 0  # the head's leading channels the rotary turns (partial rotary: fewer than head_size)
    softcap: float = 0.0  # softcap * tanh(scores / softcap) on the scaled scores (Gemma 2)
    masks: tuple[int, ...] = ()  # formal inputs (indices) that only mask the scores (a window may hide in them)
    sink: ir.Value | None = None  # one learned logit per head beside the scores (attention sinks): head_sink
    # rotary pairs channels 2i and 2i + 1: True (the module's cos/sin repeat each frequency twice) or "repeated"
    # (the module's rotate-half cos/sin, their first half repeat-interleaved in the body: GLM)
    interleaved: bool | str = False
    query_factor: ir.Value | None = None  # [batch, 1, seq, 1]: the query times one number a position (Llama 4's scale)
    chains: list | None = None  # per q, k, v: the view and norm call from projection to heads (_norm_chain), when packable
    merged: ir.Node | None = None  # without o_proj: the Reshape that merges the heads into the first output

    @property
    def anchor(self) -> ir.Node:
        """The node the rewrite inserts its nodes before and takes the attention's place at."""
        return self.o_proj if self.o_proj is not None else self.merged


def _heads(model: ir.Model, start: ir.Value) -> tuple[ir.Value, bool]:
    """The ``[batch, seq, heads, head_size]`` value transposed to ``[batch, heads, seq, head_size]``
    behind ``start`` (``False``), or the output of a norm call on the transposed heads when one comes
    first (``True``: Exaone 4's q/k norms, after the transpose)."""
    def stop(node: ir.Node) -> bool:
        return node.op_type == "Transpose" or node.op_identifier() in model.functions

    for node in _producers_bfs(start, stop):
        if node.op_identifier() in model.functions:
            if _is_projection(node, model) or len(node.outputs) != 1:
                break
            return node.outputs[0], True
        perm = node.attributes.get_ints("perm", None) if node.op_type == "Transpose" else None
        if perm is not None and list(perm) == [0, 2, 1, 3]:
            return node.inputs[0], False
    raise _fusion.Refused("no transpose from [batch, seq, heads, head] to [batch, heads, seq, head] behind the query/key/value")


def _plain_path(value: ir.Value, heads: ir.Value) -> bool:
    """``value`` is ``heads`` moved only (transposed, cast): nothing the op would drop is computed on it."""
    while value is not heads:
        node = value.producer()
        if node is None or node.op_type not in ("Transpose", "Identity", "Cast") or node.inputs[0] is None:
            return False
        value = node.inputs[0]
    return True


def _check_query_and_value(model: ir.Model, formals: list[ir.Value], query: ir.Value, key_rotary: tuple,
                           new_value: ir.Value, value_heads: ir.Value) -> ir.Value | None:
    """What the op does to the query and the value, proven on the body: the query turned by the key's
    rotary (the op turns both alike), the value cached as its heads are (the op turns it not). Returns
    the per-position factor the query is multiplied by after its rotary, if any."""
    rotation, factor = _query_rotary(model, query, formals)
    if rotation != key_rotary:
        raise _fusion.Refused("the query is not turned by the key's rotary (the op turns both alike)")
    if not _plain_path(new_value, value_heads):
        raise _fusion.Refused("the value is changed between its heads and the cache (the op caches the projection's heads)")
    return factor


def _gqa_input(heads: ir.Value, projection: ir.Node) -> ir.Value | None:
    """The projection's output when ``heads`` is just its reshape (then it can be packed), else ``None``."""
    producer = heads.producer()
    if producer is not None and producer.op_type == "Reshape" and producer.inputs[0] is projection.outputs[0]:
        return projection.outputs[0]
    return None


def _norm_chain(model: ir.Model, heads: ir.Value, projection: ir.Node) -> list[ir.Node] | None:
    """The nodes from the projection's output to ``heads`` (first to last) when they are its view into
    heads (``Reshape``) and at most one one-output call (a norm: Qwen3's ``q_norm`` on the heads, Olmo2's on
    the projection before the view) reading nothing else of the projections, else ``None``. Such q, k
    and v can come from one packed projection split apart, the calls kept on their own parts."""
    chain, value = [], heads
    while value is not projection.outputs[0] and len(chain) < 3:
        node = value.producer()
        if node is None or len(node.outputs) != 1 or not node.inputs or node.inputs[0] is None:
            return None
        call = node.op_identifier() in model.functions
        if not (call or (node.op_type == "Reshape" and node.domain in ("", "ai.onnx"))) or (call and _is_projection(node, model)):
            return None
        if call and any(v is not None and v.producer() is not None and v.producer().op_type != "Constant"
                        for v in node.inputs[1:]):
            return None  # a call reading a computed value besides its input (not only weights and constants)
        chain.append(node)
        value = node.inputs[0]
    if value is not projection.outputs[0]:
        return None
    kinds = ["call" if n.op_identifier() in model.functions else "view" for n in reversed(chain)]
    return list(reversed(chain)) if kinds in (["view"], ["view", "call"], ["call", "view"]) else None


def _norm_chains(model: ir.Model, heads: list[ir.Value], projections: tuple) -> list[list[ir.Node]] | None:
    """:func:`_norm_chain` of the query, the key and the value, when each has one and the value's is its
    view alone (the op caches the value's heads as they are), else ``None``."""
    chains = [_norm_chain(model, h, p) for h, p in zip(heads, projections)]
    return None if any(c is None for c in chains) or len(chains[2]) != 1 else chains


def _first_projection(model: ir.Model, start: ir.Value) -> ir.Node:
    for node in _producers_bfs(start, lambda n: _is_projection(n, model)):
        if _is_projection(node, model):
            return node
    raise _fusion.Refused("no projection found behind the key/value/query")


def _static_shape(model: ir.Model, value: ir.Value) -> list:
    sources = _fusion.sources_of(model, value)
    shapes = [tuple(s.shape) if s.shape is not None else None for s in sources]
    if not shapes or shapes[0] is None or any(s != shapes[0] for s in shapes):
        raise _fusion.Refused(f"the shape of {value.name!r} is not known from the main graph")
    return [d if isinstance(d, int) else None for d in shapes[0]]


def _weight_columns(model: ir.Model, projection: ir.Node) -> int:
    if len(projection.inputs) < 2 or projection.inputs[1] is None:
        raise _fusion.Refused("a projection without a weight input")
    shape = _static_shape(model, projection.inputs[1])
    if len(shape) != 2 or shape[1] is None:
        raise _fusion.Refused("a projection weight that is not a 2-D matrix")
    return shape[1]


def _output_projection(model: ir.Model, output: ir.Value, softmax: ir.Node) -> tuple[ir.Node | None, ir.Node | None]:
    """``(o_proj, None)``: the first output is a projection of the attention; ``(None, merge)``: it is the
    heads merged and returned unprojected, the caller projects them (BERT's ``BertSelfOutput``; the
    numbers check says whether the merge is GroupQueryAttention's ``[batch, seq, heads * head_size]``)."""
    o_proj = output.producer()
    while o_proj is not None and o_proj.op_type in ("Identity", "Dropout") and o_proj.inputs[0] is not None:
        o_proj = o_proj.inputs[0].producer()  # Starcoder2's residual dropout, an Identity in eval mode
    if o_proj is not None and o_proj.op_type == "Reshape" and id(softmax) in _ancestors(o_proj.inputs[0]):
        return None, o_proj
    if o_proj is None or not _is_projection(o_proj, model) or id(softmax) not in _ancestors(o_proj.inputs[0]):
        raise _fusion.Refused("the first output is neither a projection of the attention nor its heads merged")
    return o_proj, None


def _analyse(model: ir.Model, function: ir.Function) -> _Attention:
    nodes = list(function)
    formals = list(function.inputs)
    outputs = list(function.outputs)
    concats = [
        n for n in nodes
        if n.op_type == "Concat" and n.outputs[0] in outputs and len(n.inputs) == 2 and n.inputs[0] in formals
        and n.attributes.get_int("axis", 0) in (-2, 2)
    ]
    if len(concats) != 2:  # first: a router's softmaxes are no attention left unfused
        raise _fusion.NotApplicable("no key/value cache (two Concat of a past input returned as present)")
    softmaxes = [n for n in nodes if n.op_type == "Softmax"]
    if len(softmaxes) != 1:
        raise _fusion.Refused(f"{len(softmaxes)} Softmax nodes (one expected)")
    softmax = softmaxes[0]
    sink = _head_sink(function, softmax)
    behind_softmax = _ancestors(softmax.outputs[0])
    keyed = [c for c in concats if id(c) in behind_softmax]
    if len(keyed) != 1:
        raise _fusion.Refused("cannot tell the key cache from the value cache")
    key, value = keyed[0], next(c for c in concats if c is not keyed[0])
    scores = next((n for n in _producers_bfs(softmax.inputs[0], lambda n: n.op_type == "MatMul")
                   if n.op_type == "MatMul"), None)
    if scores is None:
        raise _fusion.Refused("no MatMul before the Softmax")
    _check_scores(softmax, scores)  # by structure: a Softmax over the keys of masked, scaled q @ k
    k_proj = _first_projection(model, key.inputs[1])
    v_proj = _first_projection(model, value.inputs[1])
    q_side = [v for v in scores.inputs if id(key) not in _ancestors(v)]
    if len(q_side) != 1:
        raise _fusion.Refused("cannot tell the query from the key in the scores")
    q_proj = _first_projection(model, q_side[0])
    if not (q_proj.inputs[0] is k_proj.inputs[0] is v_proj.inputs[0]):
        raise _fusion.Refused("query, key and value do not project one input (cross-attention is not fused)")
    found = [_heads(model, v) for v in (q_side[0], key.inputs[1], value.inputs[1])]
    heads, transposed = [h for h, _ in found], [t for _, t in found]
    plain = [None if t else _gqa_input(h, p) for h, t, p in zip(heads, transposed, (q_proj, k_proj, v_proj))]
    o_proj, merged = _output_projection(model, outputs[0], softmax)
    past_shape = _static_shape(model, key.inputs[0])
    if len(past_shape) != 4 or past_shape[1] is None or past_shape[3] is None:
        raise _fusion.Refused("the past key is not [batch, kv_heads, past, head_size] with static heads")
    kv_heads, head_size = past_shape[1], past_shape[3]
    q_columns = _weight_columns(model, q_proj)
    one_projection = q_proj is k_proj is v_proj  # Phi-3's qkv_proj: GQA takes it whole ([q | k | v])
    if one_projection:
        q_columns -= 2 * kv_heads * head_size
        if any(h.producer() is not None and h.producer().op_type in ("Slice", "Split") for h in heads):
            raise _fusion.Refused("one projection sliced after the split into heads (query, key and value interleaved "
                           "head by head: GPT-NeoX); GroupQueryAttention takes [query | key | value]")
    if q_columns <= 0 or q_columns % head_size or (
        not one_projection and _weight_columns(model, k_proj) != kv_heads * head_size
    ):
        raise _fusion.Refused("the projection widths do not match the cache's heads")
    cos, sin, width, interleaved = _checked_rotary(model, key.inputs[1], formals, head_size)
    factor = _check_query_and_value(model, formals, q_side[0], (cos, sin, width, interleaved), value.inputs[1], heads[2])
    if factor is not None and _ancestors(factor) & {id(q_proj), id(k_proj), id(v_proj)}:
        raise _fusion.Refused("the query is scaled by a value computed from the projections, not from positions")
    scale, softcap = _scale(model, scores)
    if softcap == 0.0 and any(n.op_type == "Tanh" for n in nodes):
        raise _fusion.Refused("a Tanh in the body that is not a soft-cap of the scores")
    chains = None if any(transposed) or one_projection else _norm_chains(model, heads, (q_proj, k_proj, v_proj))
    return _Attention(
        q_proj, k_proj, v_proj, o_proj, heads, transposed, all(v is not None for v in plain) or one_projection,
        key.inputs[0], value.inputs[0],
        outputs.index(key.outputs[0]), outputs.index(value.outputs[0]),
        q_columns // head_size, kv_heads, head_size, scale, cos, sin,
        head_size if width is None else width, softcap, _mask_formals(model, function, softmax, scores), sink,
        interleaved, factor, chains, merged,
    )


def _mask_values(model: ir.Model) -> tuple[ir.Value, ir.Value]:
    """seqlens_k and total_sequence_length computed once in the main graph from ``attention_mask``."""
    graph = model.graph
    existing = {v.name: v for node in graph for v in node.outputs}
    if SEQLENS_K in existing and TOTAL_SEQUENCE_LENGTH in existing:
        return existing[SEQLENS_K], existing[TOTAL_SEQUENCE_LENGTH]
    masks = [v for v in graph.inputs if v.name == "attention_mask" and v.shape is not None and len(v.shape) == 2]
    if not masks:
        raise _fusion.Refused("the main graph has no 2-D attention_mask input")
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


def _thread(model: ir.Model, function: ir.Function, name: str, value: ir.Value, done: dict) -> ir.Value:
    memo = done.setdefault((name, id(value)), {})  # callers already given this value keep the formal they got
    formal = _fusion.thread_value(model, function, name, lambda graph: value if graph is value.graph else None, memo)
    if formal is None:
        raise _fusion.Refused(f"a chain of calls to the attention does not reach the body that computes {name}")
    return formal


class FuseGroupQueryAttentionPass(_fusion.FusionPass):
    """Self-attention bodies with a KV cache into one ``com.microsoft.GroupQueryAttention`` each.

    Attributes after a run: ``fused`` (the rewritten functions), ``reasons`` (function -> why not),
    ``skipped`` (bodies with a ``Softmax`` but no key/value cache, such as routers: not attention),
    ``packed`` (those whose query, key and value projections became one ``MatMul`` on weights
    concatenated once in the main graph, so that ``convert`` quantizes one MatMul, not three).
    """

    def __init__(self, max_positions: int = 4096, functions: set[ir.OperatorIdentifier] | None = None,
                 pack_qkv: bool = True):
        super().__init__(functions)
        self.pack_qkv = pack_qkv
        self.max_positions = max_positions

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.reset()
        found = []
        for key, function in list(model.functions.items()):
            if not self.applies_to(key):
                continue
            if not any(node.op_type == "Softmax" for node in function):
                continue
            try:
                found.append((key, function, _analyse(model, function)))
            except _fusion.NotApplicable as refused:
                self.skipped[key] = str(refused)
            except _fusion.Refused as refused:
                self.reasons[key] = str(refused)
        if not found:
            return ir.passes.PassResult(model, modified=False)
        windows = [v.name for v in model.graph.inputs if "sliding_window" in v.name]
        if windows:  # transformers' sliding-window cache (a rolling buffer): the past is not every position's
            self.reasons.update({key: f"a sliding-window cache ({windows[0]}) keeps only the window's past; export "
                                 "with `export --genai` (every position's keys and values, the window a mask)"
                                 for key, _, _ in found})
            return ir.passes.PassResult(model, modified=False)
        try:
            seqlens, total = _mask_values(model)
        except _fusion.Refused as refused:
            self.reasons.update({key: str(refused) for key, _, _ in found})
            return ir.passes.PassResult(model, modified=False)
        self._made, self._threaded, self._windows = {}, {}, {}
        for key, function, attention in found:
            try:
                parts = self._specialized(model, function, attention)
            except _fusion.Refused as refused:
                self.reasons[key] = str(refused)
                continue
            for part, part_attention, window in parts:
                try:
                    self._rewrite(model, part, part_attention, seqlens, total, window)
                except _fusion.Refused as refused:
                    self.reasons[part.identifier()] = str(refused)
                    continue
                self.fused.append(part.identifier())
        if self.fused:
            model.opset_imports.setdefault("com.microsoft", 1)
        _fusion.drop_unused_formals(model)
        return ir.passes.PassResult(model, modified=True)

    def _window(self, model: ir.Model, value: ir.Value) -> int | str | None:
        if id(value) not in self._windows:
            self._windows[id(value)] = _window_of(model, value)
        return self._windows[id(value)]

    def _specialized(self, model: ir.Model, function: ir.Function, attention: _Attention) -> list[tuple]:
        """(function, analysis, window) for each kind of call of ``function``: calls whose masks have
        different sliding windows, or whose cos/sin come from different rotary calls (Olmo 3's and
        Gemma 3's local and global rope), get copies of the body (and of their callers' bodies:
        :func:`_fusion.split_calls`), since the window is an attribute and the caches an input."""
        splits = [(index, lambda v: self._window(model, v), lambda w: "full" if w is None else f"window{w}")
                  for index in attention.masks]
        if attention.cos is not None:
            splits.append((list(function.inputs).index(attention.cos), _rotary_source, lambda key: "rope"))
        functions = [function]
        for index, key_of, suffix in splits:
            parts = []
            for part in functions:
                groups = _fusion.split_calls(model, part, index, key_of, suffix)
                if groups is None:
                    raise _fusion.Refused("calls of this body with different masks or rotary cannot be told apart")
                parts += groups.values()
            functions = parts
        result = []
        for part in functions:
            analysis = attention if part is function else _analyse(model, part)
            windows = {self._window(model, source) for index in analysis.masks
                       for source in _fusion.sources_of(model, part.inputs[index])} - {None}
            if _UNREADABLE in windows or len(windows) > 1:
                raise _fusion.Refused("the attention mask limits the keys in a way GroupQueryAttention cannot take "
                               "(not a causal sliding window: chunked, or several windows)")
            refusals = {_causal_refusal(model, source) for index in analysis.masks
                        for source in _fusion.sources_of(model, part.inputs[index])} - {None}
            if refusals:
                raise _fusion.Refused(sorted(refusals)[0])
            result.append((part, analysis, windows.pop() if windows else None))
        return result

    @staticmethod
    def _flat(function: ir.Function, value: ir.Value | None) -> ir.Value | None:
        """``value`` reshaped to one dimension (the sink logits: ``head_sink`` is ``[num_heads]``)."""
        if value is None:
            return None
        shape = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([-1], np.int64))}, name="gqa.sink_shape")
        flat = ir.node("Reshape", [value, shape.outputs[0]], name="gqa.head_sink")
        shape.outputs[0].name, flat.outputs[0].name = "gqa.sink_shape", "gqa.head_sink"
        function.insert_before(function[0], [shape, flat])
        return flat.outputs[0]

    def _rotated(self, model, function, attention: _Attention, qkv, cos_cache, sin_cache) -> tuple:
        """Query, key and value apart (a packed projection split into ``[q | k | v]``), the query and the
        key turned by ``RotaryEmbedding`` nodes (:func:`~onnx_modular.passes.fusions.rotary.rotary_nodes`)."""
        query, key, value = qkv
        nodes = []
        if key is None:  # one packed projection: [q | k | v] on the last axis
            columns = [attention.num_heads * attention.head_size] + [attention.kv_num_heads * attention.head_size] * 2
            sizes = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(columns, np.int64))}, name="gqa.qkv_sizes")
            split = ir.node("Split", [query, sizes.outputs[0]], attributes={"axis": -1}, num_outputs=3, name="gqa.qkv_split")
            sizes.outputs[0].name = "gqa.qkv_sizes"
            for output, role in zip(split.outputs, "qkv"):
                output.name = f"gqa.{role}_split"
            nodes += [sizes, split]
            query, key, value = split.outputs
        positions = _thread(model, function, "rotary_position_ids", _position_ids(model, attention), self._threaded)
        turned, query, key = _rotary_nodes(attention, query, key, positions, cos_cache, sin_cache)
        function.insert_before(attention.anchor, nodes + turned)
        return query, key, value

    def _rewrite(self, model, function, attention: _Attention, seqlens, total, window: int | None = None) -> None:
        cos_cache = sin_cache = None
        if attention.cos is not None:
            cos_cache, sin_cache = _caches(model, attention, self.max_positions, self._made)
            cos_cache = _thread(model, function, "cos_cache", cos_cache, self._threaded)
            sin_cache = _thread(model, function, "sin_cache", sin_cache, self._threaded)
        seqlens = _thread(model, function, SEQLENS_K, seqlens, self._threaded)
        total = _thread(model, function, TOTAL_SEQUENCE_LENGTH, total, self._threaded)
        separate = _needs_rotary_op(attention)  # a partial rotary GroupQueryAttention refuses: RotaryEmbedding nodes
        attributes = {
            "num_heads": attention.num_heads, "kv_num_heads": attention.kv_num_heads, "scale": attention.scale,
            "do_rotary": int(cos_cache is not None and not separate), "rotary_interleaved": int(bool(attention.interleaved)),
            # transformers' window W (keys kv > q - W: W positions, the query's own included) is
            # onnxruntime's local_window_size W, as the builder sets it (checked: W - 1 drifts)
            "local_window_size": -1 if window is None else window, "softcap": attention.softcap,
        }
        one_projection = attention.q_proj is attention.k_proj
        packable = self.pack_qkv and not one_projection and (attention.plain or attention.chains is not None)
        packed = _packed_projection(model, function, attention) if packable else None
        if one_projection:
            query, key, value = attention.q_proj.outputs[0], None, None
        elif packed and not attention.plain:  # norms between projection and heads: split, each norm on its part
            self.packed.append(function.identifier())
            function.insert_before(attention.anchor, packed)
            query, key, value = _normed_parts(function, attention, packed[-1].outputs[0])
        elif packed:
            self.packed.append(function.identifier())
            function.insert_before(attention.anchor, packed)
            query, key, value = packed[-1].outputs[0], None, None
        elif attention.plain:
            query, key, value = (p.outputs[0] for p in (attention.q_proj, attention.k_proj, attention.v_proj))
        else:  # a norm between projection and heads (Qwen3's q_norm/k_norm): merge the heads back
            shape = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([0, 0, -1], np.int64))}, name="gqa.merge_heads")
            shape.outputs[0].name = "gqa.merge_heads"
            turned = [ir.node("Transpose", [h], attributes={"perm": [0, 2, 1, 3]}, name=f"gqa.{role}_bshd")
                      for h, t, role in zip(attention.heads, attention.transposed, "qkv") if t]
            heads = iter(node.outputs[0] for node in turned)
            merged = [ir.node("Reshape", [next(heads) if t else h, shape.outputs[0]], name=f"gqa.{role}")
                      for h, t, role in zip(attention.heads, attention.transposed, "qkv")]
            for node in turned + merged:
                node.outputs[0].name = node.name
            function.insert_before(attention.anchor, [shape, *turned, *merged])
            query, key, value = (node.outputs[0] for node in merged)
        if attention.query_factor is not None:
            query = _scaled_query(function, attention, query, key is None)
        if separate:
            query, key, value = self._rotated(model, function, attention, (query, key, value), cos_cache, sin_cache)
            cos_cache = sin_cache = None
        gqa = ir.node(
            "GroupQueryAttention",
            [query, key, value, attention.past_key, attention.past_value, seqlens, total, cos_cache, sin_cache,
             None, None, self._flat(function, attention.sink)],
            attributes=attributes, domain="com.microsoft", num_outputs=3, name="GroupQueryAttention",
        )
        first = f"{attention.o_proj.inputs[0].name}_gqa" if attention.o_proj is not None else function.outputs[0].name
        names = [first, function.outputs[attention.present_key_index].name,
                 function.outputs[attention.present_value_index].name]
        function.insert_before(attention.anchor, gqa)
        if attention.o_proj is not None:
            attention.o_proj.replace_input_with(0, gqa.outputs[0])
        else:
            function.outputs[0] = gqa.outputs[0]
        function.outputs[attention.present_key_index] = gqa.outputs[1]
        function.outputs[attention.present_value_index] = gqa.outputs[2]
        function.opset_imports.setdefault("com.microsoft", 1)
        _fusion.remove_dead_nodes(function)
        for output, name in zip(gqa.outputs, names):
            output.name = name
