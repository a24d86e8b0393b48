"""``optimize --quantize int8`` on an encoder (a file without a KV cache): dynamic int8 inside the bodies,
chosen per call by the error of the outputs.

The route Optimum users take on CPU is torch's flat export, onnxruntime's transformers optimizer, then
``quantize_dynamic`` (int8 weights, activations quantized at run time: ``DynamicQuantizeMatMul``).
``quantize_dynamic`` does not look inside local functions, so the fused modular file is quantized
by :mod:`onnx_modular.passes.precision.dynamic_int8` (the same kernels, per-column weight scales,
``Attention`` opened into one quantized GEMM + ``MultiHeadAttention``), and
:mod:`onnx_modular.files.optimize.encoder_guard` chooses per call between dynamic int8 and
weight-only int8 (the same weights, float compute), by the relative error of the outputs against
the float file on the inputs given (random inputs of the file's own shapes when none are).

For ``--quantize int4`` on an encoder, :func:`guard_int4` does the same choice between
``MatMulNBits`` at ``accuracy_level=4`` and 0 (a top-token guard does not fit: there are no tokens).

Entry: :func:`quantize_encoder` (called by :func:`onnx_modular.files.optimize.tool.optimize`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from onnx_modular.calls import targets as _calls
from onnx_modular.files.optimize import encoder_guard
from onnx_modular.format import metadata
from onnx_modular.passes.precision.dynamic_int8 import DynamicInt8, is_dynamic, quantize_dynamic_int8, to_weight_only
from onnx_modular.runtime import sessions as runtime
from onnx_modular.storage.locks import scratch_folder

__all__ = ["EncoderQuantization", "quantize_encoder", "quantize_encoder_file", "guard_int4", "inputs_only", "DEFAULT_TOLERANCE", "ENCODER_INT8_KEY", "DYNAMIC_INT8"]

#: The largest relative error ``||got - float|| / ||float||`` of an output allowed by default.
DEFAULT_TOLERANCE = 0.05
#: The file's record of the route (JSON: tolerance, safe calls, errors).
ENCODER_INT8_KEY = metadata.PREFIX + "encoder_int8"
#: Dynamic int8 against weight-only int8, node by node.
DYNAMIC_INT8 = encoder_guard.Toggle("dynamic int8", "weight-only int8", is_dynamic, to_weight_only)


@dataclasses.dataclass
class EncoderQuantization:
    """What :func:`quantize_encoder` did.

    Attributes:
        dynamic: The ``DynamicQuantizeMatMul`` made, in the (shared) bodies, as ``(call, node)``.
        opened: ``Attention`` nodes opened into a quantized GEMM + ``MultiHeadAttention``.
        norms: ``SkipLayerNormalization`` nodes opened into ``Sum`` + ``LayerNormalization`` (onnxruntime's
            CPU kernel is about 6x slower than the two).
        skipped: Weights left float, as ``(call, node, reason)``.
        guard: The per-call choice (:class:`~onnx_modular.files.optimize.encoder_guard.EncoderGuardReport`).
    """

    dynamic: list[tuple[str, str]]
    opened: list[tuple[str, str]]
    norms: list[tuple[str, str]]
    skipped: list[tuple[str, str, str]]
    guard: encoder_guard.EncoderGuardReport | None

    def text(self) -> str:
        lines = [f"Quantized (int8, encoder): {len(self.dynamic)} DynamicQuantizeMatMul in the bodies"
                 + (f" ({len(self.opened)} Attention opened into a quantized GEMM + MultiHeadAttention)" if self.opened else "")
                 + (f"; {len(self.norms)} SkipLayerNormalization as Sum + LayerNormalization (faster on CPU)" if self.norms else "")
                 + (f"; {len(self.skipped)} weights left float" if self.skipped else "")]
        lines += [f"  left float: {call} {node}: {why}" for call, node, why in self.skipped[:8]]
        if self.guard is not None:
            lines.append(self.guard.text())
        return "\n".join(lines)


def _reference(path: str, runs: Sequence[Mapping[str, np.ndarray]]) -> list[list[np.ndarray]]:
    """The float file's outputs on each run, in output order (the file as written: its weights are
    external, so a model past protobuf's 2 GB runs too)."""
    session = runtime.session(path, what="fused float file")
    return [runtime.run(session, dict(feeds), what="fused float file")[1] for feeds in runs]


def _label_of(model: onnx.ModelProto) -> dict:
    labels: dict = {}
    for call in _calls.module_calls(model).values():
        if call.function is not None:
            labels.setdefault(_calls.function_id(call.function), call.call_name)
    return labels


def _quantized_file(fused: str, folder, target: str) -> DynamicInt8:
    """``fused`` (a file in ``folder``) with dynamic int8 bodies, written to ``target`` in ``folder``."""
    import onnx_ir.passes.common as common_passes

    from onnx_modular.files.convert.build import lazy_weights

    proto = onnx.load(fused, load_external_data=False)
    labels = _label_of(proto)
    bodies = [(proto.graph, encoder_guard.MAIN_GRAPH)] + [(f, labels.get(_calls.function_id(f), f.name)) for f in proto.functions]
    done = quantize_dynamic_int8(proto, bodies, folder=str(folder))
    result = ir.serde.deserialize_model(proto)
    ir.external_data.set_base_dir(result.graph, str(folder))
    lazy_weights(result, done.sources, {})
    common_passes.RemoveUnusedNodesPass()(result)
    common_passes.RemoveUnusedFunctionsPass()(result)
    ir.save(result, target, external_data=pathlib.Path(target).name + ".data")
    return done


def quantize_encoder(model: ir.Model, write: Callable[[ir.Model], None], runs: Sequence[Mapping[str, np.ndarray]], *,
                     tolerance: float = DEFAULT_TOLERANCE, safe: Sequence[str] = (), guard: bool = True) -> EncoderQuantization:
    """Dynamic int8 for the fused encoder ``model`` (weights in memory), chosen per call; ``write`` the result.

    Args:
        model: The fused float file.
        write: Receives the final model, its weights in memory.
        runs: Inputs that fit the file (the guard's; the user's, or random of the file's own shapes).
        tolerance: The largest relative error of an output allowed with dynamic int8 calls.
        safe: Modules (call paths, classes, globs: ``calls.targets``) kept weight-only int8.
        guard: Choose per call by error (else every call dynamic but those of ``safe``).

    Raises:
        InvalidInputError: A module of ``safe`` is not in the file (the closest names listed).
    """
    with scratch_folder("optimize-int8") as folder:
        fused = str(folder / "fused.onnx")
        ir.save(model, fused, external_data="fused.onnx.data")
        reference = _reference(fused, runs) if guard else []
        quantized = str(folder / "int8.onnx")
        done = _quantized_file(fused, folder, quantized)
        proto = onnx.load(quantized, load_external_data=False)
        named = _covering(proto, [name for text in safe for name in _calls.resolve_target(proto, text).call_names])
        report = None
        if guard:
            report = encoder_guard.choose(proto, folder, DYNAMIC_INT8, runs, reference, tolerance=tolerance, safe_calls=named)
        elif named:
            encoder_guard.apply(proto, named, DYNAMIC_INT8)
        record = {"tolerance": tolerance, "weight_only": report.safe_calls if report else named,
                  "error": report.error if report else None}
        _calls.set_prop(proto, ENCODER_INT8_KEY, json.dumps(record))
        result = ir.serde.deserialize_model(proto)
        ir.external_data.set_base_dir(result.graph, str(folder))
        ir.external_data.load_to_model(result)
        write(result)
    return EncoderQuantization(done.quantized, done.opened, done.norms, done.skipped, report)


def _covering(model: onnx.ModelProto, names: Sequence[str]) -> list[str]:
    """The candidate calls at or under the named calls (a module named: every quantized call inside it)."""
    if not names:
        return []
    calls = _calls.module_calls(model)
    picked = []
    for name, call in calls.items():
        if call.function is None or not any(is_dynamic(n) for n in call.function.node):
            continue
        if any(name == n or name.startswith(n + ".") for n in names):
            picked.append(name)
    return picked


def _level_toggle() -> encoder_guard.Toggle:
    from onnx_modular.files.optimize.accuracy_guard import INT8_COMPUTE, SAFE_LEVEL, node_level, set_node_level

    def fast(node: onnx.NodeProto) -> bool:
        return node.op_type == "MatMulNBits" and node.domain == "com.microsoft" and node_level(node) == INT8_COMPUTE

    def make_safe(body, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        set_node_level([node], SAFE_LEVEL)
        return [node]

    return encoder_guard.Toggle(f"accuracy_level={INT8_COMPUTE}", f"accuracy_level={SAFE_LEVEL}", fast, make_safe)


def guard_int4(proto: onnx.ModelProto, folder, runs: Sequence[Mapping[str, np.ndarray]], *, tolerance: float = DEFAULT_TOLERANCE) -> encoder_guard.EncoderGuardReport:
    """``--quantize int4`` on an encoder: calls whose ``MatMulNBits`` int8 compute (level 4) moves the
    outputs past ``tolerance`` beyond the level-0 file are kept at level 0 (``proto`` changed in place)."""
    safe = onnx.ModelProto()
    safe.CopyFrom(proto)  # the level-0 file is the reference: the guard measures the int8 compute alone
    toggle = _level_toggle()
    for body in [safe.graph, *safe.functions]:
        for node in body.node:
            if toggle.fast(node):
                toggle.make_safe(body, node)
    session = runtime.session(safe.SerializeToString(), external_data_folder=folder, what="file at accuracy_level=0")
    reference = [runtime.run(session, dict(feeds), what="file at accuracy_level=0")[1] for feeds in runs]
    return encoder_guard.choose(proto, folder, toggle, runs, reference, tolerance=tolerance)


def quantize_encoder_file(model: ir.Model, recipe, write: Callable[[ir.Model], None], runs: Sequence[Mapping[str, np.ndarray]],
                          *, tolerance: float | None = None, weight_only: Sequence[str] = ()):
    """``optimize``'s quantization of an encoder: ``int8`` by :func:`quantize_encoder`; ``int4`` by the
    builder's recipe (:func:`~onnx_modular.files.optimize.quantize.quantize_fused`, its top-token guard
    off) with :func:`guard_int4` in its place. Returns the report of either.

    Raises:
        InvalidInputError: ``tolerance`` is not a positive number, or ``weight_only`` comes with int4.
    """
    from onnx_modular.errors import InvalidInputError
    from onnx_modular.files.optimize.quantize import quantize_fused

    tolerance = DEFAULT_TOLERANCE if tolerance is None else tolerance
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < float("inf"):
        raise InvalidInputError(f"optimize: int8_tolerance must be a positive number, not {tolerance!r}.",
                                hint="It bounds ||got - float|| / ||float|| of every output: 0.05 is 5%.")
    if recipe.quantize == "int8":
        return quantize_encoder(model, write, runs, tolerance=tolerance, safe=weight_only, guard=recipe.guard)
    if weight_only:
        raise InvalidInputError("optimize: weight_only chooses weight-only int8 calls: it needs quantize='int8'.",
                                hint="Use --quantize int8, or drop --int8-weight-only.")
    reports = []

    def guarded(result: ir.Model) -> None:
        if recipe.guard and recipe.accuracy_level == 4:
            proto = ir.to_proto(result)
            reports.append(guard_int4(proto, None, runs, tolerance=tolerance))
            result = ir.serde.deserialize_model(proto)
        write(result)

    done = quantize_fused(model, dataclasses.replace(recipe, guard=False), guarded, lambda *args: {})
    done.guard = reports[0] if reports else None
    return done


def inputs_only(model: ir.Model) -> onnx.ModelProto:
    """A ``ModelProto`` with ``model``'s graph inputs and nothing else: what the feed checks read
    (without serializing the weights)."""
    graph = onnx.helper.make_graph([], "inputs", [ir.serde.serialize_value(v) for v in model.graph.inputs], [])
    return onnx.helper.make_model(graph)
