"""Parity: onnxruntime on the modular model and on its flat (inlined) copy, against PyTorch.

The flat model is made with ``onnx.inliner.inline_local_functions``; onnx_modular
has no inliner of its own. ``verify_*`` functions return a report and never raise on
a mismatch; ``assert_parity`` raises :class:`~onnx_modular.errors.ParityError`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import pathlib
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import onnx
import onnx.inliner
import torch

from onnx_modular.errors import ExecutionProviderError, ParityError, VerificationError

__all__ = [
    "Tolerance",
    "default_tolerance",
    "OutputParity",
    "ParityReport",
    "flatten_inputs",
    "flatten_outputs",
    "inline_model",
    "run_onnxruntime",
    "execution_providers",
    "open_session",
    "run_session",
    "compare",
    "max_differences",
    "allclose",
    "verify_file",
    "assert_parity",
]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``|onnx - torch| <= atol + rtol * |torch|`` elementwise (numpy.allclose)."""

    atol: float
    rtol: float


_DEFAULT_TOLERANCES = {
    torch.float64: Tolerance(1e-7, 1e-6),
    torch.float32: Tolerance(1e-4, 1e-3),
    torch.float16: Tolerance(1e-2, 1e-2),
    torch.bfloat16: Tolerance(5e-2, 5e-2),
}


def default_tolerance(dtype: torch.dtype) -> Tolerance:
    """Defaults per dtype; integer and bool outputs must match exactly."""
    return _DEFAULT_TOLERANCES.get(dtype, Tolerance(0.0, 0.0))


@dataclasses.dataclass
class OutputParity:
    """Differences for one model output (``None`` when that model was not run)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    tolerance: Tolerance
    modular_max_abs: float
    modular_max_rel: float
    flat_max_abs: float | None
    flat_max_rel: float | None
    modular_vs_flat_max_abs: float | None
    ok: bool


@dataclasses.dataclass
class ParityReport:
    """Per-output differences between onnxruntime (modular, flat) and PyTorch."""

    outputs: list[OutputParity]

    @property
    def ok(self) -> bool:
        return all(output.ok for output in self.outputs)

    @property
    def max_abs(self) -> float:
        return max((o.modular_max_abs for o in self.outputs), default=0.0)

    def failures(self) -> list[OutputParity]:
        return [output for output in self.outputs if not output.ok]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "outputs": [
                {**dataclasses.asdict(output), "tolerance": dataclasses.asdict(output.tolerance)}
                for output in self.outputs
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        def fmt(value: float | None) -> str:
            return "-" if value is None else f"{value:.2e}"

        width = name_column_width(o.name for o in self.outputs)
        header = f"{'output':<{width}} {'shape':<18} {'dtype':<9} {'modular abs':>11} {'rel':>9} {'flat abs':>9} {'rel':>9} {'mod-flat':>9} {'atol/rtol':>15}  ok"
        lines = ["Parity against PyTorch (onnxruntime, max abs / max rel difference)", header, "-" * len(header)]
        for o in self.outputs:
            tolerance = f"{o.tolerance.atol:.0e}/{o.tolerance.rtol:.0e}"
            lines.append(
                f"{fit_name(o.name, width):<{width}} {str(list(o.shape))[:18]:<18} {o.dtype:<9} {fmt(o.modular_max_abs):>11} "
                f"{fmt(o.modular_max_rel):>9} {fmt(o.flat_max_abs):>9} {fmt(o.flat_max_rel):>9} "
                f"{fmt(o.modular_vs_flat_max_abs):>9} {tolerance:>15}  {'yes' if o.ok else 'NO'}"
            )
        lines.append("PASS" if self.ok else f"FAIL: {len(self.failures())} output(s) beyond tolerance")
        return "\n".join(lines)


def name_column_width(names: Iterable[str], minimum: int = 24, maximum: int = 56) -> int:
    """Width of a report's name column: the longest name, within bounds."""
    return max(minimum, min(maximum, max((len(name) for name in names), default=0)))


def fit_name(name: str, width: int) -> str:
    """``name`` shortened in the middle to ``width`` (both ends of a dotted path tell)."""
    if len(name) <= width:
        return name
    head = (width - 1) // 2
    return f"{name[:head]}…{name[len(name) - (width - 1 - head):]}"


def copy_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Deep copies of the inputs, for runs that may change them (a KV cache grows in place)."""
    try:
        return copy.deepcopy(tuple(args)), copy.deepcopy(dict(kwargs))
    except Exception:  # inputs that cannot be copied are used as they are
        return tuple(args), dict(kwargs)


def torch_outputs(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any] | None) -> list[torch.Tensor]:
    """The model's output tensors on copies of the inputs (which it may change, as a cache does)."""
    args, kwargs = copy_inputs(args, kwargs or {})
    with torch.no_grad():
        return flatten_outputs(model(*args, **kwargs))


def flatten_inputs(args: Sequence[Any], kwargs: dict[str, Any] | None) -> list[torch.Tensor]:
    """Tensors of (args, kwargs) in the order torch.export makes them graph inputs."""
    leaves = torch.utils._pytree.tree_leaves((tuple(args), dict(kwargs or {})))
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def flatten_outputs(outputs: Any) -> list[torch.Tensor]:
    """Tensors of a model's return value, in the order of the ONNX graph outputs."""
    return [leaf for leaf in torch.utils._pytree.tree_leaves(outputs) if isinstance(leaf, torch.Tensor)]


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def to_torch(array: np.ndarray) -> torch.Tensor:
    """An onnxruntime output as a torch tensor (bfloat16 arrives as ml_dtypes' bfloat16)."""
    array = np.asarray(array)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def inline_model(source: str | os.PathLike, destination: str | os.PathLike) -> None:
    """Write a flat copy of ``source`` (all local functions inlined) next to it.

    Weights stay where they are: external data is not loaded, so both files share
    it when they sit in one folder.
    """
    proto = onnx.load(str(source), load_external_data=False)
    flat = onnx.inliner.inline_local_functions(proto)
    onnx.save(flat, str(destination))


def execution_providers(execution_provider: str | None = None) -> list[str]:
    """onnxruntime's provider list for ``execution_provider`` (CPU when ``None``), CPU kept as the
    fallback for the operators another provider does not run.

    Accepts onnxruntime's names (``CUDAExecutionProvider``) or their short form (``cuda``).

    Raises:
        ExecutionProviderError: This onnxruntime build does not have the provider.
    """
    import onnxruntime as ort

    if execution_provider is None:
        return ["CPUExecutionProvider"]
    available = ort.get_available_providers()
    wanted = execution_provider.lower().removesuffix("executionprovider")
    match = next((name for name in available if name.lower().removesuffix("executionprovider") == wanted), None)
    if match is None:
        raise ExecutionProviderError(
            f"onnxruntime has no execution provider {execution_provider!r}; this build has: {', '.join(available)}.",
            hint="Install the onnxruntime package built for that provider (onnxruntime-gpu for CUDA), "
            "or use one of the providers listed.",
        )
    return [match] if match == "CPUExecutionProvider" else [match, "CPUExecutionProvider"]


def open_session(model: str | os.PathLike | bytes, execution_provider: str | None = None):
    """An onnxruntime session for a model file (or serialized model) on ``execution_provider``."""
    import onnxruntime as ort

    providers = execution_providers(execution_provider)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model if isinstance(model, bytes) else str(model), options, providers=providers)


def run_session(session, inputs: Sequence[torch.Tensor | np.ndarray]) -> list[np.ndarray]:
    """Run ``session`` on one tensor per model input, in order; failures become :class:`VerificationError`."""
    try:
        names = [i.name for i in session.get_inputs()]
        if len(names) != len(inputs):
            raise VerificationError(
                f"The model has {len(names)} inputs ({', '.join(names)}) but {len(inputs)} tensors were given.",
                hint="Give one tensor per model input, in order.",
            )
        feeds = {name: _to_numpy(t) if isinstance(t, torch.Tensor) else np.asarray(t) for name, t in zip(names, inputs)}
        return session.run(None, feeds)
    except VerificationError:
        raise
    except Exception as e:
        raise _run_failure(e) from e


def _run_failure(error: Exception) -> VerificationError:
    text = str(error).strip().splitlines()[0][:400]
    return VerificationError(
        f"onnxruntime could not run the model: {text}",
        hint="onnxruntime's CPU kernels do not cover every dtype (bfloat16 arithmetic, for one); "
        "pass verify=False to export without the check, or verify on a float32/float16 export.",
    )


def run_onnxruntime(
    path: str | os.PathLike, inputs: Sequence[torch.Tensor | np.ndarray], *, execution_provider: str | None = None
) -> list[np.ndarray]:
    """Run a model file in onnxruntime (CPU unless ``execution_provider``); failures become
    :class:`VerificationError` (:class:`ExecutionProviderError` for a provider this build lacks)."""
    try:
        session = open_session(path, execution_provider)
    except ExecutionProviderError:
        raise
    except Exception as e:
        raise _run_failure(e) from e
    return run_session(session, inputs)


def max_differences(actual: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """(max abs, max rel) difference; NaN/inf at the same places count as equal, a shape
    mismatch as inf; strings compare exactly."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    if actual.shape != expected.shape:
        return math.inf, math.inf
    if actual.size == 0:
        return 0.0, 0.0
    if actual.dtype.kind in "OSU":
        return (0.0, 0.0) if bool(np.all(actual == expected)) else (math.inf, math.inf)
    actual64 = actual.astype(np.complex128 if actual.dtype.kind == "c" else np.float64)
    expected64 = expected.astype(actual64.dtype)
    same = (np.isnan(actual64) & np.isnan(expected64)) | (actual64 == expected64)
    diff = np.where(same, 0.0, np.abs(actual64 - expected64))
    diff = np.where(np.isnan(diff), np.inf, diff)
    scale = np.abs(np.where(np.isfinite(expected64), expected64, 0.0))
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):  # inf is the honest answer
        rel = np.where(diff == 0, 0.0, diff / np.maximum(scale, np.finfo(np.float64).tiny))
    return float(diff.max()), float(rel.max())


def allclose(actual: np.ndarray, expected: np.ndarray, tolerance: Tolerance) -> bool:
    """``numpy.allclose`` with NaN == NaN, after a shape check; strings compare exactly."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    if actual.shape != expected.shape:
        return False
    if actual.dtype.kind in "OSU":
        return bool(np.all(actual == expected))
    kind = np.complex128 if actual.dtype.kind == "c" else np.float64
    return bool(
        np.allclose(actual.astype(kind), expected.astype(kind), atol=tolerance.atol, rtol=tolerance.rtol, equal_nan=True)
    )


def compare(
    expected: Sequence[torch.Tensor],
    modular: Sequence[np.ndarray],
    flat: Sequence[np.ndarray] | None,
    *,
    names: Sequence[str] | None = None,
    tolerance: Tolerance | None = None,
) -> ParityReport:
    """Build a :class:`ParityReport` from torch outputs and onnxruntime outputs."""
    if len(modular) != len(expected):
        raise ParityError(
            f"The ONNX model has {len(modular)} outputs but PyTorch returned {len(expected)} tensors.",
            hint="Outputs that are not tensors (None, ints) are not ONNX outputs; return tensors only.",
        )
    results = []
    for index, torch_value in enumerate(expected):
        name = names[index] if names and index < len(names) else f"output_{index}"
        tol = tolerance or default_tolerance(torch_value.dtype)
        reference = _to_numpy(torch_value)
        modular_abs, modular_rel = max_differences(modular[index], reference)
        ok = allclose(modular[index], reference, tol)
        flat_abs = flat_rel = modular_vs_flat = None
        if flat is not None:
            flat_abs, flat_rel = max_differences(flat[index], reference)
            modular_vs_flat, _ = max_differences(modular[index], flat[index])
            ok = ok and allclose(flat[index], reference, tol)
        results.append(
            OutputParity(
                name=name,
                shape=tuple(torch_value.shape),
                dtype=str(torch_value.dtype).replace("torch.", ""),
                tolerance=tol,
                modular_max_abs=modular_abs,
                modular_max_rel=modular_rel,
                flat_max_abs=flat_abs,
                flat_max_rel=flat_rel,
                modular_vs_flat_max_abs=modular_vs_flat,
                ok=ok,
            )
        )
    return ParityReport(results)


def verify_file(
    path: str | os.PathLike,
    inputs: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    *,
    flat: bool = True,
    tolerance: Tolerance | None = None,
    execution_provider: str | None = None,
) -> ParityReport:
    """Run ``path`` (and its inlined copy) in onnxruntime and compare with ``expected``."""
    path = pathlib.Path(path)
    names = [o.name for o in onnx.load(str(path), load_external_data=False).graph.output]
    modular_outputs = run_onnxruntime(path, inputs, execution_provider=execution_provider)
    flat_outputs = None
    if flat:
        # The flat copy sits next to the model so that both read the same external data.
        flat_path = path.parent / f".{path.stem}.flat-{uuid.uuid4().hex[:8]}.onnx"
        try:
            inline_model(path, flat_path)
            flat_outputs = run_onnxruntime(flat_path, inputs, execution_provider=execution_provider)
        finally:
            flat_path.unlink(missing_ok=True)
    return compare(expected, modular_outputs, flat_outputs, names=names, tolerance=tolerance)


def assert_parity(report: ParityReport, *, result=None) -> None:
    """Raise :class:`ParityError` naming each output beyond tolerance."""
    if report.ok:
        return
    lines = [
        f"{o.name}: max abs {o.modular_max_abs:.3e} (flat {o.flat_max_abs if o.flat_max_abs is None else f'{o.flat_max_abs:.3e}'}), "
        f"tolerance atol={o.tolerance.atol:g} rtol={o.tolerance.rtol:g}"
        for o in report.failures()
    ]
    raise ParityError(
        "onnxruntime results differ from PyTorch:\n  " + "\n  ".join(lines),
        report=report,
        result=result,
        hint="Inspect error.report; error.result.save(path) keeps the model for debugging; "
        "loosen rtol/atol if the drift is expected (e.g. float16).",
    )
