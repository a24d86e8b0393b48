"""Building the module-call tree of an export (:class:`~onnx_modular.format.calltree.CallTree`).

Built from the ``nn_module_stack`` that torch.export records on every FX node. The
stack *keys* tell repeated calls apart (the second call of ``self.shared`` is keyed
``L__self__shared@1``), so grouping is by key, never by module path.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import sys
from typing import Any

import onnx_ir as ir
import torch

from onnx_modular.capture import torch_compat
from onnx_modular.errors import ModularizeError
from onnx_modular.format import metadata
from onnx_modular.format.calltree import CallTree, ModuleCall

__all__ = ["build_call_tree", "module_info", "module_stacks", "package_of"]

_SYNTHETIC_KEY_PREFIX = "_empty_nn_module_stack"


@functools.cache
def _distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


@functools.cache
def package_of(module_name: str) -> tuple[str, str]:
    """(top-level package, installed version) of a Python module name.

    Modules that are not part of an installed distribution (scripts, tests,
    ``__main__``) get the version ``"local"``.
    """
    top = module_name.split(".", 1)[0]
    version = "local"
    for dist in _distributions().get(top, []):
        try:
            version = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    if version == "local" and top in sys.modules:
        version = str(getattr(sys.modules[top], "__version__", "local")).split("+")[0]
    # Local version labels ("2.13.0+cpu") say how a wheel was built, not what it computes.
    return top.strip("_") or top, version.split("+", 1)[0]


@functools.cache
def _source_of(cls: type) -> str | None:
    try:
        path = inspect.getsourcefile(cls)
        line = inspect.getsourcelines(cls)[1]
    except (TypeError, OSError):
        return None
    return f"{metadata.source_path(path)}:{line}" if path else None


def module_info(module: torch.nn.Module | None, qualified_class: str) -> tuple[str, str, str, str | None]:
    """(qualified class, package, version, source) for a live module (or just a class name)."""
    if module is not None:
        cls = type(module)
        qualified_class = f"{cls.__module__}.{cls.__qualname__}"
        package, version = package_of(cls.__module__)
        return qualified_class, package, version, _source_of(cls)
    package, version = package_of(qualified_class.rsplit(".", 1)[0] if "." in qualified_class else qualified_class)
    return qualified_class, package, version, None


def build_call_tree(
    stacks: list[dict[str, tuple[str, Any]]],
    model: torch.nn.Module,
    eager_calls: list[tuple[int, int, str, tuple[int, int] | None]] | None = None,
) -> tuple[CallTree, dict[tuple[int, int], tuple[str, int]]]:
    """Build the tree from the ``nn_module_stack`` of each FX node, in graph order.

    Args:
        stacks: ``nn_module_stack`` dicts (key -> (module path, class)) in execution order.
        model: The live model, used to resolve classes and source locations.
        eager_calls: ``(id(instance), n, first module path, parent (id, n) or None)`` for
            every call seen in an eager run, in call order. Calls that left no op in the
            graph (``nn.Identity``, a module whose result is unused) are only known from
            here; they join the tree with ``function=None``.

    Returns:
        The tree, and for each eager call ``(id(instance), n)`` its ``(module path, call
        index)`` in the tree. An instance reachable under two attribute paths is matched
        by instance and call order, so its calls are not listed twice.
    """
    _check_one_path_per_key(stacks)
    root_cls = type(model)
    qualified, package, version, source = module_info(model, "")
    root = ModuleCall("", "", 0, qualified, package, version, source)
    by_key: dict[str, ModuleCall] = {}
    modules = dict(model.named_modules(remove_duplicate=False))
    del root_cls
    for stack in stacks:
        parent = root
        for key, (path, cls) in stack.items():
            if path == "" or key.startswith(_SYNTHETIC_KEY_PREFIX):
                continue  # the root module is the main graph; torch adds synthetic entries for hoisted sizes
            call = by_key.get(key)
            if call is None:
                cls_name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
                qualified, package, version, source = module_info(modules.get(path), cls_name)
                call = ModuleCall(key, path, metadata.split_call_name(key)[1], qualified, package, version, source, parent=parent)
                parent.children.append(call)
                by_key[key] = call
            parent = call
    # The n-th call of each instance on the torch.export side. torch counts calls per path
    # (``@N``), which is the instance's count when the instance has one path; an instance
    # reachable under several paths is matched by call order instead.
    paths_per_instance: dict[int, int] = {}
    for module in modules.values():
        paths_per_instance[id(module)] = paths_per_instance.get(id(module), 0) + 1
    seen: dict[int, int] = {}
    key_of_call: dict[tuple[int, int], tuple[str, int]] = {(id(model), 0): ("", 0)}
    for call in CallTree(root).walk():
        if call is root or call.module_path not in modules:
            continue
        instance = id(modules[call.module_path])
        if paths_per_instance[instance] == 1:
            n = call.call_index
        else:
            n = seen.get(instance, 0)
            seen[instance] = n + 1
        key_of_call[(instance, n)] = (call.module_path, call.call_index)
    if eager_calls:
        for instance, n, path, _ in eager_calls:
            if (instance, n) not in key_of_call:
                # No op left in the graph: known from eager mode only, under its first path.
                if paths_per_instance.get(instance, 1) == 1:
                    index = n
                else:
                    index = sum(1 for key in key_of_call.values() if key[0] == path)
                key_of_call[(instance, n)] = (path, index)
        _add_eager_calls(
            root,
            by_key,
            [(*key_of_call[(i, n)], key_of_call.get(parent) if parent else None) for i, n, _, parent in eager_calls],
            modules,
        )
    return CallTree(root), key_of_call


def _check_one_path_per_key(stacks: list[dict[str, tuple[str, Any]]]) -> None:
    """Refuse a stack key shared by two module paths.

    torch.export keys the n-th call of ``x`` as ``x@n``; a submodule whose own name is
    ``x@1`` (a ``ModuleDict`` key) gets the same key, and the two calls would merge.
    """
    paths: dict[str, str] = {}
    for stack in stacks:
        for key, (path, _) in stack.items():
            first = paths.setdefault(key, path)
            if first != path:
                renamed = first if metadata.split_call_name(first)[1] else path
                raise ModularizeError(
                    f"The modules {first!r} and {path!r} share torch.export's call key {key!r}: a module "
                    f"named like a repeated call ('name@N') collides with the N-th call of 'name', and "
                    "their calls cannot be told apart.",
                    module_path=renamed,
                    hint=f"Rename the submodule {renamed!r} so that its name does not end in '@<number>' "
                    "(for example '_' instead of '@' in the ModuleDict key).",
                )


def _add_eager_calls(root: ModuleCall, by_key: dict[str, ModuleCall], eager_calls, modules) -> None:
    by_call = {(call.module_path, call.call_index): call for call in by_key.values()}
    order = {(path, index): i for i, (path, index, _) in enumerate(eager_calls)}
    for path, index, parent_id in eager_calls:
        if path == "" or (path, index) in by_call:
            continue
        parent = by_call.get(parent_id, root) if parent_id and parent_id[0] else root
        module = modules.get(path)
        qualified, package, version, source = module_info(module, type(module).__name__ if module is not None else "")
        call = ModuleCall("eager:" + metadata.call_name(path, index), path, index, qualified, package, version, source, parent=parent)
        parent.children.append(call)
        by_call[(path, index)] = call
    for call in root.walk():
        call.children.sort(key=lambda child: order.get((child.module_path, child.call_index), len(order)))


def module_stacks(model: ir.Model) -> dict[ir.Node, tuple[str, ...]]:
    """Each main-graph node's module-call keys (its FX node's ``nn_module_stack``, outermost first),
    for :class:`~onnx_modular.passes.export.module_stacks.AnnotateStacksPass`."""
    stacks = {}
    for node in model.graph:
        fx_node = torch_compat.fx_node_of(node)
        stack = (fx_node.meta.get("nn_module_stack") or {}) if fx_node is not None else {}
        if stack:
            stacks[node] = tuple(stack)
    return stacks
