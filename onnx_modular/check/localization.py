"""Per-module parity: which module call drifts first, and how error grows with depth.

How the ONNX side is observed (see docs/verification.md): a copy of the modular model is
*instrumented* so that every module call's outputs become extra outputs, all the way up
to the main graph. Each function body gets extra outputs for the calls it makes (and,
recursively, for what those calls expose), and every call node gets matching extra
outputs. A function shared by several calls (deduplication, repeated calls) is
instrumented once, yet each call site yields its own values, so every call in the
expanded hierarchy is observed exactly once, with onnxruntime running the real model
(no inlining, no re-export).

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
import onnx_ir.passes.common as common_passes
import torch

from onnx_modular.capture.call_hooks import call_hooks
from onnx_modular.check import tensors
from onnx_modular.files import parity, runtime
from onnx_modular.files.checks import check_expanded_size
from onnx_modular.files.load import load_model_file
from onnx_modular.files.parity import Parity, Tolerance, default_tolerance
from onnx_modular.format import metadata

__all__ = [
    "LocalizationReport",
    "localize",
    "capture_module_outputs",
    "instrument",
]


@dataclasses.dataclass
class LocalizationReport:
    """Per-module errors in the order the calls finish (children before their parent): one
    :class:`~onnx_modular.files.parity.Parity` row (``kind="call"``) per module call."""

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
        """A self-contained HTML page with a bar chart of error per module (log scale)."""
        path = pathlib.Path(path)
        path.write_text(_html_page(self), encoding="utf-8")
        return path


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


# -- the ONNX side ----------------------------------------------------------------------


@dataclasses.dataclass
class _Probe:
    """One call node in a body; its observed values are its outputs then its callee's probes'."""

    node_name: str
    module_path: str | None
    function: str
    num_outputs: int
    callee_representative: str
    children: list[_Probe]
    callee: Any = None  # the function, for its recorded calls without ops

    @property
    def width(self) -> int:
        return self.num_outputs + sum(child.width for child in self.children)


def _module_functions(model: ir.Model) -> dict[ir.OperatorIdentifier, ir.Function]:
    return {k: f for k, f in model.functions.items() if metadata.is_module_function(f)}


def _representative(function: ir.Function) -> str:
    return metadata.body_module_path(function) or ""


def instrument(model: ir.Model) -> list[_Probe]:
    """Expose every module call's outputs as graph outputs (in place). Returns the probe tree."""
    functions = _module_functions(model)
    default_opset = model.opset_imports.get("", 18)
    done: dict[ir.OperatorIdentifier, list[_Probe]] = {}

    def instrument_body(container, is_root: bool) -> list[_Probe]:
        probes: list[_Probe] = []
        exposed: list[ir.Value] = []
        for node in list(container):
            function = functions.get(node.op_identifier())
            if function is None:
                continue
            original = len(node.outputs)
            if node.op_identifier() not in done:
                done[node.op_identifier()] = []  # guards against recursion in broken files
                done[node.op_identifier()] = instrument_function(function)
            children = done[node.op_identifier()]
            extra = sum(child.width for child in children)
            node.resize_outputs(original + extra)
            for value in node.outputs[original:]:
                value.name = None
            probes.append(
                _Probe(node.name or "", node.metadata_props.get(metadata.MODULE_PATH), function.name, original,
                       _representative(function), children, function)
            )
            exposed.extend(node.outputs)
        if exposed and not is_root:
            container.opset_imports.setdefault("", default_opset)
        for value in exposed:
            probe_value = ir.Value(name=None, type=value.type, shape=value.shape)
            container.append(ir.Node("", "Identity", [value], outputs=[probe_value]))
            container.outputs.append(probe_value)
        return probes

    def instrument_function(function: ir.Function) -> list[_Probe]:
        return instrument_body(function, is_root=False)

    probes = instrument_body(model.graph, is_root=True)
    # Name the new values so that the model is valid and outputs are addressable.
    common_passes.NameFixPass()(model)
    return probes


def _flatten(
    probes: list[_Probe],
    caller: str | None,
    representative: str,
    depth: int,
    out: list,
    counter: metadata.CallCounter,
    no_ops: metadata.NoOpCalls,
    exact: bool = True,
) -> list:
    """Expand probes into (call name, path, index, function, depth, slice of values) in completion order.

    Call indices count calls in execution order, the body's recorded calls without ops included.
    """
    start = 0
    starts = []
    for probe in probes:
        starts.append(start)
        start += probe.width
    for probe, offset in zip(probes, starts):
        no_ops.before_next()
        path = metadata.resolve_module_path(probe.node_name, probe.module_path, caller, representative or None)
        name = counter.name(path, probe.node_name, exact) if probe.module_path is not None else counter(path)
        index = metadata.split_call_name(name)[1]
        entry_children: list = []
        inner = probe.callee_representative or None
        inner_exact = probe.callee is not None and name == metadata.first_call(probe.callee)
        _flatten(probe.children, name, probe.callee_representative, depth + 1, entry_children, counter,
                 metadata.NoOpCalls(probe.callee, name, inner, counter, inner_exact), inner_exact)
        for child in entry_children:
            out.append((*child[:5], (offset + probe.num_outputs + child[5][0], offset + probe.num_outputs + child[5][1])))
        out.append((name, path, index, probe.function, depth, (offset, offset + probe.num_outputs)))
    no_ops.rest()
    return out


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
        args, kwargs: Inputs (any shape the export allows).
        tolerance: Overrides the per-dtype default tolerance.
        execution_provider: onnxruntime's provider (CPU by default), as in
            :func:`onnx_modular.files.runtime.session`.

    Example::

        report = localize("gpt2.onnx", model, (input_ids,))
        print(report.first_failure)   # None, or the first module call beyond tolerance
    """
    args, kwargs = tensors.normalize_inputs(args, kwargs)
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
    entries = _flatten(probes, None, "", 1, [], counter, metadata.NoOpCalls(model.graph, None, None, counter, True))

    feeds = [tensors.to_numpy(t) for t in tensors.flatten_inputs(args, kwargs)]
    if near is None:
        with runtime.scratch_file(None, "instrumented.onnx") as path:
            ir.save(model, path)
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
