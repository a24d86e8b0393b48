"""Module calls of a file as things to work on: find them by path or class, give one call its own
functions, follow a call's arguments back to the main graph, expose a call's values.

Shared by :mod:`onnx_modular.files.extract` and :mod:`onnx_modular.files.replace`. Works on
``onnx`` protos in place; the callers work on a copy of the file's model. Calls are the
:class:`~onnx_modular.format.metadata.ExpandedCall` entries of :func:`~onnx_modular.format.metadata.expanded_calls`
(one per call, shared bodies expanded), so a call name here is the one ``onnx-modular tree`` shows.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import fnmatch
import json
from collections.abc import Iterable

import onnx

from onnx_modular.calls.tree import function_tree
from onnx_modular.errors import InvalidInputError
from onnx_modular.format import metadata
from onnx_modular.passes.proto_bodies import body_names, unique_name
from onnx_modular.storage.checks import check_expanded_size
from onnx_modular.storage.proto import FunctionId, all_nodes, function_id, node_id

__all__ = [
    "Target",
    "resolve_target",
    "find_call",
    "chain",
    "specialize",
    "initializer_source",
    "expose",
    "rebase_call_paths",
    "rebased",
    "rebase_body",
    "set_prop",
    "body_names",
    "unique_name",
    "function_name",
]


@dataclasses.dataclass
class Target:
    """What a module path or class name given by the user selects.

    Attributes:
        text: As given.
        is_class: A class (or function name): every call of it; else one call path.
        call_names: The selected calls with a function, in execution order.
        functions: The distinct functions of those calls, in order of first call.
    """

    text: str
    is_class: bool
    call_names: list[str]
    functions: list[FunctionId]

    def calls_of(self, function: FunctionId, calls: dict[str, metadata.ExpandedCall]) -> list[str]:
        """The selected call names whose function is ``function``."""
        return [name for name in self.call_names if function_id(calls[name].function) == function]


def module_calls(model: onnx.ModelProto) -> dict[str, metadata.ExpandedCall]:
    """Every call of a local function by call name, in execution order (torch's helpers included).

    A file whose calls expand past the limits of :func:`~onnx_modular.storage.checks.check_expanded_size`
    (a call bomb) is refused before the walk, which would otherwise take exponential time and memory.
    """
    check_expanded_size(model)
    return {call.call_name: call for call in metadata.expanded_calls(model, module_calls_only=False)}


def resolve_target(model: onnx.ModelProto, text: str) -> Target:
    """A call path (``h.1``, ``h.1.attn``, ``shared@1``) or a class / function name (``GPT2Block``,
    ``transformers.models.gpt2.modeling_gpt2.GPT2Block``, ``Conv1D_2``, a glob ``GPT2*``).

    Raises:
        InvalidInputError: Nothing matches (the closest call paths and classes are listed), or
            the path names a call that produced no ops (it has no function).
    """
    if not isinstance(text, str) or not text:
        raise InvalidInputError(f"The call to select must be a module path or a class name, not {text!r}.")
    calls = module_calls(model)
    tree = function_tree(model, max_calls=2**62)
    named = text if text in calls else metadata.call_name(*metadata.split_call_name(text))
    if named in calls:
        return Target(text, False, [named], [function_id(calls[named].function)])
    no_op = [c for c in tree.walk() if not c.is_root and c.function is None and c.call_name == text]
    if no_op:
        raise InvalidInputError(
            f"The call {text!r} produced no ONNX ops ({no_op[0].class_name or 'no class'}), so it has no function.",
            module_path=text,
            hint="Choose a call with a function (`onnx-modular tree` lists them).",
        )
    matched = {c.call_name for c in tree.walk() if not c.is_root and c.function is not None and c.matches(text)}
    if any(char in text for char in "*?["):  # a glob of module paths too (`model.layers.1*`), as docs/convert.md shows
        matched |= {name for name in calls if fnmatch.fnmatchcase(name, text)}
    names = [name for name in calls if name in matched]
    if not names:
        classes = {c.class_name for c in tree.walk() if not c.is_root and c.class_name}
        functions = {f.name for f in model.functions}
        candidates = sorted(set(calls) | classes | functions)
        close = difflib.get_close_matches(text, candidates, n=5, cutoff=0.5)
        raise InvalidInputError(
            f"No module call or class {text!r} in the model"
            + (f"; the closest names: {', '.join(close)}." if close else "."),
            hint=_hint(tree, next((name for name in close if name in calls), None) or _shallow_call(calls)),
        )
    functions: list[FunctionId] = []
    for name in names:
        fid = function_id(calls[name].function)
        if fid not in functions:
            functions.append(fid)
    return Target(text, True, names, functions)


def _shallow_call(calls) -> str | None:
    """A call one level inside another (``model.layers.0``, ``h.0``), else the shallowest."""
    return min(calls, key=lambda name: (abs(name.count(".") - 1), name), default=None)


def _hint(tree, example: str | None) -> str:
    """What to give, with examples from this file (a Llama gets ``model.layers.2`` and
    ``LlamaDecoderLayer``, not another model's names): ``example`` (the closest call path) and its class."""
    if example is None:
        return "This file has no module calls (`onnx-modular tree` shows its hierarchy)."
    cls = next((c.class_name for c in tree.walk() if not c.is_root and c.call_name == example and c.class_name), None)
    return f"Give a call path (`{example}`)" + (f" or a class (`{cls}`)" if cls else "") + "; `onnx-modular tree` lists them."


def find_call(model: onnx.ModelProto, name: str) -> metadata.ExpandedCall:
    calls = module_calls(model)
    if name not in calls:
        raise InvalidInputError(f"The call {name!r} is not in the model any more.", module_path=name)
    return calls[name]


def chain(call: metadata.ExpandedCall) -> list[metadata.ExpandedCall]:
    """The call and its callers, outermost first."""
    out = []
    while call is not None:
        out.append(call)
        call = call.caller
    return out[::-1]




def function_name(name: str, taken: set[str]) -> str:
    """A new function name after ``name``: ``GPT2Block_2``, ``_3``, ... as the exporter numbers
    the functions of one class (:mod:`onnx_modular.passes.export.naming`)."""
    index = 2
    while f"{name}_{index}" in taken:
        index += 1
    return f"{name}_{index}"


def rebase_call_paths(nodes, old: str | None, new: str) -> None:
    """Rewrite the ``module_path`` of the call nodes of a body written for ``old`` to ``new``.

    A body names its nested calls relative to the call it was written for
    (:func:`~onnx_modular.format.metadata.resolve_module_path`); a body that now serves another call
    (its own copy, an extracted model, a block put back) records that call's paths.
    """
    if old is None or old == new:
        return
    for node in nodes:
        for entry in node.metadata_props:
            if entry.key == metadata.MODULE_PATH:
                entry.value = rebased(entry.value, old, new)


def rebase_body(body, old: str | None, new: str) -> None:
    """:func:`rebase_call_paths` on a body's call nodes and on its recorded calls without ops."""
    if old is None or old == new:
        return
    rebase_call_paths(body.node, old, new)
    entries = metadata.no_op_calls(body)
    if entries:
        moved = [dataclasses.replace(e, module_path=rebased(e.module_path, old, new)).to_json() for e in entries]
        set_prop(body, metadata.NO_OP_CALLS, json.dumps(moved))


def rebased(path: str, old: str | None, new: str) -> str:
    """``path`` under ``new`` when it is ``old`` or below it (``h.0.attn`` -> ``h.1.attn``)."""
    if old is None or not (path == old or path.startswith(old + ".")):
        return path
    return new + path[len(old) :]


def set_prop(proto, key: str, value: str) -> None:
    for entry in proto.metadata_props:
        if entry.key == key:
            entry.value = value
            return
    proto.metadata_props.add(key=key, value=value)


def specialize(model: onnx.ModelProto, name: str, *, including_call: bool = False) -> metadata.ExpandedCall:
    """Give the call ``name`` bodies of its own: every function on its chain of callers (and its
    own function with ``including_call``) that serves other calls too is copied, and the copy,
    named ``<function>_<n>`` (:func:`function_name`), serves this call alone (its ``module_paths`` say so and its nested
    call nodes are renamed after it). Other calls keep the functions they had.

    Returns:
        The call, found again in the changed model.
    """
    while True:
        calls = module_calls(model)
        call = calls.get(name)
        if call is None:
            raise InvalidInputError(f"The call {name!r} is not in the model any more.", module_path=name)
        counts = collections.Counter(function_id(c.function) for c in calls.values())
        links = chain(call) if including_call else chain(call)[:-1]
        shared = next((c for c in links if counts[function_id(c.function)] > 1), None)
        if shared is None:
            return call
        copy = onnx.FunctionProto()
        copy.CopyFrom(shared.function)
        taken = {f.name for f in model.functions if f.domain == copy.domain}
        copy.name = function_name(shared.function.name, taken)
        rebase_body(copy, metadata.body_module_path(shared.function), metadata.strip_call_index(shared.call_name))
        _renumber_calls(copy, shared.function, shared, calls.values())
        set_prop(copy, metadata.MODULE_PATHS, json.dumps([shared.call_name]))
        set_prop(copy, metadata.CALL_COUNT, "1")
        remaining = [p for p in metadata.module_paths(shared.function) if p != shared.call_name]
        if remaining and metadata.MODULE_PATHS in metadata.props(shared.function):
            # the body now serves the other calls: its nested calls are named after the first of them
            written_for = metadata.body_module_path(shared.function)
            set_prop(shared.function, metadata.MODULE_PATHS, json.dumps(remaining))
            rebase_body(shared.function, written_for, metadata.strip_call_index(remaining[0]))
            if remaining[0] in calls:
                _renumber_calls(shared.function, shared.function, calls[remaining[0]], calls.values())
            set_prop(shared.function, metadata.CALL_COUNT, str(counts[function_id(shared.function)] - 1))
        model.functions.append(copy)
        shared.node.op_type = copy.name  # the node sits in a body this call owns already


def _renumber_calls(body: onnx.FunctionProto, original: onnx.FunctionProto, caller: metadata.ExpandedCall,
                    calls: Iterable[metadata.ExpandedCall]) -> None:
    """Name ``body``'s call nodes (``body`` is ``original`` or a copy of it) with the call indices
    they have under ``caller``, the call ``body`` is now written for: the names in a body are exact
    for its first call (:class:`~onnx_modular.format.metadata.CallCounter`), so a body given to
    ``shared@1`` names its nested call ``linear@1``, not ``linear``."""
    index_of = {id(call.node): metadata.split_call_name(call.call_name)[1]
                for call in calls if call.caller is caller and call.node is not None}
    for source, node in zip(all_nodes(original.node), all_nodes(body.node)):
        if id(source) in index_of:
            node.name = metadata.call_name(metadata.strip_call_index(node.name), index_of[id(source)])


def main_graph_names(model: onnx.ModelProto) -> tuple[set[str], set[str]]:
    """(the main graph's initializer names, the names its nodes compute)."""
    return {tensor.name for tensor in model.graph.initializer}, {name for node in model.graph.node for name in node.output}


def initializer_source(
    model: onnx.ModelProto, call: metadata.ExpandedCall, index: int, *, main_names: tuple[set[str], set[str]] | None = None
) -> str | None:
    """The main-graph initializer that reaches formal input ``index`` of ``call``, followed through
    the formal inputs of its callers; ``None`` for a value computed on the way (or not passed).
    ``main_names``: :func:`main_graph_names` of ``model``, when asked for many calls (computed once)."""
    initializers, produced = main_names if main_names is not None else main_graph_names(model)
    while True:
        if index >= len(call.node.input) or not call.node.input[index]:
            return None
        actual = call.node.input[index]
        caller = call.caller
        if caller is None:
            return actual if actual in initializers and actual not in produced else None
        formals = list(caller.function.input)
        if actual not in formals:
            return None
        call, index = caller, formals.index(actual)


def expose(model: onnx.ModelProto, call: metadata.ExpandedCall, values: list[str], taken: set[str]) -> list[str | None]:
    """Make values of the body that holds ``call``'s node outputs of the main graph.

    Every body on the call's chain must serve this call alone (:func:`specialize`). Each value
    goes out through an ``Identity`` in its body, then one more output of each enclosing call.

    Returns:
        The main-graph output names, one per value (``None`` for ``""``).
    """
    links = chain(call)[:-1]  # the callers; the node sits in the last one's body (main graph if none)
    body = links[-1].function if links else model.graph
    if not any(node is call.node or node == call.node for node in body.node):
        raise InvalidInputError(
            f"The call {call.call_name} sits inside an If/Loop/Scan body; its values cannot be captured.",
            module_path=call.call_name,
            hint="Extract it without --with-data, or choose a call outside control flow.",
        )
    if isinstance(body, onnx.FunctionProto) and not any(o.domain in ("", "ai.onnx") for o in body.opset_import):
        default = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
        if default is not None:  # a body of calls only gets its first ONNX op
            body.opset_import.add(domain="", version=default)
    outputs: list[str | None] = []
    for value in values:
        if not value:
            outputs.append(None)
            continue
        name = unique_name("onnx_modular_probe", taken)
        body.node.append(onnx.helper.make_node("Identity", [value], [name]))
        for link in reversed(links):
            link.function.output.append(name)
            node = link.node
            while len(node.output) < len(link.function.output) - 1:
                node.output.append("")
            outer = unique_name("onnx_modular_probe", taken)
            node.output.append(outer)
            name = outer
        model.graph.output.append(onnx.ValueInfoProto(name=name))
        outputs.append(name)
    return outputs


def standalone_model(model: onnx.ModelProto, graph: onnx.GraphProto, producer: str) -> onnx.ModelProto:
    """``graph`` as a model of its own: the functions it calls (:func:`used_functions`), the opsets
    of ``model`` that it and they use, ``model``'s IR version, and ``producer`` as producer name
    (this package's version as producer version). Used by extract and split."""
    from onnx_modular._version import __version__

    functions = used_functions(model, graph.node)
    domains = {""} | {node.domain for node in all_nodes(graph.node)}
    for function in functions:
        domains |= {node.domain for node in all_nodes(function.node)} | {function.domain}
    opsets = [o for o in model.opset_import if o.domain in domains]
    built = onnx.helper.make_model(graph, opset_imports=opsets, functions=functions)
    built.ir_version = model.ir_version
    built.producer_name, built.producer_version = producer, __version__
    return built


def used_functions(model: onnx.ModelProto, nodes) -> list[onnx.FunctionProto]:
    """The local functions ``nodes`` call, directly or through other functions, in model order."""
    functions = {function_id(f): f for f in model.functions}
    seen: set[FunctionId] = set()
    stack = [node_id(n) for n in all_nodes(nodes) if node_id(n) in functions]
    while stack:
        fid = stack.pop()
        if fid in seen:
            continue
        seen.add(fid)
        stack.extend(node_id(n) for n in all_nodes(functions[fid].node) if node_id(n) in functions)
    return [f for f in model.functions if function_id(f) in seen]
