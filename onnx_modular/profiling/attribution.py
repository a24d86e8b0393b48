"""Which module call each node onnxruntime runs came from: a tagged inlined copy, then the optimized graph.

onnxruntime inlines every local function when it creates a session and names the inlined
nodes after the function and a global counter (``_inlfunc_Conv1D_token_12_node_addmm``); the
call node's name, the module path, is dropped. Replaying that counter would tie the profile
to one onnxruntime release. Instead the profiler runs a copy of the file that is already
flat, built so that every node's call is known by construction (:func:`tagged_copy`):

1. every expanded call (a body shared by N calls counts N times, as in
   :func:`onnx_modular.format.metadata.expanded_calls`) gets a private copy of its function, and the
   call node in its caller's copy is pointed at it;
2. every other node is tagged (node metadata) with the call whose copy holds it;
3. ``onnx.inliner`` inlines the copies (it keeps node metadata) and each node is renamed
   ``<call name>/<node name>`` from its tag, a name unique in the flat graph.

onnxruntime then runs the same kernels as for the modular file (it inlines the same bodies
before optimizing; ``tests/test_profile.py`` compares the kernel sequences). Its graph
optimizations rewrite that graph: nodes keep their names, or are removed, or are replaced by
new nodes (fusions, layout changes). :func:`attribute` reads the optimized graph onnxruntime
saves and gives every node of it a call:

- a node whose name is one of the copy's: the call it was tagged with (``kind="node"``);
- a new node whose outputs replace values the copy computed: its *parts* are the removed
  nodes that computed them, followed back to the new node's inputs; it belongs to the
  innermost call containing all its parts, constants folded into it aside (``kind="fused"``; ``crosses`` when the parts lie in
  more than one call, e.g. a ``SkipLayerNormalization`` of a block's residual ``Add`` and the
  next module's ``LayerNormalization``);
- a node onnxruntime inserted without replacing any (a ``Transpose`` from layout
  propagation, a copy between devices): the innermost call containing its neighbours, the
  nodes it reads from and feeds (``kind="inserted"``).

onnxruntime leaves some nodes it makes without a name (the ``Cast`` of a folded constant, a
scalar or a norm's reshaped weight): its profiler names their kernels ``<op>_<node index>``,
an index the saved graph does not hold. They are attributed as above and kept per op type with
their input shapes (:class:`Attributions`); a kernel of that form is matched to them by op type,
then by input shapes, then charged to the innermost call holding all that remain.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping

import onnx
import onnx.inliner

from onnx_modular.errors import InvalidModelFileError
from onnx_modular.format import metadata
from onnx_modular.format.calltree import CallTree, ModuleCall
from onnx_modular.format.text import first_line
from onnx_modular.storage.proto import all_nodes, function_id, inline_functions, node_id, shown, subgraphs

__all__ = ["NodeOrigin", "Attribution", "Attributions", "tagged_copy", "attribute", "innermost_common"]

_TAG = metadata.PROFILE_ORIGIN


@dataclasses.dataclass(frozen=True)
class NodeOrigin:
    """Where a node of the tagged copy comes from.

    Attributes:
        call: The call's key (``h.3.attn.c_attn``; ``""`` for the main graph).
        node_name: The node's name in the function body (or the main graph).
        op_type: Its operator (``domain:op`` outside the default domain).
    """

    call: str
    node_name: str
    op_type: str


@dataclasses.dataclass(frozen=True)
class Attribution:
    """The call a node of the optimized graph belongs to.

    Attributes:
        call: The call's key (``""`` for the main graph).
        kind: ``"node"`` (a node of the copy, perhaps rewritten in place), ``"fused"`` (a new
            node replacing ``parts``) or ``"inserted"`` (a new node replacing none).
        parts: Names (in the tagged copy) of the nodes a fused node replaced.
        crosses: The parts lie in more than one call (a fusion across a module boundary).
    """

    call: str
    kind: str = "node"
    parts: tuple[str, ...] = ()
    crosses: bool = False


def _op_label(node: onnx.NodeProto) -> str:
    return f"{node.domain}:{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type


def _call_nodes_in_order(nodes, local: Mapping) -> Iterator[onnx.NodeProto]:
    """The local-function call nodes of a body in the order :func:`metadata.expanded_calls`
    visits them: a node, then its subgraphs (first attribute first), then the next node."""
    stack = [iter(nodes)]
    while stack:
        node = next(stack[-1], None)
        if node is None:
            stack.pop()
            continue
        if node_id(node) in local:
            yield node
        for graph in reversed(list(subgraphs(node))):
            stack.append(iter(graph.node))


def tagged_copy(
    model: onnx.ModelProto, main_calls: Callable[[onnx.NodeProto], str | None] | None = None
) -> tuple[onnx.ModelProto, dict[str, NodeOrigin]]:
    """A flat copy of ``model`` whose node names say which call each node comes from.

    Weights are not read: external-data references stay as they are. ``main_calls``: the call of
    a main-graph node (``None``: the main graph's own), for a flat file whose nodes record the
    module they came from (:func:`onnx_modular.calls.tree.node_call`).

    Returns:
        (the inlined copy, origin of each of its nodes by node name). Names are
        ``<call name>/<node name>`` (main-graph nodes keep their name), made unique with
        ``#N`` where a body holds two nodes of one name.

    Raises:
        InvalidModelFileError: ``onnx.inliner`` cannot inline the model.
    """
    local = {function_id(f): f for f in model.functions}
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    del copy.functions[:]
    origins: list[NodeOrigin] = []

    def tag(nodes, call: str, calls=None) -> None:
        for node in all_nodes(nodes):
            if node_id(node) in local:
                continue
            origin = NodeOrigin((calls(node) if calls else None) or call, node.name, _op_label(node))
            entry = node.metadata_props.add()
            entry.key, entry.value = _TAG, str(len(origins))
            origins.append(origin)

    tag(copy.graph.node, "", main_calls)  # before its call nodes point at the private copies
    used = {f.name for f in model.functions}
    # Per body (the main graph, or a call's private copy): its call nodes still to be assigned.
    pending: dict[int | None, Iterator[onnx.NodeProto]] = {None: _call_nodes_in_order(copy.graph.node, local)}
    specialized: list[onnx.FunctionProto] = []
    for number, call in enumerate(metadata.expanded_calls(model, module_calls_only=False)):
        site = next(pending[None if call.caller is None else id(call.caller)], None)
        expected = call.node
        if site is None or (site.name, site.op_type, site.domain, list(site.input)) != (
            expected.name, expected.op_type, expected.domain, list(expected.input)
        ):  # the two walks disagree: a bug here, never a silent misattribution
            raise AssertionError(f"call sites out of step at {call.call_name!r}")
        body = onnx.FunctionProto()
        body.CopyFrom(call.function)
        name = f"{call.function.name}.call{number}"
        while name in used:
            name += "_"
        used.add(name)
        body.name = name
        site.op_type = name
        pending[id(call)] = _call_nodes_in_order(body.node, local)
        tag(body.node, call.call_name)
        specialized.append(body)
    copy.functions.extend(specialized)
    try:
        flat = inline_functions(copy)
    except (onnx.checker.ValidationError, RuntimeError) as e:
        raise InvalidModelFileError(
            f"onnx.inliner cannot inline the model: {shown(first_line(e))}",
            hint="Check the file with `onnx-modular tree` and `onnx-modular verify`.",
        ) from e
    by_name: dict[str, NodeOrigin] = {}
    for node in all_nodes(flat.graph.node):
        index = next((int(entry.value) for entry in node.metadata_props if entry.key == _TAG), None)
        if index is None:
            raise AssertionError(f"node {node.name!r} lost its origin while inlining")
        origin = origins[index]
        base = origin.node_name or origin.op_type
        name = f"{origin.call}/{base}" if origin.call else base
        unique, count = name, 1
        while unique in by_name:
            count += 1
            unique = f"{name}#{count}"
        node.name = unique
        del node.metadata_props[:]  # onnxruntime does not read them; smaller to parse
        by_name[unique] = origin
    return flat, by_name


def innermost_common(tree: CallTree, keys) -> str:
    """The key of the innermost call containing every call in ``keys`` (``""``: the main graph)."""
    chains = []
    for key in keys:
        chain: list[ModuleCall] = []
        node = tree[key] if key in tree else tree.root
        while node is not None:
            chain.append(node)
            node = node.parent
        chains.append(chain[::-1])
    if not chains:
        return tree.root.key
    common = tree.root
    for level in zip(*chains):
        if any(item is not level[0] for item in level):
            break
        common = level[0]
    return common.key


#: A profiler's name for the kernel of an unnamed node: ``<op type>_<node index>``.
_UNNAMED_KERNEL = re.compile(r"(?P<op>[A-Za-z][A-Za-z0-9]*)_(?P<index>\d+)")


class Attributions(dict):
    """Node name -> :class:`Attribution`, and the unnamed nodes of the optimized graph, per op
    type: ``(attribution, input shapes or None)`` (:meth:`unnamed_kernel`)."""

    def __init__(self, tree: CallTree) -> None:
        super().__init__()
        self.tree = tree
        self.unnamed: dict[str, list[tuple[Attribution, tuple | None]]] = {}

    def unnamed_kernel(self, name: str, op_type: str, input_shapes: tuple | None = None) -> Attribution | None:
        """The attribution of a kernel onnxruntime named ``<op>_<index>`` (an unnamed node)."""
        match = _UNNAMED_KERNEL.fullmatch(name)
        if match is None or match["op"] != (op_type or match["op"]):
            return None
        candidates = self.unnamed.get(match["op"], [])
        if input_shapes is not None:
            fitting = [c for c in candidates if c[1] is None or c[1] == input_shapes]
            candidates = fitting or candidates
        if not candidates:
            return None
        calls = {c[0].call for c in candidates}
        if len(calls) == 1:
            return candidates[0][0]
        kinds = {c[0].kind for c in candidates}
        return Attribution(innermost_common(self.tree, calls), kinds.pop() if len(kinds) == 1 else "fused", (), True)


def _known_shapes(graph: onnx.GraphProto) -> dict[str, tuple[int, ...]]:
    """Value name -> shape, where the graph says (initializers, value_info, inputs)."""
    known = {t.name: tuple(t.dims) for t in graph.initializer}
    for value in (*graph.value_info, *graph.input):
        dims = value.type.tensor_type.shape.dim
        if value.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            known.setdefault(value.name, tuple(d.dim_value for d in dims))
    return known


def _input_shapes(node: onnx.NodeProto, known: Mapping[str, tuple[int, ...]]) -> tuple | None:
    """The shapes of ``node``'s inputs; ``None`` if any is unknown."""
    shapes = tuple(known.get(v) for v in node.input if v)
    return None if any(s is None for s in shapes) else shapes


def _replaced(node: onnx.NodeProto, producer: Mapping[str, str], removed: set[str], copy_nodes: Mapping) -> list[str]:
    """A new node's parts: the removed nodes that computed its outputs, back to its inputs."""
    boundary = set(node.input)
    parts: list[str] = []
    seen: set[str] = set()
    work = [producer[v] for v in node.output if v in producer and producer[v] in removed]
    while work:
        name = work.pop()
        if name in seen:
            continue
        seen.add(name)
        parts.append(name)
        for value in copy_nodes[name].input:
            if value and value not in boundary and producer.get(value) in removed:
                work.append(producer[value])
    return parts


def attribute(
    copy: onnx.ModelProto, origins: Mapping[str, NodeOrigin], optimized: onnx.ModelProto, tree: CallTree
) -> Attributions:
    """The call of every node of ``optimized``, the graph onnxruntime made of ``copy`` (by node
    name; its unnamed nodes in :attr:`Attributions.unnamed`)."""
    producer: dict[str, str] = {}
    for node in all_nodes(copy.graph.node):
        for output in node.output:
            if output:
                producer[output] = node.name
    copy_nodes = {node.name: node for node in all_nodes(copy.graph.node)}
    optimized_nodes = list(all_nodes(optimized.graph.node))
    kept = {node.name for node in optimized_nodes}
    removed = set(copy_nodes) - kept
    result = Attributions(tree)
    inserted: list[onnx.NodeProto] = []
    known: dict[str, tuple[int, ...]] = {}

    def place(node: onnx.NodeProto, found: Attribution) -> None:
        if node.name:
            result[node.name] = found
        else:  # matched to its kernel by op type and input shapes (Attributions.unnamed_kernel)
            if not known:
                known.update(_known_shapes(optimized.graph))
            result.unnamed.setdefault(node.op_type, []).append((found, _input_shapes(node, known)))

    for node in optimized_nodes:
        origin = origins.get(node.name)
        if origin is not None:
            result[node.name] = Attribution(origin.call)
            continue
        parts = _replaced(node, producer, removed, copy_nodes)
        if not parts:
            inserted.append(node)
            continue
        # Constants folded into the fusion are data, not work: they do not widen its call.
        working = [part for part in parts if any(copy_nodes[part].input)] or parts
        calls = {origins[part].call for part in working}
        place(node, Attribution(innermost_common(tree, calls), "fused", tuple(sorted(parts)), len(calls) > 1))
    if inserted:
        readers: dict[str, list[str]] = {}
        makers: dict[str, str] = {}
        for node in optimized_nodes:
            for value in node.input:
                readers.setdefault(value, []).append(node.name)
            for value in node.output:
                makers[value] = node.name
        for node in inserted:
            neighbours = [makers[v] for v in node.input if v in makers]
            neighbours += [reader for v in node.output for reader in readers.get(v, [])]
            calls = {result[name].call for name in neighbours if name in result}
            place(node, Attribution(innermost_common(tree, calls), "inserted"))
    return result
