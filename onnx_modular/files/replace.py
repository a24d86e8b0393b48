"""Put an edited block back: a model's graph becomes the body of a module call's function.

``replace("gpt2.onnx", "GPT2Block", "block.onnx", "new.onnx")`` makes the graph of
``block.onnx`` (an extracted model after quantization or hand optimization, from any producer)
the body of every ``GPT2Block`` function; ``replace(..., "h.1", ...)`` does it for that call
alone, which then gets a function of its own (and so do the functions of its callers that
other calls share, :func:`onnx_modular.calls.targets.specialize`).

The block's inputs must be formal inputs of the function and its outputs the function's
outputs, by name, element type and rank. Its initializers become formal inputs of the new
body, fed at each call from new main-graph initializers (``<call path>.<name>`` for a path,
``<function>.<name>`` for a class), threaded through the callers' bodies as weights are. An
initializer that is also a graph input and has a formal's name (the per-call weights of a
class extraction) stays an input: each call keeps feeding its own. Formal inputs the new body
no longer reads are dropped from it and from its callers, and weights nothing reads any more
leave the file.

The result is checked (``onnx.checker`` full check), run in onnxruntime against the original
file on the same inputs (the largest differences are reported: editing may change the
outputs), and saved atomically.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping

import numpy as np
import onnx
import onnx.numpy_helper
import onnx.shape_inference

from onnx_modular.calls import targets as _calls
from onnx_modular.check.drift import measure
from onnx_modular.errors import InvalidInputError
from onnx_modular.format import metadata
from onnx_modular.passes.export import opset_conversion as opset
from onnx_modular.runtime import sessions as runtime
from onnx_modular.runtime.inputs import feeds_for
from onnx_modular.storage import save
from onnx_modular.storage.checks import check_expanded_size
from onnx_modular.storage.load import load_external_data, load_model_file
from onnx_modular.storage.proto import FunctionId, all_nodes, function_id, function_label, node_id

__all__ = ["replace", "Replacement"]


@dataclasses.dataclass
class Replacement:
    """What :func:`replace` wrote.

    Attributes:
        functions: The functions whose body is now the block.
        call_names: The calls that run the block.
        weights: The new main-graph initializers (the block's), by name.
        max_abs: Per output of the model, the largest difference from the original file.
    """

    source: str
    output: str
    functions: list[str]
    call_names: list[str]
    weights: list[str]
    max_abs: dict[str, float]

    def __str__(self) -> str:
        worst = max(self.max_abs.values(), default=0.0)
        lines = [
            (
                f"Wrote {self.output}: the body of {', '.join(self.functions)} replaced for "
                f"{len(self.call_names)} call(s) ({', '.join(self.call_names)}); {len(self.weights)} new initializers"
            ),
            f"against {self.source} on the same inputs: max abs difference {worst:.3g}",
        ]
        lines += [f"  {name}: {value:.3g}" for name, value in self.max_abs.items()]
        return "\n".join(lines)


def _type(value: onnx.ValueInfoProto | None) -> tuple[int, int | None] | None:
    """(element type, rank or None) of a tensor value info; None when it declares no type."""
    if value is None or not value.type.HasField("tensor_type"):
        return None
    tensor_type = value.type.tensor_type
    return tensor_type.elem_type, len(tensor_type.shape.dim) if tensor_type.HasField("shape") else None


def _fits(want: tuple[int, int | None] | None, got: tuple[int, int | None] | None) -> bool:
    """Same element type and rank, where both are declared."""
    if want is None or got is None:
        return True
    return want[0] == got[0] and (want[1] is None or got[1] is None or want[1] == got[1])


def _lying_dim(want: onnx.ValueInfoProto, got: onnx.ValueInfoProto) -> tuple[int, int, int] | None:
    """(axis, the function's size, the block's size) of the first fixed dimension the block declares
    otherwise than the function, where both fix it; None when none differs."""
    if _type(want) is None or _type(got) is None or _type(want)[1] != _type(got)[1]:
        return None
    for axis, (a, b) in enumerate(zip(want.type.tensor_type.shape.dim, got.type.tensor_type.shape.dim)):
        if a.HasField("dim_value") and b.HasField("dim_value") and a.dim_value != b.dim_value:
            return axis, a.dim_value, b.dim_value
    return None


def _type_text(kind: tuple[int, int | None]) -> str:
    elem = onnx.TensorProto.DataType.Name(kind[0]) if kind[0] in onnx.TensorProto.DataType.values() else kind[0]
    return f"{elem}, rank {kind[1] if kind[1] is not None else '?'}"


def _sorted_nodes(graph: onnx.GraphProto, block: str) -> list[onnx.NodeProto]:
    """The block's nodes in an order that computes every value before it is read (Kahn).

    Raises:
        InvalidInputError: The nodes form a cycle (one of its nodes is named).
    """
    producer = {}
    for index, node in enumerate(graph.node):
        for name in node.output:
            if name:
                producer[name] = index
    waiting = []
    readers: dict[int, list[int]] = {i: [] for i in range(len(graph.node))}
    for index, node in enumerate(graph.node):
        needs = set()
        for sub in all_nodes([node]):
            needs |= {producer[n] for n in sub.input if n in producer and producer[n] != index}
        waiting.append(len(needs))
        for source in needs:
            readers[source].append(index)
    ready = [i for i, count in enumerate(waiting) if count == 0]
    order = []
    while ready:
        index = ready.pop(0)
        order.append(index)
        for reader in readers[index]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                ready.append(reader)
    if len(order) < len(graph.node):
        stuck = next(graph.node[i] for i, count in enumerate(waiting) if count > 0)
        raise InvalidInputError(
            f"The block {block!r} has a cycle: node {stuck.name or stuck.op_type!r} ({stuck.op_type}) "
            "depends on its own output.",
            hint="A block must be a graph without cycles; check the tool that wrote it.",
        )
    return [graph.node[i] for i in order]


def _check_opsets(block: onnx.ModelProto, model: onnx.ModelProto, text: str) -> onnx.ModelProto:
    """The block at the model's opset of the default domain (converted when it differs).

    Raises:
        InvalidInputError: The block's default opset is outside what onnx_modular converts and
            onnxruntime runs, or another domain's version differs from the model's.
    """
    versions = {o.domain or "": o.version for o in model.opset_import}
    wanted = versions.get("", None)
    own = {o.domain or "": o.version for o in block.opset_import}
    default = own.get("", own.get("ai.onnx"))
    possible = opset.supported_opsets()
    if default is not None and default not in possible:
        raise InvalidInputError(
            f"The block {text!r} uses opset {default} of the default domain; onnx_modular converts opsets "
            f"{possible.start} to {possible.stop - 1}.",
            hint="Convert the block to the model's opset "
            f"({wanted}) first (onnx.version_converter), or export it at a supported opset.",
        )
    for domain, version in own.items():
        if domain not in ("", "ai.onnx") and domain in versions and versions[domain] != version:
            raise InvalidInputError(
                f"The block {text!r} imports version {version} of the domain {domain!r}; the model imports {versions[domain]}.",
                hint="Use the model's version of that domain in the block.",
            )
    if default is not None and wanted is not None and default != wanted:
        import onnx_ir as ir

        converted = ir.from_proto(block)
        opset.ConvertOpsetPass(wanted)(converted)
        block = ir.to_proto(converted)
    return block


def _check_signature(graph: onnx.GraphProto, function: onnx.FunctionProto, text: str, where: str) -> list[str]:
    """The block's inputs that are formal inputs of ``function``; a typed error at the first mismatch."""
    declared = {value.name: value for value in function.value_info}
    initializers = {tensor.name for tensor in graph.initializer}
    formals = list(function.input)
    label = function.name

    def mismatch(message: str) -> InvalidInputError:
        return InvalidInputError(
            f"The block {text!r} does not fit {label}: {message}.",
            module_path=where,
            hint=f"The block's inputs must be formal inputs of {label} ({', '.join(formals)}) and its outputs "
            f"its outputs ({', '.join(function.output)}), with the same element types and ranks.",
        )

    inputs = []
    for value in graph.input:
        if value.name not in formals:
            if value.name in initializers:
                continue  # an overridable initializer of its own: a weight
            raise mismatch(f"its input {value.name!r} is not an input of {label}")
        want, got = _type(declared.get(value.name)), _type(value)
        if not _fits(want, got):
            raise mismatch(f"its input {value.name!r} is {_type_text(got)}; {label} takes {_type_text(want)}")
        inputs.append(value.name)
    outputs = [value.name for value in graph.output]
    computed = {name for node in graph.node for name in node.output if name} | {v.name for v in graph.input} | initializers
    for name in outputs:
        if name not in computed:
            raise mismatch(f"no node computes its output {name!r}")
    for value in [*graph.input, *graph.output]:
        if value.name in declared:
            lying = _lying_dim(declared[value.name], value)
            if lying is not None:
                raise mismatch(f"{value.name!r} declares dimension {lying[0]} as {lying[2]}; {label} has {lying[1]}")
    if len(outputs) != len(function.output):
        raise mismatch(f"it has {len(outputs)} outputs ({', '.join(outputs)}); {label} has {len(function.output)}")
    for value, name in zip(graph.output, function.output):
        if value.name != name:
            raise mismatch(f"its output {value.name!r} is where {label} returns {name!r}")
        want, got = _type(declared.get(name)), _type(value)
        if not _fits(want, got):
            raise mismatch(f"its output {name!r} is {_type_text(got)}; {label} returns {_type_text(want)}")
    return inputs


def _same_as_fed(model: onnx.ModelProto, fid: FunctionId, graph: onnx.GraphProto, inputs: list[str]) -> list[str]:
    """The block's initializers named like a formal input that every call already feeds from an
    initializer of the same value (the constants and unchanged weights of an extracted block):
    they stay formal inputs, fed as before, instead of becoming copies."""
    function = next(f for f in model.functions if function_id(f) == fid)
    formals = list(function.input)
    sites = [c for c in _calls.module_calls(model).values() if function_id(c.function) == fid]
    main = {tensor.name: tensor for tensor in model.graph.initializer}
    same = []
    for tensor in graph.initializer:
        if tensor.name in inputs or tensor.name not in formals or not sites:
            continue
        value = onnx.numpy_helper.to_array(tensor)
        sources = [_calls.initializer_source(model, site, formals.index(tensor.name)) for site in sites]
        if all(
            source is not None
            and main[source].data_type == tensor.data_type
            and np.array_equal(onnx.numpy_helper.to_array(main[source]), value, equal_nan=True)
            for source in sources
        ):
            same.append(tensor.name)
    return same


def _merge_functions(model: onnx.ModelProto, block: onnx.ModelProto) -> None:
    """Add the block's functions to the model; one that computes what the model's function of the
    same name computes (:func:`~onnx_modular.passes.export.dedupe.function_fingerprint`) is shared,
    another of that name is renamed (and the block's calls of it follow)."""
    import onnx_ir as ir

    from onnx_modular.passes.export.dedupe import function_fingerprint

    def same(a: onnx.FunctionProto, b: onnx.FunctionProto) -> bool:  # as dedupe sees it: the computation
        return a == b or function_fingerprint(ir.serde.deserialize_function(a)) == function_fingerprint(
            ir.serde.deserialize_function(b)
        )

    existing = {function_id(f): f for f in model.functions}
    renames: dict[FunctionId, str] = {}
    for function in block.functions:
        fid = function_id(function)
        if fid in existing and same(existing[fid], function):
            continue
        if fid in existing:
            taken = {f.name for f in model.functions if f.domain == function.domain} | set(renames.values())
            renames[fid] = _calls.function_name(function.name, taken)
    bodies = [block.graph, *block.functions]
    for body in bodies:
        for node in all_nodes(body.node):
            if node_id(node) in renames:
                node.op_type = renames[node_id(node)]
    for function in block.functions:
        fid = function_id(function)
        if fid in renames:
            function.name = renames[fid]
        elif fid in existing:
            continue
        copy = model.functions.add()
        copy.CopyFrom(function)
    have = {o.domain for o in model.opset_import}
    for entry in block.opset_import:
        if entry.domain not in have and entry.domain != "ai.onnx":
            model.opset_import.add(domain=entry.domain, version=entry.version)


def _call_sites(model: onnx.ModelProto, fid: FunctionId):
    """(body, node) for every call of ``fid``; body is the main graph or the enclosing function."""
    for body in [model.graph, *model.functions]:
        for node in all_nodes(body.node):
            if node_id(node) == fid:
                yield body, node


def _callers(model: onnx.ModelProto, fids: set[FunctionId]) -> list[onnx.FunctionProto]:
    """The functions that call any of ``fids``, directly or through others."""
    found: dict[FunctionId, onnx.FunctionProto] = {}
    frontier = set(fids)
    while frontier:
        new = set()
        for function in model.functions:
            fid = function_id(function)
            if fid not in found and any(node_id(n) in frontier for n in all_nodes(function.node)):
                found[fid] = function
                new.add(fid)
        frontier = new
    return list(found.values())


def _prune_formals(model: onnx.ModelProto, functions: list[onnx.FunctionProto]) -> None:
    """Drop the formal inputs these functions no longer read, and the arguments of their calls."""
    changed = True
    while changed:
        changed = False
        for function in functions:
            read = {name for node in all_nodes(function.node) for name in node.input} | set(function.output)
            unused = [i for i, name in enumerate(function.input) if name not in read]
            if not unused:
                continue
            changed = True
            fid = function_id(function)
            sites = [node for _, node in _call_sites(model, fid)]
            for index in reversed(unused):
                del function.input[index]
                for node in sites:
                    if index < len(node.input):
                        del node.input[index]
            kept = set(function.input) | set(function.output)
            kept |= {n for node in all_nodes(function.node) for n in (*node.input, *node.output)}
            values = [v for v in function.value_info if v.name in kept]
            del function.value_info[:]
            function.value_info.extend(values)


def _feed(model: onnx.ModelProto, body, main_name: str, memo: dict) -> str:
    """The name under which ``body`` sees the main-graph value ``main_name`` (new formal inputs
    of the body and of its callers, up to the main graph, as weights are passed)."""
    if body is model.graph:
        return main_name
    key = (function_id(body), main_name)
    if key in memo:
        return memo[key]
    formal = _calls.unique_name(main_name, _calls.body_names(body))
    memo[key] = formal
    body.input.append(formal)
    for outer, node in list(_call_sites(model, function_id(body))):
        while len(node.input) < len(body.input) - 1:
            node.input.append("")
        node.input.append(_feed(model, outer, main_name, memo))
    return formal


def _new_body(
    function: onnx.FunctionProto, block: onnx.ModelProto, nodes, kept: list[str], weights: list[onnx.TensorProto], body_path: str | None, text: str
) -> onnx.FunctionProto:
    graph = block.graph
    body = onnx.FunctionProto(name=function.name, domain=function.domain, overload=function.overload)
    body.input.extend(kept + [t.name for t in weights])
    body.output.extend(value.name for value in graph.output)
    body.node.extend(nodes)
    own = {o.domain for o in function.opset_import}
    body.opset_import.extend(function.opset_import)
    used = {node.domain for node in all_nodes(nodes)}
    for entry in block.opset_import:
        if entry.domain in used and entry.domain not in own and entry.domain != "ai.onnx":
            body.opset_import.add(domain=entry.domain, version=entry.version)
    declared = {value.name: value for value in [*graph.input, *graph.output, *graph.value_info]}
    body.value_info.extend(declared[name] for name in kept if name in declared)
    body.value_info.extend(
        onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in weights
    )
    body.value_info.extend(v for v in [*graph.output, *graph.value_info] if v.name not in set(kept))
    body.metadata_props.extend(e for e in function.metadata_props if e.key != metadata.NO_OP_CALLS)
    block_no_ops = metadata.props(graph).get(metadata.NO_OP_CALLS)
    if block_no_ops:
        body.metadata_props.add(key=metadata.NO_OP_CALLS, value=block_no_ops)
    if body_path is not None:
        _calls.rebase_body(body, metadata.body_module_path(block), body_path)
    body.doc_string = (function.doc_string + "\n" if function.doc_string else "") + f"Body replaced from {os.path.basename(text)}."
    return body


def _check_fits_calls(result, labels: list[str], text: str) -> None:
    """onnx's full check (shape inference through every call) of the edited model, before it is
    written: a block whose static shapes or constants fit one function of a class but not
    another is the user's to fix, not a bug of the save."""
    import onnx_ir as ir

    proto = ir.to_proto(result)
    if proto.ByteSize() >= 2**31 - 2**24:  # too big for an in-memory check: the save checks the file
        return
    try:
        onnx.checker.check_model(proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise InvalidInputError(
            f"With the block {text!r} as the body of {', '.join(labels)}, the model is not valid: "
            f"{runtime.first_line(e)}",
            hint="The block's shapes or constants fit some calls but not these; replace one module path, "
            "or one function by its name (`onnx-modular tree` shows them), with a block extracted from it.",
        ) from e


def _in_place(path: str | os.PathLike, out: str | os.PathLike, in_place: bool) -> bool:
    """Whether ``out`` is ``path``: refused unless ``in_place``; ``in_place`` needs it."""
    same = isinstance(out, (str, os.PathLike)) and os.path.realpath(out) == os.path.realpath(path)
    if in_place and not same:
        raise InvalidInputError(
            f"in_place writes the input file {str(path)!r}, but the output is {str(out)!r}.",
            hint="Leave -o out with --in-place (or give the input's path), or drop --in-place to write a new file.",
        )
    if same and not in_place:
        raise InvalidInputError(
            f"The output {str(out)!r} is the input file; replace writes a new file unless asked to edit in place.",
            hint="Add --in-place (replace(..., in_place=True)) to edit the file itself, or give -o another path.",
        )
    return same


def replace(
    path: str | os.PathLike,
    target: str,
    block: str | os.PathLike,
    out: str | os.PathLike,
    *,
    inputs: str | os.PathLike | Mapping[str, np.ndarray] | None = None,
    in_place: bool = False,
) -> Replacement:
    """Make the graph of ``block`` the body of the function of ``target``, and save the result.

    Args:
        path: The modular ``.onnx`` file.
        target: A class (``GPT2Block``: every call of it) or a call path (``h.1``: that call
            alone, which gets a function of its own).
        block: An ONNX model whose inputs and outputs are the function's formals (by name,
            element type and rank), e.g. one written by :func:`onnx_modular.files.extract.extract`.
        out: The file to write (atomically; an existing file is replaced only on success).
        inputs: The inputs of the check against the original file (an ``.npz`` or arrays by
            name); random ones from the declared shapes (seed 0) by default.
        in_place: ``out`` is ``path`` itself (asked for, never by accident): the file is read whole,
            the result written atomically over it, its previous data file retired after the move.

    Returns:
        The replaced functions and calls, the new initializers, and the largest difference
        of each output from the original file.

    Raises:
        InvalidInputError: Unknown call or class (closest names listed), a block that does not
            fit (the first mismatching input or output is named), a block with a cycle or an
            opset that cannot be converted.
        InvalidModelFileError: A file cannot be read, or calls a function it does not hold.
        SaveError: The result cannot be written or the ONNX checker rejects it.

    Example::

        print(replace("gpt2.onnx", "GPT2Block", "blocks/GPT2Block/model.onnx", "gpt2.edited.onnx"))
    """
    import onnx_ir as ir

    from onnx_modular.passes.export.remove_unused import RemoveUnusedPass

    destination = save.check_destination(out, reads=[block] if _in_place(path, out, in_place) else [path, block])
    text = str(block)
    model = load_model_file(path)
    edited = load_model_file(block)
    # Both are expanded by onnxruntime (the check of the result): a call bomb is refused before any work,
    # as tree and verify refuse it; then only the bytes each tensor references are read.
    check_expanded_size(model, name=repr(str(path)))
    check_expanded_size(edited, name=repr(text))
    load_external_data(model, pathlib.Path(path).parent, name=repr(str(path)), model_path=path)
    load_external_data(edited, pathlib.Path(block).parent, name=repr(text), model_path=block)
    edited = _check_opsets(edited, model, text)
    nodes = _sorted_nodes(edited.graph, text)
    selected = _calls.resolve_target(model, target)
    work = onnx.ModelProto()
    work.CopyFrom(model)
    if selected.is_class:
        calls = _calls.module_calls(work)
        functions = {function_id(f): f for f in work.functions}
        plan = [(fid, selected.calls_of(fid, calls), metadata.body_module_path(functions[fid])) for fid in selected.functions]
        prefix = {fid: fid[1] for fid in selected.functions}
    else:
        name = selected.call_names[0]
        call = _calls.specialize(work, name, including_call=True)
        plan = [(function_id(call.function), [name], metadata.strip_call_index(name))]
        prefix = {plan[0][0]: metadata.strip_call_index(name)}
    functions = {function_id(f): f for f in work.functions}
    signatures = [_check_signature(edited.graph, functions[fid], text, names[0]) for fid, names, _ in plan]
    _merge_functions(work, edited)
    added: list[str] = []
    lifted = [*metadata.lifted_constants(work)]
    block_lifted = metadata.lifted_constants(edited)
    for (fid, names, body_path), kept_inputs in zip(plan, signatures):
        old = functions[fid]
        kept_inputs = kept_inputs + _same_as_fed(work, fid, edited.graph, kept_inputs)
        kept = [name for name in old.input if name in kept_inputs]
        weights = [t for t in edited.graph.initializer if t.name not in kept]
        formals = list(old.input)
        for _, node in _call_sites(work, fid):
            actuals = [node.input[formals.index(k)] if formals.index(k) < len(node.input) else "" for k in kept]
            del node.input[:]
            node.input.extend(actuals)
        body = _new_body(old, edited, nodes, kept, weights, body_path, text)
        inner = {function_id(f) for f in _calls.used_functions(work, body.node)}
        if fid in inner:
            raise InvalidInputError(
                f"The block {text!r} calls {old.name} itself (directly or through its functions): as the body of "
                f"{old.name} it would call itself, which ONNX forbids.",
                module_path=names[0],
                hint=f"Give a block extracted from {old.name} (`onnx-modular extract ... {old.name}`), not from a "
                "module that contains it.",
            )
        index = next(i for i, f in enumerate(work.functions) if function_id(f) == fid)
        work.functions[index].CopyFrom(body)
        _prune_formals(work, _callers(work, {fid}))
        used = {n for node in all_nodes(work.graph.node) for n in node.input} | {v.name for v in work.graph.output}
        kept_initializers = [t for t in work.graph.initializer if t.name in used]
        del work.graph.initializer[:]
        work.graph.initializer.extend(kept_initializers)
        taken = _calls.body_names(work.graph)
        memo: dict = {}
        new_formals = list(work.functions[index].input)[len(kept) :]
        for tensor, formal in zip(weights, new_formals):
            main = onnx.TensorProto()
            main.CopyFrom(tensor)
            main.name = _calls.unique_name(f"{prefix[fid]}.{tensor.name}", taken)
            work.graph.initializer.append(main)
            added.append(main.name)
            if tensor.name in block_lifted:
                lifted.append(main.name)
            for outer, node in list(_call_sites(work, fid)):
                while len(node.input) < len(kept) + new_formals.index(formal):
                    node.input.append("")
                node.input.append(_feed(work, outer, main.name, memo))
    result = ir.from_proto(work)
    RemoveUnusedPass()(result)
    lifted = [name for name in dict.fromkeys(lifted) if name in result.graph.initializers]
    if lifted:
        result.metadata_props[metadata.LIFTED_CONSTANTS] = json.dumps(lifted)
    else:
        result.metadata_props.pop(metadata.LIFTED_CONSTANTS, None)
    _check_fits_calls(result, [function_label(fid) for fid, _, _ in plan], text)
    feeds = feeds_for(model, inputs)
    names, expected = runtime.run(str(path), feeds, what="original model")
    with save.staged_save(result, destination) as staged:
        _, actual = runtime.run(str(staged), feeds, what="model with the new body")
    differences = {n: measure(a, e).max_abs for n, a, e in zip(names, actual, expected)}
    all_calls = [name for _, names_, _ in plan for name in names_]
    return Replacement(
        str(path), str(out), [function_label(fid) for fid, _, _ in plan], all_calls, added, differences
    )

