"""Views of a :class:`~onnx_modular.profiling.run.ProfileReport`: the terminal view, a Chrome trace, an HTML flame chart.

All are built from data only; names from the file are escaped (JSON in the trace, ``textContent``
and an escaped ``<pre>`` in the page), and the page loads nothing from the network.
"""

from __future__ import annotations

import html
import json
from typing import Any

from onnx_modular.check.parity import fit_name
from onnx_modular.format.text import shown

# The report (onnx_modular.profiling.run.ProfileReport) is taken as it comes, not imported: its
# methods call these views, and the package has no import circles (tests/test_layout.py).
ProfileReport = Any

__all__ = ["text", "chrome_trace", "html_page"]

#: Microseconds left empty between two runs in the trace.
_RUN_GAP_US = 50.0


def text(report: ProfileReport, max_depth: int | None = None, *, top: int = 10) -> str:
    """The terminal view: the call tree with time columns, the slowest calls by self time, the
    time per class (per op type for a file without functions)."""
    settings = report.settings
    counts = report.counts
    lines = [
        f"Profile of {shown(report.path)}: {settings.get('runs')} runs after {settings.get('warmup')} warm-up, "
        f"{', '.join(settings.get('providers', []))}, intra-op threads: {settings.get('threads') or 'default'}, "
        f"graph optimizations {settings.get('optimization')}",
        f"median profiled run {report.median_run_us / 1e3:.3f} ms, kernels {report.total_us / 1e3:.3f} ms in "
        f"{len(report.kernels)} kernels ({counts['node']} by node, {counts['fused']} fused, "
        f"{counts['inserted']} inserted by onnxruntime; {counts['crossing']} fused across module boundaries)",
    ]
    if report.note:
        lines.append(f"note: {report.note}")
    lines.append("")
    drift = report.drift is not None
    header = ["call", "class", "incl ms", "self ms", "share", "kernels"] + (["max abs", "ok"] if drift else [])
    rows = [header]
    marked = False
    for call, prefix in report.tree.drawn(max_depth):
        item = report.times[call.key]
        name = (call.node_name or "main_graph") if call.is_root else call.call_name
        if item.fused_across:
            name += " *"
            marked = True
        row = [
            prefix + name,
            # a call of a flat file has no function but nodes (and kernels) of its own
            item.label if call.function is not None or call.is_root or call.num_nodes or item.kernels
            else f"{call.class_name} ({call._status()})",
            f"{item.inclusive_us / 1e3:.3f}",
            f"{item.self_us / 1e3:.3f}",
            f"{100 * item.share:.1f}%",
            str(item.kernels),
        ]
        if drift:
            found = report.drift.get(call.key)
            if found is None or found.get("max_abs") is None:
                row += ["", ""]
            else:
                row += [f"{found['max_abs']:.1e}", "yes" if found.get("ok") else "NO"]
        rows.append(row)
    rows = [[shown(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
        cells += [row[i].rjust(widths[i]) for i in range(2, len(header))]
        lines.append("  ".join(cells).rstrip())
    if max_depth is not None and report.tree.height > max_depth:
        lines.append(f"(calls deeper than {max_depth} not shown)")
    if marked:
        lines.append("* holds kernels onnxruntime fused across module boundaries (attributed to the innermost call holding all their parts)")
    calls = report.calls()
    if calls:
        lines += ["", "Slowest calls by self time:"]
        width = max(len(item.key) for item in report.by_self(top))
        for rank, item in enumerate(report.by_self(top), 1):
            lines.append(
                f"{rank:>3}. {shown(fit_name(item.key, 60)):<{min(width, 60)}}  {shown(item.label):<16} "
                f"{item.self_us / 1e3:8.3f} ms  {100 * item.self_us / (report.total_us or 1):5.1f}%"
            )
        lines += ["", "Per class (total over calls; spread = (max - min) / median between calls):"]
        table = [["class", "calls", "total ms", "share", "min ms", "median ms", "max ms", "spread", "slowest call"]]
        for group in report.classes():
            table.append(
                [
                    group.label,
                    str(group.calls),
                    f"{group.total_us / 1e3:.3f}",
                    f"{100 * group.share:.1f}%",
                    f"{group.min_us / 1e3:.3f}",
                    f"{group.median_us / 1e3:.3f}",
                    f"{group.max_us / 1e3:.3f}",
                    f"{100 * group.spread:.0f}%",
                    group.slowest if group.calls > 1 else "",
                ]
            )
        lines += _columns(table)
    if not calls or settings.get("local_functions") == 0:  # a flat file: by op type as well
        lines += ["", "Per op type:"]
        table = [["op type", "kernels", "time ms", "share"]]
        for op_type, count, median_us, share in report.by_op_type():
            table.append([op_type, str(count), f"{median_us / 1e3:.3f}", f"{100 * share:.1f}%"])
        lines += _columns(table)
    return "\n".join(lines)



def _columns(table: list[list[str]]) -> list[str]:
    table = [[shown(cell) for cell in row] for row in table]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = []
    for row in table:
        cells = [row[0].ljust(widths[0])] + [row[i].rjust(widths[i]) for i in range(1, len(row) - 1)]
        cells.append(row[-1].ljust(widths[-1]) if len(row) > 2 and not row[-1][:1].isdigit() else row[-1].rjust(widths[-1]))
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def _chain(report: ProfileReport, key: str) -> list[str]:
    """Keys of the calls from the outermost down to ``key`` (the main graph excluded)."""
    chain = []
    node = report.tree[key] if key in report.tree else report.tree.root
    while node is not None and not node.is_root:
        chain.append(node.key)
        node = node.parent
    return chain[::-1]


def chrome_trace(report: ProfileReport) -> dict[str, Any]:
    """Chrome's trace-event format: one ``run N`` span per measured run, the module calls as nested
    spans inside it and the kernels as the innermost spans.

    A call is one span for each stretch of consecutive kernels it ran (onnxruntime may run a
    node of one call between two of another; the spans stay properly nested). Times are
    microseconds; runs are laid end to end.
    """
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 1, "tid": 1, "name": "process_name", "args": {"name": f"onnx_modular profile: {report.path}"}},
        {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name", "args": {"name": "onnxruntime (module calls, kernels)"}},
    ]
    labels = {item.key: item.label for item in report.times.values()}

    def span(name: str, cat: str, start: float, duration: float, args: dict[str, Any]) -> None:
        events.append(
            {"ph": "X", "pid": 1, "tid": 1, "name": name, "cat": cat, "ts": round(start, 3), "dur": round(max(duration, 0.0), 3), "args": args}
        )

    offset = 0.0
    for run, timeline in enumerate(report.timeline):
        length = max(report.run_us[run], max((start + duration for _, start, duration in timeline), default=0.0))
        span(f"run {run}", "run", offset, length, {"kernels_ms": report.kernel_us[run] / 1e3})
        open_calls: list[tuple[str, float]] = []
        previous_end = offset

        def close(keep: int, at: float, open_calls: list[tuple[str, float]] = open_calls) -> None:
            while len(open_calls) > keep:
                key, begun = open_calls.pop()
                span(key, "module", begun, at - begun, {"class": labels.get(key, "")})

        for position, start, duration in timeline:
            kernel = report.kernels[position]
            chain = _chain(report, kernel.call)
            common = 0
            while common < min(len(chain), len(open_calls)) and open_calls[common][0] == chain[common]:
                common += 1
            close(common, previous_end)
            begin = offset + start
            open_calls.extend((key, begin) for key in chain[common:])
            args = {"op_type": kernel.op_type, "call": kernel.call, "kind": kernel.kind}
            if kernel.parts:
                args["parts"] = list(kernel.parts)
                args["crosses_modules"] = kernel.crosses
            span(kernel.name, "kernel", begin, duration, args)
            previous_end = max(previous_end, begin + duration)  # a control-flow kernel spans its subgraph's
        close(0, previous_end)
        offset += length + _RUN_GAP_US
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"path": report.path, **_plain(report.settings)}}


def _plain(settings: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(settings, default=str))


def _flame_data(report: ProfileReport) -> dict[str, Any]:
    """The call tree with times, each call's own kernels as leaves (times in microseconds)."""
    own: dict[str, list[dict[str, Any]]] = {}
    for kernel in report.kernels:
        own.setdefault(kernel.call if kernel.call in report.times else report.tree.root.key, []).append(
            {"n": kernel.name, "c": kernel.op_type, "v": kernel.median_us, "k": 1, "x": int(kernel.crosses), "ch": []}
        )

    def entry(call) -> dict[str, Any]:
        item = report.times[call.key]
        data = {
            "n": call.key or (call.node_name or "main_graph"),
            "c": item.label,
            "v": item.inclusive_us,
            "s": item.self_us,
            "p": item.share,
            "kc": item.kernels,
            "x": item.fused_across,
            "ch": [],
        }
        if report.drift is not None and call.key in report.drift:
            data["d"] = report.drift[call.key]
        return data

    root = entry(report.tree.root)
    stack = [(report.tree.root, root)]
    while stack:
        call, converted = stack.pop()
        for child in call.children:
            if report.times[child.key].inclusive_us <= 0 and not child.children:
                continue
            child_entry = entry(child)
            converted["ch"].append(child_entry)
            stack.append((child, child_entry))
        converted["ch"].extend(own.get(call.key, []))
    return root


_SCRIPT = r"""
const data = JSON.parse(document.getElementById('profile-data').textContent);
const svg = document.getElementById('flame'), NS = 'http://www.w3.org/2000/svg';
const W = 1180, ROW = 18;
function hue(s) { let h = 0; for (const ch of s) h = (h * 31 + ch.charCodeAt(0)) % 360; return h; }
function ms(us) { return (us / 1000).toFixed(3) + ' ms'; }
function tip(n) {
  if (n.k) return n.n + ' (' + n.c + '): ' + ms(n.v) + (n.x ? ', fused across module boundaries' : '');
  let t = (n.n || 'main graph') + (n.c ? ' (' + n.c + ')' : '') + ': inclusive ' + ms(n.v) + ', self ' + ms(n.s) +
          ', ' + (100 * n.p).toFixed(1) + '% of the kernel time, ' + n.kc + ' kernels';
  if (n.d) t += ', max abs error ' + (n.d.max_abs === null ? '?' : n.d.max_abs.toExponential(1)) + (n.d.ok === false ? ' (beyond tolerance)' : '');
  return t;
}
function layout(node, x, w, depth, out) {
  out.push([node, x, w, depth]);
  const sum = node.ch.reduce((a, c) => a + c.v, 0);
  const scale = node.v > 0 && sum > node.v ? node.v / sum : 1;
  let cx = x;
  for (const c of node.ch) {
    const cw = node.v > 0 ? w * c.v / node.v * scale : 0;
    if (cw >= 0.3) layout(c, cx, cw, depth + 1, out);
    cx += cw;
  }
  return out;
}
function draw(root) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const boxes = layout(root, 0, W, 0, []);
  const depth = Math.max(...boxes.map(b => b[3])) + 1;
  svg.setAttribute('height', depth * ROW + 2);
  for (const [n, x, w, d] of boxes) {
    const g = document.createElementNS(NS, 'g');
    const r = document.createElementNS(NS, 'rect');
    r.setAttribute('x', x); r.setAttribute('y', d * ROW); r.setAttribute('width', Math.max(w - 0.5, 0.2));
    r.setAttribute('height', ROW - 2); r.setAttribute('rx', 2);
    let fill = n.k ? 'hsl(210, 10%, 78%)' : 'hsl(' + hue(n.c || 'main') + ', 65%, 68%)';
    if (n.d && n.d.ok === false) fill = 'hsl(0, 80%, 60%)';
    r.setAttribute('fill', fill);
    if (n.x) { r.setAttribute('stroke', '#e8590c'); r.setAttribute('stroke-width', 1.5); }
    const title = document.createElementNS(NS, 'title'); title.textContent = tip(n); g.appendChild(title);
    g.appendChild(r);
    if (w > 36) {
      const t = document.createElementNS(NS, 'text');
      t.setAttribute('x', x + 3); t.setAttribute('y', d * ROW + 12);
      const label = (n.n || 'main graph') + (n.c && !n.k ? ' ' + n.c : '');
      t.textContent = label.length * 6.2 > w - 6 ? label.slice(0, Math.max(0, Math.floor((w - 6) / 6.2) - 1)) + '…' : label;
      g.appendChild(t);
    }
    g.addEventListener('click', () => {
      const zoomed = d > 0 && n.ch.length;
      draw(zoomed ? n : data);
      document.getElementById('zoom').textContent = zoomed ? 'showing ' + n.n + ' (click the top bar to zoom out)' : '';
    });
    svg.appendChild(g);
  }
}
function find(n, name) { if (n.n === name && !n.k) return n; for (const c of n.ch) { const f = find(c, name); if (f) return f; } return null; }
const start = location.hash.length > 1 ? find(data, decodeURIComponent(location.hash.slice(1))) : null;
draw(start && start.ch.length ? start : data);
if (start && start.ch.length) document.getElementById('zoom').textContent = 'showing ' + start.n + ' (click the top bar to zoom out)';
"""


def html_page(report: ProfileReport) -> str:
    """One self-contained page: the flame chart (inline SVG drawn by inline JavaScript, click a
    call to zoom in, hover for its times) and the terminal view. Nothing is loaded from elsewhere."""
    data = json.dumps(_flame_data(report), allow_nan=False).replace("<", "\\u003c")
    counts = report.counts
    title = f"onnx_modular profile: {report.path}"
    summary = (
        f"median profiled run {report.median_run_us / 1e3:.3f} ms, kernels {report.total_us / 1e3:.3f} ms in "
        f"{len(report.kernels)} kernels ({counts['fused']} fused by onnxruntime, {counts['crossing']} of them "
        f"across module boundaries); {report.settings.get('runs')} runs, "
        f"{', '.join(report.settings.get('providers', []))}"
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:16px} svg text{font-size:11px;pointer-events:none;"
        "font-family:monospace} svg g{cursor:pointer} pre{font-size:12px;background:#f8f8f8;padding:8px}"
        ".legend span{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;vertical-align:middle}"
        "</style></head><body>"
        f"<h2>{html.escape(title)}</h2><p>{html.escape(summary)}</p>"
        "<p class='legend'>Width: inclusive kernel time (sum of the kernels' medians over runs). Bars: module calls (colour by class), "
        "<span style='background:hsl(210,10%,78%)'></span>kernels, "
        "<span style='border:2px solid #e8590c'></span>fused across module boundaries"
        + ("<span style='background:hsl(0,80%,60%)'></span>outputs beyond tolerance (joined drift)" if report.drift else "")
        + ". Click a bar to zoom in, the top bar to zoom out (or open the page at #h.3 to start on that call); hover for the numbers. "
        "<span id='zoom' style='width:auto;height:auto'></span></p>"
        "<svg id='flame' xmlns='http://www.w3.org/2000/svg' width='1180' height='40'></svg>"
        f"<script type='application/json' id='profile-data'>{data}</script>"
        f"<script>{_SCRIPT}</script>"
        f"<pre>{html.escape(report.format())}</pre></body></html>"
    )
