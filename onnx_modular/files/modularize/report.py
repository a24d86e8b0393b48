"""What ``modularize`` did: :class:`ModularizeReport` and its text (``str(report)``, the command's output).

The tool is :mod:`onnx_modular.files.modularize.tool`, which also exports the report from there.
"""

from __future__ import annotations

import dataclasses
import pathlib

from onnx_modular.calls import inferred
from onnx_modular.check.parity import ParityReport
from onnx_modular.format.calltree import CallTree
from onnx_modular.format.text import shown

__all__ = ["ModularizeReport"]

@dataclasses.dataclass
class ModularizeReport:
    """What :func:`~onnx_modular.files.modularize.tool.modularize` did.

    Attributes:
        path: The modular file written (``None`` when nothing was written).
        source: Which of :data:`~onnx_modular.calls.scoped.SOURCES` the call tree came from.
        tree: The call tree of the written file (counts from the final model).
        calls: Module calls outlined into functions.
        functions: Distinct functions in the file (after dedupe).
        max_depth: Deepest nesting of calls.
        nodes: Main-graph nodes of the flat file.
        nodes_in_calls: Nodes that went into calls.
        nodes_in_parent: Nodes that stayed in the main graph.
        unscoped: Of those, the nodes that carried no scope at all (an optimizer's constants,
            names that are not scopes); the others belong to the root module.
        unscoped_total: Nodes of the flat file without a scope; those between the nodes of one
            call (reading from it and feeding it) went into it, as export places such nodes.
        parity: The modular file against the flat one in onnxruntime.
        inferred: The repeats found by structure (``calls/inferred.py``) when calls were
            inferred (``source`` is :data:`~onnx_modular.files.modularize.tool.INFERRED_SOURCE`, or a file
            with unscoped runs).
        absorbed: Calls with nodes but no function of their own (their nodes inside another call).
        unrecovered: What a flat file could not give back, one line each: a call whose body took
            in nodes of other scopes between its own (a module called more than once: its calls
            are merged into one; or code interleaved with it), and a module whose weights are in
            the file but that has no node of its own (torch's optimizer fused it into another
            module's node, Conv+BatchNorm, or folded it). A module whose every node was folded
            into constants leaves no trace in the file and cannot be listed.
    """

    path: pathlib.Path | None
    source: str
    tree: CallTree
    calls: int
    functions: int
    max_depth: int
    nodes: int
    nodes_in_calls: int
    nodes_in_parent: int
    unscoped: int
    unscoped_total: int
    parity: ParityReport | None
    absorbed: list[str] = dataclasses.field(default_factory=list)
    inferred: inferred.Inference | None = None
    unrecovered: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [
            f"call tree from {self.source}: {_count(self.calls, 'module call')}, {_count(self.functions, 'function')}, "
            f"nested {self.max_depth} deep",
            f"nodes: {self.nodes} in the flat file, {self.nodes_in_calls} went into calls, "
            f"{self.nodes_in_parent} stayed in the main graph ({self.unscoped} of them for lack of a scope)",
        ]
        if self.unscoped_total > self.unscoped:
            moved = self.unscoped_total - self.unscoped
            lines.append(f"{_count(moved, 'node')} without a scope went into the call whose nodes surround them")
        if self.absorbed:
            lines.append(
                f"{_count(len(self.absorbed), 'call')} without a function of its own, its nodes inside another call "
                f"(interleaved scopes, or a module called twice): {', '.join(shown(p) for p in self.absorbed[:8])}"
                + (" ..." if len(self.absorbed) > 8 else "")
            )
        if self.inferred is not None:
            lines += _inferred_lines(self.inferred)
        if self.unrecovered:
            lines.append(f"not recovered from the flat file ({len(self.unrecovered)}):")
            lines += [f"  {line}" for line in self.unrecovered[:12]]
            if len(self.unrecovered) > 12:
                lines.append(f"  ... and {len(self.unrecovered) - 12} more (report.unrecovered)")
        if self.parity is not None:
            lines.append(str(self.parity))
        if self.path is not None:
            lines.append(f"wrote {shown(str(self.path))}")
        return "\n".join(lines)


def _inferred_lines(found: inferred.Inference) -> list[str]:
    lines = []
    for region in found.regions:
        parts = ", ".join(f"{part} ({end - start})" for start, end, part in region.parts)
        lines.append(
            f"inferred: {region.count} copies of a {region.length}-node block ({region.name}.0 ... "
            f"{region.name}.{region.count - 1})" + (f", parts {parts}" if parts else "")
        )
    lines.append(f"{found.covered} of the {found.skeleton} nodes that depend on an input are in repeated blocks")
    return lines


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"
