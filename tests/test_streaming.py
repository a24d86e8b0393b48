"""weights=: models on the meta device, weights streamed from safetensors, block-by-block parity."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
import transformers
from safetensors.torch import save_file

from onnx_modular import export_modular
from onnx_modular.check.blockwise import verify_blocks
from onnx_modular.errors import (
    ExecutionProviderError,
    MissingWeightError,
    OnnxModularError,
    UnexpectedWeightError,
    WeightsError,
    WeightShapeError,
)
from onnx_modular.format import metadata
from onnx_modular.hf.meta import model_on_meta
from onnx_modular.weights.sources import WeightSource, plan_weights
from onnx_modular.weights.streaming import Blocks


def _config(tied: bool = True) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, tie_word_embeddings=tied, use_cache=False,
        architectures=["LlamaForCausalLM"],
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny tied-embedding Llama saved in shards by save_pretrained, and its real model."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config()).eval()
    folder = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(folder, max_shard_size="100KB")
    return folder, model


def _ids():
    return torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))


def _ort(path, ids):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: ids.numpy()})


def test_sharded_folder_on_meta_matches_pytorch(checkpoint, tmp_path):
    folder, real = checkpoint
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 1
    meta = model_on_meta(folder)
    assert all(p.is_meta for p in meta.parameters())
    assert meta.lm_head.weight is meta.model.embed_tokens.weight  # tied: one tensor in the checkpoint
    out = tmp_path / "m.onnx"
    result = export_modular(meta, (_ids(),), out, kwargs={"use_cache": False}, weights=folder)
    # Verified block by block by default on meta: every layer call, against PyTorch.
    assert result.blocks is not None and result.blocks.ok
    paths = [b.module_path for b in result.blocks.blocks]
    assert "model.layers.0" in " ".join(paths) and "lm_head" in paths
    assert all(b.outputs_compared >= 1 for b in result.blocks.blocks)
    # One row type for outputs and blocks; the block sessions run on the provider given.
    assert {b.kind for b in result.blocks.blocks} == {"block"} and {o.kind for o in result.report.outputs} == {"output"}
    blocks = Blocks([b.module_path for b in result.blocks.blocks], {b.module_path: b.weight_bytes for b in result.blocks.blocks})
    with pytest.raises(ExecutionProviderError, match="no-such-provider"):
        verify_blocks(out, [_ids()], [], blocks, execution_provider="no-such-provider")
    # External data by default, and every initializer is streamed (lazy) in memory.
    assert (tmp_path / "m.onnx.data").is_file()
    eager = [n for n, v in result.model.graph.initializers.items() if not isinstance(v.const_value, ir.LazyTensor)]
    lifted = metadata.lifted_constants(result.model)  # shapes and scalars lifted out of the bodies
    assert lifted and eager and all("inv_freq" in n or n in lifted for n in eager)  # and the non-persistent rotary buffers
    # The written file matches the real model in onnxruntime, whole.
    with torch.no_grad():
        expected = real(_ids(), use_cache=False).logits.numpy()
    (logits,) = _ort(out, _ids())
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=1e-3)
    # The same hierarchy as an export of the real model.
    functions = {f.name for f in result.functions}
    assert {"LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP"} <= functions
    # Folded weights (<name>.T) are transposes of the checkpoint's tensors.
    transposed = [v for name, v in result.model.graph.initializers.items() if name.endswith(".T")]
    assert transposed
    value = transposed[0]
    source_name = value.name[: -len(".T")]
    np.testing.assert_array_equal(value.const_value.numpy(), real.state_dict()[source_name].numpy().T)


def test_single_file_full_verification_and_folder_source(checkpoint, tmp_path):
    folder, real = checkpoint
    file = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in real.state_dict().items() if k != "lm_head.weight"}, str(file))
    meta = model_on_meta(folder)
    result = export_modular(meta, (_ids(),), tmp_path / "a.onnx", kwargs={"use_cache": False}, weights=file, verify="full")
    assert result.blocks is None and result.report.ok  # whole-file check through onnxruntime
    assert result.report.outputs[0].flat_max_abs is not None
    unverified = export_modular(
        model_on_meta(folder), (_ids(),), tmp_path / "b.onnx", kwargs={"use_cache": False}, weights=folder, verify=False
    )
    assert unverified.report is None and unverified.blocks is None
    np.testing.assert_array_equal(_ort(tmp_path / "a.onnx", _ids())[0], _ort(tmp_path / "b.onnx", _ids())[0])


def test_tied_weights_need_one_name(checkpoint):
    folder, real = checkpoint
    meta = model_on_meta(folder)
    state = {k: v for k, v in real.state_dict().items() if k != "model.embed_tokens.weight"}  # only lm_head
    plan = plan_weights(meta, state)
    assert plan.keys["model.embed_tokens.weight"] == "lm_head.weight" == plan.keys["lm_head.weight"]
    assert torch.equal(plan.load("model.embed_tokens.weight"), real.lm_head.weight)


@pytest.mark.parametrize(
    "change, error, names",
    [
        (lambda s: s.pop("model.norm.weight"), MissingWeightError, "model.norm.weight"),
        (lambda s: s.__setitem__("model.extra.bias", torch.zeros(3)), UnexpectedWeightError, "model.extra.bias"),
        (lambda s: s.__setitem__("model.norm.weight", torch.zeros(65)), WeightShapeError, "model.norm.weight"),
    ],
)
def test_bad_weights_raise_before_anything_is_written(checkpoint, tmp_path, change, error, names):
    folder, real = checkpoint
    state = {k: v.contiguous() for k, v in real.state_dict().items() if k != "lm_head.weight"}
    change(state)
    file = tmp_path / "bad.safetensors"
    save_file(state, str(file))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(error) as info:
        export_modular(model_on_meta(folder), (_ids(),), out / "m.onnx", kwargs={"use_cache": False}, weights=file)
    assert isinstance(info.value, (WeightsError, OnnxModularError))
    assert names in str(info.value) and info.value.module_path == names.rsplit(".", 1)[0]
    assert list(out.iterdir()) == []


def test_meta_model_without_weights_and_bad_sources(checkpoint, tmp_path):
    folder, _ = checkpoint
    with pytest.raises(OnnxModularError, match="meta device"):
        export_modular(model_on_meta(folder), (_ids(),), kwargs={"use_cache": False})
    with pytest.raises(WeightsError, match="does not exist"):
        plan_weights(model_on_meta(folder), tmp_path / "nope.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(WeightsError, match="not a readable safetensors"):
        plan_weights(model_on_meta(folder), tmp_path / "junk.safetensors")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    broken = tmp_path / "broken"
    broken.mkdir()
    index["weight_map"]["model.norm.weight"] = "../outside.safetensors"
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match="outside|missing"):
        plan_weights(model_on_meta(folder), broken)


class _Stack(torch.nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def test_save_reads_one_tensor_at_a_time(tmp_path, monkeypatch):
    """While the file is written, each weight is read once and released when written.

    The writer's threads hold at most ``WRITER_BYTES_IN_FLIGHT`` bytes of weights at once, and a
    tensor above that budget alone: with the budget below every tensor's size, only one weight is
    ever alive, whatever the threads' timing (with the default budget two small ones may be).
    """
    from onnx_modular.storage import save as storage_save

    monkeypatch.setattr(storage_save, "WRITER_BYTES_IN_FLIGHT", 1)
    torch.manual_seed(0)
    real = _Stack(32, 6).eval()
    alive, peak, reads, phase = [0], [0], {}, {"save": False}

    def reader(name):
        def read():
            tensor = real.state_dict()[name].clone()
            if phase["save"]:
                reads[name] = reads.get(name, 0) + 1
                alive[0] += 1
                peak[0] = max(peak[0], alive[0])
                weakref.finalize(tensor, lambda: alive.__setitem__(0, alive[0] - 1))
            return tensor

        return read

    source = WeightSource.from_functions({k: (v.dtype, tuple(v.shape), reader(k)) for k, v in real.state_dict().items()})
    with torch.device("meta"):
        meta = _Stack(32, 6).eval()

    def progress(stage, seconds):
        phase["save"] = stage == "optimize"  # the next stage writes the file

    x = torch.randn(2, 32)
    result = export_modular(meta, (x,), tmp_path / "s.onnx", weights=source, verify=False, progress=progress)
    assert peak[0] == 1  # never two weights in memory at once while writing
    assert set(reads) == set(real.state_dict()) and all(n == 1 for n in reads.values())
    assert result.model.graph.initializers  # names of the file
    session = ort.InferenceSession(str(tmp_path / "s.onnx"), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        np.testing.assert_allclose(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0], real(x).numpy(), atol=1e-5)


def test_unchanged_weights_are_copied_file_to_file(tmp_path, monkeypatch):
    """A weight written as stored goes file to file (``copy_file_range``); a cast one, or a
    destination without a file descriptor, through memory; the bytes are the same."""
    import io

    from onnx_modular.weights import sources

    state = {"a": torch.randn(64, 32), "b": torch.randn(16).to(torch.float16)}
    save_file(state, str(tmp_path / "w.safetensors"))
    source = WeightSource.open(tmp_path / "w.safetensors")
    with torch.device("meta"):
        model = torch.nn.Module()
        model.register_buffer("a", torch.empty(64, 32))
        model.register_buffer("b", torch.empty(16))  # float32: cast from the stored float16
    plan = plan_weights(model, source)
    copies = []
    real_copy = os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda *a: copies.append(a) or real_copy(*a))
    with open(tmp_path / "out.bin", "wb") as file:
        file.write(b"head")
        for name in ("a", "b"):
            plan.lazy_tensor(name).tofile(file)
    data = (tmp_path / "out.bin").read_bytes()
    assert len(copies) == 1 and copies[0][2] == 64 * 32 * 4  # "a" only, in one kernel copy
    assert data == b"head" + state["a"].numpy().tobytes() + state["b"].float().numpy().tobytes()
    buffer = io.BytesIO()  # no file descriptor: written through memory
    plan.lazy_tensor("a").tofile(buffer)
    assert buffer.getvalue() == state["a"].numpy().tobytes() and len(copies) == 1
    assert sources._copy_range(source.location("a"), buffer, 64 * 32 * 4) is False


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_weights(tmp_path):
    """Export ~400 MB of weights on meta: the process's peak RSS grows by far less."""
    width, depth = 2048, 24  # 24 x 16 MiB = 384 MiB of float32 weights
    torch.manual_seed(0)
    state = {}
    for i in range(depth):
        state[f"layers.{i}.weight"] = torch.randn(width, width) * 0.02
        state[f"layers.{i}.bias"] = torch.zeros(width)
    save_file(state, str(tmp_path / "w.safetensors"))
    weight_bytes = sum(t.nbytes for t in state.values())
    del state
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
        from test_streaming import _Stack
        from onnx_modular import export_modular

        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        with torch.device("meta"):
            model = _Stack({width}, {depth}).eval()
        with torch.device("meta"):
            small = _Stack(8, 2).eval()  # warm up: imports and caches, not weights
        export_modular(small, (torch.randn(2, 8),), {str(tmp_path / 'small.onnx')!r},
                       weights={{k: torch.randn(v.shape) for k, v in small.state_dict().items()}}, verify="blocks")
        before = status("VmHWM:")
        x = torch.randn(2, {width})
        export_modular(model, (x,), {str(tmp_path / 'big.onnx')!r}, weights={str(tmp_path / 'w.safetensors')!r}, verify=False)
        export_modular(model, (x,), {str(tmp_path / 'big2.onnx')!r}, weights={str(tmp_path / 'w.safetensors')!r}, verify="blocks", max_block_bytes=40 << 20)
        print(before, status("VmHWM:"))
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=dict(os.environ))
    assert run.returncode == 0, run.stderr[-2000:]
    before, peak = (int(n) for n in run.stdout.strip().splitlines()[-1].split())
    growth = peak - before
    assert (tmp_path / "big.onnx.data").stat().st_size >= weight_bytes
    assert growth < weight_bytes / 2, f"peak grew by {growth / 2**20:.0f} MiB for {weight_bytes / 2**20:.0f} MiB of weights"
    onnx.checker.check_model(str(tmp_path / "big.onnx"))
