"""AttachWeightsPass: named initializers read from the given tensors; meta leftovers are an error."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from onnx_modular.errors import WeightsError
from onnx_modular.passes.export.attach_weights import AttachWeightsPass

MODEL = """
<ir_version: 10, opset_import: ["" : 18]>
main (float[2] x) => (float[2] y) <float[2] w = {0, 0}, float[2] c = {5, 6}> {
  h = Mul(x, w)
  y = Add(h, c)
}
"""


def test_named_initializers_get_the_checkpoint_tensor():
    model = ir.from_onnx_text(MODEL)
    read = []

    def lazy(name):
        read.append(name)
        return ir.tensor(np.array([1.0, 2.0], dtype=np.float32), name=name)

    attach = AttachWeightsPass({"w"}, lazy)
    assert attach(model).modified and attach.count == 1 and read == ["w"]
    assert model.graph.initializers["w"].const_value.numpy().tolist() == [1.0, 2.0]
    assert model.graph.initializers["c"].const_value.numpy().tolist() == [5.0, 6.0]  # not named: kept


class _MetaLike:  # what a torch meta tensor looks like to the pass (duck typing, no torch import)
    is_meta = True


def test_an_unnamed_meta_initializer_is_a_typed_error():
    model = ir.from_onnx_text(MODEL)
    tensor = model.graph.initializers["c"].const_value
    tensor_with_meta = type("T", (), {"raw": _MetaLike(), "dtype": tensor.dtype, "shape": tensor.shape})()
    model.graph.initializers["c"].const_value = tensor_with_meta
    with pytest.raises(WeightsError, match="'c'"):
        AttachWeightsPass({"w"}, lambda name: None)(model)
