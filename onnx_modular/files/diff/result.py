"""What ``diff`` found: :class:`ModelDiff` (the merged call tree and the run's settings) and
:class:`CallDiff` (one call's verdict, drift and times), with their JSON records and saving.

The tool is :mod:`onnx_modular.files.diff.tool` (which exports these types from there too); the
terminal tree and the HTML page are :mod:`onnx_modular.files.diff.views`. No torch.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

from onnx_modular.format import records
from onnx_modular.format.calltree import ModuleCall, TreeNode
from onnx_modular.storage import save as _save
from onnx_modular.storage.proto import function_label

__all__ = ["ModelDiff", "CallDiff", "CHANGES"]

#: The structural verdicts of a call.
CHANGES = ("same", "changed", "added", "removed")


@dataclasses.dataclass(eq=False)
class CallDiff(TreeNode):
    """One module call of either file (or both), with what differs.

    Attributes:
        path: The call name (``h.1.mlp``, ``shared@1``; ``""`` for the main graph).
        qualified_class: The module's class (``""`` when the file does not say).
        change: ``same``, ``changed``, ``added`` (only in B) or ``removed`` (only in A).
        changed_in: For a changed call, ``"own"`` (its own body differs) or ``"below"`` (its body is
            the same; a call it makes differs); else ``None``.
        what: What differs, in words (``nodes added: 1 Mul``, ``weight values: h.0.mlp.c_fc.weight``,
            ``calls below changed: h.1.mlp``, ``body: GPT2Block -> GPT2Block_2``).
        a, b: The call in each file's tree (``None`` on the side it is missing from).
        children: The calls it makes, both files merged, in execution order.
        max_abs, max_rel: Largest difference of its outputs between the files (``None`` when not
            compared: numerics off, a call on one side only, a call without ops); ``max_rel`` over
            A's values larger than the dtype's default ``atol`` (1e-4 for float32, 1e-2 for float16).
        scaled_drift: ``max_abs`` of each output over the range of A's values of that output, the
            largest over its outputs (:mod:`onnx_modular.check.drift`, the one drift definition
            ``convert`` and ``optimize`` use too): drift on one scale for every call (a LayerNorm's
            output and a logit's compare), robust to values near 0 (which make ``max_rel`` large).
        drift_before: The largest ``scaled_drift`` of the calls that finished before it in execution
            order (those it makes included): the drift that can have reached it.
        order: Its place in execution order (calls finish children first), ``None`` if not run.
        time_a_us, time_b_us: Its inclusive kernel time in each file (``profile=True``).
        first_drift: The first call in execution order whose outputs differ.
    """

    path: str
    qualified_class: str
    change: str
    a: ModuleCall | None
    b: ModuleCall | None
    changed_in: str | None = None
    what: list[str] = dataclasses.field(default_factory=list)
    children: list[CallDiff] = dataclasses.field(default_factory=list)
    parent: CallDiff | None = dataclasses.field(default=None, repr=False)
    max_abs: float | None = None
    max_rel: float | None = None
    scaled_drift: float | None = None
    drift_before: float | None = None
    order: int | None = None
    time_a_us: float | None = None
    time_b_us: float | None = None
    first_drift: bool = False

    @property
    def class_name(self) -> str:
        call = self.b or self.a
        return call.class_name if call is not None else ""

    @property
    def function_a(self) -> str | None:
        return _label(self.a)

    @property
    def function_b(self) -> str | None:
        return _label(self.b)

    @property
    def added_drift(self) -> float | None:
        """``scaled_drift - drift_before`` (0 when smaller): the drift the call adds beyond what can
        have reached it (all of it where drift first appears; ``None`` when not measured).

        ``drift_before`` bounds what reached the call by everything measured before it, so this
        ranks where drift is made; it is not a measurement of the call on its exact inputs.
        """
        if self.scaled_drift is None or self.drift_before is None:
            return None
        return max(self.scaled_drift - self.drift_before, 0.0)

    @property
    def time_ratio(self) -> float | None:
        """B's time over A's (``None`` without both)."""
        if self.time_a_us is None or self.time_b_us is None or self.time_a_us <= 0:
            return None
        return self.time_b_us / self.time_a_us

    @property
    def verdict(self) -> str:
        """``change`` with ``below`` spelled out: ``same``, ``changed``, ``changed below``, ``added``, ``removed``."""
        return "changed below" if self.changed_in == "below" else self.change

    def record(self) -> dict[str, Any]:
        """The JSON record of this call (times in milliseconds)."""
        return {
            "path": self.path,
            "class": self.qualified_class or None,
            "change": self.change,
            "changed_in": self.changed_in,
            "what": list(self.what),
            "depth": self.depth,
            "function_a": self.function_a,
            "function_b": self.function_b,
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "scaled_drift": self.scaled_drift,
            "drift_before": self.drift_before,
            "added_drift": self.added_drift,
            "first_drift": self.first_drift,
            "order": self.order,
            "time_a_ms": None if self.time_a_us is None else self.time_a_us / 1e3,
            "time_b_ms": None if self.time_b_us is None else self.time_b_us / 1e3,
            "time_ratio": self.time_ratio,
        }


def _label(call: ModuleCall | None) -> str | None:
    if call is None:
        return None
    if call.is_root:
        return call.node_name or "main_graph"
    if call.function is None:
        return None
    return function_label((call.function[0], call.function[1], call.overload))


@dataclasses.dataclass
class ModelDiff:
    """What :func:`~onnx_modular.files.diff.tool.diff` found (``str()`` is the terminal view).

    Attributes:
        a, b: The two files.
        root: The merged call tree (the root is the main graph; its drift is the model outputs').
        inputs: Shape and dtype of each input the files were run on (empty without numerics).
        random_inputs: The inputs were random (seed ``seed``), not given.
        seed: Seed of the random inputs.
        numerics: Whether the files were run.
        settings: The profile's settings (``profile=True``), else ``None``.
        note: What could not be compared, if anything.
        cast: The inputs B declares with another floating-point type, and that type: B got the same
            values cast to it (a float32 file and its float16 copy).
        by_module: A file had no local functions: modules were compared by the module path on each
            node (a flat copy's labels), not calls; only the model outputs' drift is measured.
    """

    a: str
    b: str
    root: CallDiff
    inputs: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    random_inputs: bool = True
    seed: int = 0
    numerics: bool = True
    settings: dict[str, Any] | None = None
    note: str | None = None
    by_module: bool = False
    cast: dict[str, str] = dataclasses.field(default_factory=dict)

    def calls(self) -> list[CallDiff]:
        """Every call (the main graph excluded), in display order."""
        return [call for call in self.root.walk() if not call.is_root]

    def __getitem__(self, path: str) -> CallDiff:
        for call in self.root.walk():
            if call.path == path:
                return call
        raise KeyError(path)

    @property
    def first_drift(self) -> CallDiff | None:
        """The first call in execution order whose outputs differ."""
        return next((call for call in self.calls() if call.first_drift), None)

    @property
    def differs(self) -> bool:
        """Anything differs: a call's structure, a call's outputs or the model's outputs."""
        return any(call.change != "same" or call.max_abs for call in self.root.walk())

    def versions(self) -> dict[str, tuple[str, str]]:
        """``{package: (version in A, version in B)}`` for the packages whose classes' versions differ
        between matched calls (two exports by two versions of transformers)."""
        found: dict[str, tuple[str, str]] = {}
        for call in self.calls():
            if call.a is not None and call.b is not None and call.a.version != call.b.version:
                found.setdefault(call.b.package or call.a.package, (call.a.version, call.b.version))
        return found

    def counts(self) -> dict[str, int]:
        """Calls per verdict (``same``, ``changed``, ``changed below``, ``added``, ``removed``)."""
        counts = dict.fromkeys(("same", "changed", "changed below", "added", "removed"), 0)
        for call in self.calls():
            counts[call.verdict] += 1
        return counts

    def ranked(self, count: int | None = None) -> list[CallDiff]:
        """Calls whose outputs differ, the ones that add the most drift first (:attr:`CallDiff.added_drift`),
        then by ``scaled_drift`` and execution order."""
        drifting = [call for call in self.calls() if call.max_abs]
        drifting.sort(key=lambda call: (-(call.added_drift or 0.0), -(call.scaled_drift or 0.0), call.order or 0))
        return drifting if count is None else drifting[:count]

    def records(self) -> list[dict[str, Any]]:
        """One record per call (the main graph first, as ``path: ""``), in display order."""
        return [call.record() for call in self.root.walk()]

    def to_json(self, indent: int | None = 2) -> str:
        """The records as a JSON list (an infinite difference as the string ``"inf"``)."""
        return records.to_json(self.records(), indent=indent)

    def format(self, max_depth: int | None = None, *, top: int = 10) -> str:
        from onnx_modular.files.diff.views import text

        return text(self, max_depth, top=top)

    def __str__(self) -> str:
        return self.format()

    def html(self) -> str:
        from onnx_modular.files.diff.views import html_page

        return html_page(self)

    def save(self, *, json: str | os.PathLike | None = None, html: str | os.PathLike | None = None) -> list[pathlib.Path]:
        """Write the JSON records and the HTML page (those given), each atomically; every
        destination is checked before anything is written."""
        targets = [(path, kind) for path, kind in ((json, "json"), (html, "html")) if path is not None]
        for path, _ in targets:
            _save.check_destination(path)
        texts = [(path, self.to_json() if kind == "json" else self.html()) for path, kind in targets]
        return [_save.write_text(path, text) for path, text in texts]

