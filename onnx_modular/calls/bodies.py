"""A call's own body as a computation, names taken out, and what differs between two such bodies.

``diff`` compares two files' calls on these. A body is its own nodes (a call node counts by its
module's class), values numbered in order of use, the weights its own nodes read (compared by
the SHA-256 of their values: :func:`tensor_digest`), the opsets it uses and its data inputs and
outputs; the weights a call only passes down are its callees' concern. So a body that
``replace`` renamed, or threaded a new weight through, compares equal. Weights are hashed where
they are: inline bytes from the parsed file, external data read in chunks from the byte range
each tensor names (never a whole data file at once). No torch.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import pathlib
from collections.abc import Mapping

import numpy as np
import onnx
import onnx.numpy_helper

from onnx_modular.errors import InvalidModelFileError
from onnx_modular.format import metadata
from onnx_modular.format.text import shown
from onnx_modular.storage.load import external_byte_range
from onnx_modular.storage.proto import FunctionId, is_standard_domain, node_id

__all__ = ["Tensors", "tensor_digest", "Body", "body_of", "compare"]

#: Bytes read at a time when hashing external data.
_CHUNK = 1 << 22


class Tensors:
    """The main-graph initializers of one file, hashed on demand (once each)."""

    def __init__(self, model: onnx.ModelProto, folder: pathlib.Path, name: str):
        self.by_name = {tensor.name: tensor for tensor in model.graph.initializer}
        self.by_name.update({sparse.values.name: sparse.values for sparse in model.graph.sparse_initializer})
        self.folder = folder
        self.name = name
        self._digests: dict[str, str] = {}
        self._held: dict[int, tuple[onnx.TensorProto, str]] = {}  # the tensor kept: its id stays its own

    def digest(self, initializer: str) -> str:
        if initializer not in self._digests:
            self._digests[initializer] = tensor_digest(self.by_name[initializer], self.folder, self.name)
        return self._digests[initializer]

    def of(self, tensor: onnx.TensorProto) -> str:
        """The digest of a tensor held by a node (a ``Constant``'s value), once per tensor: a body
        shared by many calls is read once per call."""
        key = id(tensor)
        if key not in self._held:
            self._held[key] = (tensor, tensor_digest(tensor, self.folder, self.name))
        return self._held[key][1]

    def kind(self, initializer: str) -> str:
        tensor = self.by_name[initializer]
        return f"{onnx.TensorProto.DataType.Name(tensor.data_type).lower()}{list(tensor.dims)}"


def tensor_digest(tensor: onnx.TensorProto, folder: str | os.PathLike, name: str = "the model") -> str:
    """SHA-256 of a tensor's type, dims and values: inline bytes as stored, typed fields as their
    little-endian bytes (the same digest as raw bytes of the same values), external data read in
    chunks from the byte range it names (already checked by ``load_model_file``)."""
    digest = hashlib.sha256(f"{tensor.data_type}:{list(tensor.dims)}:".encode())
    if onnx.external_data_helper.uses_external_data(tensor):
        location, offset, length = external_byte_range(tensor)  # no length: the tensor's size, not the file's end
        path = pathlib.Path(folder) / location
        try:
            with open(path, "rb") as handle:
                handle.seek(offset)
                remaining = length
                while remaining is None or remaining > 0:
                    chunk = handle.read(_CHUNK if remaining is None else min(_CHUNK, remaining))
                    if not chunk:
                        break
                    digest.update(chunk)
                    if remaining is not None:
                        remaining -= len(chunk)
        except OSError as e:
            raise InvalidModelFileError(
                f"{name}: the external data of {shown(tensor.name)!r} cannot be read: {e.strerror or e}."
            ) from e
    elif tensor.HasField("raw_data"):
        digest.update(tensor.raw_data)
    elif tensor.data_type == onnx.TensorProto.STRING:
        for item in tensor.string_data:
            digest.update(len(item).to_bytes(8, "little") + item)
    else:
        array = onnx.numpy_helper.to_array(tensor)
        digest.update(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes())
    return digest.hexdigest()


# -- bodies as computations --------------------------------------------------------------------


@dataclasses.dataclass
class Body:
    """A call's own body, with names taken out: what two files' calls are compared on."""

    function: FunctionId | None
    labels: list[str]  # per node: op type (domain-qualified outside ONNX's), or "call <Class>"
    nodes: list[tuple]  # per node: (label, attributes, inputs, outputs), values numbered by use
    weights: list[str]  # the initializers its own nodes read, in order of first use
    opsets: dict[str, int]  # the opset of each standard domain its own nodes use
    inputs: int  # data inputs (weights excluded)
    outputs: int


class _Canon:
    """Numbers a body's values in order of use; weights (formals bound to initializers) apart."""

    def __init__(self, scope: Mapping[str, str]):
        self.scope = scope
        self.names: dict[str, str] = {}
        self.weights: list[str] = []
        self.counter = 0

    def ref(self, name: str) -> str:
        if not name:
            return ""
        if name in self.names:
            return self.names[name]
        if name in self.scope:
            token = f"w{len(self.weights)}"
            self.weights.append(self.scope[name])
            self.names[name] = token
            return token
        # Defined elsewhere: a module's inputs in a flat file (made by other modules' nodes), numbered
        # in order of first use as a function's formal inputs are.
        token = f"ext{len(self.names)}"
        self.names[name] = token
        return token

    def define(self, name: str) -> str:
        token = f"v{self.counter}"
        self.counter += 1
        if name:
            self.names[name] = token
        return token


def body_of(nodes, formals, outputs, scope, functions, opset_import, tensors: Tensors, function=None) -> Body:
    canon = _Canon(scope)
    data = 0
    for formal in formals:
        if formal not in scope:
            canon.names[formal] = f"in{data}"
            data += 1
    labels: list[str] = []
    canonical: list[tuple] = []
    used_domains: set[str] = set()
    for node in nodes:
        label, entry = _node(node, canon, functions, tensors, used_domains)
        labels.append(label)
        canonical.append(entry)
    canonical.append(("return", tuple(canon.ref(name) for name in outputs)))
    opsets = {domain or "ai.onnx": version for domain, version in opset_import.items() if domain in used_domains}
    return Body(function, labels, canonical, canon.weights, opsets, data, len(outputs))


def _node(node: onnx.NodeProto, canon: _Canon, functions, tensors: Tensors, used_domains: set[str]) -> tuple[str, tuple]:
    callee = functions.get(node_id(node))
    if callee is not None:
        label = "call " + (metadata.props(callee).get(metadata.CLASS, "").rsplit(".", 1)[-1] or callee.name)
        # the weights a call passes down are the callee's concern (compared there)
        inputs = tuple(canon.ref(name) for name in node.input if name not in canon.scope)
    else:
        label = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}:{node.op_type}"
        if is_standard_domain(node.domain):
            used_domains.add("" if node.domain == "ai.onnx" else node.domain)
        inputs = tuple(canon.ref(name) for name in node.input)
    attributes = tuple(sorted(_attribute(a, canon, functions, tensors, used_domains) for a in node.attribute))
    outputs = tuple(canon.define(name) for name in node.output)
    return label, (label, attributes, inputs, outputs)


def _attribute(attribute: onnx.AttributeProto, canon: _Canon, functions, tensors: Tensors, used_domains) -> tuple:
    if attribute.ref_attr_name:
        return (attribute.name, "ref", attribute.ref_attr_name)
    if attribute.HasField("g") or attribute.graphs:
        graphs = [attribute.g] if attribute.HasField("g") else list(attribute.graphs)
        return (attribute.name, "graphs", tuple(_subgraph(g, canon, functions, tensors, used_domains) for g in graphs))
    if attribute.HasField("t") or attribute.tensors:
        values = [attribute.t] if attribute.HasField("t") else list(attribute.tensors)
        return (attribute.name, "tensors", tuple(tensors.of(t) for t in values))
    if attribute.HasField("sparse_tensor") or attribute.sparse_tensors:
        values = [attribute.sparse_tensor] if attribute.HasField("sparse_tensor") else list(attribute.sparse_tensors)
        return (attribute.name, "sparse", tuple(hashlib.sha256(v.SerializeToString()).hexdigest() for v in values))
    value = onnx.helper.get_attribute_value(attribute)
    if isinstance(value, list):
        value = tuple(value)
    return (attribute.name, "value", repr(value))


def _subgraph(graph: onnx.GraphProto, canon: _Canon, functions, tensors: Tensors, used_domains) -> tuple:
    """An If/Loop/Scan body: its inputs numbered, its nodes as the enclosing body's (outer values resolve)."""
    for index, value in enumerate(graph.input):
        canon.names[value.name] = f"sub_in{index}:{canon.counter}"
    for tensor in graph.initializer:
        canon.names[tensor.name] = "const:" + tensors.of(tensor)
    entries = tuple(_node(node, canon, functions, tensors, used_domains)[1] for node in graph.node)
    return entries + (("return", tuple(canon.ref(value.name) for value in graph.output)),)


def compare(a: Body, b: Body, tensors_a: Tensors, tensors_b: Tensors) -> list[str]:
    """What differs between two bodies, in words (empty when they compute the same)."""
    what = _node_changes(a, b)
    for domain in sorted(set(a.opsets) | set(b.opsets)):
        if a.opsets.get(domain) != b.opsets.get(domain) and domain in a.opsets and domain in b.opsets:
            what.append(f"opset {domain} {a.opsets[domain]} -> {b.opsets[domain]}")
    if a.inputs != b.inputs:
        what.append(f"data inputs {a.inputs} -> {b.inputs}")
    if a.outputs != b.outputs:
        what.append(f"outputs {a.outputs} -> {b.outputs}")
    return what + _weight_changes(a, b, tensors_a, tensors_b)


def _node_changes(a: Body, b: Body) -> list[str]:
    """Nodes added or removed (by label), else the attributes, wiring or order that differ."""
    what: list[str] = []
    count_a, count_b = collections.Counter(a.labels), collections.Counter(b.labels)
    if count_a != count_b:
        added, removed = count_b - count_a, count_a - count_b
        if added:
            what.append("nodes added: " + ", ".join(f"{n} {label}" for label, n in sorted(added.items())))
        if removed:
            what.append("nodes removed: " + ", ".join(f"{n} {label}" for label, n in sorted(removed.items())))
    elif a.nodes != b.nodes:
        if a.labels == b.labels:
            attributes = sorted({x[0] for x, y in zip(a.nodes, b.nodes) if x[:2] != y[:2] and x[0] != "return"})
            wiring = sorted({x[0] for x, y in zip(a.nodes, b.nodes) if x[2:] != y[2:] and x[0] != "return"})
            if attributes:
                what.append("attributes of " + ", ".join(attributes))
            if wiring:
                what.append("inputs of " + ", ".join(wiring))
            if not attributes and not wiring:
                what.append("what the body returns")
        else:
            what.append("node order")
    return what


def _weight_changes(a: Body, b: Body, tensors_a: Tensors, tensors_b: Tensors) -> list[str]:
    """The weights read, by count, else those whose values (digests) differ, with their types when those do."""
    if len(a.weights) != len(b.weights):
        return [f"weights read {len(a.weights)} -> {len(b.weights)}"]
    changed = []
    for name_a, name_b in zip(a.weights, b.weights):
        if tensors_a.digest(name_a) != tensors_b.digest(name_b):
            kind_a, kind_b = tensors_a.kind(name_a), tensors_b.kind(name_b)
            changed.append(shown(name_b) + ("" if kind_a == kind_b else f" ({kind_a} -> {kind_b})"))
    return ["weight values: " + ", ".join(changed)] if changed else []
