"""Views of a :class:`~onnx_modular.files.diff.tool.ModelDiff`: the terminal tree and the HTML page.

Both are built from the records only. Every name from a file is escaped: :func:`shown` in the
terminal, ``html.escape`` in the page, which is one self-contained file (no script, nothing
loaded from elsewhere).
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterator
from typing import Any

from onnx_modular.check.parity import fit_name
from onnx_modular.format import calltree
from onnx_modular.format.text import shown

# The report (onnx_modular.files.diff.tool.ModelDiff) is taken as it comes, not imported: its methods
# call these views, and the package has no import circles (tests/test_layout.py).
ModelDiff = Any
CallDiff = Any

__all__ = ["text", "html_page", "drawn", "number"]

#: The marker of each verdict in the terminal tree (``diff -u``'s signs, ``~`` for changed).
MARKERS = {"same": " ", "changed": "~", "changed below": "^", "added": "+", "removed": "-"}


def number(value: float | None) -> str:
    """A drift or ratio for a column: empty when not measured, ``0`` exactly, else 2 digits."""
    if value is None:
        return ""
    if value == 0:
        return "0"
    if math.isinf(value):
        return "inf"
    return f"{value:.1e}"


def drawn(root: CallDiff, max_depth: int | None = None) -> Iterator[tuple[CallDiff, str]]:
    """(call, its tree-drawing prefix) in display order, down to ``max_depth`` (the drawing of
    :func:`onnx_modular.format.calltree.drawn`)."""
    return calltree.drawn(root, max_depth)


def _name(call: CallDiff) -> str:
    if call.is_root:
        return "main_graph"
    return call.path


def _summary(report: ModelDiff) -> list[str]:
    counts = report.counts()
    lines = [
        f"A: {shown(report.a)}",
        f"B: {shown(report.b)}",
    ]
    if report.inputs:
        shapes = ", ".join(f"{shown(n)}{v['shape']} {v['dtype']}" for n, v in report.inputs.items())
        lines.append(f"inputs: {shapes or '(none)'}" + (f" (random, seed {report.seed})" if report.random_inputs else ""))
        if report.cast:
            lines.append("cast for B: " + ", ".join(f"{shown(n)} to {dtype}" for n, dtype in report.cast.items()))
    lines.append(
        f"{'modules' if report.by_module else 'calls'}: {counts['same']} same, {counts['changed']} changed, {counts['changed below']} changed below, "
        f"{counts['added']} added, {counts['removed']} removed"
    )
    versions = report.versions()
    if versions:
        lines.append(
            "classes from other package versions: "
            + ", ".join(f"{shown(package)} {shown(a)} -> {shown(b)}" for package, (a, b) in versions.items())
        )
    if report.numerics:
        root = report.root
        first = report.first_drift
        lines.append(
            f"model outputs: max abs {number(root.max_abs) or '?'}, max rel {number(root.max_rel) or '?'}; "
            + (
                f"first drift at {shown(first.path)} ({shown(first.class_name)})" if first
                else "no call's outputs differ" if any(c.max_abs is not None for c in report.calls())
                else "calls' outputs not compared"
            )
        )
    else:
        lines.append("numerics not compared (structure only)")
    if report.settings is not None:
        a_ms, b_ms = report.settings.get("median_run_ms", [None, None])
        lines.append(
            f"time: {report.settings.get('runs')} runs each in {report.settings.get('rounds')} alternating rounds, "
            f"intra-op threads {report.settings.get('threads') or 'default'}; "
            f"median profiled run A {a_ms:.3f} ms, B {b_ms:.3f} ms"
        )
    if report.note:
        lines.append(f"note: {shown(report.note)}")
    lines.append("verdict: " + ("the files differ" if report.differs else "no difference"))
    return lines


def text(report: ModelDiff, max_depth: int | None = None, *, top: int = 10) -> str:
    """The terminal view: a summary, the merged call tree with change markers and drift (and
    time) columns, where drift is made, and what changed in each changed call."""
    lines = _summary(report) + [""]
    timed = report.settings is not None
    header = ["call", "class", "change", "max abs", "max rel"] + (["A ms", "B ms", "B/A"] if timed else [])
    rows = [header]
    for call, prefix in drawn(report.root, max_depth):
        row = [
            f"{MARKERS[call.verdict]} {prefix}{_name(call)}" + (" <- first drift" if call.first_drift else ""),
            call.class_name,
            call.verdict,
            number(call.max_abs),
            number(call.max_rel),
        ]
        if timed:
            row += [
                "" if call.time_a_us is None else f"{call.time_a_us / 1e3:.3f}",
                "" if call.time_b_us is None else f"{call.time_b_us / 1e3:.3f}",
                "" if call.time_ratio is None else f"{call.time_ratio:.2f}x",
            ]
        rows.append(row)
    rows = [[shown(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        cells = [row[i].ljust(widths[i]) for i in range(3)] + [row[i].rjust(widths[i]) for i in range(3, len(header))]
        lines.append("  ".join(cells).rstrip())
    height = max((call.depth for call in report.root.walk()), default=0)
    if max_depth is not None and height > max_depth:
        lines.append(f"(calls deeper than {max_depth} not shown)")
    lines.append("markers: ~ changed in its own body, ^ changed below (a call it makes), + only in B, - only in A")
    ranked = report.ranked(top)
    if ranked:
        lines += [
            "",
            "Where the drift is made (scaled: max abs over the range of the output's values; "
            "added: scaled minus the largest scaled drift before the call):",
        ]
        width = min(max(len(call.path) for call in ranked), 60)
        for rank, call in enumerate(ranked, 1):
            lines.append(
                f"{rank:>3}. {shown(fit_name(call.path, 60)):<{width}}  {shown(call.class_name):<18} "
                f"max abs {number(call.max_abs):>7}  scaled {number(call.scaled_drift):>7}  added {number(call.added_drift):>7}"
                + ("  (first drift)" if call.first_drift else "")
            )
    changed = [call for call in report.root.walk() if call.change != "same"]
    if changed:
        lines += ["", "Changes:"]
        for call in changed:
            what = "; ".join(call.what) if call.what else ("only in B" if call.change == "added" else "only in A")
            lines.append(f"  {MARKERS[call.verdict]} {shown(_name(call))}: {shown(what)}")
    return "\n".join(lines)


# -- HTML --------------------------------------------------------------------------------------


def _escape(value: str) -> str:
    """Names from a file in the page: control characters shown as escapes, then HTML-escaped."""
    return html.escape("\n".join(shown(line) for line in str(value).split("\n")))


_STYLE = (
    "body{font-family:sans-serif;margin:16px;font-size:13px} table{border-collapse:collapse}"
    "td,th{padding:2px 8px;border-bottom:1px solid #eee;white-space:nowrap;text-align:left}"
    "th{background:#f3f3f3;position:sticky;top:0} td.num{text-align:right;font-family:monospace}"
    "td.tree{font-family:monospace} td.side{border-left:2px solid #ccc}"
    "tr.changed td.tree,tr.changed td.verdict{background:#ffe8cc} tr.below td.tree,tr.below td.verdict{background:#fff6e0}"
    "tr.added td.b,tr.added td.verdict{background:#d3f9d8} tr.removed td.a,tr.removed td.verdict{background:#ffe3e3}"
    "tr.first td{font-weight:bold} td.what{color:#555;white-space:normal;max-width:420px}"
    "span.drift{display:inline-block;height:9px;background:#e8590c;vertical-align:middle;margin-left:4px}"
    "pre{font-size:12px;background:#f8f8f8;padding:8px} .legend span{display:inline-block;width:12px;height:12px;"
    "margin:0 4px 0 12px;vertical-align:middle}"
)

_ROW_CLASS = {"same": "same", "changed": "changed", "changed below": "below", "added": "added", "removed": "removed"}


def _side(call: CallDiff, which: str, by_module: bool) -> tuple[str, str]:
    side = call.a if which == "a" else call.b
    if side is None:
        return "", ""
    indent = "&nbsp;" * (3 * call.depth)
    name = _escape(_name(call))
    function = call.function_a if which == "a" else call.function_b
    if by_module and not side.is_root:
        function = f"{side.num_nodes} node{'' if side.num_nodes == 1 else 's'} of its own"
    return indent + name, _escape(function or ("no ops" if not side.is_root else ""))


def html_page(report: ModelDiff) -> str:
    """One self-contained page: the two call trees side by side (A left, B right, calls matched
    on one row), each row coloured by its verdict, with the drift (a bar on a log scale) and the
    times; then where the drift is made, what changed, and the terminal view."""
    timed = report.settings is not None
    largest = max((c.max_abs for c in report.root.walk() if c.max_abs and math.isfinite(c.max_abs)), default=0.0)
    smallest = min((c.max_abs for c in report.root.walk() if c.max_abs and math.isfinite(c.max_abs)), default=0.0)
    head = (
        "<tr><th class='side'>A: call</th><th>function</th><th>change</th><th class='side'>B: call</th><th>function</th>"
        "<th>max abs</th><th>max rel</th><th>scaled</th><th>added</th>" + ("<th>A ms</th><th>B ms</th><th>B/A</th>" if timed else "")
        + "<th>what differs</th></tr>"
    )
    rows = []
    for call in report.root.walk():
        a_name, a_function = _side(call, "a", report.by_module)
        b_name, b_function = _side(call, "b", report.by_module)
        bar = ""
        if call.max_abs and largest > 0:
            if math.isinf(call.max_abs):
                width = 80
            else:
                span = math.log10(largest) - math.log10(smallest) if smallest > 0 and largest > smallest else 1.0
                width = 8 + 72 * (math.log10(call.max_abs) - math.log10(smallest or call.max_abs)) / (span or 1.0)
            bar = f"<span class='drift' style='width:{width:.0f}px'></span>"
        classes = _ROW_CLASS[call.verdict] + (" first" if call.first_drift else "")
        cells = [
            f"<td class='tree a side'>{a_name}</td><td class='a'>{a_function}</td>",
            f"<td class='verdict'>{_escape(call.verdict)}{' (first drift)' if call.first_drift else ''}</td>",
            f"<td class='tree b side'>{b_name}</td><td class='b'>{b_function}</td>",
            f"<td class='num'>{number(call.max_abs)}{bar}</td><td class='num'>{number(call.max_rel)}</td>",
            f"<td class='num'>{number(call.scaled_drift)}</td><td class='num'>{number(call.added_drift)}</td>",
        ]
        if timed:
            cells.append(
                "<td class='num'>{}</td><td class='num'>{}</td><td class='num'>{}</td>".format(
                    "" if call.time_a_us is None else f"{call.time_a_us / 1e3:.3f}",
                    "" if call.time_b_us is None else f"{call.time_b_us / 1e3:.3f}",
                    "" if call.time_ratio is None else f"{call.time_ratio:.2f}x",
                )
            )
        cells.append(f"<td class='what'>{_escape('; '.join(call.what))}</td>")
        rows.append(f"<tr class='{classes}'>{''.join(cells)}</tr>")
    ranked = report.ranked(10)
    ranking = "".join(
        f"<li>{_escape(call.path)} ({_escape(call.class_name)}): max abs {number(call.max_abs)}, "
        f"scaled {number(call.scaled_drift)}, added {number(call.added_drift)}"
        f"{' &mdash; first drift' if call.first_drift else ''}</li>"
        for call in ranked
    )
    title = f"onnx_modular diff: {report.a} vs {report.b}"
    summary = "<br>".join(_escape(line) for line in _summary(report))
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{_escape(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h2>{_escape(title)}</h2><p>{summary}</p>"
        "<p class='legend'>Rows: one module call, matched by module path and class. "
        "<span style='background:#ffe8cc'></span>changed in its own body"
        "<span style='background:#fff6e0'></span>changed below (a call it makes)"
        "<span style='background:#d3f9d8'></span>only in B"
        "<span style='background:#ffe3e3'></span>only in A; "
        "bold: the first call in execution order whose outputs differ; bar: max abs drift (log scale).</p>"
        f"<table>{head}{''.join(rows)}</table>"
        + (f"<h3>Where the drift is made</h3><p>scaled: max abs over the range of the output's values; added: scaled minus the largest scaled drift measured before the call.</p><ol>{ranking}</ol>" if ranked else "")
        + f"<h3>Terminal view</h3><pre>{_escape(text(report))}</pre></body></html>"
    )
