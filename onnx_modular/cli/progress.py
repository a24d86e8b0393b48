"""The command line's progress display.

Each stage prints one line on stderr when it ends (``  capture        1.23s``), as before. On a
terminal a live status line also shows the stage under way, its elapsed time and the total, and,
while the model is being written, the bytes written so far into this process's staging folder
next to the output (the weights of a big model stream there one tensor at a time); it is redrawn
a few times a second and erased before each stage line. When stderr is not a terminal (a pipe, a
log file, CI) nothing but the stage lines is written.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TextIO

from onnx_modular.errors import EXPORT_STAGES
from onnx_modular.storage import save

__all__ = ["Progress", "EXPORT_STAGES", "TokenProgress"]


_SPINNER = "|/-\\"


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


class Progress:
    """Stage lines, and a live status line when ``stream`` is a terminal.

    Args:
        stream: Where to write (stderr).
        stages: The stages in the order they end; the live line names the next one.
        output: The file being written: the bytes in this process's staging folder beside it
            are shown as "written".
        live: Force the live line on or off (default: on for a terminal).
        interval: Seconds between redraws.

    Example::

        with Progress(sys.stderr, EXPORT_STAGES, output="m.onnx") as progress:
            export_modular(model, args, "m.onnx", progress=progress)
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        stages: Sequence[str] = EXPORT_STAGES,
        *,
        output: str | os.PathLike | None = None,
        live: bool | None = None,
        interval: float = 0.25,
    ):
        self.stream = stream if stream is not None else sys.stderr
        self.stages = list(stages)
        self.live = is_terminal(self.stream) if live is None else live
        self.interval = interval
        self._folder = pathlib.Path(output).parent if output is not None else None
        self._current = self.stages[0] if self.stages else ""
        self._started = self._stage_started = time.perf_counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._drawn = False
        self._tick = 0

    # -- the callback export_modular calls ------------------------------------------------

    def __call__(self, stage: str, seconds: float) -> None:
        """``progress(stage, seconds)``: ``stage`` ended; print its line, move the live line on."""
        self.line(f"  {stage:<11} {seconds:7.2f}s")
        with self._lock:
            if stage in self.stages:
                following = self.stages[self.stages.index(stage) + 1 :]
                self._current = following[0] if following else ""
            self._stage_started = time.perf_counter()

    def start(self, stage: str) -> None:
        """Name the stage now under way (for callers that know when a stage begins)."""
        with self._lock:
            self._current = stage
            self._stage_started = time.perf_counter()

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[list[str]]:
        """``with progress.stage("load") as detail: ...; detail.append("(LlamaForCausalLM)")``."""
        self.start(name)
        detail: list[str] = []
        started = time.perf_counter()
        yield detail
        self.line(f"  {name:<11} {time.perf_counter() - started:7.2f}s" + (f"  {' '.join(detail)}" if detail else ""))

    def line(self, text: str) -> None:
        """Print a line on the stream (the live line is erased first and redrawn after)."""
        with self._lock:
            self._erase()
            print(text, file=self.stream, flush=True)

    # -- the live line ------------------------------------------------------------------------

    def __enter__(self) -> Progress:
        if self.live:
            self._thread = threading.Thread(target=self._run, name="onnx-modular-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._erase()

    def status(self) -> str:
        """The live line's text: stage, its time, the total, the bytes written."""
        now = time.perf_counter()
        self._tick += 1
        text = f"{_SPINNER[self._tick % len(_SPINNER)]} {self._current or 'finishing'} {now - self._stage_started:6.1f}s"
        text += f"  (total {now - self._started:.1f}s)"
        written = self.bytes_written()
        if written:
            text += f"  {written / 1e9:.2f} GB written"
        return text

    def bytes_written(self) -> int:
        """Bytes in this process's staging folders beside the output (the file being written)."""
        if self._folder is None:
            return 0
        total = 0
        with contextlib.suppress(OSError):
            for folder in self._folder.glob(f"{save.TEMP_PREFIX}{os.getpid()}-*"):
                for entry in os.scandir(folder):
                    with contextlib.suppress(OSError):
                        total += entry.stat(follow_symlinks=False).st_size
        return total

    def _run(self) -> None:
        # drawn at once, then every ``interval``: a stage that ends sooner still showed its line
        while True:
            with self._lock:
                text = self.status()
                self.stream.write("\r\033[K" + text)
                self.stream.flush()
                self._drawn = True
            if self._stop.wait(self.interval):
                return

    def _erase(self) -> None:
        if self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._drawn = False


class TokenProgress:
    """``progress(done, total)`` of :func:`onnx_modular.generate`: once a run has taken ``after``
    seconds, a line on ``stream`` every ``interval`` seconds (and at the end) with the tokens made,
    the rate and the time left, so a long generation is never silent::

          generate: 120 of 1000 new tokens, 24.1 tokens/s, about 37 s left
    """

    def __init__(self, stream: TextIO | None = None, *, after: float = 2.0, interval: float = 5.0):
        self.stream = stream if stream is not None else sys.stderr
        self.after, self.interval = after, interval
        self._started = time.perf_counter()
        self._printed: float | None = None

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        elapsed = now - self._started
        due = self._printed is None and elapsed >= self.after
        due = due or (self._printed is not None and (now - self._printed >= self.interval or done == total))
        if not due:
            return
        self._printed = now
        rate = done / elapsed if elapsed > 0 else 0.0
        left = f", about {(total - done) / rate:.0f} s left" if rate > 0 and done < total else ""
        print(f"  generate: {done} of {total} new tokens, {rate:.1f} tokens/s{left}", file=self.stream, flush=True)
