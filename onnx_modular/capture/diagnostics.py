"""Error diagnostics: the module behind an error, and the lines of torch's message worth showing."""

from __future__ import annotations

import re
import types
from collections.abc import Iterator

import torch

from onnx_modular.capture import torch_export
from onnx_modular.errors import (
    CaptureError,
    DecompositionError,
    ModularizeError,
    OnnxModularError,
    SaveError,
    TranslationError,
    VerificationError,
)
from onnx_modular.format.text import first_line

__all__ = [
    "capture_error",
    "module_path_from_fx_node",
    "module_path_from_names",
    "module_path_from_traceback",
    "stage_error",
    "suggested_fixes",
]


def _iter_frames(exc: BaseException) -> Iterator[types.FrameType]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        frames = []
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        yield from reversed(frames)  # innermost first
        exc = exc.__cause__ or exc.__context__


def module_path_from_traceback(exc: BaseException, model: torch.nn.Module) -> str | None:
    """The innermost module of ``model`` whose forward() appears in the traceback."""
    paths = {id(module): path for path, module in model.named_modules()}
    for frame in _iter_frames(exc):
        candidate = frame.f_locals.get("self")
        if candidate is not None and id(candidate) in paths:
            return paths[id(candidate)]
    return None


def module_path_from_fx_node(exc: BaseException) -> str | None:
    """The module path of the FX node being translated when ``exc`` was raised."""
    for frame in _iter_frames(exc):
        node = frame.f_locals.get("node")
        if isinstance(node, torch.fx.Node):
            stack = node.meta.get("nn_module_stack") or {}
            if stack:
                return list(stack.values())[-1][0]
            return ""
    return None



def suggested_fixes(exc: BaseException | None) -> str:
    """torch.export's own "Suggested fixes" for dynamic shapes (``total = Dim('total', min=4)``),
    as `` torch suggests: ...``; ``""`` when the error has none."""
    text = str(exc) if exc is not None else ""
    if "Suggested fixes:" not in text:
        return ""
    fixes = [line.strip() for line in text.split("Suggested fixes:", 1)[1].splitlines()]
    fixes = [line for line in fixes if line and "=" in line and not line.startswith("The error")]
    return " torch suggests: " + "; ".join(fixes[:8]) if fixes else ""


def module_path_from_names(exc: BaseException, model: torch.nn.Module) -> str | None:
    """The module owning the longest parameter or buffer name that the error's messages mention
    (a weight fold names its initializers after the weights it reads)."""
    texts = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        texts.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    text = "\n".join(texts)
    found = [
        name
        for name, _ in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
        if name in text and re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", text)
    ]
    if not found:
        return None
    return max(found, key=len).rpartition(".")[0]


_FIXED_HINT = (
    " A guard on an input that describes the layout rather than the data (an image grid such as "
    "image_grid_thw or image_sizes) goes away with export_modular(..., fixed_inputs=[name]), which "
    "fixes its values into the program."
)


def capture_error(attempts: list[tuple[str, BaseException]], model: torch.nn.Module) -> CaptureError:
    """The one error when every capture strategy failed: the first strategy's error (the capture
    as asked) with its module and torch's suggestions, then one line per strategy tried."""
    first = attempts[0][1]
    what = f"{type(first).__name__}: {first_line(first, cause=True)}"
    message = f"torch.export could not capture the model: {what}"
    if len(attempts) > 1:
        tried = "; ".join(f"{name} ({type(exc).__name__}: {first_line(exc)[:200]})" for name, exc in attempts)
        message += f"\nCapture strategies tried: {tried}"
    return CaptureError(
        message,
        module_path=module_path_from_traceback(first, model),
        hint="Make the code traceable by torch.export (see the cause below), "
        "or check dynamic_shapes against the inputs." + next(filter(None, (suggested_fixes(e) for _, e in attempts)), "")
        + (_FIXED_HINT if torch_export.data_dependent(first) else ""),
        attempts=attempts,
    )


def stage_error(stage: str, exc: Exception, model: torch.nn.Module) -> OnnxModularError:
    """The typed error for an unexpected exception in one stage of ``export_modular``.

    ``stage`` is one of ``"run"`` (the eager reference run), ``"capture"``, ``"decompose"``,
    ``"translate"``, ``"modularize"``, ``"optimize"``, ``"save"``, ``"verify"``; the error names the module where it can
    be found and says what to do next.
    """
    what = f"{type(exc).__name__}: {first_line(exc, cause=True)}"
    if stage == "run":
        return CaptureError(
            f"The model failed to run in PyTorch on the example inputs: {type(exc).__name__}: {exc}",
            module_path=module_path_from_traceback(exc, model),
            hint="Check that the example inputs have the shapes and dtypes forward() expects.",
        )
    if stage == "capture":
        error = capture_error([("capture", exc)], model)
        error.attempts = []  # not a strategy's failure (the inputs, outputs or dynamic_shapes)
        return error
    if stage == "decompose":
        return DecompositionError(
            f"torch's ONNX decompositions failed: {what}",
            module_path=module_path_from_fx_node(exc),
            hint="The cause below names the operator; report it with the model.",
        )
    if stage == "translate":
        return TranslationError(
            f"torch's translator failed: {what}",
            module_path=module_path_from_fx_node(exc),
            hint="An operator may have no ONNX implementation; the cause below names it. "
            "Rewrite that code or register a custom translation.",
        )
    if stage in ("save", "verify"):  # a library's exception (onnx_ir's SerdeError, onnxruntime's)
        path = module_path_from_traceback(exc, model)
        if path is None:
            path = module_path_from_names(exc, model)
        if stage == "save":
            return SaveError(
                f"Writing the model failed: {what}",
                module_path=path,
                hint="Export with optimize=False (no weight fold) to narrow it down, and report the model.",
            )
        return VerificationError(
            f"Verification failed: {what}",
            module_path=path,
            hint="Export with verify=False to keep the file, check it with `onnx-modular verify`, and report the model.",
        )
    in_pass = f" in {exc.pass_name}" if getattr(exc, "pass_name", None) else ""  # passes/export/pipeline.run
    if stage == "optimize":
        return ModularizeError(
            f"Optimizing the function bodies failed{in_pass}: {type(exc).__name__}: {exc}",
            hint="Pass optimize=False to export without onnxscript's optimizer.",
        )
    return ModularizeError(f"Building the function hierarchy failed{in_pass}: {type(exc).__name__}: {exc}")
