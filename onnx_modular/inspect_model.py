"""Read any ONNX file with local functions: checked loading, the call tree, inlining, parity.

Nothing here needs PyTorch or a file written by onnx_modular: the functions work on
the ``onnx.ModelProto`` of any model whose local functions call each other. Files
written by onnx_modular carry extra information (module paths and classes in the
``pkg.onnx_modular.*`` metadata) that the tree shows when it is there.

Example::

    from onnx_modular.inspect_model import function_tree, load_model_file

    model = load_model_file("gpt2.onnx")     # InvalidModelFileError on a bad file
    tree = function_tree(model)
    print(tree.format(max_depth=2))
    block = next(call for call in tree.walk() if call.function == "GPT2Block")
    print(block.call_count, block.num_nodes, block.parameters)
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import math
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx.inliner
from google.protobuf import message as protobuf_message

from onnx_modular import verification
from onnx_modular.errors import InvalidInputError, InvalidModelFileError

__all__ = [
    "MAX_DIMENSION",
    "MAX_NESTING",
    "MAX_TREE_CALLS",
    "FunctionId",
    "TreeNode",
    "load_model_file",
    "check_model_structure",
    "function_tree",
    "inline_file",
    "model_inputs",
    "random_inputs",
    "check_feeds",
    "OutputDifference",
    "InlineParity",
    "compare_with_inlined",
]

#: Larger declared dimensions are refused: no real tensor has 2**40 elements along one axis,
#: and anything that tried to allocate it would exhaust memory.
MAX_DIMENSION = 2**40
#: Deepest nesting of function calls accepted (real models nest fewer than 20 levels).
MAX_NESTING = 200
#: Largest number of calls the expanded tree may hold (a function called from a function
#: called N times counts N times). Guards against exponential expansion of shared bodies.
MAX_TREE_CALLS = 200_000
#: Protobuf cannot parse a message of 2 GiB or more.
_PROTOBUF_LIMIT = 2**31

_METADATA_CLASS = "pkg.onnx_modular.class"
_METADATA_MODULE_PATH = "pkg.onnx_modular.module_path"
_METADATA_MODULE_PATHS = "pkg.onnx_modular.module_paths"

#: ``(domain, name, overload)``, as ``onnx_ir.OperatorIdentifier``.
FunctionId = tuple[str, str, str]


def _function_label(function_id: FunctionId) -> str:
    domain, name, overload = function_id
    label = f"{domain}:{name}" if domain else name
    return f"{label}:{overload}" if overload else label


def _is_standard_domain(domain: str) -> bool:
    """Domains whose operators come from a schema, not from a local function."""
    return domain in ("", "ai.onnx") or domain.startswith(("ai.onnx.", "com.microsoft"))


# -- loading -----------------------------------------------------------------------------


_WIRE_VARINT, _WIRE_FIXED64, _WIRE_LENGTH, _WIRE_FIXED32 = 0, 1, 2, 5


def _read_varint(data: bytes, position: int) -> tuple[int, int] | None:
    """(value, next position), or ``None`` when the varint runs past the end or is too long."""
    value, shift = 0, 0
    while position < len(data) and shift < 64:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
    return None


def _expected_wire_type(field: Any) -> int:
    if field.type == field.TYPE_MESSAGE or field.type == field.TYPE_STRING or field.type == field.TYPE_BYTES:
        return _WIRE_LENGTH
    return _WIRE_VARINT


def _sniff_format(data: bytes) -> str:
    """A guess at what a non-ONNX file is, to make the error message useful."""
    if data.startswith(b"PK\x03\x04"):
        return " (it looks like a zip archive, e.g. a PyTorch .pt/.pth checkpoint)"
    if data.startswith(b"\x89HDF"):
        return " (it looks like an HDF5 file, e.g. a Keras model)"
    if data[:1] in (b"{", b"["):
        return " (it looks like JSON)"
    if data.startswith(b"\x80") and data[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return " (it looks like a Python pickle)"
    head = data[:256]
    if head and all(32 <= b < 127 or b in (9, 10, 13) for b in head):
        return " (it looks like a text file)"
    return ""


def _scan_model_fields(data: bytes, path: str) -> set[int]:
    """Walk the top-level fields of a serialized ModelProto without parsing them.

    Tells a file that is not ONNX at all (its first field is not a ModelProto field)
    from an ONNX file that was cut short (a field declares more bytes than remain),
    before protobuf's generic "Error parsing message" could blur the two.

    Returns:
        The field numbers present.
    """
    fields = onnx.ModelProto.DESCRIPTOR.fields_by_number
    present: set[int] = set()
    position = 0
    while position < len(data):
        tag = _read_varint(data, position)
        if tag is None:
            break
        key, after_tag = tag
        number, wire_type = key >> 3, key & 7
        field = fields.get(number)
        if not present and (field is None or wire_type != _expected_wire_type(field)):
            raise InvalidModelFileError(f"{path!r} is not an ONNX model file{_sniff_format(data)}.")
        if wire_type == _WIRE_VARINT:
            value = _read_varint(data, after_tag)
            if value is None:
                break
            position = value[1]
        elif wire_type == _WIRE_LENGTH:
            length = _read_varint(data, after_tag)
            if length is None:
                break
            size, start = length
            if start + size > len(data):
                name = field.name if field is not None else f"field {number}"
                raise InvalidModelFileError(
                    f"{path!r} is truncated: its {name!r} part declares {size} bytes but only "
                    f"{len(data) - start} remain (file size {len(data)} bytes). The file was cut short "
                    "while being written or copied; export or download it again."
                )
            position = start + size
        elif wire_type == _WIRE_FIXED64:
            position = after_tag + 8
        elif wire_type == _WIRE_FIXED32:
            position = after_tag + 4
        else:
            raise InvalidModelFileError(f"{path!r} is corrupted or not an ONNX model file{_sniff_format(data)}.")
        if position > len(data):
            break
        present.add(number)
    else:
        return present
    raise InvalidModelFileError(
        f"{path!r} is truncated: it ends in the middle of a field (file size {len(data)} bytes). "
        "Export or download it again."
    )


def load_model_file(
    path: str | os.PathLike, *, load_external_data: bool = False, check: bool = True
) -> onnx.ModelProto:
    """Load an ONNX file, refusing files that would crash, hang or exhaust memory later.

    Weights stored as external data are not read unless ``load_external_data`` is set;
    the call tree, the checks and the parameter counts only need their shapes.

    Args:
        path: The ``.onnx`` file.
        load_external_data: Also read the weights stored in external data files.
        check: Run :func:`check_model_structure` (recursion, missing functions, huge
            dimensions, nesting depth).

    Returns:
        The model.

    Raises:
        InvalidModelFileError: The file is missing, is not ONNX, is truncated or
            corrupted, or its structure is unusable. The message says which.

    Example::

        model = load_model_file("gpt2.onnx")
    """
    text = str(path)
    file = pathlib.Path(path)
    if not file.exists():
        raise InvalidModelFileError(f"{text!r} does not exist.")
    if file.is_dir():
        raise InvalidModelFileError(f"{text!r} is a directory, not an ONNX file.")
    try:
        size = file.stat().st_size
        if size >= _PROTOBUF_LIMIT:
            raise InvalidModelFileError(
                f"{text!r} is {size / 2**30:.1f} GiB; an ONNX file cannot exceed protobuf's 2 GiB limit "
                "(large weights go to external data), so it is corrupted or not ONNX."
            )
        data = file.read_bytes()
    except OSError as e:
        raise InvalidModelFileError(f"{text!r} cannot be read: {e.strerror or e}.") from e
    if not data:
        raise InvalidModelFileError(f"{text!r} is empty (0 bytes), not an ONNX model.")
    present = _scan_model_fields(data, text)
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (protobuf_message.DecodeError, RuntimeError, ValueError) as e:
        raise InvalidModelFileError(f"{text!r} is corrupted: protobuf cannot decode it ({e}).") from e
    del data
    graph_field = onnx.ModelProto.DESCRIPTOR.fields_by_name["graph"].number
    if graph_field not in present or not model.HasField("graph"):
        raise InvalidModelFileError(
            f"{text!r} is not an ONNX model: it has no graph (a truncated file or another protobuf format)."
        )
    if not model.opset_import:
        raise InvalidModelFileError(
            f"{text!r} declares no opset_import; the file is truncated or was not written by an ONNX exporter."
        )
    if check:
        check_model_structure(model, name=repr(text))
    if load_external_data and _uses_external_data(model):
        try:
            onnx.load_external_data_for_model(model, str(file.parent))
        except (OSError, ValueError) as e:
            raise InvalidModelFileError(f"The external data of {text!r} cannot be read: {e}") from e
    return model


def _all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Initializers (subgraphs included) and tensor attributes, in the graph and in functions."""
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        yield from graph.initializer
        for node in graph.node:
            graphs.extend(_subgraphs(node))
    nodes = list(_all_nodes(model.graph.node))
    for function in model.functions:
        nodes.extend(_all_nodes(function.node))
    for node in nodes:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR:
                yield attribute.t
            elif attribute.type == onnx.AttributeProto.TENSORS:
                yield from attribute.tensors


def _uses_external_data(model: onnx.ModelProto) -> bool:
    return any(onnx.external_data_helper.uses_external_data(tensor) for tensor in _all_tensors(model))


# -- structure checks --------------------------------------------------------------------


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            yield attribute.g
        elif attribute.type == onnx.AttributeProto.GRAPHS:
            yield from attribute.graphs


def _all_nodes(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.NodeProto]:
    """The nodes and, depth first, the nodes of their If/Loop/Scan subgraphs."""
    stack = [iter(nodes)]
    while stack:
        node = next(stack[-1], None)
        if node is None:
            stack.pop()
            continue
        yield node
        for graph in _subgraphs(node):
            stack.append(iter(graph.node))


def _node_id(node: onnx.NodeProto) -> FunctionId:
    return (node.domain, node.op_type, node.overload)


def _function_id(function: onnx.FunctionProto) -> FunctionId:
    return (function.domain, function.name, function.overload)


def _check_dimensions(where: str, dims: Iterable[int], name: str) -> None:
    for dim in dims:
        if dim > MAX_DIMENSION:
            raise InvalidModelFileError(
                f"{where} {name!r} declares a dimension of {dim} (more than 2**40); "
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


def check_model_structure(model: onnx.ModelProto, *, name: str = "the model") -> None:
    """Refuse models that cannot be inspected or run safely.

    Checked, in this order, each failing fast with a message naming the culprit:

    - every graph input, output, value and initializer declares dimensions <= 2**40;
    - no two local functions share one ``(domain, name, overload)``;
    - no node of a custom domain calls a function the model does not define (a domain
      counts as custom when it is ``pkg.*`` or when some local function lives in it;
      the standard ``""``, ``ai.onnx*`` and ``com.microsoft*`` domains are not checked);
    - functions do not call each other recursively (ONNX forbids it; inliners and
      runtimes would loop forever);
    - calls nest at most :data:`MAX_NESTING` levels deep.

    Raises:
        InvalidModelFileError: On the first problem found.
    """
    graphs = [(model.graph, f"{name}: graph")]
    while graphs:
        graph, where = graphs.pop()
        _check_value_infos(graph, where)
        for node in graph.node:
            for subgraph in _subgraphs(node):
                graphs.append((subgraph, f"{name}: subgraph of node {node.name!r}"))
    for function in model.functions:
        label = _function_label(_function_id(function))
        for node in _all_nodes(function.node):
            for subgraph in _subgraphs(node):
                _check_value_infos(subgraph, f"{name}: function {label}: subgraph")
        for value in function.value_info:
            _check_dimensions(f"{name}: function {label} value", _declared_dims(value), value.name)

    functions: dict[FunctionId, onnx.FunctionProto] = {}
    for function in model.functions:
        function_id = _function_id(function)
        if function_id in functions:
            raise InvalidModelFileError(f"{name}: the function {_function_label(function_id)} is defined twice.")
        functions[function_id] = function
    custom_domains = {domain for domain, _, _ in functions}

    def check_calls(nodes: Iterable[onnx.NodeProto], where: str) -> set[FunctionId]:
        called = set()
        for node in _all_nodes(nodes):
            node_id = _node_id(node)
            if node_id in functions:
                called.add(node_id)
            elif not _is_standard_domain(node.domain) and (
                node.domain.startswith("pkg.") or node.domain in custom_domains
            ):
                raise InvalidModelFileError(
                    f"{name}: node {node.name!r} in {where} calls the function {_function_label(node_id)}, "
                    "which the model does not define (the file may be truncated, or its functions were removed)."
                )
        return called

    check_calls(model.graph.node, "the main graph")
    callees = {
        function_id: check_calls(function.node, f"function {_function_label(function_id)}")
        for function_id, function in functions.items()
    }
    depth = _nesting_depths(callees, name)
    deepest = max(depth.values(), default=0)
    if deepest > MAX_NESTING:
        raise InvalidModelFileError(
            f"{name}: function calls nest {deepest} levels deep (more than {MAX_NESTING}); refusing to inspect it."
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
                    + " -> ".join(_function_label(f) for f in cycle)
                    + ". ONNX functions cannot be recursive."
                )
            if callee in depth:
                continue
            on_path[callee] = len(path)
            path.append(callee)
            stack.append(iter(sorted(callees[callee])))
    return depth


# -- the call tree -----------------------------------------------------------------------


@dataclasses.dataclass
class TreeNode:
    """One function call in the expanded call hierarchy (or the root graph).

    Attributes:
        name: The ONNX node name of the call (the graph name for the root). Inside a
            function body, onnx_modular names call nodes relative to the body's module
            (``attn`` in the ``GPT2Block`` body shared by ``h.0`` and ``h.1``).
        path: Where this call sits: the module path for files written by onnx_modular
            (``h.1.attn``, resolved through the caller), else the node names joined by ``/``.
        function: The called function's name (``None`` for the root).
        domain: The called function's domain.
        overload: The called function's overload (usually ``""``).
        class_name: The ``pkg.onnx_modular.class`` metadata of the call or function, if any.
        call_count: How many times the function is called in the whole model, counting
            each call of an enclosing function (1 for the root).
        num_nodes: Nodes directly in the function body (the main graph for the root).
        parameters: Weight elements flowing into this call: the elements of the
            main-graph initializers passed as inputs, followed through formal inputs.
        children: Calls inside the body, in node order (subgraphs included).

    Example::

        tree = function_tree(onnx.load("gpt2.onnx"))
        print(tree.format(max_depth=2, class_filter="GPT2Attention"))
    """

    name: str
    path: str
    function: str | None = None
    domain: str = ""
    overload: str = ""
    class_name: str | None = None
    call_count: int = 1
    num_nodes: int = 0
    parameters: int = 0
    children: list[TreeNode] = dataclasses.field(default_factory=list)

    @property
    def is_root(self) -> bool:
        return self.function is None

    def walk(self) -> Iterator[TreeNode]:
        """This node and every call below it, depth first, in node order."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))

    def matches(self, class_filter: str) -> bool:
        """Whether the function name or class matches ``class_filter`` (a name or glob).

        ``GPT2Attention``, ``transformers.models.gpt2.modeling_gpt2.GPT2Attention`` and
        ``GPT2*`` all match the GPT2Attention calls; ``Conv1D`` also matches the
        ``Conv1D_2`` function through its class metadata.
        """
        candidates = [self.function or ""]
        if self.class_name:
            candidates += [self.class_name, self.class_name.rsplit(".", 1)[-1]]
        return any(fnmatch.fnmatchcase(candidate, class_filter) for candidate in candidates if candidate)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``children`` holds the nested calls."""
        result = {
            "name": self.name,
            "path": self.path,
            "function": self.function,
            "domain": self.domain,
            "overload": self.overload,
            "class": self.class_name,
            "calls": self.call_count,
            "nodes": self.num_nodes,
            "parameters": self.parameters,
            "children": [],
        }
        # Built without recursion: nesting is bounded by MAX_NESTING, but stay safe.
        stack = [(self, result)]
        while stack:
            node, converted = stack.pop()
            for child in node.children:
                child_dict = {
                    "name": child.name,
                    "path": child.path,
                    "function": child.function,
                    "domain": child.domain,
                    "overload": child.overload,
                    "class": child.class_name,
                    "calls": child.call_count,
                    "nodes": child.num_nodes,
                    "parameters": child.parameters,
                    "children": [],
                }
                converted["children"].append(child_dict)
                stack.append((child, child_dict))
        return result

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def filtered(self, max_depth: int | None = None, class_filter: str | None = None) -> TreeNode:
        """A copy keeping calls down to ``max_depth`` that match ``class_filter``, plus their ancestors.

        Args:
            max_depth: Keep calls down to this depth (1 = calls in the root graph only).
            class_filter: A function name, class name or glob (see :meth:`matches`);
                ``None`` keeps every call.
        """
        kept: set[int] | None = None
        if class_filter is not None:
            kept = {id(self)}
            path: list[TreeNode] = []
            stack: list[tuple[TreeNode, int]] = [(self, 0)]
            while stack:
                node, depth = stack.pop()
                del path[depth:]
                path.append(node)
                if not node.is_root and node.matches(class_filter):
                    kept.update(id(ancestor) for ancestor in path)
                stack.extend((child, depth + 1) for child in reversed(node.children))
        copy = dataclasses.replace(self, children=[])
        work = [(self, copy, 0)]
        while work:
            original, clone, depth = work.pop()
            if max_depth is not None and depth >= max_depth:
                continue
            for child in original.children:
                if kept is None or id(child) in kept:
                    child_clone = dataclasses.replace(child, children=[])
                    clone.children.append(child_clone)
                    work.append((child, child_clone, depth + 1))
        return copy

    def format(self, max_depth: int | None = None, class_filter: str | None = None) -> str:
        """A readable tree, one call per line: path, function, domain, calls, nodes, parameters.

        Args:
            max_depth: Show calls down to this depth (1 = calls in the root graph only).
            class_filter: Keep only calls whose function name or class matches (a name
                or a glob such as ``"GPT2*"``), plus the calls that lead to them.

        Example output::

            main_graph                                        156 nodes  108,544 params
            ├─ wte   Embedding  [pkg.torch.2.13.0]         ×1     1 node    6,400 params
            ├─ h.0   GPT2Block  [pkg.transformers.5.23.0]  ×2    6 nodes   49,984 params
            │  ├─ h.0.ln_1  LayerNorm ...
        """
        tree = self.filtered(max_depth, class_filter)
        rows: list[list[str]] = []
        stack: list[tuple[TreeNode, str, str]] = [(tree, "", "")]
        while stack:
            node, label_prefix, child_prefix = stack.pop()
            nodes = f"{node.num_nodes} node{'' if node.num_nodes == 1 else 's'}"
            params = f"{node.parameters:,} params"
            if node.is_root:
                rows.append([node.name, "", "", "", nodes, params])
            else:
                function = node.function + (f":{node.overload}" if node.overload else "")
                rows.append(
                    [label_prefix + node.path, function, f"[{node.domain}]", f"×{node.call_count}", nodes, params]
                )
            for index in reversed(range(len(node.children))):
                last = index == len(node.children) - 1
                stack.append(
                    (
                        node.children[index],
                        child_prefix + ("└─ " if last else "├─ "),
                        child_prefix + ("   " if last else "│  "),
                    )
                )
        widths = [max(len(row[column]) for row in rows) for column in range(6)]
        lines = []
        for row in rows:
            cells = [row[column].ljust(widths[column]) for column in range(3)]
            cells += [row[column].rjust(widths[column]) for column in range(3, 6)]
            lines.append("  ".join(cells).rstrip())
        if class_filter is not None and not tree.children:
            lines.append(f"(no call matches {class_filter!r})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _numel(dims: Sequence[int]) -> int:
    return math.prod(int(d) for d in dims)


def _strip_call_index(path: str) -> str:
    base, _, index = path.rpartition("@")
    return base if base and index.isdigit() else path


def _metadata(proto: onnx.NodeProto | onnx.FunctionProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in proto.metadata_props}


def _first_module_path(function: onnx.FunctionProto) -> str | None:
    """The module path the body was written for (its first call), for files of onnx_modular."""
    paths = _metadata(function).get(_METADATA_MODULE_PATHS)
    if not paths:
        return None
    try:
        decoded = json.loads(paths)
    except ValueError:
        return None
    return (
        _strip_call_index(decoded[0]) if isinstance(decoded, list) and decoded and isinstance(decoded[0], str) else None
    )


def _call_path(node: onnx.NodeProto, caller_path: str | None, body_path: str | None) -> str:
    """Where a call sits, as readable as the file allows.

    A body shared by ``h.0`` and ``h.1`` names its nested call nodes relative to itself
    (``attn``); the node's module-path metadata is ``h.0.attn`` (its first call), and under
    ``h.1`` the call is shown as ``h.1.attn``.
    """
    name = node.name or f"<{node.op_type}>"
    module_path = _metadata(node).get(_METADATA_MODULE_PATH)
    if module_path is not None:
        suffix = name[len(_strip_call_index(name)) :]  # "@1": the module's second call
        if (
            caller_path is not None
            and body_path
            and (module_path == body_path or module_path.startswith(body_path + "."))
        ):
            return _strip_call_index(caller_path) + module_path[len(body_path) :] + suffix
        return module_path + suffix
    return f"{caller_path}/{name}" if caller_path else name


def function_tree(model: onnx.ModelProto, *, max_calls: int = MAX_TREE_CALLS) -> TreeNode:
    """Build the call hierarchy of a model's local functions.

    The root is the main graph; its children are the nodes that call a local function
    (in node order, If/Loop subgraphs included), and so on into each function body.
    A function body shared by several calls is expanded under each of them.

    Args:
        model: Any ONNX model (it is checked with :func:`check_model_structure`).
        max_calls: Refuse models whose expanded tree would hold more calls.

    Returns:
        The root :class:`TreeNode`.

    Raises:
        InvalidModelFileError: The structure is unusable (see :func:`check_model_structure`),
            or the tree would hold more than ``max_calls`` calls.

    Example::

        tree = function_tree(load_model_file("gpt2.onnx"))
        print(tree.format(max_depth=2))
        print(json.dumps(tree.to_dict()))
    """
    check_model_structure(model)
    functions = {_function_id(f): f for f in model.functions}
    initializer_sizes = {tensor.name: _numel(tensor.dims) for tensor in model.graph.initializer}
    initializer_sizes.update({sparse.values.name: _numel(sparse.dims) for sparse in model.graph.sparse_initializer})

    # Calls per function over the whole model: main-graph calls count once, calls inside a
    # body count once per call of that body. Processing callers before callees (the
    # function call graph is acyclic) makes each count final when it is used.
    sites: dict[FunctionId, list[FunctionId]] = {f: [] for f in functions}
    for function_id, function in functions.items():
        for node in _all_nodes(function.node):
            if _node_id(node) in functions:
                sites[function_id].append(_node_id(node))
    call_count = dict.fromkeys(functions, 0)
    for node in _all_nodes(model.graph.node):
        if _node_id(node) in functions:
            call_count[_node_id(node)] += 1
    for function_id in _callers_first(sites):
        for callee in sites[function_id]:
            call_count[callee] += call_count[function_id]
    total = sum(call_count.values())
    if total > max_calls:
        raise InvalidModelFileError(
            f"The call hierarchy expands to {total} calls (more than {max_calls}); refusing to build the tree."
        )

    root = TreeNode(
        name=model.graph.name or "main_graph",
        path="",
        num_nodes=len(model.graph.node),
        parameters=sum(initializer_sizes.values()),
    )
    # A scope maps a value name to the main-graph initializer it carries (None: not a weight).
    # Work items: (body nodes, scope, tree node to fill, caller path, body's own module path).
    top_scope: dict[str, str | None] = {name: name for name in initializer_sizes}
    work: list[tuple[Sequence[onnx.NodeProto], dict[str, str | None], TreeNode, str | None, str | None]] = [
        (model.graph.node, top_scope, root, None, None)
    ]
    while work:
        body, body_scope, parent, caller_path, body_path = work.pop()
        # Subgraphs (If/Loop/Scan) are visited in place, so calls stay in node order.
        graphs = [(iter(body), body_scope)]
        while graphs:
            nodes, scope = graphs[-1]
            node = next(nodes, None)
            if node is None:
                graphs.pop()
                continue
            function = functions.get(_node_id(node))
            if function is not None:
                weights = {scope.get(name) for name in node.input if name} - {None}
                child = TreeNode(
                    name=node.name,
                    path=_call_path(node, caller_path, body_path),
                    function=function.name,
                    domain=function.domain,
                    overload=function.overload,
                    class_name=_metadata(node).get(_METADATA_CLASS) or _metadata(function).get(_METADATA_CLASS),
                    call_count=call_count[_node_id(node)],
                    num_nodes=len(function.node),
                    parameters=sum(initializer_sizes[w] for w in weights),
                )
                parent.children.append(child)
                # Formal inputs carry the caller's actual values into the body.
                inner_scope = {
                    formal: scope.get(actual) if actual else None for formal, actual in zip(function.input, node.input)
                }
                work.append((function.node, inner_scope, child, child.path, _first_module_path(function)))
            for subgraph in reversed(list(_subgraphs(node))):
                graphs.append((iter(subgraph.node), _subgraph_scope(scope, subgraph)))
    return root


def _subgraph_scope(scope: Mapping[str, str | None], subgraph: onnx.GraphProto) -> dict[str, str | None]:
    """A subgraph sees the enclosing scope, except for the names it defines itself."""
    inner = dict(scope)
    for value in subgraph.input:
        inner[value.name] = None
    for tensor in subgraph.initializer:
        inner[tensor.name] = None
    for node in _all_nodes(subgraph.node):
        for output in node.output:
            inner[output] = None
    return inner


def _callers_first(sites: Mapping[FunctionId, list[FunctionId]]) -> list[FunctionId]:
    """Functions ordered so that every caller comes before its callees (Kahn's algorithm)."""
    indegree = dict.fromkeys(sites, 0)
    for callees in sites.values():
        for callee in set(callees):
            indegree[callee] += 1
    ready = sorted(f for f, count in indegree.items() if count == 0)
    order = []
    while ready:
        function_id = ready.pop()
        order.append(function_id)
        for callee in sorted(set(sites[function_id])):
            indegree[callee] -= 1
            if indegree[callee] == 0:
                ready.append(callee)
    return order


# -- inlining ----------------------------------------------------------------------------


def _resolve_function_ids(model: onnx.ModelProto, selectors: Sequence[str]) -> list[tuple[str, str]]:
    """``name`` or ``domain:name`` -> the ``(domain, name)`` of matching local functions."""
    available = sorted({(f.domain, f.name) for f in model.functions})
    resolved: list[tuple[str, str]] = []
    for selector in selectors:
        domain, sep, name = selector.rpartition(":")
        matches = [(d, n) for d, n in available if n == name and (not sep or d == domain)]
        if not matches:
            listed = ", ".join(f"{d}:{n}" for d, n in available[:12])
            if len(available) > 12:
                listed += f" and {len(available) - 12} more"
            raise InvalidInputError(
                f"No local function matches {selector!r}. Functions in the model: {listed or '(none)'}."
            )
        resolved += [m for m in matches if m not in resolved]
    return resolved


@contextlib.contextmanager
def _atomic_destination(destination: pathlib.Path) -> Iterator[pathlib.Path]:
    """A private folder next to ``destination``; its files are moved into place on success."""
    parent = destination.parent
    if destination.is_dir():
        raise InvalidInputError(f"The output path {str(destination)!r} is a directory.")
    if not parent.is_dir():
        raise InvalidInputError(f"The output folder {str(parent)!r} does not exist.")
    tmpdir = pathlib.Path(tempfile.mkdtemp(prefix=f".{destination.name}.", suffix=".tmp", dir=parent))
    try:
        yield tmpdir
        # Data first: the model file only appears once everything it refers to is in place.
        for staged in sorted(tmpdir.iterdir(), key=lambda p: p.name == destination.name):
            os.replace(staged, parent / staged.name)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def inline_file(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    *,
    only: Sequence[str] | None = None,
    optimize: bool = False,
    opset_version: int | None = None,
) -> onnx.ModelProto:
    """Write a copy of ``source`` with local functions inlined, atomically.

    ``opset_version`` converts the copy to that opset of the default domain, body by body
    (functions left by ``only`` stay functions; see :class:`onnx_modular.opset.ConvertOpsetPass`).

    ``optimize=True`` then runs onnxscript's full optimizer on the flat graph, the same one
    ``torch.onnx.export`` runs (constant folding, common subexpressions, constants lifted to
    initializers, equal initializers merged), so the per-call copies of constants become one
    shared initializer each, as in torch's own flat file.

    Uses ``onnx.inliner.inline_local_functions`` (everything) or
    ``onnx.inliner.inline_selected_functions`` (the functions named in ``only``, each
    ``name`` or ``domain:name``; calls nested inside them stay calls unless selected too).
    A model with external data gets its own copy of the weights (``<destination>.data``).
    Nothing is left at ``destination`` if any step fails.

    Returns:
        The inlined model (weights not loaded when they are external).

    Example::

        inline_file("gpt2.onnx", "gpt2.flat.onnx")
        inline_file("gpt2.onnx", "gpt2.noblock.onnx", only=["GPT2Block"])
        inline_file("gpt2.onnx", "gpt2.deploy.onnx", optimize=True)
    """
    import onnx_ir as ir

    from onnx_modular import opset

    if opset_version is not None:
        opset.check_opset(opset_version, default=opset_version)  # before any work
    destination = pathlib.Path(destination)
    model = load_model_file(source)
    external = _uses_external_data(model)
    if external:
        onnx.load_external_data_for_model(model, str(pathlib.Path(source).parent))
    if only:
        flat = onnx.inliner.inline_selected_functions(model, _resolve_function_ids(model, only))
    else:
        flat = onnx.inliner.inline_local_functions(model)
    if optimize:
        import onnxscript.optimizer

        flat = onnxscript.optimizer.optimize(flat)
    if opset_version is not None:
        converted = ir.from_proto(flat)
        opset.ConvertOpsetPass(opset_version)(converted)
        flat = ir.to_proto(converted)
    with _atomic_destination(destination) as tmpdir:
        staged = tmpdir / destination.name
        try:
            if external:
                onnx.save(flat, str(staged), save_as_external_data=True, location=destination.name + ".data")
            else:
                onnx.save(flat, str(staged))
        except (OSError, ValueError) as e:
            raise InvalidInputError(f"Writing {str(destination)!r} failed: {e}") from e
    return flat


# -- running -----------------------------------------------------------------------------


_DEFAULT_INT_HIGH = 10


def model_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs a caller must feed (inputs that are also initializers excluded)."""
    initializers = {tensor.name for tensor in model.graph.initializer}
    return [value for value in model.graph.input if value.name not in initializers]


def _numpy_dtype(elem_type: int, name: str) -> np.dtype:
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        type_name = (
            onnx.TensorProto.DataType.Name(elem_type) if elem_type in onnx.TensorProto.DataType.values() else elem_type
        )
        raise InvalidInputError(
            f"Cannot make random values for input {name!r} of type {type_name}; pass --inputs."
        ) from None


def random_inputs(
    model: onnx.ModelProto,
    *,
    dims: Mapping[str, int] | None = None,
    default_dim: int = 2,
    seed: int = 0,
    int_high: int = _DEFAULT_INT_HIGH,
    max_elements: int = 2**26,
) -> dict[str, np.ndarray]:
    """Random feeds for the model's inputs, from their declared shapes and types.

    Symbolic dimensions take their value from ``dims`` (by name) or ``default_dim``;
    floats are standard normal, integers uniform in ``[0, int_high)``, booleans fair coins.

    Raises:
        InvalidInputError: An input is not a tensor, has a type without random values
            (strings), or would hold more than ``max_elements`` elements.

    Example::

        feeds = random_inputs(model, dims={"batch": 1, "sequence": 16}, seed=0)
    """
    dims = dict(dims or {})
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for value in model_inputs(model):
        if not value.type.HasField("tensor_type"):
            raise InvalidInputError(f"Input {value.name!r} is not a tensor; pass --inputs with its value.")
        tensor_type = value.type.tensor_type
        dtype = _numpy_dtype(tensor_type.elem_type, value.name)
        shape = []
        for dim in tensor_type.shape.dim:
            if dim.HasField("dim_value") and dim.dim_value >= 0:
                shape.append(dim.dim_value)
            else:
                shape.append(int(dims.get(dim.dim_param, default_dim)) if dim.HasField("dim_param") else default_dim)
        elements = _numel(shape)
        if elements > max_elements:
            raise InvalidInputError(
                f"Input {value.name!r} would hold {elements} elements (shape {shape}), more than {max_elements}; "
                "pass smaller --dim values or --inputs."
            )
        if dtype == np.bool_:
            array = rng.integers(0, 2, size=shape).astype(np.bool_)
        elif np.issubdtype(dtype, np.integer):
            array = rng.integers(0, int_high, size=shape).astype(dtype)
        elif dtype.kind in "fV":  # V: ml_dtypes (bfloat16, float8)
            array = rng.standard_normal(size=shape).astype(np.float32).astype(dtype)
        elif dtype.kind == "c":
            array = (rng.standard_normal(size=shape) + 1j * rng.standard_normal(size=shape)).astype(dtype)
        else:
            raise InvalidInputError(
                f"Cannot make random values for input {value.name!r} of dtype {dtype}; pass --inputs."
            )
        feeds[value.name] = array
    unused = set(dims) - {d.dim_param for v in model_inputs(model) for d in v.type.tensor_type.shape.dim}
    if unused:
        raise InvalidInputError(f"No input has a dimension named {sorted(unused)[0]!r} (given with --dim).")
    return feeds


def check_feeds(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> None:
    """Check given inputs against the declared ones (names, ranks, fixed dims, dtypes).

    Raises:
        InvalidInputError: Naming the first input that does not fit.
    """
    declared = {value.name: value for value in model_inputs(model)}
    missing = [name for name in declared if name not in feeds]
    extra = [name for name in feeds if name not in declared]
    if missing or extra:
        raise InvalidInputError(
            f"The inputs do not match the model: missing {missing or 'none'}, unexpected {extra or 'none'} "
            f"(the model's inputs are {list(declared)})."
        )
    for name, value in declared.items():
        array = np.asarray(feeds[name])
        tensor_type = value.type.tensor_type
        expected_dtype = _numpy_dtype(tensor_type.elem_type, name)
        if array.dtype != expected_dtype:
            raise InvalidInputError(f"Input {name!r} has dtype {array.dtype} but the model declares {expected_dtype}.")
        if tensor_type.HasField("shape"):
            declared_dims = [
                d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor_type.shape.dim
            ]
            fits = array.ndim == len(declared_dims) and all(
                not isinstance(d, int) or d == actual for d, actual in zip(declared_dims, array.shape)
            )
            if not fits:
                raise InvalidInputError(
                    f"Input {name!r} has shape {list(array.shape)} but the model declares {declared_dims}."
                )


@dataclasses.dataclass
class OutputDifference:
    """Differences for one output: modular vs inlined, and vs expected values if given."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    max_abs: float
    max_rel: float
    expected_max_abs: float | None
    expected_max_rel: float | None
    ok: bool


@dataclasses.dataclass
class InlineParity:
    """onnxruntime on a modular model against its inlined copy (and expected outputs)."""

    outputs: list[OutputDifference]
    atol: float
    rtol: float

    @property
    def ok(self) -> bool:
        return all(output.ok for output in self.outputs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "atol": self.atol,
            "rtol": self.rtol,
            "outputs": [dataclasses.asdict(output) for output in self.outputs],
        }

    def __str__(self) -> str:
        def fmt(value: float | None) -> str:
            return "-" if value is None else f"{value:.2e}"

        width = verification.name_column_width(o.name for o in self.outputs)
        header = (
            f"{'output':<{width}} {'shape':<16} {'dtype':<8} {'max abs':>9} {'max rel':>9} {'exp abs':>9} {'exp rel':>9}  ok"
        )
        lines = [
            f"onnxruntime: modular vs inlined copy (atol {self.atol:g}, rtol {self.rtol:g})",
            header,
            "-" * len(header),
        ]
        for o in self.outputs:
            lines.append(
                f"{verification.fit_name(o.name, width):<{width}} {str(list(o.shape))[:16]:<16} {o.dtype:<8} {fmt(o.max_abs):>9} {fmt(o.max_rel):>9} "
                f"{fmt(o.expected_max_abs):>9} {fmt(o.expected_max_rel):>9}  {'yes' if o.ok else 'NO'}"
            )
        failures = sum(1 for o in self.outputs if not o.ok)
        lines.append("PASS" if self.ok else f"FAIL: {failures} output(s) beyond tolerance")
        return "\n".join(lines)


def _close(actual: np.ndarray, expected: np.ndarray, atol: float, rtol: float) -> bool:
    return verification.allclose(actual, expected, verification.Tolerance(atol, rtol))


def _session(model: str | bytes):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _run(model: str | bytes, feeds: Mapping[str, np.ndarray], what: str) -> tuple[list[str], list[np.ndarray]]:
    try:
        session = _session(model)
    except Exception as e:  # onnxruntime raises its own exception types
        raise InvalidModelFileError(f"onnxruntime cannot load the {what}: {_first_line(e)}") from e
    try:
        return [o.name for o in session.get_outputs()], session.run(None, dict(feeds))
    except Exception as e:
        raise InvalidInputError(f"onnxruntime failed to run the {what}: {_first_line(e)}") from e


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:400] if text else type(exc).__name__


def compare_with_inlined(
    path: str | os.PathLike,
    feeds: Mapping[str, np.ndarray],
    *,
    expected: Mapping[str, np.ndarray] | None = None,
    atol: float = 1e-4,
    rtol: float = 1e-3,
) -> InlineParity:
    """Run ``path`` and its inlined copy in onnxruntime on ``feeds`` and compare outputs.

    The inlined copy is made with ``onnx.inliner.inline_local_functions``. A model with
    external data is inlined into a hidden file next to it, so both read the same weights.

    Args:
        path: The model file.
        feeds: Input name -> array (see :func:`random_inputs` and :func:`check_feeds`).
        expected: Optional output name -> array; the modular outputs must match them too.
        atol: Absolute tolerance, as in ``numpy.allclose``.
        rtol: Relative tolerance.

    Returns:
        An :class:`InlineParity` report; it does not raise on a mismatch.

    Example::

        model = load_model_file("m.onnx")
        report = compare_with_inlined("m.onnx", random_inputs(model))
        print(report)
    """
    path = pathlib.Path(path)
    model = load_model_file(path)
    names, modular = _run(str(path), feeds, "model")
    flat = onnx.inliner.inline_local_functions(model)
    if _uses_external_data(flat):
        flat_path = path.parent / f".{path.stem}.inlined-{os.getpid()}.onnx"
        try:
            onnx.save(flat, str(flat_path))
            _, inlined = _run(str(flat_path), feeds, "inlined copy")
        except OSError as e:
            raise InvalidInputError(f"Writing the inlined copy next to {str(path)!r} failed: {e}") from e
        finally:
            flat_path.unlink(missing_ok=True)
    else:
        _, inlined = _run(flat.SerializeToString(), feeds, "inlined copy")
    if expected is not None:
        unknown = sorted(set(expected) - set(names))
        if unknown:
            raise InvalidInputError(
                f"Expected outputs name {unknown[0]!r}, which is not an output of the model {names}."
            )
    outputs = []
    for name, modular_value, inlined_value in zip(names, modular, inlined):
        modular_value = np.asarray(modular_value)
        max_abs, max_rel = verification.max_differences(modular_value, inlined_value)
        ok = _close(modular_value, inlined_value, atol, rtol)
        expected_abs = expected_rel = None
        if expected is not None and name in expected:
            expected_abs, expected_rel = verification.max_differences(modular_value, expected[name])
            ok = ok and _close(modular_value, expected[name], atol, rtol)
        outputs.append(
            OutputDifference(
                name=name,
                shape=tuple(modular_value.shape),
                dtype=str(modular_value.dtype),
                max_abs=max_abs,
                max_rel=max_rel,
                expected_max_abs=expected_abs,
                expected_max_rel=expected_rel,
                ok=ok,
            )
        )
    return InlineParity(outputs, atol=atol, rtol=rtol)
