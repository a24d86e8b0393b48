"""Two ONNX files compared module call by module call: structure, numerics and time.

``diff(a, b)`` matches the calls of the two files' call trees
(:func:`~onnx_modular.calls.tree.function_tree`) by call name (module path and call index) and
class, and says for each call:

* structure: ``same``, ``changed``, ``added`` or ``removed``. A call is changed in its *own*
  body (nodes added or removed, op types, attributes, wiring, opset, the values of the weights
  its own nodes read, compared by hash) or only *below* it (its body is the same, a call it
  makes changed): ``changed_in`` is ``"own"`` or ``"below"``. Bodies are compared as computations,
  not by name: values are numbered in order of use, a call node counts by its module's class,
  and the weights a call only passes down are its callees' concern, so a body that ``replace``
  renamed or threaded a new weight through is not changed in its own right. A function name that
  differs (``GPT2Block`` -> ``GPT2Block_2``) is said, and is not by itself a change.
* numerics: both files run once in onnxruntime on the same inputs (given, or random from the
  declared input types, seed 0) with every call's outputs captured
  (:func:`~onnx_modular.calls.capture.call_outputs`); per call the largest absolute and relative
  difference of its outputs (:func:`~onnx_modular.check.parity.max_differences`), the first call
  in execution order whose outputs differ, and the calls ranked by the drift they add
  (:attr:`CallDiff.added_drift`).
* time (``profile=True``): each call's inclusive kernel time in both files
  (:func:`~onnx_modular.profiling.run.profile`) and the ratio.

Weights are hashed where they are: inline bytes from the parsed file, external data read in
chunks from the byte range each tensor names (never a whole data file at once). Views: the
terminal tree (``str(result)``), a JSON list of call records, a self-contained HTML page with
the two trees side by side (:mod:`onnx_modular.files.diff_views`). No torch.

Example::

    result = onnx_modular.diff("gpt2.onnx", "gpt2.edited.onnx")
    print(result.format(max_depth=3))
    result.save(json="diff.json", html="diff.html")
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper

from onnx_modular.calls.capture import call_outputs
from onnx_modular.calls.tree import function_tree, weight_sources
from onnx_modular.check.parity import default_tolerance, max_differences
from onnx_modular.errors import InvalidInputError, InvalidModelFileError
from onnx_modular.files.flat import CLASS_HIERARCHY, NAME_SCOPES, inline_model
from onnx_modular.format import metadata
from onnx_modular.format.calltree import CallTree, ModuleCall, TreeNode
from onnx_modular.format.text import shown
from onnx_modular.runtime import sessions as runtime
from onnx_modular.runtime.inputs import check_feeds, feeds_for, model_inputs
from onnx_modular.storage import save as _save
from onnx_modular.storage.checks import check_expanded_size
from onnx_modular.storage.limits import check_count
from onnx_modular.storage.load import external_byte_range, load_model_file
from onnx_modular.storage.proto import FunctionId, function_id, function_label, is_standard_domain, node_id

__all__ = ["diff", "ModelDiff", "CallDiff", "CHANGES", "tensor_digest"]

#: The structural verdicts of a call.
CHANGES = ("same", "changed", "added", "removed")

#: Bytes read at a time when hashing external data.
_CHUNK = 1 << 22


# -- records -----------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class CallDiff(TreeNode):
    """One module call of either file (or both), with what differs.

    Attributes:
        path: The call name (``h.1.mlp``, ``shared@1``; ``""`` for the main graph).
        qualified_class: The module's class (``""`` when the file does not say).
        change: ``same``, ``changed``, ``added`` (only in B) or ``removed`` (only in A).
        changed_in: For a changed call, ``"own"`` (its own body differs) or ``"below"`` (its body is
            the same; a call it makes differs); else ``None``.
        what: What differs, in words (``nodes added: 1 Mul``, ``weight values: h.0.mlp.c_fc.weight``,
            ``calls below changed: h.1.mlp``, ``body: GPT2Block -> GPT2Block_2``).
        a, b: The call in each file's tree (``None`` on the side it is missing from).
        children: The calls it makes, both files merged, in execution order.
        max_abs, max_rel: Largest difference of its outputs between the files (``None`` when not
            compared: numerics off, a call on one side only, a call without ops); ``max_rel`` over
            A's values larger than the dtype's default ``atol`` (1e-4 for float32, 1e-2 for float16).
        scaled_drift: ``max_abs`` of each output over the largest magnitude of A's values of that
            output, the largest over its outputs: drift on one scale for every call (a LayerNorm's
            output and a logit's compare), robust to values near 0 (which make ``max_rel`` large).
        drift_before: The largest ``scaled_drift`` of the calls that finished before it in execution
            order (those it makes included): the drift that can have reached it.
        order: Its place in execution order (calls finish children first), ``None`` if not run.
        time_a_us, time_b_us: Its inclusive kernel time in each file (``profile=True``).
        first_drift: The first call in execution order whose outputs differ.
    """

    path: str
    qualified_class: str
    change: str
    a: ModuleCall | None
    b: ModuleCall | None
    changed_in: str | None = None
    what: list[str] = dataclasses.field(default_factory=list)
    children: list[CallDiff] = dataclasses.field(default_factory=list)
    parent: CallDiff | None = dataclasses.field(default=None, repr=False)
    max_abs: float | None = None
    max_rel: float | None = None
    scaled_drift: float | None = None
    drift_before: float | None = None
    order: int | None = None
    time_a_us: float | None = None
    time_b_us: float | None = None
    first_drift: bool = False

    @property
    def class_name(self) -> str:
        call = self.b or self.a
        return call.class_name if call is not None else ""

    @property
    def function_a(self) -> str | None:
        return _label(self.a)

    @property
    def function_b(self) -> str | None:
        return _label(self.b)

    @property
    def added_drift(self) -> float | None:
        """``scaled_drift - drift_before`` (0 when smaller): the drift the call adds beyond what can
        have reached it (all of it where drift first appears; ``None`` when not measured).

        ``drift_before`` bounds what reached the call by everything measured before it, so this
        ranks where drift is made; it is not a measurement of the call on its exact inputs.
        """
        if self.scaled_drift is None or self.drift_before is None:
            return None
        return max(self.scaled_drift - self.drift_before, 0.0)

    @property
    def time_ratio(self) -> float | None:
        """B's time over A's (``None`` without both)."""
        if self.time_a_us is None or self.time_b_us is None or self.time_a_us <= 0:
            return None
        return self.time_b_us / self.time_a_us

    @property
    def verdict(self) -> str:
        """``change`` with ``below`` spelled out: ``same``, ``changed``, ``changed below``, ``added``, ``removed``."""
        return "changed below" if self.changed_in == "below" else self.change

    def record(self) -> dict[str, Any]:
        """The JSON record of this call (times in milliseconds)."""
        return {
            "path": self.path,
            "class": self.qualified_class or None,
            "change": self.change,
            "changed_in": self.changed_in,
            "what": list(self.what),
            "depth": self.depth,
            "function_a": self.function_a,
            "function_b": self.function_b,
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "scaled_drift": self.scaled_drift,
            "drift_before": self.drift_before,
            "added_drift": self.added_drift,
            "first_drift": self.first_drift,
            "order": self.order,
            "time_a_ms": None if self.time_a_us is None else self.time_a_us / 1e3,
            "time_b_ms": None if self.time_b_us is None else self.time_b_us / 1e3,
            "time_ratio": self.time_ratio,
        }


def _label(call: ModuleCall | None) -> str | None:
    if call is None:
        return None
    if call.is_root:
        return call.node_name or "main_graph"
    if call.function is None:
        return None
    return function_label((call.function[0], call.function[1], call.overload))


@dataclasses.dataclass
class ModelDiff:
    """What :func:`diff` found (``str()`` is the terminal view).

    Attributes:
        a, b: The two files.
        root: The merged call tree (the root is the main graph; its drift is the model outputs').
        inputs: Shape and dtype of each input the files were run on (empty without numerics).
        random_inputs: The inputs were random (seed ``seed``), not given.
        seed: Seed of the random inputs.
        numerics: Whether the files were run.
        settings: The profile's settings (``profile=True``), else ``None``.
        note: What could not be compared, if anything.
        cast: The inputs B declares with another floating-point type, and that type: B got the same
            values cast to it (a float32 file and its float16 copy).
        by_module: A file had no local functions: modules were compared by the module path on each
            node (a flat copy's labels), not calls; only the model outputs' drift is measured.
    """

    a: str
    b: str
    root: CallDiff
    inputs: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    random_inputs: bool = True
    seed: int = 0
    numerics: bool = True
    settings: dict[str, Any] | None = None
    note: str | None = None
    by_module: bool = False
    cast: dict[str, str] = dataclasses.field(default_factory=dict)

    def calls(self) -> list[CallDiff]:
        """Every call (the main graph excluded), in display order."""
        return [call for call in self.root.walk() if not call.is_root]

    def __getitem__(self, path: str) -> CallDiff:
        for call in self.root.walk():
            if call.path == path:
                return call
        raise KeyError(path)

    @property
    def first_drift(self) -> CallDiff | None:
        """The first call in execution order whose outputs differ."""
        return next((call for call in self.calls() if call.first_drift), None)

    @property
    def differs(self) -> bool:
        """Anything differs: a call's structure, a call's outputs or the model's outputs."""
        return any(call.change != "same" or call.max_abs for call in self.root.walk())

    def versions(self) -> dict[str, tuple[str, str]]:
        """``{package: (version in A, version in B)}`` for the packages whose classes' versions differ
        between matched calls (two exports by two versions of transformers)."""
        found: dict[str, tuple[str, str]] = {}
        for call in self.calls():
            if call.a is not None and call.b is not None and call.a.version != call.b.version:
                found.setdefault(call.b.package or call.a.package, (call.a.version, call.b.version))
        return found

    def counts(self) -> dict[str, int]:
        """Calls per verdict (``same``, ``changed``, ``changed below``, ``added``, ``removed``)."""
        counts = dict.fromkeys(("same", "changed", "changed below", "added", "removed"), 0)
        for call in self.calls():
            counts[call.verdict] += 1
        return counts

    def ranked(self, count: int | None = None) -> list[CallDiff]:
        """Calls whose outputs differ, the ones that add the most drift first (:attr:`CallDiff.added_drift`),
        then by ``scaled_drift`` and execution order."""
        drifting = [call for call in self.calls() if call.max_abs]
        drifting.sort(key=lambda call: (-(call.added_drift or 0.0), -(call.scaled_drift or 0.0), call.order or 0))
        return drifting if count is None else drifting[:count]

    def records(self) -> list[dict[str, Any]]:
        """One record per call (the main graph first, as ``path: ""``), in display order."""
        return [call.record() for call in self.root.walk()]

    def to_json(self, indent: int | None = 2) -> str:
        """The records as a JSON list (an infinite difference as the string ``"inf"``)."""
        return json.dumps(_json_safe(self.records()), indent=indent, allow_nan=False)

    def format(self, max_depth: int | None = None, *, top: int = 10) -> str:
        from onnx_modular.files.diff_views import text

        return text(self, max_depth, top=top)

    def __str__(self) -> str:
        return self.format()

    def html(self) -> str:
        from onnx_modular.files.diff_views import html_page

        return html_page(self)

    def save(self, *, json: str | os.PathLike | None = None, html: str | os.PathLike | None = None) -> list[pathlib.Path]:
        """Write the JSON records and the HTML page (those given), each atomically; every
        destination is checked before anything is written."""
        targets = [(path, kind) for path, kind in ((json, "json"), (html, "html")) if path is not None]
        for path, _ in targets:
            _save.check_destination(path)
        texts = [(path, self.to_json() if kind == "json" else self.html()) for path, kind in targets]
        return [_save.write_text(path, text) for path, text in texts]


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    return value


# -- weights by hash ---------------------------------------------------------------------------


class _Tensors:
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
class _Body:
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


def _body(nodes, formals, outputs, scope, functions, opset_import, tensors: _Tensors, function=None) -> _Body:
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
    return _Body(function, labels, canonical, canon.weights, opsets, data, len(outputs))


def _node(node: onnx.NodeProto, canon: _Canon, functions, tensors: _Tensors, used_domains: set[str]) -> tuple[str, tuple]:
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


def _attribute(attribute: onnx.AttributeProto, canon: _Canon, functions, tensors: _Tensors, used_domains) -> tuple:
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


def _subgraph(graph: onnx.GraphProto, canon: _Canon, functions, tensors: _Tensors, used_domains) -> tuple:
    """An If/Loop/Scan body: its inputs numbered, its nodes as the enclosing body's (outer values resolve)."""
    for index, value in enumerate(graph.input):
        canon.names[value.name] = f"sub_in{index}:{canon.counter}"
    for tensor in graph.initializer:
        canon.names[tensor.name] = "const:" + tensors.of(tensor)
    entries = tuple(_node(node, canon, functions, tensors, used_domains)[1] for node in graph.node)
    return entries + (("return", tuple(canon.ref(value.name) for value in graph.output)),)


def _compare(a: _Body, b: _Body, tensors_a: _Tensors, tensors_b: _Tensors) -> list[str]:
    """What differs between two bodies, in words (empty when they compute the same)."""
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
    for domain in sorted(set(a.opsets) | set(b.opsets)):
        if a.opsets.get(domain) != b.opsets.get(domain) and domain in a.opsets and domain in b.opsets:
            what.append(f"opset {domain} {a.opsets[domain]} -> {b.opsets[domain]}")
    if a.inputs != b.inputs:
        what.append(f"data inputs {a.inputs} -> {b.inputs}")
    if a.outputs != b.outputs:
        what.append(f"outputs {a.outputs} -> {b.outputs}")
    if len(a.weights) != len(b.weights):
        what.append(f"weights read {len(a.weights)} -> {len(b.weights)}")
    else:
        changed = []
        for name_a, name_b in zip(a.weights, b.weights):
            if tensors_a.digest(name_a) != tensors_b.digest(name_b):
                kind_a, kind_b = tensors_a.kind(name_a), tensors_b.kind(name_b)
                changed.append(shown(name_b) + ("" if kind_a == kind_b else f" ({kind_a} -> {kind_b})"))
        if changed:
            what.append("weight values: " + ", ".join(changed))
    return what


# -- one file ----------------------------------------------------------------------------------


class _File:
    """One side: the model (structure and inline weights), its tree, bodies and tensors."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self.model = load_model_file(path)  # checked; external data stays on disk
        check_expanded_size(self.model, name=repr(self.path))
        self.tree = function_tree(self.model)
        self.functions = {function_id(f): f for f in self.model.functions}
        self.scopes = weight_sources(self.model)
        self.folder = pathlib.Path(os.path.dirname(os.path.abspath(self.path)))
        self.tensors = _Tensors(self.model, self.folder, repr(self.path))
        self._bodies: dict[str, _Body] = {}
        self.by_module = False

    def compare_by_module(self) -> None:
        """Compare by the module each node carries in its metadata (``pkg.onnx_modular.module_path``),
        as a flat copy is labelled (:func:`onnx_modular.files.flat.inline_model`): one pseudo-call
        per module path, its own nodes as its body, nested by path. A file with functions is
        inlined first (a copy, labelled the same way)."""
        flat = self.model
        if self.model.functions:
            flat = onnx.ModelProto()
            flat.CopyFrom(self.model)
            flat = inline_model(flat)
        groups: dict[str, list[onnx.NodeProto]] = {}
        classes: dict[str, str] = {}
        order: dict[str, int] = {"": 0}  # module paths in order of first appearance, outer ones first
        for node in flat.graph.node:
            props = metadata.props(node)
            path = props.get(metadata.MODULE_PATH, "")
            groups.setdefault(path, []).append(node)
            for outer, outer_class in _enclosing_modules(props, path):
                order.setdefault(outer, len(order))
                if outer_class:
                    classes.setdefault(outer, outer_class)
            order.setdefault(path, len(order))
            if path and props.get(metadata.CLASS):
                classes.setdefault(path, props[metadata.CLASS])
        if len(groups) <= 1 and "" in groups:
            raise InvalidInputError(
                f"{self.path!r} has no local functions, and its nodes carry no module paths "
                f"({metadata.MODULE_PATH}): there is nothing to match module calls by.",
                hint="Compare files written by onnx_modular (export_modular, or their flat copies: "
                "`onnx-modular inline`, export_modular(flat_file=True)); for any two files, compare the "
                "outputs with `onnx-modular verify FILE --expected OUT.npz`.",
            )
        root = ModuleCall(key="", module_path="", node_name=flat.graph.name or "main_graph", num_nodes=len(groups.get("", [])))
        made = {"": root}
        for path in sorted(p for p in order if p):  # a prefix sorts before the paths below it
            parent_path = path
            while parent_path and (parent_path == path or parent_path not in made):
                parent_path = parent_path.rpartition(".")[0]
            parent = made[parent_path]
            call = ModuleCall(key=path, module_path=path, qualified_class=classes.get(path, ""), parent=parent,
                              num_nodes=len(groups.get(path, [])), node_name=path)
            parent.children.append(call)
            made[path] = call
        for call in made.values():
            call.children.sort(key=lambda child: order[child.module_path])
        self.tree = CallTree(root)
        opsets = {o.domain: o.version for o in flat.opset_import}
        weights = {name: name for name in self.tensors.by_name}
        inputs = [v.name for v in model_inputs(flat)]
        for path in order:
            outputs = [v.name for v in flat.graph.output] if not path else []
            self._bodies[path] = _body(
                groups.get(path, []), inputs if not path else [], outputs, weights, {}, opsets, self.tensors
            )
        self.by_module = True

    def body(self, call: ModuleCall) -> _Body | None:
        if self.by_module:
            return self._bodies.get(call.module_path)
        if call.is_root:
            key = ""
        elif call.function is None:
            return None
        else:
            key = call.call_name
        if key not in self._bodies:
            opsets = {o.domain: o.version for o in self.model.opset_import}
            if call.is_root:
                graph = self.model.graph
                self._bodies[key] = _body(
                    graph.node, [v.name for v in model_inputs(self.model)], [v.name for v in graph.output],
                    self.scopes[""], self.functions, opsets, self.tensors,
                )
            else:
                function = self.functions[(call.function[0], call.function[1], call.overload)]
                own = {o.domain: o.version for o in function.opset_import} or opsets
                self._bodies[key] = _body(
                    function.node, list(function.input), list(function.output), self.scopes.get(call.call_name, {}),
                    self.functions, own, self.tensors, function_id(function),
                )
        return self._bodies[key]


def _enclosing_modules(props: Mapping[str, str], path: str) -> list[tuple[str, str]]:
    """(module path, class) of the modules enclosing a flat node's module, outermost first, from
    torch's ``name_scopes`` and ``class_hierarchy`` (kept on the nodes of a flat copy): the modules
    that have no nodes of their own (``h.0.mlp``, whose nodes are all its children's)."""
    import ast

    try:
        scopes = ast.literal_eval(props.get(NAME_SCOPES, "[]"))
        hierarchy = ast.literal_eval(props.get(CLASS_HIERARCHY, "[]"))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return []
    if not isinstance(scopes, list) or not isinstance(hierarchy, list) or len(scopes) != len(hierarchy):
        return []
    return [
        (scope, hierarchy[index] if isinstance(hierarchy[index], str) else "")
        for index, scope in enumerate(scopes[1:-1], 1)
        if isinstance(scope, str) and path.startswith(scope + ".")
    ]


# -- matching ----------------------------------------------------------------------------------


def _key(call: ModuleCall) -> tuple[str, str]:
    return (call.call_name, call.qualified_class)


def _merge(a: ModuleCall | None, b: ModuleCall | None, parent: CallDiff | None, file_a: _File, file_b: _File) -> CallDiff:
    call = b or a
    path = "" if call.is_root else call.call_name
    if a is None or b is None:
        node = CallDiff(path, call.qualified_class, "added" if a is None else "removed", a, b, parent=parent)
        node.children = [_merge(None if a is None else c, c if a is None else None, node, file_a, file_b) for c in call.children]
        return node
    node = CallDiff(path, call.qualified_class, "same", a, b, parent=parent)
    in_b = {_key(c): c for c in b.children}
    in_a = {_key(c): c for c in a.children}
    removed_after: dict[tuple[str, str] | None, list[ModuleCall]] = collections.defaultdict(list)
    previous = None
    for child in a.children:
        if _key(child) in in_b:
            previous = _key(child)
        else:
            removed_after[previous].append(child)
    children = [_merge(c, None, node, file_a, file_b) for c in removed_after[None]]
    for child in b.children:
        children.append(_merge(in_a.get(_key(child)), child, node, file_a, file_b))
        if _key(child) in in_a:
            children += [_merge(c, None, node, file_a, file_b) for c in removed_after.get(_key(child), [])]
    node.children = children
    body_a, body_b = file_a.body(a), file_b.body(b)
    if (body_a is None) != (body_b is None):
        own = ["no ops -> a function" if body_a is None else "a function -> no ops"]
    elif body_a is None:
        own = []
    else:
        own = _compare(body_a, body_b, file_a.tensors, file_b.tensors)
    below = list(dict.fromkeys(c.path for c in children if c.change != "same"))
    if own or below:
        node.change = "changed"
        node.changed_in = "own" if own else "below"
        node.what = own + ([f"calls below changed: {', '.join(shown(p) for p in below)}"] if below else [])
        if not a.is_root and a.function is not None and b.function is not None and _label(a) != _label(b):
            node.what.append(f"body: {_label(a)} -> {_label(b)}")
    return node


# -- numerics and time -------------------------------------------------------------------------


#: Element types between which the same input values are cast (a float32 file and its float16 copy).
_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE})


def _check_inputs(file_a: _File, file_b: _File) -> dict[str, int]:
    """The two files take the same inputs (names, ranks, fixed dims, element types), or say which not.

    Returns:
        The inputs whose floating-point type differs (a float32 file and its float16 copy), with
        B's type: B is fed the same values cast to it.
    """
    inputs_a = {v.name: v for v in model_inputs(file_a.model)}
    inputs_b = {v.name: v for v in model_inputs(file_b.model)}
    only_a, only_b = [n for n in inputs_a if n not in inputs_b], [n for n in inputs_b if n not in inputs_a]
    if only_a or only_b:
        raise InvalidInputError(
            f"The inputs of the two files do not match: only {file_a.path!r} takes {only_a or 'nothing more'}, "
            f"only {file_b.path!r} takes {only_b or 'nothing more'}.",
            hint="diff runs both files on the same inputs; compare files of one model with the same signature.",
        )

    def described(value: onnx.ValueInfoProto) -> tuple[int, str, list]:
        tensor = value.type.tensor_type
        elem = onnx.TensorProto.DataType.Name(tensor.elem_type).lower() if tensor.elem_type else "?"
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor.shape.dim]
        return tensor.elem_type, elem, dims

    cast: dict[str, int] = {}
    for name, value in inputs_a.items():
        (type_a, elem_a, dims_a), (type_b, elem_b, dims_b) = described(value), described(inputs_b[name])
        fixed_differ = len(dims_a) != len(dims_b) or any(
            isinstance(x, int) and isinstance(y, int) and x != y for x, y in zip(dims_a, dims_b)
        )
        if type_a != type_b and type_a in _FLOATS and type_b in _FLOATS and not fixed_differ:
            cast[name] = type_b
        elif type_a != type_b or fixed_differ:
            raise InvalidInputError(
                f"The input {shown(name)!r} differs between the two files: {elem_a}{dims_a} in {file_a.path!r}, "
                f"{elem_b}{dims_b} in {file_b.path!r}.",
                hint="diff runs both files on the same inputs; an input's rank, fixed dims and element type must "
                "agree (floating-point types may differ: B gets the same values cast to its type).",
            )
    return cast


def _feeds(file_a: _File, file_b: _File, inputs: Any, seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A's feeds and B's: the same values, cast where B declares another floating-point type."""
    cast = _check_inputs(file_a, file_b)
    feeds = feeds_for(file_a.model, inputs, seed=seed)
    feeds_b = dict(feeds)
    for name, elem_type in cast.items():
        feeds_b[name] = feeds[name].astype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    try:
        check_feeds(file_b.model, feeds_b)
    except InvalidInputError as e:
        raise InvalidInputError(f"{file_b.path!r}: {str(e).splitlines()[0].removeprefix('[input] ')}") from e
    return feeds, feeds_b


def _drift(outputs_a: list[np.ndarray], outputs_b: list[np.ndarray]) -> tuple[float, float, float]:
    """(max abs, max rel, scaled drift) of B's outputs against A's (see :class:`CallDiff`)."""
    if len(outputs_a) != len(outputs_b):
        return math.inf, math.inf, math.inf
    worst_abs, worst_rel, worst_scaled = 0.0, 0.0, 0.0
    for x, y in zip(outputs_a, outputs_b):
        x, y = np.asarray(x), np.asarray(y)
        # relative error over A's values above the dtype's default atol (1e-4 for float32), as the parity
        # report does: near 0 the absolute difference judges, and 1e-7 off by 1e-4 is not a 1e+03 drift
        abs_, rel = max_differences(y, x, rel_above=default_tolerance(x.dtype).atol)
        worst_abs, worst_rel = max(worst_abs, abs_), max(worst_rel, rel)
        if abs_:
            scale = _magnitude(x)
            worst_scaled = max(worst_scaled, abs_ / scale if scale > 0 else math.inf)
    return worst_abs, worst_rel, worst_scaled


def _magnitude(values: np.ndarray) -> float:
    """The largest finite ``|value|`` (0 for empty, non-numeric or all non-finite values)."""
    if values.size == 0 or values.dtype.kind not in "biufc":
        return 0.0
    magnitude = np.abs(values.astype(np.complex128 if values.dtype.kind == "c" else np.float64))
    finite = magnitude[np.isfinite(magnitude)]
    return float(finite.max()) if finite.size else 0.0


def _numerics(root: CallDiff, file_a: _File, file_b: _File, feeds: Mapping[str, np.ndarray], feeds_b) -> None:
    outputs_a, calls_a = call_outputs(
        file_a.model, feeds, external_data_folder=runtime.external_data_folder(file_a.path, file_a.model),
        what=f"instrumented copy of {file_a.path!r}",
    )
    outputs_b, calls_b = call_outputs(
        file_b.model, feeds_b, external_data_folder=runtime.external_data_folder(file_b.path, file_b.model),
        what=f"instrumented copy of {file_b.path!r}",
    )
    _set_output_drift(root, outputs_a, outputs_b)
    by_path = {call.path: call for call in root.walk() if call.change != "added" and call.change != "removed"}
    values_b = {c.call_name: c for c in calls_b}
    seen = 0.0
    first = True
    for order, values in enumerate(calls_a):
        node = by_path.get(values.call_name)
        other = values_b.get(values.call_name)
        if node is None or other is None:
            continue
        node.max_abs, node.max_rel, node.scaled_drift = _drift(values.outputs, other.outputs)
        node.order = order
        node.drift_before = seen
        seen = max(seen, node.scaled_drift)
        if first and node.max_abs:
            node.first_drift, first = True, False
    root.drift_before = seen  # the model outputs come last


def _set_output_drift(root: CallDiff, outputs_a: Mapping[str, np.ndarray], outputs_b: Mapping[str, np.ndarray]) -> None:
    """The model outputs' drift on the root: matched by name, else by position."""
    names_a, names_b = list(outputs_a), list(outputs_b)
    if set(names_a) == set(names_b):
        pairs = [(outputs_a[n], outputs_b[n]) for n in names_a]
    elif len(names_a) == len(names_b):
        pairs = list(zip(outputs_a.values(), outputs_b.values()))
    else:
        root.max_abs, root.max_rel, root.scaled_drift = math.inf, math.inf, math.inf
        return
    root.max_abs, root.max_rel, root.scaled_drift = _drift([x for x, _ in pairs], [y for _, y in pairs])


def _output_drift(root: CallDiff, file_a: _File, file_b: _File, feeds: Mapping[str, np.ndarray], feeds_b) -> None:
    """The model outputs only (files compared by module: no call outputs to capture)."""
    outputs = []
    for file, file_feeds in ((file_a, feeds), (file_b, feeds_b)):
        names, values = runtime.run(
            file.model.SerializeToString(), file_feeds, what=f"model {file.path!r}",
            external_data_folder=runtime.external_data_folder(file.path, file.model),
        )
        outputs.append(dict(zip(names, values)))
    _set_output_drift(root, *outputs)


#: Rounds of ``profile=True``: the files are profiled in turn (A B, B A, A B), so that a change of
#: the machine's load during the measurement falls on both.
PROFILE_ROUNDS = 3


def _times(root: CallDiff, file_a: _File, file_b: _File, feeds, feeds_b, runs: int, threads: int | None) -> dict[str, Any]:
    """Each call's inclusive time in both files: the median over :data:`PROFILE_ROUNDS` alternating
    rounds of :func:`~onnx_modular.profiling.run.profile` (each round's own median over its runs)."""
    import statistics

    from onnx_modular.profiling.run import profile

    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise InvalidInputError(f"runs must be an integer >= 1, got {runs!r}.")
    rounds = min(PROFILE_ROUNDS, runs)
    per_round = -(-runs // rounds)
    reports: dict[int, list] = {0: [], 1: []}
    for index in range(rounds):
        for side in ((0, 1) if index % 2 == 0 else (1, 0)):
            file = (file_a, file_b)[side]
            reports[side].append(profile(file.path, dict((feeds, feeds_b)[side]), runs=per_round, threads=threads))
    for call in root.walk():
        for side, attribute in ((0, "time_a_us"), (1, "time_b_us")):
            module_call = call.a if side == 0 else call.b
            if module_call is None or module_call.key not in reports[side][0].times:
                continue
            setattr(call, attribute, statistics.median(r.times[module_call.key].inclusive_us for r in reports[side]))
    settings = dict(reports[1][0].settings)
    settings.update(runs=per_round * rounds, rounds=rounds)
    settings["median_run_ms"] = [statistics.median(r.median_run_us for r in reports[side]) / 1e3 for side in (0, 1)]
    return settings


# -- the tool ----------------------------------------------------------------------------------


def diff(
    a: str | os.PathLike,
    b: str | os.PathLike,
    *,
    inputs: str | os.PathLike | Mapping[str, np.ndarray] | None = None,
    numerics: bool = True,
    profile: bool = False,
    runs: int = 10,
    threads: int | None = 1,
    seed: int = 0,
) -> ModelDiff:
    """Compare two ONNX files module call by module call: structure, numerics and (``profile``) time.

    Args:
        a, b: The two ``.onnx`` files (A the reference, B the one compared with it), each with
            local functions (a modular export; any file whose functions call each other).
        inputs: The inputs both files run on: an ``.npz`` file or arrays by name; random from A's
            declared input types by default (``seed``; symbolic dims 2, masks all ones).
        numerics: Run both files (every call's outputs captured); ``False``: structure only.
        profile: Also time every call in both files (onnxruntime's profiler, ``runs`` runs in all,
            in 3 rounds that alternate the files, each after 2 warm-up runs; ``threads`` intra-op
            threads: one by default, as repeated ratios on a shared machine agree best that way).
        seed: Seed of the random inputs.

    Returns:
        The merged call tree with each call's verdict, drift and times (:class:`ModelDiff`;
        ``result.differs`` is what the command's exit code says).

    Raises:
        InvalidModelFileError: A file cannot be read (missing, not ONNX, truncated, external data
            missing or outside its folder).
        InvalidInputError: A file without local functions or module paths on its nodes; files whose
            inputs differ (which input, and how; floating-point types may differ: B gets the same
            values cast to its type); given inputs that do not fit.
        VerificationError: onnxruntime cannot run a file.

    Example::

        result = diff("gpt2.onnx", "gpt2.fp16.onnx")
        print(result.first_drift.path, [c.path for c in result.ranked(3)])
    """
    if profile and isinstance(runs, int) and not isinstance(runs, bool):
        check_count("MAX_RUNS", runs, "--runs, the measured runs of the profile")  # before any work
    file_a, file_b = _File(a), _File(b)
    note = None
    if not file_a.model.functions or not file_b.model.functions:
        for file in (file_a, file_b):
            file.compare_by_module()
        note = (
            "compared by the module path on each node (a file has no local functions): modules, not calls "
            "(no call index); drift of the model outputs only"
        )
    root = _merge(file_a.tree.root, file_b.tree.root, None, file_a, file_b)
    result = ModelDiff(
        str(a), str(b), root, random_inputs=inputs is None, seed=seed, numerics=numerics, note=note,
        by_module=note is not None,
    )
    if numerics or profile:
        feeds, feeds_b = _feeds(file_a, file_b, inputs, seed)
        result.inputs = {name: {"shape": list(x.shape), "dtype": str(x.dtype)} for name, x in feeds.items()}
        result.cast = {name: str(x.dtype) for name, x in feeds_b.items() if x.dtype != feeds[name].dtype}
        if numerics and note is not None:
            _output_drift(root, file_a, file_b, feeds, feeds_b)
        elif numerics:
            _numerics(root, file_a, file_b, feeds, feeds_b)
        if profile:
            result.settings = _times(root, file_a, file_b, feeds, feeds_b, runs, threads)
    return result
