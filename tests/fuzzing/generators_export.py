"""The file fuzzer's generators for ``export <folder>``: a tiny Llama checkpoint whose config or
weights are broken (:func:`gen_checkpoint`), and output folders holding links, FIFOs, another
model's data (:func:`gen_output_folder`). Their commands need torch and transformers in the children
(weight 0: only with ``--only checkpoint output_folder``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random

import numpy

from fuzzing.builders import _checks, _fingerprint, block_model, save_external

# -- checkpoint folders (``export <folder>``) ---------------------------------------------------

#: A valid tiny Llama configuration; each case breaks it (or its weights) in one or two ways.
_TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64,
    "max_position_embeddings": 32, "dtype": "float32", "tie_word_embeddings": False,
}  # fmt: skip
_SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "vocab_size", "max_position_embeddings", "head_dim")  # fmt: skip
_ODD_SIZES = (-4, 0, 10**7, 10**9, 10**12, 2**63, 1.5, "8", None, [16], True, 5 * 10**8)
_ODD_DTYPES = ("float33", "Tensor", 5, ["float16"], "", "torch.float16", "object", "bfloat16")
#: Written by code in a checkpoint (``auto_map``'s module, a pickled ``pytorch_model.bin``) if it ever ran.
PWNED = "PWNED-by-checkpoint"
_EVIL_CODE = f"import pathlib\npathlib.Path(__file__).resolve().parent.parent.parent.joinpath({PWNED!r}).write_text('ran')\n"


def _evil_pickle() -> bytes:
    """A pickle that, when loaded, writes PWNED next to the case folder (the command runs in the
    case folder): ``torch.load`` without ``weights_only`` would run it."""
    import pickle

    class Evil:
        def __reduce__(self):
            return (exec, (f"open('../{PWNED}', 'w').write('ran')",))

    return pickle.dumps({"model.embed_tokens.weight": Evil()})


def _weights(config: dict, rng: random.Random) -> dict[str, numpy.ndarray]:
    h, i, v = 16, 32, 64
    tensors = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,), "self_attn.q_proj.weight": (h, h),
             "self_attn.k_proj.weight": (8, h), "self_attn.v_proj.weight": (8, h), "self_attn.o_proj.weight": (h, h),
             "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}  # fmt: skip
    tensors.update({f"model.layers.0.{name}": shape for name, shape in layer.items()})
    return {name: numpy.asarray(numpy.random.default_rng(rng.randrange(2**32)).standard_normal(shape), numpy.float32)
            for name, shape in tensors.items()}  # fmt: skip


def _write_lying_weights(rng: random.Random, folder: pathlib.Path, weights: dict, how: int) -> None:
    """``model.safetensors`` whose header lies (``how`` 9: offsets or sizes; 10: not a dict of
    entries; else: a sharded index that lies), for :func:`gen_checkpoint`."""
    import safetensors.numpy

    safetensors.numpy.save_file(weights, str(folder / "model.safetensors"))
    data = bytearray((folder / "model.safetensors").read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    if how == 9:  # the header lies about offsets or sizes
        name = rng.choice([k for k in header if k != "__metadata__"])
        header[name]["data_offsets"] = rng.choice([[-40, 8], [0, 3 * 2**30], [0], [8, 0], "0-8"])
        new = json.dumps(header).encode()
    elif how == 10:  # not a dict of entries
        new = rng.choice([b"[1, 2]", b"5", b'{"a": "x"}', b"[" * 5000 + b"]" * 5000])
    else:  # a sharded index that lies
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": rng.choice([["model.safetensors"], dict.fromkeys(header, 7), dict.fromkeys(header, "../outside.safetensors")])}
        ))  # fmt: skip
        new = json.dumps(header).encode()
    data = len(new).to_bytes(8, "little") + new + data[8 + length :]
    (folder / "model.safetensors").write_bytes(data)


def gen_checkpoint(rng, case, seeds):
    """A checkpoint folder for ``export <folder>`` (with and without ``--stream-weights``): a tiny
    Llama whose ``config.json`` is broken (not JSON, empty, a list, nested thousands deep, a missing,
    unknown or non-string ``model_type``, an ``auto_map`` pointing at code in the folder, sizes that
    are negative, zero, fractional, strings or huge enough to need terabytes, odd dtypes) and/or whose
    weights lie (shapes that contradict the config, a missing tensor, a safetensors header that is a
    list or claims gigabytes, negative offsets, an index whose ``weight_map`` is a list or maps to an
    int, or only a pickled ``pytorch_model.bin`` that runs code when unpickled). The folder must come
    through unchanged, nothing it holds may run (``PWNED`` appears next to the case), and each
    command ends in a result or a typed error within its time and memory."""
    import safetensors.numpy

    folder = case / "ckpt"
    folder.mkdir()
    config = dict(_TINY_LLAMA)
    weights = _weights(config, rng)
    text, pickled_only, lie = None, False, None
    for _ in range(rng.choice([1, 1, 2])):
        how = rng.randrange(12)
        if how == 0:
            text = rng.choice(["{not json", "", "[1, 2]", "7", '"llama"', "null", "[" * 40_000 + "]" * 40_000,
                               '{"a":' * 30_000 + "1" + "}" * 30_000, "\ufeff{}", json.dumps(config)[:-3]])  # fmt: skip
        elif how == 1:
            config["model_type"] = rng.choice([None, "no-such-model", 7, ["llama"], "", "llama\x1b[2J"])
            if config["model_type"] is None:
                del config["model_type"]
        elif how == 2:
            (folder / "evil.py").write_text(_EVIL_CODE)
            config["auto_map"] = rng.choice([{"AutoConfig": "evil.Config", "AutoModelForCausalLM": "evil.Model"},
                                             {"AutoModel": "evil.Model"}, ["evil.Model"]])  # fmt: skip
        elif how in (3, 4):
            config[rng.choice(_SIZE_KEYS)] = rng.choice(_ODD_SIZES)
        elif how == 5:
            config[rng.choice(["dtype", "torch_dtype"])] = rng.choice(_ODD_DTYPES)
        elif how == 6:  # shapes that contradict the config, or a missing tensor
            name = rng.choice(sorted(weights))
            if rng.random() < 0.3:
                del weights[name]
            else:
                weights[name] = numpy.zeros(tuple(d + rng.choice([1, 3]) for d in weights[name].shape) or (2,), numpy.float32)
        elif how == 7:
            config["architectures"] = rng.choice([["NoSuchForCausalLM"], "LlamaForCausalLM", [7], []])
        elif how == 8:
            pickled_only = True  # only a pickled pytorch_model.bin
        else:
            lie = how
    (folder / "config.json").write_text(text if text is not None else json.dumps(config))
    if pickled_only:
        (folder / "pytorch_model.bin").write_bytes(_evil_pickle())
    elif lie is not None:
        _write_lying_weights(rng, folder, weights, lie)
    else:
        safetensors.numpy.save_file(weights, str(folder / "model.safetensors"))
    keep = {str(path.relative_to(case)): _fingerprint(path) for path in sorted(folder.iterdir())}
    commands = [["export", "ckpt", "-o", "out.onnx"], ["export", "ckpt", "-o", "out2.onnx", "--stream-weights"]]
    _checks(case, keep=keep, outside=PWNED, commands=commands, torch=True)
    return "ckpt"



def gen_output_folder(rng, case, seeds):
    """``export ckpt -o out`` (a tiny Llama checkpoint) into a folder holding another model's
    ``model.onnx.data``, entries that are links (to a file elsewhere, dangling), a FIFO, a private
    (0600) tokenizer file; or a checkpoint whose ``config.json`` / tokenizer links out of it.
    Nothing outside ``out`` may change or appear, the other model's data stays, modes are kept."""
    import safetensors.numpy

    folder, out, elsewhere = case / "ckpt", case / "out", case / "elsewhere"
    for path in (folder, out, elsewhere):
        path.mkdir()
    (elsewhere / "target").write_text(json.dumps(_TINY_LLAMA))
    (folder / "config.json").write_text(json.dumps(_TINY_LLAMA))
    safetensors.numpy.save_file(_weights(_TINY_LLAMA, rng), str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}))
    os.chmod(folder / "tokenizer.json", 0o600)
    save_external(block_model(), out / "other.onnx", "model.onnx.data")
    checks: dict = {"keep": {}, "absent": [], "modes": {}}
    for _ in range(rng.choice([1, 2, 3])):
        how = rng.randrange(6)
        if how == 0:
            with contextlib.suppress(FileExistsError):
                os.symlink("../elsewhere/target", out / rng.choice(["config.json", "export.json", "model.onnx", "generation_config.json"]))
        elif how == 1:
            with contextlib.suppress(FileExistsError):
                os.symlink("../elsewhere/new", out / rng.choice(["export.json", "tokenizer.json", "model.onnx.data"]))
            checks["absent"].append("elsewhere/new")
        elif how == 2:
            with contextlib.suppress(FileExistsError):
                os.mkfifo(out / rng.choice(["export.json", "tokenizer.json"]))
        elif how == 3:
            (folder / "config.json").unlink()
            os.symlink("../elsewhere/target", folder / "config.json")
        elif how == 4:
            (folder / "tokenizer.json").unlink()
            os.symlink("../elsewhere/target", folder / "tokenizer.json")
        elif not os.path.lexists(out / "tokenizer.json"):  # a link placed above is not written through
            with contextlib.suppress(FileExistsError):
                (out / "tokenizer.json").write_text("{}")
                os.chmod(out / "tokenizer.json", 0o640)
                # written over: the copy of a private (0600) file stays private; a refused export
                # leaves the file as it was, its 0640 included
                checks["private_copies"] = {"out/tokenizer.json": (_fingerprint(out / "tokenizer.json"), 0o640)}
    for path in [*elsewhere.iterdir(), *(p for p in out.iterdir() if p.name != "tokenizer.json" or p.is_fifo())]:
        if path.name in ("target", "other.onnx", "model.onnx.data") or path.is_fifo():
            checks["keep"][str(path.relative_to(case))] = _fingerprint(path)
    checks["keep"]["out/model.onnx.data"] = _fingerprint(out / "model.onnx.data")
    checks["commands"] = [["export", "ckpt", "-o", "out", "--no-verify"], ["verify", "out/other.onnx"]]
    checks["must_succeed"] = [1]
    checks["torch"] = True
    _checks(case, **checks)
    return "ckpt"
