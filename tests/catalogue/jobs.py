"""One row of the sweep in bounded child processes: torch's flat export, ``export_modular`` and
the tools phase, each in a forked child with a time and address-space limit (:func:`run_child`,
:func:`sweep_one`), and the list of architectures transformers ships (:func:`architectures`)."""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import resource
import tempfile
import time
import traceback
import warnings
from typing import Any

from catalogue import tools_phase
from catalogue.building import build_with_tier, layout_inputs
from catalogue.coverage import CAPTURED_SO, TIED_SO, Row, row_of
from catalogue.reference_outputs import call_depth, reference

# -- one exporter in a child ---------------------------------------------------------------


def _built(model_type: str, class_name: str, record: dict[str, Any]):
    """The row's model, inputs and PyTorch reference, recorded as every job records them; whether the
    reference is informative (outputs not all ~0)."""
    start = time.perf_counter()
    model, inputs, expected, tier = build_with_tier(model_type, class_name)
    record.update(built=True, config=tier)
    expected, informative = reference(model, inputs, expected, record)
    record["build_seconds"] = time.perf_counter() - start
    record["inputs"] = input_names(inputs)
    return model, inputs, expected, informative


def _job_modular(model_type: str, class_name: str, folder: str | None = None) -> dict[str, Any]:
    from onnx_modular import export_modular

    record: dict[str, Any] = {}
    model, inputs, expected, informative = _built(model_type, class_name, record)
    if not informative:
        return record
    fixed = layout_inputs(inputs)
    if fixed:
        record["fixed"] = ",".join(fixed)
    try:
        result = export_modular(model, (), kwargs=inputs, fixed_inputs=fixed)
    except Exception as e:
        error = _first_line(e)
        if getattr(getattr(e, "report", None), "captured_differently", False):
            error += f" ({CAPTURED_SO})"
        elif getattr(getattr(e, "report", None), "ties", None):
            error += f" ({TIED_SO})"
        record.update(ok=False, stage=getattr(e, "stage", "export"), error=error, report=_report_of(e))
        return record
    record.update(
        ok=result.report.ok,
        functions=len(result.model.functions),
        depth=call_depth(result.hierarchy.root),
        max_abs=_max_abs(result.report),
    )
    if folder and record["ok"]:  # the file and inputs of the tools phase (tools_phase)
        result.save(pathlib.Path(folder) / tools_phase.MODULAR)
        tools_phase.save_inputs(pathlib.Path(folder), inputs)
    return record


def input_names(inputs: dict[str, Any]) -> str:
    """The tensor inputs fed, comma-separated (which modalities a row was tested with)."""
    return ",".join(name for name, value in inputs.items() if hasattr(value, "shape"))


def _report_of(error) -> float | None:
    report = getattr(error, "report", None)
    return _max_abs(report) if report is not None else None


def _max_abs(report) -> float | None:
    values = [o.modular_max_abs for o in report.outputs if getattr(o, "modular_max_abs", None) is not None]
    return max(values) if values else None


def _job_flat(model_type: str, class_name: str, folder: str | None = None) -> dict[str, Any]:
    import numpy as np
    import torch

    record: dict[str, Any] = {}
    model, inputs, expected, informative = _built(model_type, class_name, record)
    if not informative:
        return record
    from onnx_modular.capture import torch_export

    try:
        with torch_export.partial_graphs_logged():  # torch.export's partial graph of a failure: not on stderr
            program = torch.onnx.export(model, (), kwargs=inputs, dynamo=True, verbose=False)
    except Exception as e:
        record.update(ok=False, stage="export", error=_first_line(e))
        return record
    try:
        outputs = program(**{k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)})  # constants are in the graph
    except Exception as e:
        record.update(ok=False, stage="run", error=_first_line(e))
        return record
    if len(outputs) != len(expected):
        record.update(ok=False, stage="verify", error=f"{len(outputs)} outputs, PyTorch has {len(expected)}")
        return record
    worst, ok = 0.0, True
    for got, want in zip(outputs, expected):
        got, want = np.asarray(got.detach().numpy(), np.float64), np.asarray(want.detach().numpy(), np.float64)
        if got.shape != want.shape:
            ok = False
            record["error"] = f"shape {list(got.shape)} != {list(want.shape)}"
            continue
        if got.size:
            worst = max(worst, float(np.max(np.abs(got - want))))
            ok = ok and bool(np.allclose(got, want, rtol=1e-3, atol=1e-4))  # onnx_modular's float32 default
    record.update(ok=ok, max_abs=worst)
    if folder and ok:  # modularize's input in the tools phase; weights beside it (inline, Perceiver's passed 2 GB)
        program.save(str(pathlib.Path(folder) / tools_phase.FLAT), external_data=True)
    if not ok:
        record.setdefault("stage", "verify")
        record.setdefault("error", f"max abs difference {worst:.3g}")
    return record


def _first_line(error: BaseException) -> str:
    """The error's first line; for torch.onnx's errors, the first line of its exception summary."""
    text = str(error).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[0] if lines else ""
    if "## Exception summary" in lines:
        line = lines[lines.index("## Exception summary") + 1] if lines.index("## Exception summary") + 1 < len(lines) else line
    elif lines and line.startswith("[") and "]" in line and len(lines) > 1 and len(line) < 60:
        line = " ".join(lines[:2])
    return f"{type(error).__name__}: {line[:300]}"


def _job_tool(model_type: str, class_name: str, tool: str, folder: str) -> dict[str, Any]:
    return tools_phase.run_tool(tool, folder)


JOBS = {"flat": _job_flat, "modular": _job_modular, "tool": _job_tool}


def _child(kind: str, model_type: str, class_name: str, memory_bytes: int, connection, extra: tuple = ()) -> None:
    os.nice(0)
    try:
        if memory_bytes:
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, hard))
        warnings.simplefilter("ignore")
        import logging

        logging.disable(logging.WARNING)
        record = JOBS[kind](model_type, class_name, *extra)
    except MemoryError:
        record = {"ok": False, "stage": "memory", "error": "MemoryError: over the memory limit"}
    except BaseException as e:
        record = {"ok": False, "stage": "build", "error": _first_line(e), "trace": traceback.format_exc()[-2000:]}
    try:
        connection.send(record)
    finally:
        connection.close()


def run_child(kind: str, model_type: str, class_name: str, timeout: float, memory_gb: float, *extra) -> dict[str, Any]:
    """One exporter (or one file tool, ``kind="tool"``) on one architecture in a forked child,
    bounded in time and address space; ``extra``: more arguments of the job."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    memory = int(memory_gb * 2**30) + _address_space() if memory_gb else 0
    start = time.perf_counter()
    process = context.Process(target=_child, args=(kind, model_type, class_name, memory, send, extra), daemon=True)
    process.start()
    send.close()
    record = None
    if receive.poll(timeout):
        try:
            record = receive.recv()
        except EOFError:
            record = None
    process.join(5)
    if process.is_alive():
        process.kill()
        process.join()
    if record is None:
        if time.perf_counter() - start >= timeout:
            record = {"ok": False, "stage": "timeout", "error": f"over {timeout:.0f} s"}
        else:
            record = {"ok": False, "stage": "crash", "error": f"child exited with code {process.exitcode}"}
    record["seconds"] = round(time.perf_counter() - start, 1)
    return record


def _address_space() -> int:
    """This process's virtual size (torch maps several GB before any work): the limit adds to it."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


# -- the list of architectures -----------------------------------------------------------


def architectures(heads: bool = True) -> list[tuple[str, str, str]]:
    """``(model_type, class name, task)`` for every model type: base models first, then heads."""
    import transformers
    from transformers.models.auto import configuration_auto, modeling_auto

    rows = []
    types = sorted(configuration_auto.CONFIG_MAPPING_NAMES)
    for model_type in types:
        name = modeling_auto.MODEL_MAPPING_NAMES.get(model_type)
        for class_name in names_of(name):
            if hasattr(transformers, class_name):
                rows.append((model_type, class_name, "base"))
    if heads:
        mappings = sorted(n for n in dir(modeling_auto) if n.startswith("MODEL_FOR_") and n.endswith("_MAPPING_NAMES"))
        seen = {(row[0], row[1]) for row in rows}  # one row per (model type, class)
        for model_type in types:
            for mapping in mappings:
                task = mapping[len("MODEL_FOR_") : -len("_MAPPING_NAMES")].lower().replace("_", "-")
                for class_name in names_of(getattr(modeling_auto, mapping).get(model_type)):
                    if (model_type, class_name) not in seen and hasattr(transformers, class_name):
                        seen.add((model_type, class_name))
                        rows.append((model_type, class_name, task))
    return rows


def names_of(value) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else [v for v in value if isinstance(v, str)]


def sweep_one(model_type: str, class_name: str, task: str, timeout: float, memory_gb: float, tools: bool = True) -> Row:
    """One row: torch's flat export, ours, then (``tools``, a modular-ok row) every file tool on
    the files they wrote, each tool in a child of its own (``tools_phase``)."""
    with tempfile.TemporaryDirectory(prefix="sweep-tools-") as scratch:
        folder = (scratch,) if tools else ()
        flat = run_child("flat", model_type, class_name, timeout, memory_gb, *folder)
        if flat.get("stage") == "build":  # the same build would fail the same way: not run twice
            modular = dict(flat, seconds=0.0)
        else:
            modular = run_child("modular", model_type, class_name, timeout, memory_gb, *folder)
        row = row_of(model_type, class_name, task, flat, modular)
        if tools and row.modular_ok and (pathlib.Path(scratch) / tools_phase.MODULAR).exists():
            row.tools = {}
            for tool in tools_phase.TOOLS:
                record = run_child("tool", model_type, class_name, timeout, memory_gb, tool, scratch)
                row.tools[tool] = record.get("status") or f"{record.get('stage')}: {record.get('error')}"
    return row
