"""The converted file runs: for :func:`onnx_modular.files.convert.tool.convert`, whether onnxruntime
opens it here, and when it does not run (or its outputs overflow), the module whose conversion
breaks it; the files' sizes."""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable, Mapping

import numpy as np
import onnx

from onnx_modular.check.drift import overflows
from onnx_modular.errors import InvalidInputError, RuntimeCrashError, VerificationError
from onnx_modular.format import metadata
from onnx_modular.runtime import sessions as runtime


def runnable(path: pathlib.Path, dtype: str | None, quantize: str | None) -> None:
    """The converted file opens in onnxruntime (in a child: a file it crashes on is not written), or a
    typed error says which dtype it lacks (:class:`RuntimeCrashError` when it crashes)."""
    try:
        runtime.opens_in_child(path, what="converted model")
    except RuntimeCrashError:
        raise
    except VerificationError as e:
        what = " + ".join(x for x in (dtype, quantize and f"{quantize} MatMulNBits") if x)
        raise InvalidInputError(
            f"onnxruntime cannot run the {what} model here: {str(e).splitlines()[0][:300]}",
            hint="Choose a dtype this onnxruntime provider has kernels for (float16 on CPU; bfloat16 needs "
            "a provider with bfloat16 kernels, such as CUDA), or keep the modules whose ops it lacks.",
        ) from e


def culprit(all_calls: Mapping[str, metadata.ExpandedCall], class_calls: Mapping[str, set[str]], kept: set[str],
             alone: Callable[[set[str]], float]) -> tuple[str, str, float] | None:
    """The (class, call, drift alone) whose conversion alone breaks the file (drift inf), or else
    moves the outputs most: classes in execution order, then that class's calls (up to 16)."""
    order = {name: index for index, name in enumerate(all_calls)}
    classes = sorted((c for c, names in class_calls.items() if names - kept), key=lambda c: min(order[n] for n in class_calls[c]))
    drifts = {}
    for name in classes:
        drifts[name] = alone(class_calls[name] - kept)
        if drifts[name] == math.inf:
            break
    if not drifts:
        return None
    worst = max(drifts, key=lambda c: drifts[c])  # the first failing class, or the one drifting most
    calls = sorted(class_calls[worst] - kept, key=order.get)
    first = calls[0]
    if len(calls) > 1 and len(calls) <= 16:
        for call in calls:
            if alone({call}) >= drifts[worst]:
                first = call
                break
    return worst, first, drifts[worst]


def crash_culprit(all_calls: Mapping[str, metadata.ExpandedCall], class_calls: Mapping[str, set[str]], kept: set[str],
                  opens: Callable[[set[str]], bool]) -> tuple[str, str, float] | None:
    """For a file onnxruntime crashes on: the (class, its first call, inf) whose calls kept in float32,
    everything else converted, give a file it opens; the class with the fewest calls first (no
    class converted alone need crash it: a chain across a call and its caller does)."""
    order = {name: index for index, name in enumerate(all_calls)}
    for name in sorted((c for c, names in class_calls.items() if names - kept), key=lambda c: (len(class_calls[c]), c)):
        if opens(class_calls[name] - kept):
            return name, min(class_calls[name] - kept, key=order.get), math.inf
    return None


def not_running(error: VerificationError, dtype: str, culprit: tuple[str, str, float] | None) -> VerificationError:
    """The converted file does not run: the error names the module whose conversion breaks it."""
    crashed = isinstance(error, RuntimeCrashError)
    cause = (str(error).split("] ", 1)[-1] if crashed else str(error).split(": ", 1)[-1]).splitlines()[0][:300]
    if culprit is None:
        return VerificationError(f"The {dtype} model does not run in onnxruntime: {cause}", hint="Keep modules in float32 (--keep NAME).")
    cls, call, drift = culprit
    if crashed:
        what, why = "with its calls kept in float32 (the rest converted) the file opens", "onnxruntime crashes on the ops its conversion makes"
    else:
        what = ("converting it alone already makes the file fail" if drift == math.inf else
                f"converted alone, it moves the outputs most ({drift:.3%} of their range)")
        why = f"a value it computes (a count, an index, a bin edge) likely rounds in {dtype} and a later op refuses it"
    return VerificationError(
        f"The {dtype} model does not run in onnxruntime ({cause}). Module {call!r} ({cls}): {what}; {why}.",
        hint=f"Keep it in float32: --keep {cls} (or --keep {call}), or let --auto-keep TOLERANCE choose. Nothing was written.",
    )


def refuse_overflow(dtype: str | None, actual: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray],
                    first: str | None, class_of: Mapping[str, str]) -> None:
    """A converted file whose outputs hold inf or NaN where the original's are finite is not
    written: the error names the outputs and ``first``, the first call (in finishing order) whose
    outputs overflow (found while both files' calls are compared, a batch at a time)."""
    outputs = [name for name, value in actual.items() if name in reference and overflows(value, reference[name])]
    if dtype is None or not outputs:
        return
    first = first if first in class_of else None
    where = f" The first call that overflows: {first!r} ({class_of[first]})." if first else ""
    keep = f"--keep {class_of[first]} (or --keep {first})" if first else "--keep NAME"
    raise VerificationError(
        f"The {dtype} model's outputs {', '.join(outputs[:4])} hold inf or NaN where the original's are finite: "
        f"{dtype} overflowed.{where} Nothing was written.",
        module_path=first,
        hint=f"Keep it in float32: {keep}, or let --auto-keep TOLERANCE choose. Values past {dtype}'s range on the "
        "verification inputs are kept float32 already: pass --inputs like the ones the model will see.",
    )


def source_bytes(source: pathlib.Path, model: onnx.ModelProto) -> int:
    """The size of ``source`` with its external data files."""
    return source.stat().st_size + sum(
        (source.parent / name).stat().st_size for name in _data_files(model) if (source.parent / name).is_file()
    )


def folder_bytes(folder: pathlib.Path) -> int:
    """The size of the files of ``folder`` (a staged output with its data)."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def _data_files(model: onnx.ModelProto) -> set[str]:
    files = set()
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            files |= {e.value for e in tensor.external_data if e.key == "location"}
    return files
