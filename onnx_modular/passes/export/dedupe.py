"""ONNX IR pass: identical module calls share one function, at every level.

Two functions are identical when their bodies are the same computation modulo value
names: same ops in the same order, same attributes and constants, same wiring, and
the same input/output types and shapes. Symbolic dims compare up to a consistent renaming
within each function: torch gives every dynamic input its own symbol (each layer's KV-cache
length is ``s54``, ``s60``, ... when shapes are ``Dim.AUTO``), so two layers' bodies differ
only in those names; their equality structure (which dims are the same symbol) must still
match. When such bodies merge, a dim whose symbol differs between them becomes anonymous in
the kept body, so that no caller is told a size it does not have. Weights are inputs, so
layers of equal shapes compare equal. Functions are compared bottom-up: once two
``Linear`` bodies are merged, the ``Attention`` bodies that call them compare equal,
and so on up to the blocks. This finds sharing across different parents, which
FX-level identity cannot (a function is only visible in its parent's scope there).
"""

from __future__ import annotations

import hashlib
from typing import Any

import onnx_ir as ir

from onnx_modular.format import metadata
from onnx_modular.passes.functions import callees, function_cycle, redirect_calls

__all__ = ["DeduplicateFunctionsPass", "function_fingerprint"]


#: Default-domain ops whose result does not depend on the order of their inputs.
_COMMUTATIVE = frozenset({"Add", "Mul", "Max", "Min", "Sum", "Mean", "And", "Or", "Xor", "Equal"})


def _dim_key(dim: Any, symbols: dict[str, int]) -> Any:
    if isinstance(dim, int):
        return dim
    name = str(dim)
    if getattr(dim, "value", name) is None:
        return None  # an anonymous dim
    return ("sym", symbols.setdefault(name, len(symbols)))


def _shape_key(value: ir.Value, symbols: dict[str, int]) -> tuple:
    shape = None if value.shape is None else tuple(_dim_key(d, symbols) for d in value.shape)
    return (str(value.type), shape)


def _attr_key(attr: ir.Attr, scope: dict[ir.Value, Any], symbols: dict[str, int]) -> Any:
    kind = attr.type
    if kind == ir.AttributeType.TENSOR:
        tensor = attr.value
        return ("T", str(tensor.dtype), tuple(tensor.shape), hashlib.sha256(tensor.tobytes()).hexdigest())
    if kind == ir.AttributeType.GRAPH:
        return ("G", _graph_key(attr.value, symbols, scope))
    if kind == ir.AttributeType.GRAPHS:
        return ("GS", tuple(_graph_key(g, symbols, scope) for g in attr.value))
    if kind == ir.AttributeType.TENSORS:
        return ("TS", tuple(hashlib.sha256(t.tobytes()).hexdigest() for t in attr.value))
    if isinstance(attr.value, (list, tuple)):
        return (kind.name, tuple(attr.value))
    return (kind.name, repr(attr.value) if isinstance(attr.value, float) else attr.value)


def _graph_key(
    graph: ir.Graph | ir.Function, symbols: dict[str, int], outer: dict[ir.Value, Any] | None = None
) -> tuple:
    scope: dict[ir.Value, Any] = dict(outer or {})
    depth = len(outer or ())
    parts: list[Any] = [("inputs", tuple(_shape_key(v, symbols) for v in graph.inputs))]
    for i, value in enumerate(graph.inputs):
        scope[value] = ("in", depth, i)
    for index, node in enumerate(graph):
        inputs = tuple(None if v is None else scope.get(v, ("outer", v.name)) for v in node.inputs)
        if node.domain in ("", "ai.onnx") and node.op_type in _COMMUTATIVE:
            inputs = tuple(sorted(inputs, key=repr))  # a + b is b + a (torch orders size sums by symbol)
        attrs = tuple(sorted((name, _attr_key(attr, scope, symbols)) for name, attr in node.attributes.items()))
        parts.append((node.domain, node.op_type, node.overload, inputs, attrs, len(node.outputs)))
        for j, value in enumerate(node.outputs):
            scope[value] = ("n", depth, index, j)
    parts.append(("outputs", tuple(scope.get(v, ("outer", v.name)) for v in graph.outputs)))
    parts.append(("output_types", tuple(_shape_key(v, symbols) for v in graph.outputs)))
    return tuple(parts)


def function_fingerprint(function: ir.Function) -> str:
    """A digest of the function's computation, independent of value and node names and of the
    names of its symbolic dims (up to a consistent renaming)."""
    key = (function.domain, tuple(sorted(function.attributes)), _graph_key(function, {}))
    return hashlib.sha256(repr(key).encode()).hexdigest()


class DeduplicateFunctionsPass(ir.passes.InPlacePass):
    """Merge identical module-call functions at every nesting level.

    Only functions created by onnx_modular (those with ``meta["onnx_modular.calls"]``)
    are merged; the first one in execution order is kept, and its
    ``meta["onnx_modular.calls"]`` lists every call it now serves.

    Example::

        result = DeduplicateFunctionsPass()(model)
        assert result.modified  # e.g. 12 GPT2Block bodies -> 1
    """

    def requires(self, model: ir.Model) -> None:
        cycle = function_cycle(model)
        if cycle is not None:
            chain = " -> ".join(f"{domain}:{name}" for domain, name, _ in cycle)
            raise ir.passes.PreconditionError(f"Functions call each other recursively: {chain}")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        functions = model.functions
        ours = [f for f in functions.values() if metadata.CALLS in f.meta]
        height: dict[ir.OperatorIdentifier, int] = {}

        def height_of(function: ir.Function) -> int:
            identifier = function.identifier()
            if identifier not in height:
                height[identifier] = 0
                below = [height_of(functions[c]) for c in callees(function, functions) if c in functions]
                height[identifier] = 1 + max(below, default=0)
            return height[identifier]

        by_height: dict[int, list[ir.Function]] = {}
        for function in ours:
            by_height.setdefault(height_of(function), []).append(function)

        removed = 0
        for level in sorted(by_height):
            representative: dict[str, ir.Function] = {}
            mapping: dict[ir.OperatorIdentifier, ir.OperatorIdentifier] = {}
            for function in by_height[level]:
                key = function_fingerprint(function)
                keeper = representative.setdefault(key, function)
                if keeper is function:
                    continue
                mapping[function.identifier()] = keeper.identifier()
                _generalize_dims(keeper, function)
                keeper.meta[metadata.CALLS].extend(function.meta[metadata.CALLS])
                for call in function.meta[metadata.CALLS]:
                    call.function = (keeper.domain, keeper.name)
            redirect_calls(model, mapping)
            for identifier in mapping:
                del functions[identifier]
                removed += 1
        return ir.passes.PassResult(model, modified=bool(removed))


def _values(graph: ir.Graph | ir.Function):
    """Every value of a body in a fixed order (inputs, node outputs with subgraphs, recursively)."""
    yield from graph.inputs
    for node in graph:
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                yield from _values(attr.value)
            elif attr.type == ir.AttributeType.GRAPHS:
                for subgraph in attr.value:
                    yield from _values(subgraph)
        yield from node.outputs


def _generalize_dims(keeper: ir.Function, merged: ir.Function) -> None:
    """Make anonymous every symbolic dim of ``keeper`` whose name differs in ``merged`` (same structure)."""
    for kept, other in zip(_values(keeper), _values(merged)):
        if kept.shape is None or other.shape is None or kept.shape == other.shape:
            continue
        dims = [
            d if (isinstance(d, int) or str(d) == str(o)) else ir.SymbolicDim(None)
            for d, o in zip(kept.shape, other.shape)
        ]
        kept.shape = ir.Shape(dims)
