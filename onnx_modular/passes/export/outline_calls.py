"""ONNX IR pass: outline every module call into a nested ONNX local function.

The pass works on the flat model that torch's translator produces. Each node
carries ``meta[metadata.STACK]``: the tuple of module-call keys (outermost first) that
the node was executed under. Nodes are grouped by that stack level by level:
the nodes of one call become the body of one function, replaced in the caller
by a single call node, and the body is outlined again one level down.

Why at the ONNX level rather than in FX (see docs/design.md): the translator then
sees an ordinary flat graph, and the FX-level traps (``getitem`` separated from
its producer, orphaned ``get_attr`` branches, renamed output specs) cannot occur.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import onnx_ir as ir

from onnx_modular.errors import ModularizeError
from onnx_modular.format import metadata
from onnx_modular.passes.export.signatures import (
    SIZE_INPUT,
    UNBOUND_INPUT,
    UNBOUND_OUTPUT,
    CallSignature,
    TensorSpec,
    match_by_value,
    match_unambiguous,
    source_name,
    unique_names,
    why_unbound_input,
    why_unbound_output,
)

if TYPE_CHECKING:  # data only: the pass reads calls' attributes and sets ``function``/``num_nodes``
    from onnx_modular.format.calltree import CallTree, ModuleCall

__all__ = [
    "TensorSpec",
    "CallSignature",
    "OutlineModuleCallsPass",
]


def _nested_nodes(node: ir.Node) -> Iterable[ir.Node]:
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            yield from ir.traversal.RecursiveGraphIterator(attr.value)
        elif attr.type == ir.AttributeType.GRAPHS:
            for graph in attr.value:
                yield from ir.traversal.RecursiveGraphIterator(graph)


def used_values(node: ir.Node) -> set[ir.Value]:
    """Values a node reads, including outer-scope values read by its subgraphs."""
    used = {value for value in node.inputs if value is not None}
    defined: set[ir.Value] = set()
    for inner in _nested_nodes(node):
        used.update(value for value in inner.inputs if value is not None)
        defined.update(inner.outputs)
        if inner.graph is not None:
            defined.update(inner.graph.inputs)
    for graph in _subgraphs_of(node):  # a Loop/If/Scan body's own initializers are not read from outside
        defined.update(graph.initializers.values())
    return used - defined


def _subgraphs_of(node: ir.Node):
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            yield from _graphs_in(attr.value)
        elif attr.type == ir.AttributeType.GRAPHS:
            for graph in attr.value:
                yield from _graphs_in(graph)


def _graphs_in(graph: ir.Graph):
    yield graph
    for inner in graph:
        yield from _subgraphs_of(inner)


class OutlineModuleCallsPass(ir.passes.InPlacePass):
    """Turn every module call into a nested ONNX local function.

    Args:
        call_tree: The module-call tree; each outlined call gets ``function`` set.
        signatures: Optional eager signatures per ``(module_path, call_index)``, used
            to name formal inputs after forward() parameters and keep forward() order.
        domain_of: Maps a call to its function domain (``pkg.<package>.<version>``).
        value_of: Optional lookup of a value's example-input result by the translator's
            value name; it tells apart inputs and outputs of equal dtype and shape.

    Example::

        OutlineModuleCallsPass(tree, signatures)(model)
    """

    def __init__(
        self,
        call_tree: CallTree,
        signatures: dict[tuple[str, int], CallSignature] | None = None,
        *,
        domain_of: Callable[[ModuleCall], str] | None = None,
        value_of: Callable[[str], Any] | None = None,
    ):
        super().__init__()
        self.call_tree = call_tree
        self.signatures = signatures or {}
        self.value_of = value_of
        self.domain_of = domain_of or (lambda call: metadata.function_domain(call.package, call.version))
        self._serial = 0

    def requires(self, model: ir.Model) -> None:
        """The main graph is topologically sorted, and every stack key is a call of the tree."""
        defined = set(model.graph.inputs) | set(model.graph.initializers.values())
        for node in model.graph:
            for key in node.meta.get(metadata.STACK, ()):
                if key not in self.call_tree:
                    raise ir.passes.PreconditionError(
                        f"Node {node.name!r} ran under the module call {key!r}, which is not in the call tree."
                    )
            for value in node.inputs:
                if value is not None and value not in defined and value.graph is model.graph:
                    raise ir.passes.PreconditionError(
                        f"The main graph is not topologically sorted: node {node.name!r} reads {value.name!r} "
                        "before it is produced (run onnx_ir's TopologicalSortPass first)."
                    )
            defined.update(node.outputs)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self._model = model
        _clone_shared_constants(model.graph)
        before = set(model.functions)
        self._outline(model.graph, depth=0)
        created = [f for identifier, f in model.functions.items() if identifier not in before]
        _import_opsets(model, created)
        return ir.passes.PassResult(model, modified=bool(created))

    # -- grouping -----------------------------------------------------------------

    def _outline(self, container: ir.Graph, depth: int) -> None:
        groups: dict[str, list[ir.Node]] = {}
        for node in container:
            stack = node.meta.get(metadata.STACK, ())
            if len(stack) > depth:
                groups.setdefault(stack[depth], []).append(node)
        # Node positions, computed once: extraction removes members and puts the call node at
        # the first member's place, so relative order (all _make_convex needs) is preserved.
        position = {node: i for i, node in enumerate(container)}
        alive = list(range(len(position)))  # sorted positions of the nodes still in the container
        for key, members in groups.items():
            call = self.call_tree[key]
            # An earlier group may have absorbed some members (_make_convex): they are its now.
            members = [node for node in members if node.graph is container and _key_at(node, depth) == key]
            if not members:
                continue
            try:
                members, contiguous = _make_convex(container, members, key, depth, position, alive)
                first_position = position[members[0]]
                function, call_node = self._extract(container, members, call)
                if function is not None and contiguous:
                    for node in members:
                        del alive[bisect.bisect_left(alive, position[node])]
                    position[call_node] = first_position
                    bisect.insort(alive, first_position)
                elif function is not None:
                    # Outside nodes in the span must move around the call: re-sort now so
                    # that later groups are analysed on a topologically ordered container.
                    container.sort()
                    position = {node: i for i, node in enumerate(container)}
                    alive = list(range(len(position)))
            except ModularizeError:
                raise
            except Exception as e:  # a bug here must still name the module
                raise ModularizeError(
                    f"Could not outline the call {call.call_name!r} ({call.qualified_class}): {e}",
                    module_path=call.module_path,
                    hint="Pass modules=... to keep this module inline, and report the model.",
                ) from e
            if function is None:
                continue
            self._outline(function.graph, depth + 1)
            call.num_nodes = len(function.graph)

    # -- extraction ---------------------------------------------------------------

    def _extract(
        self, container: ir.Graph, members: list[ir.Node], call: ModuleCall
    ) -> tuple[ir.Function | None, ir.Node | None]:
        inner, external, outputs = _boundary(container, members)
        if not outputs:
            return None, None  # nothing escapes: the call has no observable effect
        outputs, output_names, output_notes = self._formal_outputs(call, outputs)
        formals, input_notes = self._formal_inputs(call, external)
        output_names = unique_names(output_names, reserved=[formal.name for _, formal in formals])
        _free_names(inner, set(outputs), [formal.name for _, formal in formals] + output_names)

        # Rewire: uses inside the body read the formal inputs.
        for actual, formal in formals:
            for use in list(actual.uses()):
                if use.node in inner:
                    use.node.replace_input_with(use.idx, formal)

        domain = self.domain_of(call)
        self._serial += 1
        # A unique temporary name; NameFunctionsPass gives the final, readable one.
        temp_name = f"{call.class_name}__call{self._serial}"
        call_node = ir.Node(
            domain,
            temp_name,
            inputs=[actual for actual, _ in formals],
            num_outputs=len(outputs),
            name=_node_name(call),
            metadata_props=call.metadata(),
        )
        namespace = _call_namespace(members[0], call)
        if namespace:
            call_node.metadata_props[metadata.NAMESPACE] = namespace
        for inner_value, outer_value, name in zip(outputs, call_node.outputs, output_names):
            # The caller's value keeps the (graph-unique) name; the body's is the formal output.
            inner_value.meta[metadata.SOURCE_NAME] = outer_value.meta[metadata.SOURCE_NAME] = source_name(inner_value)
            outer_value.name = inner_value.name
            outer_value.type = inner_value.type
            outer_value.shape = inner_value.shape
            inner_value.name = name
        container.insert_before(members[0], call_node)
        container.remove(members, safe=False)

        _read_call_outputs(container, inner, outputs, call_node)

        function = ir.Function(
            domain,
            temp_name,
            graph=ir.Graph(
                [formal for _, formal in formals],
                outputs,
                nodes=members,
                name=temp_name,
            ),
            attributes=[],
        )
        function.meta[metadata.CALLS] = [call]
        function.meta[metadata.SIGNATURE_NOTES] = input_notes + output_notes
        self._model.functions[function.identifier()] = function
        call.function = (domain, temp_name)
        return function, call_node

    # -- signatures ---------------------------------------------------------------

    def _formal_inputs(
        self, call: ModuleCall, external: list[ir.Value]
    ) -> tuple[list[tuple[ir.Value, ir.Value]], list[str]]:
        """(actual, formal) pairs in signature order: forward() args, weights, sizes; and notes.

        Activations matched to forward()'s parameters take their names. The others are
        ``unbound_input_<k>`` and get a note for the doc string saying why (a value's torch
        name would only look like a binding).
        """
        signature = self.signatures.get((call.module_path, call.call_index))
        weights = [v for v in external if _global_name(v) is not None]
        scalars = [v for v in external if v not in weights and v.shape is not None and len(v.shape) == 0 and v.dtype == ir.DataType.INT64]
        activations = [v for v in external if v not in weights and v not in scalars]

        matched: dict[ir.Value, int] = {}
        if signature is not None:
            matched = match_unambiguous(activations, signature.inputs)
            match_by_value(activations, signature.inputs, matched, self.value_of)
        ordered: list[tuple[ir.Value, str]] = sorted(
            ((value, signature.inputs[matched[value]].name) for value in activations if value in matched),
            key=lambda item: matched[item[0]],
        )
        notes: list[str] = []
        for value in (v for v in activations if v not in matched):
            name = f"{UNBOUND_INPUT}_{len(notes)}"
            ordered.append((value, name))
            notes.append(f"{name}: {why_unbound_input(value, signature, matched)}")
        prefix = f"{call.module_path}." if call.module_path else ""
        for value in weights:
            global_name = _global_name(value)
            local = global_name[len(prefix):] if prefix and global_name.startswith(prefix) else global_name
            ordered.append((value, local))
        sizes = [(value, f"{SIZE_INPUT}_{i}") for i, value in enumerate(scalars)]
        if sizes:
            names = ", ".join(name for _, name in sizes)
            notes.append(f"{names}: symbolic sizes (dynamic shapes) that torch.export computed in the caller")
        ordered += sizes

        names = unique_names([name for _, name in ordered])
        pairs = []
        for (actual, _), name in zip(ordered, names):
            formal = ir.Value(name=name, type=actual.type, shape=actual.shape)
            formal.meta[metadata.SOURCE_NAME] = source_name(actual)
            if (global_name := _global_name(actual)) is not None:
                formal.meta[metadata.GLOBAL_NAME] = global_name
            pairs.append((actual, formal))
        return pairs, notes

    def _formal_outputs(self, call: ModuleCall, outputs: list[ir.Value]) -> tuple[list[ir.Value], list[str], list[str]]:
        """Outputs in forward()'s return order, their names (``output``, ``output_0``, keys), notes."""
        signature = self.signatures.get((call.module_path, call.call_index))
        matched: dict[ir.Value, int] = {}
        if signature is not None:
            matched = match_unambiguous(outputs, signature.outputs)
            match_by_value(outputs, signature.outputs, matched, self.value_of)
            outputs = sorted(outputs, key=lambda v: (matched.get(v, len(signature.outputs)), outputs.index(v)))
        names: list[str] = []
        notes: list[str] = []
        for value in outputs:
            if value in matched:
                names.append(signature.outputs[matched[value]].name)
                continue
            name = f"{UNBOUND_OUTPUT}_{len(notes)}"
            names.append(name)
            notes.append(f"{name}: {why_unbound_output(value, signature, matched)}")
        return outputs, unique_names(names), notes


def _boundary(container: ir.Graph, members: list[ir.Node]) -> tuple[set[ir.Node], list[ir.Value], list[ir.Value]]:
    """A group's nodes (its subgraphs' included), the values it reads from outside (in order of
    first use) and its values read outside it (or container outputs)."""
    inner: set[ir.Node] = set(members)
    for node in members:
        inner.update(_nested_nodes(node))

    produced: set[ir.Value] = set()
    for node in inner:
        produced.update(node.outputs)
    external: list[ir.Value] = []
    seen: set[ir.Value] = set()
    for node in members:
        for value in sorted(used_values(node), key=_first_use_order(node)):
            if value not in produced and value not in seen:
                seen.add(value)
                external.append(value)

    container_outputs = set(container.outputs)
    outputs = [
        value
        for node in members
        for value in node.outputs
        if value in container_outputs or any(use.node not in inner for use in value.uses())
    ]
    return inner, external, outputs


def _read_call_outputs(container: ir.Graph, inner: set[ir.Node], outputs: list[ir.Value], call_node: ir.Node) -> None:
    """Rewire: uses outside the body (and the container's outputs) read the call's outputs."""
    for inner_value, outer_value in zip(outputs, call_node.outputs):
        for use in list(inner_value.uses()):
            if use.node not in inner:
                use.node.replace_input_with(use.idx, outer_value)
        for i, graph_output in enumerate(container.outputs):
            if graph_output is inner_value:
                container.outputs[i] = outer_value


def _free_names(inner: set[ir.Node], outputs: set[ir.Value], wanted: list[str]) -> None:
    """Rename body values whose name a formal input or output will take (names are SSA).

    Outputs are left alone: they take their formal names after the caller's values have
    taken theirs.
    """
    wanted_set = set(wanted)
    values = [value for node in inner for value in node.outputs if value not in outputs]
    taken = {value.name for value in values if value.name} | wanted_set
    for value in values:
        if value.name in wanted_set:
            value.meta.setdefault(metadata.SOURCE_NAME, value.name)
            base, index = value.name, 1
            while f"{base}__{index}" in taken:
                index += 1
            value.name = f"{base}__{index}"
            taken.add(value.name)


def _import_opsets(model: ir.Model, functions: list[ir.Function]) -> None:
    """Each new function imports the domains its body uses; the model imports theirs.

    Versions come from the model's imports (1 for the new function domains), so the
    outlined model is valid on its own.
    """
    for function in functions:
        model.opset_imports.setdefault(function.domain, 1)
    for function in functions:
        for node in ir.traversal.RecursiveGraphIterator(function):
            function.opset_imports.setdefault(node.domain, model.opset_imports.get(node.domain, 1))


def _global_name(value: ir.Value) -> str | None:
    if value.is_initializer():
        return value.name
    return value.meta.get(metadata.GLOBAL_NAME)


def _first_use_order(node: ir.Node) -> Callable[[ir.Value], int]:
    order = {value: i for i, value in enumerate(node.inputs) if value is not None}
    return lambda value: order.get(value, len(order))


def _node_name(call: ModuleCall) -> str:
    """The call node's name: the module path relative to the function the node sits in.

    Inside ``GPT2Block`` the attention call is ``attn``, not ``h.0.attn``: the body is shared
    by ``h.0`` … ``h.11``, so a full path would name only its first caller. Calls in the main
    graph (and calls whose path does not extend the enclosing one, an instance reached
    through another attribute) keep the full path. The full path of the first call stays in
    the ``pkg.onnx_modular.module_path`` metadata.
    """
    enclosing = call.parent
    while enclosing is not None and enclosing.function is None:
        enclosing = enclosing.parent
    prefix = f"{enclosing.module_path}." if enclosing is not None and enclosing.module_path else ""
    if not prefix or not call.module_path.startswith(prefix):
        return call.call_name
    relative = call.module_path[len(prefix) :]
    return metadata.call_name(relative, call.call_index)


def _call_namespace(member: ir.Node, call: ModuleCall) -> str | None:
    """The ``namespace`` of a call node: the member's namespace cut after this call."""
    namespace = member.metadata_props.get(metadata.NAMESPACE)
    if not namespace:
        return None
    segments = namespace.split("/")
    for i, segment in enumerate(segments[1:], start=1):
        if segment.startswith(f"{call.module_path}: "):
            return "/".join(segments[: i + 1])
    return None


def _key_at(node: ir.Node, depth: int) -> str | None:
    stack = node.meta.get(metadata.STACK, ())
    return stack[depth] if len(stack) > depth else None


def _make_convex(
    container: ir.Graph,
    members: list[ir.Node],
    key: str,
    depth: int,
    position: dict[ir.Node, int],
    alive: list[int],
) -> tuple[list[ir.Node], bool]:
    """Absorb outside nodes that sit on a path from the group back into the group.

    A group whose nodes are contiguous in topological order is convex. Otherwise an
    outside node inside its span either only feeds the group (moved before it by the
    final sort), only reads from it (moved after), or both: then outlining would
    create a cycle, so the node joins the group.
    """
    first, last = position[members[0]], position[members[-1]]
    if bisect.bisect_right(alive, last) - bisect.bisect_left(alive, first) == len(members):
        return members, True  # contiguous, hence convex
    member_set = set(members)
    span = [node for node in container if first <= position[node] <= last]
    downstream_values: set[ir.Value] = set()
    downstream: set[ir.Node] = set()
    for node in span:
        if node in member_set or used_values(node) & downstream_values:
            downstream_values.update(node.outputs)
            if node not in member_set:
                downstream.add(node)
    upstream_needed: set[ir.Value] = set()
    upstream: set[ir.Node] = set()
    for node in reversed(span):
        if node in member_set or any(value in upstream_needed for value in node.outputs):
            upstream_needed.update(used_values(node))
            if node not in member_set:
                upstream.add(node)
    absorbed = downstream & upstream
    for node in absorbed:
        stack = node.meta.get(metadata.STACK, ())
        node.meta[metadata.STACK] = tuple(stack[:depth]) + (key,)
    if absorbed:
        member_set |= absorbed
        members = [node for node in span if node in member_set]
    return members, False


def _clone_shared_constants(graph: ir.Graph) -> None:
    """Give each module call its own copy of a ``Constant`` it shares with another call.

    torch's translator caches Python constants per graph, so one ``Constant`` node can
    feed nodes of different modules; without a copy, the constant would cross
    function boundaries as an extra input.
    """
    position = {n: i for i, n in enumerate(graph)}  # clones are not users: stale indices are fine
    for node in list(graph):
        if node.op_type != "Constant" or node.domain != "" or node.inputs:
            continue
        own_stack = node.meta.get(metadata.STACK, ())
        output = node.outputs[0]
        clones: dict[tuple[str, ...], ir.Node] = {}
        for use in sorted(output.uses(), key=lambda u: position.get(u.node, 0)):
            user_stack = use.node.meta.get(metadata.STACK, ())
            if user_stack == own_stack or use.node.graph is not graph:
                continue
            clone = clones.get(user_stack)
            if clone is None:
                clone = ir.Node(
                    "",
                    "Constant",
                    inputs=[],
                    attributes=list(node.attributes.values()),
                    num_outputs=1,
                    name=f"{node.name}_copy{len(clones)}",
                    metadata_props=dict(use.node.metadata_props),
                )
                clone.meta[metadata.STACK] = user_stack
                clone.outputs[0].name = f"{output.name}_copy{len(clones)}"
                clone.outputs[0].type = output.type
                clone.outputs[0].shape = output.shape
                # Right before its first user, so that identical calls keep identical node order.
                graph.insert_before(use.node, clone)
                clones[user_stack] = clone
            use.node.replace_input_with(use.idx, clone.outputs[0])
        if clones and not output.uses() and not output.is_graph_output():
            graph.remove(node, safe=True)

