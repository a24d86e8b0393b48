"""float16 ``convert`` keeps in float32 what float16 cannot hold (two patterns of the catalogue's models):

* index arithmetic: a Conv1d padded to whole frames computes its pad from the length in float
  (``ceil((length - kernel) / stride + 1)``, then int64), as PocketTTS's audio tokenizer does;
  float16 rounds lengths past 2048 and the pad comes out wrong. That chain stays float32.
* values past float16's range: box coordinates scaled by 100 before a sinusoid, as BROS does
  (941 x 100 is ``inf`` in float16). convert measures every value on the original run, runs the
  ops that touch values past 65504 in float32 and keeps the calls whose inputs or outputs are
  past it; an attention mask's ``finfo(float32).min`` is a sentinel, not a value past the range.

Small modules of our own with the same patterns, exported here (a few seconds each).
"""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from onnx_modular import export_modular
from onnx_modular.files.convert.ranges import SENTINEL, measure
from onnx_modular.files.convert.tool import convert
from onnx_modular.format import metadata
from onnx_modular.passes.precision.casts import RANGE_MARK
from onnx_modular.storage.proto import declare_function_types, function_id

FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16


class PaddedConv(nn.Module):
    """A Conv1d padded on the right to a whole number of frames, the pad computed in float from a
    length tensor (its ``.item()`` is the pad)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 2, 7)
        self.register_buffer("stride", torch.tensor(1), persistent=False)
        self.register_buffer("kernel_size", torch.tensor(7), persistent=False)
        self.register_buffer("padding_total", torch.tensor(6), persistent=False)

    def forward(self, x, length):
        frames = (length - self.kernel_size + self.padding_total) / self.stride + 1
        frames = torch.ceil(frames).to(torch.int64) - 1
        extra = (frames * self.stride + self.kernel_size - self.padding_total - length).item()
        torch._check(extra >= 0)
        torch._check(extra <= 2)
        return self.conv(F.pad(x, (6, extra)))


class Padded(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = PaddedConv()

    def forward(self, x, length):
        return self.block(torch.tanh(x), length)


class Sinusoid(nn.Module):
    """sin and cos of positions times inverse frequencies (a transformer-XL positional embedding)."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.register_buffer("inv_freq", 1 / (10000 ** (torch.arange(0.0, dim, 2.0) / dim)))

    def forward(self, positions):
        angles = positions.unsqueeze(-1) * self.inv_freq
        return torch.cat([angles.sin(), angles.cos()], dim=-1)


class BoxEmbedding(nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.sinusoid = Sinusoid()
        self.projection = nn.Linear(4 * 8, hidden, bias=False)

    def forward(self, boxes):
        relative = boxes[:, None, :, :] - boxes[:, :, None, :]  # (batch, n, n, 4), up to 1e5 apart
        return self.projection(self.sinusoid(relative).flatten(-2)).mean(2)


class MaskedMix(nn.Module):
    """Attention-like mixing with an additive mask of ``finfo(float32).min``."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.query = nn.Linear(hidden, hidden)

    def forward(self, hidden, mask):
        bias = (1.0 - mask[:, None, :].float()) * torch.finfo(torch.float32).min
        scores = self.query(hidden) @ hidden.transpose(1, 2) / 4 + bias
        return scores.softmax(-1) @ hidden


class Boxes(nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.embed = nn.Embedding(32, hidden)
        self.boxes = BoxEmbedding(hidden)
        self.mix = MaskedMix(hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, ids, boxes, mask):
        scaled = boxes.float() * 100  # BROS's bbox_scale: past 65504 for coordinates over 655
        return self.norm(self.mix(self.embed(ids) + self.boxes(scaled), mask))


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("padded") / "padded.onnx"
    x, length = torch.randn(1, 2, 3665), torch.tensor(3665)  # 3658 + 1 is 3660 in float16: the pad one off
    export_modular(Padded().eval(), (x, length), path)
    return path, {"x": x.numpy(), "length": length.numpy()}


@pytest.fixture(scope="module")
def boxes(tmp_path_factory):
    torch.manual_seed(0)
    model = Boxes().eval()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (2, 6), generator=generator)
    coordinates = torch.randint(10, 950, (2, 6, 4), generator=generator)
    mask = torch.ones(2, 6, dtype=torch.int64)
    mask[1, 4:] = 0
    path = tmp_path_factory.mktemp("boxes") / "boxes.onnx"
    export_modular(model, (ids, coordinates, mask), path)
    return path, {"ids": ids.numpy(), "boxes": coordinates.numpy(), "mask": mask.numpy()}


def _values(body) -> dict[str, int]:
    return {v.name: v.type.tensor_type.elem_type for v in body.value_info}


def test_padding_arithmetic_stays_float32(padded, tmp_path):
    path, feeds = padded
    report = convert(path, tmp_path / "padded.f16.onnx", dtype="float16", inputs=feeds)
    assert report.max_drift < 0.01 and not report.kept and not report.range_kept and report.range_values == 0
    converted = onnx.load(str(tmp_path / "padded.f16.onnx"))
    body = next(f for f in converted.functions if f.name == "PaddedConv")
    ceil = next(n for n in body.node if n.op_type == "Ceil")
    div = next(n for n in body.node if n.op_type == "Div")
    types = _values(body)
    assert types[ceil.input[0]] == types[div.output[0]] == FLOAT  # ceil((length - 7 + 6) / 1 + 1) in float32
    # the length's float copy is made in float32, not cast to float16 and back
    made = next(n for n in body.node if div.input[0] in n.output)
    assert made.op_type == "Cast" and made.attribute[0].i == FLOAT
    weights = {t.name: t.data_type for t in converted.graph.initializer}
    assert weights["block.stride.folded"] == FLOAT and weights["block.conv.weight"] == FLOAT16  # stride: read by the arithmetic alone
    assert all(types[o] == FLOAT16 for n in body.node if n.op_type == "Pad" for o in n.output)  # the data: float16


def test_values_past_float16_range_keep_their_ops_and_calls_in_float32(boxes, tmp_path):
    path, feeds = boxes
    out = tmp_path / "boxes.f16.onnx"
    report = convert(path, out, dtype="float16", inputs=feeds)
    assert all(math.isfinite(a) for a, _ in report.outputs.values()) and report.max_drift < 0.02
    kept = dict(report.range_kept)
    assert set(kept) == {"boxes", "boxes.sinusoid"}  # their inputs: coordinates times 100, and differences of them
    assert 65504 < kept["boxes"] <= 950 * 100 and report.kept == ["boxes", "boxes.sinusoid"]
    assert report.range_values >= 3  # scaled, relative, angles
    assert not any(c.overflow for c in report.calls)
    assert "values leave float16's range" in str(report) and "boxes.sinusoid" in str(report)
    note = json.loads(next(p.value for p in onnx.load(str(out), load_external_data=False).metadata_props if p.key == metadata.CONVERTED))
    assert note["range_kept"] == ["boxes", "boxes.sinusoid"] and note["kept"] == ["boxes", "boxes.sinusoid"]
    converted = onnx.load(str(out))
    scale = next(n for n in converted.graph.node if n.op_type == "Mul")
    marked = {v.name: v for v in converted.graph.value_info}[scale.output[0]]
    assert marked.type.tensor_type.elem_type == FLOAT and any(p.key == RANGE_MARK for p in marked.metadata_props)
    projection = next(c for c in report.calls if c.call_name == "boxes.projection")
    assert projection.converted  # sin and cos are in range: the Linear after them is float16
    assert next(c for c in report.calls if c.call_name == "mix").converted  # the mask's -3.4e38 is a sentinel


def test_measure_ignores_mask_sentinels_and_takes_the_largest_over_calls(boxes):
    path, feeds = boxes
    model = onnx.load(str(path))
    declare_function_types(model)
    ranges = measure(model, feeds)
    functions = {f.name: function_id(f) for f in model.functions}
    mix = ranges[functions["MaskedMix"]]
    assert mix and max(mix.values()) < 1e4  # the bias of finfo.min (and scores + it) is not counted
    assert SENTINEL < float(np.finfo(np.float32).max)
    sinusoid = ranges[functions["Sinusoid"]]
    relative = np.abs(feeds["boxes"][:, None].astype(np.float64) - feeds["boxes"][:, :, None]).max() * 100
    assert sinusoid["positions"] == pytest.approx(relative)


def test_measure_takes_the_finite_values_under_the_sentinel_of_each_value():
    # one main graph: a value with inf, NaN and a sentinel beside finite ones, a plain one, an empty one
    h = onnx.helper
    graph = h.make_graph(
        [h.make_node("Mul", ["x", "two"], ["doubled"]), h.make_node("Slice", ["x", "start", "end"], ["empty"])],
        "g",
        [h.make_tensor_value_info("x", FLOAT, [2, 3])],
        [h.make_tensor_value_info("doubled", FLOAT, [2, 3]), h.make_tensor_value_info("empty", FLOAT, [2, 0])],
        [
            onnx.numpy_helper.from_array(np.array(2.0, np.float32), "two"),
            onnx.numpy_helper.from_array(np.array([1], np.int64), "start"),
            onnx.numpy_helper.from_array(np.array([1], np.int64), "end"),
        ],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    x = np.array([[np.inf, -7.0, np.nan], [3.0, float(np.finfo(np.float32).min), -np.inf]], np.float32)
    ranges = measure(model, {"x": x})[None]
    assert ranges["x"] == 7.0  # inf, NaN and the sentinel are not values
    assert ranges["doubled"] == 14.0
    assert ranges["empty"] == 0.0  # an empty value has no magnitude (-inf, reported as 0)
    assert measure(model, {"x": np.array([[1.0, -2.5, 0.5], [0.0, 2.0, -1.0]], np.float32)})[None]["x"] == 2.5


def test_outputs_that_overflow_are_not_written():
    # what the range measure cannot see (values past the range only in a subgraph's calls, or on
    # other inputs than the verification's): a file whose outputs hold inf is refused, not written
    from onnx_modular.errors import VerificationError
    from onnx_modular.files.convert.verify import refuse_overflow

    finite, overflowed = np.array([1.0, 7e4], np.float32), np.array([1.0, np.inf], np.float32)
    classes = {"inner": "Inner", "outer": "Outer"}
    with pytest.raises(VerificationError) as caught:  # "inner": the first call convert found overflowing
        refuse_overflow("float16", {"y": overflowed}, {"y": finite}, "inner", classes)
    text = str(caught.value)
    assert "outputs y hold inf or NaN" in text and "'inner' (Inner)" in text and "--keep Inner" in text
    assert "Nothing was written" in text and caught.value.module_path == "inner"
    with pytest.raises(VerificationError) as caught:  # no call found: the outputs still refuse the file
        refuse_overflow("float16", {"y": overflowed}, {"y": finite}, None, classes)
    assert "--keep NAME" in str(caught.value) and caught.value.module_path is None
    refuse_overflow("float16", {"y": finite}, {"y": finite}, "inner", classes)  # outputs finite: written
    refuse_overflow("float16", {"y": overflowed}, {"y": overflowed}, "inner", classes)  # inf in the original too
