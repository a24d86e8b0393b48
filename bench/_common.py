"""Shared helpers for the benchmarks: timing, file sizes, onnxruntime sessions."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import statistics
import sys
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")

from helpers import graph_bytes  # noqa: E402,F401  (one definition, shared with the tests)


def median_time(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


@contextlib.contextmanager
def quiet():
    """torch.onnx.export prints progress lines; keep the benchmark output readable."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def flat_export(model, args, kwargs, path, dynamic_shapes=None):
    with quiet():
        torch.onnx.export(model, args, str(path), kwargs=kwargs, dynamo=True, verbose=False,
                          dynamic_shapes=dynamic_shapes)


def ort_session(path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def feeds_for(session, inputs):
    return {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs)}


def run_latency(session, feeds, runs: int, warmup: bool = True) -> float:
    """The median seconds of ``runs`` runs (after one warm-up run unless ``warmup`` is false:
    a benchmark that takes turns between files warms them up once, before its rounds)."""
    if warmup:
        session.run(None, feeds)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def max_abs(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))
