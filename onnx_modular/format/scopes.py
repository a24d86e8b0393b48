"""Torch's scope metadata on a flat file's nodes, read: the modules a node ran under, outermost first.

A node of a flat export records the module calls it ran under in one of three forms:

    torch name_scopes   ``pkg.torch.onnx.name_scopes`` and ``pkg.torch.onnx.class_hierarchy``
                        (torch's dynamo exporter): Python list literals of module paths and
                        classes, root first, the FX node last
    namespace           the same chain in one string, ``: Cls/h.0: pkg.Block/add: aten.add``
    scope names         a TorchScript-era node name, ``/model/layers.0/self_attn/q_proj/MatMul``:
                        module paths only, no classes

The readers take a node's metadata (a mapping: ``onnx_ir``'s ``node.metadata_props``, or
:func:`onnx_modular.format.metadata.props` of a ``NodeProto``) or its name, and never raise on
what a file holds: unreadable metadata reads as none. Used by ``modularize`` (the call tree of
a flat file: :func:`torch_scopes`, :func:`namespace_scopes`, :func:`name_scopes`), ``diff`` (the
modules enclosing a flat copy's node: :func:`enclosing_modules`) and ``tree``/``profile`` on a flat
copy (its modules' classes: :func:`namespace_classes`). The lenient readers keep the behaviour
their tools had; each says how it differs. No torch.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping

from onnx_modular.format import metadata

__all__ = [
    "Scopes",
    "ATTRIBUTE",
    "literal_list",
    "string_list",
    "torch_chain",
    "torch_scopes",
    "namespace_scopes",
    "name_scopes",
    "enclosing_modules",
    "namespace_classes",
]

#: A node's scopes: ((module path, qualified class or ""), ...), outermost first, root excluded.
Scopes = tuple[tuple[str, str], ...]

#: One part of a module path, a module's name in its owner (``layers``, ``0``, ``self_attn``).
#: ``add_module`` takes any string without a dot, and torchvision's RegNet names its blocks
#: ``block1-0``; a part with a ``/``, a ``:`` or a space is not a module's name (``onnx::Add``).
ATTRIBUTE = re.compile(r"^[^./:\s]+$")


def literal_list(text: str | None) -> list | None:
    """A Python list literal (torch writes ``name_scopes`` so), items unchecked; ``None`` when
    empty, unreadable or not a list."""
    if not text:
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, list) else None


def string_list(text: str | None) -> list[str] | None:
    """:func:`literal_list` whose items are all strings, else ``None``."""
    value = literal_list(text)
    if value is not None and all(isinstance(item, str) for item in value):
        return value
    return None


def torch_chain(props: Mapping[str, str]) -> tuple[list, list] | None:
    """``name_scopes`` and ``class_hierarchy`` as written: two lists of one length, root first,
    the FX node last, items unchecked; ``None`` when either is missing or unreadable or their
    lengths differ."""
    paths = literal_list(props.get(metadata.NAME_SCOPES))
    classes = literal_list(props.get(metadata.CLASS_HIERARCHY))
    if paths is None or classes is None or len(paths) != len(classes):
        return None
    return paths, classes


def torch_scopes(props: Mapping[str, str]) -> Scopes | None:
    """From ``name_scopes``/``class_hierarchy``: root first, the FX node last (both dropped), empty
    paths dropped; ``None`` unless both are lists of strings of one length, at least 2."""
    chain = torch_chain(props)
    if chain is None or len(chain[0]) < 2 or not all(isinstance(item, str) for item in chain[0] + chain[1]):
        return None
    paths, classes = chain
    return tuple((path, cls) for path, cls in zip(paths[1:-1], classes[1:-1]) if path)


def namespace_scopes(props: Mapping[str, str]) -> Scopes | None:
    """From ``: pkg.Model/h.0: pkg.Block/add: aten.add.Tensor`` (root first, the FX node last);
    ``None`` when absent or when a segment between them is not ``path: class``."""
    namespace = props.get(metadata.NAMESPACE)
    if not namespace:
        return None
    segments = namespace.split("/")
    if len(segments) < 2 or ": " not in segments[0]:
        return None
    scopes = []
    for segment in segments[1:-1]:
        path, sep, cls = segment.partition(": ")
        if not sep or not path:
            return None
        scopes.append((path, cls))
    return tuple(scopes)


def name_scopes(name: str | None, weights: frozenset[str] = frozenset()) -> Scopes | None:
    """From a TorchScript node name ``/model/layers.0/self_attn/q_proj/MatMul``: module paths only.

    Each part is the module's name in its owner, an item of a container prefixed by the
    container's name: ``/model/layers.0`` (a ModuleList, not called itself) is
    ``model.layers.0``, and ``/model/seq/seq.0`` (a called Sequential, a scope of its own) is
    ``model.seq.0``. Where both readings are possible, the one that names weights of the file
    (``model.seq.0.weight``) wins, else the container's.
    """
    name = name or ""
    if not name.startswith("/"):
        return None
    parts = name.split("/")[1:-1]  # the last part names the op
    if not parts or not all(part and all(ATTRIBUTE.match(a) for a in part.split(".")) for part in parts):
        return None if name.count("/") > 1 else ()  # ``/MatMul``: a node of the root
    scopes: list[tuple[str, str]] = []
    path = ""
    for part in parts:
        nested = f"{path}.{part}" if path else part
        head = part.split(".", 1)[0]
        if "." in part and (path == head or path.endswith("." + head)):
            item = path[: len(path) - len(head)] + part  # an item of the enclosing container
            if not any(w.startswith(nested + ".") for w in weights) or any(w.startswith(item + ".") for w in weights):
                nested = item
        path = nested
        scopes.append((path, ""))
    return tuple(scopes)


def enclosing_modules(props: Mapping[str, str], path: str) -> list[tuple[str, str]]:
    """(module path, class) of the modules enclosing the module ``path`` of a flat node, outermost
    first, from its ``name_scopes`` and ``class_hierarchy`` (root and FX node excluded).

    More lenient than :func:`torch_scopes` (``diff`` reads a flat copy's nodes so): an item that is
    not a string is skipped (a path) or read as ``""`` (a class) rather than voiding the node's
    scopes.
    """
    chain = torch_chain(props)
    if chain is None:
        return []
    paths, classes = chain
    return [
        (scope, classes[index] if isinstance(classes[index], str) else "")
        for index, scope in enumerate(paths[1:-1], 1)
        if isinstance(scope, str) and path.startswith(scope + ".")
    ]


def namespace_classes(namespace: str) -> dict[str, str]:
    """torch's ``namespace`` (``: GPT2Model/h.1: GPT2Block/h.1.attn: GPT2Attention/...``) -> {path: class}.

    Every ``path: class`` segment counts, the root's (``""``) and the FX node's included, and a
    malformed segment is skipped (:func:`namespace_scopes` refuses the whole chain instead): the
    classes of a flat copy's modules (:func:`onnx_modular.calls.tree.module_path_tree`).
    """
    classes = {}
    for scope in namespace.split("/"):
        path, sep, cls = scope.partition(": ")
        if sep:
            classes[path] = cls
    return classes
