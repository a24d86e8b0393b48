"""How an instrumented copy (:class:`onnx_modular.calls.capture.Instrumented`) is run in parts:
the bytes of its probes and the consecutive batches of calls under a byte budget (a call of the
main graph whose calls exceed it is opened: :func:`onnx_modular.calls.opening.open_instrumented`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

__all__ = ["batches", "bindings", "declared_bytes", "fixed", "info_of", "itemsize", "reads", "static_bytes"]

def reads(node: onnx.NodeProto) -> set[str]:
    """The names a node reads, those its subgraphs read from outside included."""
    names = {name for name in node.input if name}
    for attribute in node.attribute:
        for graph in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
            inner = {name for n in graph.node for name in n.output} | {v.name for v in graph.input} | {
                t.name for t in graph.initializer}
            names |= {name for n in graph.node for name in reads(n) if name not in inner}
            names |= {v.name for v in graph.output if v.name not in inner}
    return names


def info_of(name: str, value: np.ndarray) -> onnx.ValueInfoProto:
    return onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)


def fixed(value: onnx.ValueInfoProto, feed: np.ndarray | None) -> onnx.ValueInfoProto:
    """A graph input's declaration with the feed's shape."""
    if feed is None or not isinstance(feed, np.ndarray) or not value.type.HasField("tensor_type"):
        return value
    return onnx.helper.make_tensor_value_info(value.name, value.type.tensor_type.elem_type, feed.shape)


def declared_bytes(value: onnx.ValueInfoProto) -> int | None:
    tensor = value.type.tensor_type
    if not value.type.HasField("tensor_type") or not tensor.HasField("shape") or not tensor.elem_type:
        return None
    if not all(d.HasField("dim_value") for d in tensor.shape.dim):
        return None
    size = itemsize(tensor.elem_type)
    return int(np.prod([d.dim_value for d in tensor.shape.dim])) * size if size else None


def batches(items: Sequence[Any], costs: Sequence[int], budget: int,
            together: Callable[[Any, Any], bool] | None = None) -> list[list[Any]]:
    """``items`` in order, cut into consecutive batches whose costs add up to at most ``budget``
    (more when an item alone costs more). Items ``together`` with the one before (a group) stay in
    its batch, past the budget, when the whole group fits in it; a group over the budget (what
    :meth:`~onnx_modular.calls.capture.Instrumented.open_groups` could not open: a call inside
    control flow) is cut like the rest, each part's run making the group's node again.
    """
    groups: list[int] = []  # the group of each item, and each group's cost
    group_cost: list[int] = []
    previous = None
    for item, cost in zip(items, costs):
        if not groups or together is None or not together(previous, item):
            group_cost.append(0)
        groups.append(len(group_cost) - 1)
        group_cost[-1] += cost
        previous = item
    out: list[list[Any]] = []
    total = 0
    for index, (item, cost) in enumerate(zip(items, costs)):
        same = index > 0 and groups[index] == groups[index - 1]
        over = group_cost[groups[index]] > budget  # a group cut in parts starts a batch of its own
        if not out or total + cost > budget and not (same and not over) or over and not same and total:
            out.append([])
            total = 0
        out[-1].append(item)
        total += cost
    return out


def bindings(inputs: Sequence[ir.Value], feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
    """The symbolic dims of the graph's inputs, fixed by the feeds' shapes."""
    bound: dict[str, int] = {}
    for value in inputs:
        feed = feeds.get(value.name or "")
        if value.shape is None or feed is None or len(value.shape) != np.ndim(feed):
            continue
        for dim, size in zip(value.shape, np.shape(feed)):
            if isinstance(dim, ir.SymbolicDim) and dim.value is not None:
                bound.setdefault(dim.value, int(size))
    return bound


def static_bytes(value: ir.Value, bound: Mapping[str, int]) -> int | None:
    """``value``'s bytes from its declared type and shape, or ``None`` when not declared or not fixed."""
    if value.shape is None or not isinstance(value.type, ir.TensorType):
        return None
    size = itemsize(value.dtype.value if value.dtype is not None else 0)
    count = 1
    for dim in value.shape:
        if isinstance(dim, int):
            count *= dim
        elif dim.value is not None and dim.value in bound:
            count *= bound[dim.value]
        else:
            return None
    return count * size if size else None


def itemsize(elem_type: int) -> int | None:
    """Bytes per element of an ONNX element type (``None``: undeclared or sub-byte)."""
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).itemsize if elem_type else None
    except (KeyError, TypeError, ValueError):
        return None


