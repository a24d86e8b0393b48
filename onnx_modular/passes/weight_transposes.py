"""Store weights pre-transposed when every use of them transposes them, across function calls.

torch translates ``nn.Linear`` as ``MatMul(x, Transpose(weight))``. In a flat graph,
onnxscript's constant folder replaces ``Transpose(initializer)`` with a transposed initializer
(it always folds ``Transpose`` of a single-use initializer, whatever its size). In a modular
graph the ``Transpose`` sits inside the ``Linear`` body and reads a *formal input*, so no
folder sees a constant: onnxruntime then transposes every weight while creating the session
(a copy of each weight, seconds on a 1B model) after inlining the functions.

This pass does the folding across call boundaries. A formal input ``i`` of function ``F`` is
*transposed by perm P* when every use of it in ``F`` is a ``Transpose(perm=P)`` or is passed
on, as input ``j``, to a call of a function whose input ``j`` is transposed by ``P``. If every
call of ``F`` passes, at ``i``, either an initializer that is used nowhere else or a formal
input of the caller that is itself transposed by ``P``, the ``Transpose`` nodes are removed,
the formal input is renamed ``<name>.T`` and the initializer is stored transposed as
``<name>.T`` (lazily, so weights are transposed one at a time while saving). Tied weights
(used untransposed elsewhere) are left alone, as onnxscript leaves them in a flat graph.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx_ir as ir

__all__ = ["FoldWeightTransposesPass"]

_Key = tuple[ir.OperatorIdentifier, int]  # (function, formal input index)


def _perm(node: ir.Node) -> tuple[int, ...] | None:
    attribute = node.attributes.get("perm")
    if attribute is None:
        return None  # default perm reverses all axes; not produced by torch, left alone
    return tuple(attribute.as_ints())


def _is_transpose(node: ir.Node) -> bool:
    return node.op_type == "Transpose" and node.domain in ("", "ai.onnx") and len(node.inputs) == 1


class FoldWeightTransposesPass(ir.passes.InPlacePass):
    """Fold ``Transpose(weight)`` into the stored weight through nested function calls.

    Example::

        FoldWeightTransposesPass()(model)  # Linear bodies become MatMul(input, weight.T)
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        functions = dict(model.functions)
        if not functions:
            return ir.passes.PassResult(model, modified=False)
        calls = _call_sites(model, functions)
        candidates = {
            (identifier, index)
            for identifier, function in functions.items()
            for index in range(len(function.inputs))
        }
        while True:  # shrink to a consistent set: each removal can invalidate others
            perms = _perms(functions, candidates)
            keep = {key for key in candidates if key in perms and _call_sites_agree(key, perms, calls)}
            if keep == candidates:
                break
            candidates = keep
        if not candidates:
            return ir.passes.PassResult(model, modified=False)
        for identifier, index in sorted(candidates, key=str):
            _drop_transposes(functions[identifier].inputs[index], perms[(identifier, index)])
        for key in candidates:
            for node, _ in calls.get(key[0], []):
                argument = node.inputs[key[1]]
                if argument is not None and argument.is_initializer():
                    _transpose_initializer(argument, perms[key])
        return ir.passes.PassResult(model, modified=True)


def _call_sites(
    model: ir.Model, functions: dict[ir.OperatorIdentifier, ir.Function]
) -> dict[ir.OperatorIdentifier, list[tuple[ir.Node, ir.Function | None]]]:
    """Every call node of each function, with the function it sits in (None: main graph)."""
    sites: dict[ir.OperatorIdentifier, list[tuple[ir.Node, ir.Function | None]]] = {}
    owners: list[tuple[Iterable[ir.Node], ir.Function | None]] = [(ir.traversal.RecursiveGraphIterator(model.graph), None)]
    owners += [(ir.traversal.RecursiveGraphIterator(f), f) for f in functions.values()]
    for nodes, owner in owners:
        for node in nodes:
            if node.op_identifier() in functions:
                sites.setdefault(node.op_identifier(), []).append((node, owner))
    return sites


def _perms(
    functions: dict[ir.OperatorIdentifier, ir.Function], candidates: set[_Key]
) -> dict[_Key, tuple[int, ...]]:
    """The perm by which each candidate formal input is transposed, if all its uses agree."""
    perms: dict[_Key, tuple[int, ...] | None] = {}

    def perm_of(key: _Key, visiting: frozenset) -> tuple[int, ...] | None:
        if key in perms:
            return perms[key]
        if key not in candidates or key in visiting:
            return None
        identifier, index = key
        value = functions[identifier].inputs[index]
        found: set[tuple[int, ...] | None] = set()
        if value in functions[identifier].outputs or not value.uses():
            found.add(None)
        for use in value.uses():
            node = use.node
            if _is_transpose(node):
                found.add(_perm(node))
            elif node.op_identifier() in functions:
                found.add(perm_of((node.op_identifier(), use.idx), visiting | {key}))
            else:
                found.add(None)
        perms[key] = found.pop() if len(found) == 1 else None
        return perms[key]

    for key in candidates:
        perm_of(key, frozenset())
    return {key: perm for key, perm in perms.items() if perm is not None and key in candidates}


def _call_sites_agree(key: _Key, perms: dict[_Key, tuple[int, ...]], calls) -> bool:
    identifier, index = key
    sites = calls.get(identifier, [])
    if not sites:
        return False
    for node, owner in sites:
        argument = node.inputs[index] if index < len(node.inputs) else None
        if argument is None:
            return False
        if argument.is_initializer():
            if argument.const_value is None or not all(
                perms.get((use.node.op_identifier(), use.idx)) == perms[key] for use in argument.uses()
            ):
                return False
        elif owner is not None and argument in owner.inputs:
            if perms.get((owner.identifier(), owner.inputs.index(argument))) != perms[key]:
                return False
        else:
            return False
    return True


def _drop_transposes(value: ir.Value, perm: tuple[int, ...]) -> None:
    """Remove the Transposes reading ``value`` (now stored transposed); rename it ``<name>.T``."""
    for use in list(value.uses()):
        node = use.node
        if not _is_transpose(node):
            continue
        ir.convenience.replace_all_uses_with(node.outputs[0], value)
        node.graph.remove(node, safe=True)
    if value.shape is not None:
        value.shape = ir.Shape([value.shape[axis] for axis in perm])
    value.name = f"{value.name}.T"


def _transpose_initializer(value: ir.Value, perm: tuple[int, ...]) -> None:
    if value.meta.get("onnx_modular.transposed"):
        return  # already done for an earlier call site
    source = value.const_value
    shape = ir.Shape([source.shape[axis] for axis in perm])

    def transposed() -> ir.Tensor:
        return ir.tensor(np.ascontiguousarray(source.numpy().transpose(perm)), name=value.name)

    value.const_value = ir.LazyTensor(transposed, dtype=source.dtype, shape=shape, name=f"{value.name}.T")
    value.shape = shape
    value.name = f"{value.name}.T"  # onnx_ir re-keys graph.initializers
    value.meta["onnx_modular.transposed"] = True
