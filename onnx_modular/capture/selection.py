"""Module selection: which module calls become functions (the ``modules=`` option)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Union

import onnx_ir as ir
import torch

from onnx_modular.capture import torch_compat
from onnx_modular.format.calltree import CallTree
from onnx_modular.errors import InvalidInputError
from onnx_modular.passes.modularize import STACK_KEY

__all__ = ["ModuleSelector", "selector", "annotate_stacks"]

#: Which module calls become functions: ``None``/``"all"``, a set of classes,
#: a maximum depth (1 = children of the root), or ``predicate(module_path, module)``.
ModuleSelector = Union[None, str, int, Iterable[type], Callable[[str, torch.nn.Module], bool]]


def selector(modules: ModuleSelector, model: torch.nn.Module) -> Callable[[str, int], bool]:
    """A predicate on (module path, depth) from the user's ``modules`` option."""
    if modules is None or modules == "all":
        return lambda path, depth: True
    if isinstance(modules, bool):
        raise InvalidInputError("modules must be 'all', a set of classes, a depth or a predicate, not a bool.")
    if isinstance(modules, int):
        if modules < 0:
            raise InvalidInputError(f"modules (max depth) must be >= 0, got {modules}.")
        return lambda path, depth: depth <= modules
    named = dict(model.named_modules(remove_duplicate=False))
    if callable(modules) and not isinstance(modules, type):
        predicate = modules
        return lambda path, depth: path in named and bool(predicate(path, named[path]))
    try:
        classes = tuple(modules) if not isinstance(modules, type) else (modules,)
    except TypeError:
        raise InvalidInputError(f"Unsupported value for modules: {modules!r}.") from None
    if not all(isinstance(cls, type) for cls in classes):
        raise InvalidInputError(f"modules must contain nn.Module classes, got {modules!r}.")
    return lambda path, depth: path in named and isinstance(named[path], classes)


def annotate_stacks(model_ir: ir.Model, tree: CallTree, select: Callable[[str, int], bool]) -> None:
    """Set ``node.meta[STACK_KEY]``: the selected module-call keys each node ran under."""
    depth_of = {call.key: call.depth for call in tree.walk()}
    for call in tree.walk():
        if call.parent is not None:
            call.selected = select(call.module_path, depth_of[call.key])
    for node in model_ir.graph:
        fx_node = torch_compat.fx_node_of(node)
        stack = (fx_node.meta.get("nn_module_stack") or {}) if fx_node is not None else {}
        node.meta[STACK_KEY] = tuple(
            key
            for key, (path, _) in stack.items()
            if key in tree and depth_of[key] > 0 and tree[key].selected
        )

