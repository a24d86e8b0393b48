"""The tools phase of the catalogue sweep (``scripts/sweep_transformers.py``): every file tool on
the files a modular-ok row just made, each through the package's public API, one status per tool.

The row's children leave, in one scratch folder, ``modular.onnx`` (``export_modular``'s file),
``flat.onnx`` (torch's flat export, when it worked) and ``inputs.npz`` (the tensors the row was
fed, by name). Each tool then runs in a bounded child of its own (:func:`run_tool`) and gives
``"ok"``, ``"n/a: why"`` or a short reason; the row's ``tools`` field holds them by tool name.

What passes, per tool (:data:`CRITERIA`, rendered under the table's totals):

- ``convert_f16``: ``convert(dtype="float16")`` writes its file after its own check (onnxruntime
  runs the converted file on the row's inputs) and every output's drift (max abs difference over
  the output's range) is finite and at most :data:`F16_DRIFT`, or its max abs difference at most
  :data:`ABS_FLOOR` (an output whose range is under float16's step).
- ``convert_int8``: ``convert(quantize="int8")`` likewise, within :data:`INT8_DRIFT`; a file with
  no MatMul weight to quantize is ``n/a`` (the tool says so: a ``QuantizationWarning``).
- either conversion over its budget, or refused with the advice to let ``--auto-keep`` choose
  (outputs that overflow float16, a converted file that does not run), is tried again as the
  tool's guide says to meet a budget:
  ``auto_keep=<the budget>`` (the classes that move the outputs most kept, the calls feeding a
  selection the conversion flips first). It passes ``ok (--auto-keep ...)`` when the file is then
  within the budget with something still converted (a float16 call, an int8 MatMul), the classes
  kept and the first try's status in the cell; the totals count such rows apart (``auto-keep``).
- ``split``: ``split(stages=2)`` (its own check: every stage reproduces the whole model's values),
  then ``run_stages`` chained on the row's inputs equals onnxruntime's run of the whole file
  (atol 1e-4, rtol 1e-3, the sweep's tolerance); ``n/a`` for a file with fewer than 2 calls to cut at.
- ``modularize``: on torch's flat file (``n/a`` where torch's export failed): the file is written
  (its own check, modular against flat, passes) and at least :data:`RECOVERED` of our file's
  module paths are recovered as calls or named in the report's ``unrecovered`` list (a module
  torch's optimizer fused away, Conv+BatchNorm); a module called several times counts once
  (``modularize`` merges such calls, as documented); a call of ours that computes nothing (only
  ``Identity``: a Dropout in eval) or only from constants (torch's optimizer folds it) is not
  counted: torch's file has no trace of it.
  ``ok (r of n recovered, ...)`` says how many.
- ``diff``: ``diff(file, file)`` on the row's inputs reports no difference.
- ``profile``: ``profile`` (3 runs, 1 thread) attributes at least :data:`ATTRIBUTED` of the kernel
  time to module calls (``unattributed`` kernels are the rest).
"""

from __future__ import annotations

import math
import pathlib
import warnings
from typing import Any

TOOLS = ("convert_f16", "convert_int8", "split", "modularize", "diff", "profile")

F16_DRIFT = 0.05
INT8_DRIFT = 0.25
#: an output within this of the original passes whatever its range (float16's step at 1 is 4.9e-4:
#: a near-constant output, Conditional DETR's reference points, has a range of 1e-4)
ABS_FLOOR = 1e-3
RECOVERED = 0.9
ATTRIBUTED = 0.99
ATOL, RTOL = 1e-4, 1e-3

CRITERIA = {
    "convert_f16": f"file written after its own onnxruntime check, every output's drift (max abs / range) <= {F16_DRIFT:g} "
                   f"or its max abs <= {ABS_FLOOR:g}",
    "convert_int8": f"as float16, drift <= {INT8_DRIFT:g}; n/a when no MatMul weight is quantizable; either passes "
                    "with --auto-keep at its budget when the plain file is over it (or refused with the advice to use it: float16 "
                    "outputs that overflow) and something stays converted (counted apart)",
    "split": f"2 stages; run_stages chained = the whole file in onnxruntime (atol {ATOL:g}, rtol {RTOL:g}); --no-data, "
             "the error's advice, where the values crossing the cut are over the test data's limit",
    "modularize": f"torch's flat file: written (its parity check passes), >= {RECOVERED:.0%} of our module paths "
                  "recovered or named unrecovered in its report; n/a where torch's export fails",
    "diff": "the file against itself: no difference",
    "profile": f">= {ATTRIBUTED:.0%} of kernel time attributed to module calls",
}

MODULAR, FLAT, INPUTS = "modular.onnx", "flat.onnx", "inputs.npz"


# -- what the children of the exports leave ------------------------------------------------


def save_inputs(folder: pathlib.Path, inputs: dict[str, Any]) -> None:
    """The row's tensor inputs by name (``inputs.npz``): what every tool is fed."""
    import numpy as np

    arrays = {name: value.detach().cpu().numpy() for name, value in inputs.items() if hasattr(value, "detach")}
    np.savez(folder / INPUTS, **arrays)


def feeds(folder: pathlib.Path, path: pathlib.Path) -> dict[str, Any] | None:
    """The saved inputs the file at ``path`` declares (``None``: it declares one not saved; the
    tools then draw their own)."""
    import numpy as np
    import onnx

    if not (folder / INPUTS).exists():
        return None
    saved = dict(np.load(folder / INPUTS))
    try:
        names = [value.name for value in onnx.load(str(path), load_external_data=False).graph.input]
    except Exception:  # not a file onnx reads: the tool says so itself
        return None
    if not set(names) <= set(saved):
        return None
    return {name: saved[name] for name in names}


# -- one tool ------------------------------------------------------------------------------


def _short(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:400]}"


def _far(report, limit: float) -> dict[str, tuple[float, float]]:
    """The outputs of a conversion over the drift budget."""
    return {name: (max_abs, drift) for name, (max_abs, drift) in report.outputs.items()
            if not (math.isfinite(drift) and drift <= limit or max_abs <= ABS_FLOOR)}


def _convert(folder: pathlib.Path, name: str) -> str:
    from onnx_modular import convert

    source = folder / MODULAR
    f16 = name == "convert_f16"
    request = {"dtype": "float16" if f16 else None, "quantize": None if f16 else "int8", "inputs": feeds(folder, source)}
    from onnx_modular.errors import VerificationError

    limit = F16_DRIFT if f16 else INT8_DRIFT
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = convert(source, folder / f"{name}.onnx", **request)
    except VerificationError as e:
        if "--auto-keep" not in str(e):
            raise
        status = _short(e)  # refused (outputs that overflow, a file that does not run): the tool says to let --auto-keep choose
    else:
        if not f16 and not report.quantized:
            said = [str(w.message) for w in caught if type(w.message).__name__ == "QuantizationWarning"]
            return "n/a: no MatMul weight quantized" + (f" ({said[0][:120]})" if said else " and no warning")
        far = _far(report, limit)
        if not far:
            return "ok"
        output, (max_abs, drift) = max(far.items(), key=lambda item: item[1][1])
        flips = [f"{s.op_type} {s.node} flipped, fed by {', '.join(s.feeding[:3]) or 'no call'}" for s in report.selections]
        status = f"drift {drift:.3g} > {limit:g} (output {output}, max abs {max_abs:.3g})" + (f"; {flips[0]}" if flips else "")
    # the tool's own answer to a drift budget (docs/convert.md): --auto-keep keeps the classes that
    # move the outputs most (the calls feeding a flipped selection first) until the file is within it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kept = convert(source, folder / f"{name}.auto.onnx", auto_keep=limit, **request)
    converted = sum(c.converted for c in kept.calls) if f16 else len(kept.quantized)
    if _far(kept, limit) or not converted:
        return status + ("; --auto-keep converts nothing" if not converted else f"; with --auto-keep {limit:g} too")
    names = [c for c, _ in kept.auto_kept]  # classes, or the calls feeding a flipped selection
    return (f"ok (--auto-keep {limit:g} kept {len(names)}: {', '.join(names[:3])}"
            f"{' ...' if len(names) > 3 else ''}; without it: {status})")


def _split(folder: pathlib.Path) -> str:
    import numpy as np

    from onnx_modular import run_stages, split
    from onnx_modular.errors import InvalidInputError
    from onnx_modular.runtime import sessions

    source = folder / MODULAR
    given = feeds(folder, source)
    note = ""
    try:
        split(source, folder / "stages", stages=2, inputs=given)
    except InvalidInputError as e:
        if "MAX_TEST_DATA_BYTES" in str(e):  # the values crossing the cut are too big for test data: its advice
            split(source, folder / "stages", stages=2, with_data=False)
            note = " (--no-data: the test data is over the limit)"
        elif "more stages than" in str(e).lower() or "calls" in str(e).lower() and "stages" in str(e).lower():
            return f"n/a: {_short(e)[:150]}"
        else:
            raise
    if given is None:
        return "ok (split's own check; no saved inputs to chain)" + note
    names, whole = sessions.run(str(source), given)
    chained = run_stages(folder / "stages", given)
    for name, expected in zip(names, whole):
        got = chained.get(name)
        if got is None:
            return f"output {name} missing from the stages"
        if got.shape != expected.shape:
            return f"output {name}: shape {list(got.shape)} != {list(expected.shape)}"
        if expected.dtype.kind == "f" and not np.allclose(got, expected, atol=ATOL, rtol=RTOL, equal_nan=True):
            return f"output {name}: chained differs by {float(np.nanmax(np.abs(got - expected))):.3g}"
        if expected.dtype.kind != "f" and not np.array_equal(got, expected):
            return f"output {name}: chained differs"
    return "ok" + note


def _paths(tree) -> set[str]:
    return {call.module_path for call in tree.walk() if not call.is_root and call.module_path}


def _live(body_nodes, live: set[str], bodies: dict, memo: dict) -> set[str]:
    """``live`` and every value of ``body_nodes`` computed from it (a control-flow node's outputs
    always: its subgraphs read outer values by name). A call node passes liveness on only to the
    outputs its function computes from the inputs that are live."""
    live = set(live)
    for node in body_nodes:
        key = (node.domain, node.op_type, node.overload)
        if key in bodies:
            positions = frozenset(i for i, name in enumerate(node.input) if name in live)
            made = _live_outputs(key, positions, bodies, memo)
            live.update(name for j, name in enumerate(node.output) if j in made)
        elif any(name in live for name in node.input) or any(a.type in (5, 10) for a in node.attribute):  # GRAPH(S)
            live.update(node.output)
    return live


def _live_outputs(key, positions: frozenset, bodies: dict, memo: dict) -> frozenset:
    """The output positions of function ``key`` computed from its inputs at ``positions``."""
    if (key, positions) not in memo:
        memo[key, positions] = frozenset()  # a function that calls itself
        function = bodies[key]
        live = _live(function.node, {function.input[i] for i in positions if i < len(function.input)}, bodies, memo)
        memo[key, positions] = frozenset(j for j, name in enumerate(function.output) if name in live)
    return memo[key, positions]


def _computing_paths(model) -> set[str]:
    """The module paths of our file's calls that torch's flat file can hold: a call whose body
    (with everything it calls) holds only ``Identity`` nodes (a Dropout in eval) leaves no node
    there, and a call none of whose outputs is computed from the model's inputs is folded into a
    constant by torch's optimizer: every argument a constant (a projection of a position table:
    DeBERTa's ``pos_key_proj``, Conditional DETR's ``q_pos_proj``), or a body that ignores its
    arguments (MRA's attention returns ``zeros_like(query)`` without its CUDA kernel, and the
    projection after it then reads a constant). Neither leaves a trace modularize could recover or
    report."""
    from onnx_modular.format import metadata

    bodies = {(f.domain, f.name, f.overload): f for f in model.functions}
    memo: dict[tuple, bool] = {}
    live_memo: dict = {}

    def computes(key) -> bool:
        if key not in memo:
            memo[key] = False
            function = bodies.get(key)
            memo[key] = function is not None and any(
                (node.domain, node.op_type, node.overload) in bodies and computes((node.domain, node.op_type, node.overload))
                or (node.domain, node.op_type, node.overload) not in bodies and node.op_type != "Identity"
                for node in function.node
            )
        return memo[key]

    lives = {None: _live(model.graph.node, {value.name for value in model.graph.input}, bodies, live_memo)}
    paths = set()
    for call in metadata.expanded_calls(model, module_calls_only=False):
        live = lives[id(call.caller) if call.caller is not None else None]
        function = call.function
        formals = {formal for formal, actual in zip(function.input, call.node.input) if actual in live}
        lives[id(call)] = body = _live(function.node, formals, bodies, live_memo)
        path, _ = metadata.split_call_name(call.call_name)
        computed = formals and any(name in body for name in function.output)  # (control flow: outputs always live)
        if path and computed and computes((function.domain, function.name, function.overload)):
            paths.add(path)
    return paths


def _modularize(folder: pathlib.Path) -> str:
    import onnx

    from onnx_modular import modularize

    flat = folder / FLAT
    if not flat.exists():
        return "n/a: torch's flat export failed"
    report = modularize(flat, folder / "remodular.onnx", inputs=feeds(folder, flat))
    ours = _computing_paths(onnx.load(str(folder / MODULAR), load_external_data=False))
    if not ours:
        return "ok"
    recovered = ours & _paths(report.tree)
    reported = {line.split(":", 1)[0].split("@", 1)[0] for line in report.unrecovered}  # "path: why"
    missing = sorted(ours - recovered - reported)
    accounted = 1 - len(missing) / len(ours)
    if accounted < RECOVERED:
        return (f"{accounted:.0%} of {len(ours)} module paths recovered or reported (silently lost: "
                f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''})")
    if len(recovered) < len(ours):
        return f"ok ({len(recovered)} of {len(ours)} recovered, {len(ours & reported - recovered)} reported, {len(missing)} lost)"
    return "ok"


def _diff(folder: pathlib.Path) -> str:
    from onnx_modular import diff

    source = folder / MODULAR
    result = diff(source, source, inputs=feeds(folder, source))
    if result.differs:
        counts = result.counts
        return "differs from itself: " + ", ".join(f"{k} {v}" for k, v in counts.items() if v and k != "same")
    return "ok"


def _profile(folder: pathlib.Path) -> str:
    from onnx_modular import profile

    source = folder / MODULAR
    report = profile(source, feeds(folder, source), runs=3, warmup=1, threads=1)
    total = sum(k.median_us for k in report.kernels)
    left = [k for k in report.kernels if k.kind == "unattributed"]
    share = 1 - sum(k.median_us for k in left) / total if total else 1.0
    if share < ATTRIBUTED:
        ops = sorted({k.op_type for k in left})
        return f"{share:.1%} of kernel time attributed ({len(left)} unattributed kernels: {', '.join(ops[:4])})"
    return "ok"


def run_tool(name: str, folder: str) -> dict[str, Any]:
    """One tool on the files in ``folder`` (in a sweep child): ``{"status": ...}``."""
    folder = pathlib.Path(folder)
    try:
        if name.startswith("convert"):
            status = _convert(folder, name)
        else:
            status = {"split": _split, "modularize": _modularize, "diff": _diff, "profile": _profile}[name](folder)
    except Exception as e:  # a tool's failure is the row's finding, not the sweep's
        status = _short(e)
    return {"status": status}


# -- totals --------------------------------------------------------------------------------


def passed(status: str | None) -> bool:
    return status == "ok" or bool(status) and status.startswith("ok ")


def tool_totals(rows: list) -> dict[str, dict[str, int]]:
    """Per tool, over the modular-ok rows whose tools were run: ``passed``, ``run`` (n/a not
    counted) and ``n/a``; and how many modular-ok rows were run at all (``rows``)."""
    run_rows = [r for r in rows if r.modular_ok and r.tools]
    result = {"rows": {"run": len(run_rows), "modular_ok": sum(r.modular_ok for r in rows)}}
    for name in TOOLS:
        statuses = [r.tools.get(name) for r in run_rows]
        na = sum(1 for s in statuses if s and s.startswith("n/a"))
        result[name] = {"passed": sum(passed(s) for s in statuses), "run": len(statuses) - na, "n/a": na,
                        "auto-keep": sum(1 for s in statuses if s and s.startswith("ok (--auto-keep"))}
    return result


def markdown(rows: list) -> list[str]:
    """The tools' totals and criteria (lines for coverage.md, under the totals)."""
    totals = tool_totals(rows)
    head = totals["rows"]
    lines = [
        "## File tools on modular-ok rows (issue 51)",
        "",
        f"Every file tool on the files of {head['run']} of the {head['modular_ok']} modular-ok rows "
        "(the others were not swept with the tools phase: their `tools` cell is empty). Passed / run; "
        "n/a rows are not counted in run.",
        "",
        "| tool | passed | of which with --auto-keep | run | n/a | passes when |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in TOOLS:
        t = totals[name]
        lines.append(f"| {name} | {t['passed']} | {t['auto-keep']} | {t['run']} | {t['n/a']} | {CRITERIA[name]} |")
    return lines + [""]


def cell(tools: dict[str, str] | None) -> str:
    """The row's tools cell: ``ok`` when all passed, else the ones that did not, with why."""
    if not tools:
        return ""
    bad = [f"{name}: {status}" for name, status in tools.items() if not passed(status) and not status.startswith("n/a")]
    na = [name for name, status in tools.items() if status.startswith("n/a")]
    text = "; ".join(bad) if bad else "ok"
    return text + (f" (n/a: {', '.join(na)})" if na else "")
