"""The file fuzzer's generators that mutate a real export: its bytes (flips, overwrites,
truncation, splices, huge varints) or its protobuf (huge dims, bad callees, shuffled functions,
metadata, bad UTF-8, external-data references), and special files (a FIFO, a folder, a device).
"""

from __future__ import annotations

import json
import os
import shutil

import onnx
from onnx import TensorProto

from fuzzing.builders import _seed_bytes, _write
from onnx_modular.format import metadata


def gen_bitflips(rng, case, seeds):
    data = bytearray(_seed_bytes(rng, seeds))
    for _ in range(rng.choice([1, 2, 4, 8, 32])):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return _write(case, bytes(data))


def gen_byte_overwrite(rng, case, seeds):
    data = bytearray(_seed_bytes(rng, seeds))
    for _ in range(rng.choice([1, 3, 10])):
        pos = rng.randrange(len(data))
        chunk = bytes(rng.choice([0x00, 0xFF, 0x7F, 0x80, rng.randrange(256)]) for _ in range(rng.randint(1, 6)))
        data[pos : pos + len(chunk)] = chunk
    return _write(case, bytes(data))


def gen_truncate(rng, case, seeds):
    data = _seed_bytes(rng, seeds)
    return _write(case, data[: rng.randrange(len(data))])


def gen_splice(rng, case, seeds):
    data = _seed_bytes(rng, seeds)
    a, b = sorted(rng.randrange(len(data)) for _ in range(2))
    c = rng.randrange(len(data))
    return _write(case, data[:c] + data[a:b] + data[c:])


def gen_huge_varint(rng, case, seeds):
    data = bytearray(_seed_bytes(rng, seeds))
    pos = rng.randrange(len(data) - 10)
    data[pos : pos + 10] = b"\xff" * 9 + b"\x01"
    return _write(case, bytes(data))


def _seed_model(seeds: dict, which: str = "small") -> onnx.ModelProto:
    return onnx.load(str(seeds[which]), load_external_data=False)


def gen_huge_dim(rng, case, seeds):
    model = _seed_model(seeds)
    values = list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info)
    for value in rng.sample(values, min(len(values), rng.randint(1, 3))):
        dims = value.type.tensor_type.shape.dim
        if dims:
            dims[rng.randrange(len(dims))].dim_value = rng.choice([2**31, 2**40 - 1, 2**62, 0])
    return _write(case, model.SerializeToString())


def gen_bad_callee(rng, case, seeds):
    model = _seed_model(seeds)
    calls = [n for n in model.graph.node if n.domain.startswith("pkg.")]
    for function in model.functions:
        calls += [n for n in function.node if n.domain.startswith("pkg.")]
    node = rng.choice(calls)
    how = rng.randrange(3)
    if how == 0:
        node.op_type = "Missing" + node.op_type
    elif how == 1:
        node.domain = "pkg.nowhere"
    else:
        del node.input[:]  # a call with too few inputs
    return _write(case, model.SerializeToString())


def gen_shuffled_functions(rng, case, seeds):
    model = _seed_model(seeds)
    functions = list(model.functions)
    rng.shuffle(functions)
    del model.functions[:]
    model.functions.extend(functions)
    # and one body loses a node (a dangling value reference)
    function = rng.choice(model.functions)
    if len(function.node) > 1:
        del function.node[rng.randrange(len(function.node))]
    return _write(case, model.SerializeToString())


def gen_metadata(rng, case, seeds):
    model = _seed_model(seeds)
    targets = [model.metadata_props] + [f.metadata_props for f in model.functions]
    props = rng.choice(targets)
    value = rng.choice(
        [
            "[" * 100_000 + "]" * 100_000,
            '{"a": ' * 5000 + "1" + "}" * 5000,
            "not json",
            json.dumps([{"x": 1}, 2, None]),
            "\x1b[31mred\x1b[0m",
            json.dumps(["a" * 100_000]),
        ]
    )
    key = rng.choice([metadata.MODULE_PATHS, metadata.CLASS, metadata.CALL_COUNT])
    for prop in props:
        if prop.key == key:
            prop.value = value
            break
    else:
        props.add(key=key, value=value)
    return _write(case, model.SerializeToString())


def gen_bad_utf8(rng, case, seeds):
    """Invalid UTF-8 in names: protobuf (python) refuses to set it, so edit the bytes."""
    model = _seed_model(seeds)
    marker = "Q" * 12
    where = rng.randrange(4)
    if where == 0:
        model.functions[0].name = marker
        for f in model.functions[1:]:
            for node in f.node:
                if node.op_type == model.functions[0].name:
                    node.op_type = marker
        for node in model.graph.node:
            if node.op_type == model.functions[0].name:
                node.op_type = marker
    elif where == 1:
        model.graph.input[0].name = marker
    elif where == 2:
        model.functions[0].metadata_props.add(key=metadata.MODULE_PATHS, value=json.dumps([marker]))
    else:
        model.graph.node[0].name = marker
    data = model.SerializeToString().replace(marker.encode(), b"\xff\xfe" + b"q" * 10)
    return _write(case, data)


def gen_external(rng, case, seeds):
    """External data references: outside the folder, missing, absolute, huge offsets/lengths."""
    model = _seed_model(seeds, "external")
    source = seeds["external"].parent
    for entry in source.iterdir():
        if entry.name != seeds["external"].name:
            shutil.copy(entry, case / entry.name)
    tensors = [t for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    tensor = rng.choice(tensors)
    fields = {entry.key: entry for entry in tensor.external_data}
    how = rng.randrange(6)
    if how == 0:
        fields["location"].value = "../" * rng.randint(1, 4) + "outside.bin"
    elif how == 1:
        fields["location"].value = "/etc/hostname"
    elif how == 2:
        fields["location"].value = "missing.data"
    elif how == 3 and "offset" in fields:
        fields["offset"].value = str(rng.choice([2**40, 2**63 - 1, -5]))
    elif how == 4 and "length" in fields:
        fields["length"].value = str(rng.choice([2**40, 2**63 - 1, 0, -1]))
    else:
        fields["location"].value = rng.choice(["", ".", "sub/../../x", "a\x00b"])
    return _write(case, model.SerializeToString())


def gen_special_file(rng, case, seeds):
    how = rng.randrange(3)
    if how == 0:
        os.mkfifo(case / "m.onnx")
    elif how == 1:
        os.symlink("/dev/zero", case / "m.onnx")
    else:
        (case / "m.onnx").mkdir()
    return "m.onnx"
