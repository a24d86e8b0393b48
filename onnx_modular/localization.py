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
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import torch

from onnx_modular import inspect_model, verification
from onnx_modular.verification import Tolerance, default_tolerance

__all__ = [
    "ModuleParity",
    "LocalizationReport",
    "localize",
    "capture_module_outputs",
    "instrument",
    "verify",
    "VerificationReport",
]

_CLASS_KEY = "pkg.onnx_modular.class"
_PATH_KEY = "pkg.onnx_modular.module_path"


@dataclasses.dataclass
class ModuleParity:
    """Error of one module call's outputs, onnxruntime against PyTorch."""

    call_name: str
    module_path: str
    call_index: int
    function: str
    depth: int
    max_abs: float
    max_rel: float
    outputs_compared: int
    ok: bool


@dataclasses.dataclass
class LocalizationReport:
    """Per-module errors in the order the calls finish (children before their parent)."""

    modules: list[ModuleParity]
    tolerance: Tolerance | None

    @property
    def ok(self) -> bool:
        return all(m.ok for m in self.modules)

    @property
    def first_failure(self) -> ModuleParity | None:
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
            "modules": [dataclasses.asdict(m) for m in self.modules],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        width = verification.name_column_width((m.call_name for m in self.modules), minimum=40, maximum=72)
        header = f"{'#':>4} {'module call':<{width}} {'function':<24} {'depth':>5} {'max abs':>10} {'max rel':>10}  ok"
        lines = ["Per-module parity (onnxruntime vs PyTorch, in completion order)", header, "-" * len(header)]
        first = self.first_failure
        for i, m in enumerate(self.modules):
            mark = "yes" if m.ok else ("NO  <- first to drift" if m is first else "NO")
            lines.append(
                f"{i:>4} {verification.fit_name(m.call_name, width):<{width}} {m.function[:24]:<24} {m.depth:>5} {m.max_abs:>10.2e} {m.max_rel:>10.2e}  {mark}"
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
    rows = report.modules
    width, bar_height, left = 900, 16, 330
    height = bar_height * len(rows) + 60
    floor = 1e-12
    values = [max(m.max_abs, floor) for m in rows]
    top = max(values + [1e-3])
    log_min, log_max = np.log10(floor), np.log10(top) + 0.5
    scale = lambda v: (np.log10(max(v, floor)) - log_min) / (log_max - log_min) * (width - left - 20)  # noqa: E731
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
    for exponent in range(int(log_min), int(np.ceil(log_max)) + 1, 2):
        x = left + scale(10.0**exponent)
        ticks.append(f'<line x1="{x:.1f}" y1="30" x2="{x:.1f}" y2="{height - 20}" stroke="#ddd"/>'
                     f'<text x="{x:.1f}" y="24" font-size="10" text-anchor="middle">1e{exponent}</text>')
    title = f"first module to drift: {first.call_name}" if first else "no module drifts"
    svg = f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">{"".join(ticks)}{"".join(bars)}</svg>'
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>onnx_modular per-module parity</title></head>"
        f"<body><h2>Per-module error, onnxruntime vs PyTorch (max abs, log scale)</h2><p>{html.escape(title)}. "
        "Orange: first module beyond tolerance; red: beyond tolerance; blue: within.</p>"
        f"{svg}<pre>{html.escape(str(report))}</pre></body></html>"
    )


# -- the PyTorch side -----------------------------------------------------------------


def capture_module_outputs(
    model: torch.nn.Module, args: tuple, kwargs: dict | None = None
) -> tuple[Any, dict[tuple[str, int], list[torch.Tensor]]]:
    """Run ``model`` once; return its output and every call's output tensors by (path, call index)."""
    captured: dict[tuple[str, int], list[torch.Tensor]] = {}
    counts: dict[str, int] = {}
    handles = []

    def make_hook(path: str):
        def hook(module, hook_args, output):
            index = counts.get(path, 0)
            counts[path] = index + 1
            captured[(path, index)] = [t.detach().clone() for t in verification.flatten_outputs(output)]

        return hook

    for path, module in model.named_modules():
        if path:
            handles.append(module.register_forward_hook(make_hook(path)))
    args, kwargs = verification.copy_inputs(args, kwargs or {})  # a cache grows in place
    try:
        with torch.no_grad():
            output = model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return output, captured


# -- the ONNX side ----------------------------------------------------------------------


@dataclasses.dataclass
class _Probe:
    """One call node in a body; its observed values are its outputs then its callee's probes'."""

    module_path: str
    function: str
    num_outputs: int
    callee_representative: str
    children: list[_Probe]

    @property
    def width(self) -> int:
        return self.num_outputs + sum(child.width for child in self.children)


def _module_functions(model: ir.Model) -> dict[ir.OperatorIdentifier, ir.Function]:
    return {k: f for k, f in model.functions.items() if _CLASS_KEY in f.metadata_props}


def _representative(function: ir.Function) -> str:
    paths = json.loads(function.metadata_props.get("pkg.onnx_modular.module_paths", "[]"))
    return paths[0].split("@", 1)[0] if paths else ""


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
                _Probe(node.metadata_props.get(_PATH_KEY, node.name or ""), function.name, original,
                       _representative(function), children)
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


def _flatten(probes: list[_Probe], caller_path: str, representative: str, depth: int, out: list, counters: dict) -> list:
    """Expand probes into (call name, path, index, function, depth, slice of values) in completion order."""
    start = 0
    starts = []
    for probe in probes:
        starts.append(start)
        start += probe.width
    for probe, offset in zip(probes, starts):
        path = probe.module_path
        if representative and path.startswith(representative + ".") and caller_path is not None:
            path = caller_path + path[len(representative):]
        index = counters.get(path, 0)
        counters[path] = index + 1
        entry_children: list = []
        _flatten(probe.children, path, probe.callee_representative, depth + 1, entry_children, counters)
        for child in entry_children:
            out.append((*child[:5], (offset + probe.num_outputs + child[5][0], offset + probe.num_outputs + child[5][1])))
        call_name = f"{path}@{index}" if index else path
        out.append((call_name, path, index, probe.function, depth, (offset, offset + probe.num_outputs)))
    return out


def _compare_call(onnx_values: Sequence[np.ndarray], torch_values: Sequence[torch.Tensor], tolerance: Tolerance | None):
    """Match each ONNX output to the first unused torch output of equal shape; return errors."""
    used: set[int] = set()
    max_abs = max_rel = 0.0
    compared = 0
    ok = True
    for value in onnx_values:
        value = np.asarray(value)
        for j, tensor in enumerate(torch_values):
            if j in used or tuple(tensor.shape) != value.shape:
                continue
            used.add(j)
            reference = verification._to_numpy(tensor)
            tol = tolerance or default_tolerance(tensor.dtype)
            abs_error, rel_error = verification.max_differences(value, reference)
            max_abs, max_rel = max(max_abs, abs_error), max(max_rel, rel_error)
            ok = ok and verification.allclose(value, reference, tol)
            compared += 1
            break
    return max_abs, max_rel, compared, ok


def localize(
    onnx_model: ir.Model | str | os.PathLike,
    torch_model: torch.nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    *,
    tolerance: Tolerance | None = None,
) -> LocalizationReport:
    """Compare every module call of a modular ONNX model with the same call in PyTorch.

    Args:
        onnx_model: A modular model (``ir.Model``, or the path of a saved file).
        torch_model: The PyTorch model it was exported from.
        args, kwargs: Inputs (any shape the export allows).
        tolerance: Overrides the per-dtype default tolerance.

    Example::

        report = localize("gpt2.onnx", model, (input_ids,))
        print(report.first_failure)   # None, or the first module call beyond tolerance
    """
    if isinstance(onnx_model, ir.Model):
        model = ir.serde.deserialize_model(ir.serde.serialize_model(onnx_model))
        base_dir = None
    else:
        model = ir.load(str(onnx_model))
        base_dir = pathlib.Path(onnx_model).parent
    original_outputs = len(model.graph.outputs)
    probes = instrument(model)
    entries = _flatten(probes, "", "", 1, [], {})

    inputs = verification.flatten_inputs(args, kwargs)
    import tempfile

    with tempfile.TemporaryDirectory(dir=base_dir, prefix=".localize-") as tmp:
        path = pathlib.Path(tmp) / "instrumented.onnx"
        ir.save(model, path)
        values = verification.run_onnxruntime(path, inputs)[original_outputs:]
    _, captured = capture_module_outputs(torch_model, args, kwargs)

    results = []
    for call_name, module_path, index, function, depth, (begin, end) in entries:
        torch_values = captured.get((module_path, index), [])
        max_abs, max_rel, compared, ok = _compare_call(values[begin:end], torch_values, tolerance)
        results.append(ModuleParity(call_name, module_path, index, function, depth, max_abs, max_rel, compared, ok))
    return LocalizationReport(results, tolerance)


# -- the standalone check on a saved file ------------------------------------------------


@dataclasses.dataclass
class ShapeCheck:
    """Results at one set of input shapes."""

    shapes: dict[str, list[int]]
    parity: verification.ParityReport | None
    modules: LocalizationReport | None
    modular_vs_flat_max_abs: float


@dataclasses.dataclass
class VerificationReport:
    """Parity (and per-module localization) of a saved model at one or more input shapes."""

    checks: list[ShapeCheck]

    @property
    def ok(self) -> bool:
        return all(
            (check.parity is None or check.parity.ok) and (check.modules is None or check.modules.ok)
            for check in self.checks
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checks": [
                {
                    "shapes": check.shapes,
                    "modular_vs_flat_max_abs": check.modular_vs_flat_max_abs,
                    "parity": check.parity.to_dict() if check.parity else None,
                    "modules": check.modules.to_dict() if check.modules else None,
                }
                for check in self.checks
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        parts = []
        for check in self.checks:
            shapes = ", ".join(f"{name}{shape}" for name, shape in check.shapes.items())
            parts.append(f"== inputs: {shapes}; modular vs flat max abs {check.modular_vs_flat_max_abs:.2e}")
            if check.parity is not None:
                parts.append(str(check.parity))
            if check.modules is not None:
                parts.append(str(check.modules))
        parts.append("OK" if self.ok else "MISMATCH")
        return "\n".join(parts)


def verify(
    path: str | os.PathLike,
    model: torch.nn.Module | None = None,
    args: tuple | None = None,
    kwargs: dict | None = None,
    *,
    shapes: Sequence[dict[str, int]] | None = None,
    localize_modules: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
) -> VerificationReport:
    """Check a saved modular model: onnxruntime (modular, flat) against PyTorch, per output and per module.

    Args:
        path: The ``.onnx`` file.
        model: The PyTorch model; without it only modular-vs-flat is checked.
        args, kwargs: Inputs. When both are ``None``, inputs are generated from the declared
            input shapes, once per entry of ``shapes`` (symbolic dim name -> size); the
            default runs two shapes (all symbolic dims 2, then 3) so dynamic models are
            exercised at several sizes. Generated inputs are passed to ``model`` by the
            ONNX input names, which torch keeps from forward()'s parameters.
        localize_modules: Also compare every module call (needs ``model``).

    Example::

        report = onnx_modular.verify("gpt2.onnx", model)
        print(report)
    """
    path = pathlib.Path(path)
    tolerance = None if rtol is None and atol is None else Tolerance(atol if atol is not None else 1e-4, rtol if rtol is not None else 1e-3)
    onnx_model = ir.load(str(path))
    runs: list[tuple[dict[str, list[int]], list, tuple, dict]] = []
    if args is not None or kwargs is not None:
        args = args if isinstance(args, tuple) else (args,) if args is not None else ()
        tensors = verification.flatten_inputs(args, kwargs)
        names = [v.name for v in onnx_model.graph.inputs]
        runs.append(({n: list(t.shape) for n, t in zip(names, tensors)}, tensors, args, kwargs or {}))
    else:
        symbolic = any(not isinstance(d, int) for v in onnx_model.graph.inputs for d in (v.shape or []))
        for dims in shapes or ([{}, {"*": 3}] if symbolic else [{}]):
            default = dims.get("*", 2)
            # Integers are 0 or 1: valid token ids and masks for any vocabulary.
            feeds = inspect_model.random_inputs(
                onnx.load(str(path), load_external_data=False),
                dims={k: v for k, v in dims.items() if k != "*"},
                default_dim=default,
                seed=seed,
                int_high=2,
            )
            tensors = [torch.from_numpy(array) for array in feeds.values()]
            runs.append(({k: list(v.shape) for k, v in feeds.items()}, tensors, (), dict(zip(feeds, tensors))))

    checks = []
    for shape_info, tensors, run_args, run_kwargs in runs:
        modular = verification.run_onnxruntime(path, tensors)
        flat_path = path.parent / f".{path.stem}.flat-{os.getpid()}.onnx"
        try:
            verification.inline_model(path, flat_path)
            flat = verification.run_onnxruntime(flat_path, tensors)
        finally:
            flat_path.unlink(missing_ok=True)
        modular_vs_flat = max((verification.max_differences(a, b)[0] for a, b in zip(modular, flat)), default=0.0)
        parity = modules = None
        if model is not None:
            expected = verification.torch_outputs(model, run_args, run_kwargs)
            names = [v.name for v in onnx_model.graph.outputs]
            parity = verification.compare(expected, modular, flat, names=names, tolerance=tolerance)
            if localize_modules:
                modules = localize(path, model, run_args, run_kwargs, tolerance=tolerance)
        checks.append(ShapeCheck(shape_info, parity, modules, modular_vs_flat))
    return VerificationReport(checks)
