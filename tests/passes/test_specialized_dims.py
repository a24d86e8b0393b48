"""FixSpecializedDimsPass on models from ONNX text (no torch): a symbolic dim named by a number
(torch's name for an axis torch.export specialized) becomes that fixed dim."""

from __future__ import annotations

import warnings

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from onnx_modular.passes.export.specialized_dims import (
    FixSpecializedDimsPass,
    SpecializedAxisWarning,
    fix_specialized_dims,
)

TEXT = """<ir_version: 10, opset_import: ["" : 18]>
main (float["batch", "8"] x) => (float["batch", 2, 4] y) {
  shape = Constant <value_ints = [-1, 2, 4]> ()
  y = Reshape(x, shape)
}"""


def test_numbered_symbolic_dims_become_fixed():
    model = ir.from_onnx_text(TEXT)
    fix = FixSpecializedDimsPass()
    assert fix(model).modified
    assert model.graph.inputs[0].shape == ir.Shape([ir.SymbolicDim("batch"), 8])
    assert fix.specialized == [("x", 1, 8)]
    assert not FixSpecializedDimsPass()(model).modified  # nothing left to fix


def test_fixed_input_rejects_another_size_at_the_boundary():
    model = ir.from_onnx_text(TEXT)
    with pytest.warns(SpecializedAxisWarning, match=r"Axis 1 of input 'x'.*specialized it to 8"):
        assert fix_specialized_dims(model) == [("x", 1, 8)]
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    assert session.run(None, {"x": np.ones((3, 8), np.float32)})[0].shape == (3, 2, 4)
    with pytest.raises(Exception, match=r"(?is)invalid dimensions for input: x.*index: 1 Got: 16 Expected: 8"):
        session.run(None, {"x": np.ones((3, 16), np.float32)})


def test_named_dims_are_left_alone():
    model = ir.from_onnx_text(TEXT.replace('"8"', '"seq"').replace("[-1, 2, 4]", "[-1, 2, 4]"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fix_specialized_dims(model) == []
    assert model.graph.inputs[0].shape == ir.Shape([ir.SymbolicDim("batch"), ir.SymbolicDim("seq")])


def test_several_axes_give_one_warning():
    """A decoder's cache (heads, head_dim of each tensor): one warning naming every axis, attributed
    to onnx_modular, not eight blocks pointing at onnx_ir's pass runner."""
    model = ir.from_onnx_text(TEXT)
    model.graph.inputs[0].shape = ir.Shape([ir.SymbolicDim("2"), ir.SymbolicDim("8")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fix_specialized_dims(model) == [("x", 0, 2), ("x", 1, 8)]
    ours = [w for w in caught if issubclass(w.category, SpecializedAxisWarning)]
    assert len(ours) == 1 and ours[0].filename == "onnx_modular"
    assert "2 axes asked to be dynamic" in str(ours[0].message)
    assert "axis 0 of 'x' to 2, axis 1 of 'x' to 8" in str(ours[0].message)
