"""Inputs of an ONNX file: the declared ones, random feeds that are valid for the model, checks."""

from __future__ import annotations

import ast
import numbers
import os
import re
import zipfile
from collections.abc import Mapping

import numpy as np
import onnx

from onnx_modular.errors import InvalidInputError
from onnx_modular.storage.proto import numel, shown

__all__ = ["model_inputs", "random_inputs", "check_feeds", "feeds_from_arrays", "feeds_for", "load_arrays", "MAX_ARRAY_BYTES"]

#: Most bytes :func:`load_arrays` reads from one ``.npz`` (all arrays, uncompressed).
MAX_ARRAY_BYTES = 2**31


_DEFAULT_INT_HIGH = 10


def model_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs a caller must feed (inputs that are also initializers excluded)."""
    initializers = {tensor.name for tensor in model.graph.initializer}
    return [value for value in model.graph.input if value.name not in initializers]


def _numpy_dtype(elem_type: int, name: str) -> np.dtype:
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        type_name = (
            onnx.TensorProto.DataType.Name(elem_type) if elem_type in onnx.TensorProto.DataType.values() else elem_type
        )
        raise InvalidInputError(
            f"Cannot make random values for input {name!r} of type {type_name}; pass --inputs."
        ) from None


def random_inputs(
    model: onnx.ModelProto,
    *,
    dims: Mapping[str, int] | None = None,
    default_dim: int = 2,
    seed: int = 0,
    int_high: int = _DEFAULT_INT_HIGH,
    max_elements: int = 2**26,
) -> dict[str, np.ndarray]:
    """Random feeds for the model's inputs, from their declared shapes and types.

    Symbolic dimensions take their value from ``dims`` (by name) or ``default_dim``; a dimension
    named by a sum of others (``past_sequence_length + sequence_length``) is their sum;
    floats are standard normal, integers uniform in ``[0, int_high)``, booleans fair coins.
    Integer and boolean inputs named like a mask (``attention_mask``, ``*mask*``) are all
    ones, so that no row is masked entirely (an input the model cannot have been meant for).
    A file with onnxruntime's ``GroupQueryAttention`` gets batch 1 unless ``dims`` says otherwise.

    Raises:
        InvalidInputError: An input is not a tensor, has a type without random values
            (strings), the inputs together would hold more than ``max_elements`` elements
            (checked before any is made), or ``seed`` is negative.

    Example::

        feeds = random_inputs(model, dims={"batch": 1, "sequence": 16}, seed=0)
    """
    dims = {**(_gqa_dims(model) or {}), **(dims or {})}
    if not isinstance(seed, numbers.Integral) or seed < 0:
        raise InvalidInputError(f"The seed of the random inputs must be an integer >= 0, got {seed!r}.")
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    planned: list[tuple[onnx.ValueInfoProto, np.dtype, list[int]]] = []
    total = 0
    for value in model_inputs(model):
        if not value.type.HasField("tensor_type"):
            raise InvalidInputError(f"Input {value.name!r} is not a tensor; pass --inputs with its value.")
        tensor_type = value.type.tensor_type
        dtype = _numpy_dtype(tensor_type.elem_type, value.name)
        shape = []
        for dim in tensor_type.shape.dim:
            if dim.HasField("dim_value") and dim.dim_value >= 0:
                shape.append(dim.dim_value)
            else:
                shape.append(_dim_size(dim.dim_param, dims, default_dim) if dim.HasField("dim_param") else default_dim)
        elements = numel(shape)
        total += elements
        if total > max_elements:
            what = f"Input {shown(value.name)!r} would hold {elements} elements (shape {shape})"
            if total > elements:
                what += f", {total} with the inputs before it"
            raise InvalidInputError(
                f"{what}: more than {max_elements} in all; pass smaller --dim values or --inputs."
            )
        planned.append((value, dtype, shape))
    for value, dtype, shape in planned:
        if _is_mask(value.name) and (dtype == np.bool_ or np.issubdtype(dtype, np.integer)):
            # Random 0/1 masks can hide every position of a row, and then a correct model's
            # softmax over nothing differs between runtimes: masks keep everything visible.
            array = np.ones(shape, dtype=dtype)
        elif dtype == np.bool_:
            array = rng.integers(0, 2, size=shape).astype(np.bool_)
        elif np.issubdtype(dtype, np.integer):
            array = rng.integers(0, int_high, size=shape).astype(dtype)
        elif dtype.kind in "fV":  # V: ml_dtypes (bfloat16, float8)
            array = rng.standard_normal(size=shape).astype(np.float32).astype(dtype)
        elif dtype.kind == "c":
            array = (rng.standard_normal(size=shape) + 1j * rng.standard_normal(size=shape)).astype(dtype)
        else:
            raise InvalidInputError(
                f"Cannot make random values for input {value.name!r} of dtype {dtype}; pass --inputs."
            )
        feeds[value.name] = array
    params = {d.dim_param for v in model_inputs(model) for d in v.type.tensor_type.shape.dim}
    unused = set(dims) - params - {word for param in params for word in re.findall(r"[A-Za-z_]\w*", param)}
    if unused:
        raise InvalidInputError(f"No input has a dimension named {sorted(unused)[0]!r} (given with --dim).")
    return feeds


#: Longest symbolic dimension name read as a size expression (``past_sequence_length + sequence_length``).
_MAX_EXPRESSION = 256


def _dim_size(name: str, dims: Mapping[str, int], default: int) -> int:
    """The size of a symbolic dimension: given in ``dims``, else computed when ``name`` is a sum
    or product of other names and integers (``past_sequence_length + sequence_length``, the
    length of a with-past attention mask, as Optimum and torch name it), else ``default``."""
    if name in dims:
        return int(dims[name])
    if len(name) > _MAX_EXPRESSION:  # a 4 KB `a+a+...` is no size expression (and would recurse 2,000 deep)
        return default
    try:
        tree = ast.parse(name, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return default

    def value(node: ast.AST) -> int | None:
        if isinstance(node, ast.Name):
            return int(dims.get(node.id, default))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if left is None or right is None:
                return None
            return {ast.Add: left + right, ast.Sub: left - right, ast.Mult: left * right}[type(node.op)]
        return None

    size = value(tree) if isinstance(tree, ast.BinOp) else None
    return size if size is not None and 0 <= size <= 2**31 else default


def _is_mask(name: str) -> bool:
    return "mask" in name.lower()


def check_feeds(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> None:
    """Check given inputs against the declared ones (names, ranks, fixed dims, dtypes).

    Raises:
        InvalidInputError: Naming the first input that does not fit.
    """
    declared = {value.name: value for value in model_inputs(model)}
    missing = [name for name in declared if name not in feeds]
    extra = [name for name in feeds if name not in declared]
    if missing or extra:
        raise InvalidInputError(
            f"The inputs do not match the model: missing {missing or 'none'}, unexpected {extra or 'none'} "
            f"(the model's inputs are {list(declared)})."
        )
    for name, value in declared.items():
        array = np.asarray(feeds[name])
        tensor_type = value.type.tensor_type
        expected_dtype = _numpy_dtype(tensor_type.elem_type, name)
        if array.dtype != expected_dtype:
            raise InvalidInputError(f"Input {name!r} has dtype {array.dtype} but the model declares {expected_dtype}.")
        if tensor_type.HasField("shape"):
            declared_dims = [
                d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor_type.shape.dim
            ]
            fits = array.ndim == len(declared_dims) and all(
                not isinstance(d, int) or d == actual for d, actual in zip(declared_dims, array.shape)
            )
            if not fits:
                raise InvalidInputError(
                    f"Input {name!r} has shape {list(array.shape)} but the model declares {declared_dims}."
                )


def feeds_from_arrays(model: onnx.ModelProto, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Feeds from arrays by input name, or positional (``arr_0``, ``arr_1``: ``np.savez(a, b)``), checked.

    Raises:
        InvalidInputError: The arrays do not fit the model's inputs (see :func:`check_feeds`).
    """
    arrays = dict(arrays)
    names = [value.name for value in model_inputs(model)]
    positional = [f"arr_{i}" for i in range(len(arrays))]
    if sorted(arrays) == sorted(positional) and not set(arrays) & set(names):
        arrays = {name: arrays[f"arr_{i}"] for i, name in enumerate(names) if f"arr_{i}" in arrays}
    check_feeds(model, arrays)
    return arrays


def _gqa_dims(model: onnx.ModelProto) -> dict[str, int] | None:
    """Batch 1 for files with onnxruntime's ``GroupQueryAttention`` (``onnx-modular optimize``'s):
    the op refuses a batch above 1 when a prompt of several tokens comes with a past."""
    bodies = [model.graph.node, *(f.node for f in model.functions)]
    if not any(node.op_type == "GroupQueryAttention" for nodes in bodies for node in nodes):
        return None
    names = {d.dim_param for v in model.graph.input for d in v.type.tensor_type.shape.dim}
    return {name: 1 for name in ("batch_size", "batch") if name in names} or None


def feeds_for(
    model: onnx.ModelProto, inputs: str | os.PathLike | Mapping[str, np.ndarray] | None, *, seed: int = 0
) -> dict[str, np.ndarray]:
    """The whole model's inputs for a run: ``inputs`` (an ``.npz`` file or arrays by name, checked
    against the declared inputs), or random ones from the declared shapes (``seed``) as ``verify`` makes.

    Raises:
        InvalidInputError: The file cannot be read or the arrays do not fit the model.
    """
    if inputs is None:
        return random_inputs(model, seed=seed)
    arrays = load_arrays(inputs, "--inputs") if isinstance(inputs, (str, os.PathLike)) else dict(inputs)
    return feeds_from_arrays(model, arrays)


def load_arrays(path: str | os.PathLike, what: str = "--inputs", *, max_bytes: int = MAX_ARRAY_BYTES) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file (``np.savez``), checked before anything is decompressed.

    The zip directory's sizes bound every member (zipfile never inflates past them), each
    member's ``.npy`` header (``np.lib.format.read_array_header_*``) must describe an array that
    fits in its member, with no Python objects, and the members together may hold at most
    ``max_bytes``. A zip bomb or a header claiming 2**40 elements is refused without
    allocating it.

    Raises:
        InvalidInputError: Naming the file and what is wrong with it.
    """
    text = str(path)
    if not os.path.isfile(path):
        raise InvalidInputError(
            f"{what} {text!r} " + ("does not exist." if not os.path.exists(path) else "is not a regular file.")
        )
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        hint = " (a single array saved with np.save; save a .npz with np.savez(name=array))" if _is_npy(path) else ""
        raise InvalidInputError(f"{what} {text!r} is not a readable .npz file{hint}: {e}") from None
    names: list[str] = []
    with archive:
        members = archive.infolist()
        total = sum(member.file_size for member in members)
        if total > max_bytes:
            raise InvalidInputError(
                f"{what} {text!r} holds {total} bytes once decompressed, more than {max_bytes}; "
                "refusing to decompress it (inputs that large are not test inputs)."
            )
        try:
            for member in members:
                name = member.filename.removesuffix(".npy")
                with archive.open(member) as handle:
                    version = np.lib.format.read_magic(handle)
                    read_header = (
                        np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                    )
                    shape, _fortran_order, dtype = read_header(handle, max_header_size=10_000)
                    if dtype.hasobject:
                        raise ValueError(f"array {name!r} holds Python objects")
                    if dtype.kind in "US" or dtype.names is not None or dtype.itemsize == 0:
                        raise ValueError(
                            f"array {name!r} has dtype {dtype} (strings, records or empty items); inputs are numeric arrays"
                        )
                    size = numel(shape) * dtype.itemsize
                    if size > member.file_size:
                        raise ValueError(
                            f"array {name!r} declares shape {list(shape)} of {dtype} ({size} bytes) "
                            f"but its member holds {member.file_size} bytes"
                        )
                names.append(name)
            with np.load(path, allow_pickle=False) as loaded:
                return {name: loaded[name] for name in names}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError, RuntimeError, NotImplementedError) as e:
            # RuntimeError: an encrypted member; NotImplementedError: a compression zipfile lacks
            raise InvalidInputError(f"{what} {shown(text)!r} is not a readable .npz file: {shown(str(e))}") from None


def _is_npy(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(6) == b"\x93NUMPY"
    except OSError:
        return False
