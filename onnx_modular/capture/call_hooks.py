"""The one forward-hook recorder: every call of the model's modules, numbered per module path.

The eager reference run (:mod:`onnx_modular.capture.reference_run`: signatures and the call
tree), the per-module outputs of localization (:mod:`onnx_modular.check.localization`) and the
block-by-block loading of streamed weights (:mod:`onnx_modular.weights.streaming`) all observe
module calls the same way: pre- and post-forward hooks, registered for the duration of one run,
calls numbered per module path in execution order (the n-th call of ``h.0`` is ``(h.0, n)``,
which is how torch and the file name calls: ``h.0@n``).

Example::

    outputs = {}
    with call_hooks(model, post=lambda path, index, module, args, kwargs, output: outputs.__setitem__((path, index), output)):
        model(x)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["call_hooks"]

#: ``pre(path, index, module, args, kwargs)``
PreHook = Callable[[str, int, torch.nn.Module, tuple, dict], None]
#: ``post(path, index, module, args, kwargs, output)``
PostHook = Callable[[str, int, torch.nn.Module, tuple, dict, Any], None]


@contextlib.contextmanager
def call_hooks(
    model: torch.nn.Module,
    pre: PreHook | None = None,
    post: PostHook | None = None,
    *,
    paths: Iterable[str] | None = None,
    outermost: bool = False,
) -> Iterator[None]:
    """Within the ``with``, ``pre`` and ``post`` see every call of the modules at ``paths``
    (default: every module, the root included, each instance under its first path).

    ``index`` counts the calls of one path from 0. ``outermost``: the hooks run before any
    other pre-hook and after any other post-hook, and ``post`` runs even when forward raises
    (``always_call``), so that what ``pre`` sets up is always undone.
    """
    modules = dict(model.named_modules())
    selected = list(modules) if paths is None else list(paths)
    counts: dict[str, int] = {}
    open_calls: dict[str, list[int]] = {}
    handles = []

    def hooks(path: str):
        def pre_hook(module, args, kwargs):
            index = counts.get(path, 0)
            counts[path] = index + 1
            open_calls.setdefault(path, []).append(index)
            if pre is not None:
                pre(path, index, module, args, kwargs)

        def post_hook(module, args, kwargs, output):
            index = open_calls[path].pop()
            if post is not None:
                post(path, index, module, args, kwargs, output)

        return pre_hook, post_hook

    try:
        for path in selected:
            pre_hook, post_hook = hooks(path)
            module = modules[path]
            handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=outermost))
            handles.append(module.register_forward_hook(post_hook, with_kwargs=True, always_call=outermost))
        yield
    finally:
        for handle in handles:
            handle.remove()
