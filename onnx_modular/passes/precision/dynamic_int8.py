"""Dynamic int8 inside the bodies of a ``ModelProto``: constant MatMul/Gemm weights to int8, activations
quantized at run time (onnxruntime's ``com.microsoft.DynamicQuantizeMatMul``).

No ONNX quantizer looks inside local functions (onnxruntime's ``quantize_dynamic`` rewrites the main
graph only), so this pass does what ``quantize_dynamic`` does, in the bodies:

- a ``MatMul`` (or ``Gemm`` without ``transA``/``alpha``/``beta``) whose second input is a constant
  2-D float32 weight (a main-graph initializer passed down through formal inputs, read nowhere else:
  the same rule as :mod:`~onnx_modular.passes.precision.quantize_weights`, whose threading is reused)
  becomes ``DynamicQuantizeMatMul(x, weight_int8, weight_scale)``; the ``Add`` of a constant 1-D bias
  right after it (``nn.Linear``'s body) becomes the op's ``bias`` input;
- the weights are int8, symmetric, one scale per output column (onnxruntime's
  ``quant_utils.quantize_nparray`` and ``get_qmin_qmax_for_qType``: -127..127), packed one tensor at a
  time when the file is written (:attr:`DynamicInt8.sources`);
- ``com.microsoft.Attention`` on packed constant weights (what ``optimize``'s ``mha`` step writes) is
  opened first into ``MatMul`` + ``Split`` + ``MultiHeadAttention`` (the bias, the mask as
  ``attention_bias``, ``num_heads`` and ``scale`` kept), so its GEMM is quantized like the others
  (onnxruntime's ``QAttention`` takes no ``attention_bias``);
- ``SkipLayerNormalization`` is opened into ``Sum`` + ``LayerNormalization``: onnxruntime 1.32's CPU
  kernel is about 6x slower than the two (a quarter of a dynamic int8 BERT-base's run), and the int8
  kernels are CPU kernels.

Every quantized node can also run *weight-only* (:func:`to_weight_only`): the same int8 weight
dequantized (``Cast`` and ``Mul`` by the per-column scales, which onnxruntime folds into a float weight
when it loads the file) into a float ``MatMul``: the rounding of the weights
only, float compute. :mod:`onnx_modular.files.optimize.encoder_guard` chooses per call.

Entry: :func:`quantize_dynamic_int8`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper

from onnx_modular.passes.precision.quantize_weights import COMPUTED, FLOAT, MS_DOMAIN, Quantizer, unused_name
from onnx_modular.passes.proto_bodies import Body, call_sites, ensure_opset, function_id, uses

__all__ = ["DYNAMIC_OP", "DynamicInt8", "quantize_dynamic_int8", "open_attention", "to_weight_only", "is_dynamic"]

#: The op of a dynamically quantized MatMul.
DYNAMIC_OP = "DynamicQuantizeMatMul"
#: Suffixes of the int8 weight and its per-column scales (main-graph initializers and formal inputs).
PARTS = ("_int8", "_scale")


@dataclasses.dataclass
class DynamicInt8:
    """What :func:`quantize_dynamic_int8` did.

    Attributes:
        quantized: The ``DynamicQuantizeMatMul`` made, as ``(body label, node name)``.
        opened: The ``Attention`` nodes opened into ``MatMul`` + ``Split`` + ``MultiHeadAttention``.
        norms: The ``SkipLayerNormalization`` nodes opened into ``Sum`` + ``LayerNormalization``.
        skipped: Weight-reading nodes left float, as ``(body label, node, reason)``.
        sources: New main-graph initializer -> a function computing its values.
    """

    quantized: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    opened: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    norms: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    sources: dict[str, Callable[[], np.ndarray]] = dataclasses.field(default_factory=dict)


def is_dynamic(node: onnx.NodeProto) -> bool:
    return node.op_type == DYNAMIC_OP and node.domain == MS_DOMAIN


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def open_attention(body: Body, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """``Attention(x, w, b, [mask_index, past,] attention_bias)`` as ``MatMul`` + ``Split`` +
    ``MultiHeadAttention`` (same outputs), or ``None`` when the node uses what MultiHeadAttention
    has no input for (a mask index, a past, ``unidirectional`` and the like)."""
    inputs = list(node.input) + [""] * (6 - len(node.input))
    attrs = _attrs(node)
    if any(inputs[3:5]) or len(node.output) > 1 or set(attrs) - {"num_heads", "scale", "qkv_hidden_sizes"}:
        return None
    heads = attrs["num_heads"]
    sizes = list(attrs.get("qkv_hidden_sizes") or [])
    if sizes and (sizes[0] != sizes[1]):
        return None
    packed = unused_name(body, node.output[0] + "_qkv")
    split_sizes = unused_name(body, node.output[0] + "_qkv_sizes")
    q, k, v = (unused_name(body, f"{node.output[0]}_{role}") for role in "qkv")
    made = [onnx.helper.make_node("MatMul", [inputs[0], inputs[1]], [packed], name=f"{node.name}_qkv_proj")]
    split_inputs = [packed]
    if sizes:
        made.append(onnx.helper.make_node("Constant", [], [split_sizes], name=f"{node.name}_qkv_sizes",
                                          value=onnx.numpy_helper.from_array(np.array(sizes, np.int64))))
        split_inputs.append(split_sizes)
        made.append(onnx.helper.make_node("Split", split_inputs, [q, k, v], name=f"{node.name}_qkv_split", axis=-1))
    else:
        made.append(onnx.helper.make_node("Split", split_inputs, [q, k, v], name=f"{node.name}_qkv_split", axis=-1,
                                          num_outputs=3))
    mha = {"num_heads": heads, **({"scale": attrs["scale"]} if "scale" in attrs else {})}
    made.append(onnx.helper.make_node("MultiHeadAttention", [q, k, v, inputs[2], "", inputs[5]], list(node.output),
                                      name=f"{node.name}_mha", domain=MS_DOMAIN, **mha))
    for new in made:
        new.metadata_props.extend(node.metadata_props)
    return made


def open_skip_layer_norm(body: Body, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """``SkipLayerNormalization(x, skip, gamma, beta[, bias])`` as ``Sum`` + ``LayerNormalization`` (its
    4th output, the sum, kept), or ``None`` when the mean or inverse deviation outputs are read.
    onnxruntime 1.32's CPU kernel takes 0.43 ms at ``[1, 128, 768]`` (one thread) against 0.07 ms for
    the two ops, and ``Sum`` is not an ``Add``, so onnxruntime does not fuse them back when it knows the shapes."""
    outputs = list(node.output) + [""] * (4 - len(node.output))
    read = {name for n in body.node for name in n.input} | {getattr(v, "name", v) for v in body.output}
    if any(name and name in read for name in outputs[1:3]) or len(node.input) < 3:
        return None
    attrs = _attrs(node)
    total = outputs[3] or unused_name(body, outputs[0] + "_sum")
    inputs = [node.input[0], node.input[1]] + ([node.input[4]] if len(node.input) > 4 and node.input[4] else [])
    norm_inputs = [total, node.input[2]] + ([node.input[3]] if len(node.input) > 3 and node.input[3] else [])
    made = [onnx.helper.make_node("Sum", inputs, [total], name=f"{node.name}_sum"),
            onnx.helper.make_node("LayerNormalization", norm_inputs, [outputs[0]], name=f"{node.name}_norm", axis=-1,
                                  epsilon=attrs.get("epsilon", 1e-12))]
    for new in made:
        new.metadata_props.extend(node.metadata_props)
    return made


def to_weight_only(body: Body, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """A ``DynamicQuantizeMatMul`` of this pass as ``Cast`` + ``Mul`` by the per-column scales + ``MatMul``
    (+ ``Add`` of its bias): the same int8 weight, float compute. The nodes, in order."""
    a, weight, scale = node.input[0], node.input[1], node.input[2]
    bias = node.input[4] if len(node.input) > 4 else ""
    widened, dequantized = unused_name(body, weight + "_float"), unused_name(body, weight + "_dequantized")
    # Cast + Mul, not DequantizeLinear: onnxruntime fuses DequantizeLinear + MatMul into MatMulNBits
    # computing in int8 (its session's default accuracy level 4); these fold into a float weight at load
    made = [onnx.helper.make_node("Cast", [weight], [widened], name=f"{node.name}_widen", to=FLOAT),
            onnx.helper.make_node("Mul", [widened, scale], [dequantized], name=f"{node.name}_dequantize")]
    product = node.output[0] if not bias else unused_name(body, node.output[0] + "_matmul")
    made.append(onnx.helper.make_node("MatMul", [a, dequantized], [product], name=f"{node.name}_weight_only"))
    if bias:
        made.append(onnx.helper.make_node("Add", [product, bias], [node.output[0]], name=f"{node.name}_bias"))
    for new in made:
        new.metadata_props.extend(node.metadata_props)
    return made


class _DynamicQuantizer(Quantizer):
    """quantize_weights' threading of constant weights through the call sites, with int8 per-column parts."""

    def __init__(self, model: onnx.ModelProto, folder: str | None, open_norms: bool = True):  # no MatMulNBits packer
        self.open_norms = open_norms
        self.model = model
        self.folder = folder
        self.parts = list(PARTS)
        self.initializers = {t.name: t for t in model.graph.initializer}
        self.sources: dict[str, Callable[[], np.ndarray]] = {}
        self.done: set[tuple[int, str]] = set()
        self.transposed: set[str] = set()

    def _shapes(self, k: int, n: int) -> list[tuple[list[int], int]]:
        return [([k, n], onnx.TensorProto.INT8), ([n], FLOAT)]

    @functools.lru_cache(maxsize=4)  # noqa: B019 (one quantizer per file; the two parts of a weight are written together)
    def _pack(self, name: str) -> tuple[np.ndarray, ...]:
        from onnxruntime.quantization.quant_utils import get_qmin_qmax_for_qType, quantize_nparray

        array = onnx.numpy_helper.to_array(self.initializers[name], base_dir=self.folder or "").astype(np.float32)
        if name in self.transposed:
            array = np.ascontiguousarray(array.T)
        _, qmax = get_qmin_qmax_for_qType(onnx.TensorProto.INT8, symmetric=True)
        scale = np.abs(array).max(axis=0) / float(qmax)
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        quantized = quantize_nparray(onnx.TensorProto.INT8, array, scale[None, :], 0, -qmax, qmax)
        return np.ascontiguousarray(quantized.astype(np.int8)), scale

    def _bias(self, body, node: onnx.NodeProto) -> onnx.NodeProto | None:
        """The ``Add`` of a constant 1-D bias (``[N]``: longer than 1, so the product's width, in a
        valid model) that alone reads the product, if any."""
        readers = uses(body, node.output[0])
        if len(readers) != 1 or node.output[0] in {getattr(v, "name", v) for v in body.output}:
            return None
        add, index = readers[0]
        if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or index not in (0, 1):
            return None
        bias = add.input[1 - index]
        return add if self._is_vector(body, bias) else None

    def _vector_shapes(self, body, name: str, depth: int = 0) -> set[tuple[int, ...]]:
        """The shapes of the float32 initializers ``name`` is, through the call sites (empty: not a constant)."""
        if body is self.model.graph:
            tensor = self.initializers.get(name)
            inputs = {v.name for v in body.input}
            return {tuple(tensor.dims)} if tensor is not None and tensor.data_type == FLOAT and name not in inputs else set()
        if name not in body.input or depth > 64:
            return set()
        index = list(body.input).index(name)
        shapes: set[tuple[int, ...]] = set()
        for caller, call in call_sites(self.model, function_id(body)):
            if index >= len(call.input) or not call.input[index]:
                return set()
            found = self._vector_shapes(caller, call.input[index], depth + 1)
            if not found:
                return set()
            shapes |= found
        return shapes

    def _rewritten(self, body, node: onnx.NodeProto, parts: list[str], removed: set[int]) -> list[onnx.NodeProto]:
        """The ``DynamicQuantizeMatMul`` of ``node`` (its bias, or the Add's after it, as the op's ``bias``
        when it is a vector; a Gemm's other ``C`` in an ``Add`` after it)."""
        output, bias = node.output[0], node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 else ""
        after = []
        if bias and not self._is_vector(body, bias):
            product = unused_name(body, output + "_product")
            after = [onnx.helper.make_node("Add", [product, bias], [output], name=(node.name or output) + "_bias")]
            output, bias = product, ""
        add = self._bias(body, node) if not bias and not after else None
        if add is not None:
            bias, output = add.input[1] if add.input[0] == node.output[0] else add.input[0], add.output[0]
            removed.add(id(add))
        made = onnx.helper.make_node(DYNAMIC_OP, [node.input[0], *parts, "", bias] if bias else [node.input[0], *parts],
                                     [output], name=(node.name or output) + "_int8", domain=MS_DOMAIN)
        for new in [made, *after]:
            new.metadata_props.extend(node.metadata_props)
        return [made, *after]

    def _is_vector(self, body, name: str) -> bool:
        shapes = self._vector_shapes(body, name)
        return bool(shapes) and all(len(shape) == 1 and shape[0] > 1 for shape in shapes)

    def _reaches_initializer(self, body, name: str, depth: int = 0) -> bool:
        """Whether ``name`` is, in some call, a main-graph initializer (through formal inputs and transposes)."""
        if depth > 64:
            return False
        if body is self.model.graph:
            return name in self.initializers
        producer = next((n for n in body.node if name in n.output), None)
        if producer is not None:
            return producer.op_type == "Transpose" and self._reaches_initializer(body, producer.input[0], depth + 1)
        if name not in body.input:
            return False
        index = list(body.input).index(name)
        return any(index < len(call.input) and self._reaches_initializer(caller, call.input[index], depth + 1)
                   for caller, call in call_sites(self.model, function_id(body)))

    def open_attentions(self, body, label: str) -> list[tuple[str, str, str]]:
        """``Attention`` on constant packed weights and ``SkipLayerNormalization`` opened (see their functions)."""
        opened = []
        nodes: list = list(body.node)
        for position, node in enumerate(nodes):
            made = None
            if node.op_type == "Attention" and node.domain == MS_DOMAIN and len(node.input) > 1:
                made = open_attention(body, node) if self._pure(body, node.input[1]) is None else None
            elif node.op_type == "SkipLayerNormalization" and node.domain == MS_DOMAIN and self.open_norms:
                made = open_skip_layer_norm(body, node)
            if made is not None:
                nodes[position] = made
                opened.append((node.op_type, label, node.name or node.output[0]))
        if opened:
            del body.node[:]
            body.node.extend(n for item in nodes for n in (item if isinstance(item, list) else [item]))
        return opened

    def dynamic_body(self, body, label: str) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
        done, skipped = [], []
        nodes: list = list(body.node)
        removed: set[int] = set()
        for position, node in enumerate(nodes):
            if isinstance(node, list) or node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm") \
                    or len(node.input) < 2 or (node.op_type == "MatMul" and len(node.input) != 2):
                continue
            weight = node.input[1]
            why = self._pure(body, weight)
            transposed = False
            if why is None:
                why, transposed = self._weight_reason(body, node)
            # no shape attributes: calls may pass weights of different shapes (one scale vector each)
            if why == COMPUTED or (why and not self._reaches_initializer(body, weight)):
                continue  # activations times activations (attention scores): not a weight
            if why:
                skipped.append((label, node.name or node.output[0], why))
                continue
            parts = self._split(body, weight, transposed)
            nodes[position] = self._rewritten(body, node, parts, removed)
            ensure_opset(self.model, body, MS_DOMAIN)
            done.append((label, nodes[position][0].name))
        del body.node[:]
        body.node.extend(n for item in nodes for n in (item if isinstance(item, list) else [item]) if id(n) not in removed)
        return done, skipped


def quantize_dynamic_int8(model: onnx.ModelProto, bodies: Sequence[tuple[Body, str]], *,
                          folder: str | None = None, open_norms: bool = True) -> DynamicInt8:
    """Dynamic int8 for the MatMul/Gemm weights of ``bodies`` (``(body, label)`` of ``model``, changed
    in place; ``Attention`` on constant packed weights opened first, and with ``open_norms``
    ``SkipLayerNormalization`` too). ``folder``: where the external data of ``model``'s initializers
    is (read when a new initializer's source is called).

    Example::

        done = quantize_dynamic_int8(model, [(f, f.name) for f in model.functions])
    """
    quantizer = _DynamicQuantizer(model, folder, open_norms)
    result = DynamicInt8(sources=quantizer.sources)
    for body, label in bodies:
        for op, where, name in quantizer.open_attentions(body, label):
            (result.opened if op == "Attention" else result.norms).append((where, name))
        done, left = quantizer.dynamic_body(body, label)
        result.quantized += done
        result.skipped += left
    return result
