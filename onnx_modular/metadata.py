"""The file-format contract: metadata keys and call-name conventions (see docs/metadata.md).

Every key onnx_modular writes into a file, and every rule for reading call names back, lives
here; the exporter, the file tools, localization and the tests import them from this module.
It imports neither torch nor onnxruntime, and works on both ``onnx`` protos and ``onnx_ir``
objects (anything with ``metadata_props``).

Example::

    from onnx_modular import metadata

    for call in metadata.expanded_calls(onnx.load("gpt2.onnx")):
        print(call.call_name, call.function.name, call.depth)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from typing import Any

import onnx

__all__ = [
    "PREFIX",
    "CLASS",
    "PACKAGE",
    "PACKAGE_VERSION",
    "SOURCE",
    "MODULE_PATH",
    "MODULE_PATHS",
    "CALL_INDEX",
    "CALL_COUNT",
    "NO_OP_CALLS",
    "NAMESPACE",
    "CALLS",
    "CALL_METADATA_KEYS",
    "call_name",
    "split_call_name",
    "strip_call_index",
    "props",
    "is_module_function",
    "module_paths",
    "body_module_path",
    "resolve_module_path",
    "CallCounter",
    "no_op_calls",
    "ExpandedCall",
    "expanded_calls",
]

PREFIX = "pkg.onnx_modular."

# -- keys on functions and call nodes ------------------------------------------------------
#: Qualified class of the module (``transformers.models.gpt2.modeling_gpt2.GPT2Block``);
#: on functions and call nodes. Its presence marks a module-call function.
CLASS = PREFIX + "class"
#: Top-level package that defines the class (``transformers``).
PACKAGE = PREFIX + "package"
#: That package's installed version (``5.23.0``).
PACKAGE_VERSION = PREFIX + "package_version"
#: ``file:line`` of the class definition.
SOURCE = PREFIX + "source"
#: Call nodes: full module path of the (first) call (``h.0.attn``).
MODULE_PATH = PREFIX + "module_path"
#: Call nodes: 0 for the first call of that module instance, 1 for the second, ...
CALL_INDEX = PREFIX + "call_index"
#: Functions: JSON list of the call names of every call using this definition.
MODULE_PATHS = PREFIX + "module_paths"
#: Functions: how many calls use this definition.
CALL_COUNT = PREFIX + "call_count"
#: Functions and the main graph: JSON list of ``[call name, qualified class, n]`` for the module
#: calls made directly in this body that produced no ops (``nn.Dropout`` in eval, ``nn.Identity``);
#: they have no function and no node. The call name is relative to the body, as call node names
#: are; ``n`` is the number of calls with functions made in this body before it (its position).
NO_OP_CALLS = PREFIX + "no_op_calls"
#: torch's ``path: class/...`` chain (not ours; kept on every node).
NAMESPACE = "namespace"

#: ``meta`` key (in memory only, never saved) of an ``onnx_ir.Function``: the
#: :class:`~onnx_modular.calltree.ModuleCall` objects it serves.
CALLS = "onnx_modular.calls"

#: The keys every call node carries.
CALL_METADATA_KEYS = frozenset({MODULE_PATH, CALL_INDEX, CLASS, PACKAGE, PACKAGE_VERSION, NAMESPACE})


# -- call names ----------------------------------------------------------------------------


def call_name(path: str, index: int = 0) -> str:
    """``h.0.attn`` for a first call, ``shared@1`` for the second call of ``shared``."""
    return f"{path}@{index}" if index else path


def split_call_name(name: str) -> tuple[str, int]:
    """``"shared@1"`` -> ``("shared", 1)``; ``"h.0"`` -> ``("h.0", 0)``.

    A trailing ``@`` followed by digits is the call index; anything else is part of the path.
    """
    base, sep, index = name.rpartition("@")
    if sep and base and index.isdigit():
        return base, int(index)
    return name, 0


def strip_call_index(name: str) -> str:
    """``"shared@1"`` -> ``"shared"``."""
    return split_call_name(name)[0]


# -- reading metadata ----------------------------------------------------------------------


def props(obj: Any) -> Mapping[str, str]:
    """``metadata_props`` as a mapping, for onnx protos (a repeated field) and onnx_ir objects (a dict)."""
    entries = obj.metadata_props
    if isinstance(entries, Mapping):
        return entries
    return {entry.key: entry.value for entry in entries}


def is_module_function(function: Any) -> bool:
    """Whether a function (proto or ``onnx_ir``) is a module call's function written by onnx_modular
    (torch's own helper functions are not)."""
    return function is not None and CLASS in props(function)


def _json_list(text: str | None) -> list:
    if not text:
        return []
    try:
        decoded = json.loads(text)
    except ValueError:
        return []
    return decoded if isinstance(decoded, list) else []


def module_paths(function: Any) -> list[str]:
    """The call names a function serves (its ``module_paths`` metadata), ``[]`` when absent."""
    return [path for path in _json_list(props(function).get(MODULE_PATHS)) if isinstance(path, str)]


def body_module_path(function: Any) -> str | None:
    """The module path a function body was written for (its first call), ``None`` when unknown.

    Call nodes inside the body are named relative to this path.
    """
    paths = module_paths(function)
    return strip_call_index(paths[0]) if paths else None


def resolve_module_path(node_name: str, node_module_path: str | None, caller: str | None, body_path: str | None) -> str:
    """The full module path of a call node, resolved through its caller (no call index).

    A body shared by ``h.0`` and ``h.1`` names its nested call nodes relative to itself
    (``attn``) and records the full path of its first call (``h.0.attn``) in the node's
    ``module_path``; under the caller ``h.1`` the call is ``h.1.attn``. A node whose module
    path is not below the body's own (an instance reached through another attribute) keeps
    it. Nodes without the metadata (files of other tools) are named ``caller/node name``.

    The call index is not in the node: a body called twice (``shared``, ``shared@1``) holds
    one ``linear`` node for ``shared.linear`` and ``shared.linear@1``. Count calls per path in
    execution order (:class:`CallCounter`), as torch does.

    Args:
        node_name: The call node's name (``attn``, ``shared@1``).
        node_module_path: Its ``module_path`` metadata (``None`` for files of other tools).
        caller: The full call name of the enclosing call (``None`` in the main graph).
        body_path: :func:`body_module_path` of the enclosing function.
    """
    if node_module_path is None:
        return f"{caller}/{node_name}" if caller else node_name
    if caller is not None and body_path and (
        node_module_path == body_path or node_module_path.startswith(body_path + ".")
    ):
        return strip_call_index(caller) + node_module_path[len(body_path) :]
    return node_module_path


class CallCounter:
    """Call names in execution order: the n-th call of a module path is ``path@n``."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def __call__(self, path: str) -> str:
        index = self._counts.get(path, 0)
        self._counts[path] = index + 1
        return call_name(path, index)


def no_op_calls(body: Any) -> list[tuple[str, str, int]]:
    """``[(relative call name, qualified class, position)]`` recorded in a body's :data:`NO_OP_CALLS`."""
    return [
        (str(entry[0]), str(entry[1]), int(entry[2]))
        for entry in _json_list(props(body).get(NO_OP_CALLS))
        if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], int)
    ]


# -- the expanded calls of a file ----------------------------------------------------------


@dataclasses.dataclass
class ExpandedCall:
    """One module call in a model, with shared bodies expanded under each caller.

    Attributes:
        call_name: Full call name (``h.1.attn``, ``shared@1``).
        node: The call node (``onnx.NodeProto``).
        function: The called function (``onnx.FunctionProto``).
        depth: 1 for calls in the main graph, 2 for calls inside those, ...
        caller: The enclosing call (``None`` in the main graph).
    """

    call_name: str
    node: onnx.NodeProto
    function: onnx.FunctionProto
    depth: int
    caller: ExpandedCall | None = dataclasses.field(default=None, repr=False)


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            yield attribute.g
        elif attribute.type == onnx.AttributeProto.GRAPHS:
            yield from attribute.graphs


def expanded_calls(model: onnx.ModelProto, *, module_calls_only: bool = True) -> Iterator[ExpandedCall]:
    """Every call of a local function reachable from the main graph, in execution order.

    A function shared by N calls is expanded N times, so this counts calls, not definitions.
    Calls inside If/Loop/Scan subgraphs are included, at the depth of their node. Works on
    any ONNX model; ``module_calls_only`` keeps calls of module-call functions (torch's
    helper functions, if any survive, are skipped, their bodies not entered).

    Example::

        names = [call.call_name for call in expanded_calls(onnx.load("m.onnx"))]
    """
    functions = {(f.domain, f.name, f.overload): f for f in model.functions}
    counter = CallCounter()
    # Work items: (node iterator, caller, depth, body path); iterative, for deep files.
    stack: list[tuple[Iterator[onnx.NodeProto], ExpandedCall | None, int, str | None]] = [
        (iter(model.graph.node), None, 1, None)
    ]
    while stack:
        nodes, caller, depth, body_path = stack[-1]
        node = next(nodes, None)
        if node is None:
            stack.pop()
            continue
        subgraphs = list(_subgraphs(node))
        if subgraphs:
            # Pushed below the callee so the callee's calls come first, then the subgraphs'.
            for subgraph in reversed(subgraphs):
                stack.append((iter(subgraph.node), caller, depth, body_path))
        function = functions.get((node.domain, node.op_type, node.overload))
        if function is None or (module_calls_only and not is_module_function(function)):
            continue
        module_path = props(node).get(MODULE_PATH)
        name = resolve_module_path(
            node.name or f"<{node.op_type}>", module_path, caller.call_name if caller is not None else None, body_path
        )
        if module_path is not None:
            name = counter(name)
        call = ExpandedCall(name, node, function, depth, caller)
        yield call
        stack.append((iter(function.node), call, depth + 1, body_module_path(function)))
