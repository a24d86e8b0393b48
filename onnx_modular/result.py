"""The result of an export: the modular model, its call tree, the parity report."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import torch

from onnx_modular.capture import tensors
from onnx_modular.check import verification
from onnx_modular.check.dispatch import verify_export
from onnx_modular.errors import InvalidInputError
from onnx_modular.format import metadata
from onnx_modular.format.calltree import CallTree
from onnx_modular.storage.scratch import scratch_model_file

__all__ = ["ModularExport"]


@dataclasses.dataclass
class ModularExport:
    """The result of :func:`export_modular`.

    Attributes:
        model: The modular ONNX model (``onnx_ir.Model``).
        hierarchy: The module-call tree; ``print(result.hierarchy)`` shows it.
        report: The parity report (``None`` when verification was off).
        blocks: The block-by-block report (``weights=`` with a model on ``meta``), else ``None``.
        timings: Seconds spent per stage.
        path: Where the model was written (``None`` if not saved yet).
        flat_path: Where the flat deployment copy was written (``export_modular(flat_file=...)``).
        flat_report: That copy's parity report against PyTorch (onnxruntime).
        capture_strategy: The capture strategy that gave the program (``"torch.export"``,
            ``"size-oblivious"``, ``"suggested-fixes"``, ``"draft_export"``, ``"meta:..."``; see
            :mod:`onnx_modular.capture.strategies`); ``None`` when the program was given
            (``exported_program=``).
    """

    model: ir.Model
    hierarchy: CallTree
    report: verification.ParityReport | None = None
    blocks: Any = None  # blockwise.BlockReport when verified block by block (weights=...)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    path: pathlib.Path | None = None
    flat_path: pathlib.Path | None = None
    flat_report: verification.ParityReport | None = None
    capture_strategy: str | None = None
    exported_program: torch.export.ExportedProgram | None = dataclasses.field(default=None, repr=False)
    _reference: tuple[list[torch.Tensor], list[torch.Tensor]] | None = dataclasses.field(default=None, repr=False)
    _example: tuple[tuple, dict] | None = dataclasses.field(default=None, repr=False)
    #: The inputs ``fixed_inputs=`` fixed into the program: given to PyTorch, not to the file.
    _fixed: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict, repr=False)
    #: bfloat16 exports: ``(inputs, outputs)`` of PyTorch in float32 on the bfloat16 weights.
    _reference_float32: tuple[list[torch.Tensor], list[torch.Tensor]] | None = dataclasses.field(default=None, repr=False)
    _sessions: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    #: The program as captured, before decomposition and the FX fixes: what a failed check runs
    #: in PyTorch to tell a captured difference from a translated one; dropped once the export verifies.
    _captured: torch.export.ExportedProgram | None = dataclasses.field(default=None, repr=False)

    def __call__(self, *args: Any, execution_provider: str | None = None, **kwargs: Any) -> list[torch.Tensor]:
        """Run the model in onnxruntime, as torch's ``ONNXProgram`` does: ``result(*args, **kwargs)``
        takes forward()'s inputs and returns the output tensors, in graph-output order.

        Args:
            execution_provider: onnxruntime's provider (``"CPUExecutionProvider"`` or ``"cpu"``, the
                default; ``"cuda"``, ... when this onnxruntime build has it, else
                :class:`~onnx_modular.errors.ExecutionProviderError`). Sessions are kept per provider.
        """
        from onnx_modular.runtime import sessions as runtime

        fixed = self._fixed or _fixed_from_metadata(self.model)
        if fixed:  # the file holds them: the exported values are dropped, others refused
            kwargs = {k: torch.as_tensor(v) if k in fixed and isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
            kwargs, _ = tensors.with_fixed(kwargs, fixed)
        if self._example is not None:  # keyword inputs in the order the export flattened them
            order = list(self._example[1])
            kwargs = dict(sorted(kwargs.items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order)))
        key = runtime.execution_providers(execution_provider)[0]
        if key not in self._sessions:
            with model_file(self) as path:
                self._sessions[key] = runtime.session(path, execution_provider)
        inputs = [tensors.to_numpy(t) for t in tensors.flatten_inputs(args, kwargs)]
        _check_call_inputs(self._sessions[key].get_inputs(), inputs)
        _, outputs = runtime.run(self._sessions[key], inputs)
        return [tensors.to_torch(array) for array in outputs]

    @property
    def model_proto(self) -> onnx.ModelProto:
        """The model as an ``onnx.ModelProto`` (serialized on demand)."""
        return ir.serde.serialize_model(self.model)

    @property
    def functions(self) -> list[ir.Function]:
        """The module-call functions (torch's own helper functions excluded)."""
        return [f for f in self.model.functions.values() if metadata.is_module_function(f)]

    def save(
        self,
        path: str | os.PathLike,
        *,
        external_data: bool | None = None,
        flat_file: bool | str | os.PathLike | None = None,
        rtol: float | None = None,
        atol: float | None = None,
    ) -> pathlib.Path:
        """Write the model atomically (checked with onnx.checker, full_check=True).

        ``flat_file``: also write the flat deployment copy (as ``export_modular(flat_file=...)``:
        ``True`` for ``<stem>.flat.onnx`` beside ``path``); verified against the export's PyTorch
        outputs when they are stored (``self.flat_report``; a bfloat16 copy on its float32-widened
        copy; ``rtol``/``atol`` override the per-dtype tolerance), both files written or neither.
        """
        from onnx_modular.calls import flat

        flat_path = flat.flat_file_path(path, flat_file)
        tolerance = verification.tolerance(rtol, atol)
        with flat.staged_with_flat(self.model, path, flat_path, external_data=external_data) as (_, staged_flat):
            if staged_flat is not None and self._reference is not None:  # the modular file was checked by the export
                verify_export(self, modular=False, flat_copy=staged_flat, tolerance=tolerance)
        self.path, self.flat_path = pathlib.Path(path), flat_path or self.flat_path
        return self.path

    def verify(
        self,
        args: tuple | None = None,
        kwargs: dict | None = None,
        *,
        model: torch.nn.Module | None = None,
        rtol: float | None = None,
        atol: float | None = None,
        flat: bool = True,
        execution_provider: str | None = None,
    ) -> verification.ParityReport:
        """Compare onnxruntime (modular and flat) with PyTorch on new inputs.

        With no arguments, re-checks the example inputs of the export. New inputs
        need the PyTorch ``model`` to compute the reference. ``execution_provider``: as for
        calling the result (CPU by default).
        """
        return verify_export(
            self, args=args, kwargs=kwargs, model=model, flat=flat, tolerance=verification.tolerance(rtol, atol),
            execution_provider=execution_provider, record=False, check=False,
        )

    def localize(
        self,
        model: torch.nn.Module,
        args: tuple | None = None,
        kwargs: dict | None = None,
        *,
        rtol: float | None = None,
        atol: float | None = None,
        execution_provider: str | None = None,
    ):
        """Per-module parity: every module call's outputs, onnxruntime against ``model``.

        Returns a :class:`~onnx_modular.check.localization.LocalizationReport` whose
        ``first_failure`` names the first call (in completion order) beyond tolerance.
        Uses the example inputs of the export unless ``args``/``kwargs`` are given.
        """
        from onnx_modular.check.localization import localize

        if args is None and kwargs is None:
            args, kwargs = self._example or ((), {})
            kwargs = {**kwargs, **self._fixed}
        args, kwargs = tensors.normalize_inputs(args, kwargs, model)
        with model_file(self) as path:
            return localize(
                path, model, args, kwargs, tolerance=verification.tolerance(rtol, atol),
                execution_provider=execution_provider,
            )

    def profile(
        self,
        inputs: Any = None,
        *,
        runs: int = 10,
        warmup: int = 2,
        execution_provider: str | None = None,
        threads: int | None = None,
        optimization: str = "all",
    ):
        """Where the time goes, per module call, in onnxruntime (:func:`onnx_modular.profile`).

        ``inputs``: as for :func:`onnx_modular.profile` (arrays by input name, in order, or a
        ``.npz``); by default the example inputs of the export. Join the per-module error with
        ``result.profile().join(result.localize(model))``.

        Returns:
            A :class:`~onnx_modular.profiling.run.ProfileReport`.
        """
        from onnx_modular.profiling.run import profile

        if inputs is None and self._example is not None:
            inputs = [tensors.to_numpy(t) for t in tensors.flatten_inputs(*self._example)]
        with model_file(self) as path:
            return profile(
                path, inputs, runs=runs, warmup=warmup, execution_provider=execution_provider,
                threads=threads, optimization=optimization,
            )

    def summary(self) -> str:
        functions = self.functions
        calls = sum(int(f.metadata_props.get(metadata.CALL_COUNT, "1")) for f in functions)
        lines = [
            f"{len(functions)} functions for {calls} module calls, max depth {self.hierarchy.max_depth}, "
            f"{sum(1 for _ in self.model.graph)} nodes in the main graph",
        ]
        if self.timings:
            lines.append("time: " + ", ".join(f"{stage} {seconds:.2f}s" for stage, seconds in self.timings.items()))
        return "\n".join(lines)


@contextlib.contextmanager
def model_file(result: ModularExport) -> Iterator[pathlib.Path]:
    """The saved file of ``result``, or the model written to a temporary folder for the duration."""
    if result.path is not None and result.path.exists():
        yield result.path
        return
    with scratch_model_file(result.model) as path:
        yield path


def _fixed_from_metadata(model: ir.Model) -> dict[str, torch.Tensor]:
    """The fixed inputs a file records with their values (``pkg.onnx_modular.fixed_inputs``)."""
    import json

    text = model.metadata_props.get(metadata.FIXED_INPUTS)
    if not text:
        return {}
    fixed = {}
    for name, entry in json.loads(text).items():
        if "values" in entry:
            fixed[name] = torch.tensor(entry["values"], dtype=getattr(torch, entry["dtype"])).reshape(entry["shape"])
    return fixed


def _check_call_inputs(declared: list, inputs: list[np.ndarray]) -> None:
    """``result(*args)``'s inputs against the session's (count, rank, fixed sizes), as an
    :class:`InvalidInputError` naming the input, where onnxruntime's own text would be raw."""
    if len(inputs) != len(declared):
        raise InvalidInputError(
            f"The model takes {len(declared)} input tensors ({', '.join(d.name for d in declared)}), "
            f"{len(inputs)} were given.",
            hint="Call the result with the inputs of the export (forward()'s arguments).",
        )
    for value, array in zip(declared, inputs):
        dims = list(value.shape)
        if len(dims) != array.ndim or any(isinstance(d, int) and d != n for d, n in zip(dims, array.shape)):
            raise InvalidInputError(
                f"Input {value.name!r} has shape {list(array.shape)} but the model declares {dims} "
                "(names are dynamic axes, numbers fixed sizes).",
                hint="Give the input at a declared shape, or export with dynamic_shapes for the axes that vary.",
            )
