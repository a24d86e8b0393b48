"""Per-module parity: which module call drifts first, and how error grows with depth.

The ONNX side is observed by :mod:`onnx_modular.calls.capture` (every module call's outputs
from one onnxruntime run of an instrumented copy of the real model; see docs/verification.md).

The PyTorch side is captured with forward hooks keyed by module path and call index,
the same keys that name the call nodes (``h.0.attn``, ``shared@1``).
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from onnx_modular.calls.capture import flatten_probes, instrument
from onnx_modular.capture import tensors
from onnx_modular.capture.call_hooks import call_hooks
from onnx_modular.check import parity
from onnx_modular.check.parity import Parity, Tolerance, default_tolerance
from onnx_modular.format import metadata
from onnx_modular.runtime import sessions as runtime
from onnx_modular.storage.checks import check_expanded_size
from onnx_modular.storage.load import load_model_file
from onnx_modular.storage.scratch import scratch_model_file

__all__ = [
    "LocalizationReport",
    "localize",
    "capture_module_outputs",
]


@dataclasses.dataclass
class LocalizationReport:
    """Per-module errors in the order the calls finish (children before their parent): one
    :class:`~onnx_modular.check.parity.Parity` row (``kind="call"``) per module call."""

    modules: list[Parity]
    tolerance: Tolerance | None

    @property
    def ok(self) -> bool:
        return all(m.ok for m in self.modules)

    @property
    def first_failure(self) -> Parity | None:
        """The first module call, in completion order, whose error exceeds tolerance."""
        return next((m for m in self.modules if not m.ok), None)

    def by_depth(self) -> dict[int, float]:
        """Largest max-abs error at each nesting depth."""
        result: dict[int, float] = {}
        for m in self.modules:
            result[m.depth] = max(result.get(m.depth, 0.0), m.max_abs)
        return dict(sorted(result.items()))

    def to_dict(self) -> dict[str, Any]:
        first = self.first_failure
        return {
            "ok": self.ok,
            "first_failure": first.call_name if first else None,
            "max_abs_by_depth": self.by_depth(),
            "modules": [m.to_dict() for m in self.modules],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        width = parity.name_column_width((m.call_name for m in self.modules), minimum=40, maximum=72)
        header = f"{'#':>4} {'module call':<{width}} {'function':<24} {'depth':>5} {'max abs':>10} {'max rel':>10}  ok"
        lines = ["Per-module parity (onnxruntime vs PyTorch, in completion order)", header, "-" * len(header)]
        first = self.first_failure
        for i, m in enumerate(self.modules):
            mark = "yes" if m.ok else ("NO  <- first to drift" if m is first else "NO")
            lines.append(
                f"{i:>4} {parity.fit_name(m.call_name, width):<{width}} {m.function[:24]:<24} {m.depth:>5} {m.max_abs:>10.2e} {m.max_rel:>10.2e}  {mark}"
            )
        growth = ", ".join(f"depth {d}: {v:.1e}" for d, v in self.by_depth().items())
        lines.append(f"max abs error by depth: {growth}")
        lines.append(f"first module to drift: {first.call_name} ({first.function})" if first else "no module drifts")
        return "\n".join(lines)

    def save_html(self, path: str | os.PathLike) -> pathlib.Path:
        """A self-contained HTML page with a bar chart of error per module (log scale), written as
        every report is (:func:`~onnx_modular.storage.save.write_text`: atomically, a link replaced
        rather than followed, a FIFO or a device refused, an existing file's mode kept)."""
        from onnx_modular.storage.save import write_text

        return write_text(path, _html_page(self))


def _html_page(report: LocalizationReport) -> str:
    """An SVG bar chart, log scale, with a dashed line at the absolute tolerance."""
    rows = report.modules
    width, bar_height, left, right = 900, 16, 330, 70  # right: room for the value labels
    height = bar_height * len(rows) + 60
    floor = 1e-12
    values = [max(m.max_abs, floor) for m in rows]
    atols = [m.atol for m in rows if m.atol]
    atol = min(atols) if atols else None
    # The axis ends on a labelled tick at or above the largest error and the tolerance.
    log_min = np.log10(floor)
    log_max = float(np.ceil(np.log10(max(values + [atol or 0.0, 1e-3]))))
    if (log_max - log_min) % 2:
        log_max += 1  # ticks every two decades from 1e-12: the last one sits at the end of the axis
    span = width - left - right

    def scale(v: float) -> float:
        return (np.log10(max(v, floor)) - log_min) / (log_max - log_min) * span

    first = report.first_failure
    bars = []
    for i, (m, v) in enumerate(zip(rows, values)):
        y = 40 + i * bar_height
        color = "#d62728" if not m.ok else "#1f77b4"
        if m is first:
            color = "#ff7f0e"
        label = html.escape(("  " * (m.depth - 1)) + m.call_name)
        bars.append(
            f'<text x="{left - 6}" y="{y + 12}" text-anchor="end" font-size="11">{label}</text>'
            f'<rect x="{left}" y="{y + 2}" width="{scale(v):.1f}" height="{bar_height - 4}" fill="{color}">'
            f"<title>{html.escape(m.call_name)} ({html.escape(m.function)}): max abs {m.max_abs:.3e}, max rel {m.max_rel:.3e}</title></rect>"
            f'<text x="{left + scale(v) + 4:.1f}" y="{y + 12}" font-size="10">{m.max_abs:.1e}</text>'
        )
    ticks = []
    for exponent in range(int(log_min), int(log_max) + 1, 2):
        x = left + scale(10.0**exponent)
        anchor = "end" if exponent == int(log_max) else "middle"
        ticks.append(
            f'<line x1="{x:.1f}" y1="30" x2="{x:.1f}" y2="{height - 20}" stroke="#ddd"/>'
            f'<text x="{x:.1f}" y="24" font-size="10" text-anchor="{anchor}">1e{exponent}</text>'
        )
    if atol is not None:
        x = left + scale(atol)
        ticks.append(
            f'<line class="tolerance" x1="{x:.1f}" y1="30" x2="{x:.1f}" y2="{height - 20}" stroke="#d62728" '
            f'stroke-dasharray="4 3"/><text x="{x:.1f}" y="{height - 6}" font-size="10" text-anchor="middle" '
            f'fill="#d62728">atol {atol:.0e}</text>'
        )
    title = f"first module to drift: {first.call_name}" if first else "no module drifts"
    svg = f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">{"".join(ticks)}{"".join(bars)}</svg>'
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>onnx_modular per-module parity</title></head>"
        f"<body><h2>Per-module error, onnxruntime vs PyTorch (max abs, log scale)</h2><p>{html.escape(title)}. "
        "Orange: first module beyond tolerance; red: beyond tolerance; blue: within; "
        "dashed line: the absolute tolerance.</p>"
        f"{svg}<pre>{html.escape(str(report))}</pre></body></html>"
    )


# -- the PyTorch side -----------------------------------------------------------------


def capture_module_outputs(
    model: torch.nn.Module, args: tuple, kwargs: dict | None = None
) -> tuple[Any, dict[tuple[str, int], list[torch.Tensor]]]:
    """Run ``model`` once; return its output and every call's output tensors by (path, call index)."""
    captured: dict[tuple[str, int], list[torch.Tensor]] = {}

    def record(path: str, index: int, module, hook_args, hook_kwargs, output) -> None:
        captured[(path, index)] = [t.detach().clone() for t in tensors.flatten_outputs(output)]

    args, kwargs = tensors.copy_inputs(args, kwargs or {})  # a cache grows in place
    with call_hooks(model, post=record, paths=[path for path, _ in model.named_modules() if path]), torch.no_grad():
        output = model(*args, **kwargs)
    return output, captured


def _compare_call(onnx_values: Sequence[np.ndarray], torch_values: Sequence[torch.Tensor], tolerance: Tolerance | None):
    """Match each ONNX output to the first unused torch output of equal shape; return errors."""
    used: set[int] = set()
    max_abs = max_rel = 0.0
    compared = 0
    ok = True
    used_tolerance: Tolerance | None = None
    for value in onnx_values:
        value = np.asarray(value)
        for j, tensor in enumerate(torch_values):
            if j in used or tuple(tensor.shape) != value.shape:
                continue
            used.add(j)
            reference = tensors.to_numpy(tensor)
            tol = tolerance or default_tolerance(tensor.dtype)
            if used_tolerance is None or tol.atol < used_tolerance.atol:
                used_tolerance = tol  # the tightest one, shown on the chart
            abs_error, rel_error = parity.max_differences(value, reference)
            max_abs, max_rel = max(max_abs, abs_error), max(max_rel, rel_error)
            ok = ok and parity.allclose(value, reference, tol)
            compared += 1
            break
    return max_abs, max_rel, compared, ok, used_tolerance


def localize(
    onnx_model: ir.Model | str | os.PathLike,
    torch_model: torch.nn.Module,
    args: tuple | None = None,
    kwargs: dict | None = None,
    *,
    tolerance: Tolerance | None = None,
    execution_provider: str | None = None,
) -> LocalizationReport:
    """Compare every module call of a modular ONNX model with the same call in PyTorch.

    Args:
        onnx_model: A modular model (``ir.Model``, or the path of a saved file).
        torch_model: The PyTorch model it was exported from.
        args, kwargs: Inputs (any shape the export allows), the export's ``fixed_inputs`` among
            ``kwargs`` (PyTorch takes them; the file, which lists them in its metadata, does not).
        tolerance: Overrides the per-dtype default tolerance.
        execution_provider: onnxruntime's provider (CPU by default), as in
            :func:`onnx_modular.runtime.sessions.session`.

    Example::

        report = localize("gpt2.onnx", model, (input_ids,))
        print(report.first_failure)   # None, or the first module call beyond tolerance
    """
    args, kwargs = tensors.normalize_inputs(args, kwargs, torch_model)
    if isinstance(onnx_model, ir.Model):
        model = ir.serde.deserialize_model(ir.serde.serialize_model(onnx_model))
        near = None
    else:
        # The file tools' bounded loading: special files, bad external-data references and
        # call-expansion bombs are refused before onnxruntime sees anything.
        near = pathlib.Path(onnx_model)
        proto = load_model_file(near)
        check_expanded_size(proto, name=repr(str(onnx_model)))
        model = ir.serde.deserialize_model(proto)
        del proto
    original_outputs = len(model.graph.outputs)
    probes = instrument(model)
    counter = metadata.CallCounter()
    entries = flatten_probes(probes, None, "", 1, [], counter, metadata.NoOpCalls(model.graph, None, None, counter, True))

    fixed = json.loads(model.metadata_props.get(metadata.FIXED_INPUTS, "{}"))  # PyTorch's, not the file's
    feeds = [
        tensors.to_numpy(t)
        for t in tensors.flatten_inputs(args, {key: value for key, value in kwargs.items() if key not in fixed})
    ]
    if near is None:
        with scratch_model_file(model, name="instrumented.onnx", external_data=False) as path:
            values = runtime.run(
                path, feeds, what="instrumented model", execution_provider=execution_provider
            )[1][original_outputs:]
    else:  # in memory, its external data read from the file's folder: nothing written next to it
        values = runtime.run(
            ir.serde.serialize_model(model).SerializeToString(),
            feeds,
            what="instrumented model",
            execution_provider=execution_provider,
            external_data_folder=near.resolve().parent,
        )[1][original_outputs:]
    _, captured = capture_module_outputs(torch_model, args, kwargs)

    results = []
    for call_name, module_path, index, function, depth, (begin, end) in entries:
        torch_values = captured.get((module_path, index), [])
        max_abs, max_rel, compared, ok, used = _compare_call(values[begin:end], torch_values, tolerance)
        results.append(
            Parity(
                call_name, kind="call", module_path=module_path, call_index=index, function=function, depth=depth,
                modular_max_abs=max_abs, modular_max_rel=max_rel, outputs_compared=compared, ok=ok, tolerance=used,
            )
        )
    return LocalizationReport(results, tolerance)
