"""What model libraries add to a capture, without the core importing them.

A library's front end registers two kinds of hooks here:

* input types: ``hook(model, values) -> bool`` makes objects of that library flattenable by
  torch.export (transformers' KV caches), returning True when it registered something;
* translations: ``hook() -> {torch op: onnxscript function}`` for the library's own custom ops
  (transformers' ``grouped_mm_fallback``), used where torch has no translation.

The front end for transformers is :mod:`onnx_modular.hf.hooks`. The core never imports
transformers: when transformers is already imported (``"transformers" in sys.modules``, so the
model may come from it), the hooks call :data:`FRONT_ENDS`' module, which imports it and
registers itself (``onnx_modular.hf`` is the only package that imports transformers).

Example::

    from onnx_modular.capture import library_hooks

    library_hooks.register_translations(lambda: {torch.ops.mylib.op.default: my_onnx_op})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from onnx_modular.errors import MissingDependencyError

__all__ = ["FRONT_ENDS", "register_input_types", "register_translations", "make_flattenable", "translations"]

#: library (top-level module name) -> onnx_modular module that registers its hooks when imported.
FRONT_ENDS = {"transformers": "onnx_modular.hf.hooks"}

_input_type_hooks: list[Callable[[Any, Sequence[Any]], bool]] = []
_translation_hooks: list[Callable[[], Mapping[Callable, Callable]]] = []


def register_input_types(hook: Callable[[Any, Sequence[Any]], bool]) -> None:
    """Register ``hook(model, values) -> bool`` (see the module doc)."""
    if hook not in _input_type_hooks:
        _input_type_hooks.append(hook)


def register_translations(hook: Callable[[], Mapping[Callable, Callable]]) -> None:
    """Register ``hook() -> {torch op: onnxscript function}`` (see the module doc)."""
    if hook not in _translation_hooks:
        _translation_hooks.append(hook)


def _load_front_ends() -> None:
    for library, module in FRONT_ENDS.items():
        if library in sys.modules and module not in sys.modules:
            try:
                importlib.import_module(module)
            except MissingDependencyError:  # a library version without what the front end needs
                pass


def make_flattenable(model: Any, values: Sequence[Any]) -> bool:
    """Let every registered library make ``values`` flattenable; True if one registered something."""
    _load_front_ends()
    registered = False
    for hook in _input_type_hooks:  # every hook runs: values may come from several libraries
        registered = hook(model, values) or registered
    return registered


def translations() -> dict[Callable, Callable]:
    """Every registered library's translations of its custom ops (empty when none is imported)."""
    _load_front_ends()
    table: dict[Callable, Callable] = {}
    for hook in _translation_hooks:
        table.update(hook())
    return table
