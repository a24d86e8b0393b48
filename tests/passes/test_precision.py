"""convert_precision (passes/precision/casts.py) on small ONNX text models: a converted body computes in
float16, a float32-only op runs between Casts, Cast/dtype attributes and constants follow, a weight
read twice is stored once in float16, a weight a kept body reads stays float32. The rewritten
models run in onnxruntime against numpy in float32 (float16's rounding as the tolerance)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import onnx.parser
import onnx.shape_inference
import onnxruntime as ort
import pytest

from onnx_modular.passes.precision.casts import FLOAT32_OPS, clip_for, convert_precision
from onnx_modular.storage.proto import declare_function_types

FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16

MAIN = """
<ir_version: 10, opset_import: ["" : 18]>
main (float[4] x) => (float[4] y) <float[4] w = {1.0, 2.0, 3.0, 4.0}> {
  a = Mul(x, w)
  b = Add(a, w)
  axis = Constant <value = int64 {0}> ()
  c = CumSum(b, axis)
  y = Cast <to = 1> (c)
}"""

ATTRIBUTES = """
<ir_version: 10, opset_import: ["" : 18]>
main (float[2, 2] x) => (float[2, 2] y) {
  s = Shape(x)
  z = ConstantOfShape <value = float[1] {0.5}> (s)
  e = EyeLike <dtype = 1> (x)
  h = Constant <value_float = 2.0> ()
  t = Add(z, e)
  u = Mul(t, h)
  y = Add(u, x)
}"""

CALLS = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[4] x) => (float[4] y) <float[4] w = {0.5, 1.5, -2.0, 3.0}> {
  a = pkg.test.Scale(x, w)
  b = pkg.test.Scale(a, w)
  y = Add(b, w)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Scale (input, weight) => (output) {
  output = Mul(input, weight)
}"""

SCALE = ("pkg.test", "Scale", "")


def _model(text: str) -> onnx.ModelProto:
    model = onnx.shape_inference.infer_shapes(onnx.parser.parse_model(text))  # value_info, as an exported file has
    declare_function_types(model)
    return model


def _store(model: onnx.ModelProto, initializer_types: dict[str, int]) -> None:
    """The initializers in their planned dtypes (what the writer does one tensor at a time)."""
    for tensor in model.graph.initializer:
        if initializer_types.get(tensor.name, FLOAT) != FLOAT:
            array = onnx.numpy_helper.to_array(tensor)
            tensor.CopyFrom(onnx.numpy_helper.from_array(clip_for(initializer_types[tensor.name], array), tensor.name))


def _run(model: onnx.ModelProto, **feeds: np.ndarray) -> np.ndarray:
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _producer(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if name in n.output)


def _readers(body, name: str) -> list[onnx.NodeProto]:
    return [n for n in body.node if name in n.input]


def test_a_float32_only_op_runs_between_casts_and_cast_targets_follow():
    model = _model(MAIN)
    assert "CumSum" in FLOAT32_OPS
    result = convert_precision(model, FLOAT16, {})
    cumsum = next(n for n in model.graph.node if n.op_type == "CumSum")
    before = _producer(model, cumsum.input[0])
    assert before.op_type == "Cast" and before.attribute[0].i == FLOAT and before.input == ["b"]
    (after,) = _readers(model.graph, cumsum.output[0])
    assert after.op_type == "Cast" and after.attribute[0].i == FLOAT16 and after.output == ["c"]
    # the body's own Cast to float32 now casts to float16; the graph output is cast back at the end
    (own_cast,) = _readers(model.graph, "c")
    assert own_cast.op_type == "Cast" and own_cast.attribute[0].i == FLOAT16
    assert _producer(model, "y").op_type == "Cast" and _producer(model, "y").attribute[0].i == FLOAT
    # graph inputs and outputs keep their types: x is cast where it is read
    assert model.graph.input[0].type.tensor_type.elem_type == FLOAT
    assert model.graph.output[0].type.tensor_type.elem_type == FLOAT
    mul = _producer(model, "a")
    assert _producer(model, mul.input[0]).op_type == "Cast" and _producer(model, mul.input[0]).input == ["x"]
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.value_info}
    assert types["a"] == types["b"] == types["c"] == FLOAT16
    assert result.casts == 4  # x to float16, CumSum in and out, y back to float32
    _store(model, result.initializer_types)
    x = np.array([0.1, -0.2, 0.3, 0.25], np.float32)
    w = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    np.testing.assert_allclose(_run(model, x=x), np.cumsum(x * w + w), rtol=2e-3, atol=2e-3)


def test_a_weight_read_twice_is_stored_once_in_float16():
    model = _model(MAIN)
    result = convert_precision(model, FLOAT16, {})
    assert result.initializer_types == {"w": FLOAT16}
    readers = _readers(model.graph, "w")
    assert sorted(n.op_type for n in readers) == ["Add", "Mul"]  # both read the stored weight, no Cast of it
    assert not any(n.op_type == "Cast" and "w" in n.input for n in model.graph.node)


def test_kept_body_changes_nothing():
    model = _model(MAIN)
    before = model.SerializeToString()
    result = convert_precision(model, FLOAT16, {}, root_low=False)
    assert result.casts == 0 and result.initializer_types == {"w": FLOAT}
    assert model.SerializeToString() == before


def test_dtype_attributes_and_constants_follow():
    model = _model(ATTRIBUTES)
    convert_precision(model, FLOAT16, {})
    nodes = {n.op_type: n for n in model.graph.node}
    assert nodes["EyeLike"].attribute[0].i == FLOAT16
    assert nodes["ConstantOfShape"].attribute[0].t.data_type == FLOAT16
    constant = nodes["Constant"].attribute[0]
    assert constant.name == "value" and constant.t.data_type == FLOAT16  # value_float becomes a float16 tensor
    x = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    np.testing.assert_allclose(_run(model, x=x), (0.5 + np.eye(2, dtype=np.float32)) * 2 + x, rtol=1e-3)


@pytest.mark.parametrize("function_low", [True, False])
def test_a_weight_shared_by_calls_follows_its_readers(function_low):
    """Converted everywhere: the weight is stored in float16 once and passed as it is. Read by a
    kept function too (a tied weight): it stays float32 and the converted reader casts it."""
    model = _model(CALLS)
    result = convert_precision(model, FLOAT16, {SCALE: function_low}, weight_sources={SCALE: {"weight": {"w"}}})
    assert result.initializer_types == {"w": FLOAT16 if function_low else FLOAT}
    calls = [n for n in model.graph.node if n.op_type == "Scale"]
    assert [n.input[1] for n in calls] == ["w", "w"]  # a weight formal: the same dtype on both sides
    casts_of_w = [n for n in model.graph.node if n.op_type == "Cast" and n.input == ["w"]]
    add = next(n for n in model.graph.node if n.op_type == "Add")
    if function_low:
        assert casts_of_w == [] and add.input[1] == "w"
    else:
        assert len(casts_of_w) == 1 and casts_of_w[0].attribute[0].i == FLOAT16 and add.input[1] == casts_of_w[0].output[0]
        # the kept calls' float32 results are cast where the converted main graph reads them
        assert any(n.op_type == "Cast" and n.input == ["b"] for n in model.graph.node)
    _store(model, result.initializer_types)
    x = np.array([1.0, -1.0, 0.5, 0.25], np.float32)
    w = np.array([0.5, 1.5, -2.0, 3.0], np.float32)
    np.testing.assert_allclose(_run(model, x=x), x * w * w + w, rtol=2e-3, atol=2e-3)



HISTC = """
<ir_version: 10, opset_import: ["" : 18]>
main (int64[6] i, float[6] x) => (float[4] counts, float[6] y) <float[5, 1] edges = {0.0, 0.75, 1.5, 2.25, 3.0000002}> {
  zero = Constant <value = int64[1] {0}> ()
  one = Constant <value = int64[1] {1}> ()
  four = Constant <value = int64[1] {4}> ()
  five = Constant <value = int64[1] {5}> ()
  f = Cast <to = 1> (i)
  u = Unsqueeze(f, zero)
  below = Less(u, edges)
  ones = Cast <to = 1> (below)
  cumulative = ReduceSum <keepdims = 0> (ones, one)
  hi = Slice(cumulative, one, five)
  lo = Slice(cumulative, zero, four)
  counts = Sub(hi, lo)
  y = Mul(x, f)
}"""


def test_comparisons_run_in_float32_and_read_their_weights_in_float32():
    # torch.histc's bin edges: 3.0000002 is 3.0 in float16, and the index 3 fell out of the last bin
    model = _model(HISTC)
    result = convert_precision(model, FLOAT16, {})
    assert result.initializer_types == {"edges": FLOAT}  # read by a comparison only: stays float32
    less = next(n for n in model.graph.node if n.op_type == "Less")
    assert less.input[1] == "edges"
    unsqueeze = _producer(model, less.input[0])  # read by the comparison alone: index arithmetic, float32
    assert unsqueeze.op_type == "Unsqueeze" and unsqueeze.output[0] == less.input[0]
    cast = _producer(model, unsqueeze.input[0])
    assert cast.op_type == "Cast" and cast.attribute[0].i == FLOAT  # f (Mul reads it too) in float32 here
    assert next(n for n in model.graph.node if n.op_type == "Mul").output[0] != "y"  # the rest in float16, cast back
    _store(model, result.initializer_types)
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    counts, y = session.run(None, {"i": np.array([0, 1, 2, 3, 3, 1], np.int64), "x": np.ones(6, np.float32)})
    np.testing.assert_array_equal(counts, [1, 2, 1, 2])  # the last bin keeps its two 3s
    np.testing.assert_array_equal(y, [0, 1, 2, 3, 3, 1])


PADDING = """
<ir_version: 10, opset_import: ["" : 18]>
main (float[1, 3665] x, int64 length) => (float[1, N] y) <float stride = {1.0}, int64 kernel = {7}> {
  one = Constant <value_float = 1.0> ()
  zero = Constant <value = int64[1] {0}> ()
  minus = Constant <value = int64[1] {-1}> ()
  edge = Sub(length, kernel)
  f = Cast <to = 1> (edge)
  per = Div(f, stride)
  frames = Add(per, one)
  up = Ceil(frames)
  whole = Cast <to = 7> (up)
  extra = Sub(whole, edge)
  e = Reshape(extra, minus)
  pads = Concat <axis = 0> (zero, zero, zero, e)
  t = Tanh(x)
  y = Pad(t, pads)
}"""


def test_index_arithmetic_stays_float32_and_its_weights_too():
    # a Conv1d's padding from the length (PocketTTS's audio tokenizer, issue 51): 3658 / 1 + 1 is
    # 3660 in float16, the pad amount comes out one too long and the shapes no longer match
    model = _model(PADDING)
    result = convert_precision(model, FLOAT16, {})
    assert result.initializer_types == {"stride": FLOAT}  # read by index arithmetic only
    ops = {n.output[0]: n for n in model.graph.node}
    for name in ("f", "per", "frames", "up"):  # the float chain from the length to the Cast to int64
        assert name in ops and not any(n.op_type == "Cast" and n.input[0] == name for n in model.graph.node if n.output[0] != "whole")
    assert onnx.helper.get_attribute_value(ops["f"].attribute[0]) == FLOAT  # not lowered to float16
    assert onnx.helper.get_attribute_value(ops["one"].attribute[0]) == 1.0 and ops["one"].attribute[0].name == "value_float"
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.value_info}
    assert types["per"] == types["frames"] == types["up"] == FLOAT and types["t"] == FLOAT16  # the data: float16
    _store(model, result.initializer_types)
    x = np.random.default_rng(0).standard_normal((1, 3665)).astype(np.float32)
    y = _run(model, x=x, length=np.array(3665, np.int64))
    assert y.shape == (1, 3665 + 1)  # ceil(3658 / 1 + 1) - 3658 = 1 in float32; 2 in float16
    np.testing.assert_allclose(y[:, :-1], np.tanh(x), atol=2e-3)


SCATTER_ADD = """
<ir_version: 10, opset_import: ["" : 18]>
main (float[4] x, int64[3, 1] i) => (float[4] y) <float[4] w = {0.5, 1.5, -2.0, 3.0}> {
  d = Mul(x, w)
  two = Constant <value = int64[1] {0}> ()
  three = Constant <value = int64[1] {3}> ()
  u = Slice(d, two, three)
  s = ScatterND <reduction = "add"> (d, i, u)
  y = Add(s, w)
}"""


def test_a_scatter_that_accumulates_runs_in_float32():
    # onnxruntime's CPU provider has no float16 ScatterND/ScatterElements with a reduction (JetMoE):
    # data, updates and output go through Casts, whether or not shape inference typed them
    model = _model(SCATTER_ADD)
    result = convert_precision(model, FLOAT16, {})
    scatter = next(n for n in model.graph.node if n.op_type == "ScatterND")
    for index in (0, 2):
        cast = _producer(model, scatter.input[index])
        assert cast.op_type == "Cast" and cast.attribute[0].i == FLOAT
    assert [n.op_type for n in _readers(model.graph, scatter.output[0])] == ["Cast"]
    x, i = np.array([1.0, 2.0, 3.0, 4.0], np.float32), np.array([[0], [0], [3]], np.int64)
    d = x * np.array([0.5, 1.5, -2.0, 3.0], np.float32)
    expected = d.copy()
    np.add.at(expected, i[:, 0], d[:3])
    _store(model, result.initializer_types)
    np.testing.assert_allclose(_run(model, x=x, i=i), expected + [0.5, 1.5, -2.0, 3.0], rtol=2e-3)


UNTYPED_MASK = """
<ir_version: 10, opset_import: ["" : 18]>
main (float[2, 3] x) => (float[2, 3] y) <float half = {0.5}> {
  m = Mul(x, x)
  axis = Constant <value = int64[1] {0}> ()
  u = Unsqueeze(m, axis)
  shape = Constant <value = int64[3] {1, 1, 1}> ()
  e = Expand(u, shape)
  reps = Constant <value = int64[3] {2, 1, 1}> ()
  t = Tile(e, reps)
  flat = Constant <value = int64[2] {4, 3}> ()
  r = Reshape(t, flat)
  low = Less(r, half)
  lowf = Cast <to = 1> (low)
  start = Constant <value = int64[1] {0}> ()
  stop = Constant <value = int64[1] {2}> ()
  head = Slice(lowf, start, stop, axis)
  y = Add(head, m)
}"""


def test_a_value_a_pass_left_untyped_takes_the_type_onnx_infers():
    # OneFormer's decoder (issue 51): a mask chain Unsqueeze -> Expand -> Tile -> Reshape -> Less,
    # where the Expand's output has no value_info (a pass made it). The chain is index arithmetic
    # (float32); without a type for the Expand's output, it was read in float16 by a float32 Tile
    # and the checker refused the Less (float16 against float32)
    model = _model(UNTYPED_MASK)
    expand = next(n for n in model.graph.node if n.op_type == "Expand").output[0]
    kept = [v for v in model.graph.value_info if v.name != expand]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)
    result = convert_precision(model, FLOAT16, {})
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.value_info}
    assert types["t"] == types["r"] == FLOAT and types["m"] == FLOAT16  # the mask's chain float32, the data float16
    assert _producer(model, "u").op_type == "Unsqueeze" and _producer(model, "u").input[0] != "m"  # m cast to float32
    _store(model, result.initializer_types)
    x = np.array([[0.1, 0.9, -0.5], [0.7, 0.2, 1.5]], np.float32)
    np.testing.assert_allclose(_run(model, x=x), (x * x < 0.5).astype(np.float32) + x * x, atol=2e-3)


EMPTY_SEQUENCE = """
<ir_version: 10, opset_import: ["" : 18]>
main (float[2, 3] x) => (float[4, 3] y) <float[3] w = {0.5, 1.5, -2.0}> {
  s = SequenceEmpty ()
  a = Mul(x, w)
  t = SequenceInsert(s, a)
  u = SequenceInsert(t, x)
  y = ConcatFromSequence <axis = 0> (u)
}"""


def test_an_empty_sequence_takes_the_converted_dtype():
    # SequenceEmpty's dtype is float32 when not given; a converted body's tensors inserted in it are
    # float16 (Kimi-K2.5's vision position table, issue 51's sweep: the checker refused the file)
    model = _model(EMPTY_SEQUENCE)
    result = convert_precision(model, FLOAT16, {})
    empty = next(n for n in model.graph.node if n.op_type == "SequenceEmpty")
    assert onnx.helper.get_attribute_value(empty.attribute[0]) == FLOAT16
    _store(model, result.initializer_types)
    x = np.array([[0.1, 0.9, -0.5], [0.7, 0.2, 1.5]], np.float32)
    np.testing.assert_allclose(_run(model, x=x), np.concatenate([x * [0.5, 1.5, -2.0], x]), rtol=2e-3)
