"""Evaluating a few nodes outside the model they belong to: onnx's shape inference for their
outputs, and onnxruntime (or onnx's reference evaluator) for their values. Used by
``FoldWeightsPass`` to type and compute what it folds."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import numpy as np
import onnx
import onnx_ir as ir

__all__ = ["FoldedShapeError", "evaluator", "infer_shapes", "static_size", "support"]


def static_size(value: ir.Value) -> int | None:
    """Elements of ``value``: its constant's, else its static shape's; None when not static."""
    if value.const_value is not None:
        return value.const_value.size
    if value.shape is None or not all(isinstance(d, int) for d in value.shape.dims):
        return None
    return int(np.prod(value.shape.dims, dtype=np.int64))


def support(values: Iterable[ir.Value]) -> list[ir.Node]:
    """The nodes ``values`` are computed by, in topological order."""
    order: list[ir.Node] = []
    seen: set[ir.Node] = set()

    def visit(node: ir.Node) -> None:
        if node in seen:
            return
        seen.add(node)
        for v in node.inputs:
            if v is not None and v.producer() is not None:
                visit(v.producer())
        order.append(node)

    for value in values:
        if value.producer() is not None:
            visit(value.producer())
    return order


def _proto(nodes: list[ir.Node], inputs: list[ir.Value], outputs: list[ir.Value], opset: int, names: dict) -> onnx.ModelProto:
    """A model of ``nodes`` (no weights), its values renamed by ``names`` (filled in here)."""
    for i, v in enumerate(inputs):
        names.setdefault(v, f"x{i}")
    for i, node in enumerate(nodes):
        for j, out in enumerate(node.outputs):
            names.setdefault(out, f"n{i}_{j}")

    def info(v: ir.Value) -> onnx.ValueInfoProto:
        shape = list(v.shape.numpy()) if v.shape is not None and static_size(v) is not None else None
        return onnx.helper.make_tensor_value_info(names[v], v.dtype.value if v.dtype is not None else 0, shape)

    protos = []
    for node in nodes:
        proto = onnx.helper.make_node(
            node.op_type, [names[v] if v is not None else "" for v in node.inputs], [names[v] for v in node.outputs],
            domain=node.domain,
        )
        proto.attribute.extend(ir.serde.serialize_attribute(a) for a in node.attributes.values())
        protos.append(proto)
    graph = onnx.helper.make_graph(protos, "fold", [info(v) for v in inputs], [info(v) for v in outputs])
    # IR version 10: what onnxruntime and torch's exporter use (onnx's default may be newer than onnxruntime reads)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)], ir_version=10)


def infer_shapes(nodes: list[ir.Node], inputs: list[ir.Value], opset: int) -> None:
    """Give the outputs of ``nodes`` their static dtype and shape (onnx's shape inference)."""
    if not nodes or any(v.dtype is None or static_size(v) is None for v in inputs):
        return
    names: dict[ir.Value, str] = {}
    outputs = [out for node in nodes for out in node.outputs]
    model = _proto(nodes, inputs, [], opset, names)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:
        return
    found = {info.name: info.type.tensor_type for info in inferred.graph.value_info}
    for out in outputs:
        tensor_type = found.get(names[out])
        if tensor_type is None or not tensor_type.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
        if None not in dims and tensor_type.elem_type:
            out.dtype = ir.DataType(tensor_type.elem_type)
            out.shape = ir.Shape(dims)


@functools.lru_cache(maxsize=8)
def _session(model_bytes: bytes):
    """One onnxruntime session per tiny model: the Linear weights of a transformer share a few
    shapes, so their transposes share a session (creating one cost as much as running it: 30 ms
    of 60 for a 46 MB transpose). No memory arena: a session holds no buffers between runs."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    options.intra_op_num_threads = 1  # the file writer runs these on its own threads
    options.enable_cpu_mem_arena = False
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def _run_into(session, feeds: dict[str, np.ndarray], output_name: str, shape: tuple[int, ...], dtype: ir.DataType) -> np.ndarray:
    """Run ``session`` writing its output into a new numpy array: numpy backs large arrays with
    transparent huge pages, onnxruntime's own allocation faults in 4 KiB pages (a 46 MB
    transpose: 31 ms of CPU into numpy's buffer, 61 ms into onnxruntime's)."""
    result = np.empty(shape, dtype=dtype.numpy())
    if result.size == 0:
        (result,) = session.run([output_name], feeds)
        return result
    binding = session.io_binding()
    arrays = {name: np.ascontiguousarray(array) for name, array in feeds.items()}  # alive until the run ends
    for name, array in arrays.items():
        binding.bind_cpu_input(name, array)
    binding.bind_output(output_name, "cpu", 0, result.dtype, result.shape, result.ctypes.data)
    session.run_with_iobinding(binding)
    del arrays
    computed = tuple(binding.get_outputs()[0].shape())
    # onnxruntime writes into a bound buffer of the same size whatever shape it computed: a value
    # of another shape ((1,) for ()) must show as such, so that the caller refuses to fold it.
    return result if computed == tuple(shape) else result.reshape(computed)


class FoldedShapeError(ValueError):
    """A computed value has another shape or dtype than the value it is to replace."""


def evaluator(value: ir.Value, sources: list[ir.Value], opset: int):
    """A function computing ``value`` from the sources' tensors: onnxruntime on a tiny model
    (optimizations off), or onnx's reference evaluator for dtypes onnxruntime's Python API cannot
    take. The tiny model holds no weights: they are read (``const_value.numpy()``) only when called.

    The result has exactly the dtype and shape of ``value`` (what onnx's shape inference gave it),
    or the function raises :class:`FoldedShapeError`: where onnxruntime's result has another shape
    or dtype, onnx's reference evaluator (the specification's implementation) decides.
    """
    names: dict[ir.Value, str] = {}
    model_bytes = _proto(support([value]), sources, [value], opset, names).SerializeToString()
    tensors = [v.const_value for v in sources]
    inputs, output_name, shape, dtype = [names[v] for v in sources], names[value], tuple(value.shape.numpy()), value.dtype

    def reference(feeds) -> np.ndarray:
        from onnx.reference import ReferenceEvaluator

        (result,) = ReferenceEvaluator(onnx.load_from_string(model_bytes)).run([output_name], feeds)
        return _contiguous(result)

    def matches(result: np.ndarray) -> bool:
        return result.shape == shape and ir.tensor(result).dtype == dtype

    def compute() -> ir.Tensor:
        feeds = {name: t.numpy() for name, t in zip(inputs, tensors)}
        try:
            result = _run_into(_session(model_bytes), feeds, output_name, shape, value.dtype)
        except Exception:
            result = reference(feeds)
        else:
            if not matches(result):
                result = reference(feeds)
        if not matches(result):
            raise FoldedShapeError(
                f"Folded value {output_name}: {ir.tensor(result).dtype} {result.shape}, expected {dtype} {shape}."
            )
        return ir.tensor(result)

    return compute


def _contiguous(array: np.ndarray) -> np.ndarray:
    # not np.ascontiguousarray, which turns a scalar (shape ()) into shape (1,)
    return np.asarray(array, order="C")
