"""FuseMultiHeadAttentionPass on ONNX text: an encoder's self-attention body (BERT's layout: a
linear call per projection, heads reshaped and transposed, a scaled ``q @ k``, one additive mask)
becomes ``com.microsoft.Attention`` inside its function, with the same numbers in onnxruntime;
bodies that are not that attention are refused with their reason."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from pass_helpers import as_initializers

from onnx_modular.passes.fusions.mha import FuseMultiHeadAttentionPass

HIDDEN, HEADS, HEAD, SEQ = 16, 2, 8, 4

#: Constants are main-graph initializers passed down as formal inputs, as the export lifts them
#: (the shapes of the heads, the scale). ``{scores}`` is how the body turns ``q @ k`` (``raw``) into what the Softmax takes (``masked``);
#: ``{softmax_axis}`` and ``{value}`` (the value the probabilities multiply) vary per case.
MODEL = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[1, 4, 16] x, float[1, 1, 4, 4] mask, float[16, 16] qw, float[16] qb, float[16, 16] kw, float[16] kb,
      float[16, 16] vw, float[16] vb, int64[4] heads, int64[3] merged, float scale) => (float[1, 4, 16] y) {{
  y = pkg.test.SelfAttention(x, qw, qb, kw, kb, vw, vb, mask, heads, merged, scale)
}}
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
Linear (x, w, b) => (y) {{
  xw = MatMul(x, w)
  y = Add(xw, b)
}}
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
SelfAttention (x, qw, qb, kw, kb, vw, vb, mask, heads, merged, scale) => (y) {{
  q = pkg.test.Linear(x, qw, qb)
  k = pkg.test.Linear(x, kw, kb)
  v = pkg.test.Linear(x, vw, vb)
  q4 = Reshape(q, heads)
  k4 = Reshape(k, heads)
  v4 = Reshape(v, heads)
  qh = Transpose <perm = [0, 2, 1, 3]> (q4)
  kh = Transpose <perm = [0, 2, 1, 3]> (k4)
  vh = Transpose <perm = [0, 2, 1, 3]> (v4)
  kt = Transpose <perm = [0, 1, 3, 2]> (kh)
  raw = MatMul(qh, kt)
  {scores}
  probs = Softmax <axis = {softmax_axis}> (masked)
  context = MatMul(probs, {value})
  ct = Transpose <perm = [0, 2, 1, 3]> (context)
  y = Reshape(ct, merged)
}}
"""
SCALED = """scaled = Mul(raw, scale)
  masked = Add(scaled, mask)"""


def _model(scores: str = SCALED, softmax_axis: int = -1, value: str = "vh") -> ir.Model:
    model = ir.from_onnx_text(MODEL.format(scores=scores, softmax_axis=softmax_axis, value=value))
    constants = {"heads": np.array([0, 0, HEADS, HEAD], np.int64), "merged": np.array([0, 0, HIDDEN], np.int64),
                 "scale": np.array(HEAD ** -0.5, np.float32)}
    return as_initializers(model, {"x", "mask"}, constants, scale=0.3)


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    mask = np.zeros((1, 1, SEQ, SEQ), np.float32)
    mask[..., -1] = np.finfo(np.float32).min  # the last key padded, as an attention_mask makes it
    return {"x": rng.standard_normal((1, SEQ, HIDDEN)).astype(np.float32), "mask": mask}


def _run(model: ir.Model) -> np.ndarray:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, _feeds())[0]


def _body(model: ir.Model) -> ir.Function:
    return next(f for f in model.functions.values() if f.name.startswith("SelfAttention"))


def test_a_self_attention_body_becomes_one_attention_op_with_the_same_numbers():
    model = _model()
    expected = _run(model)
    fuse = FuseMultiHeadAttentionPass()
    assert fuse(model).modified
    ops = [(node.domain, node.op_type) for node in _body(model)]
    attention = [node for node in _body(model) if node.domain == "com.microsoft"]
    assert len(attention) == 1 and attention[0].op_type in ("Attention", "MultiHeadAttention"), ops
    assert ("", "Softmax") not in ops  # the scores are the op's now
    assert attention[0].attributes.get_int("num_heads") == HEADS
    assert attention[0].attributes.get_float("scale") == pytest.approx(HEAD ** -0.5, rel=1e-5)
    assert [node.op_type for node in model.graph] == ["SelfAttention"]  # the call stays a call
    np.testing.assert_allclose(_run(model), expected, atol=1e-5, rtol=1e-4)  # float32 kernels, same math


REFUSED = {
    "softmax over another axis": (dict(softmax_axis=2), "the Softmax is not over the last axis"),
    "soft-capped scores": (dict(scores="""cap = Constant <value = float {30.0}> ()
  inner = Div(raw, cap)
  bent = Tanh(inner)
  capped = Mul(bent, cap)
  masked = Add(capped, mask)"""), "soft-capped scores (Tanh) are not fused"),
    "squared scores": (dict(scores="""squared = Mul(raw, raw)
  masked = Add(squared, mask)"""), "between q @ k and the Softmax"),
    "two softmaxes": (dict(scores="""first = Softmax <axis = -1> (raw)
  masked = Add(first, mask)"""), "2 Softmax nodes (one expected)"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_bodies_that_are_not_that_attention_are_refused_with_their_reason(case):
    changes, reason = REFUSED[case]
    model = _model(**changes)
    fuse = FuseMultiHeadAttentionPass()
    fuse(model)
    body = _body(model)
    assert not any(node.domain == "com.microsoft" for node in body)
    assert reason in fuse.reasons[body.identifier()]


ROUTER = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[4, 16] x, float[16, 8] w, int64[1] k) => (float[4, 2] weights, int64[4, 2] experts) {
  weights, experts = pkg.test.TopKRouter(x, w, k)
}
<domain: "pkg.test", opset_import: ["" : 18, "pkg.test" : 1]>
TopKRouter (x, w, k) => (weights, experts) {
  logits = MatMul(x, w)
  top, experts = TopK <axis = -1> (logits, k)
  weights = Softmax <axis = -1> (top)
}
"""


def test_a_router_softmax_is_not_attention_and_not_a_refusal():
    """GraniteMoe's router (top-k of a projection, then a Softmax): no values weighted, so not attention;
    it is skipped, not listed as an attention left unfused (which made optimize say "not fused")."""
    model = ir.from_onnx_text(ROUTER)
    fuse = FuseMultiHeadAttentionPass()
    assert not fuse(model).modified
    body = next(f for f in model.functions.values() if f.name == "TopKRouter")
    assert fuse.reasons == {} and "weights no values" in fuse.skipped[body.identifier()]
