"""ONNX IR pass: name symbolic dimensions after the user's axis names (``batch``, not ``s72``)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import onnx_ir as ir

__all__ = ["RenameDynamicAxesPass"]


class RenameDynamicAxesPass(ir.passes.InPlacePass):
    """Rename symbolic dims everywhere, in expressions too (``s1 + 1`` -> ``seq + 1``).

    ``mapping`` is ``{torch's symbol: the user's name}``, plain strings; the capture side
    builds it from ``dynamic_shapes`` (torch names only string axes; ``Dim`` objects carry a
    name too). Longer symbols are replaced first (``s11`` before ``s1``), as torch does. A sum
    of names is spelled one way (``past_sequence_length + sequence_length``, terms sorted).

    Example::

        RenameDynamicAxesPass({"s72": "batch"})(model)
    """

    def __init__(self, mapping: Mapping[str, str]):
        super().__init__()
        self.mapping = dict(sorted(mapping.items(), key=lambda item: len(item[0]), reverse=True))

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        if not self.mapping:
            return ir.passes.PassResult(model, modified=False)
        for value in _all_values(model):
            if value.shape is None:
                continue
            dims, changed = [], False
            for dim in value.shape:
                if isinstance(dim, ir.SymbolicDim) and dim.value is not None:
                    new = _one_spelling(self.mapping.get(dim.value) or self._replace(dim.value))
                    changed |= new != dim.value
                    dims.append(new)
                else:
                    dims.append(dim)
            if changed:
                value.shape = ir.Shape(dims)
                modified = True
        return ir.passes.PassResult(model, modified=modified)

    def _replace(self, expression: str) -> str:
        for old, new in self.mapping.items():
            expression = re.sub(rf"(?<!\w){re.escape(old)}(?!\w)", new, expression)
        return expression


_NAME_SUM = re.compile(r"\s*[A-Za-z_]\w*(\s*\+\s*[A-Za-z_]\w*)+\s*")


def _one_spelling(name: str) -> str:
    """A sum of names with its terms sorted: torch prints a cache's new length ``s1 + s2`` for one
    layer and ``s2 + s1`` for another, which once renamed would keep their bodies (and functions) apart."""
    if _NAME_SUM.fullmatch(name):
        return " + ".join(sorted(term.strip() for term in name.split("+")))
    return name


def _all_values(model: ir.Model) -> Iterator[ir.Value]:
    yield from model.graph.inputs
    yield from model.graph.initializers.values()
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        yield from node.outputs
    for function in model.functions.values():
        yield from function.inputs
        for node in ir.traversal.RecursiveGraphIterator(function):
            yield from node.outputs
