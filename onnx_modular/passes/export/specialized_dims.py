"""Fix the axes torch.export specialized: a symbolic dim named by a number becomes that number.

Asked to keep an axis dynamic (``Dim.AUTO``), torch.export may find that the model only works
for the example's size (a reshape to a fixed length, a size check) and *specialize* the axis:
it becomes a constant in the program. torch's translator still declares such an axis of a graph
input as a symbolic dim, named by its value (``"8"``). onnxruntime then accepts any size there
and fails deep inside the graph (``Reshape``, ``Split``), or computes wrong numbers (torch's
flat file, issue 21). Declared as the fixed dim it is, a wrong input is rejected at the boundary
with onnxruntime's shape error. :func:`fix_specialized_dims` (and the pass with ``warn=True``, as the pipeline runs it) also
warns, once, naming each input and axis.
"""

from __future__ import annotations

import warnings

import onnx_ir as ir

__all__ = ["FixSpecializedDimsPass", "SpecializedAxisWarning", "fix_specialized_dims"]


class SpecializedAxisWarning(UserWarning):
    """An axis asked to be dynamic was specialized by torch.export to the example's size."""


def _fixed(shape: ir.Shape | None) -> tuple[ir.Shape | None, list[tuple[int, int]]]:
    if shape is None:
        return None, []
    dims, fixed = [], []
    for axis, dim in enumerate(shape.dims):
        name = dim.value if isinstance(dim, ir.SymbolicDim) else None
        if isinstance(name, str) and name.isdigit():
            dims.append(int(name))
            fixed.append((axis, int(name)))
        else:
            dims.append(dim)
    return (ir.Shape(dims) if fixed else shape), fixed


class FixSpecializedDimsPass(ir.passes.InPlacePass):
    """Symbolic dims named by a non-negative integer become fixed dims, in every value.

    After the pass, ``specialized`` lists ``(graph input name, axis, size)`` for the inputs.

    Example::

        fix = FixSpecializedDimsPass()
        fix(model)
        fix.specialized  # [("input_ids", 1, 8)]
    """

    def __init__(self, warn: bool = False):
        super().__init__()
        self.warn = warn
        self.specialized: list[tuple[str, int, int]] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.specialized = []
        graphs: list = [model.graph, *model.functions.values()]
        values: list[ir.Value] = []
        for graph in graphs:
            values += [*graph.inputs, *graph.outputs]
            for node in ir.traversal.RecursiveGraphIterator(graph):
                values += node.outputs
        modified = False
        inputs = set(model.graph.inputs)
        for value in dict.fromkeys(values):
            shape, fixed = _fixed(value.shape)
            if fixed:
                value.shape = shape
                modified = True
                if value in inputs:
                    self.specialized += [(value.name, axis, size) for axis, size in fixed]
        if self.warn:
            _warn(self.specialized)
        return ir.passes.PassResult(model, modified=modified)


def _warn(specialized: list[tuple[str, int, int]]) -> None:
    """One warning for all the specialized axes (a decoder's cache has four per layer), attributed to
    onnx_modular rather than to the line of onnx_ir's pass runner that ran the pass."""
    if not specialized:
        return
    if len(specialized) == 1:
        (name, axis, size), = specialized
        text = (
            f"Axis {axis} of input {name!r} was asked to be dynamic, but torch.export specialized it to {size} "
            f"(the model only traces for that size): the file declares it as the fixed size {size}, so "
            "onnxruntime rejects other sizes at the input."
        )
    else:
        axes = ", ".join(f"axis {axis} of {name!r} to {size}" for name, axis, size in specialized)
        text = (
            f"{len(specialized)} axes asked to be dynamic were specialized by torch.export (the model only traces "
            f"for those sizes): {axes}. The file declares them as fixed sizes, so onnxruntime rejects other sizes "
            "at those inputs."
        )
    warnings.warn_explicit(text, SpecializedAxisWarning, "onnx_modular", 0, module="onnx_modular")


def fix_specialized_dims(model: ir.Model) -> list[tuple[str, int, int]]:
    """Run :class:`FixSpecializedDimsPass` and warn once, naming every specialized input axis."""
    fix = FixSpecializedDimsPass(warn=True)
    fix(model)
    return fix.specialized
