"""The ``"onnx_modular"`` backend of ``transformers.exporters``: config, exporter and runner.

:class:`ModularOnnxExporter` is transformers' own ``OnnxExporter`` with one step swapped: where
that exporter converts the captured ``torch.export`` program with ``torch.onnx.export`` (a flat
graph), this one converts it with :func:`onnx_modular.export_modular`. Everything around that
step is transformers' code, run as it is: the model patches and pytree registrations, the
signature and config patches, the FX node fixes (after capture, and again after the
decompositions, through ``program_fixes``), its custom translation table (handed over in the
call), the output naming, the ONNX IR fixes and the recorded metadata. The parity check then
runs on the final program, after those fixes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pathlib
import threading
from collections.abc import Iterator, MutableMapping
from typing import Any

import onnx_ir as ir
import torch
from transformers.exporters import auto
from transformers.exporters.configs import OnnxConfig
from transformers.exporters.exporter_dynamo import (
    patch_forward_signature,
    patch_model_config,
    reset_model_state,
)
from transformers.exporters.exporter_onnx import OnnxExporter
from transformers.exporters.runners.runner_onnx import OnnxModelRunner
from transformers.exporters.utils import (
    _OUTPUT_FLAGS,
    apply_fx_node_fixes,
    apply_patches,
)

from onnx_modular.capture import strategies, torch_compat
from onnx_modular.check.dispatch import verify_export
from onnx_modular.check.parity import user_tolerance
from onnx_modular.errors import InvalidInputError
from onnx_modular.export import ModularExport, ModuleSelector, export_modular
from onnx_modular.storage import save

__all__ = [
    "EXPORT_FORMAT",
    "ModularOnnxConfig",
    "ModularOnnxExporter",
    "ModularOnnxModelRunner",
    "modular_result",
    "register",
]

#: The name of the format in transformers' registry (``get_exporter_class("onnx_modular")``).
EXPORT_FORMAT = "onnx_modular"

#: Where the :class:`~onnx_modular.ModularExport` of a program is kept (``program.meta``).
_RESULT_KEY = "onnx_modular.result"


@dataclasses.dataclass
class ModularOnnxConfig(OnnxConfig):
    """transformers' ``OnnxConfig`` (``dynamic``, ``dynamic_shapes``, ``opset_version``,
    ``optimize``, ...) plus onnx_modular's options.

    Args:
        modules: Which module calls become functions (``export_modular``'s ``modules``).
        dedupe: Identical calls share one function.
        verify: Check parity (onnxruntime, modular and flat, against PyTorch) on the final program;
            a mismatch raises :class:`~onnx_modular.errors.ParityError`, whose ``result`` keeps the
            exported model.
        verify_flat: Also run the inlined (flat) copy in the check.
        rtol: Relative tolerance of the check (default: per output dtype).
        atol: Absolute tolerance of the check (default: per output dtype).
    """

    export_format: str = EXPORT_FORMAT
    modules: ModuleSelector = "all"
    dedupe: bool = True
    verify: bool = True
    verify_flat: bool = True
    rtol: float | None = None
    atol: float | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.ort_fusions is not None:
            raise InvalidInputError(
                f"ort_fusions={self.ort_fusions!r} rewrites the flat graph into onnxruntime's fused ops, "
                "which would dissolve the module functions.",
                hint="Export with the 'onnx' format for a fused flat graph, or leave ort_fusions unset.",
            )
        if self.quantizer is not None:
            raise InvalidInputError(
                "Quantization is not supported by the onnx_modular format yet.",
                hint="Export with the 'onnx' format to quantize, or leave quantizer unset.",
            )


class ModularOnnxExporter(OnnxExporter):
    """Exports a transformers model to a modular ONNX graph (an ``onnx_ir.Model`` whose module
    calls are nested local functions), through transformers' ``OnnxExporter``.

    Example::

        exporter = ModularOnnxExporter()
        exported = exporter.export(model, {"input_ids": ids}, ModularOnnxConfig(dynamic=True))
        exported(input_ids=ids).logits
        modular_result(exported).hierarchy        # the function tree, the parity report, ...
    """

    export_format = EXPORT_FORMAT
    config_class = ModularOnnxConfig
    # onnx_modular drives torch's private exporter stages (onnx_modular/capture/torch_compat.py): the
    # installed torch when it is one of the tested releases, else the newest tested one.
    tested_versions = {
        "torch": next(
            (v for v in torch_compat.TESTED_TORCH_VERSIONS if torch.__version__.split("+")[0] == v),
            torch_compat.TESTED_TORCH_VERSIONS[-1],
        )
    }

    def export_program(
        self, model: torch.nn.Module, sample_inputs: MutableMapping[str, Any], config: ModularOnnxConfig
    ) -> tuple[ir.Model, Any]:
        # transformers pops these from the inputs and sets them on the config for the trace; the
        # eager run of the modular pipeline sees the same config.
        output_flags = {flag: sample_inputs[flag] for flag in _OUTPUT_FLAGS if flag in sample_inputs}
        conversion = _ModularConversion(model, config, output_flags)
        # Axis names (strings, as torch.onnx.export takes them) are Dim.DYNAMIC for transformers'
        # torch.export call; the conversion names the ONNX axes after them.
        traced = dataclasses.replace(config, dynamic_shapes=torch_compat.export_dims(config.dynamic_shapes))
        # transformers' torch.export call is made by the capture strategies of export_modular
        # (capture/strategies.py; BERT's Dim("seq") gets torch's suggested max, as in torch.onnx.export),
        # one strategy per run of transformers' export_program: each run traces the model once, and
        # transformers reads the input and output names from that trace.
        outputs = []

        def attempt(strategy: strategies.CaptureStrategy, failures: list[strategies.Attempt]) -> strategies.Attempt:
            with conversion.capturing_with(strategy, failures), conversion.replacing_torch_onnx_export():
                try:
                    outputs.append(super(ModularOnnxExporter, self).export_program(model, sample_inputs, traced))
                except Exception:
                    if conversion.attempt is None or conversion.attempt.ok:
                        raise  # not the capture: transformers' preparation or the conversion failed
            return conversion.attempt

        captured = strategies.first_success(strategies.STRATEGIES, attempt, model)
        program, metadata = outputs[-1]
        result = conversion.result
        if result is None or result.model is not program:
            raise InvalidInputError(
                "transformers' OnnxExporter did not convert the program through torch.onnx.export, so the "
                "modular conversion could not take its place.",
                hint="This transformers version is not supported by onnx_modular.hf; use transformers 5.23.",
            )
        result.capture_strategy = captured.strategy
        program.meta[_RESULT_KEY] = result
        if config.verify:
            verify_export(result, flat=config.verify_flat, tolerance=user_tolerance(config.rtol, config.atol))
        return program, metadata

    @classmethod
    def save_program(cls, program: ir.Model, path) -> None:
        """Written as the ``onnx`` format writes it (weights in ``<name>.onnx.data``), atomically
        and checked with ``onnx.checker`` (full check) before it is moved into place."""
        with save.staged_save(program, path, external_data=True):
            pass
        # transformers' from_pretrained looks for <name>.data. Over a model that used that name,
        # the atomic write picked a name of its own; a second write goes back to <name>.data.
        if save.data_name(pathlib.Path(path), None) not in save.referenced_data(pathlib.Path(path)):
            with save.staged_save(program, path, external_data=True):
                pass


class _ModularConversion:
    """Stands in for ``torch.onnx.export`` inside one ``OnnxExporter.export_program`` call."""

    def __init__(self, model: torch.nn.Module, config: ModularOnnxConfig, output_flags: dict[str, Any]):
        self.model = model
        self.config = config
        self.output_flags = output_flags
        self.result: ModularExport | None = None
        self.attempt: strategies.Attempt | None = None
        self._capturing = False
        self._thread = threading.get_ident()

    @contextlib.contextmanager
    def capturing_with(self, strategy: strategies.CaptureStrategy, failures: list[strategies.Attempt]) -> Iterator[None]:
        """transformers' first ``torch.export.export`` call, on this thread, is made by ``strategy``
        with the options transformers gave (``strict``, ``prefer_deferred_runtime_asserts_over_guards``);
        its :class:`~onnx_modular.capture.strategies.Attempt` is kept in :attr:`attempt`, and a failure
        is raised again to stop transformers' run. The strategy's own calls and any other call are
        torch's as usual."""
        original = torch.export.export
        self.attempt = None

        @functools.wraps(original)
        def export(mod, args=(), kwargs=None, *, dynamic_shapes=None, **options):
            if self.attempt is not None or self._capturing or threading.get_ident() != self._thread:
                return original(mod, args, kwargs, dynamic_shapes=dynamic_shapes, **options)
            call = strategies.CaptureCall(mod, tuple(args), dict(kwargs or {}), dynamic_shapes, options)
            self._capturing = True
            try:
                self.attempt = strategy(call, failures)
            finally:
                self._capturing = False
            if not self.attempt.ok:
                raise self.attempt.error
            return self.attempt.program

        torch.export.export = export
        try:
            yield
        finally:
            torch.export.export = original

    @contextlib.contextmanager
    def replacing_torch_onnx_export(self) -> Iterator[None]:
        original = torch.onnx.export

        @functools.wraps(original)
        def export(model, args=(), *rest, **kwargs):
            # Only the call of this export, on this thread: anything else is torch's as usual.
            if self.result is not None or threading.get_ident() != self._thread or rest:
                return original(model, args, *rest, **kwargs)
            if not isinstance(model, torch.export.ExportedProgram):
                return original(model, args, **kwargs)
            return self.convert(model, args, **kwargs)

        torch.onnx.export = export
        try:
            yield
        finally:
            torch.onnx.export = original

    def convert(
        self,
        program: torch.export.ExportedProgram,
        args: tuple = (),
        *,
        kwargs: dict | None = None,
        input_names: list[str] | None = None,
        custom_translation_table: dict | None = None,
        opset_version: int | None = None,
        optimize: bool = True,
        **unused: Any,
    ) -> torch.onnx.ONNXProgram:
        config, model, kwargs = self.config, self.model, dict(kwargs or {})
        # A copy: transformers' forward wrapper appends the names of every later call to the list.
        input_names = list(input_names) if input_names is not None else None
        # The eager run records every module call; it runs in the state torch.export traced in.
        with (
            reset_model_state(model),
            patch_model_config(model, self.output_flags),
            apply_patches("dynamo"),
            patch_forward_signature(model, kwargs),
        ):
            self.result = export_modular(
                model,
                tuple(args),
                kwargs=kwargs,
                input_names=input_names,
                opset_version=opset_version,
                modules=config.modules,
                dedupe=config.dedupe,
                optimize=optimize,
                verify=False,  # checked on the final program, after transformers' IR fixes
                custom_translation_table=custom_translation_table,
                exported_program=program,
                dynamic_shapes=config.dynamic_shapes,  # only names the axes: the program is captured
                program_fixes=[functools.partial(apply_fx_node_fixes, "onnx")],
            )
        return torch.onnx.ONNXProgram(self.result.model, program)


class ModularOnnxModelRunner(OnnxModelRunner):
    """Runs a modular program in onnxruntime: transformers' ONNX runner (local functions are
    standard ONNX, run by onnxruntime as they are), registered under ``"onnx_modular"``."""


def modular_result(exported: Any, component: str | None = None) -> ModularExport:
    """The :class:`~onnx_modular.ModularExport` of an export (its ``hierarchy``, parity ``report``,
    ``localize(model)``, ...): from an ``ExportedModel`` (its one component, or ``component``)
    or a program. Programs loaded with ``from_pretrained`` have none (only their file).
    """
    program = exported
    if hasattr(exported, "components"):
        name = component if component is not None else exported._single_component()
        program = exported.components[name].program
    result = getattr(program, "meta", {}).get(_RESULT_KEY)
    if result is None:
        raise InvalidInputError(
            "This program carries no export result (it was loaded from a file, or exported by another format).",
            hint="Inspect a saved file with `onnx-modular tree` / `onnx-modular verify`.",
        )
    return result


def register() -> None:
    """Register the format with transformers (idempotent; ``import onnx_modular.hf`` calls it)."""
    backend = auto.EXPORT_BACKENDS.get(EXPORT_FORMAT)
    if backend is not None and backend.exporter is ModularOnnxExporter:
        return
    auto.register_backend(ModularOnnxExporter, ModularOnnxModelRunner)
