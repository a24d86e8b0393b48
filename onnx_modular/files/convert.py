"""Precision and weight-only quantization chosen per module, inside the function bodies.

``convert("llama.onnx", "llama.f16.onnx", dtype="float16", keep=["LlamaRMSNorm"])`` runs every
module in float16 except the RMS norms; ``convert(..., quantize="int4", exclude=["lm_head"])``
turns the MatMul weights of every module but ``lm_head`` into onnxruntime's ``MatMulNBits``
(com.microsoft). A NAME is a class, a module path or a glob of either
(:func:`onnx_modular.calls.targets.resolve_target`); it selects those calls and everything they
call.

How the file changes:

* Every call gets a plan (low precision or kept; quantized or not). A function whose calls want
  different plans is split: the calls that differ get bodies of their own
  (:func:`~onnx_modular.calls.targets.specialize`, as ``replace`` does). A class choice converts
  its shared body once: the decoder layer stays one function.
* A converted body computes in the new dtype: its float32 values, ``Cast``s to float32,
  ``Constant``s and ``ConstantOfShape`` values follow; the ops onnxconverter-common's float16
  converter keeps in float32 (:data:`FLOAT32_OPS`: ``Resize``, ``Range``, ``TopK``, ``CumSum``,
  ``Min``/``Max``, ...) run in float32 between ``Cast``s.
* Weights live in the main graph and reach the bodies as formal inputs. A weight is stored in
  the new dtype when every body that reads it is converted; a weight a kept body reads (a tied
  embedding, say) stays float32 and a converted reader casts it where it reads it. Values are
  clipped to the dtype's finite range (``-3.4e38`` mask constants become ``-65504``).
* ``Cast``s sit only where a converted call meets a kept one (its arguments and its results),
  and at the graph's inputs and outputs, which keep their types.
* Quantization packs each weight with onnxruntime's own ``DefaultWeightOnlyQuantizer`` (the
  kernels ``MatMulNBitsQuantizer`` uses), so a file quantized here computes what onnxruntime's
  quantizer makes of the flat copy with the same settings. The weight's formal input becomes the
  packed weight, its scales and zero points, threaded through the callers' bodies.

Weights are converted one tensor at a time while the file is written (external data in and out),
the result is checked, run in onnxruntime against the original on the same inputs with every
module call's outputs captured (:func:`onnx_modular.calls.capture.call_outputs`), and saved
atomically. The :class:`Conversion` report gives the drift of every call and class.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import pathlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx.defs
import onnx.helper
import onnx.numpy_helper

from onnx_modular.calls import targets as _calls
from onnx_modular.calls.capture import call_outputs
from onnx_modular.check.parity import fit_name, max_differences, name_column_width
from onnx_modular.errors import InvalidInputError, InvalidModelFileError, VerificationError
from onnx_modular.format import metadata
from onnx_modular.runtime import sessions as runtime
from onnx_modular.runtime.inputs import feeds_for
from onnx_modular.storage import save
from onnx_modular.storage.checks import check_expanded_size
from onnx_modular.storage.proto import (
    FunctionId,
    all_nodes,
    declare_function_types,
    function_id,
    node_id,
    uses_external_data,
)

__all__ = ["convert", "Conversion", "QuantizationWarning", "CallDrift", "ClassDrift", "FLOAT32_OPS", "DTYPES", "QUANTIZE_BITS"]

FLOAT = onnx.TensorProto.FLOAT
#: The dtypes a body can be converted to.
DTYPES = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}
#: ``quantize=`` -> bits of ``MatMulNBits``.
QUANTIZE_BITS = {"int4": 4, "int8": 8}
#: Ops that stay float32 inside a converted body: onnxconverter-common's
#: ``float16.DEFAULT_OP_BLOCK_LIST`` (ranges, resizes, sorting, cumulative sums, the ML ops).
FLOAT32_OPS = frozenset({
    "ArrayFeatureExtractor", "Binarizer", "CastMap", "CategoryMapper", "DictVectorizer", "FeatureVectorizer",
    "Imputer", "LabelEncoder", "LinearClassifier", "LinearRegressor", "Normalizer", "OneHotEncoder",
    "RandomUniformLike", "SVMClassifier", "SVMRegressor", "Scaler", "TreeEnsembleClassifier",
    "TreeEnsembleRegressor", "ZipMap", "NonMaxSuppression", "TopK", "RoiAlign", "Resize", "Range", "CumSum",
    "Min", "Max", "Upsample",
})  # fmt: skip
#: Ops whose ``dtype`` attribute names the type of what they make.
_DTYPE_ATTRIBUTE_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "EyeLike", "Bernoulli", "Multinomial"})
_MS_DOMAIN = "com.microsoft"
_COMPUTED = "its second input is computed in the body"
#: The ops whose constant weight becomes MatMulNBits (a Gemm's bias an Add after it).
_QUANTIZED_OPS = ("MatMul", "Gemm")
#: The ops whose weights stay float32 under quantize, reported in ``Conversion.skipped``.
_LEFT_OPS = ("Conv", "ConvTranspose")
_LEFT_OPS_REASON = ("a Conv weight: onnxruntime's weight-only quantization (MatMulNBits) covers MatMul and Gemm "
                    "weights only; it stays float32 (use --dtype float16 to halve it)")
#: Name suffix of a value cast to a dtype.
_SUFFIX = {FLOAT: "f32", onnx.TensorProto.FLOAT16: "f16", onnx.TensorProto.BFLOAT16: "bf16"}


# -- the report ---------------------------------------------------------------------------


@dataclasses.dataclass
class CallDrift:
    """One module call of the converted file against the same call of the original.

    Attributes:
        call_name: As ``onnx-modular tree`` names it.
        module_class: The call's class (``LlamaRMSNorm``).
        converted: The call's own ops run in the new dtype.
        quantized: ``MatMulNBits`` in the call's own body.
        max_abs: The largest absolute difference over the call's outputs.
        drift: ``max_abs`` over the range (max - min) of the original's output: ``0.01`` is 1%.
        overflow: Some output is inf or NaN where the original's is finite (float16 overflowed).
    """

    call_name: str
    module_class: str
    converted: bool
    quantized: bool
    max_abs: float
    drift: float
    overflow: bool = False


@dataclasses.dataclass
class ClassDrift:
    """The worst :class:`CallDrift` of a class's calls."""

    module_class: str
    calls: int
    max_abs: float
    drift: float


@dataclasses.dataclass
class Conversion:
    """What :func:`convert` wrote and how far each module moved.

    Attributes:
        dtype / quantize: As asked (``None`` when not).
        kept: The calls left in the original precision (``keep`` and ``auto_keep``).
        auto_kept: The classes ``auto_keep`` kept, worst first, with why: the drift of the
            outputs when that class alone is converted.
        excluded: The calls left unquantized.
        quantized: The ``MatMulNBits`` made, as ``(call or <main graph>, node)``.
        skipped: MatMuls of quantized calls left as they were, with the reason.
        weights: Main-graph weights stored in the new dtype; ``float32_weights``: those kept
            float32 because a kept module reads them.
        casts: ``Cast`` nodes added (boundaries between converted and kept, graph inputs and outputs).
        split: Functions given to some calls alone so that their plans differ.
        outputs: Per model output: ``(max_abs, drift)`` against the original.
        calls / classes: Per module call and class, in execution order / worst first.
    """

    source: str
    output: str
    dtype: str | None
    quantize: str | None
    block_size: int
    kept: list[str]
    auto_kept: list[tuple[str, float]]
    tolerance: float | None
    excluded: list[str]
    quantized: list[tuple[str, str]]
    skipped: list[tuple[str, str, str]]
    weights: int
    float32_weights: list[str]
    casts: int
    split: list[str]
    outputs: dict[str, tuple[float, float]]
    calls: list[CallDrift]
    classes: list[ClassDrift]
    source_bytes: int = 0
    output_bytes: int = 0

    @property
    def max_drift(self) -> float:
        """The largest drift of the model's outputs."""
        return max((drift for _, drift in self.outputs.values()), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["max_drift"] = self.max_drift
        data["outputs"] = {k: {"max_abs": a, "drift": d} for k, (a, d) in self.outputs.items()}
        data["auto_kept"] = [{"class": c, "drift_alone": d} for c, d in self.auto_kept]
        data["quantized"] = [{"call": c, "node": n} for c, n in self.quantized]
        data["skipped"] = [{"call": c, "node": n, "reason": r} for c, n, r in self.skipped]
        return data

    def to_json(self) -> str:
        """The report as strict JSON (a non-finite drift is ``null``)."""

        def finite(value):
            if isinstance(value, float):
                return value if math.isfinite(value) else None
            if isinstance(value, dict):
                return {k: finite(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [finite(v) for v in value]
            return value

        return json.dumps(finite(self.to_dict()), indent=2, allow_nan=False)

    def __str__(self) -> str:
        what = [f"{self.dtype}" if self.dtype else None, f"{self.quantize} weights (block {self.block_size})" if self.quantize else None]
        lines = [f"Wrote {self.output} ({' + '.join(w for w in what if w)}) from {self.source}"]
        if self.output_bytes and self.source_bytes:
            lines.append(f"  size: {self.source_bytes / 1e6:.2f} MB -> {self.output_bytes / 1e6:.2f} MB ({self.output_bytes / self.source_bytes:.2f}x)")
        if self.dtype:
            lines.append(f"  {self.weights} weights in {self.dtype}, {len(self.float32_weights)} kept float32; {self.casts} Casts added")
            if self.kept:
                lines.append(f"  kept in float32: {len(self.kept)} calls ({_short_list(self.kept)})")
        for name, drift in self.auto_kept:
            lines.append(f"  auto-keep kept {name}: " + ("converted alone, the file does not run in onnxruntime" if drift == math.inf
                         else f"converted alone, it moves the outputs by {drift:.3%} of their range"))
        if self.tolerance is not None:
            verdict = "within" if self.max_drift <= self.tolerance else "NOT within"
            lines.append(f"  outputs {verdict} --auto-keep {self.tolerance:g} ({self.max_drift:.3%} of their range)")
        if self.quantize:
            lines.append(f"  MatMulNBits nodes (in shared bodies): {len(self.quantized)}; weights left float32: {len(self.skipped)}"
                         + (f"; not quantized: {_short_list(self.excluded)}" if self.excluded else ""))
            if not self.quantized:
                lines.append("  WARNING: nothing was quantized" + (" (the weights left are listed below)" if self.skipped else
                             " (no MatMul or Gemm reads a constant weight)"))
            for call, node, reason in self.skipped[:8]:
                lines.append(f"    left: {call} {node}: {reason}")
            if len(self.skipped) > 8:
                lines.append(f"    ... and {len(self.skipped) - 8} more (the report's `skipped`)")
        if self.split:
            lines.append(f"  calls given bodies of their plan (split from shared ones): {_short_list(self.split, 6)}")
        lines.append("Drift against the original on the same inputs, per output (max abs; % of the output's range):")
        width = name_column_width(self.outputs)
        for name, (max_abs, drift) in self.outputs.items():  # the file's names (output.past_key_values...) alone
            lines.append(f"  {fit_name(name, width):<{width}} {max_abs:10.3g} {drift:8.3%}")
        overflowed = [c.call_name for c in self.calls if c.overflow or not math.isfinite(c.max_abs)]
        if overflowed:  # the outputs' drift alone would hide them (a later op can clip an inf)
            lines.append(f"  {len(overflowed)} calls overflow (inf or NaN where the original is finite): {_short_list(overflowed)}; "
                         "keep them in float32 (--keep) to convert without overflow")
        if not self.calls:  # a flat file: no module calls to compare
            return "\n".join(lines)
        first = next((c for c in self.calls if c.drift > _LARGE_DRIFT and c.converted), None)
        if first is not None and self.tolerance is None and self.max_drift > _LARGE_DRIFT:
            lines.append(f"  hint: the first call drifting over {_LARGE_DRIFT:.0%}: {first.call_name} ({first.module_class}); "
                         f"try --keep {first.module_class}, or --auto-keep 0.01")
        lines.append("Per class, worst call:")
        width = name_column_width(c.module_class for c in self.classes)
        for c in self.classes:
            lines.append(f"  {fit_name(c.module_class, width):<{width}} {c.calls:4d} calls {c.max_abs:10.3g} {c.drift:8.3%}")
        lines.append("Per call:")
        width = name_column_width(c.call_name for c in self.calls)
        for c in self.calls:
            mode = ("q" if c.quantized else "-") + ("c" if c.converted else ("k" if self.dtype else "-"))
            lines.append(f"  {fit_name(c.call_name, width):<{width}} {mode} {c.module_class:<24} {c.max_abs:10.3g} {c.drift:8.3%}")
        return "\n".join(lines)


#: An output drift (of its range) the report points at the first call drifting that far.
_LARGE_DRIFT = 0.05


class QuantizationWarning(UserWarning):
    """``quantize`` left weights in float32 (Conv weights, shared or computed ones): they are
    listed in :attr:`Conversion.skipped` with the reason."""


def _warn_left(quantize: str | None, quantized: Sequence, skipped: Sequence[tuple[str, str, str]]) -> None:
    if not quantize or not skipped:
        return
    import warnings

    reasons = collections.Counter(reason for _, _, reason in skipped)
    text = (f"--quantize {quantize}: {len(skipped)} weight(s) left float32 ({len(quantized)} quantized): "
            + "; ".join(f"{count} x {reason}" for reason, count in reasons.most_common(3)))
    warnings.warn_explicit(text, QuantizationWarning, "onnx_modular", 0, module="onnx_modular")


def _short_list(names: Sequence[str], count: int = 4) -> str:
    shown = ", ".join(names[:count])
    return shown + (f" and {len(names) - count} more" if len(names) > count else "")


# -- plans ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    low: bool  # own ops in the new dtype
    quantize: bool  # own MatMul weights to MatMulNBits


def _selected(model: onnx.ModelProto, names: Iterable[str], what: str) -> set[str]:
    """The call names ``names`` select (closest names listed when one selects nothing)."""
    chosen: set[str] = set()
    for text in names:
        chosen.update(_calls.resolve_target(model, text).call_names)
    return chosen


def _under(call: metadata.ExpandedCall, chosen: set[str]) -> bool:
    """The call or one of its callers is chosen."""
    return any(link.call_name in chosen for link in _calls.chain(call))


def _split_plans(model: onnx.ModelProto, plan_of: Callable[[metadata.ExpandedCall], _Plan]) -> tuple[dict[FunctionId, _Plan], list[str]]:
    """Give calls whose plan differs from their function's other calls bodies of their own.

    Returns the plan of every function that has calls, and the calls given own bodies.
    """
    split: list[str] = []
    copies: dict[tuple[FunctionId, _Plan], FunctionId] = {}  # (function, plan) -> the body split off for it
    while True:
        calls = _calls.module_calls(model)
        by_function: dict[FunctionId, dict[_Plan, list[str]]] = collections.defaultdict(lambda: collections.defaultdict(list))
        for call in calls.values():
            by_function[function_id(call.function)][plan_of(call)].append(call.call_name)
        mixed = next(((fid, plans) for fid, plans in by_function.items() if len(plans) > 1), None)
        if mixed is None:
            return {fid: next(iter(plans)) for fid, plans in by_function.items()}, split
        fid, plans = mixed
        # the plan of most calls keeps the body; the others move to a body split off once per plan
        majority = max(plans, key=lambda plan: len(plans[plan]))
        plan, name = next((plan, names[0]) for plan, names in plans.items() if plan != majority)
        copy = copies.get((fid, plan))
        if copy is not None and any(function_id(f) == copy for f in model.functions):
            _move_call(model, _calls.specialize(model, name), copy)
        else:
            copies[(fid, plan)] = function_id(_calls.specialize(model, name, including_call=True).function)
        split.append(name)


def _move_call(model: onnx.ModelProto, call: metadata.ExpandedCall, target: FunctionId) -> None:
    """Let ``call`` (whose callers serve it alone) run ``target``, a copy of its function split off
    for another call with the same plan: the two share it, as the export shares bodies."""
    old = call.function
    copy = next(f for f in model.functions if function_id(f) == target)
    remaining = [p for p in metadata.module_paths(old) if p != call.call_name]
    written_for = metadata.body_module_path(old)
    _calls.set_prop(old, metadata.MODULE_PATHS, json.dumps(remaining))
    _calls.set_prop(old, metadata.CALL_COUNT, str(len(remaining)))
    if remaining:  # its nested calls are named after its first call
        _calls.rebase_body(old, written_for, metadata.strip_call_index(remaining[0]))
    paths = [*metadata.module_paths(copy), call.call_name]
    _calls.set_prop(copy, metadata.MODULE_PATHS, json.dumps(paths))
    _calls.set_prop(copy, metadata.CALL_COUNT, str(len(paths)))
    call.node.op_type = copy.name


# -- walking bodies -------------------------------------------------------------------------


def _call_sites(model: onnx.ModelProto, fid: FunctionId) -> Iterable[tuple[Any, onnx.NodeProto]]:
    for body in [model.graph, *model.functions]:
        for node in body.node:
            if node_id(node) == fid:
                yield body, node


def _uses(body, name: str) -> list[tuple[onnx.NodeProto, int]]:
    """(node, input index) of every top-level node of ``body`` reading ``name``; a subgraph's
    read counts as its node's, with index -1."""
    found = []
    for node in body.node:
        for index, value in enumerate(node.input):
            if value == name:
                found.append((node, index))
        for sub in all_nodes([node]):
            if sub is not node and name in sub.input:
                found.append((node, -1))
                break
    return found


def _declared_types(body) -> dict[str, int]:
    """Element types a body declares (value_info, graph inputs/outputs, initializers)."""
    types: dict[str, int] = {}
    values = list(body.value_info)
    if isinstance(body, onnx.GraphProto):
        values += [*body.input, *body.output]
        types.update({t.name: t.data_type for t in body.initializer})
    for value in values:
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            types[value.name] = value.type.tensor_type.elem_type
    return types


def _ensure_default_opset(model: onnx.ModelProto, body) -> None:
    if isinstance(body, onnx.FunctionProto) and not any(o.domain in ("", "ai.onnx") for o in body.opset_import):
        default = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)
        body.opset_import.add(domain="", version=default)


def _ensure_opset(model: onnx.ModelProto, body, domain: str, version: int = 1) -> None:
    if not any(o.domain == domain for o in model.opset_import):
        model.opset_import.add(domain=domain, version=version)
    if isinstance(body, onnx.FunctionProto) and not any(o.domain == domain for o in body.opset_import):
        body.opset_import.add(domain=domain, version=version)


# -- quantization ---------------------------------------------------------------------------


@contextlib.contextmanager
def _root_logging_kept():
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


class _Quantizer:
    """Weight-only quantization of MatMul weights inside bodies, packed by onnxruntime."""

    def __init__(self, model: onnx.ModelProto, folder: str | None, bits: int, block_size: int, symmetric: bool, accuracy_level: int | None):
        with _root_logging_kept():
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
        self.parts = [f"_Q{bits}", "_scales"] + ([] if symmetric else ["_zero_points"])
        self.initializers = {t.name: t for t in model.graph.initializer}
        self.sources: dict[str, Callable[[], np.ndarray]] = {}  # new initializer -> its array
        self.done: set[tuple[int, str]] = set()
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
        packed, scales, zero_points = self.packer.qbits_block_quant(array)
        return (packed, scales) if self.symmetric else (packed, scales, zero_points)

    def _pure(self, body, name: str, depth: int = 0) -> str | None:
        """Why ``name`` (the MatMul weight read in ``body``) cannot be split; None when it can:
        on the way up to its initializer, each body passes it on once and reads it nowhere else."""
        if body is self.model.graph:
            tensor = self.initializers.get(name)
            if tensor is None or name in {v.name for v in body.input}:
                return "its weight is not an initializer (computed or a graph input)"
            if tensor.data_type != FLOAT or len(tensor.dims) != 2:
                return "its weight is not a 2-D float32 tensor"
            return None if len(_uses(body, name)) == 1 else "its weight is read by other nodes too (shared)"
        if name not in body.input:
            producer = next((n for n in body.node if name in n.output), None)
            if producer is not None and producer.op_type == "Transpose" and producer.input[0] in body.input:
                return "its weight is transposed in the body (a weight tied to another use)"
            return _COMPUTED
        index = list(body.input).index(name)
        sites = list(_call_sites(self.model, function_id(body)))
        if not sites:
            return "its function has no call"
        for caller, node in sites:
            if index >= len(node.input) or not node.input[index]:
                return "a call does not pass its weight"
            arg = node.input[index]
            if len(_uses(caller, arg)) != 1:
                return "its weight is read by other nodes too (shared)"
            why = self._pure(caller, arg, depth + 1)
            if why:
                return why
        return None

    def _source_shapes(self, body, name: str, transposed: bool = False) -> set[tuple[int, ...]]:
        if body is self.model.graph:
            dims = tuple(self.initializers[name].dims)
            return {dims[::-1] if transposed else dims}
        index = list(body.input).index(name)
        shapes: set[tuple[int, ...]] = set()
        for caller, node in _call_sites(self.model, function_id(body)):
            shapes |= self._source_shapes(caller, node.input[index], transposed)
        return shapes

    def _split(self, body, name: str, transposed: bool = False) -> list[str]:
        """Replace ``name`` in ``body`` by its packed parts, up to the main graph. Returns the new names."""
        new = [name + part for part in self.parts]
        if (id(body), name) in self.done:
            return new
        self.done.add((id(body), name))
        if body is self.model.graph:
            tensor = self.initializers[name]
            k, n = tensor.dims[::-1] if transposed else tensor.dims
            if transposed:
                self.transposed.add(name)
            for index, (part, (dims, data_type)) in enumerate(zip(new, self._shapes(k, n))):
                self.model.graph.initializer.append(onnx.TensorProto(name=part, data_type=data_type, dims=dims))  # values when written
                self.sources[part] = functools.partial(lambda i, source: self._pack(source)[i], index, name)
            return new
        index = list(body.input).index(name)
        body.input[index : index + 1] = new
        kept = [v for v in body.value_info if v.name != name]
        del body.value_info[:]
        body.value_info.extend(kept)
        for caller, node in list(_call_sites(self.model, function_id(body))):
            arg = node.input[index]
            node.input[index : index + 1] = self._split(caller, arg, transposed)
        return new

    def _weight_reason(self, body, node: onnx.NodeProto) -> tuple[str | None, bool]:
        """For a node that may read a weight: (why it stays float, whether it reads its weight
        transposed). ``(_COMPUTED, False)``: not a weight; ``(None, t)``: it becomes MatMulNBits."""
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Gemm":
            if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or (len(node.input) > 2 and node.input[2] and attrs.get("beta", 1.0) != 1.0):
                return "a Gemm with transA, alpha or beta other than the defaults (MatMulNBits has none of them)", False
            return None, bool(attrs.get("transB", 0))
        return None, False

    def quantize_body(self, body, label: str) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
        """Every MatMul of ``body`` with a constant 2-D weight -> MatMulNBits; every such Gemm ->
        MatMulNBits + Add of its bias. The weights of Conv nodes are reported left (skipped)."""
        done, skipped = [], []
        nodes = list(body.node)
        for position, node in enumerate(nodes):
            if node.domain not in ("", "ai.onnx") or node.op_type not in _QUANTIZED_OPS + _LEFT_OPS or len(node.input) < 2:
                continue
            weight = node.input[1]
            why = self._pure(body, weight)
            if node.op_type in _LEFT_OPS:  # reported whenever its weight is a constant of the file
                if why in (None, "its weight is not a 2-D float32 tensor", "its weight is read by other nodes too (shared)"):
                    skipped.append((label, node.name or node.output[0], _LEFT_OPS_REASON))
                continue
            if node.op_type == "MatMul" and len(node.input) != 2:
                continue
            transposed = False
            if why is None:
                why, transposed = self._weight_reason(body, node)
            shapes = set() if why else self._source_shapes(body, weight, transposed)
            if not why and len(shapes) != 1:
                why = f"its calls pass weights of different shapes {sorted(shapes)}"
            if why == _COMPUTED:
                continue  # activations times activations (attention scores): not a weight
            if why:
                skipped.append((label, node.name or node.output[0], why))
                continue
            (k, n), = shapes
            parts = self._split(body, weight, transposed)
            attributes = {"K": k, "N": n, "bits": self.bits, "block_size": self.block_size}
            if self.accuracy_level:
                attributes["accuracy_level"] = self.accuracy_level
            bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else None
            product = list(node.output) if bias is None else [_unused_name(body, node.output[0] + "_matmul")]
            nbits = onnx.helper.make_node(
                "MatMulNBits", [node.input[0], *parts], product,
                name=(node.name + f"_Q{self.bits}") if node.name else "", domain=_MS_DOMAIN, **attributes,
            )
            nbits.metadata_props.extend(node.metadata_props)
            made = [nbits]
            if bias is not None:  # Gemm's C: broadcast over the rows as Add does
                add = onnx.helper.make_node("Add", [product[0], bias], list(node.output), name=(node.name + "_bias") if node.name else "")
                add.metadata_props.extend(node.metadata_props)
                made.append(add)
            nodes[position] = made
            _ensure_opset(self.model, body, _MS_DOMAIN)
            done.append((label, nbits.name or node.output[0]))
        del body.node[:]
        body.node.extend(n for item in nodes for n in (item if isinstance(item, list) else [item]))
        return done, skipped


def _unused_name(body, base: str) -> str:
    taken = {v for n in body.node for v in (*n.input, *n.output)} | {getattr(v, "name", v) for v in (*body.input, *body.output)}
    name, count = base, 0
    while name in taken:
        count += 1
        name = f"{base}_{count}"
    return name


# -- precision ------------------------------------------------------------------------------


def _clip_for(data_type: int, array: np.ndarray) -> np.ndarray:
    """``array`` (float32) in ``data_type``, clipped to its finite range (infinities stay)."""
    array = np.asarray(array, dtype=np.float32)
    if data_type == onnx.TensorProto.FLOAT16:
        finite = np.finfo(np.float16).max
        clipped = np.where(np.isfinite(array), np.clip(array, -finite, finite), array)
        return clipped.astype(np.float16)
    import ml_dtypes

    return array.astype(ml_dtypes.bfloat16)


def _converted_tensor(tensor: onnx.TensorProto, data_type: int) -> onnx.TensorProto:
    out = onnx.numpy_helper.from_array(_clip_for(data_type, onnx.numpy_helper.to_array(tensor)), tensor.name)
    return out


class _Precision:
    """Float32 -> ``target`` in the bodies of converted calls, Casts where converted meets kept."""

    def __init__(self, model: onnx.ModelProto, target: int, low: dict[FunctionId, bool], root_low: bool):
        self.model = model
        self.target = target
        self.low = low
        self.root_low = root_low
        self.casts = 0
        self.functions = {function_id(f): f for f in model.functions}
        self.types = {function_id(f): _declared_types(f) for f in model.functions}
        self.main_types = _declared_types(model.graph)

    def _mode_type(self, body) -> int:
        low = self.root_low if body is self.model.graph else self.low.get(function_id(body), False)
        return self.target if low else FLOAT

    def _cast(self, body, value: str, to: int, taken: set[str]) -> tuple[onnx.NodeProto, str]:
        name = _calls.unique_name(f"{value}_{_SUFFIX[to]}", taken)
        self.casts += 1
        return onnx.helper.make_node("Cast", [value], [name], to=to, name=f"convert_cast_{self.casts}_{name}"), name

    def weight_plan(self) -> tuple[dict[str, int], dict[FunctionId, dict[str, int]]]:
        """Target dtype of every float32 main-graph initializer, and of every weight formal.

        A weight formal: a formal input every call feeds from a main-graph initializer. An
        initializer goes to ``target`` when every body that reads it (other than passing it on to
        a weight formal) is converted; the formals it reaches follow it; a formal reached by
        initializers of both kinds makes them all float32.
        """
        model = self.model
        calls = _calls.module_calls(model)
        by_function: dict[FunctionId, list[metadata.ExpandedCall]] = collections.defaultdict(list)
        for call in calls.values():
            by_function[function_id(call.function)].append(call)
        sources: dict[FunctionId, dict[str, set[str]]] = {}
        main_names = _calls.main_graph_names(model)  # once: per call it made 10,000 calls quadratic
        for fid, its_calls in by_function.items():
            function = self.functions[fid]
            formals: dict[str, set[str]] = {}
            for index, formal in enumerate(function.input):
                found = [_calls.initializer_source(model, call, index, main_names=main_names) for call in its_calls]
                if found and all(found):
                    formals[formal] = set(found)
            sources[fid] = formals
        initializers = {t.name: t for t in model.graph.initializer}
        readers: dict[str, set[bool]] = collections.defaultdict(set)  # initializer -> modes of its readers

        def reads(body, weights: Mapping[str, set[str]], mode: bool) -> None:
            for name, origins in weights.items():
                for node, index in _uses(body, name):
                    callee = self.functions.get(node_id(node))
                    if callee is not None and index >= 0 and callee.input[index] in sources.get(node_id(node), {}):
                        continue  # passed on to a weight formal
                    for origin in origins:
                        readers[origin].add(mode)

        main_weights = {name: {name} for name, t in initializers.items() if t.data_type == FLOAT}
        reads(model.graph, main_weights, self.root_low)
        for fid, formals in sources.items():
            reads(self.functions[fid], formals, self.low.get(fid, False))
        low = {name for name in main_weights if readers.get(name) and all(readers[name])}
        changed = True
        while changed:
            changed = False
            for formals in sources.values():
                for origins in formals.values():
                    floats = {o for o in origins if initializers[o].data_type == FLOAT}
                    if floats & low and floats - low:
                        low -= floats
                        changed = True
        initializer_types = {name: (self.target if name in low else FLOAT) for name in main_weights}
        formal_types = {}
        for fid, formals in sources.items():
            formal_types[fid] = {}
            for formal, origins in formals.items():
                kinds = {initializer_types.get(o, initializers[o].data_type) for o in origins}
                formal_types[fid][formal] = kinds.pop() if len(kinds) == 1 else initializers[next(iter(origins))].data_type
        return initializer_types, formal_types

    def convert(self) -> dict[str, int]:
        """Rewrite every body; returns the dtype of every main-graph float32 initializer."""
        initializer_types, formal_types = self.weight_plan()
        self._body(self.model.graph, initializer_types, formal_types, is_root=True)
        for function in list(self.model.functions):
            fid = function_id(function)
            self._body(function, formal_types.get(fid, {}), formal_types, is_root=False)
        return initializer_types

    def _body(self, body, weight_types: Mapping[str, int], formal_types, *, is_root: bool) -> None:
        model = self.model
        mode = self._mode_type(body)
        low = mode != FLOAT
        declared = self.main_types if is_root else self.types[function_id(body)]
        taken = _calls.body_names(body)
        weights = dict(weight_types)
        out: list[onnx.NodeProto] = []
        cast_of: dict[tuple[str, int], str] = {}

        def as_type(value: str, to: int) -> str:
            key = (value, to)
            if key not in cast_of:
                node, name = self._cast(body, value, to, taken)
                out.append(node)
                cast_of[key] = name
            return cast_of[key]

        if is_root:  # graph inputs keep their types: read like float32 weights, cast where used
            for value in body.input:
                if declared.get(value.name) == FLOAT:
                    weights.setdefault(value.name, FLOAT)
        body_outputs = set() if is_root else set(body.output)  # a function's outputs are in its own dtype
        renamed_outputs = {}
        if is_root and low:
            for value in body.output:
                if declared.get(value.name) == FLOAT and value.name not in weights:
                    renamed_outputs[value.name] = _calls.unique_name(f"{value.name}_{_SUFFIX[mode]}", taken)
        for node in list(body.node):
            callee = self.functions.get(node_id(node))
            if callee is not None:
                callee_fid = node_id(node)
                callee_mode = self.target if self.low.get(callee_fid, False) else FLOAT
                callee_types = self.types.get(callee_fid, {})
                callee_weights = formal_types.get(callee_fid, {})
                for index, value in enumerate(node.input):
                    if not value or index >= len(callee.input) or callee.input[index] in callee_weights:
                        continue  # a weight formal: the same dtype on both sides
                    if value in weights:
                        have = weights[value] if weights[value] in (FLOAT, self.target) else None
                    else:
                        have = mode if callee_types.get(callee.input[index]) == FLOAT else None
                    if have is not None and have != callee_mode:
                        node.input[index] = as_type(value, callee_mode)
                out.append(node)
                if callee_mode != mode:
                    for index, value in enumerate(node.output):
                        if value and index < len(callee.output) and callee_types.get(callee.output[index]) == FLOAT:
                            if callee_mode == FLOAT and value not in body_outputs:
                                # a kept call's float32 result: read like a float32 weight, cast by
                                # the readers that need it (a graph output stays float32 as it is)
                                weights[value] = FLOAT
                                renamed_outputs.pop(value, None)
                                continue
                            inner = _calls.unique_name(f"{value}_{_SUFFIX[callee_mode]}", taken)
                            node.output[index] = inner
                            self.casts += 1
                            out.append(onnx.helper.make_node("Cast", [inner], [value], to=mode, name=f"convert_cast_{self.casts}_{value}"))
                continue
            # an op of this body reads weights (and graph inputs) in the body's dtype
            for index, value in enumerate(node.input):
                if value in weights and weights[value] in (FLOAT, self.target) and weights[value] != mode:
                    node.input[index] = as_type(value, mode)
            for sub in all_nodes([node]):  # subgraphs read the enclosing body's values by name
                if sub is not node:
                    for index, value in enumerate(sub.input):
                        if value in weights and weights[value] in (FLOAT, self.target) and weights[value] != mode:
                            sub.input[index] = as_type(value, mode)
            if low:
                self._lower(node, body, declared, weights, mode, taken, out)
            else:
                out.append(node)
        if renamed_outputs:
            for node in out:
                for index, value in enumerate(node.output):
                    if value in renamed_outputs:
                        node.output[index] = renamed_outputs[value]
                for sub in all_nodes([node]):
                    for index, value in enumerate(sub.input):
                        if value in renamed_outputs:
                            sub.input[index] = renamed_outputs[value]
            for original, inner in renamed_outputs.items():
                self.casts += 1
                out.append(onnx.helper.make_node("Cast", [inner], [original], to=FLOAT, name=f"convert_cast_{self.casts}_{original}"))
        if len(out) != len(body.node) or any(a is not b for a, b in zip(out, body.node)):
            _ensure_default_opset(model, body)
        del body.node[:]
        body.node.extend(out)
        if low:
            self._retype(body, weights, mode, is_root)

    def _lower(self, node: onnx.NodeProto, body, declared: Mapping[str, int], weights, mode: int, taken: set[str], out: list) -> None:
        """One op of a converted body, in ``mode`` (or float32 between Casts for FLOAT32_OPS)."""
        for sub in all_nodes([node]):
            self._lower_attributes(sub, mode)
        if node.domain in ("", "ai.onnx") and (node.op_type in FLOAT32_OPS or not self._supports(node.op_type, mode)):
            for index, value in enumerate(node.input):
                if value and (declared.get(value) == FLOAT or weights.get(value) == mode) and weights.get(value) != FLOAT:
                    node_cast, name = self._cast(body, value, FLOAT, taken)
                    out.append(node_cast)
                    node.input[index] = name
            out.append(node)
            for index, value in enumerate(node.output):
                if value and declared.get(value) == FLOAT:
                    inner = _calls.unique_name(f"{value}_f32", taken)
                    node.output[index] = inner
                    self.casts += 1
                    out.append(onnx.helper.make_node("Cast", [inner], [value], to=mode, name=f"convert_cast_{self.casts}_{value}"))
            return
        out.append(node)

    @functools.cache  # noqa: B019 (one per conversion)
    def _supports(self, op_type: str, mode: int) -> bool:
        """The op's schema at the model's opset takes ``mode`` wherever it takes float32 (Cos has
        no bfloat16 before opset 22): otherwise it runs in float32 between Casts."""
        version = next((o.version for o in self.model.opset_import if o.domain in ("", "ai.onnx")), 18)
        try:
            schema = onnx.defs.get_schema(op_type, version, "")
        except onnx.defs.SchemaError:
            return True
        wanted = f"tensor({onnx.helper.tensor_dtype_to_np_dtype(mode).name if mode == onnx.TensorProto.FLOAT16 else 'bfloat16'})"
        return all(wanted in c.allowed_type_strs for c in schema.type_constraints if "tensor(float)" in c.allowed_type_strs)

    def _lower_attributes(self, node: onnx.NodeProto, mode: int) -> None:
        for attribute in node.attribute:
            if node.op_type in ("Cast",) and attribute.name == "to" and attribute.i == FLOAT:
                attribute.i = mode
            elif node.op_type in _DTYPE_ATTRIBUTE_OPS and attribute.name == "dtype" and attribute.i == FLOAT:
                attribute.i = mode
            elif attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == FLOAT and node.op_type in ("Constant", "ConstantOfShape"):
                attribute.t.CopyFrom(_converted_tensor(attribute.t, mode))
            elif node.op_type == "Constant" and attribute.name in ("value_float", "value_floats"):
                values = [attribute.f] if attribute.name == "value_float" else list(attribute.floats)
                tensor = onnx.numpy_helper.from_array(np.asarray(values if attribute.name == "value_floats" else values[0], np.float32))
                attribute.CopyFrom(onnx.helper.make_attribute("value", _converted_tensor(tensor, mode)))

    def _retype(self, body, weights: Mapping[str, int], mode: int, is_root: bool) -> None:
        """Declared float32 values of a converted body now hold ``mode`` (weights keep theirs;
        the main graph's inputs and outputs keep their types)."""
        boundary = {v.name for v in body.input} | {v.name for v in body.output} if is_root else set()

        def retype(values) -> None:
            for value in values:
                if value.name in boundary or (value.name in weights and weights[value.name] == FLOAT):
                    continue
                tensor_type = value.type.tensor_type
                if value.type.HasField("tensor_type") and tensor_type.elem_type == FLOAT:
                    tensor_type.elem_type = mode

        retype(body.value_info)
        for node in body.node:
            for sub in all_nodes([node]):
                for attribute in sub.attribute:
                    for graph in [attribute.g, *attribute.graphs] if attribute.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) else []:
                        retype([*graph.input, *graph.output, *graph.value_info])
                        for tensor in graph.initializer:
                            if tensor.data_type == FLOAT:
                                tensor.CopyFrom(_converted_tensor(tensor, mode))


# -- the tool -------------------------------------------------------------------------------


def _class_of(call: metadata.ExpandedCall) -> str:
    return metadata.props(call.function).get(metadata.CLASS, "").rsplit(".", 1)[-1] or call.function.name


def _drift(actual: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """(max abs, max abs / range of ``expected``) with ``actual`` read as float32."""
    expected = np.asarray(expected)
    actual = np.asarray(actual)
    if expected.dtype.kind == "f" or expected.dtype.kind == "V":
        expected = expected.astype(np.float32)
        actual = actual.astype(np.float32)
    elif actual.dtype != expected.dtype and actual.dtype.kind in "fV":
        actual = actual.astype(np.float32)
    max_abs, _ = max_differences(actual, expected)
    finite = expected[np.isfinite(expected)] if expected.dtype.kind == "f" else expected
    spread = float(finite.max() - finite.min()) if finite.size and expected.dtype.kind in "fiu" else 0.0
    return max_abs, (max_abs / spread if spread > 0 else (0.0 if max_abs == 0 else math.inf))


def _overflows(actual: np.ndarray, expected: np.ndarray) -> bool:
    """Some value is inf or NaN in ``actual`` where ``expected`` holds a finite one."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape or actual.dtype.kind != "f" or expected.dtype.kind != "f":
        return False
    return bool(np.any(~np.isfinite(actual) & np.isfinite(expected)))


def _load(path: str | os.PathLike, dtype: str | None) -> onnx.ModelProto:
    """The file, checked; a file without functions only for ``quantize``, by its nodes' module metadata."""
    from onnx_modular.storage.load import load_model_file

    model = load_model_file(path)  # checked; external data stays external
    if not model.functions:
        if not _node_modules(model):
            raise InvalidModelFileError(
                f"{str(path)!r} has no local functions and its nodes do not name their modules "
                f"({metadata.MODULE_PATH}), so no module can be chosen in it.",
                hint="Convert the modular file written by `onnx-modular export`; for another exporter's file "
                "use onnxruntime's or onnxconverter-common's tools with node names.",
            )
        if dtype is not None:
            raise InvalidInputError(
                f"{str(path)!r} is a flat file (no local functions): --dtype converts module bodies, which it has none of.",
                hint="Convert the modular file (before `onnx-modular inline`); --quantize/--exclude work on a flat "
                "file by its nodes' module paths.",
            )
    return model


def _node_modules(model: onnx.ModelProto) -> dict[str, tuple[str, str]]:
    """Node name -> (module path, class) from the nodes' metadata (a flat copy, ``files/flat.py``)."""
    found = {}
    for node in model.graph.node:
        props = {e.key: e.value for e in node.metadata_props}
        if metadata.MODULE_PATH in props and node.name:
            found[node.name] = (props[metadata.MODULE_PATH], props.get(metadata.CLASS, "").rsplit(".", 1)[-1])
    return found


def _flat_excluded(model: onnx.ModelProto, names: Sequence[str]) -> list[str]:
    """The nodes of a flat file whose module (path, a path below it, class or glob) a NAME selects."""
    import difflib
    import fnmatch

    modules = _node_modules(model)
    chosen: list[str] = []
    for text in names:
        hits = [
            node for node, (path, cls) in modules.items()
            if path == text or path.startswith(text + ".") or fnmatch.fnmatchcase(path, text) or cls == text
            or (cls and fnmatch.fnmatchcase(cls, text))
        ]
        if not hits:
            known = sorted({p for p, _ in modules.values()} | {c for _, c in modules.values() if c})
            close = difflib.get_close_matches(text, known, n=5, cutoff=0.5)
            raise InvalidInputError(
                f"No node of the flat file belongs to a module or class {text!r}"
                + (f"; the closest names: {', '.join(close)}." if close else "."),
                hint="Give a module path (`model.layers.0`) or a class (`LlamaMLP`) as the nodes' metadata names them.",
            )
        chosen += [n for n in hits if n not in chosen]
    return chosen


def _convert_flat(
    source: pathlib.Path, destination: pathlib.Path, model: onnx.ModelProto, *, quantize: str, exclude: Sequence[str],
    block_size: int, symmetric: bool, accuracy_level: int | None, inputs, seed: int,
) -> Conversion:
    """``quantize`` on a flat file: onnxruntime's ``MatMulNBitsQuantizer`` itself, its
    ``nodes_to_exclude`` found from the nodes' module metadata. The weights are loaded (the
    quantizer works on a model in memory)."""
    import onnx_ir as ir

    with _root_logging_kept():
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from onnx_modular.storage.load import load_external_data

    excluded = _flat_excluded(model, exclude)
    feeds = feeds_for(model, inputs, seed=seed)
    names, values = runtime.run(str(source), feeds, what="original model")
    reference = dict(zip(names, values))
    work = onnx.ModelProto()
    work.CopyFrom(model)
    if uses_external_data(work):
        load_external_data(work, source.parent, name=repr(str(source)))
    quantizer = MatMulNBitsQuantizer(work, bits=QUANTIZE_BITS[quantize], block_size=block_size, is_symmetric=symmetric,
                                     accuracy_level=accuracy_level, nodes_to_exclude=excluded)
    quantizer.process()
    result = quantizer.model.model
    originals = {n.name: n for n in model.graph.node if n.name}
    suffix = f"_Q{QUANTIZE_BITS[quantize]}"
    made = []
    for node in result.graph.node:
        if node.op_type == "MatMulNBits" and node.name.endswith(suffix) and node.name[: -len(suffix)] in originals:
            original = originals[node.name[: -len(suffix)]]
            if not node.metadata_props:  # the quantizer's new node keeps the MatMul's module labels
                node.metadata_props.extend(original.metadata_props)
            made.append((_node_modules(model).get(original.name, ("<main graph>", ""))[0], node.name))
    result.metadata_props.add(key=metadata.CONVERTED, value=json.dumps({
        "source": source.name, "dtype": None, "kept": [], "quantize": quantize, "bits": QUANTIZE_BITS[quantize],
        "block_size": block_size, "excluded": sorted({_node_modules(model)[n][0] for n in excluded}),
    }))
    with save.staged_save(ir.serde.deserialize_model(result), destination, full_check=False) as staged:
        _runnable(staged, None, quantize)
        names, values = runtime.run(str(staged), feeds, what="converted model")
        output_bytes = sum(p.stat().st_size for p in staged.parent.iterdir() if p.is_file())
    outputs = {name: _drift(value, reference[name]) for name, value in zip(names, values) if name in reference}
    source_bytes = source.stat().st_size + sum(
        (source.parent / name).stat().st_size for name in _data_files(model) if (source.parent / name).is_file()
    )
    skipped = _flat_left(result, set(excluded))
    _warn_left(quantize, made, skipped)
    return Conversion(
        str(source), str(destination), None, quantize, block_size, [], [], None,
        sorted({_node_modules(model)[n][0] for n in excluded}), made, skipped, 0, [], 0, [], outputs, [], [],
        source_bytes, output_bytes,
    )


def _flat_left(model: onnx.ModelProto, excluded: set[str]) -> list[tuple[str, str, str]]:
    """The weight-reading nodes onnxruntime's quantizer left in a flat file (it quantizes MatMul only)."""
    constants = {t.name for t in model.graph.initializer}
    modules = _node_modules(model)
    left = []
    for node in model.graph.node:
        if node.op_type in _QUANTIZED_OPS + _LEFT_OPS and node.name not in excluded and len(node.input) > 1 and node.input[1] in constants:
            reason = _LEFT_OPS_REASON if node.op_type in _LEFT_OPS else (
                f"a {node.op_type} of a flat file: onnxruntime's MatMulNBitsQuantizer leaves it (the modular file's "
                "convert makes Gemm MatMulNBits + Add)" if node.op_type == "Gemm" else "onnxruntime's MatMulNBitsQuantizer left it")
            left.append((modules.get(node.name, ("<main graph>", ""))[0], node.name or node.output[0], reason))
    return left


def _build(
    model: onnx.ModelProto,
    folder: str | None,
    *,
    dtype: int | None,
    low_calls: Callable[[metadata.ExpandedCall], bool],
    root_low: bool,
    quant: Callable[[metadata.ExpandedCall], bool],
    root_quant: bool,
    bits: int | None,
    block_size: int,
    symmetric: bool,
    accuracy_level: int | None,
    note: Mapping[str, Any],
):
    """The converted model (onnx_ir, weights converted lazily when written) and its facts."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common_passes

    work = onnx.ModelProto()
    work.CopyFrom(model)

    def plan_of(call: metadata.ExpandedCall) -> _Plan:
        return _Plan(dtype is not None and low_calls(call), bits is not None and quant(call))

    plans, split = _split_plans(work, plan_of)
    calls = _calls.module_calls(work)
    quantized: list[tuple[str, str]] = []
    skipped: list[tuple[str, str, str]] = []
    sources: dict[str, Callable[[], np.ndarray]] = {}
    if bits is not None:
        quantizer = _Quantizer(work, folder, bits, block_size, symmetric, accuracy_level)
        label_of = {}
        for call in calls.values():
            label_of.setdefault(function_id(call.function), call.call_name)
        if root_quant:
            done, left = quantizer.quantize_body(work.graph, "<main graph>")
            quantized += done
            skipped += left
        for function in list(work.functions):
            fid = function_id(function)
            if plans.get(fid, _Plan(False, False)).quantize:
                done, left = quantizer.quantize_body(function, label_of.get(fid, function.name))
                quantized += done
                skipped += left
        sources = quantizer.sources
    initializer_types: dict[str, int] = {}
    casts = 0
    if dtype is not None:
        precision = _Precision(work, dtype, {fid: plan.low for fid, plan in plans.items()}, root_low)
        initializer_types = precision.convert()
        casts = precision.casts
    work.metadata_props.add(key=metadata.CONVERTED, value=json.dumps(dict(note)))
    result = ir.serde.deserialize_model(work)
    if folder:
        ir.external_data.set_base_dir(result.graph, folder)
    lowered = {name for name, kind in initializer_types.items() if kind != FLOAT}
    for name, value in list(result.graph.initializers.items()):
        source = sources.get(name)
        to = initializer_types.get(name) if name in lowered else None
        if source is None and to is None:
            continue
        original = value.const_value

        def compute(source=source, to=to, original=original, name=name):
            array = source() if source is not None else original.numpy()
            if to is not None:
                array = _clip_for(to, array)  # a new array: the source's mapped pages can go
                if source is None and isinstance(original, ir.ExternalTensor):
                    original.release()  # one tensor at a time: the file is not mapped whole by the end
            return ir.Tensor(array, name=name)

        if source is not None:
            shape = ir.Shape(list(value.shape))
            kind = value.dtype if to is None else ir.DataType(to)
        else:
            shape = original.shape
            kind = ir.DataType(to)
        value.const_value = ir.LazyTensor(compute, dtype=kind, shape=shape, name=name)
        value.dtype = kind
    common_passes.RemoveUnusedNodesPass()(result)
    common_passes.RemoveUnusedFunctionsPass()(result)
    facts = {
        "quantized": quantized,
        "skipped": skipped,
        "weights": len(lowered),
        "float32_weights": sorted(n for n, kind in initializer_types.items() if kind == FLOAT and n in result.graph.initializers),
        "casts": casts,
        "split": split,
        "plans": plans,
        "calls": calls,
    }
    return result, facts


def _runnable(path: pathlib.Path, dtype: str | None, quantize: str | None) -> None:
    """The converted file opens in onnxruntime here, or a typed error says which dtype it lacks."""
    try:
        runtime.session(str(path), what="converted model")
    except Exception as e:
        what = " + ".join(x for x in (dtype, quantize and f"{quantize} MatMulNBits") if x)
        raise InvalidInputError(
            f"onnxruntime cannot run the {what} model here: {str(e).splitlines()[0][:300]}",
            hint="Choose a dtype this onnxruntime provider has kernels for (float16 on CPU; bfloat16 needs "
            "a provider with bfloat16 kernels, such as CUDA), or keep the modules whose ops it lacks.",
        ) from e


def convert(
    path: str | os.PathLike,
    output: str | os.PathLike,
    *,
    dtype: str | None = None,
    keep: Sequence[str] = (),
    quantize: str | None = None,
    exclude: Sequence[str] = (),
    block_size: int = 32,
    symmetric: bool = False,
    accuracy_level: int | None = None,
    auto_keep: float | None = None,
    verify: bool = True,
    inputs: str | os.PathLike | Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
) -> Conversion:
    """Write ``path`` with chosen modules in another precision and/or their MatMul weights quantized.

    Args:
        path: A modular ``.onnx`` file (``export_modular``); external data is read tensor by tensor.
        output: The file to write (its weights as external data when large, as ``save`` decides).
        dtype: ``"float16"`` or ``"bfloat16"``: every module's ops and the weights only converted
            modules read, except ``keep``.
        keep: NAMEs (class, module path, glob) left in float32, with everything they call.
        quantize: ``"int4"`` or ``"int8"``: MatMul weights of every module but ``exclude`` to
            ``MatMulNBits`` (onnxruntime's packing, ``block_size``, ``symmetric``,
            ``accuracy_level`` as in ``MatMulNBitsQuantizer``).
        exclude: NAMEs whose MatMuls stay as they are, with everything they call.
        verify: Run the original and the converted file in onnxruntime on the same inputs for the
            drift report (default). ``False`` for a file onnxruntime cannot hold in memory: the
            conversion then reads and writes one tensor at a time, the file is checked with
            ``onnx.checker`` only, and the report has no drift.
        auto_keep: A tolerance: convert, then keep classes in float32, the most harmful first
            (ranked by the drift of the outputs when that class alone is converted), until every
            output's drift (max abs difference over its range) is at most this.
        inputs: The model's inputs for the comparison (``.npz`` or arrays by name); random ones
            from the declared input types when ``None``.

    Returns:
        A :class:`Conversion`: what was converted and the drift of every call, class and output.

    Raises:
        InvalidInputError: Nothing to do, an unknown NAME (the closest names are listed), a
            dtype onnxruntime cannot run here, or inputs that do not fit. Nothing is written.
        InvalidModelFileError: The file is not a modular model.

    Example::

        convert("llama.onnx", "llama.f16.onnx", dtype="float16", keep=["LlamaRMSNorm"])
        convert("llama.onnx", "llama.q4.onnx", quantize="int4", exclude=["lm_head"])
    """
    if dtype is not None and dtype not in DTYPES:
        raise InvalidInputError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}.", hint="Use --dtype float16.")
    if quantize is not None and quantize not in QUANTIZE_BITS:
        raise InvalidInputError(f"quantize must be one of {', '.join(QUANTIZE_BITS)}, not {quantize!r}.")
    if dtype is None and quantize is None:
        raise InvalidInputError("Nothing to convert: give dtype (float16, bfloat16) and/or quantize (int4, int8).")
    if keep and dtype is None:
        raise InvalidInputError("keep names modules left in float32: it needs dtype.", hint="Add --dtype float16.")
    if exclude and quantize is None:
        raise InvalidInputError("exclude names modules left unquantized: it needs quantize.", hint="Add --quantize int4.")
    if auto_keep is not None and (dtype is None or not (isinstance(auto_keep, (int, float)) and auto_keep > 0)):
        raise InvalidInputError(f"auto_keep must be a tolerance > 0 with dtype, not {auto_keep!r}.", hint="--dtype float16 --auto-keep 0.02")
    if isinstance(block_size, bool) or block_size not in (16, 32, 64, 128, 256):  # onnxruntime's MLAS quantizes these only
        raise InvalidInputError(f"block_size must be 16, 32, 64, 128 or 256 (MatMulNBits), not {block_size!r}.")
    if auto_keep is not None and not verify:
        raise InvalidInputError("auto_keep ranks modules by the drift it measures: it needs verify.", hint="Drop --no-verify.")
    destination = save.check_destination(output, reads=[path, *([inputs] if isinstance(inputs, (str, os.PathLike)) else [])])
    source = pathlib.Path(path)
    model = _load(source, dtype)
    check_expanded_size(model, name=repr(str(source)))  # call bombs and endless Loops, before any work
    declare_function_types(model)  # a function that declares no types gets its call's (Casts at the seams)
    if not model.functions:  # a flat file: quantization by the nodes' module metadata
        return _convert_flat(source, destination, model, quantize=quantize, exclude=exclude, block_size=block_size,
                             symmetric=symmetric, accuracy_level=accuracy_level, inputs=inputs, seed=seed)
    folder = runtime.external_data_folder(source, model)
    kept_calls = _selected(model, keep, "keep")
    excluded_calls = _selected(model, exclude, "exclude")
    reference: dict[str, np.ndarray] = {}
    reference_calls: list = []
    if verify:
        feeds = feeds_for(model, inputs, seed=seed)
        _, reference_calls = call_outputs(model, feeds, external_data_folder=folder, what="original model")
        names, values = runtime.run(str(source), feeds, what="original model")
        reference = dict(zip(names, values))
    target = DTYPES.get(dtype) if dtype else None
    bits = QUANTIZE_BITS.get(quantize) if quantize else None
    all_calls = _calls.module_calls(model)
    class_calls: dict[str, set[str]] = collections.defaultdict(set)
    for call in all_calls.values():
        class_calls[_class_of(call)].add(call.call_name)

    def build(own: set[str], note_extra: Mapping[str, Any] | None = None):
        """``keep`` keeps calls with everything they call; ``auto_keep`` keeps a class's own calls (``own``)."""
        kept = kept_calls | own
        note = {"source": source.name, "dtype": dtype, "kept": sorted(kept), "quantize": quantize,
                "bits": bits, "block_size": block_size if quantize else None, "excluded": sorted(excluded_calls)}
        note.update(note_extra or {})
        return _build(
            model, folder, dtype=target,
            low_calls=lambda call: not _under(call, kept_calls) and call.call_name not in own, root_low=True,
            quant=lambda call: not _under(call, excluded_calls), root_quant=True,
            bits=bits, block_size=block_size, symmetric=symmetric, accuracy_level=accuracy_level, note=note,
        )

    def output_drift(result) -> dict[str, tuple[float, float]]:
        import onnx_ir as ir

        with runtime.scratch_file(None) as scratch:
            ir.save(result, scratch, external_data=scratch.name + ".data")
            names, values = runtime.run(str(scratch), feeds, what="trial conversion")
        return {n: _drift(v, reference[n]) for n, v in zip(names, values)}

    def worst_drift(result) -> float:
        """The worst output drift of a trial conversion (inf: onnxruntime does not run it)."""
        try:
            return max((d for _, d in output_drift(result).values()), default=0.0)
        except VerificationError:
            return math.inf

    def alone(names: set[str]) -> float:
        """The worst output drift when only the calls ``names`` are converted."""
        others = set(all_calls) - names
        return worst_drift(_build(
            model, folder, dtype=target, low_calls=lambda call, o=others: call.call_name not in o, root_low=False,
            quant=lambda call: False, root_quant=False, bits=None, block_size=block_size, symmetric=symmetric,
            accuracy_level=None, note={})[0])

    own: set[str] = set()
    auto_kept: list[tuple[str, float]] = []
    if auto_keep is not None:
        worst = worst_drift(build(own)[0])
        if worst > auto_keep:
            kept_below = {c.call_name for c in all_calls.values() if _under(c, kept_calls)}
            candidates = [name for name, names in class_calls.items() if not names <= kept_below]
            alone_drift = {name: alone(class_calls[name]) for name in candidates}  # each class converted alone
            for name in sorted(candidates, key=lambda n: -alone_drift[n]):
                own |= class_calls[name]
                auto_kept.append((name, alone_drift[name]))
                worst = worst_drift(build(own)[0])
                if worst <= auto_keep:
                    break
    kept = {c.call_name for c in all_calls.values() if _under(c, kept_calls)} | own
    result, facts = build(own, {"auto_kept": [n for n, _ in auto_kept]} if auto_keep is not None else None)
    # onnx has no schema for MatMulNBits: no strict type inference; onnxruntime opens and runs it below
    actual: dict[str, np.ndarray] = {}
    actual_calls: list = []
    # a source with external data gives one with external data: tensors left as they are stay
    # references into the source's data (a `--generation` decode.onnx reads prefill.onnx.data), which
    # an inline save cannot keep; writing them to the output's own data file can
    external = True if folder else None
    with save.staged_save(result, destination, external_data=external, full_check=quantize is None) as staged:
        if verify:
            _runnable(staged, dtype, quantize)
            staged_model = onnx.load(str(staged), load_external_data=False)
            staged_folder = str(staged.parent) if uses_external_data(staged_model) else None
            # the outputs from the file as users run it (capturing every call can change onnxruntime's fusions)
            try:
                names, values = runtime.run(str(staged), feeds, what="converted model")
            except VerificationError as e:
                if dtype is None:
                    raise
                raise _not_running(e, dtype, _culprit(all_calls, class_calls, kept, alone)) from e
            actual = dict(zip(names, values))
            try:
                _, actual_calls = call_outputs(staged_model, feeds, external_data_folder=staged_folder, what="converted model")
            except Exception as e:
                raise VerificationError(f"The converted model does not run in onnxruntime: {str(e).splitlines()[0][:300]}") from e
        output_bytes = sum(p.stat().st_size for p in staged.parent.iterdir() if p.is_file())
    source_bytes = source.stat().st_size + sum(
        (source.parent / name).stat().st_size for name in _data_files(model) if (source.parent / name).is_file()
    )
    outputs = {name: _drift(actual[name], value) for name, value in reference.items() if name in actual}
    converted = {c.call_name: c for c in actual_calls}
    plans = facts["plans"]
    new_calls = facts["calls"]
    drifts: list[CallDrift] = []
    for call in reference_calls:
        other = converted.get(call.call_name)
        if other is None or call.call_name not in all_calls:
            continue
        pairs = [_drift(a, e) for a, e in zip(other.outputs, call.outputs)]
        plan = plans.get(function_id(new_calls[call.call_name].function), _Plan(False, False)) if call.call_name in new_calls else _Plan(False, False)
        drifts.append(CallDrift(
            call.call_name, _class_of(all_calls[call.call_name]), plan.low, plan.quantize,
            max((p[0] for p in pairs), default=0.0), max((p[1] for p in pairs), default=0.0),
            any(_overflows(a, e) for a, e in zip(other.outputs, call.outputs)),
        ))
    classes: dict[str, list[CallDrift]] = collections.defaultdict(list)
    for drift in drifts:
        classes[drift.module_class].append(drift)
    class_rows = sorted(
        (ClassDrift(name, len(rows), max(r.max_abs for r in rows), max(r.drift for r in rows)) for name, rows in classes.items()),
        key=lambda row: -row.drift,
    )
    _warn_left(quantize, facts["quantized"], facts["skipped"])
    ordered_kept = [name for name in all_calls if name in kept]
    ordered_excluded = [name for name in all_calls if name in excluded_calls]
    return Conversion(
        str(source), str(destination), dtype, quantize, block_size, ordered_kept, auto_kept, auto_keep, ordered_excluded,
        facts["quantized"], facts["skipped"], facts["weights"], facts["float32_weights"], facts["casts"], facts["split"],
        outputs, drifts, class_rows, source_bytes, output_bytes,
    )


def _culprit(all_calls: Mapping[str, metadata.ExpandedCall], class_calls: Mapping[str, set[str]], kept: set[str],
             alone: Callable[[set[str]], float]) -> tuple[str, str, float] | None:
    """The (class, call, drift alone) whose conversion alone breaks the file (drift inf), or else
    moves the outputs most: classes in execution order, then that class's calls (up to 16)."""
    order = {name: index for index, name in enumerate(all_calls)}
    classes = sorted((c for c, names in class_calls.items() if names - kept), key=lambda c: min(order[n] for n in class_calls[c]))
    drifts = {}
    for name in classes:
        drifts[name] = alone(class_calls[name] - kept)
        if drifts[name] == math.inf:
            break
    if not drifts:
        return None
    worst = max(drifts, key=lambda c: drifts[c])  # the first failing class, or the one drifting most
    calls = sorted(class_calls[worst] - kept, key=order.get)
    first = calls[0]
    if len(calls) > 1 and len(calls) <= 16:
        for call in calls:
            if alone({call}) >= drifts[worst]:
                first = call
                break
    return worst, first, drifts[worst]


def _not_running(error: VerificationError, dtype: str, culprit: tuple[str, str, float] | None) -> VerificationError:
    """The converted file does not run: the error names the module whose conversion breaks it."""
    cause = str(error).split(": ", 1)[-1].splitlines()[0][:300]
    if culprit is None:
        return VerificationError(f"The {dtype} model does not run in onnxruntime: {cause}", hint="Keep modules in float32 (--keep NAME).")
    cls, call, drift = culprit
    what = ("converting it alone already makes the file fail" if drift == math.inf else
            f"converted alone, it moves the outputs most ({drift:.3%} of their range)")
    return VerificationError(
        f"The {dtype} model does not run in onnxruntime ({cause}). Module {call!r} ({cls}): {what}; a value it computes "
        f"(a count, an index, a bin edge) likely rounds in {dtype} and a later op refuses it.",
        hint=f"Keep it in float32: --keep {cls} (or --keep {call}), or let --auto-keep TOLERANCE choose. Nothing was written.",
    )


def _data_files(model: onnx.ModelProto) -> set[str]:
    files = set()
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            files |= {e.value for e in tensor.external_data if e.key == "location"}
    return files
