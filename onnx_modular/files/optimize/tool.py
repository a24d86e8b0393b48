"""``optimize``: function bodies of a modular decoder or encoder file rewritten into onnxruntime's fused kernels.

The file stays modular: each fusion rewrites the shared body of a class (every call of it at
once), and the decoder-layer function is still one function called once per layer. The steps, in
order (passes in ``onnx_modular/passes/``):

1. RMS norm bodies -> ``SimplifiedLayerNormalization`` (:class:`~onnx_modular.passes.fusions.rms_norm.FuseRMSNormPass`);
2. residual ``Add`` + norm call -> ``com.microsoft.SkipSimplifiedLayerNormalization``
   (:class:`~onnx_modular.passes.fusions.skip_norm.FuseSkipNormPass`);
3. self-attention with a KV cache -> ``com.microsoft.GroupQueryAttention``
   (:class:`~onnx_modular.passes.fusions.gqa.FuseGroupQueryAttentionPass`);
4. residual ``Add`` + ``LayerNormalization`` call -> ``com.microsoft.SkipLayerNormalization``
   (the same pass, ``layer_norm=True``);
5. attention without a cache (encoders, cross-attention) -> ``com.microsoft.Attention`` (query,
   key and value projections of one input, packed, with biases) or ``MultiHeadAttention``
   (:class:`~onnx_modular.passes.fusions.mha.FuseMultiHeadAttentionPass`);
6. erf GELU and quick GELU bodies -> ``com.microsoft.Gelu`` / ``QuickGelu``
   (:class:`~onnx_modular.passes.fusions.activation.FuseActivationPass`);
7. mixture-of-experts blocks (router and experts) -> ``com.microsoft.MoE``
   (:class:`~onnx_modular.passes.fusions.moe.FuseMoEPass`; ``QMoE`` once quantized).

Each step is verified before it is kept: the file before and after the step runs in onnxruntime
on reference feeds (a prompt with an empty cache, then one decode step on the cache that prompt
made; for a file without a cache, random inputs at batch 2 and the same with the second row's
mask half padding), with every module call's outputs exposed (:func:`onnx_modular.calls.capture.call_outputs`),
and every call of a rewritten class must agree with the original file's call within the
tolerance, as must the file's outputs. A class whose calls drift is put back as it was and the
step is redone without it; the report says why.

Example::

    report = optimize("llama.onnx", "llama.opt.onnx")
    print(report.text())
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from onnx_modular.calls.capture import call_outputs
from onnx_modular.check.drift import measure
from onnx_modular.check.parity import Tolerance, default_tolerance
from onnx_modular.errors import InvalidInputError, InvalidModelFileError, SaveError, VerificationError
from onnx_modular.files.optimize import reference_runs
from onnx_modular.files.optimize.options import check_options, positions_of
from onnx_modular.files.optimize.report import Fusion, OptimizeReport
from onnx_modular.format import metadata
from onnx_modular.passes.fusions.activation import FuseActivationPass
from onnx_modular.passes.fusions.base import FusionPass
from onnx_modular.passes.fusions.gqa import SEQLENS_K, TOTAL_SEQUENCE_LENGTH, FuseGroupQueryAttentionPass
from onnx_modular.passes.fusions.mha import FuseMultiHeadAttentionPass
from onnx_modular.passes.fusions.moe import FuseMoEPass
from onnx_modular.passes.fusions.rms_norm import FuseRMSNormPass
from onnx_modular.passes.fusions.skip_norm import FuseSkipNormPass
from onnx_modular.runtime.generation import cache_key, is_state, past_axis
from onnx_modular.runtime.inputs import feeds_for
from onnx_modular.storage import save
from onnx_modular.storage.checks import check_expanded_size
from onnx_modular.storage.load import load_model_file

__all__ = ["optimize", "OptimizeReport", "Fusion"]

#: The fused op each step writes.
FUSED_OPS = {
    "rms_norm": "SimplifiedLayerNormalization",
    "skip_norm": "com.microsoft.SkipSimplifiedLayerNormalization",
    "attention": "com.microsoft.GroupQueryAttention",
    "skip_layer_norm": "com.microsoft.SkipLayerNormalization",
    "mha": "com.microsoft.MultiHeadAttention",
    "activation": "com.microsoft.Gelu",  # or QuickGelu: the pass says which (its ``ops``)
    "moe": "com.microsoft.MoE",
}

#: The attention steps (their ops make :attr:`OptimizeReport.attention`).
_ATTENTION_STEPS = ("attention", "mha")


def _class_of(function: ir.Function) -> str:
    return (metadata.props(function).get(metadata.CLASS) or function.name).rsplit(".", 1)[-1]


def _expanded_nodes(model: ir.Model) -> int:
    memo: dict = {}

    def count(body) -> int:
        total = 0
        for node in body:
            function = model.functions.get(node.op_identifier())
            if function is None:
                total += 1
            else:
                key = node.op_identifier()
                if key not in memo:
                    memo[key] = 0
                    memo[key] = count(function)
                total += memo[key]
        return total

    return count(model.graph)


def _copy(model: ir.Model) -> ir.Model:
    return ir.serde.deserialize_model(ir.serde.serialize_model(model))


# -- reference feeds -------------------------------------------------------------------------

def _cache_inputs(model: ir.Model) -> list[ir.Value]:
    """Keys and values (``[batch, heads, past, head]``), and the fixed-size states of recurrent or
    convolution layers (:func:`~onnx_modular.runtime.generation.is_state`)."""
    return [v for v in model.graph.inputs if v.dtype is not None and v.dtype.is_floating_point() and v.shape is not None
            and (is_state(v.name) or past_axis(v.shape) is not None
                 or (len(v.shape) == 4 and ("past" in v.name or "cache" in v.name)))]


def _grown_axis(value: ir.Value) -> int:
    """The axis a cache input grows on: its :func:`~onnx_modular.runtime.generation.past_axis`, else 2."""
    axis = past_axis(value.shape)
    return 2 if axis is None else axis


def _presents(model: ir.Model, outputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """The returned cache, in the order of :func:`_cache_inputs`: each input's output of the same
    :func:`~onnx_modular.runtime.generation.cache_key`, else the outputs after the logits in order."""
    caches = _cache_inputs(model)
    returned = {cache_key(v.name): v.name for v in model.graph.outputs}
    if all(cache_key(v.name) in returned for v in caches):
        return [outputs[returned[cache_key(v.name)]] for v in caches]
    return [outputs[v.name] for v in model.graph.outputs[1: 1 + len(caches)]]


def _encoder_runs(model: ir.Model) -> list[dict[str, np.ndarray]]:
    """A file without a cache (an encoder): random inputs at batch 2, sequence 7 (masks all ones,
    token ids below 10, token types 0), then the same with the second row's 2-D masks half padding."""
    from onnx_modular.runtime.inputs import random_inputs

    dims = {d: (2 if i == 0 else 7) for v in model.graph.inputs if v.shape is not None
            for i, d in enumerate(v.shape) if isinstance(d, ir.SymbolicDim) and d.value}
    feeds = random_inputs(ir.to_proto(model), dims=dims, default_dim=2, seed=0)
    for name, array in feeds.items():
        if "token_type" in name:
            feeds[name] = np.zeros_like(array)
    padded = {}
    for name, array in feeds.items():
        if "mask" in name and array.ndim == 2 and array.shape[0] > 1:
            array = array.copy()
            array[1, array.shape[1] // 2 + 1:] = 0
        padded[name] = array
    return [feeds, padded] if any(p is not feeds[n] for n, p in padded.items()) else [feeds]


def _vocab(model: ir.Model) -> int:
    for output in model.graph.outputs:
        if output.shape is not None and len(output.shape) == 3 and isinstance(output.shape[-1], int):
            return int(output.shape[-1])
    return 100


def _prompt_feeds(model: ir.Model, length: int, past: list[np.ndarray] | None, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    caches = _cache_inputs(model)
    grown = [index for index, value in enumerate(caches) if not is_state(value.name)]  # keys and values
    past_length = 0 if past is None or not grown else past[grown[0]].shape[_grown_axis(caches[grown[0]])]
    feeds: dict[str, np.ndarray] = {}
    for index, value in enumerate(caches):
        if past is not None:
            feeds[value.name] = past[index]
            continue
        dims = [d if isinstance(d, int) else 1 for d in value.shape]
        if not is_state(value.name):  # a state starts as zeros of its fixed sizes
            dims[_grown_axis(value)] = 0
        feeds[value.name] = np.zeros(dims, dtype=value.dtype.numpy())
    for value in model.graph.inputs:
        if value.name in feeds:
            continue
        dtype = value.dtype.numpy() if value.dtype is not None else np.int64
        if "mask" in value.name:
            feeds[value.name] = np.ones((1, past_length + length), dtype=dtype)
        elif "position" in value.name:
            feeds[value.name] = np.arange(past_length, past_length + length, dtype=dtype)[None]
        elif "input_ids" in value.name or (value.shape is not None and len(value.shape) == 2):
            feeds[value.name] = rng.integers(0, _vocab(model), (1, length)).astype(dtype)
        else:
            raise InvalidInputError(
                f"optimize: cannot make reference inputs for the input {value.name!r}.",
                hint="Use verify=False (--no-verify) to write the rewrite unchecked, or export with "
                "--task causal-lm-with-past.",
            )
    return feeds


def _run_calls(model: ir.Model, feeds, folder) -> tuple[dict, dict]:
    outputs, calls = call_outputs(model, feeds, external_data_folder=folder, what="the file being optimized")
    return outputs, {c.call_name: c for c in calls}


class _Reference:
    """The original file's outputs and call outputs on a prompt and on one decode step."""

    def __init__(self, model: ir.Model, folder: str | None, max_positions: int = 4096):
        self.folder = folder
        self.left = None  # a left-padded batch: measured on the final file, not a condition of the steps
        self.cuts: dict[int, tuple[int, int]] = {}  # run -> (length, padding) of a right-padded batch
        if not _cache_inputs(model):
            self.runs = [(feeds, *_run_calls(model, feeds, folder)) for feeds in _encoder_runs(model)]
            return
        prompt = _prompt_feeds(model, 6, None, 0)
        outputs, calls = _run_calls(model, prompt, folder)
        self.runs = [(prompt, outputs, calls)]
        caches = _cache_inputs(model)
        if caches:
            step = _prompt_feeds(model, 1, _presents(model, outputs), 1)
            outputs, calls = _run_calls(model, step, folder)
            self.runs.append((step, outputs, calls))
        ids = next((v.name for v in model.graph.inputs if "input_ids" in v.name), None)
        length = reference_runs.long_prompt_length(model, max_positions)  # past any window the bodies hold
        extra = [(_prompt_feeds(model, length, None, 3), None)] if length > 6 else []
        padded, pad = reference_runs.padded_batch(_prompt_feeds(model, 8, None, 4), ids, "right")
        extra.append((padded, (8, pad)))
        for feeds, cut in extra:
            try:
                self.runs.append((feeds, *_run_calls(model, feeds, folder)))
            except Exception:  # the file itself cannot run it (a batch fixed to 1): not a check
                continue
            if cut is not None:
                self.cuts[len(self.runs) - 1] = cut
        self.left = reference_runs.left_padded(lambda n: _prompt_feeds(model, n, None, 2), ids,
                                               lambda feeds: _run_calls(model, feeds, folder)[0])

    def left_padding_drift(self, candidate: ir.Model) -> float | None:
        """How far ``candidate``'s logits are from the original's on a left-padded batch (real tokens only)."""
        if self.left is None:
            return None
        feeds, expected, pad = self.left
        try:
            got = _run_calls(candidate, feeds, self.folder)[0]
        except Exception:
            return None
        return reference_runs.logits_drift(expected, got, pad)

    def compare(self, candidate: ir.Model, functions: Mapping[str, str], tolerance: Tolerance) -> tuple[dict, dict, str | None]:
        """Per function name: (max abs diff, calls compared), the drifted ones, and a failure of the file's outputs."""
        diffs: dict[str, list] = {name: [0.0, 0] for name in functions}
        drifted: dict[str, str] = {}
        failure = None
        for index, (feeds, outputs, calls) in enumerate(self.runs):
            real = functools.partial(reference_runs.real_tokens, cut=self.cuts.get(index))  # a padded row's real tokens
            try:
                new_outputs, new_calls = _run_calls(candidate, feeds, self.folder)
            except Exception as error:  # onnxruntime refuses the rewrite: every rewritten class is suspect
                text = str(error).splitlines()[0][:300]
                return diffs, dict.fromkeys(functions, f"onnxruntime cannot run the rewrite: {text}"), text
            for name, call in new_calls.items():
                if call.function not in functions or name not in calls:
                    continue
                entry = diffs[call.function]
                entry[1] += 1
                for got, expected in zip(call.outputs, calls[name].outputs):
                    if got is None or expected is None or got.dtype.kind != "f":
                        continue
                    got, expected = real(got), real(expected)
                    measured = measure(got, expected, tolerance)
                    entry[0] = max(entry[0], measured.max_abs)
                    if not measured.within():
                        drifted.setdefault(call.function, f"call {name} differs by {measured.max_abs:.2e} (tolerance "
                                                          f"atol {tolerance.atol:g}, rtol {tolerance.rtol:g})")
            for key, expected in outputs.items():
                got = new_outputs.get(key)
                if got is None or (expected.dtype.kind == "f" and not measure(real(got), real(expected), tolerance).within()):
                    failure = f"the file's output {key!r} differs"
        return {k: (v[0], v[1]) for k, v in diffs.items()}, drifted, failure


# -- the steps ---------------------------------------------------------------------------------

#: The file's record of what optimize fused (JSON: step -> function names).
OPTIMIZED_KEY = metadata.PREFIX + "optimized"

_STEPS: list[tuple[str, Callable[..., FusionPass]]] = [
    ("rms_norm", lambda allowed, max_positions: FuseRMSNormPass(functions=allowed)),
    ("skip_norm", lambda allowed, max_positions: FuseSkipNormPass(functions=allowed)),
    ("attention", lambda allowed, max_positions: FuseGroupQueryAttentionPass(max_positions, functions=allowed)),
    ("skip_layer_norm", lambda allowed, max_positions: FuseSkipNormPass(functions=allowed, layer_norm=True)),
    ("mha", lambda allowed, max_positions: FuseMultiHeadAttentionPass(functions=allowed)),
    ("activation", lambda allowed, max_positions: FuseActivationPass(functions=allowed)),
    ("moe", lambda allowed, max_positions: FuseMoEPass(functions=allowed)),
]


def _run_step(model, step, make_pass: Callable[..., FusionPass], reference, tolerance, max_positions) -> tuple[ir.Model, list[Fusion]]:
    allowed = None
    refused: list[Fusion] = []
    for _ in range(3):  # a drifting class is put back and the step redone without it
        candidate = _copy(model)
        fusion_pass = make_pass(allowed, max_positions)
        fusion_pass(candidate)
        reasons = fusion_pass.reasons
        records = [Fusion(step, key[1], _class_of(candidate.functions[key]), False, FUSED_OPS[step], reason)
                   for key, reason in reasons.items() if key in candidate.functions] if allowed is None else []
        refused += records
        keys = list(fusion_pass.fused)
        if not keys:
            return model, refused
        names = {key[1]: _class_of(candidate.functions[key]) for key in keys}
        ops = {key[1]: op for key, op in fusion_pass.ops.items()}
        if reference is None:
            return candidate, refused + [Fusion(step, n, c, True, ops.get(n) or FUSED_OPS[step]) for n, c in names.items()]
        diffs, drifted, failure = reference.compare(candidate, names, tolerance)
        if failure is not None and not drifted:
            drifted = dict.fromkeys(names, failure)
        if not drifted:
            packed = {key[1] for key in fusion_pass.packed}
            kept = [Fusion(step, n, c, True, ops.get(n) or FUSED_OPS[step], None, diffs[n][0], diffs[n][1], n in packed)
                    for n, c in names.items()]
            return candidate, refused + kept
        refused += [Fusion(step, n, names[n], False, FUSED_OPS[step], f"drifts past the tolerance: {why}",
                           diffs.get(n, (None, 0))[0], diffs.get(n, (None, 0))[1]) for n, why in drifted.items()]
        allowed = {key for key in keys if key[1] not in drifted}
        if not allowed:
            return model, refused
    return model, refused


def _load(path: str | os.PathLike) -> ir.Model:
    # the project's checks: not a model, malformed, recursive, huge; call bombs and endless Loops
    check_expanded_size(load_model_file(path), name=repr(str(path)))
    try:
        model = ir.load(path)
        # Weights in memory: each step works on a serialized copy, which would lose the folder its
        # external data is read from (and the checks run every weight in onnxruntime anyway).
        ir.external_data.load_to_model(model)
    except Exception as error:  # a file onnx can read but onnx_ir cannot
        raise InvalidModelFileError(f"onnx_ir cannot read {str(path)!r}: {error}") from error
    if not model.functions:
        raise InvalidInputError(
            f"{str(path)!r} has no local functions: optimize rewrites module bodies.",
            hint="Export the model with onnx-modular export (or rebuild the hierarchy with onnx-modular modularize).",
        )
    return model


def optimize(
    path: str | os.PathLike,
    output: str | os.PathLike,
    *,
    verify: bool = True,
    max_positions: int | None = None,
    tolerance: Tolerance | None = None,
    steps: tuple[str, ...] = ("rms_norm", "skip_norm", "attention", "skip_layer_norm", "mha", "activation", "moe"),
    quantize: str | None = None,
    accuracy_level: int | None = None,
    int8_lm_head: bool = False,
    accuracy_guard: bool = True,
    inputs: str | os.PathLike | Mapping[str, np.ndarray] | None = None,
    weight_only: Sequence[str] = (),
    int8_tolerance: float | None = None,
    calibration: str | os.PathLike | None = None,
    max_size: str | int | float | None = None,
) -> OptimizeReport:
    """Rewrite the bodies of ``path`` into onnxruntime's fused kernels and write ``output``.

    Args:
        path: A modular ONNX file (``onnx-modular export ... --task causal-lm-with-past``, or an encoder's).
        output: Where to write the optimized file (atomically; nothing is left on failure).
        verify: Check every step in onnxruntime on a prompt and a decode step (an encoder: random
            inputs, then with padding) and keep only the
            classes whose calls agree (within ``tolerance``; float32 defaults: atol 1e-4, rtol 1e-3).
        max_positions: Rows of the rotary cos/sin caches given to ``GroupQueryAttention``: the
            longest sequence (prompt plus generated tokens) the file will run. Default: the file's
            ``max_position_embeddings`` metadata when present, else 4096.
        steps: Which steps to run (``rms_norm``, ``skip_norm``, ``attention``, ``skip_layer_norm``, ``mha``,
            ``activation``, ``moe``).
        quantize: ``"int4"``: then quantize the fused file with onnxruntime-genai's builder recipe
            (``convert``'s passes: blocks of 32, symmetric, ``accuracy_level``, lm_head included;
            :mod:`onnx_modular.files.optimize.quantize`). ``"int8"`` likewise with 8 bits.
        accuracy_level: ``MatMulNBits``'s compute (4: int8 activations, the builder's, the default; 0: float);
            only with ``quantize`` (as ``accuracy_guard=False``).
        int8_lm_head: Quantize ``lm_head`` to int8 instead (the rest int4).
        accuracy_guard: At accuracy level 4, keep at level 0 the calls whose int8 compute flips a
            top token on a random prompt (:mod:`onnx_modular.files.optimize.accuracy_guard`; ``report.quantization.guard``).
            An encoder (no cache) takes its own route (:mod:`onnx_modular.files.optimize.encoder_int8`):
            ``int8`` is dynamic int8 (``DynamicQuantizeMatMul``) or weight-only int8, chosen per call by
            the relative error of the outputs against the float file; ``int4`` keeps at level 0 the
            calls whose int8 compute moves the outputs past ``int8_tolerance``.
        inputs: An encoder's inputs for that choice (an ``.npz`` file or arrays by name; default:
            random inputs of the file's own shapes, then with the masks half padding).
        weight_only: (encoder, ``int8``) modules kept weight-only int8 (call paths, classes, globs).
        int8_tolerance: (encoder) the largest relative error ``||got - float|| / ||float||`` of an
            output allowed (default 0.05).
        calibration: Token ids (an ``.npz`` with ``input_ids`` ``[n, seq]`` int64, or a ``.txt`` tokenized
            with the ``tokenizer.json`` beside ``path``): ``quantize="auto"`` chooses each call's precision
            on them (:mod:`onnx_modular.files.optimize.auto`); with ``"int4"``/``"int8"`` the file is
            measured on them (``report.quantization.quality``: KL, top-1, perplexity).
        max_size: ``quantize="auto"``'s size budget: bytes, or a ratio of the uniform int4 file (``"1.02x"``);
            default the uniform int4 file's size.

    Returns:
        An :class:`OptimizeReport` (``fused_classes``, ``attention``, ``added_inputs``, ``fusions``).

    Raises:
        InvalidInputError: The file has no functions, or reference inputs cannot be made.
        VerificationError: The optimized file fails its final check.
    """
    unknown = sorted(set(steps) - set(FUSED_OPS))
    if unknown:
        raise InvalidInputError(f"optimize: unknown steps {unknown}; the steps are {sorted(FUSED_OPS)}.")
    accuracy_level = check_options(max_positions=max_positions, quantize=quantize, accuracy_level=accuracy_level,
                                   accuracy_guard=accuracy_guard, int8_lm_head=int8_lm_head)
    recipe = None
    if (calibration is not None or max_size is not None) and quantize is None:
        raise InvalidInputError("optimize: calibration and max_size are for a quantized file: give quantize.",
                                hint="Add --quantize auto (or int4 to measure the builder's recipe on the calibration ids).")
    if quantize is not None or int8_lm_head:
        from onnx_modular.files.optimize.quantize import Recipe, check_recipe

        recipe = Recipe(quantize or "", accuracy_level=accuracy_level, int8_lm_head=int8_lm_head, guard=accuracy_guard,
                        calibration=None if calibration is None else str(calibration),
                        max_size=None if max_size is None else str(max_size))
        check_recipe(recipe)
    destination = save.check_destination(output, reads=[path, *([calibration] if calibration is not None else [])])
    model = _load(path)
    inputs, calibration_ids = _checked_for_model(model, path, recipe, calibration, inputs, weight_only, int8_tolerance)
    if max_positions is None:
        max_positions = positions_of(model, str(path))
    folder = str(pathlib.Path(path).resolve().parent)
    tolerance = tolerance or default_tolerance("float32")
    reference = _Reference(model, folder, max_positions) if verify else None
    nodes_before = _expanded_nodes(model)
    fusions: list[Fusion] = []
    for step, make_pass in _STEPS:
        if step in steps:
            model, records = _run_step(model, step, make_pass, reference, tolerance, max_positions)
            fusions += records
    taken = {f.function for f in fusions if f.fused and f.step == "mha"}  # the cache-less attention GQA refused
    fusions = [f for f in fusions if not (f.step == "attention" and not f.fused and f.function in taken)]
    if reference is not None and any(f.fused for f in fusions):
        _, drifted, failure = reference.compare(model, {}, tolerance)
        if failure is not None:
            raise VerificationError(f"optimize: the optimized file of {str(path)!r} fails its final check: {failure}.")
    attention_fused = [f for f in fusions if f.step in _ATTENTION_STEPS]
    attention = "+".join(sorted({f.op.rsplit(".", 1)[-1] for f in attention_fused})) \
        if attention_fused and all(f.fused for f in attention_fused) else None
    added = [name for name in ("cos_cache", "sin_cache", "rotary_position_ids", SEQLENS_K, TOTAL_SEQUENCE_LENGTH)
             if any(v.name == name for f in model.functions.values() for v in f.inputs)]
    model.metadata_props[OPTIMIZED_KEY] = json.dumps(
        {step: sorted(f.function for f in fusions if f.fused and f.step == step) for step in steps}
    )
    report = OptimizeReport(str(path), str(destination), fusions, attention, added, verify,
                            nodes_before, _expanded_nodes(model))
    if reference is not None and any(f.fused for f in fusions):
        drift = reference.left_padding_drift(model)
        report.left_padding = drift if drift is not None and drift > tolerance.atol else None
    if recipe is None:
        _write(model, destination)
    elif not _cache_inputs(model):  # an encoder: errors of its outputs, not top tokens
        from onnx_modular.files.optimize.encoder_int8 import quantize_encoder_file

        runs = _encoder_runs(model) if inputs is None else [inputs]
        report.quantization = quantize_encoder_file(model, recipe, lambda result: _write(result, destination), runs,
                                                    tolerance=int8_tolerance, weight_only=weight_only)
    else:
        from onnx_modular.files.optimize.quantize import quantize_fused

        # the guard's reference inputs: the ones the steps were verified on (the graph's inputs do not change)
        report.quantization = quantize_fused(model, recipe, lambda result: _write(result, destination),
                                             lambda length, past, seed: _prompt_feeds(model, length, past, seed),
                                             calibration_ids=calibration_ids, destination=destination)
    return report


def _checked_for_model(model: ir.Model, path, recipe, calibration, inputs, weight_only, int8_tolerance):
    """The options that depend on the file, checked before any work: an encoder's (``inputs``,
    ``weight_only``, ``int8_tolerance``) and a decoder's (``quantize="auto"``, ``calibration``).
    Returns the encoder's feeds and the calibration ids (``None`` when not given)."""
    if recipe is not None and (recipe.quantize == "auto" or calibration is not None) and not _cache_inputs(model):
        raise InvalidInputError("optimize: quantize='auto' and calibration measure next-token KL on token ids: they need "
                                "a decoder with a cache, and this file has none (an encoder).",
                                hint="For an encoder use --quantize int8 (dynamic int8, chosen per call by the outputs' "
                                "error), with --inputs for real inputs.")
    if (weight_only or int8_tolerance is not None or inputs is not None) and (recipe is None or _cache_inputs(model)):
        raise InvalidInputError("optimize: inputs, weight_only and int8_tolerance choose how an encoder (a file without "
                                "a cache) is quantized: " + ("quantize is not given." if recipe is None else "this file has a cache."),
                                hint="Add --quantize int8 for an encoder; drop them for a decoder.")
    if inputs is not None:  # checked before any work (the steps do not change the graph's inputs)
        from onnx_modular.files.optimize.encoder_int8 import inputs_only

        inputs = feeds_for(inputs_only(model), inputs)
    calibration_ids = None
    if calibration is not None:
        from onnx_modular.check.quality import load_ids

        calibration_ids = load_ids(calibration, vocab=_vocab(model), beside=path)
    return inputs, calibration_ids


def _write(model: ir.Model, destination: pathlib.Path) -> None:
    """Atomically, functions callee-first; then loaded once in onnxruntime. Not through onnx's checker:
    it knows no ``SimplifiedLayerNormalization``, which onnxruntime registers in the ONNX domain."""
    from onnx_modular.passes.function_order import SortFunctionsPass
    from onnx_modular.runtime import sessions

    SortFunctionsPass()(model)
    with save.atomic_write(destination) as staging:
        external = save.wants_external_data(model, None)
        try:
            ir.save(model, staging.model_path, external_data=staging.data_location if external else None)
        except OSError as error:
            raise SaveError(f"Writing {str(destination)!r} failed: {error}", hint="Check free disk space and permissions.") from error
        sessions.session(str(staging.model_path), what="the optimized file")


