"""The file fuzzer's generators of graphs built from scratch (issue 25 and the generated function
graphs): hidden external data, names for the terminal, npz inputs, destinations, constant bombs,
call-expansion bombs, recursion, deep chains, many large inputs, symbolic dims.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil

import numpy
import onnx
from onnx import TensorProto, helper

from fuzzing.builders import (
    _TERMINAL,
    DOMAIN,
    _call,
    _checks,
    _external_ref,
    _fingerprint,
    _model,
    _opsets,
    _write,
    bomb,
)


def gen_hidden_external(rng, case, seeds):
    """An external-data reference where a shallow check does not look: a sparse initializer's
    values or indices, a Constant's ``sparse_value``, an initializer of an If branch inside a
    function, a tensor attribute whose declared type says it is an int. The file it names is
    outside the folder, a FIFO (a read hangs: a timeout), or a link to ``/dev/zero``."""
    target = rng.choice(["fifo", "../outside.bin", "zero", "/etc/hostname", "link-out"])
    if target == "fifo":
        os.mkfifo(case / "fifo")
    elif target == "zero":
        os.symlink("/dev/zero", case / "zero")
    elif target == "link-out":
        os.symlink("../outside.bin", case / "link-out")
    (case.parent / "outside.bin").write_bytes(b"\0" * 64)
    values = helper.make_tensor("v", TensorProto.FLOAT, [2], [1.0, 2.0])
    indices = helper.make_tensor("i", TensorProto.INT64, [2], [0, 4])
    sparse = helper.make_sparse_tensor(values, indices, [2, 3])
    where = rng.randrange(5)
    _external_ref(values if rng.random() < 0.5 else indices, target)
    relu = [helper.make_node("Relu", ["x"], ["y"])]
    if where == 0:  # a sparse initializer of the main graph
        model = _model(relu, [])
        model.graph.sparse_initializer.append(sparse)
    elif where == 1:  # Constant sparse_value, in a function
        body = [helper.make_node("Constant", [], ["s"], sparse_value=sparse), helper.make_node("Relu", ["a"], ["b"])]
        model = _model([_call("f", ["x"], ["y"])], [helper.make_function(DOMAIN, "f", ["a"], ["b"], body, _opsets())])
    else:
        dense = helper.make_tensor("w", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])
        _external_ref(dense, target)
        if where == 2:  # an initializer of an If branch inside a function
            branch = helper.make_graph(
                [helper.make_node("Identity", ["w"], ["o"])], "then", [],
                [helper.make_tensor_value_info("o", TensorProto.FLOAT, [3])], [dense],
            )  # fmt: skip
            body = [
                helper.make_node("Constant", [], ["c"], value=helper.make_tensor("c", TensorProto.BOOL, [], [True])),
                helper.make_node("If", ["c"], ["k"], then_branch=branch, else_branch=branch),
                helper.make_node("Relu", ["a"], ["b"]),
            ]
            model = _model([_call("f", ["x"], ["y"])], [helper.make_function(DOMAIN, "f", ["a"], ["b"], body, _opsets())])
        else:  # a Constant whose tensor attribute claims another type
            attribute = helper.make_attribute("value", dense)
            if where == 4:
                attribute.type = onnx.AttributeProto.INT
            constant = helper.make_node("Constant", [], ["w2"])
            constant.attribute.append(attribute)
            model = _model([constant, helper.make_node("Relu", ["x"], ["y"])], [])
    _checks(case, no_outside_refs=["out.onnx"])
    return _write(case, model.SerializeToString())




def gen_terminal_names(rng, case, seeds):
    """Names that would drive the terminal (clear the screen, set the title, reverse a line)
    in graph inputs/outputs, node names and function names; the commands print them in the
    tree, the verify report and its error line. Any raw ESC/BEL/U+202E printed is a failure."""
    bad = rng.choice(_TERMINAL)
    nodes = [_call("f" + bad, ["x" + bad], ["y" + bad])]
    nodes[0].name = "node" + rng.choice(_TERMINAL)
    body = [helper.make_node("Relu", ["a"], ["b"])]
    if rng.random() < 0.5:  # a model that differs from its flat copy cannot: make verify fail differently
        body[0].name = rng.choice(_TERMINAL)
    functions = [helper.make_function(DOMAIN, "f" + bad, ["a"], ["b"], body, _opsets())]
    model = _model(
        nodes,
        functions,
        inputs=[helper.make_tensor_value_info("x" + bad, TensorProto.FLOAT, [2, 3])],
        outputs=[helper.make_tensor_value_info("y" + bad, TensorProto.FLOAT, [2, 3])],
    )
    if rng.random() < 0.3:
        model.graph.node[0].input[0] = "undefined" + bad  # onnxruntime refuses: an error line with the name
    return _write(case, model.SerializeToString())


def _npz_bytes(rng) -> bytes:
    buffer = io.BytesIO()
    how = rng.randrange(5)
    if how == 0:
        numpy.savez(buffer, x=numpy.array(["ab", "c"]))
    elif how == 1:
        numpy.savez(buffer, x=numpy.zeros(6, dtype="U0"))
    elif how == 2:
        numpy.savez(buffer, x=numpy.zeros(2, dtype=[("a", "f4"), ("b", "i4")]))
    else:
        numpy.savez(buffer, x=numpy.zeros((2, 3), dtype=numpy.float32))
    data = bytearray(buffer.getvalue())
    central = data.find(b"PK\x01\x02")
    if how == 3:  # an encrypted member
        data[6] |= 1
        data[central + 8] |= 1
    elif how == 4:  # a compression method zipfile does not know
        data[8] = data[central + 10] = rng.choice([1, 6, 97, 99])
    return bytes(data)


def gen_npz_inputs(rng, case, seeds):
    """``verify --inputs`` with an .npz holding strings, empty items, records, an encrypted
    member or an unknown compression method."""
    (case / "in.npz").write_bytes(_npz_bytes(rng))
    _checks(case, inputs="in.npz")
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [])
    return _write(case, model.SerializeToString())


def gen_destination(rng, case, seeds):
    """``inline`` to a destination that must not be replaced or followed: a FIFO, a link to a
    FIFO or to ``/dev/null``, or a lock-file name taken by a dangling link or a folder; and
    another model (``victim.onnx``) whose data file has the name the destination's data would
    take. The victim's files and the FIFO must come through unchanged."""
    source = seeds["external"].parent
    for entry in source.iterdir():
        shutil.copy(entry, case / entry.name)
    name = seeds["external"].name
    how = rng.randrange(5)
    if how == 0:
        os.mkfifo(case / "out.onnx")
    elif how == 1:
        os.mkfifo(case / "pipe")
        os.symlink("pipe", case / "out.onnx")
    elif how == 2:
        os.symlink("/dev/null", case / "out.onnx")
    else:
        lock = ".onnx_modular-lock-" + hashlib.sha256(b"out.onnx").hexdigest()[:16]
        if how == 3:
            os.symlink("../escaped-lock", case / lock)
        else:
            (case / lock).mkdir()
    # the victim: a renamed copy of the seed whose data file is named as out.onnx's would be
    victim = onnx.load(str(case / name), load_external_data=False)
    for tensor in victim.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                old = entry.value
                entry.value = "out.onnx.data"
    if (case / old).exists():
        shutil.copy(case / old, case / "out.onnx.data")
    onnx.save(victim, str(case / "victim.onnx"))
    keep = ["victim.onnx", "out.onnx.data"] + (["out.onnx"] if how == 0 else ["pipe"] if how == 1 else [])
    _checks(case, keep={path: _fingerprint(case / path) for path in keep}, outside="escaped-lock")
    return name


def gen_constant_bomb(rng, case, seeds):
    """A tiny file whose constant folds to a declared 1024**3 tensor (ConstantOfShape, Expand,
    Tile): ``inline --optimize`` must not allocate it (the memory limit catches it)."""
    shape = helper.make_tensor("s", TensorProto.INT64, [3], [1024, 1024, rng.choice([1024, 4096])])
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    how = rng.randrange(3)
    if how == 0:
        grow = [helper.make_node("ConstantOfShape", ["s"], ["big"], value=one)]
    elif how == 1:
        grow = [helper.make_node("Constant", [], ["o"], value=one), helper.make_node("Expand", ["o", "s"], ["big"])]
    else:
        grow = [
            helper.make_node("Constant", [], ["o"], value=helper.make_tensor("o", TensorProto.FLOAT, [1, 1, 1], [1.0])),
            helper.make_node("Tile", ["o", "s"], ["big"]),
        ]
    nodes = [
        helper.make_node("Constant", [], ["s"], value=shape),
        *grow,
        helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0),
        helper.make_node("Add", ["x", "total"], ["y"]),
    ]
    _checks(case, optimize=True)
    return _write(case, _model(nodes, []).SerializeToString())




def gen_bomb(rng, case, seeds):
    model = bomb(depth=rng.choice([16, 24, 32]), fanout=rng.choice([2, 3]), via_if=rng.random() < 0.4)
    return _write(case, model.SerializeToString())


def gen_recursion(rng, case, seeds):
    n = rng.randint(1, 4)  # f0 -> f1 -> ... -> f{n-1} -> f0
    functions = [
        helper.make_function(DOMAIN, f"f{i}", ["a"], ["b"], [_call(f"f{(i + 1) % n}", ["a"], ["b"])], _opsets())
        for i in range(n)
    ]
    if rng.random() < 0.5:  # the cycle hidden in an If branch
        inner = helper.make_graph([_call("f0", ["a"], ["r"])], "t", [], [helper.make_tensor_value_info("r", TensorProto.FLOAT, None)])
        functions[0] = helper.make_function(
            DOMAIN,
            "f0",
            ["a", "c"],
            ["b"],
            [helper.make_node("If", ["c"], ["b"], then_branch=inner, else_branch=inner)],
            _opsets(),
        )
    return _write(case, _model([_call("f0", ["x"], ["y"])], functions).SerializeToString())


def gen_deep_chain(rng, case, seeds):
    depth = rng.choice([150, 250, 1000, 5000])
    functions = [helper.make_function(DOMAIN, "f0", ["a"], ["b"], [helper.make_node("Relu", ["a"], ["b"])], _opsets())]
    for level in range(1, depth):
        functions.append(helper.make_function(DOMAIN, f"f{level}", ["a"], ["b"], [_call(f"f{level - 1}", ["a"], ["b"])], _opsets()))
    return _write(case, _model([_call(f"f{depth - 1}", ["x"], ["y"])], functions).SerializeToString())


def gen_many_inputs(rng, case, seeds):
    count = rng.choice([8, 40, 200])
    side = rng.choice([4096, 8000])  # each input just under the per-input cap of 2**26 elements
    inputs = [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [side, side]) for i in range(count)]
    nodes, current = [], "x0"
    for i in range(1, count):
        nodes.append(helper.make_node("Add", [current, f"x{i}"], [f"s{i}"]))
        current = f"s{i}"
    nodes.append(helper.make_node("Identity", [current], ["y"]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [side, side])]
    return _write(case, _model(nodes, [], inputs, outputs).SerializeToString())


def gen_symbolic_dims(rng, case, seeds):
    """Inputs with symbolic or missing dims and odd dtypes (random inputs must cope or refuse)."""
    dtype = rng.choice([TensorProto.FLOAT, TensorProto.STRING, TensorProto.BFLOAT16, TensorProto.COMPLEX64, TensorProto.BOOL, 0])
    shape = rng.choice([None, ["batch", 3], [-1, 3], [0, 3], ["", 2**33]])
    inputs = [helper.make_tensor_value_info("x", dtype, shape)]
    node = helper.make_node("Identity", ["x"], ["y"])
    outputs = [helper.make_tensor_value_info("y", dtype, shape)]
    return _write(case, _model([node], [], inputs, outputs).SerializeToString())
