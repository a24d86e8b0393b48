"""The call tree a flat file's recorded module scopes give (``modularize``), and what they cannot give back.

:func:`recorded_stacks` reads each main-graph node's scopes by the first of :data:`SOURCES` the
file carries (the readers are :mod:`onnx_modular.format.scopes`); :func:`build_tree` makes the
:class:`~onnx_modular.format.calltree.CallTree` and each node's stack of call keys that the
export pipeline's passes read; :func:`selected` marks the calls that become functions. After
outlining, :func:`merged_calls` and :func:`weightless_modules` say what a flat file could not
give back. Calls inferred from structure, where no scope is recorded, are
:mod:`onnx_modular.calls.inferred`'s. No torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import onnx_ir as ir

from onnx_modular.errors import InvalidInputError, InvalidModelFileError
from onnx_modular.format import metadata, scopes
from onnx_modular.format.calltree import CallTree, ModuleCall
from onnx_modular.format.scopes import Scopes
from onnx_modular.format.text import shown

__all__ = [
    "SOURCES",
    "recorded_stacks",
    "build_tree",
    "selected",
    "root_class",
    "torch_version",
    "weightless_modules",
    "merged_calls",
]

#: Where a call tree can come from, in the order they are looked for.
SOURCES = ("torch name_scopes", "namespace", "scope names")


def recorded_stacks(model: ir.Model) -> tuple[str, dict[ir.Node, Scopes | None]] | None:
    """The first of :data:`SOURCES` the main graph's nodes carry, and each node's scopes by it
    (``None``: the node carries none); ``None`` when no node carries any.

    Raises:
        InvalidModelFileError: The file is modular already (it has module functions).
    """
    ours = [f.name for f in model.functions.values() if metadata.is_module_function(f)]
    if ours:
        raise InvalidModelFileError(
            f"The file is modular already: it has module functions ({', '.join(shown(n) for n in ours[:3])}).",
            hint="Run `onnx-modular tree` on it; to start again from a flat copy, run `onnx-modular inline` first.",
        )
    nodes = list(model.graph)
    weights = frozenset(model.graph.initializers)
    readers = {
        "torch name_scopes": lambda node: scopes.torch_scopes(node.metadata_props),
        "namespace": lambda node: scopes.namespace_scopes(node.metadata_props),
        "scope names": lambda node: scopes.name_scopes(node.name, weights),
    }
    for source, reader in readers.items():
        stacks = {node: reader(node) for node in nodes}
        # A source counts when it places some node under a module, not only under the root.
        if any(stack for stack in stacks.values()):
            return source, stacks
    return None


def _package(qualified_class: str, torch_version: str | None) -> tuple[str, str]:
    """(package, version): the top of the class's module path; the version only when the file tells it."""
    if not qualified_class or "." not in qualified_class:
        return metadata.UNKNOWN_PACKAGE, metadata.UNKNOWN_PACKAGE
    package = qualified_class.split(".", 1)[0].strip("_") or metadata.UNKNOWN_PACKAGE
    if package == "torch" and torch_version:
        return package, torch_version
    return package, metadata.UNKNOWN_PACKAGE


def _name_hint(path: str) -> str:
    """``model.layers.0`` -> ``layers``, ``model.layers.0.self_attn`` -> ``self_attn``."""
    names = [part for part in path.split(".") if not part.isdigit()]
    return names[-1] if names else "module"


def build_tree(
    stacks: Mapping[ir.Node, Scopes | None], root_class: str, torch_version: str | None
) -> tuple[CallTree, dict[ir.Node, tuple[str, ...]]]:
    """The tree (keys are module paths: a file does not tell a module's repeated calls apart) and
    each node's call keys."""
    package, version = _package(root_class, torch_version)
    root = ModuleCall("", "", 0, root_class, package, version)
    by_path: dict[str, ModuleCall] = {}
    keys: dict[ir.Node, tuple[str, ...]] = {}
    for node, chain in stacks.items():
        if not chain:
            continue
        parent = root
        for path, cls in chain:
            call = by_path.get(path)
            if call is None:
                package, version = _package(cls, torch_version)
                call = ModuleCall(path, path, 0, cls, package, version, parent=parent, name_hint="" if cls else _name_hint(path))
                parent.children.append(call)
                by_path[path] = call
            parent = call
        keys[node] = tuple(path for path, _ in chain)
    return CallTree(root), keys


def selected(tree: CallTree, modules: str | int | Iterable[str] | None) -> set[str]:
    """The call keys that become functions: ``"all"``, a maximum depth, or class names/globs."""
    if modules is None or modules == "all":
        select = lambda call: True
    elif isinstance(modules, bool):
        raise InvalidInputError("modules must be 'all', a depth or class names, not a bool.")
    elif isinstance(modules, int):
        if modules < 1:
            raise InvalidInputError(f"The depth must be >= 1 (1: the root's children only), got {modules}.")
        select = lambda call: call.depth <= modules
    else:
        patterns = [modules] if isinstance(modules, str) else list(modules)
        if not patterns or not all(isinstance(p, str) and p for p in patterns):
            raise InvalidInputError(f"modules must be 'all', a depth or class names/globs, got {modules!r}.")
        select = lambda call: any(call.matches(p) for p in patterns)
        found = {p for p in patterns for call in tree.walk() if not call.is_root and call.matches(p)}
        missing = [p for p in patterns if p not in found]
        if missing:
            known = sorted({call.class_name for call in tree.walk() if not call.is_root})
            raise InvalidInputError(
                f"No module of the file matches {', '.join(shown(p) for p in missing)}.",
                hint=f"Classes in the file: {', '.join(known[:12])}{' ...' if len(known) > 12 else ''}.",
            )
    for call in tree.walk():
        if not call.is_root:
            call.selected = bool(select(call))
    return {call.key for call in tree.walk() if not call.is_root and call.selected}


#: Names exporters give the constants they store as initializers: torch's translator ``val_<n>``

def torch_version(model: ir.Model) -> str | None:
    return model.producer_version.split("+", 1)[0] if model.producer_name == "pytorch" else None


def root_class(model: ir.Model) -> str:
    root_class = next(
        (classes[0] for node in model.graph if (classes := scopes.string_list(node.metadata_props.get(metadata.CLASS_HIERARCHY)))),
        "",
    )
    if not root_class:
        root_class = next(
            (seg.partition(": ")[2] for node in model.graph
             if (seg := (node.metadata_props.get(metadata.NAMESPACE) or "").split("/")[0]).startswith(": ")),
            "",
        )
    return root_class


def weightless_modules(model: ir.Model, tree: CallTree, keys: Mapping[ir.Node, tuple[str, ...]]) -> list[str]:
    """Modules whose weights (``<path>.<attribute>`` initializers) are in the file but that have
    no node: their ops were fused into another module's node or folded (before outlining)."""
    paths = {call.module_path for call in tree.walk() if call.module_path}
    lost: dict[str, list[str]] = {}
    readers: dict[str, set[str]] = {}
    for name, value in model.graph.initializers.items():
        path = name.rpartition(".")[0]
        if not path or path in paths or not all(scopes.ATTRIBUTE.match(part) for part in path.split(".")):
            continue
        lost.setdefault(path, []).append(name)
        for user, _ in value.uses():
            stack = keys.get(user)
            readers.setdefault(path, set()).add(stack[-1] if stack else "the main graph")
    lines = []
    for path, names in lost.items():
        read = sorted(readers.get(path, ()))
        lines.append(
            f"{path}: its weights ({', '.join(names[:3])}{' ...' if len(names) > 3 else ''}) are in the file but it has no "
            "node of its own (torch's optimizer fused it into another module's node, e.g. Conv+BatchNorm, or folded it)"
            + (f"; read by nodes of {', '.join(read[:3])}" if read else "")
        )
    return lines


def _nodes_below(model: ir.Model, function: ir.Function) -> Iterable[ir.Node]:
    """The nodes of ``function`` and of the functions it calls, nested."""
    stack, seen = [function], set()
    while stack:
        for node in stack.pop():
            inner = model.functions.get(node.op_identifier())
            if inner is None:
                yield node
            elif id(inner) not in seen:
                seen.add(id(inner))
                stack.append(inner)


def _above(call: ModuleCall) -> set[str]:
    keys, parent = set(), call.parent
    while parent is not None:
        keys.add(parent.key)
        parent = parent.parent
    return keys


def merged_calls(model: ir.Model, tree: CallTree, stacks: Mapping[ir.Node, Scopes | None]) -> list[str]:
    """Calls whose body took in nodes of other scopes (``_make_convex``): a module called more
    than once, its calls merged into one, or code interleaved with it (after outlining)."""
    serving: dict[tuple, list[ModuleCall]] = {}
    for call in tree.walk():
        if call.function is not None:
            serving.setdefault((*call.function, call.overload), []).append(call)
    lines = []
    reported: set[str] = set()
    for function_key, calls in serving.items():
        function = model.functions.get(function_key)
        if function is None or any(_above(call) & reported for call in calls):
            continue  # an enclosing call merged already says it
        own = {call.key for call in calls}
        foreign = sorted({
            (stack[-1][0] if stack else "") for node in _nodes_below(model, function)
            if (stack := stacks.get(node)) is not None and not own & {path for path, _ in stack}
        })
        if foreign:
            reported |= own
            names = ", ".join(shown(key or "<root>") for key in foreign[:3]) + (" ..." if len(foreign) > 3 else "")
            lines.append(
                f"{calls[0].call_name}: its body took in nodes of {names} that run between its own: a module called "
                "more than once (its calls merged into one; a flat file does not tell them apart) or code interleaved with it"
            )
    return lines
