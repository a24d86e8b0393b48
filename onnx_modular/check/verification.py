"""Verification: onnxruntime (modular and flat) against PyTorch, on a file or an export.

Output parity of a whole file: :func:`onnx_modular.check.parity.check_file` runs the file
and its inlined flat copy (sessions from :mod:`onnx_modular.runtime.sessions`) and builds the
:class:`~onnx_modular.check.parity.ParityReport`; this module adds the PyTorch side (reference
outputs) and :func:`verify`, the standalone check of a saved file, which also localizes per
module (:mod:`onnx_modular.check.localization`). Block by block is :mod:`onnx_modular.check.blockwise`. torch is imported only when a PyTorch model or tensors are involved, so
``verify(path)`` without a model works where torch cannot be imported.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_modular.capture.tensors import (
    copy_inputs,
    flatten_inputs,
    normalize_inputs,
    to_numpy,
    torch_outputs,
    with_fixed,
)
from onnx_modular.check.parity import (
    OutputParity,
    ParityReport,
    Tolerance,
    allclose,
    check_file,
    compare_outputs,
    default_tolerance,
    fit_name,
    max_differences,
    name_column_width,
    user_tolerance,
)
from onnx_modular.errors import ParityError
from onnx_modular.format.text import first_line
from onnx_modular.runtime import inputs as file_inputs
from onnx_modular.storage.load import load_model_file

if TYPE_CHECKING:
    import torch

__all__ = [
    "Tolerance",
    "default_tolerance",
    "tolerance",
    "OutputParity",
    "ParityReport",
    "VerificationReport",
    "max_differences",
    "allclose",
    "fit_name",
    "name_column_width",
    "compare_outputs",
    "verify_file",
    "uses_bfloat16",
    "float32_reference",
    "verify_bfloat16",
    "verify",
    "assert_parity",
    "add_program_differences",
]


#: The user's tolerance or ``None`` for the per-dtype defaults (:func:`~onnx_modular.check.parity.user_tolerance`).
tolerance = user_tolerance


def verify_file(
    path: str | os.PathLike,
    inputs: Sequence[Any],
    expected: Sequence[Any],
    *,
    flat: bool = True,
    tolerance: Tolerance | None = None,
    execution_provider: str | None = None,
) -> ParityReport:
    """Run ``path`` (and its inlined copy) in onnxruntime on ``inputs``; compare with PyTorch's ``expected``."""
    return check_file(
        path,
        [to_numpy(t) for t in inputs],
        expected=[to_numpy(t) for t in expected],
        reference_name="PyTorch",
        flat=flat,
        tolerance=tolerance,
        execution_provider=execution_provider,
    )


def uses_bfloat16(model: Any) -> bool:
    """Whether an ``onnx_ir.Model`` has bfloat16 weights, inputs or outputs."""
    import onnx_ir as ir

    graph = model.graph
    values = [*graph.inputs, *graph.outputs, *graph.initializers.values()]
    return any(getattr(v.type, "dtype", None) == ir.DataType.BFLOAT16 for v in values)


def float32_reference(
    model: torch.nn.Module, args: tuple, kwargs: dict, fixed: Mapping[str, Any] | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(inputs, outputs)`` of ``model`` run in float32 on its bfloat16-rounded weights (every
    bfloat16 value is a float32 value), on the inputs widened alike. ``fixed``: the export's
    ``fixed_inputs``, given to the model and not among the file's inputs.

    The model's own bfloat16 tensors are widened for the run and given back after it (the same
    tensor objects: a copy of the model would not do, as exporters patch ``forward`` on the
    instance).
    """
    import itertools

    import torch

    widen = lambda value: value.float() if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 else value
    args32, kwargs32 = torch.utils._pytree.tree_map(widen, copy_inputs(args, kwargs))
    saved = [(t, t.data) for t in itertools.chain(model.parameters(), model.buffers()) if t.dtype == torch.bfloat16]
    try:
        for tensor, data in saved:
            tensor.data = data.float()
        feed, run = with_fixed(kwargs32, fixed or {})
        return flatten_inputs(args32, feed), torch_outputs(model, args32, run)
    finally:
        for tensor, data in saved:
            tensor.data = data


def verify_bfloat16(
    path: str | os.PathLike,
    inputs: Sequence[Any],
    expected: Sequence[Any],
    *,
    flat: bool = True,
    tolerance: Tolerance | None = None,
    execution_provider: str | None = None,
) -> ParityReport:
    """Check a bfloat16 file where onnxruntime has no bfloat16 kernels (its CPU provider).

    The file is widened to float32 (:class:`~onnx_modular.check.widen.WidenFloatPass`: weights,
    constants, inputs, outputs and casts; exact, as every bfloat16 value is a float32 value) and
    run in onnxruntime on ``inputs`` against ``expected``, PyTorch's outputs in float32 on the same
    bfloat16-rounded weights (:func:`float32_reference`), with float32 tolerances. The report's
    ``note`` says so, and whether onnxruntime loads the bfloat16 file itself.
    """
    import onnx_ir as ir

    from onnx_modular.check.widen import WidenFloatPass
    from onnx_modular.runtime import sessions as runtime
    from onnx_modular.storage.scratch import scratch_model_file

    if tolerance is None:
        tolerance = widened_tolerance(expected)
    try:
        runtime.session(path, execution_provider)
        loads = "onnxruntime loads the bfloat16 file"
    except Exception as e:  # onnxruntime's CPU provider: no bfloat16 MatMul, Add, ...
        loads = f"onnxruntime does not load the bfloat16 file ({first_line(e)[:160]})"
    widened = ir.load(path)
    WidenFloatPass()(widened)
    with scratch_model_file(widened, "bf16", name="float32.onnx", external_data=True) as copy_path:
        report = verify_file(copy_path, inputs, expected, flat=flat, tolerance=tolerance, execution_provider=execution_provider)
    report.reference = "PyTorch float32"
    report.note = (
        "bfloat16 file checked on its float32-widened copy, against PyTorch in float32 on the same "
        f"bfloat16 weights (atol {tolerance.atol:.3g}: the file's own constants are bfloat16); {loads}"
    )
    return report


#: bfloat16's relative resolution (8 bits of mantissa): a constant the bfloat16 file stores
#: (an attention scale, an epsilon) may differ from PyTorch's by this much of its value.
BFLOAT16_RESOLUTION = 2.0**-8


def widened_tolerance(expected: Sequence[Any]) -> Tolerance:
    """The default tolerance of the widened check: float32's, with ``atol`` raised to bfloat16's
    resolution times the largest expected magnitude.

    The widened copy computes in float32 like the reference, but the constants the bfloat16 file
    holds were rounded to bfloat16 when torch wrote them (``sqrt(1/sqrt(8))`` = 0.5946 as 0.59375 in
    a split attention scale): the outputs then differ by about that resolution relative to their
    scale, not to each element (a logit near 0 beside logits of 10). A wrong weight or op still
    differs by the outputs' own order of magnitude.
    """
    default = default_tolerance("float32")
    scale = 0.0
    for value in expected:
        if hasattr(value, "detach"):  # a torch tensor; integer outputs are compared exactly
            if not value.is_floating_point():
                continue
            value = value.detach().float().cpu().numpy()
        array = np.asarray(value)
        if array.size and array.dtype.kind == "f":
            finite = np.abs(array[np.isfinite(array)])
            scale = max(scale, float(finite.max()) if finite.size else 0.0)
    return Tolerance(max(default.atol, BFLOAT16_RESOLUTION * scale), default.rtol)


def assert_parity(report: ParityReport, *, result=None) -> None:
    """Raise :class:`ParityError` naming each output beyond tolerance."""
    if report.ok:
        return

    def fmt(value):
        return "-" if value is None else f"{value:.3e}"

    lines = [
        f"{o.name}: shape mismatch: {o.shape_mismatch}"
        if o.shape_mismatch
        else f"{o.name}: max abs {fmt(o.modular_max_abs)} (flat {fmt(o.flat_max_abs)}"
        + (f", torch.export's program {fmt(o.program_max_abs)}" if o.program_max_abs is not None else "")
        + f"), tolerance atol={o.tolerance.atol:g} rtol={o.tolerance.rtol:g}"
        for o in report.failures()
    ]
    if report.padding:
        from onnx_modular.check import padding

        lines.append(report.padding)
        hint = padding.HINT
    elif report.ties:
        from onnx_modular.check import ties

        lines.append(report.ties)
        hint = ties.HINT
    elif report.captured_differently:
        lines.append(
            "The program torch.export captured is as far from PyTorch when PyTorch runs it: the ONNX files compute "
            "what was captured, and the model takes another path when traced than when run eagerly."
        )
        hint = (
            "Compare result.exported_program.module() with the model on the same inputs. The usual cause is a branch "
            "taken only under tracing (transformers builds, when traced, an attention mask it skips in eager mode, "
            "and the attention then differs where the module's is_causal disagrees with that mask): fix the branch, "
            "or pass the inputs that make both paths agree (token_type_ids, where the model takes them)."
        )
    else:
        hint = (
            "Inspect error.report; error.result.save(path) keeps the model for debugging; "
            "loosen rtol/atol if the drift is expected (e.g. float16)."
        )
    raise ParityError(
        "onnxruntime results differ from PyTorch:\n  " + "\n  ".join(lines), report=report, result=result, hint=hint
    )


def add_program_differences(report: ParityReport, result: Any, expected: Sequence[Any]) -> None:
    """For a failed check of an export on its example inputs: run the program torch.export
    captured in PyTorch and record each output's difference from the same reference
    (``program_max_abs``). The program as captured (``result._captured``, before decomposition
    and the FX fixes), else ``result.exported_program``: a difference there is the capture's,
    not the translation's. One more forward pass, only on failure; not for a program that
    writes its buffers (training-mode BatchNorm: the run would change the model's) or one that
    does not run in PyTorch (weights on ``meta``)."""
    program = getattr(result, "_captured", None) or getattr(result, "exported_program", None)
    example = getattr(result, "_example", None)
    if report.ok or program is None or example is None or program.graph_signature.buffers_to_mutate:
        return
    try:
        outputs = torch_outputs(program.module(), *example)
    except Exception:  # not runnable eagerly: the report stays as it was
        return
    if len(outputs) != len(report.outputs) or len(expected) != len(report.outputs):
        return
    for row, actual, reference in zip(report.outputs, outputs, expected):
        actual, reference = to_numpy(actual), to_numpy(reference)
        if actual.shape == reference.shape:
            row.program_max_abs = max_differences(actual, reference)[0]


@dataclasses.dataclass
class VerificationReport:
    """:func:`verify` at one or more sets of input shapes: one :class:`ParityReport` per run."""

    checks: list[ParityReport]

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "checks": [check.to_dict() for check in self.checks]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        parts = []
        for check in self.checks:
            shapes = ", ".join(f"{name}{shape}" for name, shape in check.shapes.items())
            parts += [f"== inputs: {shapes or '(none)'}", str(check)]
        return "\n".join(parts + ["OK" if self.ok else "MISMATCH"])


def verify(
    path: str | os.PathLike,
    model: torch.nn.Module | None = None,
    args: tuple | None = None,
    kwargs: dict | None = None,
    *,
    shapes: Sequence[dict[str, int]] | None = None,
    localize_modules: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
    flat: bool = True,
    execution_provider: str | None = None,
) -> VerificationReport:
    """Check a saved modular model: onnxruntime (modular, flat) against PyTorch, per output and per module.

    Args:
        path: The ``.onnx`` file.
        model: The PyTorch model; without it only modular-vs-flat is checked (no torch needed).
        args, kwargs: Inputs. When both are ``None``, inputs are generated from the declared
            input shapes (:func:`onnx_modular.runtime.inputs.random_inputs`: masks all ones,
            integers 0 or 1, valid ids for any vocabulary), once per entry of ``shapes``
            (symbolic dim name -> size, ``"*"`` for the rest); the default runs two shapes (all
            symbolic dims 2, then 3) so dynamic models are exercised at several sizes.
            Generated inputs are passed to ``model`` by the ONNX input names, which torch
            keeps from forward()'s parameters.
        localize_modules: Also compare every module call (needs ``model``).
        rtol, atol: Override the per-dtype default tolerance.
        flat: Also run the inlined flat copy.
        execution_provider: onnxruntime's provider for every run (CPU by default; ``"cuda"``, ...
            when this onnxruntime build has it, else :class:`~onnx_modular.errors.ExecutionProviderError`).

    Example::

        report = onnx_modular.verify("gpt2.onnx", model)
        print(report)
    """
    path = pathlib.Path(path)
    tol = tolerance(rtol, atol)
    proto = load_model_file(path)
    runs: list[tuple[list, tuple, dict]] = []
    if args is not None or kwargs is not None:
        args, kwargs = normalize_inputs(args, kwargs, model)
        runs.append((flatten_inputs(args, kwargs), args, kwargs))
    else:
        symbolic = any(
            d.HasField("dim_param") or not d.HasField("dim_value")
            for value in file_inputs.model_inputs(proto)
            for d in value.type.tensor_type.shape.dim
        )
        for dims in shapes or ([{}, {"*": 3}] if symbolic else [{}]):
            feeds = file_inputs.random_inputs(
                proto, dims={k: v for k, v in dims.items() if k != "*"}, default_dim=dims.get("*", 2), seed=seed, int_high=2
            )
            if model is None:
                runs.append((list(feeds.values()), (), {}))
            else:
                import torch

                tensors = {name: torch.from_numpy(array) for name, array in feeds.items()}
                runs.append((list(tensors.values()), (), tensors))

    checks = []
    for tensors, run_args, run_kwargs in runs:
        if model is None:
            report = check_file(
                path, [to_numpy(t) for t in tensors], flat=flat, tolerance=tol, execution_provider=execution_provider
            )
        else:
            expected = torch_outputs(model, run_args, run_kwargs)
            report = verify_file(
                path, tensors, expected, flat=flat, tolerance=tol, execution_provider=execution_provider
            )
            if localize_modules:
                from onnx_modular.check.localization import localize

                report.modules = localize(
                    path, model, run_args, run_kwargs, tolerance=tol, execution_provider=execution_provider
                )
        checks.append(report)
    return VerificationReport(checks)
