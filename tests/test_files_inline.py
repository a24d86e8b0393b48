"""Inlining local functions (files/inline.py, files/_proto.inline_functions): the flat copy keeps
every subgraph output the outer graph reads, also where onnx.inliner alone loses one."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.inliner
import onnx.parser
import onnxruntime as ort
import pytest
import torch
from torch import nn

from onnx_modular import export_modular
from onnx_modular.errors import VerificationError
from onnx_modular.files import inline_file
from onnx_modular.runtime import sessions as runtime

# A function whose If branch returns a body initializer (what onnxscript's optimizer makes of a
# branch that computes a constant), called twice.
BRANCH_INITIALIZER = """<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (bool c) => (float[2] y, float[2] z) { y = pkg.test.F(c)  z = pkg.test.F(c) }
<domain: "pkg.test", opset_import: ["" : 18]>
F (c) => (out) {
  out = If (c) <
    then_branch: graph = t () => (float[2] r) <float[2] r = {1, 2}> {},
    else_branch: graph = e () => (float[2] s) { s = Constant <value_floats = [3.0, 4.0]> () }>
}"""


def _run(model: onnx.ModelProto, c: bool) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"c": np.array(c)})


def test_onnx_inliner_alone_loses_a_branch_initializer_output():
    # the upstream bug the workaround is for: if this starts passing, onnx fixed it
    flat = onnx.inliner.inline_local_functions(onnx.parser.parse_model(BRANCH_INITIALIZER))
    with pytest.raises(Exception, match="does not exist"):
        _run(flat, True)


def test_inlined_copy_keeps_a_branch_initializer_output(tmp_path):
    source = tmp_path / "m.onnx"
    onnx.save(onnx.parser.parse_model(BRANCH_INITIALIZER), source)
    flat = inline_file(source, tmp_path / "flat.onnx")
    assert not flat.functions
    onnx.checker.check_model(flat, full_check=True)
    for c, expected in ((True, [1, 2]), (False, [3, 4])):
        for output in _run(onnx.load(tmp_path / "flat.onnx"), c):
            np.testing.assert_array_equal(output, np.array(expected, np.float32))
    session = ort.InferenceSession(runtime.flat_copy(source), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(None, {"c": np.array(True)})[1], [1, 2])


def test_load_failure_hint_names_the_cause():
    bad = onnx.parser.parse_model("""<ir_version: 10, opset_import: ["" : 18]>
main (float[2] x) => (float[2] y) { y = Relu(missing) }""").SerializeToString()
    with pytest.raises(VerificationError) as info:
        runtime.session(bad, what="inlined flat copy")
    assert "inlined flat copy" in str(info.value) and "bfloat16" not in str(info.value)
    assert "verify_flat=False" in info.value.hint


class _BagAndSpectrum(nn.Module):
    """nn.EmbeddingBag (nested If bodies in a Loop after translation) beside torch.fft.rfft."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 8, mode="mean")
        self.proj = nn.Linear(5, 8)

    def forward(self, ids, offsets, signal):
        return self.bag(ids, offsets) + self.proj(torch.fft.rfft(signal).abs())


def test_embedding_bag_beside_rfft_exports_with_flat_parity(tmp_path):
    torch.manual_seed(0)
    model = _BagAndSpectrum().eval()
    args = (torch.randint(0, 20, (10,)), torch.tensor([0, 3, 6]), torch.randn(3, 8))
    result = export_modular(model, args, tmp_path / "bag.onnx")  # the flat copy is run inside
    assert result.report.ok
    assert all(o.flat_max_abs is not None and o.flat_max_abs < 1e-5 for o in result.report.outputs)
    assert {f.name for f in result.functions} >= {"EmbeddingBag", "Linear"}


def test_run_gives_outputs_that_do_not_hold_the_session_arena():
    """onnxruntime's output arrays live in the session's memory arena and keep all of it alive:
    the parity check held the modular run's outputs while the inlined flat copy ran, and peaked
    at twice one session's memory (SegGPT at 448x448: 8.3 GB, 4.2 GB with the outputs copied).
    ``run`` gives arrays that own their data, equal to onnxruntime's."""
    model = onnx.parser.parse_model(
        '<ir_version: 10, opset_import: ["" : 18]>\nmain (float[2, 3] x) => (float[2, 3] y) { y = Relu (x) }'
    )
    x = np.array([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]], dtype=np.float32)
    names, (y,) = runtime.run(model.SerializeToString(), {"x": x})
    raw = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert names == ["y"] and y.flags.owndata and not raw.flags.owndata
    np.testing.assert_array_equal(y, np.maximum(x, 0))
