"""ONNX IR pass: final function names, doc strings and function metadata.

Runs after deduplication (on the functions OutlineModuleCallsPass created, with the same
call tree; ``requires()`` checks the tree). Functions of one class in one domain are named after
the class; when a class has several distinct bodies (different shapes, different
submodules), the first in execution order keeps the class name and the others get
``_2``, ``_3``, ... in execution order, which is stable from run to run. The doc
string (what Netron shows) says which module paths call each function.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import onnx_ir as ir

from onnx_modular.format import metadata
from onnx_modular.passes.functions import redirect_calls

if TYPE_CHECKING:  # data only: the pass reads the calls' attributes and sets ``function``
    from onnx_modular.format.calltree import CallTree, ModuleCall

__all__ = ["NameFunctionsPass", "MAX_LISTED_PATHS"]

MAX_LISTED_PATHS = 8


def _doc_string(calls: list[ModuleCall], name: str, notes: list[str]) -> str:
    first = calls[0]
    paths = [call.call_name for call in calls]
    if len(paths) > MAX_LISTED_PATHS:
        listed = ", ".join(paths[:MAX_LISTED_PATHS]) + f", ... ({len(paths) - MAX_LISTED_PATHS} more)"
    else:
        listed = ", ".join(paths)
    lines = [
        f"{name}: {first.qualified_class}",
        f"package: {first.package} {first.version}",
    ]
    if first.source:
        lines.append(f"source: {first.source}")
    plural = "call" if len(paths) == 1 else "calls"
    lines.append(f"{len(paths)} {plural}: {listed}")
    if notes:
        lines.append("names not from forward():")
        lines += [f"  {note}" for note in notes]
    return "\n".join(lines)


class NameFunctionsPass(ir.passes.InPlacePass):
    """Give module-call functions readable, stable names, doc strings and metadata.

    Args:
        call_tree: The module-call tree; ``call.function`` is updated to the final name.

    Example::

        NameFunctionsPass(tree)(model)
        # functions: ('pkg.transformers.5.23.0', 'GPT2Block'), ... 'Conv1D', 'Conv1D_2'
    """

    def __init__(self, call_tree: CallTree):
        super().__init__()
        self.call_tree = call_tree

    def requires(self, model: ir.Model) -> None:
        """Every call a module-call function serves is a call of ``call_tree`` (the same export)."""
        for function in model.functions.values():
            for call in function.meta.get(metadata.CALLS, ()):
                if call.key not in self.call_tree:
                    raise ir.passes.PreconditionError(
                        f"Function {function.name!r} serves the call {call.key!r}, which is not in the call tree; "
                        "name functions with the tree that outlined them."
                    )

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        order = {call.key: i for i, call in enumerate(self.call_tree.walk())}
        ours = [f for f in model.functions.values() if metadata.CALLS in f.meta]
        groups: dict[tuple[str, str], list[ir.Function]] = {}
        for function in ours:
            calls = function.meta[metadata.CALLS]
            calls.sort(key=lambda call: order[call.key])
            groups.setdefault((function.domain, calls[0].class_name), []).append(function)

        renames: dict[ir.OperatorIdentifier, ir.OperatorIdentifier] = {}
        for (domain, class_name), functions in groups.items():
            functions.sort(key=lambda f: order[f.meta[metadata.CALLS][0].key])
            for index, function in enumerate(functions):
                name = class_name if index == 0 else f"{class_name}_{index + 1}"
                renames[function.identifier()] = (domain, name, "")
        redirect_calls(model, renames)
        renamed = {}
        for function in list(model.functions.values()):
            new = renames.get(function.identifier())
            if new is None:
                renamed[function.identifier()] = function
                continue
            function.name = new[1]
            function.graph.name = new[1]
            calls = function.meta[metadata.CALLS]
            for call in calls:
                call.function = (function.domain, function.name)
            first = calls[0]
            function.doc_string = _doc_string(calls, function.name, function.meta.get(metadata.SIGNATURE_NOTES, []))
            props = function.metadata_props
            props[metadata.CLASS] = first.qualified_class
            props[metadata.PACKAGE] = first.package
            props[metadata.PACKAGE_VERSION] = first.version
            props[metadata.MODULE_PATHS] = json.dumps([call.call_name for call in calls])
            props[metadata.CALL_COUNT] = str(len(calls))
            if first.source:
                props[metadata.SOURCE] = first.source
            renamed[function.identifier()] = function
        model.functions.clear()
        model.functions.update(renamed)
        _drop_repeated_class_keys(model)
        return ir.passes.PassResult(model, modified=bool(renames))


def _drop_repeated_class_keys(model: ir.Model) -> None:
    """The module's class, package and version have one home, its function (Netron shows them
    on a call node as its type and domain): a call node keeps one only where its call's differs
    (a body shared by two classes). The source stays on the node too: Netron's node panel shows
    a node's metadata, not its function's."""
    graphs = [model.graph, *(f.graph for f in model.functions.values())]
    for graph in graphs:
        for node in ir.traversal.RecursiveGraphIterator(graph):
            function = model.functions.get(node.op_identifier())
            if function is None or metadata.CLASS not in function.metadata_props:
                continue
            for key in metadata.FUNCTION_ONLY_KEYS:
                if key in node.metadata_props and node.metadata_props[key] == function.metadata_props.get(key):
                    del node.metadata_props[key]
