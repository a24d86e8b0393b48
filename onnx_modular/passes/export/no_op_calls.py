"""ONNX IR pass: module calls that produce no ops get no function; their caller records them.

A module call whose body ends up without a single computing op, after cleanup and the
optimizer (``nn.Dropout`` in eval, whose ``Dropout`` op the optimizer turns into an
``Identity``; ``nn.Identity``; a module returning its input), is dropped: each call node is
replaced by wiring its outputs to its inputs, and the function is removed. torch 2.15 emits
no op for ``nn.Dropout`` in eval while torch 2.13 emits a ``Dropout``; after this pass both
give the same file. Such calls stay visible: every body (a function, or the main graph)
lists the no-op calls made directly in it in ``pkg.onnx_modular.no_op_calls``
(:data:`onnx_modular.format.metadata.NO_OP_CALLS`), which ``onnx-modular tree`` shows as
``Dropout (no ops)``, as ``result.hierarchy`` does.
"""

from __future__ import annotations

import json

import onnx_ir as ir

from onnx_modular.format import metadata
from onnx_modular.format.calltree import CallTree, ModuleCall
from onnx_modular.passes.functions import all_nodes

__all__ = ["RecordNoOpCallsPass"]


def _pass_through(function: ir.Function) -> list[int] | None:
    """For a body of ``Identity`` nodes only: the formal input each output is; else ``None``."""
    if not function.outputs or any(node.op_type != "Identity" or node.domain not in ("", "ai.onnx") for node in function):
        return None
    inputs = {value: i for i, value in enumerate(function.inputs)}
    mapping = []
    for output in function.outputs:
        value = output
        while value is not None and value not in inputs:
            producer = value.producer()
            if producer is None or producer.op_type != "Identity":
                return None
            value = producer.inputs[0]
        if value is None:
            return None
        mapping.append(inputs[value])
    return mapping


def _remove_call(node: ir.Node, mapping: list[int]) -> None:
    graph = node.graph
    for output, index in zip(node.outputs, mapping):
        source = node.inputs[index]
        if output.is_graph_output() and _can_take_name(source, graph):
            # A body output produced by a node of the same body: that value takes the output's
            # place and name (an Identity would be one more node for onnxruntime to inline per call).
            name = output.name
            output.replace_all_uses_with(source, replace_graph_outputs=True)
            output.name = None
            source.name = name
            if source.type is None:
                source.type, source.shape = output.type, output.shape
        elif output.is_graph_output() or source is None:
            # A graph or body output keeps its name: one Identity takes the call's place.
            identity = ir.Node("", "Identity", [source], num_outputs=1, name=f"{node.name}.identity")
            identity.metadata_props.update(
                {k: v for k, v in node.metadata_props.items() if k == metadata.NAMESPACE}
            )
            graph.insert_before(node, identity)
            name = output.name
            output.replace_all_uses_with(identity.outputs[0], replace_graph_outputs=True)
            output.name = None
            identity.outputs[0].name = name
            identity.outputs[0].type, identity.outputs[0].shape = output.type, output.shape  # a graph output keeps its type
        else:
            output.replace_all_uses_with(source)
    graph.remove(node, safe=True)


def _can_take_name(source: ir.Value | None, graph) -> bool:
    """Whether ``source`` can become an output of ``graph`` under another name: computed by a node
    of that graph, and not already an output (a graph input or weight keeps its own name)."""
    if source is None or source.is_graph_output() or source.is_graph_input() or source.is_initializer():
        return False
    producer = source.producer()
    return producer is not None and producer.graph is graph


def _relative_name(call: ModuleCall, owner: ModuleCall) -> str:
    if owner.is_root or not call.module_path.startswith(owner.module_path + "."):
        return call.call_name
    return metadata.call_name(call.module_path[len(owner.module_path) + 1 :], call.call_index)


def _body_no_op_calls(owner: ModuleCall) -> list[list]:
    """The :class:`~onnx_modular.format.metadata.NoOpCall` entries of the calls without ops in owner's body."""
    found: list[list] = []
    before = 0
    stack: list[tuple[ModuleCall, int]] = [(child, -1) for child in reversed(owner.children)]
    while stack:
        call, parent = stack.pop()
        if call.function is not None:
            before += 1  # a call node in this body
        elif not call.selected and parent < 0:
            stack.extend((child, -1) for child in reversed(call.children))  # inlined here: its calls are in this body
        else:
            entry = metadata.NoOpCall(_relative_name(call, owner), call.qualified_class, before, call.module_path, parent)
            found.append(entry.to_json())
            index = len(found) - 1
            stack.extend((child, index) for child in reversed(call.children))  # no ops either
    return found


class RecordNoOpCallsPass(ir.passes.InPlacePass):
    """Drop module calls whose body computes nothing and record them in their caller's metadata.

    Args:
        call_tree: The module-call tree; calls whose function is dropped get ``function=None``.
    """

    def __init__(self, call_tree: CallTree):
        super().__init__()
        self.call_tree = call_tree

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        no_ops = {}
        for identifier, function in model.functions.items():
            if metadata.is_module_function(function):
                mapping = _pass_through(function)
                if mapping is not None:
                    no_ops[identifier] = mapping
        for node in list(all_nodes(model)):
            mapping = no_ops.get(node.op_identifier())
            if mapping is not None:
                _remove_call(node, mapping)
        for identifier in no_ops:
            del model.functions[identifier]
        dropped = {(domain, name) for domain, name, _ in no_ops}
        for call in self.call_tree.walk():
            if call.function in dropped:
                call.function = None
        # Record, for each body, the no-op calls made directly in it (a shared body: from its first call).
        recorded = False
        done: set = set()
        by_name = {(f.domain, f.name): f for f in model.functions.values()}
        for owner in self.call_tree.walk():
            if owner.is_root:
                body = model.graph
            elif owner.function is None or owner.function in done:
                continue
            else:
                done.add(owner.function)
                body = by_name.get(owner.function)
                if body is None:
                    continue
            entries = _body_no_op_calls(owner)
            if entries:
                body.metadata_props[metadata.NO_OP_CALLS] = json.dumps(entries)
                recorded = True
        return ir.passes.PassResult(model, modified=bool(no_ops) or recorded)
