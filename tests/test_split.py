"""``split`` and ``run_stages`` (onnx_modular.files.split.tool): a model cut into stages at module boundaries.

Two real exports, each made once: a 4-layer Llama with a ``DynamicCache`` (hidden 64, 4 heads,
2 KV heads, vocab 128; weights in external data) cut into 2 stages between its decoder layers,
and a 2-layer T5 cut between its encoder and decoder. The chained stages run in onnxruntime
against the whole file on other inputs than the ones the stages were made with (float32,
atol 1e-5).
"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
import torch
from models import t5

import onnx_modular
from onnx_modular import export_modular
from onnx_modular.cli import main
from onnx_modular.errors import InvalidInputError
from onnx_modular.files import function_tree, load_model_file
from onnx_modular.format import metadata
from onnx_modular.runtime import sessions
from onnx_modular.runtime.inputs import random_inputs

ATOL = 1e-5
LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 4, 2, 16, 128
CACHE = [f"past_key_values.layers.{i}.{kind}" for i in range(LAYERS) for kind in ("keys", "values")]


def _llama_feeds(seed: int, batch: int = 2, seq: int = 3, past: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {
        "input_ids": rng.integers(0, VOCAB, (batch, seq)).astype(np.int64),
        "attention_mask": np.ones((batch, past + seq), dtype=np.int64),
    }
    for name in CACHE:
        feeds[f"input.{name}"] = rng.standard_normal((batch, KV_HEADS, past, HEAD_DIM)).astype(np.float32)
    return feeds


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=KV_HEADS, use_cache=True, max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, VOCAB, (2, 3)), use_cache=True).past_key_values
    kwargs = dict(
        input_ids=torch.randint(0, VOCAB, (2, 2)), attention_mask=torch.ones(2, 5, dtype=torch.long), past_key_values=cache
    )
    Dim = torch.export.Dim
    batch, seq, past = Dim("batch"), Dim("seq"), Dim("past")
    dynamic_shapes = dict(
        input_ids={0: batch, 1: seq}, attention_mask={0: batch, 1: Dim.AUTO}, past_key_values={0: batch, 2: past}
    )
    folder = tmp_path_factory.mktemp("llama")
    path = folder / "llama.onnx"
    export_modular(model, (), path, kwargs=kwargs, dynamic_shapes=dynamic_shapes, external_data=True)
    out = folder / "stages"
    result = onnx_modular.split(path, out, stages=2, inputs=_llama_feeds(seed=0))
    return path, out, result


@pytest.fixture(scope="module")
def t5_file(tmp_path_factory):
    model, args, kwargs = t5()
    path = tmp_path_factory.mktemp("t5") / "t5.onnx"
    export_modular(model, args, path, kwargs=kwargs)
    return path


def _weight_bytes(path) -> tuple[int, set[str]]:
    """Stored bytes of a file's weights (lifted constants excluded) and their names, without reading them."""
    model = onnx.load(str(path), load_external_data=False)
    lifted = metadata.lifted_constants(model)
    total, names = 0, set()
    for tensor in model.graph.initializer:
        if tensor.name in lifted:
            continue
        total += int(np.prod(tensor.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        names.add(tensor.name)
    return total, names


def _chained_vs_whole(path, out, feeds) -> dict[str, float]:
    chained = onnx_modular.run_stages(out, feeds)
    names, whole = sessions.run(str(path), feeds)
    assert list(chained) == names  # every model output, in the model's order
    return {name: float(np.abs(chained[name] - value).max()) for name, value in zip(names, whole)}


# -- Llama with a KV cache, 2 stages -------------------------------------------------------


def test_llama_chain_equals_whole_file(llama):
    path, out, _ = llama
    differences = _chained_vs_whole(path, out, _llama_feeds(seed=7, seq=2, past=4))
    assert set(differences) == {"logits", *(f"output.{name}" for name in CACHE)}
    assert all(d <= ATOL for d in differences.values()), differences


def test_llama_cut_between_layers_with_the_cache_of_each_layer(llama):
    _, out, result = llama
    assert result.opened == ["model"]
    first, second = result.stages
    assert first.calls == ["model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1"]
    assert second.calls == ["model.layers.2", "model.layers.3", "model.norm", "lm_head"]
    for stage, own in ((first, (0, 1)), (second, (2, 3))):
        cache_in = {n for n in stage.inputs if n.startswith("input.past_key_values")}
        cache_out = {n for n in stage.outputs if n.startswith("output.past_key_values")}
        expected = {name for name in CACHE if int(name.split(".")[2]) in own}
        assert cache_in == {f"input.{n}" for n in expected}
        assert cache_out == {f"output.{n}" for n in expected}
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["file"] for s in manifest["stages"]] == ["stage_0/model.onnx", "stage_1/model.onnx"]
    assert manifest["outputs"]["logits"] == "stage_1/logits"
    crossing = {n: src for n, src in manifest["stages"][1]["inputs"].items() if src.startswith("stage_0/")}
    # the hidden state, the mask and the rotary tables (cos, sin) cross the cut
    assert len(crossing) >= 4
    assert all(src == f"stage_0/{n}" and n in manifest["stages"][0]["outputs"] for n, src in crossing.items())
    stage_0 = onnx.load(str(out / "stage_0" / "model.onnx"), load_external_data=False)
    stage_1 = onnx.load(str(out / "stage_1" / "model.onnx"), load_external_data=False)
    produced = {o: n.op_type for n in stage_0.graph.node for o in n.output}
    assert {produced[n] for n in crossing} >= {"LlamaDecoderLayer", "LlamaRotaryEmbedding"}
    assert [v.name for v in stage_1.graph.input] == list(manifest["stages"][1]["inputs"])


def test_llama_stage_weights_sum_to_the_whole_file(llama):
    path, out, result = llama
    whole, whole_names = _weight_bytes(path)
    stage_bytes = [_weight_bytes(out / f"stage_{k}" / "model.onnx") for k in range(2)]
    assert sum(b for b, _ in stage_bytes) == whole == result.weight_bytes
    assert not stage_bytes[0][1] & stage_bytes[1][1]  # no weight stored twice
    assert stage_bytes[0][1] | stage_bytes[1][1] == whole_names
    assert result.shared_weights == {}
    assert [s.weight_bytes for s in result.stages] == [b for b, _ in stage_bytes]
    for k in range(2):  # external data in, external data out: each stage has its own data file
        model = onnx.load(str(out / f"stage_{k}" / "model.onnx"), load_external_data=False)
        locations = {
            e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"
        }
        assert locations == {"model.onnx.data"}


def test_llama_each_stage_keeps_a_shared_decoder_layer_function(llama):
    _, out, _ = llama
    for k, layers in ((0, ["model.layers.0", "model.layers.1"]), (1, ["model.layers.2", "model.layers.3"])):
        model = load_model_file(out / f"stage_{k}" / "model.onnx")
        layer_functions = [f for f in model.functions if f.name == "LlamaDecoderLayer"]
        assert len(layer_functions) == 1 and layer_functions[0].domain.startswith("pkg.transformers.")
        assert metadata.module_paths(layer_functions[0]) == layers
        tree = function_tree(model)
        calls = [c for c in tree.walk() if not c.is_root and c.class_name == "LlamaDecoderLayer"]
        assert [c.call_name for c in calls] == layers
        assert {c.call_count for c in calls} == {2}
        # nested calls are named after their own layer, not the layer the body was written for
        assert f"{layers[1]}.self_attn.q_proj" in {c.call_name for c in tree.walk()}
        props = metadata.props(model)
        assert props[metadata.SPLIT_STAGE] == f"{k}/2" and json.loads(props[metadata.SPLIT_OPENED]) == ["model"]
        onnx.checker.check_model(str(out / f"stage_{k}" / "model.onnx"), full_check=True)


def test_llama_test_data_reproduce_each_stage(llama):
    _, out, result = llama
    for stage in result.stages:
        data = stage.path.parent / "test_data_set_0"
        inputs = [onnx.numpy_helper.to_array(onnx.load_tensor(str(p))) for p in sorted(data.glob("input_*.pb"), key=_index)]
        expected = [onnx.numpy_helper.to_array(onnx.load_tensor(str(p))) for p in sorted(data.glob("output_*.pb"), key=_index)]
        assert len(inputs) == len(stage.inputs) and len(expected) == len(stage.outputs)
        _, actual = sessions.run(str(stage.path), inputs)
        for got, want in zip(actual, expected):
            np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def _index(path) -> int:
    return int(path.stem.split("_")[1])


def test_llama_balanced_by_time_cuts_between_layers(llama, tmp_path):
    path, _, _ = llama
    result = onnx_modular.split(path, tmp_path / "timed", stages=2, balance="time", inputs=_llama_feeds(seed=0))
    assert result.balance == "time" and result.opened == ["model"]
    assert all(any(c.startswith("model.layers.") for c in stage.calls) for stage in result.stages)
    assert all(cost > 0 for cost in result.stage_costs)


def test_llama_cut_at_named_layers(llama, tmp_path):
    path, _, _ = llama
    result = onnx_modular.split(path, tmp_path / "three", at=["model.layers.3", "model.layers.1"], inputs=_llama_feeds(seed=0))
    assert result.balance == "at" and result.opened == ["model"]
    assert [s.calls[0] for s in result.stages] == ["model.embed_tokens", "model.layers.1", "model.layers.3"]
    differences = _chained_vs_whole(path, tmp_path / "three", _llama_feeds(seed=8, seq=1, past=6))
    assert all(d <= ATOL for d in differences.values()), differences
    with pytest.raises(InvalidInputError, match="inside the call model.layers.1"):
        onnx_modular.split(path, tmp_path / "bad", at=["model.layers.2", "model.layers.1.mlp"])
    assert not (tmp_path / "bad").exists()


# -- T5: encoder | decoder -----------------------------------------------------------------


def test_t5_cut_between_encoder_and_decoder(t5_file, tmp_path):
    named = onnx_modular.split(t5_file, tmp_path / "at", at=["decoder"])
    balanced = onnx_modular.split(t5_file, tmp_path / "balanced", stages=2)
    for result in (named, balanced):
        assert result.opened == [] and [s.calls for s in result.stages] == [["encoder"], ["decoder"]]
    manifest = json.loads((tmp_path / "at" / "manifest.json").read_text())
    assert manifest["stages"][0]["inputs"] == {"input_ids": "input_ids"}
    assert manifest["stages"][1]["inputs"] == {
        "decoder_input_ids": "decoder_input_ids",
        "encoder_last_hidden_state": "stage_0/encoder_last_hidden_state",
    }
    assert manifest["outputs"] == {
        "last_hidden_state": "stage_1/last_hidden_state",
        "encoder_last_hidden_state": "stage_0/encoder_last_hidden_state",
    }
    feeds = random_inputs(load_model_file(t5_file), seed=3)
    differences = _chained_vs_whole(t5_file, tmp_path / "at", feeds)
    assert all(d <= ATOL for d in differences.values()), differences
    # the embedding both stacks read is stored in both stages, and reported
    assert named.shared_weights == {"decoder.embed_tokens.weight": [0, 1]}
    whole, _ = _weight_bytes(t5_file)
    shared = 100 * 32 * 4
    assert sum(s.weight_bytes for s in named.stages) == whole + shared
    assert "decoder.embed_tokens.weight: stored in stages 0, 1" in str(named)


def test_without_data_the_model_is_not_run(t5_file, tmp_path):
    result = onnx_modular.split(t5_file, tmp_path / "nodata", stages=2, with_data=False)
    assert [s.calls for s in result.stages] == [["encoder"], ["decoder"]]
    assert all(s.max_abs == {} for s in result.stages) and "no test data" in str(result)
    assert not list((tmp_path / "nodata").glob("stage_*/test_data_set_*"))
    feeds = random_inputs(load_model_file(t5_file), seed=5)
    differences = _chained_vs_whole(t5_file, tmp_path / "nodata", feeds)
    assert all(d <= ATOL for d in differences.values()), differences
    with pytest.raises(InvalidInputError, match="no-data"):
        onnx_modular.split(t5_file, tmp_path / "bad", stages=2, with_data=False, balance="time")
    assert not (tmp_path / "bad").exists()


def test_run_stages_takes_a_provider_per_stage(t5_file, tmp_path):
    onnx_modular.split(t5_file, tmp_path / "s", at="decoder")
    feeds = random_inputs(load_model_file(t5_file), seed=4)
    per_stage = onnx_modular.run_stages(tmp_path / "s", feeds, ["cpu", None])
    default = onnx_modular.run_stages(tmp_path / "s", feeds)
    assert all(np.array_equal(per_stage[n], default[n]) for n in default)
    with pytest.raises(InvalidInputError, match="3 execution providers for 2 stages"):
        onnx_modular.run_stages(tmp_path / "s", feeds, ["cpu", None, None])
    with pytest.raises(InvalidInputError, match="decoder_input_ids"):
        onnx_modular.run_stages(tmp_path / "s", {"input_ids": feeds["input_ids"]})


# -- bad input: typed errors, nothing written -----------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"at": ["decodr"]}, "closest names: decoder"),
        ({"at": ["decoder.block.0", "encoder.block.1"]}, "inside the call encoder"),
        ({"at": ["encoder"]}, "first call of the graph"),
        ({"at": ["T5Block"]}, "names a class"),
        ({"stages": 1000}, "1000 stages need 1000 module calls"),
        ({"stages": 1}, "stages must be an integer >= 2"),
        ({"stages": 2, "at": ["decoder"]}, "not both or neither"),
        ({}, "not both or neither"),
        ({"stages": 2, "balance": "flops"}, "balance must be one of"),
    ],
)
def test_bad_input_is_refused_and_nothing_is_written(t5_file, tmp_path, options, message):
    out = tmp_path / "out"
    with pytest.raises(InvalidInputError, match=message):
        onnx_modular.split(t5_file, out, **options)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary folder left either


def test_a_folder_that_is_not_empty_is_left_alone(t5_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(InvalidInputError, match="not empty"):
        onnx_modular.split(t5_file, out, stages=2)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_cli_split(t5_file, tmp_path):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["split", str(t5_file), "--at", "decoder", "-o", str(tmp_path / "cli")])
    assert code == 0
    assert "2 stages cut between the calls of the main graph (at)" in printed.getvalue()
    assert (tmp_path / "cli" / "manifest.json").is_file()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as errors:
        code = main(["split", str(t5_file), "--at", "decodr", "-o", str(tmp_path / "bad")])
    assert code == 2 and "closest names" in errors.getvalue()
    assert not (tmp_path / "bad").exists()


def test_partition_is_the_best_linear_partition():
    import itertools

    from onnx_modular.files.split.plan import _partition

    rng = np.random.default_rng(0)
    for _ in range(20):
        costs = [float(c) for c in rng.integers(0, 100, rng.integers(3, 9))]
        parts = int(rng.integers(2, len(costs) + 1))
        worst, starts = _partition(costs, parts)
        best = min(
            max(sum(costs[a:b]) for a, b in zip((0, *cut), (*cut, len(costs))))
            for cut in itertools.combinations(range(1, len(costs)), parts - 1)
        )
        assert worst == best
        assert len(starts) == parts - 1 and starts == sorted(set(starts)) and 0 < starts[0]
        bounds = (0, *starts, len(costs))
        assert max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])) == worst


def test_run_stages_refuses_a_manifest_that_leaves_its_folder(tmp_path):
    (tmp_path / "manifest.json").write_text(
        json.dumps({"stages": [{"file": "../elsewhere/model.onnx", "inputs": {}, "outputs": []}], "outputs": {}})
    )
    with pytest.raises(InvalidInputError, match="outside the folder"):
        onnx_modular.run_stages(tmp_path, {})
    with pytest.raises(InvalidInputError, match="no manifest.json"):
        onnx_modular.run_stages(tmp_path / "missing", {})


# -- files of other tools, from ONNX text (no torch, no onnx_modular metadata) -------------

CHAIN = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
chain (float[2, 3] x, bool c) => (float[2, 3] y) {
    a = pkg.test.Noise (x)
    b = pkg.test.Scale (a)
    d = pkg.test.Scale (b)
    y = If (c) <then_branch = g1 () => (float[2, 3] t) { t = pkg.test.Scale (d) },
                else_branch = g2 () => (float[2, 3] e) { e = Identity (d) }>
}
<domain: "pkg.test", opset_import: ["" : 18]>
Noise (x) => (y) {
    r = RandomUniformLike (x)
    y = Add (x, r)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Scale (x) => (y) {
    two = Constant <value = float {2.0}> ()
    y = Mul (x, two)
}
"""


@pytest.fixture
def chain(tmp_path):
    model = onnx.parser.parse_model(CHAIN)
    for node, name in zip(model.graph.node, ("noise", "first", "second", "branch")):
        node.name = name
    model.graph.node[3].attribute[0].g.node[0].name = "inner"
    path = tmp_path / "chain.onnx"
    onnx.save(model, path)
    return path


def test_a_stage_that_does_not_reproduce_the_run_writes_nothing(chain, tmp_path):
    from onnx_modular.errors import ParityError

    feeds = {"x": np.ones((2, 3), np.float32), "c": np.array(True)}
    with pytest.raises(ParityError, match="Stage 0 does not reproduce"):  # random numbers differ on every run
        onnx_modular.split(chain, tmp_path / "out", at=["first"], inputs=feeds)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chain.onnx"]  # no folder, no temporary folder
    # without the run, the same cut is written; the second stage holds the branch and its call
    result = onnx_modular.split(chain, tmp_path / "out", at=["second"], with_data=False)
    assert [s.calls for s in result.stages] == [["noise", "first"], ["second"]]
    stage_1 = onnx.load(str(result.stages[1].path))
    assert [n.op_type for n in stage_1.graph.node] == ["Scale", "If"] and [f.name for f in stage_1.functions] == ["Scale"]
    assert list(result.stages[1].inputs.items()) == [("b", "stage_0/b"), ("c", "c")]
    chained = onnx_modular.run_stages(tmp_path / "out", feeds)
    b = sessions.run(str(result.stages[0].path), {"x": feeds["x"]})[1][0]
    np.testing.assert_array_equal(chained["y"], b * 4)


def test_a_call_inside_control_flow_cannot_be_a_cut(chain, tmp_path):
    with pytest.raises(InvalidInputError, match="inside an If/Loop/Scan body"):
        onnx_modular.split(chain, tmp_path / "out", at=["inner"], with_data=False)
    assert not (tmp_path / "out").exists()


class _Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


class _Decoder(torch.nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 8)
        self.mix = torch.nn.Linear(8, 8)

    def forward(self, ids, memory):
        return self.mix(self.embed(ids) + memory.mean(1, keepdim=True))


class _EncoderDecoder(torch.nn.Module):
    """Whisper's and CLIP's shape: an encoder with weights of its own beside a decoder whose
    vocabulary table outweighs it (here 1024 x 8 against 2 x 8 x 8: the encoder is 1/7 of 5%)."""

    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = _Encoder(), _Decoder(1024)

    def forward(self, x, ids):
        return self.decoder(ids, self.encoder(x))


def test_an_encoder_outweighed_by_a_vocabulary_table_is_still_a_stage(tmp_path):
    # Before, a call under 5% of the heaviest call's bytes counted as a table (a rotary table, a
    # norm) and joined the next call: the encoder joined the decoder, and 2 stages were refused.
    # A call with calls of its own is never a table.
    torch.manual_seed(0)
    feeds = {"x": torch.randn(2, 3, 8), "ids": torch.randint(0, 1024, (2, 4))}
    path = tmp_path / "ed.onnx"
    export_modular(_EncoderDecoder().eval(), (), kwargs=feeds).save(path)
    result = onnx_modular.split(path, tmp_path / "stages", stages=2)
    assert [s.calls for s in result.stages] == [["encoder"], ["decoder"]]
    arrays = {name: value.numpy() for name, value in feeds.items()}
    chained = onnx_modular.run_stages(tmp_path / "stages", arrays)
    names, whole = sessions.run(str(path), arrays)
    np.testing.assert_allclose(chained[names[0]], whole[0], atol=ATOL)


class _Trunk(torch.nn.Module):
    """Layers that also return a constant (a cache's fixed field, as GraniteMoe SWA's)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x, torch.tensor([4, 4])  # a constant made in forward: torch lifts it


class _TrunkAndHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model, self.head = _Trunk(), torch.nn.Linear(16, 2)

    def forward(self, x):
        hidden, window = self.model(x)
        return self.head(hidden), window


def test_a_constant_output_of_an_opened_call_is_made_by_the_last_stage(tmp_path):
    # Opening `model` leaves `Identity(lifted constant)` in the main graph: a constant node,
    # copied only where a stage reads it. No stage read it, the last stage returned it unmade,
    # and onnx's checker refused that stage ("not an output of any node").
    torch.manual_seed(0)
    x = torch.randn(2, 16)
    path = tmp_path / "trunk.onnx"
    export_modular(_TrunkAndHead().eval(), (x,)).save(path)
    result = onnx_modular.split(path, tmp_path / "stages", stages=2)
    assert result.opened == ["model"] and len(result.stages) == 2
    names, whole = sessions.run(str(path), {"x": x.numpy()})
    chained = onnx_modular.run_stages(tmp_path / "stages", {"x": x.numpy()})
    assert set(chained) == set(names)
    np.testing.assert_allclose(chained[names[0]], whole[0], atol=ATOL)
    np.testing.assert_array_equal(chained[names[1]], [4, 4])
