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
module call's outputs captured a batch at a time (:func:`onnx_modular.calls.capture.paired_calls`), and saved
atomically. The :class:`Conversion` report gives the drift of every call and class.

Where the parts live: the precision change is :mod:`onnx_modular.passes.precision.casts`, the weight
quantization :mod:`onnx_modular.passes.precision.quantize_weights`; the plans and the converted model of a
plan :mod:`.convert_build`, the report :mod:`.convert_report`, the checks that the converted file
runs :mod:`.convert_verify`, flat files :mod:`.convert_flat`. This module is the tool: it
checks the request, chooses the calls to keep (``keep``, ``auto_keep``) and verifies the result.
"""

from __future__ import annotations

import collections
import math
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from onnx_modular.calls import targets as _calls
from onnx_modular.calls.capture import PROBE_BUDGET, Instrumented, paired_calls
from onnx_modular.errors import InvalidInputError, InvalidModelFileError, RuntimeCrashError, VerificationError
from onnx_modular.files.convert.build import BuildFacts, build, class_of, selected, under
from onnx_modular.files.convert.flat import convert_flat, node_modules
from onnx_modular.files.convert.ranges import mark as mark_ranges
from onnx_modular.files.convert.ranges import measure as measure_ranges
from onnx_modular.files.convert.ranges import wide_functions
from onnx_modular.files.convert.report import (
    CallDrift,
    ClassDrift,
    Conversion,
    QuantizationWarning,
    call_drift,
    class_drifts,
    output_drifts,
    warn_left,
)
from onnx_modular.files.convert.select import Selection, flipped, run_with_selections
from onnx_modular.files.convert.verify import (
    crash_culprit,
    culprit,
    folder_bytes,
    not_running,
    refuse_overflow,
    runnable,
    source_bytes,
)
from onnx_modular.format import metadata
from onnx_modular.passes.precision.casts import DTYPES, FLOAT32_OPS
from onnx_modular.passes.precision.quantize_weights import QUANTIZE_BITS, QuantizeSettings
from onnx_modular.runtime import sessions as runtime
from onnx_modular.runtime.inputs import feeds_for
from onnx_modular.storage import save
from onnx_modular.storage.checks import check_expanded_size
from onnx_modular.storage.proto import declare_function_types, function_id, uses_external_data

__all__ = ["convert", "Conversion", "QuantizationWarning", "CallDrift", "ClassDrift", "FLOAT32_OPS", "DTYPES", "QUANTIZE_BITS"]


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
            output's drift (max abs difference over its range) is at most this. First, the calls
            feeding a selection the conversion flips (``TopK``/``ArgMax``/``ArgMin``, in the main
            graph or in a module's body, :mod:`.convert_select`), nearest first. With ``quantize``
            alone, calls are left unquantized with everything they call: those, then *roles*
            (the calls a class makes under one attribute, ``LlamaMLP.down_proj`` in every layer),
            the one that moves the outputs most when quantized alone first.
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
    _check_request(dtype=dtype, keep=keep, quantize=quantize, exclude=exclude, auto_keep=auto_keep,
                   block_size=block_size, verify=verify)
    destination = save.check_destination(output, reads=[path, *([inputs] if isinstance(inputs, (str, os.PathLike)) else [])])
    source = pathlib.Path(path)
    model = _load(source, dtype)
    check_expanded_size(model, name=repr(str(source)))  # call bombs and endless Loops, before any work
    declare_function_types(model)  # a function that declares no types gets its call's (Casts at the seams)
    if not model.functions:  # a flat file: quantization by the nodes' module metadata
        return convert_flat(source, destination, model, quantize=quantize, exclude=exclude, block_size=block_size,
                            symmetric=symmetric, accuracy_level=accuracy_level, inputs=inputs, seed=seed)
    job = _Job(source, model, dtype=dtype, keep=keep, quantize=quantize, exclude=exclude,
               settings=QuantizeSettings(QUANTIZE_BITS[quantize], block_size, symmetric, accuracy_level) if quantize else None)
    if verify:
        job.run_original(inputs, seed)
        job.keep_ranges()
    own, auto_kept = job.auto_keep(auto_keep) if auto_keep is not None else (set(), [])
    kept = job.kept_below() | (own if dtype else set()) | set(job.range_kept)  # quantize alone: auto_keep leaves calls unquantized
    job.excluded_calls |= set() if dtype else own
    result, facts = job.build(own, {"auto_kept": [n for n, _ in auto_kept]} if auto_keep is not None else None)
    # onnx has no schema for MatMulNBits: no strict type inference; onnxruntime opens and runs it below
    actual: dict[str, np.ndarray] = {}
    drifts: list[CallDrift] = []
    # a source with external data gives one with external data: tensors left as they are stay
    # references into the source's data (a `--generation` decode.onnx reads prefill.onnx.data), which
    # an inline save cannot keep; writing them to the output's own data file can
    external = True if job.folder else None
    with save.staged_save(result, destination, external_data=external, full_check=quantize is None) as staged:
        if verify:
            actual, drifts = job.run_converted(staged, kept, facts)
            refuse_overflow(dtype, actual, job.reference, job.first_overflow,
                            {name: class_of(call) for name, call in job.all_calls.items()})
        output_bytes = folder_bytes(staged.parent)
    warn_left(quantize, facts.quantized, facts.skipped)
    return Conversion(
        source=str(source), output=str(destination), dtype=dtype, quantize=quantize, block_size=block_size,
        kept=[name for name in job.all_calls if name in kept], auto_kept=auto_kept, tolerance=auto_keep,
        range_kept=list(job.range_kept.items()), range_values=job.range_values,
        excluded=[name for name in job.all_calls if name in job.excluded_calls],
        quantized=facts.quantized, skipped=facts.skipped, weights=facts.weights, float32_weights=facts.float32_weights,
        casts=facts.casts, split=facts.split, outputs=output_drifts(actual, job.reference), calls=drifts,
        classes=class_drifts(drifts), source_bytes=source_bytes(source, model), output_bytes=output_bytes,
        selections=job.selections, flipped_before=job.first_selections,
    )


def _check_request(*, dtype: str | None, keep: Sequence[str], quantize: str | None, exclude: Sequence[str],
                   auto_keep: float | None, block_size: int, verify: bool) -> None:
    """The arguments of :func:`convert` make sense together, or a typed error says what to change."""
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
    if auto_keep is not None and not (isinstance(auto_keep, (int, float)) and not isinstance(auto_keep, bool) and auto_keep > 0):
        raise InvalidInputError(f"auto_keep must be a tolerance > 0, not {auto_keep!r}.", hint="--dtype float16 --auto-keep 0.02")
    if isinstance(block_size, bool) or block_size not in (16, 32, 64, 128, 256):  # onnxruntime's MLAS quantizes these only
        raise InvalidInputError(f"block_size must be 16, 32, 64, 128 or 256 (MatMulNBits), not {block_size!r}.")
    if auto_keep is not None and not verify:
        raise InvalidInputError("auto_keep ranks modules by the drift it measures: it needs verify.", hint="Drop --no-verify.")


class _Job:
    """One conversion of a modular file: which calls keep or exclude, trial builds for
    ``auto_keep``, the runs of the original and the converted file, the drift of every call."""

    def __init__(self, source: pathlib.Path, model: onnx.ModelProto, *, dtype: str | None, keep: Sequence[str],
                 quantize: str | None, exclude: Sequence[str], settings: QuantizeSettings | None):
        self.source = source
        self.model = model
        self.dtype = dtype
        self.quantize = quantize
        self.settings = settings
        self.folder = runtime.external_data_folder(source, model)
        self.kept_calls = selected(model, keep)
        self.excluded_calls = selected(model, exclude)
        self.target = DTYPES.get(dtype) if dtype else None
        self.all_calls = _calls.module_calls(model)
        self.class_calls: dict[str, set[str]] = collections.defaultdict(set)
        for call in self.all_calls.values():
            self.class_calls[class_of(call)].add(call.call_name)
        self.range_kept: dict[str, float] = {}  # call -> the magnitude past float16's range at its inputs or outputs
        self.range_values = 0  # values marked past float16's range (their ops stay float32)
        self.feeds: dict[str, np.ndarray] = {}
        self.reference: dict[str, np.ndarray] = {}
        self.original: Instrumented | None = None
        self.reference_selections: dict[str, np.ndarray] = {}
        self.selections: list[Selection] = []  # the selections the conversion flips (convert_select)
        self.trial_selections: list[Selection] = []
        self.first_selections: list[Selection] = []  # those auto_keep's first trial flipped
        self.crashed = False  # onnxruntime crashed on a trial conversion (worst_drift)
        self.first_overflow: str | None = None  # the first call whose converted outputs overflow (run_converted)

    def run_original(self, inputs, seed: int) -> None:
        """The original's outputs and every call's outputs on the inputs (random ones when ``None``)."""
        self.feeds = feeds_for(self.model, inputs, seed=seed)
        # every call's outputs are run later, a batch at a time beside the converted file's (paired_calls)
        self.original = Instrumented(self.model, self.feeds, external_data_folder=self.folder, what="original model")
        self.reference, self.reference_selections = run_with_selections(self.model, self.feeds, folder=self.folder,
                                                                        what="original model")

    def keep_ranges(self) -> None:
        """float16: mark the values past its finite range (the precision pass runs their ops in
        float32) and keep the calls whose inputs or outputs are past it (:mod:`.convert_ranges`)."""
        if self.target != DTYPES["float16"]:
            return  # bfloat16 has float32's range
        ranges = measure_ranges(self.model, self.feeds, external_data_folder=self.folder)
        limit = float(np.finfo(np.float16).max)
        self.range_values = mark_ranges(self.model, ranges, limit)
        wide = wide_functions(self.model, ranges, limit)
        self.range_kept = {c.call_name: wide[function_id(c.function)] for c in self.all_calls.values() if function_id(c.function) in wide}

    def kept_below(self) -> set[str]:
        """The calls ``keep`` keeps: the chosen calls and everything they call."""
        return {c.call_name for c in self.all_calls.values() if under(c, self.kept_calls)}

    def build(self, own: set[str], note_extra: Mapping[str, Any] | None = None):
        """``keep`` keeps calls with everything they call; ``auto_keep`` keeps a class's own calls (``own``)."""
        own = own | set(self.range_kept)
        kept = self.kept_calls | own
        settings = self.settings
        note = {"source": self.source.name, "dtype": self.dtype, "kept": sorted(kept), "quantize": self.quantize,
                "bits": settings.bits if settings else None, "block_size": settings.block_size if settings else None,
                "excluded": sorted(self.excluded_calls)}
        if self.range_kept:
            note["range_kept"] = sorted(self.range_kept)
        note.update(note_extra or {})
        unquantized = self.excluded_calls | (set() if self.dtype else own)  # quantize alone: auto_keep's calls
        return build(
            self.model, self.folder, dtype=self.target,
            low_calls=lambda call: not under(call, self.kept_calls) and call.call_name not in own, root_low=True,
            quant=lambda call: not under(call, unquantized), root_quant=True, quantize=settings, note=note,
        )

    def output_drift(self, result) -> dict[str, tuple[float, float]]:
        import onnx_ir as ir

        with runtime.scratch_file(None) as scratch:
            ir.save(result, scratch, external_data=scratch.name + ".data")
            runtime.opens_in_child(scratch, what="trial conversion")  # onnxruntime may crash on it (worst_drift: inf)
            outputs, selections = run_with_selections(onnx.load(str(scratch), load_external_data=False), self.feeds,
                                                      folder=str(scratch.parent), what="trial conversion")
        self.trial_selections = flipped(self.model, self.reference_selections, selections)
        return output_drifts(outputs, self.reference)

    def worst_drift(self, result) -> float:
        """The worst output drift of a trial conversion (inf: onnxruntime does not run it)."""
        try:
            return max((d for _, d in self.output_drift(result).values()), default=0.0)
        except RuntimeCrashError:
            self.crashed = True
            return math.inf
        except VerificationError:
            return math.inf

    def opens_keeping(self, kept: set[str]) -> Callable[[set[str]], bool]:
        """Whether onnxruntime opens (and runs) the conversion that also keeps ``names`` in float32."""
        return lambda names: self.worst_drift(self.build(kept | names)[0]) < math.inf

    def alone(self, names: set[str]) -> float:
        """The worst output drift when only the calls ``names`` are converted."""
        others = set(self.all_calls) - (names - set(self.range_kept))
        return self.worst_drift(build(
            self.model, self.folder, dtype=self.target, low_calls=lambda call, o=others: call.call_name not in o, root_low=False,
            quant=lambda call: False, root_quant=False, quantize=None, note={})[0])

    def auto_keep(self, tolerance: float) -> tuple[set[str], list[tuple[str, float]]]:
        """Keep classes in float32 (roles unquantized, for quantization alone), the most harmful alone
        first, until the outputs drift at most ``tolerance``; first the calls that feed a selection
        the conversion flips."""
        own: set[str] = set()
        auto_kept: list[tuple[str, float]] = []
        worst = self.worst_drift(self.build(own)[0])
        self.first_selections = list(self.trial_selections)
        feeding = list(dict.fromkeys(c for s in self.trial_selections for c in s.feeding))
        for name in feeding:  # nearest first: a selection's scores moved by a call's small drift
            if worst <= tolerance:
                return own, auto_kept
            own |= {name} if self.dtype is None else {c for c in self.all_calls if c == name or c.startswith(name + ".")}
            worst = self.worst_drift(self.build(own)[0])
            auto_kept.append((name, worst))
        if worst <= tolerance:
            return own, auto_kept
        if self.dtype is None:
            return self.unquantize_roles(tolerance, own, auto_kept)
        kept_below = self.kept_below()
        crash = crash_culprit(self.all_calls, self.class_calls, kept_below | own, self.opens_keeping(own)) if self.crashed and worst == math.inf else None
        if crash is not None:  # onnxruntime crashes on the file: the class whose calls kept let it open, first
            own |= self.class_calls[crash[0]]
            auto_kept.append((crash[0], crash[2]))
            if self.worst_drift(self.build(own)[0]) <= tolerance:
                return own, auto_kept
        candidates = [name for name, names in self.class_calls.items() if not names <= kept_below | own]
        alone_drift = {name: self.alone(self.class_calls[name]) for name in candidates}  # each class converted alone
        for name in sorted(candidates, key=lambda n: -alone_drift[n]):
            own |= self.class_calls[name]
            auto_kept.append((name, alone_drift[name]))
            if self.worst_drift(self.build(own)[0]) <= tolerance:
                break
        return own, auto_kept

    def quantized_roles(self) -> dict[str, set[str]]:
        """The calls whose own body has a MatMul or Gemm, by role: the caller's class and the call's
        attribute (``LlamaMLP.down_proj``: every layer's; ``MoeBlock.experts[]``: every expert), a
        call of the main graph by its name."""
        roles: dict[str, set[str]] = collections.defaultdict(set)
        for name, call in self.all_calls.items():
            if call.function is None or not any(n.op_type in ("MatMul", "Gemm") and n.domain in ("", "ai.onnx") for n in call.function.node):
                continue
            parts = metadata.split_call_name(name)[0].split(".")
            attribute = f"{parts[-2]}[]" if parts[-1].isdigit() and len(parts) > 1 else parts[-1]
            roles[f"{class_of(call.caller)}.{attribute}" if call.caller is not None else ".".join(parts)].add(name)
        return roles

    def unquantize_roles(self, tolerance: float, own: set[str], auto_kept: list[tuple[str, float]]):
        """``quantize`` alone, past the selections: leave roles unquantized (:meth:`quantized_roles`),
        the one that moves the outputs most when quantized alone first, until within ``tolerance``."""
        roles = {role: names - own for role, names in self.quantized_roles().items() if names - own}
        alone = {role: self.worst_drift(build(
            self.model, self.folder, dtype=None, low_calls=lambda call: False, root_low=False,
            quant=lambda call, n=names: call.call_name in n and not under(call, self.excluded_calls), root_quant=False,
            quantize=self.settings, note={})[0]) for role, names in roles.items()}
        for role in sorted(roles, key=lambda r: -alone[r]):
            if alone[role] == 0:
                break  # quantized alone, it moves nothing
            own |= roles[role]
            auto_kept.append((role, alone[role]))
            if self.worst_drift(self.build(own)[0]) <= tolerance:
                break
        return own, auto_kept

    def run_converted(self, staged: pathlib.Path, kept: set[str], facts: BuildFacts) -> tuple[dict[str, np.ndarray], list[CallDrift]]:
        """The staged file's outputs on the same inputs, and the drift of every call of the original
        that it also runs, in execution order (both files' call outputs a batch at a time)."""
        try:
            runnable(staged, self.dtype, self.quantize)
        except RuntimeCrashError as e:
            if self.dtype is None:
                raise
            opens = self.opens_keeping(kept)
            raise not_running(e, self.dtype, crash_culprit(self.all_calls, self.class_calls, kept, opens)) from e
        staged_model = onnx.load(str(staged), load_external_data=False)
        staged_folder = str(staged.parent) if uses_external_data(staged_model) else None
        # the outputs from the file as users run it (capturing every call can change onnxruntime's fusions)
        try:
            outputs, selections = run_with_selections(staged_model, self.feeds, folder=staged_folder, what="converted model")
        except VerificationError as e:
            if self.dtype is None:
                raise
            raise not_running(e, self.dtype, culprit(self.all_calls, self.class_calls, kept, self.alone)) from e
        self.selections = flipped(self.model, self.reference_selections, selections)
        assert self.original is not None
        drifts = []
        try:
            converted = Instrumented(staged_model, self.feeds, external_data_folder=staged_folder, what="converted model")
            for call, other in paired_calls(self.original, converted, PROBE_BUDGET,
                                            select=lambda x, _: x.call_name in self.all_calls):
                plan = facts.plan_of(call.call_name)
                drifts.append(call_drift(call.call_name, class_of(self.all_calls[call.call_name]), plan.low, plan.quantize,
                                         other.outputs, call.outputs))
                if self.first_overflow is None and drifts[-1].overflow:
                    self.first_overflow = call.call_name  # in finishing order: refuse_overflow names it
        except VerificationError as e:
            if "converted model" not in str(e):
                raise
            raise VerificationError(f"The converted model does not run in onnxruntime: {str(e).splitlines()[0][:300]}") from e
        return outputs, drifts


def _load(path: str | os.PathLike, dtype: str | None) -> onnx.ModelProto:
    """The file, checked; a file without functions only for ``quantize``, by its nodes' module metadata."""
    from onnx_modular.storage.load import load_model_file

    model = load_model_file(path)  # checked; external data stays external
    if not model.functions:
        if not node_modules(model):
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

