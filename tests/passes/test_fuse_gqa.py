"""FuseGroupQueryAttentionPass on ONNX text: a decoder's self-attention body with a KV cache
(three projections of one input, the new key and value appended to the past, a scaled and masked
``q @ k``, an output projection) becomes ``com.microsoft.GroupQueryAttention`` inside its function,
with ``seqlens_k``/``total_sequence_length`` computed once in the main graph from ``attention_mask``,
and decodes a token as the body did in onnxruntime; bodies the op cannot take are refused with
their reason, and a body with a ``Softmax`` but no cache (a router) is skipped as no attention."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from pass_helpers import as_initializers

from onnx_modular.passes.fusions.gqa import SEQLENS_K, TOTAL_SEQUENCE_LENGTH, FuseGroupQueryAttentionPass

HIDDEN, HEADS, KV_HEADS, HEAD, PAST = 32, 4, 2, 8, 3

#: Constants are main-graph initializers passed down as formal inputs, as the export lifts them.
#: ``{key_input}`` is what the key projection reads (``hidden``: self-attention; ``key_input``: another input), ``{scores}`` how
#: ``q @ k`` (``raw``) becomes what the Softmax takes (``masked``), ``{main_inputs}`` the main graph's mask input.
MODEL = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[1, 1, 32] hidden, float[1, 1, 32] other, {main_mask} attention_mask, float[1, 2, past, 8] past_key,
      float[1, 2, past, 8] past_value, float[32, 32] qw, float[32, 16] kw, float[32, 16] vw, float[32, 32] ow,
      int64[4] q_heads, int64[4] kv_heads, int64[3] merged, float scale, int64[5] repeated, int64[4] grouped,
      float big) => (float[1, 1, 32] out, float[1, 2, total, 8] present_key, float[1, 2, total, 8] present_value) {{
  one = Constant <value = float {{1.0}}> ()
  shape4 = Constant <value = int64[4] {{1, 1, 1, -1}}> ()
  as_float = Cast <to = 1> (attention_mask)
  hidden_keys = Sub(one, as_float)
  blocked = Mul(hidden_keys, big)
  mask = Reshape(blocked, shape4)
  out, present_key, present_value = pkg.test.Attention(hidden, other, past_key, past_value, mask, qw, kw, vw,
                                                       ow, q_heads, kv_heads, merged, scale, repeated, grouped)
}}
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Attention (hidden, key_input, past_key, past_value, mask, qw, kw, vw, ow, q_heads, kv_heads, merged, scale,
           repeated, grouped) => (out, present_key, present_value) {{
  q = MatMul(hidden, qw)
  k = MatMul({key_input}, kw)
  v = MatMul(hidden, vw)
  q4 = Reshape(q, q_heads)
  k4 = Reshape(k, kv_heads)
  v4 = Reshape(v, kv_heads)
  qh = Transpose <perm = [0, 2, 1, 3]> (q4)
  kh = Transpose <perm = [0, 2, 1, 3]> (k4)
  vh = Transpose <perm = [0, 2, 1, 3]> (v4)
  present_key = Concat <axis = 2> (past_key, kh)
  present_value = Concat <axis = 2> (past_value, vh)
  axis2 = Constant <value = int64[1] {{2}}> ()
  k5 = Unsqueeze(present_key, axis2)
  v5 = Unsqueeze(present_value, axis2)
  k_rep = Expand(k5, repeated)
  v_rep = Expand(v5, repeated)
  k_all = Reshape(k_rep, grouped)
  v_all = Reshape(v_rep, grouped)
  kt = Transpose <perm = [0, 1, 3, 2]> (k_all)
  raw = MatMul(qh, kt)
  {scores}
  probs = Softmax <axis = -1> (masked)
  context = MatMul(probs, v_all)
  ct = Transpose <perm = [0, 2, 1, 3]> (context)
  flat = Reshape(ct, merged)
  {output}
}}
"""
PROJECTED = "out = MatMul(flat, ow)"
SCALED = """scaled = Mul(raw, scale)
  masked = Add(scaled, mask)"""
MASK_2D = "int64[1, total]"


def _model(scores: str = SCALED, key_input: str = "hidden", main_mask: str = MASK_2D, output: str = PROJECTED) -> ir.Model:
    model = ir.from_onnx_text(MODEL.format(scores=scores, key_input=key_input, main_mask=main_mask, output=output))
    constants = {
        "q_heads": np.array([0, 0, HEADS, HEAD], np.int64), "kv_heads": np.array([0, 0, KV_HEADS, HEAD], np.int64),
        "merged": np.array([0, 0, HIDDEN], np.int64), "scale": np.array(HEAD ** -0.5, np.float32),
        "repeated": np.array([1, KV_HEADS, HEADS // KV_HEADS, 1, 1], np.int64),
        "grouped": np.array([1, HEADS, -1, HEAD], np.int64), "big": np.array(-1e9, np.float32),
    }
    return as_initializers(model, set(_feeds()), constants, scale=0.2)


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    cache = (1, KV_HEADS, PAST, HEAD)
    return {
        "hidden": rng.standard_normal((1, 1, HIDDEN)).astype(np.float32),
        "other": rng.standard_normal((1, 1, HIDDEN)).astype(np.float32),
        "attention_mask": np.ones((1, PAST + 1), np.int64),
        "past_key": rng.standard_normal(cache).astype(np.float32),
        "past_value": rng.standard_normal(cache).astype(np.float32),
    }


def _run(model: ir.Model) -> list[np.ndarray]:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in _feeds().items() if k in names})


def _body(model: ir.Model) -> ir.Function:
    return next(f for f in model.functions.values() if f.name.startswith("Attention"))


def test_a_decoder_attention_body_becomes_one_group_query_attention_that_decodes_alike():
    model = _model()
    expected = _run(model)
    fuse = FuseGroupQueryAttentionPass(max_positions=16)
    assert fuse(model).modified, fuse.reasons
    body = _body(model)
    (gqa,) = [node for node in body if node.domain == "com.microsoft"]
    assert gqa.op_type == "GroupQueryAttention"
    assert (gqa.attributes.get_int("num_heads"), gqa.attributes.get_int("kv_num_heads")) == (HEADS, KV_HEADS)
    assert gqa.attributes.get_float("scale") == pytest.approx(HEAD ** -0.5, rel=1e-5)
    assert gqa.attributes.get_int("do_rotary") == 0 and gqa.attributes.get_int("local_window_size") == -1
    assert not any(node.op_type in ("Softmax", "Concat") for node in body)  # the cache is the op's
    assert fuse.fused == [body.identifier()] and fuse.packed == [body.identifier()]  # q, k, v: one MatMul
    main_outputs = {value.name for node in model.graph for value in node.outputs}
    assert {SEQLENS_K, TOTAL_SEQUENCE_LENGTH} <= main_outputs  # computed once, from the 2-D mask
    assert {SEQLENS_K, TOTAL_SEQUENCE_LENGTH} <= {v.name for v in body.inputs}  # threaded down as formal inputs
    for got, want in zip(_run(model), expected):  # the token's output and the grown caches
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


def test_a_body_returning_the_merged_heads_unprojected_becomes_the_op_alone():
    """BERT's self-attention: the heads merged are the body's output, its caller (BertSelfOutput)
    projects them; the op's first output takes the output's place (an Identity after it included)."""
    model = _model(output="out = Identity(flat)")
    expected = _run(model)
    fuse = FuseGroupQueryAttentionPass(max_positions=16)
    assert fuse(model).modified, fuse.reasons
    body = _body(model)
    (gqa,) = [node for node in body if node.domain == "com.microsoft"]
    assert body.outputs[0] is gqa.outputs[0] and body.outputs[0].name == "out"
    assert [node.op_type for node in body if node.op_type in ("Softmax", "Transpose", "Identity")] == []
    for got, want in zip(_run(model), expected):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


REFUSED = {
    "cross-attention": (dict(key_input="key_input"), "query, key and value do not project one input"),
    "two softmaxes": (dict(scores="""first = Softmax <axis = -1> (raw)
  masked = Add(first, mask)"""), "2 Softmax nodes (one expected)"),
    "a Tanh that is no soft-cap": (dict(scores="""bent = Tanh(raw)
  masked = Add(bent, mask)"""), "Tanh"),
    "no 2-D attention_mask": (dict(main_mask="int64[1, 1, total]"), "no 2-D attention_mask input"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_bodies_the_op_cannot_take_are_refused_with_their_reason(case):
    changes, reason = REFUSED[case]
    model = _model(**changes)
    fuse = FuseGroupQueryAttentionPass(max_positions=16)
    fuse(model)
    body = _body(model)
    assert not any(node.domain == "com.microsoft" for node in body) and fuse.fused == []
    assert reason in fuse.reasons[body.identifier()]


ROUTER = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[1, 4, 8] x, float[8, 4] w) => (float[1, 4, 4] y) {
  y = pkg.test.Router(x, w)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Router (x, w) => (y) {
  logits = MatMul(x, w)
  y = Softmax <axis = -1> (logits)
}
"""


def test_a_softmax_without_a_cache_is_skipped_as_no_attention():
    model = ir.from_onnx_text(ROUTER)
    fuse = FuseGroupQueryAttentionPass()
    assert not fuse(model).modified
    ((key, reason),) = fuse.skipped.items()
    assert key[1] == "Router" and "no key/value cache" in reason and fuse.reasons == {}
