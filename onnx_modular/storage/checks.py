"""Structure checks of a loaded ONNX model: sizes, missing or duplicate functions, recursion, depth."""

from __future__ import annotations

import contextvars
import os
from collections.abc import Iterable, Mapping

import onnx
import onnx.defs
import onnx.numpy_helper

from onnx_modular.errors import InvalidModelFileError
from onnx_modular.storage.proto import (
    FunctionId,
    all_nodes,
    function_id,
    function_label,
    is_standard_domain,
    node_id,
    shown,
    subgraphs,
)

__all__ = [
    "MAX_DIMENSION",
    "MAX_NESTING",
    "MAX_EXPANDED_NODES",
    "MAX_EXPANDED_CALLS",
    "check_model_structure",
    "expanded_size",
    "check_expanded_size",
    "MAX_LOOP_TRIPS",
]

#: Larger declared dimensions are refused: no real tensor has 2**40 elements along one axis,
#: and anything that tried to allocate it would exhaust memory.
MAX_DIMENSION = 2**40
#: Deepest nesting of function calls accepted (real models nest fewer than 20 levels);
#: ``onnx.inliner`` refuses call chains deeper than 100 with an untyped error.
MAX_NESTING = 100
#: Most nodes a model may hold once every call is expanded (:func:`expanded_size`); more is
#: refused before anything expands the calls (``onnx.inliner``, onnxruntime's session). The
#: largest real models hold well under a million nodes inlined; a 2 KB file of 24 functions,
#: each calling the one below twice, holds 2**24. The environment variable
#: ``ONNX_MODULAR_MAX_EXPANDED_NODES`` raises it.
MAX_EXPANDED_NODES = 2_000_000
#: Most calls of local functions a model may make once expanded (a call inside a body called
#: N times counts N times). onnxruntime's session creation takes time growing with the square
#: of the calls (measured: 16,384 calls 2.3 s, 32,768 calls 17 s); real models make a few
#: thousand (a 48-layer transformer about 700). ``ONNX_MODULAR_MAX_EXPANDED_CALLS`` raises it.
MAX_EXPANDED_CALLS = 20_000
#: Most iterations of a ``Loop`` whose trip count is a constant and whose condition cannot stop it
#: (absent, or a constant ``true`` passed through): onnxruntime runs it to the end, holding every
#: scan output (a ``Loop`` of 10**5 steps took 3.5 GB; 2**62 steps never end).
#: ``ONNX_MODULAR_MAX_LOOP_TRIPS`` raises it.
MAX_LOOP_TRIPS = 2**14
_TRIPS_VARIABLE = "ONNX_MODULAR_MAX_LOOP_TRIPS"
LOOP_SECONDS_VARIABLE = "ONNX_MODULAR_LOOP_SECONDS"
#: Seconds a run of a model may take when one of its ``Loop``s has a trip count decided at run time
#: (a ``while`` loop): onnxruntime is then stopped (``RunOptions.terminate``) and the run is a typed
#: error. Such loops in real exports (``EmbeddingBag``) take milliseconds. ``ONNX_MODULAR_LOOP_SECONDS`` raises it.
LOOP_RUN_SECONDS = 30
_LOOP_SECONDS: contextvars.ContextVar[int | None] = contextvars.ContextVar("onnx_modular_loop_seconds", default=None)
_NODES_VARIABLE = "ONNX_MODULAR_MAX_EXPANDED_NODES"
_CALLS_VARIABLE = "ONNX_MODULAR_MAX_EXPANDED_CALLS"


def _check_dimensions(where: str, dims: Iterable[int], name: str) -> None:
    for dim in dims:
        if dim > MAX_DIMENSION:
            raise InvalidModelFileError(
                f"{where} {shown(name)!r} declares a dimension of {dim} (more than 2**40); "
                "refusing to use a model whose tensors could never be allocated."
            )


def _declared_dims(value: onnx.ValueInfoProto) -> list[int]:
    if not (value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape")):
        return []
    return [d.dim_value for d in value.type.tensor_type.shape.dim if d.HasField("dim_value")]


def _check_value_infos(graph: onnx.GraphProto, where: str) -> None:
    for kind, values in (("input", graph.input), ("output", graph.output), ("value", graph.value_info)):
        for value in values:
            _check_dimensions(f"{where} {kind}", _declared_dims(value), value.name)
    for tensor in graph.initializer:
        _check_dimensions(f"{where} initializer", tensor.dims, tensor.name)
    for sparse in graph.sparse_initializer:
        _check_dimensions(f"{where} sparse initializer", sparse.dims, sparse.values.name)


def _check_single_assignment(nodes: Iterable[onnx.NodeProto], inputs: list[str], where: str) -> None:
    """Every value of a graph (or body) is computed once: by one node output, or given as an input
    (ONNX graphs are in single assignment form; onnx_ir, the inliner and onnxruntime fail on a
    value named twice with untyped errors)."""
    seen = {name: "an input" for name in inputs if name}
    for node in nodes:
        for output in node.output:
            if not output:
                continue
            if output in seen:
                raise InvalidModelFileError(
                    f"{where}: the value {shown(output)!r} is computed twice (by node {shown(node.name)!r} and by "
                    f"{seen[output]}); an ONNX graph names each value once (the file is corrupted).",
                )
            seen[output] = f"node {shown(node.name)!r}"


def _check_acyclic(nodes: Iterable[onnx.NodeProto], where: str) -> None:
    """No value of a graph (or body) depends on itself: a cycle of nodes has no order to run in
    (tools that walk the graph would loop forever; onnxruntime refuses it with an untyped error)."""
    nodes = list(nodes)
    producer = {output: index for index, node in enumerate(nodes) for output in node.output if output}
    readers: list[list[int]] = [[] for _ in nodes]
    waiting = [0] * len(nodes)
    for index, node in enumerate(nodes):
        for source in {producer[name] for name in node.input if name in producer}:
            readers[source].append(index)
            waiting[index] += 1
    ready = [index for index, count in enumerate(waiting) if count == 0]
    done = 0
    while ready:
        index = ready.pop()
        done += 1
        for reader in readers[index]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                ready.append(reader)
    if done < len(nodes):
        stuck = next(nodes[i] for i, count in enumerate(waiting) if count)
        raise InvalidModelFileError(
            f"{where}: its nodes form a cycle (node {shown(stuck.name or stuck.op_type)!r} reads a value computed "
            "from its own output); an ONNX graph runs in an order, so the file is corrupted."
        )


def _check_function_body(function: onnx.FunctionProto, name: str) -> None:
    label = function_label(function_id(function))
    _check_single_assignment(function.node, list(function.input), f"{name}: function {label}")
    _check_acyclic(function.node, f"{name}: function {label}")
    for node in all_nodes(function.node):
        for subgraph in subgraphs(node):
            _check_value_infos(subgraph, f"{name}: function {label}: subgraph")
            _check_single_assignment(subgraph.node, [v.name for v in subgraph.input], f"{name}: function {label}: subgraph")
    for value in function.value_info:
        _check_dimensions(f"{name}: function {label} value", _declared_dims(value), value.name)


def check_model_structure(model: onnx.ModelProto, *, name: str = "the model") -> None:
    """Refuse models that cannot be inspected or run safely.

    Checked, in this order, each failing fast with a message naming the culprit:

    - every graph input, output, value and initializer declares dimensions <= 2**40;
    - every graph and function body computes each value once, and no value depends on itself (a cycle);
    - no two local functions share one ``(domain, name, overload)``;
    - no node of a custom domain calls a function the model does not define (a domain
      counts as custom when it is ``pkg.*`` or when some local function lives in it;
      the standard ``""``, ``ai.onnx*`` and ``com.microsoft*`` domains are not checked);
    - functions do not call each other recursively (ONNX forbids it; inliners and
      runtimes would loop forever);
    - every name, domain and metadata entry is valid UTF-8 (as ONNX requires; protobuf
      hands undecodable strings over as ``bytes``);
    - no call passes more inputs or takes more outputs than its function declares;
    - calls nest at most :data:`MAX_NESTING` levels deep.

    Raises:
        InvalidModelFileError: On the first problem found.
    """
    _check_text(model, name)
    graphs = [(model.graph, f"{name}: graph")]
    while graphs:
        graph, where = graphs.pop()
        _check_value_infos(graph, where)
        _check_single_assignment(graph.node, [v.name for v in graph.input], where)
        _check_acyclic(graph.node, where)
        for node in graph.node:
            for subgraph in subgraphs(node):
                graphs.append((subgraph, f"{name}: subgraph of node {shown(node.name)!r}"))
    for function in model.functions:
        _check_function_body(function, name)

    functions: dict[FunctionId, onnx.FunctionProto] = {}
    for function in model.functions:
        fid = function_id(function)
        if fid in functions:
            raise InvalidModelFileError(f"{name}: the function {function_label(fid)} is defined twice.")
        functions[fid] = function
    custom_domains = {domain for domain, _, _ in functions}

    def check_calls(nodes: Iterable[onnx.NodeProto], where: str) -> set[FunctionId]:
        called = set()
        for node in all_nodes(nodes):
            nid = node_id(node)
            if nid in functions:
                called.add(nid)
                function = functions[nid]
                if len(node.input) > len(function.input) or len(node.output) > len(function.output):
                    raise InvalidModelFileError(
                        f"{name}: node {shown(node.name)!r} in {where} calls {function_label(nid)} with "
                        f"{len(node.input)} inputs and {len(node.output)} outputs, but the function declares "
                        f"{len(function.input)} inputs and {len(function.output)} outputs (the file is corrupted)."
                    )
            elif not is_standard_domain(node.domain) and (
                node.domain.startswith("pkg.") or node.domain in custom_domains
            ):
                raise InvalidModelFileError(
                    f"{name}: node {shown(node.name)!r} in {where} calls the function {function_label(nid)}, "
                    "which the model does not define (the file may be truncated, or its functions were removed)."
                )
        return called

    check_calls(model.graph.node, "the main graph")
    callees = {
        fid: check_calls(function.node, f"function {function_label(fid)}")
        for fid, function in functions.items()
    }
    depth = _nesting_depths(callees, name)
    deepest = max(depth.values(), default=0)
    if deepest > MAX_NESTING:
        raise InvalidModelFileError(
            f"{name}: function calls nest {deepest} levels deep (more than {MAX_NESTING}, the most onnx.inliner "
            "and onnxruntime accept); refusing to inspect it."
        )


def _nesting_depths(callees: Mapping[FunctionId, set[FunctionId]], name: str) -> dict[FunctionId, int]:
    """Depth of each function's call tree (1 = calls nothing); raises on a cycle.

    Iterative depth-first search, so deep chains cannot overflow Python's stack.
    """
    depth: dict[FunctionId, int] = {}
    on_path: dict[FunctionId, int] = {}
    for start in sorted(callees):
        if start in depth:
            continue
        path = [start]
        on_path[start] = 0
        stack = [iter(sorted(callees[start]))]
        while stack:
            callee = next(stack[-1], None)
            if callee is None:
                stack.pop()
                done = path.pop()
                del on_path[done]
                depth[done] = 1 + max((depth[c] for c in callees[done]), default=0)
                continue
            if callee in on_path:
                cycle = path[on_path[callee] :] + [callee]
                raise InvalidModelFileError(
                    f"{name}: functions call each other recursively: "
                    + " -> ".join(function_label(f) for f in cycle)
                    + ". ONNX functions cannot be recursive."
                )
            if callee in depth:
                continue
            on_path[callee] = len(path)
            path.append(callee)
            stack.append(iter(sorted(callees[callee])))
    return depth


def _strings(model: onnx.ModelProto) -> Iterable[tuple[str, str | bytes]]:
    """(where, value) of every name, domain and metadata string the tools read."""

    def of_props(where, entries):
        for entry in entries:
            yield where + " metadata key", entry.key
            yield where + f" metadata {shown(entry.key)!r}", entry.value

    def of_values(where, values):
        for value in values:
            yield where, value.name

    def of_graph(graph, where):
        yield where + " name", graph.name
        yield from of_values(where + " input", graph.input)
        yield from of_values(where + " output", graph.output)
        yield from of_values(where + " value", graph.value_info)
        yield from of_values(where + " initializer", graph.initializer)
        yield from of_props(where, graph.metadata_props)
        yield from of_nodes(graph.node, where)

    def of_nodes(nodes, where):
        for node in all_nodes(nodes):
            yield where + " node", node.name
            yield where + " node domain", node.domain
            yield where + " node op_type", node.op_type
            yield where + " node overload", node.overload
            for value in (*node.input, *node.output):
                yield where + f" node {shown(node.name)!r} value", value
            yield from of_props(where + f" node {shown(node.name)!r}", node.metadata_props)

    yield from of_props("the model", model.metadata_props)
    for opset in model.opset_import:
        yield "an opset import domain", opset.domain
    yield from of_graph(model.graph, "the graph")
    for function in model.functions:
        yield "a function name", function.name
        yield "a function domain", function.domain
        yield "a function overload", function.overload
        where = f"function {function_label(function_id(function))}"
        for value in (*function.input, *function.output):
            yield where + " formal", value
        yield from of_props(where, function.metadata_props)
        yield from of_nodes(function.node, where)
        for node in all_nodes(function.node):
            for subgraph in subgraphs(node):
                yield where + " subgraph name", subgraph.name


def _check_text(model: onnx.ModelProto, name: str) -> None:
    for where, value in _strings(model):
        if isinstance(value, bytes):
            raise InvalidModelFileError(
                f"{name}: {where} '{shown(value)}' is not valid UTF-8, as ONNX requires of every string "
                "(the file is corrupted, or was written by a tool that does not encode names)."
            )


def expanded_size(model: onnx.ModelProto) -> tuple[int, int]:
    """(nodes, calls) of the model once every call of a local function is replaced by its body, recursively.

    Dynamic programming over the (acyclic) call graph, callees first: a function's size is
    its nodes (If/Loop/Scan subgraphs included), each call counting as the size of its
    callee; its calls are its call nodes plus their callees' calls. Nothing is expanded,
    so a call-expansion bomb costs its file size.
    """
    functions = {function_id(f): f for f in model.functions}
    size: dict[FunctionId, tuple[int, int]] = {}

    def nodes_size(nodes: Iterable[onnx.NodeProto]) -> tuple[int, int]:
        total, calls = 0, 0
        for node in all_nodes(nodes):
            nid = node_id(node)
            if nid in functions:
                inner_nodes, inner_calls = size.get(nid, (1, 0))
                total += inner_nodes
                calls += 1 + inner_calls
            else:
                total += 1
        return total, calls

    callees = {
        fid: list(dict.fromkeys(c for node in all_nodes(f.node) if (c := node_id(node)) in functions))
        for fid, f in functions.items()
    }
    # Iterative post-order over the call graph (callees first), so deep chains cannot
    # overflow Python's stack; a cycle is refused rather than followed.
    state: dict[FunctionId, int] = {}
    for start in functions:
        if start in state:
            continue
        state[start] = 1
        stack = [(start, iter(callees[start]))]
        while stack:
            fid, pending = stack[-1]
            callee = next(pending, None)
            if callee is None:
                stack.pop()
                state[fid] = 2
                size[fid] = nodes_size(functions[fid].node)
            elif callee not in state:
                state[callee] = 1
                stack.append((callee, iter(callees[callee])))
            elif state[callee] == 1:
                raise InvalidModelFileError(
                    f"Functions call each other recursively ({function_label(callee)}); ONNX functions cannot be recursive."
                )
    return nodes_size(model.graph.node)


def _limit(variable: str, default: int) -> int:
    text = os.environ.get(variable, "").strip()
    return int(text) if text.isdigit() else default


def max_expanded_calls() -> int:
    """:data:`MAX_EXPANDED_CALLS`, or ``ONNX_MODULAR_MAX_EXPANDED_CALLS`` when set (the tree's limit too)."""
    return _limit(_CALLS_VARIABLE, MAX_EXPANDED_CALLS)


def check_expanded_size(model: onnx.ModelProto, *, name: str = "the model") -> tuple[int, int]:
    """Refuse a model whose calls expand to more than :data:`MAX_EXPANDED_NODES` nodes or
    :data:`MAX_EXPANDED_CALLS` calls (raised by the environment variables
    ``ONNX_MODULAR_MAX_EXPANDED_NODES`` and ``ONNX_MODULAR_MAX_EXPANDED_CALLS``).

    Called before anything expands the calls: ``onnx.inliner`` (``inline``, the flat copy)
    and onnxruntime, which inlines every call when it creates a session (in time that grows
    with the square of the calls: 8,192 calls 0.5 s, 16,384 calls 2.3 s, 32,768 calls 17 s).

    Returns:
        (expanded nodes, expanded calls).

    Raises:
        InvalidModelFileError: Saying the expanded size, the limit and how to raise it.
    """
    _check_loop_trips(model, name)
    _check_known_opsets(model, name)
    nodes, calls = expanded_size(model)
    for what, count, variable, default in (
        ("nodes", nodes, _NODES_VARIABLE, MAX_EXPANDED_NODES),
        ("calls", calls, _CALLS_VARIABLE, MAX_EXPANDED_CALLS),
    ):
        limit = _limit(variable, default)
        if count > limit:
            raise InvalidModelFileError(
                f"{name}: its function calls expand to {count} {what} (more than the limit of {limit}); inlining "
                "it or running it in onnxruntime would take too long or exhaust memory. A file that expands "
                "that much is usually a call-expansion bomb; if the model is genuine, raise the limit with "
                f"the environment variable {variable}={count}."
            )
    return nodes, calls


def _constant_values(model: onnx.ModelProto) -> dict[str, onnx.TensorProto | int | bool]:
    """Every constant a node may read, by name: initializers and ``Constant`` outputs, in any graph."""
    values: dict[str, onnx.TensorProto | int | bool] = {}
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        for tensor in graph.initializer:
            values[tensor.name] = tensor
        for node in graph.node:
            graphs.extend(subgraphs(node))
    for node in all_nodes([*model.graph.node, *(n for f in model.functions for n in f.node)]):
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output:
            for attribute in node.attribute:
                if attribute.name == "value":
                    values[node.output[0]] = attribute.t
                elif attribute.name == "value_int":
                    values[node.output[0]] = attribute.i
    return values


def _scalar(value: onnx.TensorProto | int | bool | None) -> int | None:
    if value is None or isinstance(value, (int, bool)):
        return value
    if value.data_location == onnx.TensorProto.EXTERNAL or len(value.dims) > 1 or any(d != 1 for d in value.dims):
        return None
    try:
        array = onnx.numpy_helper.to_array(value)
    except Exception:
        return None
    return int(array.reshape(-1)[0]) if array.size == 1 else None


def _check_loop_trips(model: onnx.ModelProto, name: str) -> None:
    """Refuse a ``Loop`` whose trip count is a constant above :data:`MAX_LOOP_TRIPS`
    (``ONNX_MODULAR_MAX_LOOP_TRIPS`` raises it), whatever its condition: a condition computed at run
    time may never turn false (2**62 trips hung verify, split, run_stages and profile). A trip count
    decided at run time (computed, or none: torch's ``EmbeddingBag`` exports a ``while`` loop) cannot
    be told here: unless it comes from tensor shapes only, the runs that follow in this context (the
    command) get a time limit (:func:`loop_run_seconds`, ``ONNX_MODULAR_LOOP_SECONDS``) after which
    onnxruntime is stopped."""
    nodes = [n for n in all_nodes([*model.graph.node, *(n for f in model.functions for n in f.node)]) if n.op_type == "Loop"]
    if not nodes:
        return
    limit = _limit(_TRIPS_VARIABLE, MAX_LOOP_TRIPS)
    constants = _constant_values(model)
    producers: dict[str, onnx.NodeProto] = {}
    for body in (model.graph.node, *(f.node for f in model.functions)):
        producers.update({output: n for n in all_nodes(body) for output in n.output if output})
    for node in nodes:
        count = node.input[0] if len(node.input) > 0 else ""
        trips = _scalar(constants.get(count)) if count else None
        if trips is not None and trips <= limit:
            continue
        if trips is None:
            if count in constants or (count and _from_shapes(count, producers, constants, limit)):
                continue  # a constant not read here (external, values left out), or bounded by tensor sizes
            _LOOP_SECONDS.set(_limit(LOOP_SECONDS_VARIABLE, LOOP_RUN_SECONDS))
            continue
        raise InvalidModelFileError(
            f"{name}: the Loop {shown(node.name)!r} may run {trips} iterations (more than the limit of {limit}); running "
            "it would not end in reasonable time or memory. If the model is genuine, raise the limit with the "
            f"environment variable {_TRIPS_VARIABLE}={trips}."
        )


def loop_run_seconds() -> int | None:
    """The time limit of a run in this context once :func:`check_expanded_size` checked a model holding
    a ``Loop`` whose trip count is decided at run time; ``None`` before."""
    return _LOOP_SECONDS.get()


#: Ops through which a trip count computed from tensor shapes stays bounded by those shapes.
_SHAPE_ARITHMETIC = frozenset({
    "Gather", "Squeeze", "Unsqueeze", "Cast", "Concat", "Slice", "Reshape", "Identity", "Min", "Max", "Add", "Sub",
    "Mul", "Div", "Floor", "Ceil", "Abs", "ReduceMax", "ReduceMin", "ReduceSum", "ReduceProd", "Expand", "Flatten",
})  # fmt: skip


def _from_shapes(value: str, producers: Mapping[str, onnx.NodeProto], constants, limit: int) -> bool:
    """Whether ``value`` is computed only from tensor shapes (``Shape``, ``Size``) and small constants
    through shape arithmetic: a trip count bounded by the sizes of real tensors, not by their values."""
    pending, seen = [value], set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        if len(seen) > 256:
            return False
        if name in constants:
            constant = constants[name]
            if isinstance(constant, (int, bool)):
                if abs(int(constant)) > limit:
                    return False
                continue
            try:
                array = onnx.numpy_helper.to_array(constant)
            except Exception:
                return False
            if array.size > 64 or array.dtype.kind not in "iub" or (array.size and abs(array).max() > limit):
                return False
            continue
        node = producers.get(name)
        if node is None or node.domain not in ("", "ai.onnx"):
            return False  # an input, or a value computed by anything else: decided by data
        if node.op_type in ("Shape", "Size"):
            continue
        if node.op_type not in _SHAPE_ARITHMETIC:
            return False
        pending.extend(i for i in node.input if i)
    return True


def _check_known_opsets(model: onnx.ModelProto, name: str) -> None:
    """Refuse a standard-domain opset newer than this onnx knows: onnx's inliner and checker, and
    onnxruntime, would each fail their own way (a file claiming opset 2**63-1 is no model)."""
    known = onnx.defs.onnx_opset_version()
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version > known:
            raise InvalidModelFileError(
                f"{name} imports the ONNX opset {opset.version}; the installed onnx knows opsets up to {known}.",
                hint="Convert the model to a known opset, or upgrade onnx and onnxruntime if this one is genuine.",
            )
