"""What the fusion passes share: where a function is called, what constant a formal input always
receives, and how to pass a new value down the call chain to a body that needs it.

A modular file lifts constants to main-graph initializers passed down as formal inputs
(``const_float_1e-06``), so inside a body an epsilon or a scale is a formal input, not a
``Constant``. :func:`constant_of` follows it up through every call site: when all the calls
pass the same tensor, that is the body's constant.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from onnx_modular.format import metadata
from onnx_modular.passes.export.sink_constants import constant_argument, function_call_sites, same_tensor
from onnx_modular.passes.functions import keep_formal_inputs

__all__ = [
    "FusionPass", "Refused", "NotApplicable", "apply_rules",
    "call_sites", "constant_of", "scalar_of", "sources_of", "thread_value", "owner_of", "body_of",
    "remove_dead_nodes", "drop_unused_formals", "pack_formals",
]

#: The metadata key fusion passes put on the nodes they write (the fused op's origin).
FUSED_FROM_KEY = metadata.FUSED_FROM


class Refused(Exception):
    """Why a body is not rewritten: the one refusal type of the fusions (its text is the reason the
    report gives, :attr:`FusionPass.reasons`)."""


class NotApplicable(Refused):
    """A body this fusion does not apply to, which is no refusal (a mixture-of-experts router's
    ``Softmax`` for the attention fusion): recorded in :attr:`FusionPass.skipped`."""


class FusionPass(ir.passes.InPlacePass):
    """What every fusion declares, read by ``optimize`` after a run (:meth:`reset` at the start of each):

    - ``fused``: the functions rewritten;
    - ``reasons``: function -> why a body of this fusion's kind was not rewritten (:class:`Refused`);
    - ``skipped``: function -> why a body is not of this fusion's kind (:class:`NotApplicable`);
    - ``packed``: the functions whose projections became one ``MatMul`` on weights packed once;
    - ``ops``: function -> the op written, for a fusion that writes more than one kind.

    ``functions``: the bodies a run may rewrite (``None``: every body).
    """

    def __init__(self, functions: set[ir.OperatorIdentifier] | None = None):
        super().__init__()
        self.functions = functions
        self.reset()

    def reset(self) -> None:
        self.fused: list[ir.OperatorIdentifier] = []
        self.reasons: dict[ir.OperatorIdentifier, str] = {}
        self.skipped: dict[ir.OperatorIdentifier, str] = {}
        self.packed: list[ir.OperatorIdentifier] = []
        self.ops: dict[ir.OperatorIdentifier, str] = {}

    def applies_to(self, key: ir.OperatorIdentifier) -> bool:
        """Whether a run may rewrite the body ``key``."""
        return self.functions is None or key in self.functions


def apply_rules(rules, model: ir.Model, function: ir.Function) -> int:
    """Apply an onnxscript ``RewriteRuleSet`` to one function body; returns the rewrites made.

    onnxscript applies a rule set to a whole model (``apply_to_model``: every function); a fusion
    rewrites only the bodies it was asked for, so it calls the per-body step ``apply_to_model``
    runs for each function. That step is private to onnxscript: this is its one caller here.
    """
    return rules._apply_to_graph_or_function(model, function, verbose=None)


def call_sites(model: ir.Model) -> dict[ir.OperatorIdentifier, list[ir.Node]]:
    """Every call node of every local function, by function."""
    return function_call_sites(model)


def owner_of(value: ir.Value) -> ir.Graph | ir.Function | None:
    """The body a value lives in (the main graph, or a function's graph)."""
    return value.graph


def body_of(model: ir.Model, graph: ir.Graph) -> ir.Function | None:
    """The function whose graph is ``graph`` (``None`` for the main graph)."""
    for function in model.functions.values():
        if function.graph is graph:
            return function
    return None


def _formal_index(function: ir.Function, value: ir.Value) -> int | None:
    for index, formal in enumerate(function.inputs):
        if formal is value:
            return index
    return None


def sources_of(model: ir.Model, value: ir.Value, _depth: int = 0) -> list[ir.Value]:
    """The values ``value`` stands for one level up at a time, until a non-formal value: for a formal
    input of a function, the arguments of all its calls (followed up again); else ``[value]``."""
    if _depth > 64:
        return []
    function = body_of(model, value.graph) if value.graph is not None else None
    if function is None:
        return [value]
    index = _formal_index(function, value)
    if index is None:
        return [value]
    sites = call_sites(model).get(function.identifier(), [])
    found: list[ir.Value] = []
    for site in sites:
        argument = site.inputs[index] if index < len(site.inputs) else None
        if argument is None:
            return []
        found += sources_of(model, argument, _depth + 1)
    return found


def constant_of(model: ir.Model, value: ir.Value | None) -> ir.TensorProtocol | None:
    """The tensor ``value`` always holds (an initializer or ``Constant`` reached through every call), or ``None``."""
    if value is None:
        return None
    if value.const_value is not None and not isinstance(value.const_value, ir.ExternalTensor) and value.graph is not None:
        if value.is_initializer() or value.producer() is not None:
            return value.const_value
    tensors = []
    for source in sources_of(model, value):
        tensor = source.const_value if source.is_initializer() else constant_argument(source, set())
        if tensor is None or isinstance(tensor, ir.ExternalTensor):
            return None
        tensors.append(tensor)
    if not tensors or not all(same_tensor(t, tensors[0]) for t in tensors):
        return None
    return tensors[0]


def scalar_of(model: ir.Model, value: ir.Value | None) -> float | None:
    """The one number ``value`` always holds, or ``None``."""
    tensor = constant_of(model, value)
    if tensor is None:
        return None
    array = np.asarray(tensor.numpy())
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def thread_value(
    model: ir.Model,
    target: ir.Function,
    name: str,
    provide: Callable[[ir.Graph], ir.Value | None],
    _done: dict | None = None,
) -> ir.Value | None:
    """A new formal input of ``target`` (named ``name``) fed, at every call, down from the first
    caller body where ``provide(body)`` gives the value. Callers in between get a formal input of
    their own. Returns ``target``'s new formal input, or ``None`` (nothing changed) when some call
    chain reaches the main graph without a value."""
    done = {} if _done is None else _done
    key = target.identifier()
    if key in done:
        return done[key]
    sites = call_sites(model).get(key, [])
    if not sites:
        return None
    arguments: list[tuple[ir.Node, ir.Value]] = []
    done[key] = None  # recursion guard
    for site in sites:
        graph = site.graph
        value = provide(graph)
        if value is None:
            caller = body_of(model, graph)
            if caller is None:
                return None
            value = thread_value(model, caller, name, provide, done)
            if value is None:
                return None
        arguments.append((site, value))
    formal = ir.Value(name=_unique_input_name(target, name))
    target.inputs.append(formal)
    position = len(target.inputs) - 1
    for site, value in arguments:
        if len(site.inputs) < position:
            site.resize_inputs(position)
        site.resize_inputs(position + 1)
        site.replace_input_with(position, value)
    done[key] = formal
    return formal


def _unique_input_name(function: ir.Function, name: str) -> str:
    taken = {v.name for v in function.inputs} | {v.name for node in function for v in node.outputs}
    candidate, count = name, 1
    while candidate in taken:
        candidate, count = f"{name}_{count}", count + 1
    return candidate


def remove_dead_nodes(body: ir.Function | ir.Graph) -> int:
    """Remove the nodes of one body whose outputs nothing reads (last first); returns how many."""
    outputs = {id(v) for v in body.outputs}
    removed = 0
    for node in reversed(list(body)):
        if any(v.uses() or id(v) in outputs for v in node.outputs):
            continue
        body.remove(node, safe=True)
        removed += 1
    return removed


def drop_unused_formals(model: ir.Model) -> int:
    """Drop formal inputs no body reads, with their arguments at every call and what computed only
    them, until nothing changes. Returns how many formals were dropped."""
    dropped = 0
    for _ in range(len(model.functions) + 2):
        changed = False
        sites = call_sites(model)
        for key, function in model.functions.items():
            unused = {i for i, v in enumerate(function.inputs) if not v.uses() and not v.is_graph_output()}
            if not unused:
                continue
            keep_formal_inputs(function, sites.get(key, []), [i for i in range(len(function.inputs)) if i not in unused])
            dropped += len(unused)
            changed = True
        for body in [model.graph, *model.functions.values()]:
            changed = bool(remove_dead_nodes(body)) or changed
        if not changed:
            break
    for name in [name for name, value in model.graph.initializers.items() if not value.uses() and not value.is_graph_output()]:
        del model.graph.initializers[name]
    return dropped


def _packed_initializer(model: ir.Model, arguments: list[ir.Value], name: str, combine=None) -> ir.Value:
    arrays = [np.asarray(a.const_value.numpy()) for a in arguments]
    packed = np.concatenate(arrays, axis=-1) if combine is None else np.ascontiguousarray(combine(arrays))
    base = arguments[0].name or name
    candidate = base.replace("q_proj", "qkv_proj") if "q_proj" in base else f"{base}.{name}"
    if combine is not None:  # the arguments' common module path (``mlp.experts.gate_up_proj``), then the name
        parts = [(a.name or "").split(".") for a in arguments]
        common = [p[0] for p in zip(*parts) if len(set(p)) == 1]
        candidate = ".".join([*common[:min(len(p) for p in parts) - 1], name])
    while candidate in model.graph.initializers:
        candidate += "_"
    value = ir.Value(name=candidate, shape=ir.Shape(packed.shape), type=ir.TensorType(arguments[0].dtype),
                     const_value=ir.tensor(packed, name=candidate))
    model.graph.register_initializer(value)
    return value


def pack_formals(model: ir.Model, function: ir.Function, formals: list[ir.Value], name: str,
                 _memo: dict | None = None, combine: Callable[[list[np.ndarray]], np.ndarray] | None = None) -> ir.Value | None:
    """A new formal input of ``function`` holding the concatenation (last axis) of what ``formals``
    receive (or ``combine(arrays)``: the experts' weights stacked), built at every call: main-graph
    initializers are concatenated into one new initializer,
    formal inputs of a caller are packed in the caller the same way, recursively. ``None`` when some
    call passes anything else (what was added then goes unused: :func:`drop_unused_formals` drops it)."""
    memo = {} if _memo is None else _memo
    inputs = list(function.inputs)
    if any(f not in inputs for f in formals):
        return None
    indices = [inputs.index(f) for f in formals]
    placed = []
    for site in call_sites(model).get(function.identifier(), []):
        arguments = [site.inputs[i] if i < len(site.inputs) else None for i in indices]
        if any(a is None for a in arguments):
            return None
        key = tuple(id(a) for a in arguments)
        if key not in memo:
            if site.graph is model.graph and all(a.is_initializer() and a.const_value is not None for a in arguments):
                memo[key] = _packed_initializer(model, arguments, name, combine)
            else:
                caller = body_of(model, site.graph)
                memo[key] = pack_formals(model, caller, arguments, name, memo, combine) if caller is not None else None
        if memo[key] is None:
            return None
        placed.append((site, memo[key]))
    if not placed:
        return None
    formal = ir.Value(name=_unique_input_name(function, name))
    function.inputs.append(formal)
    position = len(function.inputs) - 1
    for site, value in placed:
        site.resize_inputs(position + 1)
        site.replace_input_with(position, value)
    return formal


def _clone_function(model: ir.Model, function: ir.Function, suffix: str) -> ir.Function:
    """A copy of ``function`` under a new name (``<name>_<suffix>``) in the same domain, added to the model."""
    copy = function.clone()
    taken = {key[1] for key in model.functions if key[0] == function.domain}
    name = f"{function.name}_{suffix}"
    while name in taken:
        name += "_"
    copy.name = name
    model.functions[copy.identifier()] = copy
    return copy


def split_calls(model: ir.Model, function: ir.Function, index: int, key_of: Callable[[ir.Value], object],
                suffix: Callable[[object], str], _depth: int = 0) -> dict[object, ir.Function] | None:
    """Copies of ``function`` such that all the calls of each one pass, at formal input ``index``,
    values with one ``key_of`` (read on the values they stand for in the bodies that compute them,
    :func:`sources_of`). A caller whose own calls disagree is split first, the same way, so a
    decoder layer called with two kinds of mask becomes two functions, each called for its kind.
    Returns key -> function (``function`` itself for the first key), or ``None`` when the calls
    cannot be told apart (nothing is changed then... except callers already split, which stay valid)."""
    if _depth > 16:
        return None
    for site in call_sites(model).get(function.identifier(), []):
        argument = site.inputs[index] if index < len(site.inputs) else None
        if argument is None:
            return None
        if len({key_of(s) for s in sources_of(model, argument)}) > 1:
            caller = body_of(model, site.graph)
            position = _formal_index(caller, argument) if caller is not None else None
            if position is None or split_calls(model, caller, position, key_of, suffix, _depth + 1) is None:
                return None
    groups: dict[object, list[ir.Node]] = {}
    for site in call_sites(model).get(function.identifier(), []):
        keys = {key_of(s) for s in sources_of(model, site.inputs[index])}
        if len(keys) != 1:
            return None
        groups.setdefault(keys.pop(), []).append(site)
    result: dict[object, ir.Function] = {}
    for key, sites in groups.items():
        if not result:
            result[key] = function
            continue
        copy = _clone_function(model, function, suffix(key))
        for site in sites:
            site.op_type = copy.name
        result[key] = copy
    return result
