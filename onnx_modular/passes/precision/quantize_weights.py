"""Weight-only quantization of the MatMul and Gemm weights inside the bodies of a ``ModelProto``.

A MatMul of a body whose second input is a constant 2-D float32 weight (a main-graph
initializer, passed down to the body through formal inputs, read nowhere else) becomes
onnxruntime's ``MatMulNBits`` (com.microsoft); a Gemm becomes ``MatMulNBits`` + ``Add`` of its
bias. The weight is packed by onnxruntime's own ``DefaultWeightOnlyQuantizer`` (the kernels
``MatMulNBitsQuantizer`` uses), one tensor at a time when the file is written: the weight's formal
input becomes the packed weight, its scales and zero points, threaded through the callers' bodies,
and the new initializers carry no values yet (:attr:`QuantizedWeights.sources` computes them).
Weights that stay float32 (Conv weights, shared or computed ones) are reported with the reason.
A ``com.microsoft.MoE`` (``optimize``'s fused experts) becomes ``QMoE``: its ``[experts, N, K]``
weights packed expert by expert as ``MatMulNBits`` packs a ``[K, N]`` weight (``weights_prepacked=0``:
the raw ``[experts, N, K * bits / 8]`` bytes, scales ``[experts, N, K / block_size]``), the same
``accuracy_level``.

Entry: :func:`quantize_weights`. The tool around it (which calls quantize) is
:mod:`onnx_modular.files.convert.tool`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper

from onnx_modular.passes.precision import kquant as _kquant
from onnx_modular.passes.precision.tied_weights import TRANSPOSED_REASON, gather_block_quantized, tied_uses
from onnx_modular.passes.proto_bodies import Body, body_names, call_sites, ensure_opset, function_id, uses

__all__ = ["QUANTIZE_BITS", "QuantizeSettings", "QuantizedWeights", "quantize_weights", "root_logging_kept"]

FLOAT = onnx.TensorProto.FLOAT
#: ``quantize=`` -> bits of ``MatMulNBits``.
QUANTIZE_BITS = {"int4": 4, "int8": 8}
MS_DOMAIN = "com.microsoft"
COMPUTED = "its second input is computed in the body"
#: The ops whose constant weight becomes MatMulNBits (a Gemm's bias an Add after it).
QUANTIZED_OPS = ("MatMul", "Gemm")
#: A mixture-of-experts router's logits stay float: they choose the experts (and the weight is tiny).
ROUTER_REASON = "a mixture-of-experts router's logits (they choose the experts; a [hidden, experts] weight): kept float"
#: The ops whose weights stay float32 under quantize, reported as skipped.
LEFT_OPS = ("Conv", "ConvTranspose")
LEFT_OPS_REASON = ("a Conv weight: onnxruntime's weight-only quantization (MatMulNBits) covers MatMul and Gemm "
                   "weights only; it stays float32 (use --dtype float16 to halve it)")


@dataclasses.dataclass(frozen=True)
class QuantizeSettings:
    """``MatMulNBits``'s settings, as in onnxruntime's ``MatMulNBitsQuantizer``."""

    bits: int
    block_size: int = 32
    symmetric: bool = False
    accuracy_level: int | None = None
    #: The rounding: ``"rtn"`` (onnxruntime's ``DefaultWeightOnlyQuantizer``) or ``"k_quant"``
    #: (:mod:`onnx_modular.passes.precision.kquant`; asymmetric only; importance-weighted when
    #: :func:`quantize_weights` is given an ``importance``).
    algorithm: str = "rtn"
    #: Also the embedding tables: every axis-0 ``Gather`` of a 2-D float32 weight in the bodies (read
    #: nowhere else) becomes ``GatherBlockQuantized`` on the table packed as ``MatMulNBits`` packs
    #: its transpose (:func:`.tied_weights.gather_block_quantized`). onnxruntime-genai's builder
    #: leaves an untied embedding float32; ``optimize --quantize auto`` offers it.
    embeddings: bool = False


@dataclasses.dataclass
class QuantizedWeights:
    """What :func:`quantize_weights` did.

    Attributes:
        quantized: The ``MatMulNBits`` made, as ``(body label, node)``.
        skipped: The weight-reading nodes left as they were, as ``(body label, node, reason)``.
        sources: New main-graph initializer -> a function computing its values (packed when called).
        tied: The embedding ``Gather`` nodes now reading a packed table (``GatherBlockQuantized``): a
            tied head's, or their own (:attr:`QuantizeSettings.embeddings`), as ``(body label, node)``.
    """

    quantized: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    tied: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    sources: dict[str, Callable[[], np.ndarray]] = dataclasses.field(default_factory=dict)


def quantize_weights(model: onnx.ModelProto, bodies: Sequence[tuple[Body, str]], settings: QuantizeSettings,
                     *, folder: str | None = None, importance: Mapping[str, np.ndarray] | None = None) -> QuantizedWeights:
    """Quantize the MatMul/Gemm weights of ``bodies`` (``(body, label)``: the main graph and/or
    functions of ``model``, changed in place). ``folder``: where the external data of ``model``'s
    initializers is (read when a packed initializer's source is called). ``importance``: per main-graph
    weight (by initializer name), the weight of each input channel's error (the mean squared
    activation entering it, llama.cpp's importance matrix), used by the k-quant rounding.

    Example::

        done = quantize_weights(model, [(model.graph, "<main graph>")], QuantizeSettings(bits=4))
    """
    quantizer = Quantizer(model, folder, settings, importance)
    result = QuantizedWeights(sources=quantizer.sources)
    result.quantized, result.tied = quantizer.tie(bodies)
    for body, label in bodies:
        done, left = quantizer.quantize_body(body, label)
        result.quantized += done
        result.skipped += left
        if settings.embeddings:
            result.tied += quantizer.quantize_gathers(body, label)
    return result


@contextlib.contextmanager
def root_logging_kept():
    """onnxruntime's ``matmul_nbits_quantizer`` calls ``logging.basicConfig(level=INFO)`` when first
    imported: every library's INFO lines (onnx_ir's passes) would then print before the report. The
    root logger is put back as it was."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


class Quantizer:
    """Weight-only quantization of MatMul weights inside bodies, packed by onnxruntime."""

    def __init__(self, model: onnx.ModelProto, folder: str | None, settings: QuantizeSettings,
                 importance: Mapping[str, np.ndarray] | None = None):
        bits, block_size, symmetric, accuracy_level = settings.bits, settings.block_size, settings.symmetric, settings.accuracy_level
        with root_logging_kept():
            from onnxruntime.quantization.matmul_nbits_quantizer import (
                DefaultWeightOnlyQuantConfig,
                DefaultWeightOnlyQuantizer,
            )

        self.model = model
        self.folder = folder
        self.bits = bits
        self.block_size = block_size
        self.symmetric = symmetric
        self.accuracy_level = accuracy_level
        self.packer = DefaultWeightOnlyQuantizer(
            DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric, bits=bits, accuracy_level=accuracy_level)
        )
        if settings.algorithm == "k_quant":
            if symmetric:
                raise ValueError("k-quant rounding is asymmetric (a zero point per block): use symmetric=False")
            self.packer = _kquant.KQuantPacker(bits, block_size)
        self.importance = dict(importance or {})
        self.parts = [f"_Q{bits}", "_scales"] + ([] if symmetric else ["_zero_points"])
        self.initializers = {t.name: t for t in model.graph.initializer}
        self.sources: dict[str, Callable[[], np.ndarray]] = {}  # new initializer -> its array
        self.done: set[tuple[tuple[str, str, str] | None, str]] = set()
        self.transposed: set[str] = set()  # initializers a Gemm reads with transB=1: packed as their transpose

    def _shapes(self, k: int, n: int) -> list[tuple[list[int], int]]:
        kpack = 8 // self.bits
        blocks = (k + self.block_size - 1) // self.block_size
        shapes = [([n, blocks, (self.block_size + kpack - 1) // kpack], onnx.TensorProto.UINT8), ([n, blocks], FLOAT)]
        if not self.symmetric:
            shapes.append(([n, (blocks + kpack - 1) // kpack], onnx.TensorProto.UINT8))
        return shapes

    @functools.lru_cache(maxsize=4)  # noqa: B019 (one quantizer per conversion; the parts of one weight are written together)
    def _pack(self, name: str) -> tuple[np.ndarray, ...]:
        tensor = self.initializers[name]
        array = onnx.numpy_helper.to_array(tensor, base_dir=self.folder or "").astype(np.float32)
        if name in self.transposed:
            array = np.ascontiguousarray(array.T)
        weights = self.importance.get(name)
        if isinstance(self.packer, _kquant.KQuantPacker) and weights is not None and np.size(weights) == array.shape[0]:
            packed, scales, zero_points = self.packer.qbits_block_quant(array, weights)
        else:
            packed, scales, zero_points = self.packer.qbits_block_quant(array)
        return (packed, scales) if self.symmetric else (packed, scales, zero_points)

    @functools.lru_cache(maxsize=4)  # noqa: B019 (as _pack)
    def _pack_experts(self, name: str) -> tuple[np.ndarray, ...]:
        """An ``[experts, N, K]`` weight packed expert by expert (each as the ``[K, N]`` weight of a MatMul)."""
        array = onnx.numpy_helper.to_array(self.initializers[name], base_dir=self.folder or "").astype(np.float32)
        experts, n = array.shape[:2]
        parts = [self.packer.qbits_block_quant(np.ascontiguousarray(weight.T)) for weight in array]
        count = 2 if self.symmetric else 3
        return tuple(np.stack([np.asarray(p[i]).reshape(n, -1) for p in parts]).reshape(experts, n, -1) for i in range(count))

    def _pure(self, body, name: str, depth: int = 0, rank: int = 2) -> str | None:
        """Why ``name`` (the MatMul weight read in ``body``) cannot be split; None when it can:
        on the way up to its initializer, each body passes it on once and reads it nowhere else."""
        if body is self.model.graph:
            tensor = self.initializers.get(name)
            if tensor is None or name in {v.name for v in body.input}:
                return "its weight is not an initializer (computed or a graph input)"
            if tensor.data_type != FLOAT or len(tensor.dims) != rank:
                return f"its weight is not a {rank}-D float32 tensor"
            return None if len(uses(body, name)) == 1 else "its weight is read by other nodes too (shared)"
        if name not in body.input:
            producer = next((n for n in body.node if name in n.output), None)
            if producer is not None and producer.op_type == "Transpose" and producer.input[0] in body.input:
                return TRANSPOSED_REASON
            return COMPUTED
        index = list(body.input).index(name)
        sites = list(call_sites(self.model, function_id(body)))
        if not sites:
            return "its function has no call"
        for caller, node in sites:
            if index >= len(node.input) or not node.input[index]:
                return "a call does not pass its weight"
            arg = node.input[index]
            if len(uses(caller, arg)) != 1:
                return "its weight is read by other nodes too (shared)"
            why = self._pure(caller, arg, depth + 1, rank)
            if why:
                return why
        return None

    def _source_shapes(self, body, name: str, transposed: bool = False) -> set[tuple[int, ...]]:
        if body is self.model.graph:
            dims = tuple(self.initializers[name].dims)
            return {dims[::-1] if transposed else dims}
        index = list(body.input).index(name)
        shapes: set[tuple[int, ...]] = set()
        for caller, node in call_sites(self.model, function_id(body)):
            shapes |= self._source_shapes(caller, node.input[index], transposed)
        return shapes

    def _split(self, body, name: str, transposed: bool = False, experts: bool = False) -> list[str]:
        """Replace ``name`` in ``body`` by its packed parts, up to the main graph. Returns the new names.
        ``experts``: an ``[experts, N, K]`` weight, packed expert by expert (``QMoE``)."""
        new = [name + part for part in self.parts]
        key = (self._body_key(body), name)
        if key in self.done:
            return new
        self.done.add(key)
        if body is self.model.graph:
            tensor = self.initializers[name]
            if experts:
                count, n, k = tensor.dims
                shapes = [([count, dims[0], int(np.prod(dims[1:]))], data_type) for dims, data_type in self._shapes(k, n)]
                pack = self._pack_experts
            else:
                k, n = tensor.dims[::-1] if transposed else tensor.dims
                shapes, pack = self._shapes(k, n), self._pack
            if transposed:
                self.transposed.add(name)
            for index, (part, (dims, data_type)) in enumerate(zip(new, shapes)):
                self.model.graph.initializer.append(onnx.TensorProto(name=part, data_type=data_type, dims=dims))  # values when written
                self.sources[part] = functools.partial(lambda i, source, pack: pack(source)[i], index, name, pack)
            return new
        index = list(body.input).index(name)
        body.input[index : index + 1] = new
        kept = [v for v in body.value_info if v.name != name]
        del body.value_info[:]
        body.value_info.extend(kept)
        for caller, node in list(call_sites(self.model, function_id(body))):
            arg = node.input[index]
            node.input[index : index + 1] = self._split(caller, arg, transposed, experts)
        return new

    def _weight_reason(self, body, node: onnx.NodeProto) -> tuple[str | None, bool]:
        """For a node that may read a weight: (why it stays float, whether it reads its weight
        transposed). ``(COMPUTED, False)``: not a weight; ``(None, t)``: it becomes MatMulNBits."""
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Gemm":
            if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or (len(node.input) > 2 and node.input[2] and attrs.get("beta", 1.0) != 1.0):
                return "a Gemm with transA, alpha or beta other than the defaults (MatMulNBits has none of them)", False
            return None, bool(attrs.get("transB", 0))
        return None, False

    def tie(self, bodies: Sequence[tuple[Body, str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """Tied heads (``MatMul(x, Transpose(W))`` with ``W`` also an embedding's table) quantized first:
        the head from ``W`` packed as its transpose; at 4 bits, every embedding ``Gather`` of
        ``W`` in the bodies quantized reads the same packed table (:mod:`.tied_weights`)."""
        labels = {self._body_key(body): label for body, label in bodies}
        quantized, tied = [], []
        for body, _label in bodies:
            for transpose in [n for n in body.node if n.op_type == "Transpose" and n.domain in ("", "ai.onnx")]:
                if transpose not in body.node:  # taken with an earlier head of the same weight
                    continue
                found = tied_uses(self.model, body, transpose)
                if isinstance(found, str) or not found.heads or any(self._body_key(b) not in labels for b, *_ in found.heads):
                    continue
                vocab, hidden = self.initializers[found.initializer].dims
                for head_body, formal, head_transpose, matmuls in found.heads:
                    parts = self._split(head_body, formal, transposed=True)
                    for matmul in matmuls:
                        self._replace(head_body, matmul, [self._nbits(matmul, parts, hidden, vocab)])
                        quantized.append((labels[self._body_key(head_body)], matmul.name or matmul.output[0]))
                    head_body.node.remove(head_transpose)
                    ensure_opset(self.model, head_body, MS_DOMAIN)
                if self.bits != 4 or any(self._body_key(b) not in labels for b, *_ in found.gathers):
                    continue  # the embedding reads the float table (GatherBlockQuantized takes int4 here)
                for gather_body, formal, gather in found.gathers:
                    parts = self._split(gather_body, formal, transposed=True)
                    nodes = gather_block_quantized(gather, parts, vocab=vocab, hidden=hidden, bits=self.bits,
                                                   block_size=self.block_size, taken=body_names(gather_body))
                    self._replace(gather_body, gather, nodes)
                    ensure_opset(self.model, gather_body, MS_DOMAIN)
                    tied.append((labels[self._body_key(gather_body)], gather.name or gather.output[0]))
        return quantized, tied

    def quantize_gathers(self, body, label: str) -> list[tuple[str, str]]:
        """Every ``Gather`` (axis 0) of ``body`` on a 2-D float32 weight read nowhere else ->
        ``GatherBlockQuantized`` on the table packed as its transpose would be for ``MatMulNBits``
        (``[vocab, blocks, blob]``, the same packing and zero points as a tied head's)."""
        done = []
        for gather in [n for n in body.node if n.op_type == "Gather" and n.domain in ("", "ai.onnx")]:
            if any(a.name == "axis" and a.i != 0 for a in gather.attribute) or self._pure(body, gather.input[0]):
                continue
            shapes = self._source_shapes(body, gather.input[0])
            if len(shapes) != 1 or len(next(iter(shapes))) != 2:
                continue
            (vocab, hidden), = shapes
            parts = self._split(body, gather.input[0], transposed=True)
            nodes = gather_block_quantized(gather, parts, vocab=vocab, hidden=hidden, bits=self.bits,
                                           block_size=self.block_size, taken=body_names(body))
            self._replace(body, gather, nodes)
            ensure_opset(self.model, body, MS_DOMAIN)
            done.append((label, gather.name or gather.output[0]))
        return done

    def _body_key(self, body) -> tuple[str, str, str] | None:
        """A body's identity (not ``id()``: protobuf's Python wrappers come and go)."""
        return None if body is self.model.graph else function_id(body)

    @staticmethod
    def _replace(body, node: onnx.NodeProto, nodes: list[onnx.NodeProto]) -> None:
        position = list(body.node).index(node)
        kept = list(body.node)
        kept[position: position + 1] = nodes
        del body.node[:]
        body.node.extend(kept)

    def _nbits(self, node: onnx.NodeProto, parts: list[str], k: int, n: int, output: list[str] | None = None) -> onnx.NodeProto:
        attributes = {"K": k, "N": n, "bits": self.bits, "block_size": self.block_size}
        if self.accuracy_level:
            attributes["accuracy_level"] = self.accuracy_level
        nbits = onnx.helper.make_node(
            "MatMulNBits", [node.input[0], *parts], list(node.output) if output is None else output,
            name=(node.name + f"_Q{self.bits}") if node.name else "", domain=MS_DOMAIN, **attributes,
        )
        nbits.metadata_props.extend(node.metadata_props)
        return nbits

    def quantize_body(self, body, label: str) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
        """Every MatMul of ``body`` with a constant 2-D weight -> MatMulNBits; every such Gemm ->
        MatMulNBits + Add of its bias. The weights of Conv nodes are reported left (skipped)."""
        done, skipped = [], []
        nodes = list(body.node)
        routers = {n.input[1] for n in nodes if n.op_type == "MoE" and n.domain == MS_DOMAIN and len(n.input) > 1}
        for position, node in enumerate(nodes):
            if node.output and node.output[0] in routers and node.op_type in QUANTIZED_OPS:
                skipped.append((label, node.name or node.output[0], ROUTER_REASON))
                continue
            if node.op_type == "MoE" and node.domain == MS_DOMAIN:
                made = self._qmoe(body, node)
                if isinstance(made, str):
                    skipped.append((label, node.name or node.output[0], made))
                else:
                    nodes[position] = made
                    done.append((label, made.name or node.output[0]))
                continue
            if node.domain not in ("", "ai.onnx") or node.op_type not in QUANTIZED_OPS + LEFT_OPS or len(node.input) < 2:
                continue
            weight = node.input[1]
            why = self._pure(body, weight)
            if node.op_type in LEFT_OPS:  # reported whenever its weight is a constant of the file
                if why in (None, "its weight is not a 2-D float32 tensor", "its weight is read by other nodes too (shared)"):
                    skipped.append((label, node.name or node.output[0], LEFT_OPS_REASON))
                continue
            if node.op_type == "MatMul" and len(node.input) != 2:
                continue
            transposed = False
            if why is None:
                why, transposed = self._weight_reason(body, node)
            shapes = set() if why else self._source_shapes(body, weight, transposed)
            if not why and len(shapes) != 1:
                why = f"its calls pass weights of different shapes {sorted(shapes)}"
            if why == COMPUTED:
                continue  # activations times activations (attention scores): not a weight
            if why:
                skipped.append((label, node.name or node.output[0], why))
                continue
            (k, n), = shapes
            parts = self._split(body, weight, transposed)
            bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else None
            product = list(node.output) if bias is None else [unused_name(body, node.output[0] + "_matmul")]
            nbits = self._nbits(node, parts, k, n, product)
            made = [nbits]
            if bias is not None:  # Gemm's C: broadcast over the rows as Add does
                add = onnx.helper.make_node("Add", [product[0], bias], list(node.output), name=(node.name + "_bias") if node.name else "")
                add.metadata_props.extend(node.metadata_props)
                made.append(add)
            nodes[position] = made
            ensure_opset(self.model, body, MS_DOMAIN)
            done.append((label, nbits.name or node.output[0]))
        del body.node[:]
        body.node.extend(n for item in nodes for n in (item if isinstance(item, list) else [item]))
        return done, skipped


    def _qmoe(self, body, node: onnx.NodeProto) -> onnx.NodeProto | str:
        """``QMoE`` for a ``MoE`` whose expert weights (inputs 2 and 4: ``[experts, N, K]``) are the file's
        own, or why it stays float."""
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if len(node.input) > 6 and any(node.input[6:]):
            return "a MoE with separate FC3 weights (QMoE is written for fused gate/up weights)"
        weights = [node.input[2], node.input[4]]
        for weight in weights:
            why = self._pure(body, weight, rank=3)
            if why:
                return why
        shapes = [self._source_shapes(body, w) for w in weights]
        if any(len(found) != 1 for found in shapes):
            return "its calls pass expert weights of different shapes"
        if any(shape[2] % self.block_size for (shape,) in shapes):
            return f"the hidden or intermediate size is not a multiple of the block size {self.block_size} (QMoE's blocks)"
        fc1, fc2 = (self._split(body, w, experts=True) for w in weights)
        zero_points = [] if self.symmetric else [fc1[2], fc2[2]]
        inputs = [node.input[0], node.input[1], fc1[0], fc1[1], node.input[3] if len(node.input) > 3 else "",
                  fc2[0], fc2[1], node.input[5] if len(node.input) > 5 else "", "", "", "", *zero_points]
        attrs.update(expert_weight_bits=self.bits, block_size=self.block_size, weights_prepacked=0, quant_type="int")
        if self.accuracy_level:
            attrs["accuracy_level"] = self.accuracy_level
        qmoe = onnx.helper.make_node("QMoE", inputs, list(node.output), name=(node.name + f"_Q{self.bits}") if node.name else "",
                                     domain=MS_DOMAIN, **attrs)
        qmoe.metadata_props.extend(node.metadata_props)
        return qmoe


def unused_name(body, base: str) -> str:
    taken = {v for n in body.node for v in (*n.input, *n.output)} | {getattr(v, "name", v) for v in (*body.input, *body.output)}
    name, count = base, 0
    while name in taken:
        count += 1
        name = f"{base}_{count}"
    return name

