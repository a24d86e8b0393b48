"""The record of a profile: times per kernel, per module call and per class, and its views.

:func:`onnx_modular.profiling.run.profile` makes a :class:`ProfileReport`; this module holds
what it returns (numbers, grouping, JSON, the tree text, the trace and the flame chart through
:mod:`onnx_modular.profiling.views`), so that the run and the record each have one home.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import statistics
from collections.abc import Mapping
from typing import Any

from onnx_modular.errors import InvalidInputError
from onnx_modular.format import records
from onnx_modular.format.calltree import CallTree, ModuleCall
from onnx_modular.storage import save as _save

__all__ = ["ProfileReport", "CallTime", "KernelTime", "ClassTime"]


@dataclasses.dataclass
class KernelTime:
    """One node of the graph onnxruntime ran, with its time.

    Attributes:
        name: Node name in the profiled copy (``h.3.attn.c_attn/node_addmm``; onnxruntime's
            name for a node it made, such as ``GPT2Gelu_token_35``).
        op_type: The kernel's operator (onnxruntime's ``op_name``).
        call: Key of the module call it belongs to (``""``: the main graph).
        kind: ``node``, ``fused`` or ``inserted`` (see :class:`~onnx_modular.profiling.attribution.Attribution`).
        parts: For a fused node, the nodes it replaced.
        crosses: A fused node whose parts lie in more than one module call.
        provider: The execution provider that ran it.
        median_us: Median over the runs of its time in a run (summed when it runs more than
            once a run; a control-flow kernel's time excludes the kernels of its subgraphs).
        runs_us: Its time in each measured run.
    """

    name: str
    op_type: str
    call: str
    kind: str
    parts: tuple[str, ...]
    crosses: bool
    provider: str
    median_us: float
    runs_us: list[float] = dataclasses.field(repr=False)


@dataclasses.dataclass
class CallTime:
    """The time of one module call (``call`` is the :class:`ModuleCall`; the root is the main graph).

    Attributes:
        inclusive_us: Kernel time of the call and everything it calls: the sum of its kernels'
            medians over the runs.
        self_us: The same for its own kernels (those of nodes in its body, not in its callees).
        share: ``inclusive_us`` over the total (the main graph's ``inclusive_us``).
        kernels: Kernels under the call (its own and its callees').
        self_kernels: Its own kernels.
        fused_across: Its own kernels that onnxruntime fused across module boundaries.
        self_runs_us: Its own kernels' time in each run.
    """

    call: ModuleCall
    inclusive_us: float
    self_us: float
    share: float
    kernels: int
    self_kernels: int
    fused_across: int
    self_runs_us: list[float] = dataclasses.field(default_factory=list, repr=False)

    @property
    def key(self) -> str:
        return self.call.key

    def __repr__(self) -> str:
        return (
            f"CallTime({self.key!r}, {self.label or 'main graph'}, inclusive {self.inclusive_us / 1e3:.3f} ms, "
            f"self {self.self_us / 1e3:.3f} ms, {100 * self.share:.1f}%)"
        )

    @property
    def label(self) -> str:
        """Class name, else function name (``""`` for the main graph)."""
        return "" if self.call.is_root else (self.call.class_name or (self.call.function or ("", ""))[1])


@dataclasses.dataclass
class ClassTime:
    """All calls of one class (or function, for files without classes).

    Attributes:
        total_us: Sum of the calls' inclusive medians (a call nested in a call of the same
            class is counted once, in the outer one).
        min_us, median_us, max_us: Over the calls' inclusive medians.
        spread: ``(max - min) / median`` between calls (0 for one call).
        slowest: Key of the slowest call.
    """

    label: str
    calls: int
    total_us: float
    share: float
    min_us: float
    median_us: float
    max_us: float
    spread: float
    slowest: str


def median_of(values) -> float:
    values = list(values)
    return float(statistics.median(values)) if values else 0.0


@dataclasses.dataclass
class ProfileReport:
    """A run-time profile of one ONNX file on its module-call tree (see :func:`onnx_modular.profiling.run.profile`).

    Attributes:
        path: The profiled file.
        tree: Its call tree (:func:`~onnx_modular.calls.tree.function_tree`).
        times: :class:`CallTime` per call key (the root's key is ``""``).
        kernels: :class:`KernelTime` of every node onnxruntime ran, in execution order.
        run_us: Wall time of each measured run, as onnxruntime's profiler recorded it.
        kernel_us: The profiler's kernel time of each measured run (all its kernel events).
        timeline: Per measured run, ``(kernel index, start, duration)`` in microseconds from
            the run's start, in execution order (for the trace).
        settings: Runs, warm-up, providers, threads, optimization level, inputs.
        note: A one-line note (a file without functions is profiled by op type).
        drift: Per call key, the error against PyTorch (:meth:`join`), else ``None``.
    """

    path: str
    tree: CallTree
    times: dict[str, CallTime]
    kernels: list[KernelTime]
    run_us: list[float]
    kernel_us: list[float]
    timeline: list[list[tuple[int, float, float]]] = dataclasses.field(repr=False)
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    note: str | None = None
    drift: dict[str, dict[str, Any]] | None = None

    # -- numbers -----------------------------------------------------------------------------

    @property
    def total_us(self) -> float:
        """Kernel time of a run: the sum of every kernel's median (the main graph's inclusive time)."""
        return self.times[self.tree.root.key].inclusive_us

    @property
    def median_run_us(self) -> float:
        """Median wall time of a run (kernels plus onnxruntime's executor between them)."""
        return median_of(self.run_us)

    @property
    def root(self) -> CallTime:
        return self.times[self.tree.root.key]

    def calls(self) -> list[CallTime]:
        """Every module call's time, in execution order (the main graph excluded)."""
        return [self.times[call.key] for call in self.tree.walk() if not call.is_root]

    def by_self(self, count: int | None = None) -> list[CallTime]:
        """Module calls, slowest self time first."""
        ranked = sorted(self.calls(), key=lambda item: -item.self_us)
        return ranked if count is None else ranked[:count]

    def classes(self, by: str = "class") -> list[ClassTime]:
        """Time per class, largest total first.

        Args:
            by: ``"class"``, or ``"function"``: per ONNX function, so calls of one class with
                different shapes (GPT-2's ``Conv1D`` as ``c_attn``, ``c_fc``, ...) are apart and the
                spread compares identical calls only.
        """
        if by not in ("class", "function"):
            raise InvalidInputError(f"by must be 'class' or 'function', got {by!r}.")
        def group_of(call: ModuleCall) -> str:
            if by == "function":
                return call.function[1] if call.function else ""
            return self.times[call.key].label or "?"

        groups: dict[str, list[CallTime]] = {}
        for item in self.calls():
            if item.call.function is not None or item.kernels:  # calls without ops have no time (a flat file's have kernels)
                groups.setdefault(group_of(item.call), []).append(item)
        result = []
        total = self.total_us or 1.0
        for label, items in groups.items():
            outer = [
                item for item in items if not any(group_of(a) == label for a in _ancestors(item.call))
            ]
            inclusive = [item.inclusive_us for item in items]
            middle = median_of(inclusive)
            total_us = sum(item.inclusive_us for item in outer)
            result.append(
                ClassTime(
                    label,
                    len(items),
                    total_us,
                    total_us / total,
                    min(inclusive),
                    middle,
                    max(inclusive),
                    (max(inclusive) - min(inclusive)) / middle if middle > 0 else 0.0,
                    max(items, key=lambda item: item.inclusive_us).key,
                )
            )
        return sorted(result, key=lambda item: -item.total_us)

    def by_op_type(self) -> list[tuple[str, int, float, float]]:
        """``(op type, kernels, time, share)`` per operator (sums of kernel medians), largest first."""
        groups: dict[str, list[KernelTime]] = {}
        for kernel in self.kernels:
            groups.setdefault(kernel.op_type, []).append(kernel)
        total = self.total_us or 1.0
        rows = []
        for op_type, kernels in groups.items():
            time_us = sum(kernel.median_us for kernel in kernels)
            rows.append((op_type, len(kernels), time_us, time_us / total))
        return sorted(rows, key=lambda row: -row[2])

    @property
    def counts(self) -> dict[str, int]:
        """Kernels by how they were attributed: ``node``, ``fused``, ``inserted`` (see
        :class:`KernelTime`), ``unattributed`` (not a node of onnxruntime's optimized graph: counted
        under the main graph, never guessed; 0 in every profile measured) and ``crossing`` (fused
        across module boundaries)."""
        counts = {"node": 0, "fused": 0, "inserted": 0, "unattributed": 0, "crossing": 0}
        for kernel in self.kernels:
            counts[kernel.kind] += 1
            counts["crossing"] += kernel.crosses
        return counts

    # -- drift -------------------------------------------------------------------------------

    def join(self, localization: Any) -> ProfileReport:
        """This profile with the per-module error of ``localization`` beside the times.

        ``localization`` is a :class:`~onnx_modular.check.localization.LocalizationReport`
        (``result.localize(model)``) or its ``to_dict()``; rows are joined on the call name
        (module path and call index). The terminal view, :meth:`table` and the JSON then show
        ``max abs``, ``max rel`` and ``ok`` per call: slow and wrong in one table.
        """
        modules = localization.get("modules", []) if isinstance(localization, Mapping) else localization.modules
        drift = {}
        for module in modules:
            row = module if isinstance(module, Mapping) else module.to_dict()
            # a call's row (check.parity.Parity) is named by its call name
            drift[row.get("call_name", row.get("name"))] = {key: row.get(key) for key in ("max_abs", "max_rel", "ok")}
        return dataclasses.replace(self, drift=drift)

    def table(self) -> list[dict[str, Any]]:
        """One row per module call (execution order): path, class, times, share, kernels, and the drift if joined."""
        rows = []
        for item in self.calls():
            row = {
                "call": item.key,
                "class": item.label,
                "depth": item.call.depth,
                "inclusive_ms": item.inclusive_us / 1e3,
                "self_ms": item.self_us / 1e3,
                "share": item.share,
                "kernels": item.kernels,
            }
            if self.drift is not None:
                row.update(self.drift.get(item.key, {"max_abs": None, "max_rel": None, "ok": None}))
            rows.append(row)
        return rows

    # -- views -------------------------------------------------------------------------------

    def format(self, max_depth: int | None = None, *, top: int = 10) -> str:
        """The call tree with time columns, the slowest calls by self time and the time per class.

        Args:
            max_depth: Show calls down to this depth (1 = calls in the main graph).
            top: How many calls the "slowest by self time" list shows.
        """
        from onnx_modular.profiling.views import text

        return text(self, max_depth, top=top)
    def __str__(self) -> str:
        return self.format()

    def to_dict(self) -> dict[str, Any]:
        """The profile as JSON-ready data: settings, totals, the call tree with times, classes,
        op types and every kernel with its call (times in milliseconds)."""

        def row(call: ModuleCall) -> dict[str, Any]:
            item = self.times[call.key]
            data = {
                "call": call.key,
                "module_path": call.module_path,
                "call_index": call.call_index,
                "class": call.qualified_class or None,
                "function": call.function[1] if call.function else None,
                "inclusive_ms": item.inclusive_us / 1e3,
                "self_ms": item.self_us / 1e3,
                "share": item.share,
                "kernels": item.kernels,
                "self_kernels": item.self_kernels,
                "fused_across": item.fused_across,
                "children": [],
            }
            if self.drift is not None:
                data["drift"] = self.drift.get(call.key)
            return data

        root = row(self.tree.root)
        stack = [(self.tree.root, root)]
        while stack:
            call, converted = stack.pop()
            for child in call.children:
                child_row = row(child)
                converted["children"].append(child_row)
                stack.append((child, child_row))
        return {
            "path": self.path,
            "settings": self.settings,
            "note": self.note,
            "median_run_ms": self.median_run_us / 1e3,
            "kernel_ms": self.total_us / 1e3,
            "runs_ms": [value / 1e3 for value in self.run_us],
            "kernel_runs_ms": [value / 1e3 for value in self.kernel_us],
            "attribution": self.counts,
            "tree": root,
            "classes": [
                {
                    "class": group.label,
                    "calls": group.calls,
                    "total_ms": group.total_us / 1e3,
                    "share": group.share,
                    "min_ms": group.min_us / 1e3,
                    "median_ms": group.median_us / 1e3,
                    "max_ms": group.max_us / 1e3,
                    "spread": group.spread,
                    "slowest": group.slowest,
                }
                for group in self.classes()
            ],
            "functions": [
                {"function": group.label, "calls": group.calls, "total_ms": group.total_us / 1e3,
                 "median_ms": group.median_us / 1e3, "spread": group.spread, "slowest": group.slowest}
                for group in self.classes("function")
            ],
            "op_types": [
                {"op_type": op, "kernels": count, "time_ms": median / 1e3, "share": share}
                for op, count, median, share in self.by_op_type()
            ],
            "kernels": [
                {
                    "name": kernel.name,
                    "op_type": kernel.op_type,
                    "call": kernel.call,
                    "kind": kernel.kind,
                    "parts": list(kernel.parts),
                    "crosses": kernel.crosses,
                    "provider": kernel.provider,
                    "time_ms": kernel.median_us / 1e3,
                }
                for kernel in self.kernels
            ],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return records.to_json(self.to_dict(), indent=indent)

    def chrome_trace(self) -> dict[str, Any]:
        """A Chrome trace (Perfetto, speedscope, chrome://tracing): each run, the module calls
        as nested spans, the kernels inside."""
        from onnx_modular.profiling.views import chrome_trace

        return chrome_trace(self)

    def html(self) -> str:
        """One self-contained HTML page: a flame chart of the call tree (click to zoom), the tables."""
        from onnx_modular.profiling.views import html_page

        return html_page(self)

    def save(
        self,
        *,
        json: str | os.PathLike | None = None,
        trace: str | os.PathLike | None = None,
        html: str | os.PathLike | None = None,
    ) -> list[pathlib.Path]:
        """Write the JSON, the Chrome trace and the HTML page (those given), each atomically.

        Every destination is checked before anything is written.
        """
        import json as json_module

        targets = [(path, kind) for path, kind in ((json, "json"), (trace, "trace"), (html, "html")) if path is not None]
        for path, _ in targets:
            _save.check_destination(path)
        contents = {
            "json": lambda: self.to_json(),
            "trace": lambda: json_module.dumps(self.chrome_trace(), allow_nan=False),
            "html": lambda: self.html(),
        }
        texts = [(path, contents[kind]()) for path, kind in targets]  # all rendered before any write
        return [_save.write_text(path, text) for path, text in texts]


def _ancestors(call: ModuleCall):
    node = call.parent
    while node is not None and not node.is_root:
        yield node
        node = node.parent
