"""The sweep's report: a :class:`Row` per (model type, class), the note that names why both
exporters fail (:func:`classify`), the totals, ``docs/coverage.md`` and its JSON
(:func:`write_markdown`, :func:`write_json`), and the comparison of two runs (:func:`regressions`,
:func:`differing`)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import subprocess
from typing import Any

from catalogue import tools_phase
from catalogue.reference_outputs import TIES_REMAIN

ROOT = pathlib.Path(__file__).resolve().parents[2]


# -- the report ----------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    model_type: str
    class_name: str
    task: str
    built: bool = False
    flat_ok: bool = False
    modular_ok: bool = False
    functions: int | None = None
    depth: int | None = None
    max_abs: float | None = None
    flat_max_abs: float | None = None
    flat_stage: str | None = None
    flat_error: str | None = None
    stage: str | None = None
    error: str | None = None
    seconds: float = 0.0
    inputs: str | None = None  # the tensor inputs fed (input_ids,pixel_values,image_grid_thw: text and images)
    note: str | None = None  # why a row fails where both exporters fail: a torch limit, a missing package
    config: str | None = None  # how far the config was shrunk (TIERS): tiny, shallow or default
    commit: str | None = None  # the commit the row was swept on (a table resumed across commits mixes them)
    fixed: str | None = None  # the inputs the modular export fixed into the program (LAYOUT_INPUTS)
    reference_max_abs: float | None = None  # the largest |PyTorch output| compared (a pass on ~0 outputs says nothing)
    jittered: bool = False  # the weights got seeded noise: PyTorch's outputs were all ~0 (with_signal) or tied (without_ties)
    ties: str | None = None  # torch.topk picked among equal values in PyTorch's reference: what the sweep did (without_ties)
    tools: dict[str, str] | None = None  # modular-ok rows: each file tool's status (tools_phase; None: not run)

    @property
    def key(self) -> tuple[str, str]:
        """A row is one (model type, class): a class serves several model types (LlamaModel)."""
        return (self.model_type, self.class_name)


def row_of(model_type: str, class_name: str, task: str, flat: dict[str, Any], modular: dict[str, Any]) -> Row:
    """The row of one (model type, class) from its two children's records."""
    row = Row(model_type, class_name, task)
    row.built = bool(flat.get("built") or modular.get("built"))
    row.flat_ok = bool(flat.get("ok"))
    row.flat_max_abs = flat.get("max_abs")
    if not row.flat_ok:
        row.flat_stage, row.flat_error = flat.get("stage"), flat.get("error")
    row.modular_ok = bool(modular.get("ok"))
    row.functions, row.depth = modular.get("functions"), modular.get("depth")
    row.max_abs = modular["max_abs"] if modular.get("max_abs") is not None else modular.get("report")  # an exact 0 stays 0
    row.reference_max_abs = modular.get("reference_max_abs", flat.get("reference_max_abs"))
    row.jittered = bool(modular.get("jittered") or flat.get("jittered"))
    row.ties = modular.get("ties") or flat.get("ties")
    if not row.modular_ok:
        row.stage, row.error = modular.get("stage"), modular.get("error")
    row.seconds = round(flat.get("seconds", 0) + modular.get("seconds", 0), 1)
    row.inputs = modular.get("inputs") or flat.get("inputs")
    row.fixed = modular.get("fixed")
    row.config = modular.get("config") or flat.get("config")
    row.note = classify(row)
    return row


#: What a modular row's error adds when torch.export's program is itself as far from PyTorch.
CAPTURED_SO = "the captured program differs as much in PyTorch"

#: What a modular row's error adds when PyTorch's reference picks among ties (check/ties.py).
TIED_SO = "torch.topk picks among equal values; with ties broken as ONNX's TopK does, PyTorch equals the file"

#: (what the error says, the note): why neither exporter, or no build, gets through
_NOTES = (
    ((TIED_SO, TIES_REMAIN),
     "PyTorch's reference selects among equal values (torch.topk on ties: random weights whose scores are all "
     "the bias): torch's kernel leaves the order of tied elements unspecified, ONNX's TopK takes the lowest index "
     "first, so both files pick other elements than PyTorch and differ by whole units; not an export error "
     "(with ties broken the ONNX way PyTorch equals the file: check/ties.py)"),
    ((CAPTURED_SO,),
     "the model's own limit: the program torch.export captures differs from eager PyTorch as much (a path only "
     "tracing takes, such as a mask built only when traced); both files compute what was captured"),
    (("requires the timm library", "requires the PIL library", "TimmWrapper", "TimmBackbone"),
     "needs timm, which needs torchvision: no torchvision wheel imports beside the CPU torch 2.13 here (a hard limit of this environment)"),
    (("requires the detectron2 library", "requires the natten library", "requires the torchaudio library"),
     "needs a package not installable here (detectron2, natten or torchaudio)"),
    (("GuardOnDataDependentSymNode", "data-dependent", "Could not guard on data-dependent", "Could not extract specialized integer",
      "unbacked", "u0", "_is_all_true"),
     "torch limit: a data-dependent guard (control flow or a shape on input values) that torch.export cannot trace"),
    (("No ONNX function found", "DispatchError", "no decomposition", "not implemented for", "Unsupported FX nodes"),
     "torch limit: an operator torch's ONNX translation has no function or decomposition for"),
    (("complex", "Complex"), "torch limit: complex tensors, which the ONNX translation does not take"),
)
#: both files run and differ from PyTorch alike: not an export failure (flat's error is a max difference)
_BOTH_DIFFER = "both files run and differ from PyTorch beyond the tolerance (no export failure)"


def classify(row: Row) -> str | None:
    """A short note for a row that fails where both exporters fail, or that cannot be built,
    when the error names a known cause (a torch limit, a package missing here); else None."""
    if row.modular_ok or row.flat_ok:
        return None
    text = " ".join(filter(None, (row.error, row.flat_error, row.ties)))
    for needles, note in _NOTES:
        if any(needle in text for needle in needles):
            return note
    if row.stage == "verify" and row.flat_stage == "verify":
        return _BOTH_DIFFER
    return _stage_note(row)


def _stage_note(row: Row) -> str:
    """Where no known cause is named: what the two failures are, by stage (every row both
    exporters fail has a note)."""
    if row.stage == "build":
        return ("not built: the sweep's config and input rules do not make a model of this class that runs "
                "in PyTorch (a limit of the harness, not of either exporter)")
    if row.stage == "timeout":
        return "over the sweep's time budget per exporter (timeout): no result either way"
    if row.stage == "capture" and row.flat_stage == "export":
        return "torch.export fails on the model's own code for both exporters (the same capture error)"
    if row.stage == "input":
        return "forward returns values that are not tensors (ints): not ONNX outputs; torch's exporter fails on them too"
    if row.stage == "verify" and row.flat_stage in ("export", "run"):
        return (f"torch's flat export fails ({row.flat_stage}); the modular file exports but differs from PyTorch "
                "beyond the tolerance: to investigate")
    return f"both fail: modular at {row.stage or '?'}, flat at {row.flat_stage or '?'} (the errors say why)"


def run_environment() -> dict[str, str]:
    import onnxruntime
    import onnxscript
    import torch
    import transformers

    commit = os.environ.get("SWEEP_COMMIT", "")  # a sweep run from an exported snapshot of a commit
    if not commit:
        try:
            git = ["git", "rev-parse", "--short", "HEAD"]
            commit = subprocess.run(git, cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip() or "?"
        except OSError:
            commit = "?"
    return {
        "commit": commit,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnxscript": onnxscript.__version__,
        "onnxruntime": onnxruntime.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def totals(rows: list[Row]) -> dict[str, int]:
    return {
        "tried": len(rows),
        "built": sum(r.built for r in rows),
        "flat_ok": sum(r.flat_ok for r in rows),
        "modular_ok": sum(r.modular_ok for r in rows),
        "both_ok": sum(r.flat_ok and r.modular_ok for r in rows),
        "flat_only": sum(r.flat_ok and not r.modular_ok for r in rows),
        "modular_only": sum(r.modular_ok and not r.flat_ok for r in rows),
    }


def markdown_cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.2g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _jitter_cell(row: Row) -> str:
    """What the reference cell adds when the weights were re-drawn: jittered, and why when for ties."""
    if not row.jittered:
        return ""
    return " (jittered: top-k ties)" if row.ties else " (jittered)"


def write_markdown(path: pathlib.Path, rows: list[Row], environment: dict[str, str], planned: int, notes: str = "") -> None:
    t = totals(rows)
    lines = [
        "# Coverage: transformers architectures",
        "",
        f"Generated by `scripts/sweep_transformers.py` on commit {environment['commit']}, torch {environment['torch']}, "
        f"transformers {environment['transformers']}, onnxscript {environment['onnxscript']}, onnxruntime "
        f"{environment['onnxruntime']} ({environment['date']}). Tiny configs from the defaults, random weights, "
        "batch 2; flat = `torch.onnx.export(dynamo=True)` then onnxruntime vs PyTorch, modular = `export_modular` "
        "(its own parity check, modular and inlined copy); both with atol 1e-4 / rtol 1e-3.",
        "",
        "## Totals",
        "",
        "| tried | of planned | built | flat ok | modular ok | both | flat only | modular only |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {t['tried']} | {planned} | {t['built']} | {t['flat_ok']} | {t['modular_ok']} | {t['both_ok']} | {t['flat_only']} | {t['modular_only']} |",
        "",
    ]
    lines += tools_phase.markdown(rows)
    if notes:
        lines += [notes.strip(), ""]
    flat_only = [r for r in rows if r.flat_ok and not r.modular_ok]
    lines += ["## Flat exports, modular does not", ""]
    lines += [f"- `{r.class_name}` ({r.model_type}): {r.stage}: {markdown_cell(r.error)}" for r in flat_only] or ["None."]
    lines += [
        "",
        "## Every architecture",
        "",
        "| model type | class | task | built | flat | modular | functions | depth | max abs (modular) | max abs (flat) | max \\|PyTorch output\\| | failing stage | first error line | inputs | config | note | tools | s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        stage = r.stage or (f"flat: {r.flat_stage}" if r.flat_stage else "")
        error = r.error or r.flat_error
        lines.append(
            f"| {r.model_type} | {r.class_name} | {r.task} | {markdown_cell(r.built)} | {markdown_cell(r.flat_ok)} | {markdown_cell(r.modular_ok)} | "
            f"{markdown_cell(r.functions)} | {markdown_cell(r.depth)} | {markdown_cell(r.max_abs)} | {markdown_cell(r.flat_max_abs)} | "
            f"{markdown_cell(r.reference_max_abs)}{_jitter_cell(r)} | {markdown_cell(stage)} | "
            f"{markdown_cell((error or '')[:160])} | {markdown_cell(r.inputs)}{f' (fixed: {r.fixed})' if r.fixed else ''} | {markdown_cell(r.config)} | {markdown_cell(r.note or classify(r))} | "
            f"{markdown_cell(tools_phase.cell(r.tools)[:200])} | {r.seconds:.0f} |"
        )
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


def write_json(path: pathlib.Path, rows: list[Row], environment: dict[str, str], planned: int, notes: str = "") -> None:
    data = {"environment": environment, "planned": planned, "totals": totals(rows), "tools": tools_phase.tool_totals(rows),
            "notes": notes, "rows": [dataclasses.asdict(r) for r in rows]}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def read_rows(path: pathlib.Path) -> list[Row]:
    """The rows of a JSON report; a row swept before notes existed gets its note now."""
    data = json.loads(path.read_text())
    rows = [Row(**row) for row in data["rows"]]
    for row in rows:
        row.note = row.note or classify(row)
    return rows


def unique_rows(rows: list[Row]) -> list[Row]:
    """One row per (model type, class): of rows with one key (a table written when rows were
    keyed by class, whose copies took a sibling's model type), the first is kept."""
    seen: set[tuple[str, str]] = set()
    kept = []
    for row in rows:
        if row.key not in seen:
            seen.add(row.key)
            kept.append(row)
    return kept


def regressions(old: list[Row], new: list[Row]) -> list[str]:
    """What worked in ``old`` and does not in ``new`` (built, flat, modular), by class."""
    before = {r.key: r for r in old}
    found = []
    for r in new:
        o = before.get(r.key)
        if o is None:
            continue
        for field, label in (("built", "built"), ("flat_ok", "flat"), ("modular_ok", "modular")):
            if getattr(o, field) and not getattr(r, field):
                detail = r.error if field != "flat_ok" else r.flat_error
                found.append(f"{r.class_name} ({r.model_type}): {label} regressed: {detail or ''}".strip())
    return found


#: inputs that are text (or its masks and positions): a row fed only these was fed no image, audio or video
_TEXT_INPUTS = frozenset({
    "input_ids", "attention_mask", "token_type_ids", "position_ids", "decoder_input_ids", "decoder_attention_mask",
    "inputs_embeds",
})


def differing(kept: list[Row], other: list[Row]) -> list[str]:
    """The keys (model type, class) of ``kept`` whose row differs from the same row of ``other`` (another torch's
    run on the current commit): in outcome (built, flat, modular) or in the inputs fed or fixed. A kept row
    with no inputs recorded (swept before the column) differs when the other was fed more than
    text. What is not in ``other`` is left alone."""
    others = {r.key: r for r in other}
    found = []
    for row in kept:
        o = others.get(row.key)
        if o is None:
            continue
        fed = set(filter(None, (o.inputs or "").split(",")))
        if (row.built, row.flat_ok, row.modular_ok) != (o.built, o.flat_ok, o.modular_ok):
            found.append(row.key)
        elif row.inputs is None and fed - _TEXT_INPUTS or row.inputs is not None and set(row.inputs.split(",")) != fed:
            found.append(row.key)
        elif (row.fixed or None) != (o.fixed or None):  # fixed into the program on one run only
            found.append(row.key)
    return found
