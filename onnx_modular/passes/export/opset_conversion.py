"""ONNX opset versions that keep local functions: checks and a per-body version conversion.

torch-free. Both converters that exist flatten the model first: onnxscript's
``ConvertVersionPass`` runs an ``InlinePass`` (onnxscript#2813) and onnx's C++ converter
rejects or drops local functions (onnx#4370). What a version converter does, though, is
local to one node (an attribute becomes an input, ``Split`` gains ``num_outputs``, ...), so
it can run on every body on its own: :class:`ConvertOpsetPass` wraps each function body, and
the main graph, as a model of its own, converts it with ``onnx.version_converter`` (the same
C++ converter ``torch.onnx.export`` falls back to), and puts the converted nodes back,
with the names and metadata the converter drops. Calls of other functions are nodes of a
custom domain, which the converter leaves alone, so the hierarchy is untouched.

``export_modular`` avoids converting wherever torch's translator can write the opset
itself (18 and above: it picks the torchlib implementation for that opset, which is how
``Attention`` and ``RMSNormalization`` appear at 23); only opset 17 is converted, down
from the translator's 18, exactly as torch's own flat export does.
"""

from __future__ import annotations

import functools

import onnx
import onnx.version_converter
import onnx_ir as ir

from onnx_modular.errors import InvalidInputError
from onnx_modular.format import metadata
from onnx_modular.passes.export.default_opset import SetDefaultOpsetPass
from onnx_modular.passes.functions import bodies

__all__ = [
    "MIN_OPSET",
    "max_opset",
    "supported_opsets",
    "check_opset",
    "ConvertOpsetPass",
]

#: The lowest opset a modular file can have: torchlib is written for 18, and onnx's
#: converter brings it down to 17 (the oldest opset TensorRT 8.x and mobile runtimes read).
MIN_OPSET = 17

# Small constants (Reduce axes, Split sizes, ...) go into the wrapper model as initializers,
# so that adapters which need them as constants see them; larger ones are typed inputs.
_MAX_INLINE_CONSTANT = 1024


@functools.lru_cache(maxsize=1)
def max_opset() -> int:
    """The newest opset of the default domain both the installed onnx and onnxruntime read.

    onnxruntime publishes no number for it, so a one-node model is loaded at each opset
    from onnx's newest down (a few milliseconds, once per process).
    """
    newest = onnx.defs.onnx_opset_version()
    try:
        import onnxruntime as ort
    except ImportError:
        return newest
    for version in range(newest, MIN_OPSET, -1):
        graph = onnx.helper.make_graph(
            [onnx.helper.make_node("Identity", ["x"], ["y"])],
            "probe",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
        )
        probe = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", version)], ir_version=10)
        try:
            ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
        except Exception:
            continue
        return version
    return MIN_OPSET


def supported_opsets() -> range:
    return range(MIN_OPSET, max_opset() + 1)


def check_opset(opset_version: int | None, *, default: int) -> int:
    """The opset to write: ``default`` for ``None``; a typed error when it cannot be reached."""
    if opset_version is None:
        return default
    possible = supported_opsets()
    if isinstance(opset_version, bool) or not isinstance(opset_version, int) or opset_version not in possible:
        raise InvalidInputError(
            f"opset_version={opset_version!r} cannot be written: the possible opsets are "
            f"{possible.start} to {possible.stop - 1} (the newest the installed onnx {onnx.__version__} "
            f"and onnxruntime both read; below {MIN_OPSET} torch's operator library has no conversion).",
            hint=f"Pass an opset from {possible.start} to {possible.stop - 1}, or None for {default}.",
        )
    return opset_version


class ConvertOpsetPass(ir.passes.InPlacePass):
    """Convert every body (main graph and each function) to ``target`` without inlining.

    Bodies already at ``target`` are left as they are. Raises :class:`InvalidInputError`
    naming the function when onnx's converter cannot convert one of its ops.
    """

    def __init__(self, target: int):
        super().__init__()
        self.target = target

    def requires(self, model: ir.Model) -> None:
        check_opset(self.target, default=self.target)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        source = model.opset_imports.get("", model.graph.opset_imports.get(""))
        modified = False
        for body in bodies(model):
            version = body.opset_imports.get("", source)
            if version is None or version == self.target:
                continue
            if not any(node.domain in ("", "ai.onnx") for node in ir.traversal.RecursiveGraphIterator(body)):
                continue
            _convert_body(model, body, version, self.target)
            modified = True
        SetDefaultOpsetPass(self.target)(model)
        return ir.passes.PassResult(model, modified=modified or source != self.target)


def _value_info(value: ir.Value) -> onnx.ValueInfoProto:
    if value.type is not None:
        return ir.serde.serialize_value(value)
    return onnx.helper.make_value_info(value.name, onnx.TypeProto())


def _wrap(model: ir.Model, body: ir.Graph | ir.Function, version: int) -> onnx.ModelProto:
    """``body`` as a model of its own (weights as typed inputs, small constants as initializers)."""
    if isinstance(body, ir.Function):
        proto = ir.serde.serialize_function(body)
        nodes, inputs, outputs = list(proto.node), list(body.inputs), list(body.outputs)
        initializers = []
    else:
        # Serialize the nodes without the weights: the graph's initializers are not part of it.
        nodes = [ir.serde.serialize_node(node) for node in body]
        inputs, outputs = list(body.inputs), list(body.outputs)
        initializers = []
        for value in body.initializers.values():
            tensor = value.const_value
            if tensor is not None and tensor.size <= _MAX_INLINE_CONSTANT:
                initializers.append(ir.serde.serialize_tensor(tensor))
            elif value not in inputs:
                inputs.append(value)
    imports = {**model.opset_imports, **body.opset_imports, "": version}
    for node in nodes:
        _constant_as_tensor(node)
    graph = onnx.helper.make_graph(
        nodes,
        "body",
        [_value_info(value) for value in inputs],
        [_value_info(value) for value in outputs],
        initializer=initializers,
    )
    return onnx.helper.make_model(
        graph,
        opset_imports=[onnx.helper.make_opsetid(domain, v) for domain, v in imports.items()],
        ir_version=model.ir_version,
    )


_CONSTANT_FORMS = {"value_int": onnx.TensorProto.INT64, "value_ints": onnx.TensorProto.INT64,
                   "value_float": onnx.TensorProto.FLOAT, "value_floats": onnx.TensorProto.FLOAT}


def _constant_as_tensor(node: onnx.NodeProto) -> None:
    """``Constant <value_ints = [1]>`` as ``Constant <value = int64[1] {1}>`` (the same value).

    onnx's converter reads a constant input (the axes of a Reduce op) only from ``value``.
    """
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
        return
    (attribute,) = node.attribute
    dtype = _CONSTANT_FORMS.get(attribute.name)
    if dtype is None:
        return
    value = onnx.helper.get_attribute_value(attribute)
    scalar = not isinstance(value, (list, tuple)) and not hasattr(value, "__len__")
    values = [value] if scalar else list(value)
    tensor = onnx.helper.make_tensor("value", dtype, [] if scalar else [len(values)], values)
    del node.attribute[:]
    node.attribute.append(onnx.helper.make_attribute("value", tensor))


# onnx's converter has no 18 -> 17 adapter for Split and Pad; their opset-13 forms are done here,
# and the nodes pass through the converter under this domain (custom domains are left alone).
_DONE_DOMAIN = metadata.CONVERTED_DOMAIN


def _split_pad_to_13(body: ir.Graph | ir.Function, what: str) -> bool:
    """Split with ``num_outputs`` gets its sizes as an input; Pad without ``axes`` is unchanged."""
    found = False
    for node in list(ir.traversal.RecursiveGraphIterator(body)):
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("Split", "Pad"):
            continue
        if node.op_type == "Pad" and len(node.inputs) > 3 and node.inputs[3] is not None:
            raise InvalidInputError(
                f"Pad with an axes input in {what} has no form below opset 18.",
                hint="Export at opset 18 or above.",
            )
        if node.op_type == "Split" and "num_outputs" in node.attributes:
            _split_sizes_as_input(node)
        node.domain = _DONE_DOMAIN
        found = True
    return found


def _split_sizes_as_input(node: ir.Node) -> None:
    """Opset 18's ``num_outputs=n`` (chunks of ceil(d / n), the last one smaller) as sizes."""
    n = node.attributes["num_outputs"].as_int()
    del node.attributes["num_outputs"]
    axis = node.attributes["axis"].as_int() if "axis" in node.attributes else 0
    x = node.inputs[0]
    graph = node.graph
    new_nodes: list[ir.Node] = []

    def add(op_type: str, inputs, **attributes) -> ir.Value:
        created = ir.node(op_type, inputs, attributes=attributes)
        created.metadata_props.update(node.metadata_props)
        new_nodes.append(created)
        return created.outputs[0]

    def constant(values: list[int]) -> ir.Value:
        return add("Constant", [], value=ir.tensor(values, dtype=ir.DataType.INT64))

    dim = x.shape[axis] if x.shape is not None and -x.shape.rank() <= axis < x.shape.rank() else None
    if isinstance(dim, int):
        chunk = -(-dim // n)
        sizes = constant([chunk] * (n - 1) + [dim - chunk * (n - 1)])
    else:
        d = add("Gather", [add("Shape", [x]), constant([axis])], axis=0)
        chunk = add("Div", [add("Add", [d, constant([n - 1])]), constant([n])])
        last = add("Sub", [d, add("Mul", [chunk, constant([n - 1])])])
        sizes = add("Concat", [*([chunk] * (n - 1)), last], axis=0)
    graph.insert_before(node, new_nodes)
    node.resize_inputs(2)
    node.replace_input_with(1, sizes)


def _convert_body(model: ir.Model, body: ir.Graph | ir.Function, version: int, target: int) -> None:
    what = f"function {body.domain}:{body.name}" if isinstance(body, ir.Function) else "the main graph"
    if version >= 18 > target and _split_pad_to_13(body, what):
        body.opset_imports[_DONE_DOMAIN] = 1
    try:
        converted = onnx.version_converter.convert_version(_wrap(model, body, version), target)
    except Exception as e:
        raise InvalidInputError(
            f"onnx's version converter cannot bring {what} from opset {version} to {target}: {e}",
            hint="Export at another opset (18 and above need no conversion).",
        ) from e
    body.opset_imports.pop(_DONE_DOMAIN, None)
    new_graph = ir.serde.deserialize_graph(converted.graph)
    for node in ir.traversal.RecursiveGraphIterator(new_graph):
        if node.domain == _DONE_DOMAIN:
            node.domain = ""
        _drop_unknown_default_attributes(node, version, target, what)
    _transplant(body, new_graph)


def _drop_unknown_default_attributes(node: ir.Node, version: int, target: int, what: str) -> None:
    """Drop an attribute the target schema lacks when it holds the source schema's default.

    onnx's 18 -> 17 adapters move Reduce axes back into an attribute but keep
    ``noop_with_empty_axes`` (opset 18 only, except ReduceSum), which then fails the checker.
    """
    if node.domain not in ("", "ai.onnx"):
        return
    try:
        schema = onnx.defs.get_schema(node.op_type, target, "")
        source = onnx.defs.get_schema(node.op_type, version, "")
    except onnx.defs.SchemaError:
        return
    for name in [name for name in node.attributes if name not in schema.attributes]:
        default = source.attributes.get(name)
        value = node.attributes[name]
        if default is not None and default.default_value.HasField("type"):
            if ir.serde.serialize_attribute(value).SerializeToString() == (
                _named(default.default_value, name).SerializeToString()
            ):
                del node.attributes[name]
                continue
        raise InvalidInputError(
            f"onnx's version converter left attribute {name!r} on {node.op_type} in {what}, "
            f"which opset {target} does not have.",
            hint="Export at another opset (18 and above need no conversion).",
        )


def _named(attribute: onnx.AttributeProto, name: str) -> onnx.AttributeProto:
    copy = onnx.AttributeProto()
    copy.CopyFrom(attribute)
    copy.name = name
    return copy


def _transplant(body: ir.Graph | ir.Function, new_graph: ir.Graph) -> None:
    """Replace ``body``'s nodes by ``new_graph``'s, wired to ``body``'s own inputs and weights.

    The converter keeps value names but drops node names and metadata; a converted node
    takes them from the original node that produced the same output, else (a helper node an
    adapter added) from the node that consumes its output.
    """
    old_nodes = list(ir.traversal.RecursiveGraphIterator(body))
    producer = {value.name: node for node in old_nodes for value in node.outputs}
    old_values = {value.name: value for node in old_nodes for value in node.outputs}
    sources = {value.name: value for value in body.inputs}
    if isinstance(body, ir.Graph):
        sources.update(body.initializers)
    wrapper_sources = {value.name for value in new_graph.inputs} | set(new_graph.initializers)

    new_nodes = list(new_graph)
    for node in ir.traversal.RecursiveGraphIterator(new_graph):
        for i, value in enumerate(node.inputs):
            if value is not None and value.name in wrapper_sources and value.name in sources:
                node.replace_input_with(i, sources[value.name])
    new_outputs = list(new_graph.outputs)
    new_graph.outputs.clear()
    new_graph.remove(new_nodes, safe=False)

    converted = _with_subgraph_nodes(new_nodes)
    origin = _origins(converted, producer)
    for node in converted:
        original = origin.get(id(node))
        if original is not None:
            _inherit(node, original, old_values)

    outputs = list(body.outputs)
    body.remove(list(body), safe=False)
    body.extend(new_nodes)
    for i, (old, new) in enumerate(zip(outputs, new_outputs)):
        if old.producer() is None and old.name in sources:  # an input or weight returned as is
            continue
        new.type = new.type or old.type
        new.shape = new.shape or old.shape
        new.metadata_props.update(old.metadata_props)
        body.outputs[i] = new


def _with_subgraph_nodes(nodes: list[ir.Node]) -> list[ir.Node]:
    """``nodes`` and, after each, every node of its subgraphs."""
    converted: list[ir.Node] = []
    for node in nodes:
        converted.append(node)
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                converted += list(ir.traversal.RecursiveGraphIterator(attr.as_graph()))
            elif attr.type == ir.AttributeType.GRAPHS:
                for graph in attr.as_graphs():
                    converted += list(ir.traversal.RecursiveGraphIterator(graph))
    return converted


def _origins(converted: list[ir.Node], producer: dict[str, ir.Node]) -> dict[int, ir.Node]:
    """``{id(converted node): original node}``: the original that produced the same output, else
    (a helper node an adapter added) the original of the node consuming its output."""
    origin: dict[int, ir.Node] = {}
    for node in converted:
        original = next((producer[v.name] for v in node.outputs if v.name in producer), None)
        if original is not None:
            origin[id(node)] = original
    for node in reversed(converted):  # helpers inherit from their consumer
        if id(node) not in origin:
            consumer = next(
                (origin[id(use.node)] for v in node.outputs for use in v.uses() if id(use.node) in origin), None
            )
            if consumer is not None:
                origin[id(node)] = consumer
    return origin


def _inherit(node: ir.Node, original: ir.Node, old_values: dict[str, ir.Value]) -> None:
    """A converted node takes its original's name (same first output), metadata and doc string;
    its outputs the types, shapes and metadata of the original values of the same names."""
    if original.outputs and node.outputs and original.outputs[0].name == node.outputs[0].name:
        node.name = original.name
    node.metadata_props.update(original.metadata_props)
    node.meta.update(original.meta)
    if original.doc_string and not node.doc_string:
        node.doc_string = original.doc_string
    for value in node.outputs:
        old = old_values.get(value.name)
        if old is not None:
            value.type = value.type or old.type
            value.shape = value.shape or old.shape
            value.metadata_props.update(old.metadata_props)
