"""Float32 -> float16 or bfloat16 inside the bodies of a ``ModelProto``, body by body.

Each body (the main graph, every function) is either converted (low) or kept float32. A
converted body computes in the new dtype: its float32 values, ``Cast``s to float32,
``Constant``s and ``ConstantOfShape`` values and ``dtype`` attributes follow; the ops
onnxconverter-common's float16 converter keeps in float32 (:data:`FLOAT32_OPS`: ``Resize``,
``Range``, ``TopK``, ``CumSum``, ``Min``/``Max``, ...) and ops without a schema for the dtype at
the model's opset run in float32 between ``Cast``s. ``Cast``s sit only where a converted call
meets a kept one (its arguments and its results), and at the graph's inputs and outputs, which
keep their types.

Some values of a converted body stay float32 (:func:`float32_values`): comparisons read float32
(:data:`COMPARE_OPS`); *index arithmetic*, float values computed only for sizes, counts and
positions (a ``Cast`` to int64, :data:`INDEX_INPUTS`), is computed in float32, since float16 holds
integers exactly only up to 2048; and the ops that read or write a value marked
:data:`RANGE_MARK` (past the target's finite range on the original run, measured by
:mod:`onnx_modular.files.convert.ranges`) run in float32. Such results are read like float32
weights: a converted reader casts them where it reads them.

Weights live in the main graph and reach the bodies as formal inputs (*weight formals*, found by
the caller from the call tree and given as plain data). A weight goes to the new dtype when every
body that reads it is converted; one a kept body reads (a tied embedding) stays float32 and a
converted reader casts it where it reads it. The initializers' values are not touched here: the
result says which dtype each one takes (the writer converts them one at a time with
:func:`clip_for`).

Entry: :func:`convert_precision`. The tool around it (which calls convert) is
:mod:`onnx_modular.files.convert.tool`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Container, Mapping

import numpy as np
import onnx
import onnx.defs
import onnx.helper
import onnx.numpy_helper

from onnx_modular.format import metadata
from onnx_modular.passes.proto_bodies import (
    Body,
    FunctionId,
    all_nodes,
    body_names,
    declared_types,
    ensure_default_opset,
    function_id,
    node_id,
    unique_name,
    uses,
)

__all__ = ["COMPARE_OPS", "DTYPES", "FLOAT32_OPS", "INDEX_INPUTS", "RANGE_MARK", "PrecisionResult", "WeightSources", "clip_for",
           "convert_precision", "float32_values"]

FLOAT = onnx.TensorProto.FLOAT
#: The dtypes a body can be converted to.
DTYPES = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}
#: Ops that stay float32 inside a converted body: onnxconverter-common's
#: ``float16.DEFAULT_OP_BLOCK_LIST`` (ranges, resizes, sorting, cumulative sums, the ML ops).
FLOAT32_OPS = frozenset({
    "ArrayFeatureExtractor", "Binarizer", "CastMap", "CategoryMapper", "DictVectorizer", "FeatureVectorizer",
    "Imputer", "LabelEncoder", "LinearClassifier", "LinearRegressor", "Normalizer", "OneHotEncoder",
    "RandomUniformLike", "SVMClassifier", "SVMRegressor", "Scaler", "TreeEnsembleClassifier",
    "TreeEnsembleRegressor", "ZipMap", "NonMaxSuppression", "TopK", "RoiAlign", "Resize", "Range", "CumSum",
    "Min", "Max", "Upsample",
})  # fmt: skip
#: Comparisons run in float32 too, and a weight they read (a threshold, a histogram's bin edges)
#: stays float32: ``histc``'s last edge ``3.0000002`` is ``3.0`` in float16, the count of the last
#: bin drops, and what it sizes no longer fits (a mixture of experts' tokens per expert).
COMPARE_OPS = frozenset({"Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Equal"})
#: Ops onnxruntime's CPU provider runs in float16 only without an attribute: a scatter that
#: accumulates (``reduction`` add, mul, max or min) has no float16 kernel ("MLFloat16 data type is
#: not supported with ScatterND ... when reduction is 'add'", JetMoE's attention): it runs in
#: float32 between Casts.
REDUCING_SCATTERS = frozenset({"ScatterND", "ScatterElements"})
#: Float inputs that are sizes, counts or positions (besides a comparison's inputs and a ``Cast``
#: to an integer or bool type): ``Resize``'s scales, ``Range``'s bounds. A float value computed
#: for such uses alone is *index arithmetic* and stays float32 (:func:`float32_values`): a
#: ``Conv1d``'s padding, ``ceil(length / stride)``, rounds in float16 past 2048 and the shapes no
#: longer match.
INDEX_INPUTS = {"Resize": frozenset({2}), "Upsample": frozenset({1}), "Range": frozenset({0, 1, 2})}
#: ``ValueInfoProto`` metadata on a value whose float32 values leave the target's finite range
#: (its largest finite magnitude, measured by ``convert``): the ops that read or write it stay float32.
RANGE_MARK = metadata.FLOAT32_RANGE
#: Ops that read any type: a value held in float32 needs no Cast before them.
_READS_ANY = frozenset({"Cast", "Shape", "Size"})
_FLOATS = frozenset({FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE})
#: Ops whose ``dtype`` attribute names the type of what they make.
_DTYPE_ATTRIBUTE_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "EyeLike", "Bernoulli",
                                  "Multinomial", "SequenceEmpty"})
#: Those whose ``dtype`` is float32 when not given (a converted body gives it: Kimi-K2.5's position
#: table fills an empty sequence with float16 tensors in a Loop).
_FLOAT_BY_DEFAULT = frozenset({"RandomNormal", "RandomUniform", "SequenceEmpty"})
#: Name suffix of a value cast to a dtype.
_SUFFIX = {FLOAT: "f32", onnx.TensorProto.FLOAT16: "f16", onnx.TensorProto.BFLOAT16: "bf16"}

#: Per function: formal input -> the main-graph initializers every call feeds it from (a weight formal).
WeightSources = Mapping[FunctionId, Mapping[str, set[str]]]


@dataclasses.dataclass
class PrecisionResult:
    """What :func:`convert_precision` did.

    Attributes:
        initializer_types: The dtype every float32 main-graph initializer takes (float32 or the target).
        casts: ``Cast`` nodes added.
    """

    initializer_types: dict[str, int]
    casts: int


def convert_precision(model: onnx.ModelProto, target: int, low: Mapping[FunctionId, bool], *, root_low: bool = True,
                      weight_sources: WeightSources | None = None) -> PrecisionResult:
    """Rewrite the bodies of ``model`` in place: the functions ``low`` marks (and the main graph
    when ``root_low``) compute in ``target`` (``onnx.TensorProto.FLOAT16`` or ``BFLOAT16``).

    ``weight_sources``: the weight formals of each function (``{}`` for a model without functions).

    Example::

        done = convert_precision(model, onnx.TensorProto.FLOAT16, {})   # the main graph in float16
    """
    precision = _Precision(model, target, dict(low), root_low)
    initializer_types = precision.convert(weight_sources or {})
    return PrecisionResult(initializer_types, precision.casts)


def clip_for(data_type: int, array: np.ndarray) -> np.ndarray:
    """``array`` (float32) in ``data_type``, clipped to its finite range (infinities stay)."""
    array = np.asarray(array, dtype=np.float32)
    if data_type == onnx.TensorProto.FLOAT16:
        finite = np.finfo(np.float16).max
        clipped = np.where(np.isfinite(array), np.clip(array, -finite, finite), array)
        return clipped.astype(np.float16)
    import ml_dtypes

    return array.astype(ml_dtypes.bfloat16)


def _converted_tensor(tensor: onnx.TensorProto, data_type: int) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(clip_for(data_type, onnx.numpy_helper.to_array(tensor)), tensor.name)


@dataclasses.dataclass
class _Rewrite:
    """One body being rewritten: its dtype, the dtypes of the weights it reads, the nodes made."""

    body: Body
    mode: int
    declared: Mapping[str, int]
    weights: dict[str, int]
    taken: set[str]
    body_outputs: set[str]  # a function's outputs are in its own dtype
    held: set[str] = dataclasses.field(default_factory=set)  # index arithmetic (float32_values)
    wide: set[str] = dataclasses.field(default_factory=set)  # values past the target's range
    renamed_outputs: dict[str, str] = dataclasses.field(default_factory=dict)
    out: list[onnx.NodeProto] = dataclasses.field(default_factory=list)
    cast_of: dict[tuple[str, int], str] = dataclasses.field(default_factory=dict)


class _Precision:
    """Float32 -> ``target`` in the bodies of converted calls, Casts where converted meets kept."""

    def __init__(self, model: onnx.ModelProto, target: int, low: dict[FunctionId, bool], root_low: bool):
        self.model = model
        self.target = target
        self.low = low
        self.root_low = root_low
        self.casts = 0
        self.functions = {function_id(f): f for f in model.functions}
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)
        self.types = {function_id(f): declared_types(f, opset) for f in model.functions}
        self.main_types = declared_types(model.graph, opset)

    def _declared(self, body) -> dict[str, int]:
        """The declared types of a body's values, with the float32 constants it makes (typed or not)."""
        declared = dict(self.main_types if body is self.model.graph else self.types[function_id(body)])
        declared.update({value: FLOAT for node in body.node for value in _float_constants(node)})
        return declared

    def _mode_type(self, body) -> int:
        low = self.root_low if body is self.model.graph else self.low.get(function_id(body), False)
        return self.target if low else FLOAT

    def _cast(self, body, value: str, to: int, taken: set[str]) -> tuple[onnx.NodeProto, str]:
        name = unique_name(f"{value}_{_SUFFIX[to]}", taken)
        self.casts += 1
        return onnx.helper.make_node("Cast", [value], [name], to=to, name=f"convert_cast_{self.casts}_{name}"), name

    # -- the weights' dtypes ------------------------------------------------------------

    def weight_plan(self, sources: WeightSources) -> tuple[dict[str, int], dict[FunctionId, dict[str, int]]]:
        """Target dtype of every float32 main-graph initializer, and of every weight formal.

        An initializer goes to ``target`` when every body that reads it (other than passing it on
        to a weight formal) is converted; the formals it reaches follow it; a formal reached by
        initializers of both kinds makes them all float32.
        """
        initializers = {t.name: t for t in self.model.graph.initializer}
        main_weights = {name: {name} for name, t in initializers.items() if t.data_type == FLOAT}
        readers = self._reader_modes(sources, main_weights)
        low = {name for name in main_weights if readers.get(name) and all(readers[name])}
        low = _agreeing(low, sources, initializers)
        initializer_types = {name: (self.target if name in low else FLOAT) for name in main_weights}
        formal_types = {}
        for fid, formals in sources.items():
            formal_types[fid] = {}
            for formal, origins in formals.items():
                kinds = {initializer_types.get(o, initializers[o].data_type) for o in origins}
                formal_types[fid][formal] = kinds.pop() if len(kinds) == 1 else initializers[next(iter(origins))].data_type
        return initializer_types, formal_types

    def _reader_modes(self, sources: WeightSources, main_weights: Mapping[str, set[str]]) -> dict[str, set[bool]]:
        """Initializer -> the modes (low or not) of the bodies that read it."""
        readers: dict[str, set[bool]] = collections.defaultdict(set)

        def reads(body, declared: Mapping[str, int], weights: Mapping[str, set[str]], mode: bool) -> None:
            held, wide = float32_values(body, declared, self.functions) if mode else (set(), set())
            for name, origins in weights.items():
                for node, index in uses(body, name):
                    callee = self.functions.get(node_id(node))
                    if callee is not None and index >= 0 and callee.input[index] in sources.get(node_id(node), {}):
                        continue  # passed on to a weight formal
                    # a comparison, a Cast to an integer, index arithmetic read their weight in float32
                    in_float32 = index >= 0 and _index_use(node, index) or _holds(node, held, wide, self.functions)
                    for origin in origins:
                        readers[origin].add(mode and not in_float32)

        reads(self.model.graph, self._declared(self.model.graph), main_weights, self.root_low)
        for fid, formals in sources.items():
            reads(self.functions[fid], self._declared(self.functions[fid]), formals, self.low.get(fid, False))
        return readers

    # -- the bodies -----------------------------------------------------------------------

    def convert(self, sources: WeightSources) -> dict[str, int]:
        """Rewrite every body; returns the dtype of every main-graph float32 initializer."""
        initializer_types, formal_types = self.weight_plan(sources)
        self._body(self.model.graph, initializer_types, formal_types, is_root=True)
        for function in list(self.model.functions):
            fid = function_id(function)
            self._body(function, formal_types.get(fid, {}), formal_types, is_root=False)
        return initializer_types

    def _body(self, body, weight_types: Mapping[str, int], formal_types, *, is_root: bool) -> None:
        rewrite = self._start(body, weight_types, is_root)
        for node in list(body.node):
            callee = self.functions.get(node_id(node))
            if callee is not None:
                self._call(rewrite, node, callee, formal_types)
            else:
                self._op(rewrite, node)
        if rewrite.renamed_outputs:
            self._cast_outputs(rewrite)
        out = rewrite.out
        if len(out) != len(body.node) or any(a is not b for a, b in zip(out, body.node)):
            ensure_default_opset(self.model, body)
        del body.node[:]
        body.node.extend(out)
        if rewrite.mode != FLOAT:
            self._retype(body, rewrite.weights, rewrite.mode, is_root)

    def _start(self, body, weight_types: Mapping[str, int], is_root: bool) -> _Rewrite:
        mode = self._mode_type(body)
        declared = self._declared(body)
        rewrite = _Rewrite(body, mode, declared, dict(weight_types), body_names(body), set() if is_root else set(body.output))
        if mode != FLOAT:
            rewrite.held, rewrite.wide = float32_values(body, declared, self.functions)
        if not is_root:
            return rewrite
        for value in body.input:  # graph inputs keep their types: read like float32 weights, cast where used
            if declared.get(value.name) == FLOAT:
                rewrite.weights.setdefault(value.name, FLOAT)
        if mode != FLOAT:
            for value in body.output:
                if declared.get(value.name) == FLOAT and value.name not in rewrite.weights:
                    rewrite.renamed_outputs[value.name] = unique_name(f"{value.name}_{_SUFFIX[mode]}", rewrite.taken)
        return rewrite

    def _as_type(self, rewrite: _Rewrite, value: str, to: int) -> str:
        """``value`` cast to ``to`` (one Cast per value and type in a body)."""
        key = (value, to)
        if key not in rewrite.cast_of:
            node, name = self._cast(rewrite.body, value, to, rewrite.taken)
            rewrite.out.append(node)
            rewrite.cast_of[key] = name
        return rewrite.cast_of[key]

    def _call(self, rewrite: _Rewrite, node: onnx.NodeProto, callee: onnx.FunctionProto, formal_types) -> None:
        """A call: its arguments cast to the callee's dtype (weight formals are the same on both sides)."""
        callee_fid = node_id(node)
        callee_mode = self.target if self.low.get(callee_fid, False) else FLOAT
        callee_types = self.types.get(callee_fid, {})
        callee_weights = formal_types.get(callee_fid, {})
        weights = rewrite.weights
        for index, value in enumerate(node.input):
            if not value or index >= len(callee.input) or callee.input[index] in callee_weights:
                continue  # a weight formal: the same dtype on both sides
            if value in weights:
                have = weights[value] if weights[value] in (FLOAT, self.target) else None
            else:
                have = rewrite.mode if callee_types.get(callee.input[index]) == FLOAT else None
            if have is not None and have != callee_mode:
                node.input[index] = self._as_type(rewrite, value, callee_mode)
        rewrite.out.append(node)
        if callee_mode != rewrite.mode:
            self._call_results(rewrite, node, callee, callee_mode, callee_types)

    def _call_results(self, rewrite: _Rewrite, node: onnx.NodeProto, callee: onnx.FunctionProto, callee_mode: int,
                      callee_types: Mapping[str, int]) -> None:
        """The float32 results of a call in another dtype than its body's."""
        for index, value in enumerate(node.output):
            if not (value and index < len(callee.output) and callee_types.get(callee.output[index]) == FLOAT):
                continue
            if callee_mode == FLOAT and value not in rewrite.body_outputs:
                # a kept call's float32 result: read like a float32 weight, cast by
                # the readers that need it (a graph output stays float32 as it is)
                rewrite.weights[value] = FLOAT
                rewrite.renamed_outputs.pop(value, None)
                continue
            inner = unique_name(f"{value}_{_SUFFIX[callee_mode]}", rewrite.taken)
            node.output[index] = inner
            self.casts += 1
            rewrite.out.append(onnx.helper.make_node("Cast", [inner], [value], to=rewrite.mode, name=f"convert_cast_{self.casts}_{value}"))

    def _op(self, rewrite: _Rewrite, node: onnx.NodeProto) -> None:
        """An op of this body reads weights (and graph inputs) in the body's dtype."""
        weights, mode = rewrite.weights, rewrite.mode

        def needs_cast(value: str) -> bool:
            return value in weights and weights[value] in (FLOAT, self.target) and weights[value] != mode

        held = mode != FLOAT and _holds(node, rewrite.held, rewrite.wide, self.functions)
        # else _lower or _hold casts them to float32; a Cast reads any type
        own_inputs = not (mode != FLOAT and (held or self._in_float32(node, mode)) or _reads_any(node))
        for index, value in enumerate(node.input):
            if own_inputs and needs_cast(value):
                node.input[index] = self._as_type(rewrite, value, mode)
        for sub in all_nodes([node]):  # subgraphs read the enclosing body's values by name
            if sub is not node:
                for index, value in enumerate(sub.input):
                    if needs_cast(value):
                        sub.input[index] = self._as_type(rewrite, value, mode)
        if held:
            self._hold(rewrite, node)
        elif mode != FLOAT:
            self._lower(node, rewrite.body, rewrite.declared, weights, mode, rewrite.taken, rewrite.out)
        else:
            rewrite.out.append(node)

    def _hold(self, rewrite: _Rewrite, node: onnx.NodeProto) -> None:
        """An op of index arithmetic, or one that reads or writes values past the target's range,
        in a converted body: it runs in float32 and its float results stay float32, read like
        float32 weights (a converted reader casts them where it reads them)."""
        weights, declared = rewrite.weights, rewrite.declared
        for index, value in enumerate(node.input):
            if value and (declared.get(value) == FLOAT or weights.get(value) == rewrite.mode) and weights.get(value) != FLOAT:
                node.input[index] = self._as_type(rewrite, value, FLOAT)
        rewrite.out.append(node)
        for index, value in enumerate(node.output):
            if not value or declared.get(value) != FLOAT:
                continue
            if value in rewrite.body_outputs:  # a function's results are in its dtype
                inner = unique_name(f"{value}_f32", rewrite.taken)
                node.output[index] = inner
                self.casts += 1
                rewrite.out.append(onnx.helper.make_node("Cast", [inner], [value], to=rewrite.mode, name=f"convert_cast_{self.casts}_{value}"))
                continue
            weights[value] = FLOAT
            rewrite.renamed_outputs.pop(value, None)  # a float32 graph output as it is

    def _cast_outputs(self, rewrite: _Rewrite) -> None:
        """The main graph's float32 outputs computed in the low dtype: renamed, cast back."""
        renamed = rewrite.renamed_outputs
        for node in rewrite.out:
            for index, value in enumerate(node.output):
                if value in renamed:
                    node.output[index] = renamed[value]
            for sub in all_nodes([node]):
                for index, value in enumerate(sub.input):
                    if value in renamed:
                        sub.input[index] = renamed[value]
        for original, inner in renamed.items():
            self.casts += 1
            rewrite.out.append(onnx.helper.make_node("Cast", [inner], [original], to=FLOAT, name=f"convert_cast_{self.casts}_{original}"))

    def _lower(self, node: onnx.NodeProto, body, declared: Mapping[str, int], weights, mode: int, taken: set[str], out: list) -> None:
        """One op of a converted body, in ``mode`` (or float32 between Casts for FLOAT32_OPS)."""
        for sub in all_nodes([node]):
            self._lower_attributes(sub, mode)
        if self._in_float32(node, mode):
            # a comparison's inputs share one type: one known float makes them all float (a value
            # computed here may have no declared type); a scatter's data, updates and output likewise
            shared = range(len(node.input)) if _compares(node) else (0, 2) if _accumulates(node) else ()
            floats = any(declared.get(v) == FLOAT or weights.get(v) in (FLOAT, mode) for i, v in enumerate(node.input) if i in shared)
            for index, value in enumerate(node.input):
                if value and (floats and index in shared or declared.get(value) == FLOAT or weights.get(value) == mode) and weights.get(value) != FLOAT:
                    node_cast, name = self._cast(body, value, FLOAT, taken)
                    out.append(node_cast)
                    node.input[index] = name
            out.append(node)
            for index, value in enumerate(node.output):
                if value and (declared.get(value) == FLOAT or floats and _accumulates(node)):
                    inner = unique_name(f"{value}_f32", taken)
                    node.output[index] = inner
                    self.casts += 1
                    out.append(onnx.helper.make_node("Cast", [inner], [value], to=mode, name=f"convert_cast_{self.casts}_{value}"))
            return
        out.append(node)

    def _in_float32(self, node: onnx.NodeProto, mode: int) -> bool:
        """An op of a converted body that runs in float32 between Casts."""
        return node.domain in ("", "ai.onnx") and (
            node.op_type in FLOAT32_OPS or _compares(node) or _accumulates(node) or not self._supports(node.op_type, mode))

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
        if node.op_type in _FLOAT_BY_DEFAULT and node.domain in ("", "ai.onnx") and not any(a.name == "dtype" for a in node.attribute):
            node.attribute.append(onnx.helper.make_attribute("dtype", FLOAT))  # made explicit, lowered below
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
                kind = value.type.sequence_type.elem_type if value.type.HasField("sequence_type") else value.type
                if kind.HasField("tensor_type") and kind.tensor_type.elem_type == FLOAT:  # a tensor, or a sequence of them
                    kind.tensor_type.elem_type = mode

        retype(body.value_info)
        for node in body.node:
            for sub in all_nodes([node]):
                for attribute in sub.attribute:
                    for graph in [attribute.g, *attribute.graphs] if attribute.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) else []:
                        retype([*graph.input, *graph.output, *graph.value_info])
                        for tensor in graph.initializer:
                            if tensor.data_type == FLOAT:
                                tensor.CopyFrom(_converted_tensor(tensor, mode))




def _compares(node: onnx.NodeProto) -> bool:
    return node.domain in ("", "ai.onnx") and node.op_type in COMPARE_OPS


def _accumulates(node: onnx.NodeProto) -> bool:
    """A scatter with a ``reduction`` (:data:`REDUCING_SCATTERS`)."""
    return node.op_type in REDUCING_SCATTERS and any(
        a.name == "reduction" and a.s not in (b"", b"none") for a in node.attribute)


def float32_values(body, declared: Mapping[str, int], functions: Container[FunctionId]) -> tuple[set[str], set[str]]:
    """The float values a converted ``body`` holds in float32, as (index arithmetic, past the range).

    *Index arithmetic*: the float values whose every reader reads them as a size, count or
    position (:func:`_index_use`: a comparison, a ``Cast`` to an integer or bool type,
    :data:`INDEX_INPUTS`), is index arithmetic itself, or reads only their shape (``Shape``,
    ``Size``: then another reader must be one of the others); a body's results are not. *Past the
    range*: the values marked :data:`RANGE_MARK`. The ops that make the first, and that read or
    make the second, run in float32 (:func:`_holds`).
    """
    values = [*body.value_info, *(body.input if isinstance(body, onnx.GraphProto) else ()), *(body.output if isinstance(body, onnx.GraphProto) else ())]
    wide = {v.name for v in values if any(p.key == RANGE_MARK for p in v.metadata_props)}
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = collections.defaultdict(list)
    for node in body.node:
        for index, value in enumerate(node.input):
            readers[value].append((node, index))
        for sub in all_nodes([node]):
            for value in sub.input if sub is not node else ():
                readers[value].append((node, -1))  # a subgraph's read: not an index use
    results = {v if isinstance(v, str) else v.name for v in body.output}
    held: set[str] = set()

    def for_indices(value: str) -> bool:
        """Every reader takes ``value`` as an index (or only its shape), and one does."""
        kinds = [_reads_shape(reader) or ("index" if index >= 0 and _index_use(reader, index) or any(o in held for o in reader.output) else "")
                 for reader, index in readers[value]]
        return value not in results and all(kinds) and "index" in kinds

    for node in reversed(body.node):  # readers before the values they read
        if not _may_hold(node, functions):
            continue
        floats = [v for v in node.output if v and declared.get(v) == FLOAT]
        if floats and all(for_indices(v) for v in floats):
            held.update(floats)
    return held, wide


def _reads_shape(node: onnx.NodeProto) -> str:
    """``"shape"`` when ``node`` reads only the shape of what it reads (its contents do not matter)."""
    return "shape" if node.domain in ("", "ai.onnx") and node.op_type in ("Shape", "Size") else ""


def _index_use(node: onnx.NodeProto, index: int) -> bool:
    """``node`` reads its input ``index`` as a size, count or position."""
    if node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type in COMPARE_OPS:
        return True
    if node.op_type == "Cast":
        return next((a.i for a in node.attribute if a.name == "to"), FLOAT) not in _FLOATS
    return index in INDEX_INPUTS.get(node.op_type, ())


def _may_hold(node: onnx.NodeProto, functions: Container[FunctionId]) -> bool:
    """An op (not a call, no subgraphs) that can run in float32 inside a converted body."""
    return (node.domain in ("", "ai.onnx") and node_id(node) not in functions
            and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute))


def _holds(node: onnx.NodeProto, held: set[str], wide: set[str], functions: Container[FunctionId]) -> bool:
    """``node`` runs in float32 in a converted body (see :func:`float32_values`)."""
    if not (held or wide) or not _may_hold(node, functions):
        return False
    return any(v in held for v in node.output) or any(v in wide for v in (*node.input, *node.output) if v)


def _reads_any(node: onnx.NodeProto) -> bool:
    return node.domain in ("", "ai.onnx") and node.op_type in _READS_ANY


def _float_constants(node: onnx.NodeProto) -> list[str]:
    """The outputs of a ``Constant`` or ``ConstantOfShape`` that makes float32 values."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("Constant", "ConstantOfShape") or not node.output:
        return []
    attribute = next(iter(node.attribute), None)
    if node.op_type == "ConstantOfShape" and attribute is None:
        return [node.output[0]]  # float32 zeros
    if attribute is None:
        return []
    if attribute.name in ("value_float", "value_floats") or attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == FLOAT:
        return [node.output[0]]
    return []


def _agreeing(low: set[str], sources: WeightSources, initializers: Mapping[str, onnx.TensorProto]) -> set[str]:
    """``low`` without the initializers that share a weight formal with a float32 one."""
    low = set(low)
    changed = True
    while changed:
        changed = False
        for formals in sources.values():
            for origins in formals.values():
                floats = {o for o in origins if initializers[o].data_type == FLOAT}
                if floats & low and floats - low:
                    low -= floats
                    changed = True
    return low
