"""Module selection: which module calls become functions (the ``modules=`` option)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Union

import torch

from onnx_modular.errors import InvalidInputError
from onnx_modular.format.calltree import CallTree

__all__ = ["ModuleSelector", "selector", "selected_calls"]

#: Which module calls become functions: ``None``/``"all"``, a set of classes,
#: a maximum depth (1 = children of the root), or ``predicate(module_path, module)``.
ModuleSelector = Union[None, str, int, Iterable[type], Callable[[str, torch.nn.Module], bool]]  # noqa: UP007 (a runtime alias: | on typing objects needs 3.10's types.UnionType)


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


def selected_calls(tree: CallTree, select: Callable[[str, int], bool]) -> set[str]:
    """Mark each call of ``tree`` ``selected`` by ``select(module path, depth)``; the selected keys."""
    for call in tree.walk():
        if call.parent is not None:
            call.selected = select(call.module_path, call.depth)
    return {call.key for call in tree.walk() if call.parent is not None and call.selected}
