"""``modularize``: rebuild the module hierarchy of a flat ONNX file someone else exported.

A flat file still carries its module structure, in one of three forms (read in this order):

    torch name_scopes   torch's dynamo exporter (the default since torch 2.9) writes
                        ``pkg.torch.onnx.name_scopes`` and ``pkg.torch.onnx.class_hierarchy`` on
                        every node: module paths and classes, root first, the FX node last
    namespace           the same chain in one string, ``: Cls/h.0: pkg.Block/add: aten.add``
                        (Model Explorer's key; some tools keep only this one)
    scope names         TorchScript-era exporters (and Optimum's exports made with them) name
                        nodes by scope: ``/model/layers.0/self_attn/q_proj/MatMul``; module
                        paths only, no classes

Each is translated into what the export pipeline's own passes read: a
:class:`~onnx_modular.format.calltree.CallTree` and each main-graph node's stack of call keys.
Then ``passes/pipeline.modularize_passes`` (helper inlining, outlining, dedupe, naming) runs as in
``export_modular``: weights are passed into the calls as formal inputs, identical bodies are
shared (dedupe compares bodies, not names), a module whose nodes are interleaved with another's
is made convex the same way. Classes known: domain ``pkg.<package>`` (the top of the class's
module path), with the version when the file tells it (torch's own classes: the producer's
version), else ``unknown``. Scope names only: domain ``pkg.unknown``, functions named after the
path's last attribute (``layers.0`` -> ``layers``, ``self_attn``), class left empty.

The weights are never loaded: external data is read through onnx_ir's lazy tensors one at a
time while the new file is written, and onnxruntime runs both files from their folders. The
written file is verified against the flat one on the same inputs (given, or random from the
input types) inside the atomic save: a mismatch leaves nothing behind.

Example::

    report = modularize("gpt2.flat.onnx", "gpt2.onnx")
    print(report)      # calls, functions, nodes moved into calls / left for lack of a scope, parity
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from onnx_modular.calls import inferred
from onnx_modular.calls.tree import count_from_ir
from onnx_modular.check.parity import ParityReport, Tolerance, compare_outputs
from onnx_modular.errors import InvalidInputError, InvalidModelFileError, ParityError
from onnx_modular.format import metadata
from onnx_modular.format.calltree import CallTree, ModuleCall
from onnx_modular.format.text import shown
from onnx_modular.passes import pipeline
from onnx_modular.runtime import inputs as runtime_inputs
from onnx_modular.runtime import sessions
from onnx_modular.storage import save
from onnx_modular.storage.limits import check_count
from onnx_modular.storage.load import load_model_file
from onnx_modular.storage.proto import uses_external_data

__all__ = ["ModularizeReport", "modularize", "file_stacks", "SOURCES", "INFERRED_SOURCE", "DEFAULT_TOLERANCE"]

#: Where a call tree can come from, in the order they are looked for.
SOURCES = ("torch name_scopes", "namespace", "scope names")
#: Outlining moves nodes, it does not change them: the outputs must agree to this (float32).
DEFAULT_TOLERANCE = Tolerance(atol=1e-6, rtol=0.0)

#: One attribute of a module path (``layers``, ``0``, ``self_attn``); TorchScript scopes use
#: the attribute names, so anything else in a ``/``-separated name is not a scope.
_ATTRIBUTE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$|^[0-9]+$")

#: A node's scopes: ((module path, qualified class or ""), ...), outermost first, root excluded.
Scopes = tuple[tuple[str, str], ...]


@dataclasses.dataclass
class ModularizeReport:
    """What :func:`modularize` did.

    Attributes:
        path: The modular file written (``None`` when nothing was written).
        source: Which of :data:`SOURCES` the call tree came from.
        tree: The call tree of the written file (counts from the final model).
        calls: Module calls outlined into functions.
        functions: Distinct functions in the file (after dedupe).
        max_depth: Deepest nesting of calls.
        nodes: Main-graph nodes of the flat file.
        nodes_in_calls: Nodes that went into calls.
        nodes_in_parent: Nodes that stayed in the main graph.
        unscoped: Of those, the nodes that carried no scope at all (an optimizer's constants,
            names that are not scopes); the others belong to the root module.
        unscoped_total: Nodes of the flat file without a scope; those between the nodes of one
            call (reading from it and feeding it) went into it, as export places such nodes.
        parity: The modular file against the flat one in onnxruntime.
        inferred: The repeats found by structure (``calls/inferred.py``) when calls were
            inferred (``source`` is :data:`INFERRED_SOURCE`, or a file with unscoped runs).
        absorbed: Calls with nodes but no function of their own (their nodes inside another call).
        unrecovered: What a flat file could not give back, one line each: a call whose body took
            in nodes of other scopes between its own (a module called more than once: its calls
            are merged into one; or code interleaved with it), and a module whose weights are in
            the file but that has no node of its own (torch's optimizer fused it into another
            module's node, Conv+BatchNorm, or folded it). A module whose every node was folded
            into constants leaves no trace in the file and cannot be listed.
    """

    path: pathlib.Path | None
    source: str
    tree: CallTree
    calls: int
    functions: int
    max_depth: int
    nodes: int
    nodes_in_calls: int
    nodes_in_parent: int
    unscoped: int
    unscoped_total: int
    parity: ParityReport | None
    absorbed: list[str] = dataclasses.field(default_factory=list)
    inferred: inferred.Inference | None = None
    unrecovered: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [
            f"call tree from {self.source}: {_count(self.calls, 'module call')}, {_count(self.functions, 'function')}, "
            f"nested {self.max_depth} deep",
            f"nodes: {self.nodes} in the flat file, {self.nodes_in_calls} went into calls, "
            f"{self.nodes_in_parent} stayed in the main graph ({self.unscoped} of them for lack of a scope)",
        ]
        if self.unscoped_total > self.unscoped:
            moved = self.unscoped_total - self.unscoped
            lines.append(f"{_count(moved, 'node')} without a scope went into the call whose nodes surround them")
        if self.absorbed:
            lines.append(
                f"{_count(len(self.absorbed), 'call')} without a function of its own, its nodes inside another call "
                f"(interleaved scopes, or a module called twice): {', '.join(shown(p) for p in self.absorbed[:8])}"
                + (" ..." if len(self.absorbed) > 8 else "")
            )
        if self.inferred is not None:
            lines += _inferred_lines(self.inferred)
        if self.unrecovered:
            lines.append(f"not recovered from the flat file ({len(self.unrecovered)}):")
            lines += [f"  {line}" for line in self.unrecovered[:12]]
            if len(self.unrecovered) > 12:
                lines.append(f"  ... and {len(self.unrecovered) - 12} more (report.unrecovered)")
        if self.parity is not None:
            lines.append(str(self.parity))
        if self.path is not None:
            lines.append(f"wrote {shown(str(self.path))}")
        return "\n".join(lines)


def _inferred_lines(found: inferred.Inference) -> list[str]:
    lines = []
    for region in found.regions:
        parts = ", ".join(f"{part} ({end - start})" for start, end, part in region.parts)
        lines.append(
            f"inferred: {region.count} copies of a {region.length}-node block ({region.name}.0 ... "
            f"{region.name}.{region.count - 1})" + (f", parts {parts}" if parts else "")
        )
    lines.append(f"{found.covered} of the {found.skeleton} nodes that depend on an input are in repeated blocks")
    return lines


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


# -- reading the scopes ------------------------------------------------------------------------


def _literal_list(text: str | None) -> list[str] | None:
    if not text:
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    return None


def _torch_scopes(node: ir.Node) -> Scopes | None:
    """From ``name_scopes``/``class_hierarchy``: root first, the FX node last (both dropped)."""
    paths = _literal_list(node.metadata_props.get(metadata.NAME_SCOPES))
    classes = _literal_list(node.metadata_props.get(metadata.CLASS_HIERARCHY))
    if paths is None or classes is None or len(paths) != len(classes) or len(paths) < 2:
        return None
    return tuple((path, cls) for path, cls in zip(paths[1:-1], classes[1:-1]) if path)


def _namespace_scopes(node: ir.Node) -> Scopes | None:
    """From ``: pkg.Model/h.0: pkg.Block/add: aten.add.Tensor`` (root first, the FX node last)."""
    namespace = node.metadata_props.get(metadata.NAMESPACE)
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


def _name_scopes(node: ir.Node, weights: frozenset[str] = frozenset()) -> Scopes | None:
    """From a TorchScript node name ``/model/layers.0/self_attn/q_proj/MatMul``: module paths only.

    Each part is the module's name in its owner, an item of a container prefixed by the
    container's name: ``/model/layers.0`` (a ModuleList, not called itself) is
    ``model.layers.0``, and ``/model/seq/seq.0`` (a called Sequential, a scope of its own) is
    ``model.seq.0``. Where both readings are possible, the one that names weights of the file
    (``model.seq.0.weight``) wins, else the container's.
    """
    name = node.name or ""
    if not name.startswith("/"):
        return None
    parts = name.split("/")[1:-1]  # the last part names the op
    if not parts or not all(part and all(_ATTRIBUTE.match(a) for a in part.split(".")) for part in parts):
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


_READERS = {"torch name_scopes": _torch_scopes, "namespace": _namespace_scopes, "scope names": _name_scopes}


def file_stacks(model: ir.Model) -> tuple[str, dict[ir.Node, Scopes | None]]:
    """The first of :data:`SOURCES` the main graph's nodes carry, and each node's scopes by it
    (``None``: the node carries none).

    Raises:
        InvalidModelFileError: No node carries any, or the file is modular already.
    """
    found = _recorded_stacks(model)
    if found is None:
        raise _no_scopes(len(model.graph))
    return found


def _recorded_stacks(model: ir.Model) -> tuple[str, dict[ir.Node, Scopes | None]] | None:
    ours = [f.name for f in model.functions.values() if metadata.is_module_function(f)]
    if ours:
        raise InvalidModelFileError(
            f"The file is modular already: it has module functions ({', '.join(shown(n) for n in ours[:3])}).",
            hint="Run `onnx-modular tree` on it; to start again from a flat copy, run `onnx-modular inline` first.",
        )
    nodes = list(model.graph)
    weights = frozenset(model.graph.initializers)
    for source, reader in _READERS.items():
        stacks = {node: reader(node, weights) if reader is _name_scopes else reader(node) for node in nodes}
        # A source counts when it places some node under a module, not only under the root.
        if any(stack for stack in stacks.values()):
            return source, stacks
    return None


def _no_scopes(nodes: int, repeats: bool | None = None) -> InvalidModelFileError:
    """No scopes recorded (and, when ``repeats`` is False, no block that repeats either)."""
    message = (
        f"The file carries no module scopes: none of its {nodes} main-graph nodes has torch's "
        f"{metadata.NAME_SCOPES!r} and {metadata.CLASS_HIERARCHY!r}, a {metadata.NAMESPACE!r} "
        "chain, or a TorchScript scope name ('/model/layers.0/self_attn/MatMul')"
    )
    if repeats is False:
        message += (
            f", and no block of {inferred.MIN_BLOCK_NODES} nodes or more repeats in its graph "
            "(same ops, attributes, shapes and weight shapes, back to back), so no call can be inferred."
        )
        hint = ("The file has nothing to share; to outline it anyway, export the model with "
                "onnx_modular.export_modular if you have the PyTorch model.")
    else:
        message += "."
        hint = ("Export the model with torch.onnx.export(..., dynamo=True) (which records them), or with "
                "onnx_modular.export_modular if you have the PyTorch model; --infer auto (infer='auto') "
                "infers calls from repeated blocks.")
    return InvalidModelFileError(message, hint=hint)


#: ``report.source`` of a call tree inferred from the graph's structure (no scopes recorded).
INFERRED_SOURCE = "structure (inferred)"
# -- the call tree -----------------------------------------------------------------------------


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


def _build_tree(
    stacks: Mapping[ir.Node, Scopes | None], root_class: str, torch_version: str | None
) -> tuple[CallTree, dict[ir.Node, tuple[str, ...]]]:
    """The tree (keys are module paths: a file does not tell a module's repeated calls apart) and
    each node's call keys."""
    package, version = _package(root_class, torch_version)
    root = ModuleCall("", "", 0, root_class, package, version)
    by_path: dict[str, ModuleCall] = {}
    keys: dict[ir.Node, tuple[str, ...]] = {}
    for node, scopes in stacks.items():
        if not scopes:
            continue
        parent = root
        for path, cls in scopes:
            call = by_path.get(path)
            if call is None:
                package, version = _package(cls, torch_version)
                call = ModuleCall(path, path, 0, cls, package, version, parent=parent, name_hint="" if cls else _name_hint(path))
                parent.children.append(call)
                by_path[path] = call
            parent = call
        keys[node] = tuple(path for path, _ in scopes)
    return CallTree(root), keys


def _selected(tree: CallTree, modules: str | int | Iterable[str] | None) -> set[str]:
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
#: and ``<node>/<input>``, TorchScript ``onnx::MatMul_<n>`` and ``/model/Constant_output_0``.
_CONSTANT_NAME = re.compile(r"^val_\d+$|/|::")


def _constants(model: ir.Model, tree: CallTree, *, inferred_only: bool = False) -> list[str]:
    """The initializers that are an exporter's constants, not a module's weights.

    Listed in :data:`~onnx_modular.format.metadata.LIFTED_CONSTANTS` as our exports list theirs:
    ``tree`` does not count them as parameters, ``view`` shows them inside the bodies. A weight is
    named ``<module path>.<attribute>`` (the state dict's name); an integer, boolean or scalar
    tensor named by the exporter's own patterns, not under a module path, is a constant.
    """
    paths = {call.module_path for call in tree.walk() if call.module_path}
    constants = []
    for name, value in model.graph.initializers.items():
        # Inferred calls have no module paths, and a stripped file's names say nothing: by value only.
        if not inferred_only and (name.rpartition(".")[0] in paths or not _CONSTANT_NAME.search(name)):
            continue
        # An optimizer's fold of weights is named like a constant (torch's ``val_308``, the
        # transposed tied ``lm_head.weight``): float tensors count as weights, scalars do not.
        size = math.prod(value.shape.numpy()) if value.shape is not None and value.shape.is_static() else None
        if value.dtype is not None and value.dtype.is_floating_point() and (size is None or size > 1):
            continue
        constants.append(name)
    return constants


def _torch_version(model: ir.Model) -> str | None:
    return model.producer_version.split("+", 1)[0] if model.producer_name == "pytorch" else None


def _root_class(model: ir.Model) -> str:
    root_class = next(
        (classes[0] for node in model.graph if (classes := _literal_list(node.metadata_props.get(metadata.CLASS_HIERARCHY)))),
        "",
    )
    if not root_class:
        root_class = next(
            (seg.partition(": ")[2] for node in model.graph
             if (seg := (node.metadata_props.get(metadata.NAMESPACE) or "").split("/")[0]).startswith(": ")),
            "",
        )
    return root_class


def _weightless_modules(model: ir.Model, tree: CallTree, keys: Mapping[ir.Node, tuple[str, ...]]) -> list[str]:
    """Modules whose weights (``<path>.<attribute>`` initializers) are in the file but that have
    no node: their ops were fused into another module's node or folded (before outlining)."""
    paths = {call.module_path for call in tree.walk() if call.module_path}
    lost: dict[str, list[str]] = {}
    readers: dict[str, set[str]] = {}
    for name, value in model.graph.initializers.items():
        path = name.rpartition(".")[0]
        if not path or path in paths or not all(_ATTRIBUTE.match(part) for part in path.split(".")):
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


def _merged_calls(model: ir.Model, tree: CallTree, scopes: Mapping[ir.Node, Scopes | None]) -> list[str]:
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
            if (stack := scopes.get(node)) is not None and not own & {path for path, _ in stack}
        })
        if foreign:
            reported |= own
            names = ", ".join(shown(key or "<root>") for key in foreign[:3]) + (" ..." if len(foreign) > 3 else "")
            lines.append(
                f"{calls[0].call_name}: its body took in nodes of {names} that run between its own: a module called "
                "more than once (its calls merged into one; a flat file does not tell them apart) or code interleaved with it"
            )
    return lines


def _domain(call: ModuleCall) -> str:
    if call.version and call.version != metadata.UNKNOWN_PACKAGE:
        return f"pkg.{call.package}.{call.version}"
    return f"pkg.{call.package}"


# -- the tool ----------------------------------------------------------------------------------


def modularize(
    path: str | os.PathLike,
    output: str | os.PathLike,
    *,
    dedupe: bool = True,
    modules: str | int | Sequence[str] | None = "all",
    inputs: str | os.PathLike | Mapping[str, np.ndarray] | None = None,
    tolerance: Tolerance | None = None,
    verify: bool = True,
    execution_provider: str | None = None,
    infer: str = "auto",
    output_names: Sequence[str] | None = None,
) -> ModularizeReport:
    """Rebuild the module hierarchy of the flat ONNX file ``path`` into ``output``.

    Args:
        path: A flat ONNX file (torch's dynamo exporter, or named by scope as TorchScript-era
            exporters and Optimum name nodes).
        output: The modular file to write (atomically; its weights external when ``path``'s are).
        dedupe: Share one function among identical calls (the layers of a stack).
        modules: Which calls become functions: ``"all"``, a maximum depth (1: the root's
            children), or class names/globs (``GPT2Block``, ``*Attention``; scope-named files:
            the function names, ``layers``, ``self_attn``). The others stay inline in their parent.
        inputs: Inputs for the check (an ``.npz`` file or arrays by name); random from the
            declared input types by default.
        tolerance: Of the check, modular against flat; default ``atol=1e-6``.
        verify: Run the check (the file is written only when it passes).
        execution_provider: onnxruntime's provider for the check (CPU by default).
        infer: ``"auto"``: where the file records no scopes (all of it, or runs of nodes of a file
            that has them elsewhere), infer calls from repeated blocks (``calls/inferred.py``);
            ``"always"``: infer even where scopes are recorded; ``"never"``: recorded scopes only.
        output_names: New names of the graph outputs, in order, as ``torch.onnx.export``'s
            ``output_names`` gives them (``["logits", ...]``): torch's file names them after
            the graph's last nodes (``linear_28``), since it keeps no forward() return names.

    Returns:
        A :class:`ModularizeReport`.

    Raises:
        InvalidModelFileError: ``path`` is not a readable ONNX file, carries no scopes, or is
            modular already. Nothing is written.
        InvalidInputError: A bad ``modules``, ``inputs`` or ``output``.
        ModularizeError: A module's nodes cannot be outlined (named by its path).
        ParityError: The modular file's outputs differ from the flat file's; nothing written.
    """
    source_path = pathlib.Path(path)
    destination = save.check_destination(output, reads=[path])
    if destination.resolve() == source_path.resolve():
        raise InvalidInputError(
            f"The output {shown(str(output))} is the input file.", hint="Write the modular file to another path."
        )
    proto = load_model_file(source_path, values=False)  # the checks; weights not read
    external = uses_external_data(proto)
    feeds = runtime_inputs.feeds_for(proto, inputs) if verify else None
    del proto
    model = ir.load(str(source_path))  # external weights stay on disk (lazy tensors)
    _rename_outputs(model, output_names)
    if infer not in ("auto", "always", "never"):
        raise InvalidInputError(f"infer must be 'auto', 'always' or 'never', got {infer!r}.")
    found = _recorded_stacks(model)  # refuses a modular file, whatever ``infer`` says
    inference = None
    if found is None or infer == "always":
        if infer == "never":
            raise _no_scopes(len(model.graph))
        # Shapes first: the signatures compare them (TorchScript-era files declare few).
        if any(value.shape is None or value.type is None for node in model.graph for value in node.outputs):
            common_passes.ShapeInferencePass(strict_mode=False)(model)
        inference = inferred.infer_calls(model)
        keys = inference.keys
        if not inference.regions and found is not None:
            raise InvalidModelFileError(
                f"No block of {inferred.MIN_BLOCK_NODES} nodes or more repeats in the graph of {shown(str(source_path))} "
                "(same ops, attributes, shapes and weight shapes, back to back): infer='always' finds no call.",
                hint="The file records module scopes: run with infer='auto' (--infer auto) to use them.",
            )
        if not inference.regions:
            raise _no_scopes(len(model.graph), repeats=False)
        source, tree = INFERRED_SOURCE, inference.tree
        scopes = {node: None for node in model.graph if node not in keys}
    else:
        source, scopes = found
        tree, keys = _build_tree(scopes, _root_class(model), _torch_version(model))
        if infer == "auto" and any(stack is None for stack in scopes.values()):
            inference = inferred.infer_calls(model, subset=inferred.unscoped_runs(model, scopes))
            more = inference.keys
            if inference.regions and not any(call.key in tree for call in inference.tree.walk() if not call.is_root):
                tree = inferred.merged(tree, inference.tree, keys, more, model)
                keys.update(more)
                scopes.update(dict.fromkeys(more, ()))
            else:
                inference = None
    check_count("MAX_MODULES", sum(1 for _ in tree.walk()) - 1, "its module calls", from_file=shown(str(source_path)))
    selected = _selected(tree, modules)
    nodes = len(model.graph)
    unscoped_nodes = {node for node, stack in scopes.items() if stack is None}

    weightless = _weightless_modules(model, tree, keys)
    passes = pipeline.modularize_passes(
        stacks=keys, selected=selected, tree=tree, signatures={}, dedupe=dedupe, domain_of=_domain
    )
    # Types and shapes of the values the file leaves undeclared (TorchScript exports declare few):
    # dedupe compares the bodies' input and output shapes, and an unknown one differs from any.
    # onnx_ir runs onnx's inference without the initializers' values; a failure leaves the model as it is.
    if source != INFERRED_SOURCE:  # the inferred mode ran it before its search (where shapes lacked)
        passes.insert(0, common_passes.ShapeInferencePass(strict_mode=False))
    try:
        pipeline.run(passes, model)
    except ir.passes.PreconditionError as e:
        raise InvalidModelFileError(
            f"{shown(str(source_path))} cannot be modularized: {e}",
            hint="Sort the graph topologically (onnx_ir's TopologicalSortPass) and try again.",
        ) from e
    model.metadata_props[metadata.MODULARIZED_FROM] = source if inference is None or source == INFERRED_SOURCE else (
        f"{source} + {INFERRED_SOURCE}"
    )
    if inference is not None:
        inferred.mark_inferred(model, inference)
    constants = _constants(model, tree, inferred_only=source == INFERRED_SOURCE)
    if constants:
        model.metadata_props[metadata.LIFTED_CONSTANTS] = json.dumps(constants)
    functions = {call.function for call in tree.walk() if call.function is not None}
    scoped = {key for stack in keys.values() for key in stack}  # the calls that had nodes
    stayed = [node for node in model.graph if node.op_identifier() not in model.functions]
    count_from_ir(tree, model)

    parity = None
    with save.staged_save(model, destination, external_data=True if external else None) as staged:
        if verify:
            parity = _check(source_path, staged, feeds, tolerance or DEFAULT_TOLERANCE, execution_provider)
    return ModularizeReport(
        path=destination,
        source=source,
        tree=tree,
        calls=sum(1 for call in tree.walk() if call.function is not None),
        functions=len(functions),
        max_depth=tree.max_depth,
        nodes=nodes,
        nodes_in_calls=max(nodes - len(stayed), 0),
        nodes_in_parent=len(stayed),
        unscoped=sum(1 for node in stayed if node in unscoped_nodes),
        unscoped_total=len(unscoped_nodes),
        absorbed=[call.call_name for call in tree.walk() if call.key in scoped and call.selected and call.function is None],
        parity=parity,
        inferred=inference,
        unrecovered=_merged_calls(model, tree, scopes) + weightless,
    )


def _rename_outputs(model: ir.Model, names: Sequence[str] | None) -> None:
    """Give the graph outputs ``names`` (in order); refused before anything is written when the
    count differs, a name repeats or is taken by another value, or an output is a graph input or
    a weight (renaming it would rename that too)."""
    if names is None:
        return
    names = list(names)
    outputs = list(model.graph.outputs)
    if len(names) != len(outputs) or len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise InvalidInputError(
            f"output_names needs {len(outputs)} distinct names, one per output ({', '.join(v.name or '?' for v in outputs)}); "
            f"got {names!r}.",
            hint="Give one name per graph output, in order: --output-names logits,present.0.key,...",
        )
    taken = {v.name for v in model.graph.inputs} | set(model.graph.initializers)
    for node in model.graph:
        taken |= {v.name for v in node.outputs if v is not None and v not in outputs}
    clash = sorted(set(names) & taken)
    plain = [v.name for v in outputs if v.is_graph_input() or v.is_initializer()]
    if clash or plain:
        raise InvalidInputError(
            (f"output_names {clash} are names of other values of the file." if clash else "")
            + (f" Outputs {plain} are graph inputs or weights, which keep their names." if plain else ""),
            hint="Choose other names, or keep the file's.",
        )
    for value, name in zip(outputs, names):
        value.name = name


def _check(flat: pathlib.Path, staged: pathlib.Path, feeds, tolerance: Tolerance, execution_provider) -> ParityReport:
    """The staged modular file against the flat one, in onnxruntime on the same feeds (the outputs
    matched by position: ``output_names`` renames them)."""
    names, expected = sessions.run(flat, feeds, what="flat file", execution_provider=execution_provider)
    got_names, got = sessions.run(staged, feeds, what="modular file", execution_provider=execution_provider)
    if len(got_names) != len(names):
        raise ParityError(
            f"The modular file's outputs {got_names} are not the flat file's {names}.",
            hint="This is a bug in onnx_modular's outlining; please report it with the file.",
        )
    report = compare_outputs(got_names, got, None, expected, reference_name="flat file", tolerance=tolerance)
    if not report.ok:
        raise ParityError(
            f"The modular file differs from the flat file beyond atol={tolerance.atol}, rtol={tolerance.rtol}; "
            f"nothing was written.\n{report}",
            report=report,
            hint="Report the file; keep the flat file, or pass modules= to outline fewer modules.",
        )
    return report
