"""Typed errors raised by onnx_modular.

Every error derives from :class:`OnnxModularError`. Each names the stage that failed
and, when it can be known, the module path involved; the original exception is
chained as ``__cause__``.
"""

from __future__ import annotations

__all__ = [
    "EXPORT_STAGES",
    "CHECKPOINT_STAGES",
    "OnnxModularError",
    "InvalidInputError",
    "CaptureError",
    "DecompositionError",
    "TranslationError",
    "ModularizeError",
    "SaveError",
    "ParityError",
    "VerificationError",
    "RuntimeCrashError",
    "InvalidModelFileError",
    "MissingDependencyError",
    "ExecutionProviderError",
    "ProfileError",
    "WeightsError",
    "MissingWeightError",
    "UnexpectedWeightError",
    "WeightShapeError",
    "PipelineError",
]

#: The one home of stage names. ``export_modular``'s stages, in the order they end (``verify``
#: ends inside ``save``): its ``result.timings`` keys, the CLI's progress lines, and the
#: ``stage`` of the typed error an unexpected exception in one becomes
#: (:func:`onnx_modular.capture.diagnostics.stage_error`; ``"run"`` is the eager run of ``capture``).
EXPORT_STAGES = ("capture", "decompose", "translate", "modularize", "optimize", "verify", "save")

#: The stages of a checkpoint export (``onnx-modular export <checkpoint folder>``), in order.
CHECKPOINT_STAGES = ("load", "export", "verify", "save")


class OnnxModularError(Exception):
    """Base class of every error raised by onnx_modular.

    Attributes:
        stage: The pipeline stage that failed (``capture``, ``decompose``, ...).
        module_path: The module path involved, or ``None`` when unknown.
            The root module is ``""``.
    """

    stage: str = "export"

    def __init__(self, message: str, *, module_path: str | None = None, hint: str | None = None):
        self.module_path = module_path
        self.hint = hint
        parts = [f"[{self.stage}] {message}"]
        if module_path is not None:
            parts.append(f"Module: {module_path or '<root>'}")
        if hint:
            parts.append(f"What to do: {hint}")
        super().__init__("\n".join(parts))


class InvalidInputError(OnnxModularError, TypeError):
    """The arguments given to export_modular are not usable (not a module, bad path, ...)."""

    stage = "input"


class CaptureError(OnnxModularError):
    """torch.export could not capture the model.

    Attributes:
        attempts: ``[(strategy, exception), ...]``: each capture strategy tried and why it failed
            (``torch.export``, ``size-oblivious``, ``suggested-fixes``, ...; see
            :mod:`onnx_modular.capture.strategies`), empty when the model failed before capture.
    """

    stage = "capture"

    def __init__(self, message: str, *, module_path: str | None = None, hint: str | None = None, attempts=()):
        self.attempts = list(attempts)
        super().__init__(message, module_path=module_path, hint=hint)


class DecompositionError(OnnxModularError):
    """torch's ONNX decompositions failed on the captured program."""

    stage = "decompose"


class TranslationError(OnnxModularError):
    """torch's FX-to-ONNX translator failed on a node."""

    stage = "translate"


class ModularizeError(OnnxModularError):
    """Building the function hierarchy failed."""

    stage = "modularize"


class SaveError(OnnxModularError, OSError):
    """Writing the ONNX file failed. No partial file is left behind."""

    stage = "save"


class ParityError(OnnxModularError):
    """onnxruntime results differ from PyTorch beyond tolerance.

    Attributes:
        report: The :class:`~onnx_modular.check.verification.ParityReport`.
        result: The :class:`~onnx_modular.export.ModularExport` (not written to disk);
            call ``result.save(path)`` to keep it for debugging.
    """

    stage = "verify"

    def __init__(self, message: str, *, report=None, result=None, module_path: str | None = None, hint: str | None = None):
        self.report = report
        self.result = result
        super().__init__(message, module_path=module_path, hint=hint)


class VerificationError(OnnxModularError):
    """Verification could not run (onnxruntime cannot load or run the model, bad inputs)."""

    stage = "verify"


class RuntimeCrashError(VerificationError):
    """onnxruntime ended the process that opened a model with a signal (a crash in its graph
    optimizers on a valid file): the file was opened in a child process, so this one goes on."""


class InvalidModelFileError(OnnxModularError, ValueError):
    """An ONNX file given to onnx_modular cannot be read or is malformed."""

    stage = "load"


class MissingDependencyError(OnnxModularError, ImportError):
    """An optional dependency (transformers, for ``onnx_modular.hf``) is not installed."""

    stage = "setup"


class ExecutionProviderError(OnnxModularError, ValueError):
    """The onnxruntime execution provider asked for is not available in this onnxruntime build."""

    stage = "run"


class ProfileError(OnnxModularError):
    """onnxruntime could not load or run the model being profiled. Nothing is written."""

    stage = "profile"


class WeightsError(OnnxModularError, ValueError):
    """The ``weights=`` given to export_modular cannot be read or do not fit the model.

    Raised before anything is written.
    """

    stage = "weights"


class MissingWeightError(WeightsError, KeyError):
    """A parameter or buffer of the model has no tensor in the weights."""

    def __str__(self) -> str:  # KeyError would quote the message
        return Exception.__str__(self)


class UnexpectedWeightError(WeightsError):
    """The weights hold a tensor that no parameter or buffer of the model takes."""


class WeightShapeError(WeightsError):
    """A tensor in the weights has another shape than the parameter it is for."""


class PipelineError(OnnxModularError):
    """A stage of a pipeline run (a split decoder's stages on Ray workers) failed: its worker died,
    gave no answer in time, could not load its stage, or the cluster could not be joined or could
    not place the stages. The message is one line and names the stage (``stage_index``: ``None``
    when no stage is involved, as for joining the cluster). Nothing is written."""

    stage = "pipeline"

    def __init__(self, message: str, *, stage_index: int | None = None, hint: str | None = None):
        self.stage_index = stage_index
        super().__init__(message, hint=hint)
        # One line, whatever the cause: a command line prints it as the whole story.
        self.args = (" ".join(f"[{self.stage}] {message}".split()) + (f" What to do: {hint}" if hint else ""),)
