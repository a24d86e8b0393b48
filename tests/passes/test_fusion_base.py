"""What every fusion declares (passes/fusions/base.FusionPass): the report ``optimize`` reads after a
run, reset at each run, and the bodies a run may touch."""

from __future__ import annotations

import onnx_ir as ir
import pytest

from onnx_modular.passes.fusions.activation import FuseActivationPass
from onnx_modular.passes.fusions.base import FusionPass, NotApplicable, Refused
from onnx_modular.passes.fusions.gqa import FuseGroupQueryAttentionPass
from onnx_modular.passes.fusions.mha import FuseMultiHeadAttentionPass
from onnx_modular.passes.fusions.rms_norm import FuseRMSNormPass
from onnx_modular.passes.fusions.skip_norm import FuseSkipNormPass

#: Two bodies computing the same erf GELU, ``Gelu`` and ``Other``.
BODY = """
<domain: "pkg.test", opset_import: ["" : 18]>
{name} (x) => (y) {{
  root = Constant <value = float {{1.4142135}}> ()
  one = Constant <value = float {{1.0}}> ()
  half = Constant <value = float {{0.5}}> ()
  scaled = Div(x, root)
  erf = Erf(scaled)
  plus = Add(erf, one)
  inner = Mul(x, plus)
  y = Mul(half, inner)
}}
"""
GELU = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[2, 8] x) => (float[2, 8] y, float[2, 8] z) {
  y = pkg.test.Gelu(x)
  z = pkg.test.Other(x)
}
""" + BODY.format(name="Gelu") + BODY.format(name="Other")

PASSES = [FuseActivationPass, FuseGroupQueryAttentionPass, FuseMultiHeadAttentionPass, FuseRMSNormPass, FuseSkipNormPass]


@pytest.mark.parametrize("kind", PASSES, ids=lambda kind: kind.__name__)
def test_every_fusion_declares_its_report(kind):
    fusion = kind()
    assert isinstance(fusion, FusionPass)
    fusion(ir.from_onnx_text(GELU))
    for name, empty in (("fused", []), ("reasons", {}), ("skipped", {}), ("packed", []), ("ops", {})):
        assert type(getattr(fusion, name)) is type(empty), name


def test_a_run_resets_the_report_and_touches_only_the_bodies_asked_for():
    model = ir.from_onnx_text(GELU)
    (gelu,) = [key for key in model.functions if key[1] == "Gelu"]
    fusion = FuseActivationPass(functions={gelu})
    assert fusion(model).modified and fusion.fused == [gelu] and fusion.ops[gelu] == "com.microsoft.Gelu"
    assert not fusion.applies_to(next(key for key in model.functions if key[1] == "Other"))
    other = next(f for f in model.functions.values() if f.name == "Other")
    assert "Erf" in [node.op_type for node in other]  # not asked for: left as it was
    fusion(model)  # nothing left to fuse in Gelu: the last run's report is gone
    assert fusion.fused == [] and fusion.ops == {}


def test_one_refusal_type():
    assert issubclass(NotApplicable, Refused)
