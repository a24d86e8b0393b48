"""The module-call tree: one :class:`ModuleCall` per ``nn.Module`` call in the forward pass.

Built from the ``nn_module_stack`` that torch.export records on every FX node. The
stack *keys* tell repeated calls apart (the second call of ``self.shared`` is keyed
``L__self__shared@1``), so grouping is by key, never by module path.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import inspect
import json
import re
import sys
from collections.abc import Iterator
from typing import Any

import torch

from onnx_modular.errors import ModularizeError

__all__ = ["ModuleCall", "CallTree", "module_info", "package_of"]

_CALL_INDEX = re.compile(r"@(\d+)$")
_SYNTHETIC_KEY_PREFIX = "_empty_nn_module_stack"


@dataclasses.dataclass
class ModuleCall:
    """One call of one module.

    Attributes:
        key: The ``nn_module_stack`` key of the call (unique per call).
        module_path: Dotted path of the module in the model (``""`` for the root).
        call_index: 0 for the first call of this module instance, 1 for the second, ...
        qualified_class: ``package.module.Class``.
        package: Top-level package that defines the class.
        version: That package's installed version (``"local"`` when not installed).
        source: ``file:line`` of the class definition, when known.
        children: Calls made from inside this call, in execution order.
        function: ``(domain, name)`` of the ONNX function of this call, once exported
            (``None`` for calls that produce no ops or are not selected).
        selected: False when the ``modules`` option kept this call inline in its parent.
        num_nodes: ONNX nodes directly in the function body (excluding nested calls' bodies).
    """

    key: str
    module_path: str
    call_index: int
    qualified_class: str
    package: str
    version: str
    source: str | None = None
    children: list[ModuleCall] = dataclasses.field(default_factory=list)
    parent: ModuleCall | None = dataclasses.field(default=None, repr=False)
    function: tuple[str, str] | None = None
    num_nodes: int = 0
    selected: bool = True

    @property
    def class_name(self) -> str:
        return self.qualified_class.rsplit(".", 1)[-1]

    @property
    def call_name(self) -> str:
        """The module path, with ``@N`` when the module is called again."""
        path = self.module_path or "<root>"
        return f"{path}@{self.call_index}" if self.call_index else path

    @property
    def depth(self) -> int:
        depth, node = 0, self.parent
        while node is not None:
            depth, node = depth + 1, node.parent
        return depth

    def walk(self) -> Iterator[ModuleCall]:
        """This call and all calls below it, depth first, in execution order."""
        yield self
        for child in self.children:
            yield from child.walk()

    def metadata(self) -> dict[str, str]:
        """Metadata for the ONNX call node (keys ``pkg.onnx_modular.*``)."""
        props = {
            "pkg.onnx_modular.module_path": self.module_path,
            "pkg.onnx_modular.call_index": str(self.call_index),
            "pkg.onnx_modular.class": self.qualified_class,
            "pkg.onnx_modular.package": self.package,
            "pkg.onnx_modular.package_version": self.version,
        }
        if self.source:
            props["pkg.onnx_modular.source"] = self.source
        return props


class CallTree:
    """The module-call tree of one export.

    Example::

        result = export_modular(model, (x,), "m.onnx")
        print(result.hierarchy)          # readable tree
        for call in result.hierarchy.walk():
            print(call.call_name, call.function)
    """

    def __init__(self, root: ModuleCall):
        self.root = root
        self._by_key = {call.key: call for call in root.walk()}

    def __getitem__(self, key: str) -> ModuleCall:
        return self._by_key[key]

    def __contains__(self, key: str) -> bool:
        return key in self._by_key

    def walk(self) -> Iterator[ModuleCall]:
        return self.root.walk()

    def find(self, module_path: str, call_index: int = 0) -> ModuleCall:
        for call in self.walk():
            if call.module_path == module_path and call.call_index == call_index:
                return call
        raise KeyError(f"No call of module {module_path!r} (call {call_index})")

    def calls_with_functions(self) -> list[ModuleCall]:
        return [call for call in self.walk() if call.function is not None]

    @property
    def max_depth(self) -> int:
        """Deepest nesting of calls that have functions (0 when there are none)."""
        best = 0
        for call in self.calls_with_functions():
            depth, node = 0, call
            while node is not None and node.parent is not None:
                if node.function is not None:
                    depth += 1
                node = node.parent
            best = max(best, depth)
        return best

    def to_dict(self) -> dict[str, Any]:
        def convert(call: ModuleCall) -> dict[str, Any]:
            return {
                "call": call.call_name,
                "module_path": call.module_path,
                "call_index": call.call_index,
                "class": call.qualified_class,
                "function": list(call.function) if call.function else None,
                "nodes": call.num_nodes,
                "selected": call.selected,
                "children": [convert(child) for child in call.children],
            }

        return convert(self.root)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format(self, max_depth: int | None = None) -> str:
        lines = [f"{self.root.class_name} (root graph)"]

        def visit(call: ModuleCall, prefix: str, depth: int) -> None:
            for i, child in enumerate(call.children):
                last = i == len(call.children) - 1
                branch = "└─ " if last else "├─ "
                if child.function is not None:
                    domain, name = child.function
                    what = f"{name}  [{domain}]  {child.num_nodes} nodes"
                elif not child.selected:
                    what = f"{child.class_name}  (not selected: inlined into its parent)"
                else:
                    what = f"{child.class_name}  (no ops)"
                lines.append(f"{prefix}{branch}{child.call_name}: {what}")
                if max_depth is None or depth + 1 < max_depth:
                    visit(child, prefix + ("   " if last else "│  "), depth + 1)

        visit(self.root, "", 0)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        count = sum(1 for _ in self.walk()) - 1
        return f"CallTree(root={self.root.class_name}, calls={count})"


@functools.lru_cache(maxsize=None)
def _distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


@functools.lru_cache(maxsize=None)
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


@functools.lru_cache(maxsize=None)
def _source_of(cls: type) -> str | None:
    try:
        path = inspect.getsourcefile(cls)
        line = inspect.getsourcelines(cls)[1]
    except (TypeError, OSError):
        return None
    return f"{path}:{line}" if path else None


def module_info(module: torch.nn.Module | None, qualified_class: str) -> tuple[str, str, str, str | None]:
    """(qualified class, package, version, source) for a live module (or just a class name)."""
    if module is not None:
        cls = type(module)
        qualified_class = f"{cls.__module__}.{cls.__qualname__}"
        package, version = package_of(cls.__module__)
        return qualified_class, package, version, _source_of(cls)
    package, version = package_of(qualified_class.rsplit(".", 1)[0] if "." in qualified_class else qualified_class)
    return qualified_class, package, version, None


def call_index_of(key: str) -> int:
    match = _CALL_INDEX.search(key)
    return int(match.group(1)) if match else 0


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
                call = ModuleCall(key, path, call_index_of(key), qualified, package, version, source, parent=parent)
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
                renamed = first if _CALL_INDEX.search(first) else path
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
        call = ModuleCall(f"eager:{path}@{index}", path, index, qualified, package, version, source, parent=parent)
        parent.children.append(call)
        by_call[(path, index)] = call
    for call in root.walk():
        call.children.sort(key=lambda child: order.get((child.module_path, child.call_index), len(order)))
