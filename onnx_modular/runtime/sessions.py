"""onnxruntime for the file tools and verification: sessions, runs, and the inlined flat copy.

Copies of a file made for onnxruntime (the inlined flat copy, an instrumented copy) are
handed over in memory, with the file's folder as the place of their external data
(``external_data_folder``: onnxruntime's ``session.model_external_initializers_file_folder_path``),
so nothing is written next to the user's model. An in-memory model that must be written
goes into a private temporary folder (:func:`~onnx_modular.storage.locks.scratch_file`, the
one home of temporary files), removed afterwards whatever happens.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from onnx_modular.errors import ExecutionProviderError, RuntimeCrashError, VerificationError
from onnx_modular.format.text import first_line
from onnx_modular.storage.checks import LOOP_SECONDS_VARIABLE, loop_run_seconds
from onnx_modular.storage.locks import scratch_file
from onnx_modular.storage.proto import inline_functions, uses_external_data

__all__ = [
    "execution_providers",
    "session",
    "run",
    "scratch_file",
    "flat_copy",
    "external_data_folder",
]



def execution_providers(execution_provider: str | None = None) -> list[str]:
    """onnxruntime's provider list for ``execution_provider`` (CPU when ``None``), with CPU kept as
    the fallback for the operators another provider does not run.

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


def session(
    model: str | os.PathLike | bytes,
    execution_provider: str | None = None,
    *,
    external_data_folder: str | os.PathLike | None = None,
    configure: Callable[[Any], None] | None = None,
    prepacking: bool = True,
    disabled_optimizers: Sequence[str] = (),
    arena: bool = True,
    what: str = "model",
):
    """An ``onnxruntime.InferenceSession`` (CPU unless ``execution_provider``) with warnings silenced.

    ``external_data_folder``: where a serialized ``model`` (bytes) finds its external data.
    ``configure``: called with the ``SessionOptions`` before the session is made (profiling,
    threads, optimization level).
    ``prepacking=False``: no pre-packed copies of the weights (the block-wise check holds one
    block's weights once).
    ``disabled_optimizers``: onnxruntime graph transformers not to run, by name.
    ``arena=False``: no CPU memory arena, for a session made for one run. The arena grows by
    doubling and reserves address space it never touches: SegGPT's run at 448x448 peaks at 4.1 GB
    of address space without it and 7.0 GB with it (3.9 GB resident either way), which a process
    under an address-space limit (``ulimit -v``) cannot have; a second run would reuse it.

    Raises:
        ExecutionProviderError: This onnxruntime build lacks the provider.
        VerificationError: onnxruntime cannot load the model.
    """
    import onnxruntime as ort

    providers = execution_providers(execution_provider)
    # onnxruntime's default logger prints coloured warnings and errors to stderr (with node names
    # from the file, unescaped) before the session's own options apply; its errors reach us as
    # exceptions, and ours say what went wrong, escaped: fatal messages only.
    ort.set_default_logger_severity(4)
    options = ort.SessionOptions()
    options.log_severity_level = 4
    if not prepacking:
        options.add_session_config_entry("session.disable_prepacking", "1")
    options.enable_cpu_mem_arena = arena
    if external_data_folder is not None:
        options.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", os.path.abspath(external_data_folder)
        )
    if configure is not None:
        configure(options)
    try:
        return ort.InferenceSession(model if isinstance(model, bytes) else str(model), options, providers=providers,
                                    disabled_optimizers=list(disabled_optimizers) or None)
    except Exception as e:  # onnxruntime raises its own exception types
        raise VerificationError(f"onnxruntime cannot load the {what}: {first_line(e)}", hint=_load_hint(str(e), what)) from e


#: :func:`opens_in_child`'s child: a session as :func:`session` makes one (no pre-packed weights,
#: one thread: only whether it opens counts); onnxruntime's own error on stderr, exit code 3
_OPEN = """
import sys
import onnxruntime as ort
ort.set_default_logger_severity(4)
options = ort.SessionOptions()
options.log_severity_level = 4
options.intra_op_num_threads = 1
options.add_session_config_entry("session.disable_prepacking", "1")
try:
    ort.InferenceSession(sys.argv[1], options, providers=sys.argv[2].split(","))
except Exception as e:
    sys.stderr.write(str(e))
    sys.exit(3)
"""


def opens_in_child(path: str | os.PathLike, execution_provider: str | None = None, *, what: str = "model") -> None:
    """onnxruntime opens the file ``path`` in a child interpreter.

    onnxruntime's graph optimizers can end the process with a signal on a file the checker accepts
    (its NCHWc transformer on a float16 ``MatMul -> Reshape -> Transpose -> MatMul`` chain,
    onnxruntime 1.32). A file this package is about to write is opened here first: the crash
    becomes a typed error, and this process goes on to remove its scratch files.

    Raises:
        RuntimeCrashError: The child ended with a signal (or another unexpected exit).
        VerificationError: onnxruntime cannot load the file (its message).
    """
    providers = execution_providers(execution_provider)
    child = subprocess.run([sys.executable, "-c", _OPEN, os.fspath(path), ",".join(providers)],
                           capture_output=True, text=True, errors="replace", check=False)
    if child.returncode == 3:
        said = (child.stderr.strip().splitlines() or ["(no message)"])[0][:400]
        raise VerificationError(f"onnxruntime cannot load the {what}: {said}",
                                hint=_load_hint(child.stderr, what))
    if child.returncode != 0:
        how = f"signal {_signal_name(-child.returncode)}" if child.returncode < 0 else f"exit code {child.returncode}"
        raise RuntimeCrashError(
            f"onnxruntime crashes ({how}) creating a session for the {what}: a bug of onnxruntime's graph optimizers "
            "on this file, which it would end any process with.",
            hint="Nothing was written. Keep the modules whose conversion makes the ops it crashes on in float32 "
            "(the error of the tool that raised this names one), and report the file to onnxruntime.",
        )


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _load_hint(message: str, what: str) -> str:
    """What to do when onnxruntime rejects a model, by the kind of its complaint."""
    if "NOT_IMPLEMENTED" in message or "Could not find an implementation" in message:
        return (
            "onnxruntime has no kernel for an operator with these dtypes (bfloat16 arithmetic on CPU, "
            "for one); verify a float32/float16 export, or use an execution provider that has it."
        )
    if what != "model":
        return (
            f"The {what} is made by onnx.inliner from a file onnxruntime loads; skip it with "
            "verify_flat=False (flat=False in check_file) and report the model."
        )
    return "The file is not valid for onnxruntime; check it with `onnx-modular tree` and onnx.checker, and report the model."


def run(
    model,
    feeds: Mapping[str, np.ndarray] | Sequence[np.ndarray],
    *,
    what: str = "model",
    execution_provider: str | None = None,
    external_data_folder: str | os.PathLike | None = None,
    copy: bool = True,
) -> tuple[list[str], list[np.ndarray]]:
    """Run a model on ``feeds`` (by name, or one array per input in order).

    ``model`` is a file path or a serialized model (run in a session of its own, without the memory
    arena: see :func:`session`), or an open session (which is reused).
    ``copy=False``: the output arrays are onnxruntime's own (for a session without the CPU memory
    arena, whose outputs hold only their own memory; see below).

    Returns:
        (output names, output arrays).

    Raises:
        VerificationError: The model cannot be loaded or run, or the inputs do not fit.
    """
    sess = (
        model
        if hasattr(model, "get_inputs")
        else session(model, execution_provider, external_data_folder=external_data_folder, arena=False, what=what)
    )
    names = [i.name for i in sess.get_inputs()]
    if not isinstance(feeds, Mapping):
        feeds = list(feeds)
        if len(feeds) != len(names):
            raise VerificationError(
                f"The {what} has {len(names)} inputs ({', '.join(names)}) but {len(feeds)} tensors were given.",
                hint="Give one tensor per model input, in order.",
            )
        feeds = dict(zip(names, feeds))
    seconds = loop_run_seconds()  # a Loop decided at run time: onnxruntime is stopped after this long
    options = _run_options() if seconds else None
    timer = threading.Timer(seconds, setattr, (options, "terminate", True)) if seconds else None
    try:
        if timer is not None:
            timer.start()
        outputs = sess.run(None, {name: np.asarray(value) for name, value in feeds.items()}, options)
    except Exception as e:
        if options is not None and options.terminate:
            raise VerificationError(
                f"The {what} ran longer than {seconds} s and was stopped: it holds a Loop whose trip count is decided "
                "at run time, which may never end.",
                hint=f"If the model is genuine and slow, raise the limit with the environment variable {LOOP_SECONDS_VARIABLE}.",
            ) from e
        raise VerificationError(
            f"onnxruntime failed to run the {what}: {first_line(e)}",
            hint="Check the inputs against the model's declared inputs (names, shapes, dtypes).",
        ) from e
    finally:
        if timer is not None:
            timer.cancel()
    # onnxruntime's output arrays live in the session's memory arena and keep all of it (4.2 GB for
    # SegGPT at 448x448) alive as long as they do: copies free the arena with the session, so that
    # a second session (the inlined flat copy) does not run beside the first one's memory.
    if copy:
        outputs = [np.array(output, copy=True) if isinstance(output, np.ndarray) else output for output in outputs]
    return [o.name for o in sess.get_outputs()], outputs



def _run_options():
    import onnxruntime as ort

    return ort.RunOptions()


def flat_copy(path: str | os.PathLike, model: onnx.ModelProto | None = None) -> bytes:
    """The model at ``path`` with every local function inlined (``onnx.inliner``), serialized for :func:`run`.

    Weights are not loaded: external-data references are kept as they are, so run the copy
    with ``external_data_folder=`` the model's folder (:func:`external_data_folder`); nothing
    is written to disk.
    """
    if model is None:
        model = onnx.load(str(path), load_external_data=False)
    try:
        flat = inline_functions(model)
    except (onnx.checker.ValidationError, RuntimeError) as e:
        raise VerificationError(
            f"onnx.inliner cannot inline the model: {first_line(e)}",
            hint="Check the file with `onnx-modular tree`; skip the flat copy with flat=False.",
        ) from e
    try:
        return flat.SerializeToString()
    except ValueError as e:  # over protobuf's 2 GiB: weights stored in the graph
        raise VerificationError(
            f"The inlined copy of {str(path)!r} exceeds protobuf's 2 GiB limit: {first_line(e)}",
            hint="Save the model with external data (export_modular(..., external_data=True)).",
        ) from e


def external_data_folder(path: str | os.PathLike, model: onnx.ModelProto) -> str | None:
    """The folder a copy of the model at ``path`` reads its external data from (``None`` without)."""
    return os.path.dirname(os.path.abspath(path)) if uses_external_data(model) else None
