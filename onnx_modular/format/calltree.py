"""The module-call tree: one :class:`ModuleCall` per module call, under a :class:`CallTree`.

One type for both sides: ``result.hierarchy`` (built during export from torch's
``nn_module_stack``, see :mod:`onnx_modular.capture.fx_call_tree`) and the tree of a saved file
(:func:`onnx_modular.calls.tree.function_tree`). Node, parameter and call counts always
come from the final ONNX model (:func:`onnx_modular.calls.tree.count_from_model`), so the
same file gives the same numbers both ways. No torch here.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from collections.abc import Iterator
from typing import Any

from onnx_modular.format import metadata
from onnx_modular.format.text import shown

__all__ = ["ModuleCall", "CallTree", "drawn"]


class TreeNode:
    """What every node of a call tree derives from its ``parent`` and ``children`` links
    (``ModuleCall`` here, ``CallDiff`` in ``files/diff/result.py``)."""

    parent: Any
    children: list

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def depth(self) -> int:
        depth, node = 0, self.parent
        while node is not None:
            depth, node = depth + 1, node.parent
        return depth

    def walk(self) -> Iterator[Any]:
        """This node and all nodes below it, depth first, in order (no recursion)."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))


@dataclasses.dataclass(eq=False)
class ModuleCall(TreeNode):
    """One call of one module (or, in a file of another tool, one call of a local function).

    Attributes:
        key: A key unique per call (torch's ``nn_module_stack`` key during export, the
            call name in a file's tree).
        module_path: Dotted path of the module in the model (``""`` for the root).
        call_index: 0 for the first call of this module instance, 1 for the second, ...
        qualified_class: ``package.module.Class`` (``""`` when unknown).
        package: Top-level package that defines the class.
        version: That package's installed version (``"local"`` when not installed).
        source: ``file:line`` of the class definition, when known.
        children: Calls made from inside this call, in execution order.
        function: ``(domain, name)`` of the ONNX function of this call (``None`` for calls
            that produce no ops or are not selected).
        overload: The function's overload (usually ``""``).
        num_nodes: ONNX nodes directly in the function body (the main graph for the root),
            in the final model.
        parameters: Weight elements flowing into this call (main-graph initializers passed
            in, followed through formal inputs); all of them for the root.
        call_count: Calls of this call's function in the whole model (1 for the root).
        node_name: The ONNX node name of the call (relative inside a shared body: ``attn``);
            the graph name for the root.
        selected: False when the ``modules`` option kept this call inline in its parent.
        name_hint: The function's name where the class is unknown (a flat file named by
            scope only: ``modularize`` names bodies after the module path's pattern).
    """

    key: str
    module_path: str
    call_index: int = 0
    qualified_class: str = ""
    package: str = ""
    version: str = ""
    source: str | None = None
    children: list[ModuleCall] = dataclasses.field(default_factory=list)
    parent: ModuleCall | None = dataclasses.field(default=None, repr=False)
    function: tuple[str, str] | None = None
    overload: str = ""
    num_nodes: int = 0
    parameters: int = 0
    call_count: int = 1
    node_name: str = ""
    selected: bool = True
    name_hint: str = ""

    @property
    def class_name(self) -> str:
        if self.qualified_class:
            return self.qualified_class.rsplit(".", 1)[-1]
        if self.name_hint:
            return self.name_hint
        return self.function[1] if self.function else ""

    @property
    def call_name(self) -> str:
        """The module path, with ``@N`` when the module is called again."""
        return metadata.call_name(self.module_path or "<root>", self.call_index)

    def metadata(self) -> dict[str, str]:
        """Metadata for the ONNX call node (keys from :mod:`onnx_modular.format.metadata`)."""
        props = {
            metadata.MODULE_PATH: self.module_path,
            metadata.CALL_INDEX: str(self.call_index),
            metadata.CLASS: self.qualified_class,
            metadata.PACKAGE: self.package,
            metadata.PACKAGE_VERSION: self.version,
        }
        if self.source:
            props[metadata.SOURCE] = self.source
        return props

    def matches(self, class_filter: str) -> bool:
        """Whether the function name or class matches ``class_filter`` (a name or glob).

        ``GPT2Attention``, ``transformers.models.gpt2.modeling_gpt2.GPT2Attention`` and
        ``GPT2*`` all match the GPT2Attention calls; ``Conv1D`` also matches the
        ``Conv1D_2`` function through its class.
        """
        candidates = [self.function[1] if self.function else ""]
        if self.qualified_class:
            candidates += [self.qualified_class, self.class_name]
        elif self.name_hint:
            candidates.append(self.name_hint)
        return any(fnmatch.fnmatchcase(candidate, class_filter) for candidate in candidates if candidate)

    def _row(self) -> dict[str, Any]:
        return {
            "name": self.node_name,
            "path": "" if self.is_root else self.call_name,
            "module_path": self.module_path,
            "call_index": self.call_index,
            "function": self.function[1] if self.function else None,
            "domain": self.function[0] if self.function else "",
            "overload": self.overload,
            "class": self.qualified_class or None,
            "calls": self.call_count,
            "nodes": self.num_nodes,
            "parameters": self.parameters,
            "selected": self.selected,
            "children": [],
        }

    def _status(self) -> str:
        if self.function is not None:
            return ""
        return "not selected: inlined into its parent" if not self.selected else "no ops"


class CallTree:
    """The module-call tree of one export or one file.

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
            if not call.is_root and call.module_path == module_path and call.call_index == call_index:
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
        """A JSON-ready dict; ``children`` holds the nested calls (built without recursion)."""
        result = self.root._row()
        stack = [(self.root, result)]
        while stack:
            node, converted = stack.pop()
            for child in node.children:
                row = child._row()
                converted["children"].append(row)
                stack.append((child, row))
        return result

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def filtered(self, max_depth: int | None = None, class_filter: str | None = None) -> CallTree:
        """A copy keeping calls down to ``max_depth`` that match ``class_filter``, plus their ancestors.

        Args:
            max_depth: Keep calls down to this depth (1 = calls in the root graph only).
            class_filter: A function name, class name or glob (see :meth:`ModuleCall.matches`);
                ``None`` keeps every call.
        """
        kept: set[int] | None = None
        if class_filter is not None:
            kept = {id(self.root)}
            for call in self.walk():
                if not call.is_root and call.matches(class_filter):
                    node = call
                    while node is not None and id(node) not in kept:
                        kept.add(id(node))
                        node = node.parent
        copy = dataclasses.replace(self.root, children=[], parent=None)
        work = [(self.root, copy, 0)]
        while work:
            original, clone, depth = work.pop()
            if max_depth is not None and depth >= max_depth:
                continue
            for child in original.children:
                if kept is None or id(child) in kept:
                    child_clone = dataclasses.replace(child, children=[], parent=clone)
                    clone.children.append(child_clone)
                    work.append((child, child_clone, depth + 1))
        return CallTree(copy)

    @property
    def height(self) -> int:
        """Deepest nesting of any call (0 for a tree without calls)."""
        return max((call.depth for call in self.walk()), default=0)

    def drawn(self, max_depth: int | None = None) -> Iterator[tuple[ModuleCall, str]]:
        """(call, its tree-drawing prefix such as ``│  ├─ ``) in display order, down to ``max_depth``.

        The one drawing of the tree: :meth:`format` and the profile's view (``onnx-modular profile``)
        put their columns after it.
        """
        yield from drawn(self.root, max_depth)

    def format(self, max_depth: int | None = None, class_filter: str | None = None) -> str:
        """A readable tree, one call per line: call name, function, domain, calls, nodes, parameters.

        Calls without a function say why: ``(no ops)`` or ``(not selected: inlined into its parent)``.

        Args:
            max_depth: Show calls down to this depth (1 = calls in the root graph only).
            class_filter: Keep only calls whose function name or class matches (a name
                or a glob such as ``"GPT2*"``), plus the calls that lead to them.

        Example output::

            main_graph                                        156 nodes  108,544 params
            ├─ wte   Embedding  [pkg.torch.2.13.0]         ×1     1 node    6,400 params
            ├─ h.0   GPT2Block  [pkg.transformers.5.23.0]  ×2    6 nodes   49,984 params
        """
        tree = self.filtered(max_depth, class_filter)
        rows: list[list[str]] = []
        for node, label_prefix in tree.drawn():
            nodes = f"{node.num_nodes} node{'' if node.num_nodes == 1 else 's'}"
            params = f"{node.parameters:,} params"
            if node.is_root:
                rows.append([node.node_name or node.class_name or "main_graph", "", "", "", nodes, params])
            elif node.function is None:
                rows.append([label_prefix + node.call_name, f"{node.class_name} ({node._status()})", "", "", "", ""])
            else:
                function = node.function[1] + (f":{node.overload}" if node.overload else "")
                rows.append(
                    [
                        label_prefix + node.call_name,
                        function,
                        f"[{node.function[0]}]",
                        f"×{node.call_count}",
                        nodes,
                        params,
                    ]
                )
        rows = [[shown(cell) for cell in row] for row in rows]  # names cannot drive the terminal
        widths = [max((len(row[column]) for row in rows if column != 1 or row[2]), default=0) for column in range(6)]
        lines = []
        for row in rows:
            if row[1] and not row[2]:  # a call without a function: its status, nothing more
                lines.append(f"{row[0].ljust(widths[0])}  {row[1]}".rstrip())
                continue
            cells = [row[column].ljust(widths[column]) for column in range(3)]
            cells += [row[column].rjust(widths[column]) for column in range(3, 6)]
            lines.append("  ".join(cells).rstrip())
        if class_filter is not None and not tree.root.children:
            lines.append(f"(no call matches {shown(class_filter)!r})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        count = sum(1 for _ in self.walk()) - 1
        return f"CallTree(root={self.root.class_name or self.root.node_name}, calls={count})"


def drawn(root: Any, max_depth: int | None = None) -> Iterator[tuple[Any, str]]:
    """(node, its tree-drawing prefix such as ``│  ├─ ``) in display order, down to ``max_depth``,
    for any tree whose nodes have ``children`` (module calls, a diff's merged calls): the one
    drawing of a call tree in the terminal."""
    stack: list[tuple[Any, str, str, int]] = [(root, "", "", 0)]
    while stack:
        node, label_prefix, child_prefix, depth = stack.pop()
        yield node, label_prefix
        if max_depth is not None and depth >= max_depth:
            continue
        for index in reversed(range(len(node.children))):
            last = index == len(node.children) - 1
            stack.append(
                (
                    node.children[index],
                    child_prefix + ("└─ " if last else "├─ "),
                    child_prefix + ("   " if last else "│  "),
                    depth + 1,
                )
            )
