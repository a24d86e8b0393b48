"""Fold what function bodies compute from weights alone, across function calls.

In a flat graph, onnxscript's constant folder evaluates every node whose inputs are all
initializers or constants (``Transpose`` of a ``Linear`` weight, the ``Slice``/``Concat``
gate re-ordering of ``LSTM`` weights) and stores the result as an initializer. In a modular
graph the weights reach those nodes as *formal inputs* of a function, so no folder sees a
constant, and onnxruntime redoes the work at every session start, after inlining the calls.

This pass does that folding across call boundaries. A formal input is *constant* when every
call passes an initializer, or a formal input of the caller that is itself constant. A node of
a body is *foldable* when it is a deterministic ONNX op without subgraphs whose inputs are
constant formal inputs, ``Constant`` outputs or outputs of foldable nodes. The foldable values
that the rest of the body reads become new formal inputs, and the nodes that compute them are
moved, one copy per call, into each caller (identical copies, from calls that share weights,
are merged). Repeated until no body has foldable nodes, this brings every such computation to
the main graph, where it reads initializers only; each result is stored as an initializer, an
``ir.LazyTensor`` that onnxruntime (on a tiny model of the folded nodes) computes from the
source initializers when the file is written (so weights are read, and folded, one at a time).

Which nodes fold follows onnxscript's folder: a node reading a weight larger than
``INPUT_SIZE_LIMIT`` elements folds only when that weight is used by folded nodes alone (its
old copy disappears; tied weights used elsewhere are left alone), and no result may exceed
``OUTPUT_SIZE_LIMIT`` elements unless it is no larger than the inputs it replaces.
The formal input a fold consumes entirely is replaced, at its position, by the folded one,
named ``<input>.T`` for a plain transpose and ``<inputs>.folded`` otherwise.

``Constant`` nodes of bodies are lifted the same way (``constants=True``, the default when every
op folds), as the flat optimizer lifts constants to initializers: a body's constant becomes a
formal input named after its value (``const_int64_-1_256``, ``const_float_0.5``, or
``const_float_1x1x8x8`` for larger ones), its callers pass it on, and the main graph holds one
initializer per distinct value, listed in the model's ``pkg.onnx_modular.lifted_constants``.
onnxruntime inlines every call at session start and turns each body constant into one more
initializer per call: on GPT-2 (12 layers) 264 of them, which it then creates, optimizes and
merges again at every session start (docs/benchmarks.md, issue 16).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable

import onnx_ir as ir

from onnx_modular.format import metadata
from onnx_modular.passes.export._node_eval import FoldedShapeError
from onnx_modular.passes.export._node_eval import evaluator as _evaluator
from onnx_modular.passes.export._node_eval import infer_shapes as _infer_shapes
from onnx_modular.passes.export._node_eval import static_size as _static_size
from onnx_modular.passes.export._node_eval import support as _support

__all__ = ["INPUT_SIZE_LIMIT", "OUTPUT_SIZE_LIMIT", "FoldWeightsPass"]

#: onnxscript's defaults (``onnxscript.optimizer._constant_folding``), the flat export's rules.
INPUT_SIZE_LIMIT = 8192
OUTPUT_SIZE_LIMIT = 512 * 512
#: ``node.meta`` flag of the copies moved into callers (internal to this pass).

_NON_DETERMINISTIC = frozenset({"RandomUniform", "RandomNormal", "RandomUniformLike", "RandomNormalLike", "Multinomial"})
_Key = tuple[ir.OperatorIdentifier, int]  # (function, formal input index)
_Site = tuple[ir.Node, "ir.Function | None"]  # call node, the function it sits in (None: main graph)


class FoldWeightsPass(ir.passes.InPlacePass):
    """Compute at export time what function bodies derive from weights only.

    Args:
        ops: Fold only these op types (``None``: every deterministic ONNX op).
            ``{"Transpose"}`` stores ``Linear`` weights pre-transposed and nothing else.
        constants: Also lift the bodies' ``Constant`` nodes to main-graph initializers (or a
            predicate ``constants(value) -> bool`` on each ``Constant``'s typed output, lifting
            only those: ``bench/bench_lifted_constants.py`` measures such choices),
            passed in as formal inputs (default: when ``ops`` is ``None``).

    Example::

        FoldWeightsPass()(model)  # Linear bodies become MatMul(input, weight.T)
    """

    def __init__(self, ops: Collection[str] | None = None, constants: bool | Callable[[ir.Value], bool] | None = None):
        super().__init__()
        self.ops = frozenset(ops) if ops is not None else None
        self.constants = ops is None if constants is None else constants

    def requires(self, model: ir.Model) -> None:
        for function in model.functions.values():
            if function.attributes:
                # Bodies with attribute parameters fold differently per call; torch never emits them.
                raise ir.passes.PreconditionError(f"Function {function.name} has attribute parameters.")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if not model.functions or _default_opset(model) is None:  # nothing to fold, nothing to fold with
            return ir.passes.PassResult(model, modified=False)
        modified = False
        merged: dict = {}  # per graph: (op, inputs, attributes) -> outputs; copies are shared
        for _ in range(len(model.functions) + 1):  # each round moves folds up one call level
            if not _lift_round(model, self.ops, merged, self.constants):
                break
            modified = True
        if _store_folded_initializers(model):
            modified = True
        return ir.passes.PassResult(model, modified=modified)


def _default_opset(model: ir.Model) -> int | None:
    return model.opset_imports.get("", None) or model.opset_imports.get("ai.onnx")


# -- analysis ------------------------------------------------------------------------


def _call_sites(model: ir.Model) -> dict[ir.OperatorIdentifier, list[_Site]]:
    functions = model.functions
    sites: dict[ir.OperatorIdentifier, list[_Site]] = {}
    owners: list[tuple[Iterable[ir.Node], ir.Function | None]] = [(ir.traversal.RecursiveGraphIterator(model.graph), None)]
    owners += [(ir.traversal.RecursiveGraphIterator(f), f) for f in functions.values()]
    for nodes, owner in owners:
        for node in nodes:
            if node.op_identifier() in functions:
                sites.setdefault(node.op_identifier(), []).append((node, owner))
    return sites


def _is_constant_node(node: ir.Node) -> bool:
    return (
        node.op_type == "Constant"
        and node.domain in ("", "ai.onnx")
        and len(node.attributes) == 1
        and not any(a.is_ref() for a in node.attributes.values())
    )


def _can_evaluate(node: ir.Node, ops: frozenset[str] | None) -> bool:
    """A deterministic ONNX op without subgraphs or attribute references."""
    if node.domain not in ("", "ai.onnx") or node.op_type in _NON_DETERMINISTIC or node.op_type == "Constant":
        return False
    if ops is not None and node.op_type not in ops:
        return False
    for attribute in node.attributes.values():
        if attribute.is_ref() or attribute.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            return False
    return True


def _has_static_outputs(node: ir.Node) -> bool:
    return all(_static_size(out) is not None and out.dtype is not None for out in node.outputs)


def _constant_inputs(model: ir.Model, sites: dict[ir.OperatorIdentifier, list[_Site]]) -> set[_Key]:
    """Formal inputs that receive an initializer (possibly through callers) at every call."""
    keys = {(fid, i) for fid, f in model.functions.items() for i in range(len(f.inputs)) if sites.get(fid)}
    while True:
        keep = {key for key in keys if all(_argument_key(node, owner, key[1], keys) for node, owner in sites[key[0]])}
        if keep == keys:
            return keys
        keys = keep


def _argument_key(node: ir.Node, owner: ir.Function | None, index: int, keys: set[_Key]) -> bool:
    argument = node.inputs[index] if index < len(node.inputs) else None
    if argument is None:
        return False
    if owner is None:
        return argument.is_initializer() and argument.const_value is not None and not argument.is_graph_input()
    return argument in owner.inputs and (owner.identifier(), owner.inputs.index(argument)) in keys


def _foldable_nodes(
    function: ir.Function, constant: set[ir.Value], ops, excluded: set[ir.Node], opset: int, constants: bool
) -> list[ir.Node]:
    """Nodes of the body (top level, in order) computed from constant inputs and ``Constant``s only
    (and, with ``constants``, the ``Constant`` nodes themselves)."""
    candidates = _foldable_nodes_unchecked(function, constant, ops, excluded, constants)
    _infer_shapes(_support(out for n in candidates for out in n.outputs), [v for v in function.inputs if v in constant], opset)
    return _foldable_nodes_unchecked(function, constant, ops, excluded, constants, static=True)


def _foldable_nodes_unchecked(function, constant, ops, excluded, constants: bool, static: bool = False) -> list[ir.Node]:
    derived = set(constant)  # values that depend on a constant formal input
    leaves: set[ir.Value] = set()  # Constant outputs
    found = []
    for node in function:
        if _is_constant_node(node):
            leaves.update(node.outputs)
            if (
                constants
                and node not in excluded
                and not node.outputs[0].is_graph_output()
                and _type_constant(node.outputs[0])
                and (constants is True or constants(node.outputs[0]))
            ):
                found.append(node)
            continue
        inputs = [v for v in node.inputs if v is not None]
        if (
            node not in excluded
            and any(v in derived for v in inputs)
            and all(v in derived or v in leaves for v in inputs)
            and _can_evaluate(node, ops)
            and (not static or _has_static_outputs(node))
            and not any(out.is_graph_output() for out in node.outputs)
        ):
            found.append(node)
            derived.update(node.outputs)
    return found


def _type_constant(value: ir.Value) -> bool:
    """Give a ``Constant`` output the dtype and shape of its tensor; False if it has none."""
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None:
        return False
    value.dtype, value.shape = tensor.dtype, ir.Shape(tensor.shape.numpy())
    return True


def _analyse(model: ir.Model, sites, ops, constants: bool) -> dict[ir.OperatorIdentifier, list[ir.Node]]:
    """The foldable nodes of each body, pruned to those the size rules allow."""
    functions = model.functions
    opset = _default_opset(model)
    constant_keys = _constant_inputs(model, sites)
    constant = {fid: {f.inputs[i] for (g, i) in constant_keys if g == fid} for fid, f in functions.items()}
    _type_constant_inputs(model, sites, constant_keys)
    sizes = _input_sizes(model, sites, constant_keys)
    excluded: set[ir.Node] = set()
    while True:
        folds = {fid: set(_foldable_nodes(f, constant[fid], ops, excluded, opset, constants)) for fid, f in functions.items()}
        owned = _owned_inputs(model, sites, constant_keys, folds)
        bad = set()
        for fid, nodes in folds.items():
            function = functions[fid]
            index = {value: i for i, value in enumerate(function.inputs)}
            for node in nodes:
                large = [v for v in node.inputs if v in index and sizes.get((fid, index[v]), 0) > INPUT_SIZE_LIMIT]
                if any((fid, index[v]) not in owned for v in large):
                    bad.add(node)
                    continue
                out = sum(_static_size(v) for v in node.outputs)
                if out > OUTPUT_SIZE_LIMIT and out > sum(_static_size(v) or 0 for v in node.inputs if v is not None):
                    bad.add(node)
        if not bad:
            return {fid: [n for n in functions[fid] if n in nodes] for fid, nodes in folds.items() if nodes}
        excluded |= bad


def _type_constant_inputs(model: ir.Model, sites, constant_keys: set[_Key]) -> None:
    """Give an untyped constant formal input the dtype and shape its arguments all have."""
    changed = True
    while changed:
        changed = False
        for fid, i in constant_keys:
            value = model.functions[fid].inputs[i]
            if value.dtype is not None and _static_size(value) is not None:
                continue
            arguments = [node.inputs[i] for node, _ in sites[fid]]
            found = {(a.dtype, tuple(a.shape.dims) if a.shape is not None else None) for a in arguments}
            if len(found) == 1:
                dtype, dims = found.pop()
                if dtype is not None and dims is not None and all(isinstance(d, int) for d in dims):
                    value.dtype, value.shape = dtype, ir.Shape(dims)
                    changed = True


def _input_sizes(model: ir.Model, sites, constant_keys: set[_Key]) -> dict[_Key, int]:
    """Elements of each constant formal input: its static shape, else the largest argument."""
    sizes: dict[_Key, int] = {}

    def size(key: _Key, depth: int = 0) -> int:
        if key in sizes:
            return sizes[key]
        fid, i = key
        found = _static_size(model.functions[fid].inputs[i])
        if found is None and depth < len(model.functions):
            found = 0
            for node, owner in sites[fid]:
                argument = node.inputs[i]
                if owner is None:
                    found = max(found, argument.const_value.size)
                else:
                    found = max(found, size((owner.identifier(), owner.inputs.index(argument)), depth + 1))
        sizes[key] = found or 0
        return sizes[key]

    for key in constant_keys:
        size(key)
    return sizes


def _owned_inputs(model: ir.Model, sites, constant_keys: set[_Key], folds) -> set[_Key]:
    """Constant formal inputs read only by folded nodes (or passed on to owned inputs), and whose
    arguments are, at every call, owned too: after folding, nothing reads the original weight."""
    owned = set(constant_keys)
    while True:
        keep = set()
        for fid, i in owned:
            value = model.functions[fid].inputs[i]
            if not all(_owned_use(use, folds.get(fid, ()), owned, model) for use in value.uses()):
                continue
            if all(_owned_argument(node, owner, i, owned, folds, model) for node, owner in sites[fid]):
                keep.add((fid, i))
        if keep == owned:
            return owned
        owned = keep


def _owned_use(use: ir.Usage, folded: Collection[ir.Node], owned: set[_Key], model: ir.Model) -> bool:
    node = use.node
    if node in folded or node.meta.get(metadata.FOLDED):
        return True
    return node.op_identifier() in model.functions and (node.op_identifier(), use.idx) in owned


def _owned_argument(node: ir.Node, owner, index: int, owned: set[_Key], folds, model: ir.Model) -> bool:
    argument = node.inputs[index]
    if owner is None:
        return all(_owned_use(use, (), owned, model) for use in argument.uses())
    return (owner.identifier(), owner.inputs.index(argument)) in owned


# -- moving folds into the callers ---------------------------------------------------------


def _lift_round(model: ir.Model, ops, merged: dict, constants: bool) -> bool:
    """Move every body's foldable nodes one call level up. True if anything moved."""
    sites = _call_sites(model)
    folds = _analyse(model, sites, ops, constants)
    if not folds:
        return False
    for fid, nodes in folds.items():
        _lift(model.functions[fid], nodes, sites[fid], merged)
    for function in model.functions.values():
        _remove_dead(function)
    return True


def _lift(function: ir.Function, nodes: list[ir.Node], sites: list[_Site], merged: dict) -> None:
    folded = set(nodes)
    frontier = [v for n in nodes for v in n.outputs if any(use.node not in folded for use in v.uses())]
    old_inputs = list(function.inputs)
    sources = {v: _sources(v, function) for v in frontier}
    parameters = {}
    taken = {v.name for v in old_inputs}
    by_content: dict[tuple, ir.Value] = {}  # equal lifted constants share one formal input
    for value in frontier:
        content = _constant_key(value)
        if content is not None and content in by_content:
            parameter = by_content[content]
        else:
            name = _unique(_folded_name(value, sources[value]), taken)
            parameter = ir.Value(name=name, type=value.type, shape=value.shape)
            if content is not None:
                by_content[content] = parameter
        for use in list(value.uses()):
            if use.node not in folded:
                use.node.replace_input_with(use.idx, parameter)
        parameters[value] = parameter
    # a formal input read by folded nodes only is replaced, at its position, by its folds
    consumed = {
        v for v in old_inputs if v.uses() and not v.is_graph_output() and all(use.node in folded for use in v.uses())
    }
    order: list[ir.Value] = []
    placed = set()
    for value in old_inputs:
        if value not in consumed:
            order.append(value)
            continue
        for result in frontier:
            if result not in placed and sources[result] and sources[result][0] is value:
                order.append(parameters[result])
                placed.add(result)
    for value in frontier:
        if value not in placed and parameters[value] not in order:
            order.append(parameters[value])
    position = {value: i for i, value in enumerate(old_inputs)}
    for node, owner in sites:
        computed = _copy_into_caller(function, frontier, node, owner, merged)
        arguments = [node.inputs[position[v]] if v in position else None for v in order]
        for result, copy in zip(frontier, computed):
            arguments[order.index(parameters[result])] = copy
        node.resize_inputs(len(arguments))
        for i, argument in enumerate(arguments):
            node.replace_input_with(i, argument)
    function.inputs.clear()
    function.inputs.extend(order)


def _sources(value: ir.Value, function: ir.Function) -> list[ir.Value]:
    """The formal inputs ``value`` is computed from, in signature order."""
    seen, stack, found = set(), [value], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        producer = current.producer()
        if producer is None:
            found.add(current)
        else:
            stack.extend(v for v in producer.inputs if v is not None)
    return [v for v in function.inputs if v in found]


def _folded_name(value: ir.Value, sources: list[ir.Value]) -> str:
    if not sources:
        return _constant_name(value)
    producer = value.producer()
    names = "+".join(v.name or "input" for v in sources)
    if producer is not None and producer.op_type == "Transpose" and producer.inputs[0] in sources:
        return f"{names}.T"
    return f"{names}.folded"


def _constant_name(value: ir.Value) -> str:
    """``const_<dtype>_<values>`` for up to 8 elements, else ``const_<dtype>_<dims>``."""
    dtype = value.dtype.name.lower() if value.dtype is not None else "tensor"
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is not None and tensor.size <= 8:
        items = tensor.numpy().reshape(-1).tolist()
        text = "_".join(f"{x:.8g}" if isinstance(x, float) else str(x) for x in items)
        return f"const_{dtype}_{text or 'empty'}"
    dims = "x".join(str(d) for d in value.shape.dims) if value.shape is not None else ""
    return f"const_{dtype}_{dims or 'scalar'}"


def _unique(name: str, taken: set[str]) -> str:
    candidate, n = name, 1
    while candidate in taken:
        candidate = f"{name}_{n}"
        n += 1
    taken.add(candidate)
    return candidate


def _copy_into_caller(function, frontier, call: ir.Node, owner, merged: dict) -> list[ir.Value]:
    """Copy the nodes computing ``frontier`` in front of ``call``, reading its arguments."""
    graph = call.graph  # the body (or a subgraph of it) the call sits in
    mapping: dict[ir.Value, ir.Value] = {formal: call.inputs[i] for i, formal in enumerate(function.inputs) if i < len(call.inputs)}
    shared = merged.setdefault(graph, {})
    for node in _support(frontier):
        inputs = [mapping[v] if v is not None else None for v in node.inputs]
        key = (node.domain, node.op_type, tuple(inputs), _attribute_key(node))
        if key in shared and shared[key][0].producer() is not None and shared[key][0].producer().graph is graph:
            outputs = shared[key]  # (a copy lifted on in a later round is no longer there)
        else:
            copy = ir.Node(
                node.domain, node.op_type, inputs, [_copy_attribute(a) for a in node.attributes.values()],
                num_outputs=len(node.outputs), version=node.version, metadata_props=dict(node.metadata_props),
            )
            copy.meta[metadata.FOLDED] = True
            for old, new in zip(node.outputs, copy.outputs):
                new.type, new.shape = old.type, old.shape.copy() if old.shape is not None else None
            _insert_with_folds(graph, copy, call)
            outputs = shared[key] = list(copy.outputs)
        mapping.update(zip(node.outputs, outputs))
    return [mapping[v] for v in frontier]


def _insert_with_folds(graph, copy: ir.Node, call: ir.Node) -> None:
    """Insert ``copy`` after the copies already at the top of ``graph`` (before its first other
    node). A copy reads only formal inputs, initializers, values of the enclosing scopes and earlier
    copies, so there it precedes every call that a merged copy may serve, in any order of lifting."""
    first = next((node for node in graph if not node.meta.get(metadata.FOLDED)), call)
    graph.insert_before(first, copy)


def _constant_key(value: ir.Value) -> tuple | None:
    """dtype, shape and bytes of a ``Constant``'s output (its name aside); None for other values."""
    producer = value.producer()
    if producer is None or not _is_constant_node(producer):
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None:
        return None
    return (tensor.dtype, tuple(tensor.shape.numpy()), tensor.tobytes())


def _attribute_key(node: ir.Node) -> bytes | tuple:
    if _is_constant_node(node):
        content = _constant_key(node.outputs[0])
        if content is not None:
            return content
    return b"".join(ir.serde.serialize_attribute(a).SerializeToString() for a in node.attributes.values())


def _copy_attribute(attribute: ir.Attr) -> ir.Attr:
    return ir.Attr(attribute.name, attribute.type, attribute.value, doc_string=attribute.doc_string)


def _remove_dead(function: ir.Function) -> None:
    for node in reversed(list(function)):
        if not any(out.uses() or out.is_graph_output() for out in node.outputs):
            function.remove(node, safe=True)


# -- the main graph: folded copies become lazily computed initializers ----------------------


def _store_folded_initializers(model: ir.Model) -> bool:
    graph = model.graph
    folded = [node for node in graph if node.meta.get(metadata.FOLDED)]
    if not folded:
        return False
    members = set(folded)
    taken = {v.name for n in graph for v in (*n.inputs, *n.outputs) if v is not None} | set(graph.initializers)
    taken |= {v.name for v in graph.inputs}
    opset = _default_opset(model)
    frontier = [
        value
        for node in folded
        for value in node.outputs
        if value.is_graph_output() or any(use.node not in members for use in value.uses())
    ]
    # name and capture every computation before rewiring any of them
    stored = []
    for value in frontier:
        sources = _graph_sources(value)
        if _is_constant_node(value.producer()):  # a lifted Constant: its own tensor
            tensor = ir.tensor(ir.convenience.get_const_tensor(value).numpy())
        else:  # computed (from weights, read lazily) when the file is written
            compute = _evaluator(value, sources, opset)
            if _in_memory(sources) and sum(v.const_value.size for v in sources) <= INPUT_SIZE_LIMIT:
                # small weights in memory: computed now, so that a value that cannot be computed with
                # exactly the shape and dtype it replaces stays unfolded (its nodes stay in the graph);
                # weights read lazily (streamed) stay unread, and a mismatch then fails the save
                try:
                    compute = _constant(compute())
                except FoldedShapeError:
                    continue
            tensor = ir.LazyTensor(compute, dtype=value.dtype, shape=ir.Shape(value.shape.numpy()))
        tensor.name = _unique(_main_name(value, sources), taken)
        stored.append((value, tensor.name, sources, tensor))
    lifted = json.loads(model.metadata_props.get(metadata.LIFTED_CONSTANTS, "[]"))
    for value, name, sources, tensor in stored:
        initializer = ir.Value(name=name, type=value.type, shape=value.shape)
        initializer.const_value = tensor
        if not sources:
            lifted.append(name)
        ir.convenience.replace_all_uses_with(value, initializer)
        graph.register_initializer(initializer)
    for node in reversed(folded):
        if not any(out.uses() or out.is_graph_output() for out in node.outputs):  # else: not folded
            graph.remove(node, safe=True)
    if lifted:
        model.metadata_props[metadata.LIFTED_CONSTANTS] = json.dumps(lifted)
    return True


def _in_memory(sources: list[ir.Value]) -> bool:
    return not any(isinstance(v.const_value, ir.LazyTensor) for v in sources)


def _constant(tensor: ir.Tensor):
    return lambda: tensor


def _graph_sources(value: ir.Value) -> list[ir.Value]:
    """The initializers a folded value is computed from, in first-use order."""
    found: list[ir.Value] = []
    for node in _support([value]):
        for v in node.inputs:
            if v is not None and v.producer() is None and v not in found:
                found.append(v)
    return found


def _main_name(value: ir.Value, sources: list[ir.Value]) -> str:
    if not sources:
        return _constant_name(value)
    producer = value.producer()
    names = "+".join(v.name for v in sources)
    if producer.op_type == "Transpose" and len(sources) == 1 and producer.inputs[0] is sources[0]:
        return f"{names}.T"
    return f"{names}.folded"
