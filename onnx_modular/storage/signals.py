"""Signals around a save: SIGTERM handled like Ctrl-C while a save runs, and both deferred
through the few renames of a commit (:mod:`onnx_modular.storage.commit`), and through the CLI's
heavy imports (a signal inside a C extension's initialisation aborts the process)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

__all__ = ["Terminated", "interrupt_on_sigterm", "signals_deferred", "quiet_interrupt_while_importing", "end_quiet_interrupt"]


def _exit_interrupted(signum, frame):
    os.write(2, b"interrupted\n")
    os._exit(128 + signum)


def quiet_interrupt_while_importing() -> None:
    """For the command line only (``python -m onnx_modular``, ``onnx-modular``): Ctrl-C while the
    libraries import (the first half second, before any file is touched) exits 130 with one line,
    not an import traceback. :func:`end_quiet_interrupt` (the CLI's ``main``) gives SIGINT back to
    Python's ``KeyboardInterrupt``, which every cleanup relies on."""
    import sys

    argv = list(getattr(sys, "orig_argv", []))
    as_module = any(a == "-m" and b == "onnx_modular" for a, b in zip(argv, argv[1:]))
    as_script = len(argv) > 1 and os.path.basename(argv[1]) == "onnx-modular" or bool(argv) and os.path.basename(argv[0]) == "onnx-modular"
    if (as_module or as_script) and threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _exit_interrupted)


def end_quiet_interrupt() -> None:
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is _exit_interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived; raised like KeyboardInterrupt so that every cleanup runs."""

    signum = signal.SIGTERM


def _raise_terminated(signum, frame):
    raise Terminated()


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` (a ``KeyboardInterrupt``).

    Only in the main thread and only when SIGTERM still has its default action (a
    handler installed by the application is left alone).
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT/SIGTERM wait until the block ends (the few renames of a commit).

    Blocking the signals is not enough: a signal caught just before the block runs its
    Python handler at the next bytecode, inside the block. So the main thread's handlers
    are swapped for one that records the signal, which is handed to the previous handler
    once the block is done.
    """
    deferred = (signal.SIGINT, signal.SIGTERM)
    pending: list[int] = []
    previous_handlers = {}
    if threading.current_thread() is threading.main_thread():
        for signum in deferred:
            previous_handlers[signum] = signal.signal(signum, lambda signum, frame: pending.append(signum))
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(deferred))
    try:
        yield
    finally:
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    for signum in dict.fromkeys(pending):
        handler = previous_handlers.get(signum)
        if callable(handler):
            handler(signum, None)
        elif handler == signal.SIG_DFL:
            os.kill(os.getpid(), signum)
