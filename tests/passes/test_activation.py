"""FuseActivationPass (passes/fusions/activation.py) on tanh-GELU bodies written as the export writes them
(the constants formal inputs, lifted to the main graph): transformers' ``GELUTanh`` (Gemma2) and
``NewGELUActivation`` (Phi) become ``com.microsoft.FastGelu``, computing what the bodies computed;
a body whose constants are not GELU's is left as it was."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnx_modular.passes.fusions.activation import FuseActivationPass

TEXT = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[2,3,8] x) => (float[2,3,8] y, float[2,3,8] z)
<float three = {3.0}, float cubic = {CUBIC}, float root = {0.7978845608}, float one = {1.0}, float half = {0.5}>
{
    y = pkg.test.GELUTanh(x, three, cubic, root, one, half)
    z = pkg.test.NewGELUActivation(x, three, cubic, root, one, half)
}
<domain: "pkg.test", opset_import: ["" : 18]>
GELUTanh (input, three, cubic, root, one, half) => (output)
{
    p = Pow(input, three)
    c = Mul(cubic, p)
    s = Add(input, c)
    r = Mul(root, s)
    t = Tanh(r)
    a = Add(t, one)
    h = Mul(half, a)
    output = Mul(input, h)
}
<domain: "pkg.test", opset_import: ["" : 18]>
NewGELUActivation (input, three, cubic, root, one, half) => (output)
{
    h = Mul(half, input)
    p = Pow(input, three)
    c = Mul(cubic, p)
    s = Add(input, c)
    r = Mul(root, s)
    t = Tanh(r)
    a = Add(one, t)
    output = Mul(h, a)
}
"""


def _run(model: ir.Model, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


@pytest.mark.parametrize("form", ["GELUTanh", "NewGELUActivation"])
def test_tanh_gelu_bodies_become_fast_gelu(form):
    model = ir.from_onnx_text(TEXT.replace("CUBIC", "0.044715"))
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32) * 3
    expected = _run(model, x)
    fusion = FuseActivationPass()
    fusion(model)
    body = model.functions[("pkg.test", form, "")]
    assert [(n.domain, n.op_type) for n in body] == [("com.microsoft", "FastGelu")]
    assert fusion.ops[("pkg.test", form, "")] == "com.microsoft.FastGelu"
    for got, want in zip(_run(model, x), expected):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_a_body_with_other_constants_stays():
    model = ir.from_onnx_text(TEXT.replace("CUBIC", "0.05"))  # not GELU's 0.044715
    fusion = FuseActivationPass()
    fusion(model)
    assert fusion.fused == []
    assert "Tanh" in [n.op_type for n in model.functions[("pkg.test", "GELUTanh", "")]]
