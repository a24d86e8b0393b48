"""Odd models and factories get typed errors that say what happened (issue 12)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import struct

import pytest
import torch
import torch.nn as nn
from fuzzing import builders

from onnx_modular import InvalidInputError, ModularizeError, export_modular
from onnx_modular.cli import main
from onnx_modular.errors import OnnxModularError, WeightsError
from onnx_modular.weights import WeightSource


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(arg) for arg in argv])
    return code, out.getvalue(), err.getvalue()


class CallKeyCollision(nn.Module):
    """torch.export keys the second call of ``x`` as ``x@1``: the key of the module ``x@1``."""

    def __init__(self):
        super().__init__()
        self.d = nn.ModuleDict({"x": nn.Linear(4, 4), "x@1": nn.Linear(4, 4)})

    def forward(self, a):
        a = self.d["x"](a)
        a = self.d["x@1"](a)
        return self.d["x"](a)


def test_a_module_named_like_a_repeated_call_is_refused(tmp_path):
    with pytest.raises(ModularizeError, match=r"'d\.x@1' and 'd\.x' share torch\.export's call key") as info:
        export_modular(CallKeyCollision().eval(), (torch.randn(2, 4),), tmp_path / "m.onnx")
    assert info.value.module_path == "d.x@1"
    assert "Rename the submodule 'd.x@1'" in str(info.value)
    assert os.listdir(tmp_path) == []


class NoCollision(nn.Module):
    """The same names, called so that no key is shared: exported, three calls."""

    def __init__(self):
        super().__init__()
        self.d = nn.ModuleDict({"x": nn.Linear(4, 4), "x@1": nn.Linear(4, 4)})

    def forward(self, a):
        return self.d["x@1"](self.d["x"](a))


def test_names_with_at_sign_export_when_keys_do_not_collide():
    result = export_modular(NoCollision().eval(), (torch.randn(2, 4),), None)
    assert result.report.ok
    assert sorted(call.module_path for call in result.hierarchy.calls_with_functions()) == ["d.x", "d.x@1"]


class ReturnsNone(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        self.proj(x)


class ReturnsText(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return {"logits": self.proj(x), "label": "cat"}


class ReturnsSize(nn.Module):
    def forward(self, x):
        return x * 2, x.shape[0]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (ReturnsNone(), r"forward\(\) returned None, with no tensor in it"),
        (ReturnsText(), r"forward\(\) returned a value of type str at output\.label \('cat'\)"),
        (ReturnsSize(), r"forward\(\) returned a value of type int at output\.1 \(2\)"),
    ],
)
def test_non_tensor_outputs_are_named(tmp_path, model, message):
    with pytest.raises(InvalidInputError, match=message):
        export_modular(model.eval(), (torch.randn(2, 4),), tmp_path / "m.onnx")
    assert os.listdir(tmp_path) == []


def test_a_factory_that_exits_is_an_error(tmp_path):
    script = tmp_path / "make.py"
    script.write_text("import sys\ndef make():\n    sys.exit()\n")
    code, _, err = run_cli("export", f"{script}:make", "-o", tmp_path / "m.onnx")
    assert code == 2
    assert f"error: [input] The factory '{script}:make' exited (SystemExit(None)) instead of returning a model." in err
    assert sorted(os.listdir(tmp_path)) == ["make.py"]
    code, _, err = run_cli("export", "builtins:exit", "-o", tmp_path / "m.onnx")  # a builtin is no factory
    assert code == 2 and "'builtins:exit' is a Python builtin, not a factory" in err


def test_a_factory_module_that_exits_on_import_is_an_error(tmp_path):
    script = tmp_path / "make.py"
    script.write_text("import sys\nsys.exit(3)\n")
    code, _, err = run_cli("export", f"{script}:make", "-o", tmp_path / "m.onnx")
    assert code == 2
    assert "failed: SystemExit: 3" in err
    assert sorted(os.listdir(tmp_path)) == ["make.py"]


# -- issue 25: API misuse, factories, training mode ------------------------------------------


@pytest.mark.parametrize(
    "call, message",
    [
        ({"args": 3}, "args must be a tuple of positional inputs"),
        ({"args": "x"}, "args must be a tuple of positional inputs"),
        ({"kwargs": [1, 2]}, "kwargs must be a dict"),
        ({"verify": "bogus"}, "verify must be True, False, 'blocks' or 'full'"),
        ({"max_block_bytes": -5}, "max_block_bytes must be a positive number"),
        ({"max_block_bytes": True}, "max_block_bytes must be a positive number"),
    ],
)
def test_api_misuse_is_a_typed_error(tmp_path, call, message):
    call = {"args": (torch.randn(2, 4),), **call}
    with pytest.raises(InvalidInputError, match=message):
        export_modular(nn.Linear(4, 4).eval(), call.pop("args"), tmp_path / "m.onnx", **call)
    assert os.listdir(tmp_path) == []


FACTORIES = """
class Boom(BaseException):
    pass

def a_list():
    return [1, 2, 3, 4, 5]

def an_int():
    return 3

def base_exception():
    raise Boom("from the factory")
"""


@pytest.mark.parametrize(
    "factory, message",
    [
        ("builtins:breakpoint", "is a Python builtin, not a factory"),
        ("builtins:input", "is a Python builtin, not a factory"),
        ("{file}:a_list", "returned list"),
        ("{file}:an_int", "returned int"),
        ("{file}:base_exception", "raised Boom: from the factory"),
    ],
)
def test_odd_factories_are_typed_errors(tmp_path, factory, message):
    script = tmp_path / "factories.py"
    script.write_text(FACTORIES)
    code, _, err = run_cli("export", factory.format(file=script), "-o", tmp_path / "m.onnx")
    assert code == 2 and err.startswith("error: [input]") and "Traceback" not in err, err
    assert message in err
    assert not (tmp_path / "m.onnx").exists()


class TrainingNet(nn.Module):
    def __init__(self, fail: bool = False):
        super().__init__()
        self.fail = fail
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        y = self.drop(self.norm(self.lin(x)))
        if self.fail and y.sum() > -1e9:  # data-dependent: torch.export refuses it, after the eager run
            y = y + 1
        return y


@pytest.mark.parametrize("fail", [False, True], ids=["export-succeeds", "export-fails"])
def test_a_model_in_training_mode_comes_back_as_given(tmp_path, fail):
    model = TrainingNet(fail).train()
    model.drop.eval()  # a mixed set of flags must come back too
    flags = [m.training for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    objects = dict(model.state_dict(keep_vars=True))
    with pytest.raises(OnnxModularError) if fail else contextlib.nullcontext():
        export_modular(model, (torch.randn(8, 4),), tmp_path / "m.onnx", verify=False)
    assert [m.training for m in model.modules()] == flags
    after = model.state_dict(keep_vars=True)
    assert all(after[k] is objects[k] for k in objects)  # the same Parameter and buffer objects
    assert all(torch.equal(after[k], state[k]) for k in state)  # running_mean, num_batches_tracked, weights


# -- issue 25: safetensors headers are validated as data -------------------------------------




def safetensors_file(path, header, body: bytes = b"\0" * 56, raw: bytes | None = None):
    text = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)
    return path


GOOD_A = {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]}
GOOD_B = {"dtype": "I64", "shape": [1], "data_offsets": [48, 56]}


@pytest.mark.parametrize(
    "header, message",
    [
        ([1, 2], "header is a JSON list"),
        (5, "header is a JSON int"),
        ({"a": "x"}, "is described by a JSON str"),
        ({"a": {"dtype": "F32", "shape": [3, 4]}, "b": GOOD_B}, "has data_offsets None"),
        ({"a": {**GOOD_A, "data_offsets": [0, 24, 48]}, "b": GOOD_B}, "data_offsets [0, 24, 48]"),
        ({"a": {**GOOD_A, "data_offsets": [-40, 8]}, "b": GOOD_B}, "data_offsets [-40, 8]"),
        ({"a": {**GOOD_A, "data_offsets": [0, 3 * 2**30], "shape": [3, 2**28]}}, "<= 56"),
        ({"a": {**GOOD_A, "shape": [True, 12]}, "b": GOOD_B}, "a shape is a list of non-negative integers"),
        ({"a": {**GOOD_A, "shape": [4, 4]}, "b": GOOD_B}, "declares shape [4, 4] of F32 (64 bytes) but 48"),
        ({"a": {**GOOD_A, "dtype": ["F32"]}, "b": GOOD_B}, "has dtype ['F32']"),
        ({"a": GOOD_A, "b": {**GOOD_B, "data_offsets": [40, 48]}}, "overlaps the tensor before it"),
        ({"a": {**GOOD_A, "data_offsets": [8, 56]}, "b": {**GOOD_B, "data_offsets": [0, 8]}, "c": GOOD_B}, "overlaps"),
        ({"a": GOOD_A}, "end at byte 48 of the data, but the file holds 56"),
    ],
)
def test_safetensors_headers_that_lie_are_refused(tmp_path, header, message):
    with pytest.raises(WeightsError, match=re.escape(message)):
        WeightSource.open(safetensors_file(tmp_path / "w.safetensors", header))


@pytest.mark.parametrize(
    "raw, message",
    [
        (b'{"a": %s, "a": %s}' % (json.dumps(GOOD_A).encode(), json.dumps(GOOD_A).encode()), "the name 'a' appears twice"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b"\xff\xfe{}", "not a readable safetensors file"),
    ],
    ids=["duplicate", "deep", "not-utf8"],
)
def test_safetensors_header_json_is_parsed_strictly(tmp_path, raw, message):
    with pytest.raises(WeightsError, match=message):
        WeightSource.open(safetensors_file(tmp_path / "w.safetensors", None, raw=raw))


def test_a_short_file_claiming_gigabytes_allocates_nothing(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(struct.pack("<Q", 3 * 2**30) + b"{}")
    with pytest.raises(WeightsError, match="header claims 3221225472 bytes"):
        WeightSource.open(path)


def test_weights_paths_and_indexes_are_checked(tmp_path):
    os.mkfifo(tmp_path / "fifo.safetensors")
    with pytest.raises(WeightsError, match="is not a regular file"):
        WeightSource.open(tmp_path / "fifo.safetensors")
    for weight_map, message in (([1, 2], "no weight_map object"), ({"w": 3}, "maps 'w' to 3")):
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(WeightsError, match=message):
            WeightSource.open(tmp_path)


# -- issue 25: checkpoint folders are checked before transformers reads them ------------------


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _edited_config(source, target, text=None, **changes):
    import shutil

    shutil.copytree(source, target)
    if text is None:
        config = json.loads((source / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        text = json.dumps(config)
    (target / "config.json").write_text(text)
    return target


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"text": "{not json"}, "config.json' is not valid JSON"),
        ({"text": ""}, "config.json' is not valid JSON"),
        ({"text": "[1, 2]"}, "holds a JSON list, not an object"),
        ({"text": "[" * 50_000 + "]" * 50_000}, "nested too deeply"),
        ({"model_type": "no-such-model"}, "model_type 'no-such-model', which this transformers version does not know"),
        ({"model_type": None}, "model_type None"),
        ({"auto_map": {"AutoConfig": "code.Config"}}, "never runs code from a checkpoint"),
        ({"hidden_size": -4}, "sets hidden_size to -4"),
        ({"num_attention_heads": "4"}, "sets num_attention_heads to '4'"),
        ({"dtype": "Tensor"}, "sets dtype to 'Tensor'"),
        ({"hidden_size": 10**9}, "describes a model of at least 1e+18 parameters"),
        ({"num_hidden_layers": 10**7}, "describes a model of at least"),
        ({"vocab_size": 10**12}, "describes a model of at least"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["load", "meta"])
def test_bad_checkpoint_configs_are_typed_errors(llama_folder, tmp_path, edit, message, stream):
    from onnx_modular.hf.checkpoint import load_checkpoint, meta_checkpoint

    folder = _edited_config(llama_folder, tmp_path / "ckpt", **edit)
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        (meta_checkpoint if stream else load_checkpoint)(folder, "causal-lm")


def test_pickled_weights_are_never_unpickled(llama_folder, tmp_path):
    from onnx_modular.hf.checkpoint import load_checkpoint

    folder = _edited_config(llama_folder, tmp_path / "ckpt")
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(InvalidInputError, match="only pytorch_model.bin: pickled weights are never unpickled"):
        load_checkpoint(folder, "causal-lm")


def test_weights_that_contradict_the_config_are_a_typed_error(llama_folder, tmp_path):
    from onnx_modular.hf.checkpoint import load_checkpoint

    folder = _edited_config(llama_folder, tmp_path / "ckpt", intermediate_size=48)
    with pytest.raises(InvalidInputError, match="Loading the weights of .* failed"):
        load_checkpoint(folder, "causal-lm")


def test_the_zero_cache_is_bounded_before_allocation(llama_folder):
    from onnx_modular.hf.meta import model_on_meta, zero_cache

    model = model_on_meta(llama_folder)
    model.config.num_key_value_heads = 2**24  # 2**31 values: 8 GiB of float32
    with pytest.raises(InvalidInputError, match="A sample cache for this config holds"):
        zero_cache(model, 2, 4)
    model.config.num_key_value_heads = 0
    model.config.num_attention_heads = -1
    with pytest.raises(InvalidInputError, match="are not positive integers"):
        zero_cache(model, 2, 4)


# -- issue 25: localize reads files as the file tools do; signals during imports -------------


def test_localize_uses_the_bounded_loader(tmp_path):
    from onnx_modular.check.localization import localize
    from onnx_modular.errors import InvalidModelFileError

    os.mkfifo(tmp_path / "fifo.onnx")  # onnx_ir.load would block on it for ever
    with pytest.raises(InvalidModelFileError, match="is not a regular file"):
        localize(tmp_path / "fifo.onnx", nn.Identity(), (torch.ones(2, 3),))
    (tmp_path / "bomb.onnx").write_bytes(builders.bomb(depth=24).SerializeToString())
    with pytest.raises(InvalidModelFileError, match="expand to"):
        localize(tmp_path / "bomb.onnx", nn.Identity(), (torch.ones(2, 3),))


@pytest.mark.parametrize("delay", [0.5, 1.5, 3.0])
def test_sigterm_while_the_cli_imports_torch_exits_cleanly(tmp_path, delay):
    import signal
    import subprocess
    import sys
    import time

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen(
        [sys.executable, "-m", "onnx_modular", "export", "onnx_modular.hf.demo:gpt2", "-o", str(tmp_path / "m.onnx")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    # Killed before the CLI installs its handler (the default action), or "interrupted": never an
    # abort (134) or a traceback, and nothing written.
    assert proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), (proc.returncode, err[-2000:])
    assert "Traceback" not in err and "terminate called" not in err, err[-2000:]
    assert os.listdir(tmp_path) == []
