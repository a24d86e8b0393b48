"""A model whose forward updates its own buffers (tests/models.RingNet: a ring buffer and its write
pointer, updated in place): the eager reference run and torch.export start from the same state,
so parity holds and the file computes what torch's flat export computes; the model comes back
with the state it was given."""

from __future__ import annotations

import copy

import models
import numpy as np
import onnx
import torch

from onnx_modular import export_modular
from onnx_modular.runtime import sessions as runtime


def test_buffers_updated_by_forward(tmp_path):
    model, args, _ = models.ring_net()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        expected = copy.deepcopy(model)(*args).numpy()  # one step from the given state
    path = tmp_path / "ring.onnx"
    export_modular(model, args, path)  # parity checked (raises ParityError otherwise)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # given back as given
    stored = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    assert any(np.array_equal(v, state["ring.buf"].numpy()) for v in stored.values())  # the state before the step
    flat = tmp_path / "flat.onnx"
    torch.onnx.export(copy.deepcopy(model), args, str(flat), dynamo=True)
    feeds = [a.numpy() for a in args]
    (ours,) = runtime.run(str(path), feeds, what="modular file")[1]
    (theirs,) = runtime.run(str(flat), feeds, what="torch's flat file")[1]
    np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ours, theirs, atol=1e-6, rtol=1e-6)


class RingOut(models.Ring):
    """The ring buffer returned as it is after the write (an output that is the buffer itself)."""

    def forward(self, x):
        super().forward(x)
        return self.buf * 1.0, self.buf


def test_an_output_that_is_the_buffer_keeps_its_reference_values(tmp_path):
    torch.manual_seed(0)
    model = RingOut().eval()
    with torch.no_grad():
        model(torch.randn(1, 8))
    x = torch.randn(1, 8)
    with torch.no_grad():
        expected = [t.numpy() for t in copy.deepcopy(model)(x)]
    result = export_modular(model, (x,), tmp_path / "ring_out.onnx")  # parity against the step's outputs
    actual = runtime.run(str(tmp_path / "ring_out.onnx"), [x.numpy()], what="modular file")[1]
    for got, want in zip(actual, expected):
        np.testing.assert_allclose(got, want, atol=1e-6)
    assert result.report.ok
