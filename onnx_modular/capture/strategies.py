"""How a model becomes an ``ExportedProgram``: capture strategies, tried in turn.

Shaped as torch's own ``torch/onnx/_internal/exporter/_capture_strategies.py``: each strategy is
a small object whose call returns an :class:`Attempt` record holding the program or the error.
:func:`capture` runs them in the order of :data:`STRATEGIES`; a strategy runs only where it can
help (:meth:`CaptureStrategy.applies` reads the failures so far), the first program wins, and
its name is kept (``ModularExport.capture_strategy``). When all fail, one
:class:`~onnx_modular.errors.CaptureError` lists each strategy's error (``error.attempts``).

=================  ==========================================================================
strategy           runs when, and what it does
=================  ==========================================================================
torch.export       always: ``torch.export.export(strict=False)`` (the options the caller gave)
size-oblivious     a constraint violation: again with sizes 0 and 1 not specialized
                   (``backed_size_oblivious``, as torch's ``TorchExportNonStrictStrategy``)
suggested-fixes    a violation with torch's "Suggested fixes" (``Dim('seq', max=64)`` for
                   BERT's position table): the fixes applied to ``dynamic_shapes``, exported
                   as the strategy that got them, as ``torch.onnx.export`` does
draft_export       a data-dependent guard (``Eq(u0, 1)``): ``torch.export.draft_export``,
                   kept only when every value it assumed comes from weights and constants
meta:<strategy>    a model on ``meta`` (``weights=``): each strategy again with the example
                   inputs on ``meta`` (``F.linear`` refuses CPU inputs next to meta weights)
=================  ==========================================================================

A capture that works without the later strategies is kept as it was (some bounded ``Dim`` s only
pass without ``backed_size_oblivious``). A program captured beforehand (``exported_program=``)
skips this module; transformers' exporter (:mod:`onnx_modular.hf.exporter`) has each strategy make
its own ``torch.export.export`` call (:func:`first_success`). Everything on torch's private API is
in :mod:`~onnx_modular.capture.torch_compat`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from onnx_modular.capture import diagnostics, torch_compat, torch_export
from onnx_modular.format.text import first_line

__all__ = [
    "STRATEGIES",
    "Attempt",
    "Capture",
    "CaptureCall",
    "CaptureStrategy",
    "DataDependentCaptureWarning",
    "DraftExport",
    "OnMeta",
    "SizeOblivious",
    "SuggestedFixes",
    "TorchExport",
    "capture",
    "first_success",
    "fixed_into",
    "strategies_for",
]


class DataDependentCaptureWarning(UserWarning):
    """torch.export could not decide a branch on a tensor's value; the program assumes the
    example inputs' outcome there (``torch.export.draft_export``)."""


@dataclasses.dataclass(frozen=True)
class CaptureCall:
    """What to capture: the model, its example inputs, ``dynamic_shapes`` (as ``torch.export``
    takes them) and further ``torch.export.export`` keywords (``strict``, ...)."""

    model: torch.nn.Module
    args: tuple
    kwargs: dict
    dynamic_shapes: Any = None
    options: dict = dataclasses.field(default_factory=dict)

    def export(self, dynamic_shapes: Any = None) -> torch.export.ExportedProgram:
        """``torch.export.export`` with this call's options (``dynamic_shapes`` replaced when given)."""
        shapes = self.dynamic_shapes if dynamic_shapes is None else dynamic_shapes
        return torch.export.export(self.model, self.args, self.kwargs, dynamic_shapes=shapes, **self.options)

    def on_meta(self) -> CaptureCall:
        """The same call with every example tensor on the ``meta`` device."""
        to_meta = lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v
        args, kwargs = torch.utils._pytree.tree_map(to_meta, (self.args, self.kwargs))
        return dataclasses.replace(self, args=args, kwargs=kwargs)


@dataclasses.dataclass
class Attempt:
    """One strategy's outcome: its program, or the error it raised."""

    strategy: CaptureStrategy
    program: torch.export.ExportedProgram | None = None
    error: Exception | None = None
    dynamic_shapes: Any = None  # the shapes it exported with, when not the call's

    @property
    def name(self) -> str:
        return self.strategy.name

    @property
    def ok(self) -> bool:
        return self.program is not None

    def __str__(self) -> str:
        if self.ok:
            return f"{self.name}: captured"
        return f"{self.name}: {type(self.error).__name__}: {first_line(self.error)}"


@dataclasses.dataclass
class Capture:
    """The winning program, the strategy that gave it, and every attempt made (failures first)."""

    program: torch.export.ExportedProgram
    strategy: str
    attempts: list[Attempt]
    dynamic_shapes: Any = None  # the shapes suggested fixes refined; None: the call's own


class CaptureStrategy:
    """One way to capture a model. ``strategy(call, failures)`` returns an :class:`Attempt`;
    subclasses set :attr:`name` and implement :meth:`export` (and :meth:`applies` when they only
    help after some failure)."""

    name = "capture"

    def applies(self, failures: Sequence[Attempt]) -> bool:
        """Whether this strategy can help after ``failures`` (the attempts that failed so far)."""
        return True

    def export(self, call: CaptureCall, dynamic_shapes: Any = None) -> torch.export.ExportedProgram:
        """Capture ``call`` (with ``dynamic_shapes`` instead of the call's, when given)."""
        raise NotImplementedError

    def _capture(self, call: CaptureCall, failures: Sequence[Attempt]) -> Attempt:
        return Attempt(self, self.export(call))

    def __call__(self, call: CaptureCall, failures: Sequence[Attempt] = ()) -> Attempt:
        try:
            return self._capture(call, failures)
        except Exception as error:
            return Attempt(self, error=error)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TorchExport(CaptureStrategy):
    """``torch.export.export`` as the caller asked (non-strict unless ``strict=True`` was given)."""

    name = "torch.export"

    def export(self, call, dynamic_shapes=None):
        return call.export(dynamic_shapes)


class SizeOblivious(CaptureStrategy):
    """torch.export with sizes 0 and 1 not specialized (``backed_size_oblivious``), as torch's
    ``TorchExportNonStrictStrategy`` captures: after a constraint violation (``Dim("n")`` meeting a
    size-1 broadcast)."""

    name = "size-oblivious"

    def applies(self, failures):
        return any(torch_export.constraint_violation(f.error) for f in failures)

    def export(self, call, dynamic_shapes=None):
        with torch_export.size_oblivious():
            return call.export(dynamic_shapes)


class SuggestedFixes(CaptureStrategy):
    """torch's "Suggested fixes" for a constraint violation applied to ``dynamic_shapes``
    (``Dim("seq")`` becomes ``Dim("seq", max=64)`` where the model has 64 positions), captured
    again by the strategy whose error suggested them, as ``torch.onnx.export`` does."""

    name = "suggested-fixes"

    def applies(self, failures):
        return any(diagnostics.suggested_fixes(f.error) for f in failures)

    def _capture(self, call, failures):
        errors = []
        for failure in failures:
            try:
                refined = torch_export.refined_dynamic_shapes(failure.error, call.dynamic_shapes)
            except ValueError as error:  # fixes that are not taken, and why
                errors.append(error)
                continue
            if refined is None:
                continue
            try:
                return Attempt(self, failure.strategy.export(call, refined), dynamic_shapes=refined)
            except Exception as error:
                errors.append(error)
        if errors:
            raise errors[0]
        raise ValueError("torch's suggested fixes could not be applied to dynamic_shapes")


class DraftExport(CaptureStrategy):
    """``torch.export.draft_export`` after a data-dependent guard (``GuardOnDataDependentSymNode:
    Eq(u0, 1)``: Longformer's and EnCodec's padding sizes kept as tensors), which fails non-strict
    and strict capture alike. draft_export assumes, at each such guard, what the example inputs
    give. The program is kept only when every data-dependent value it assumed comes from weights,
    buffers and constants (the same for every input); a guard on values computed from the inputs
    (``if x.sum() > 0``) would make the file wrong for other inputs, so that is a failure. The
    export warns with the guards assumed (:class:`DataDependentCaptureWarning`)."""

    name = "draft_export"

    def applies(self, failures):
        return hasattr(torch.export, "draft_export") and any(torch_export.data_dependent(f.error) for f in failures)

    def export(self, call, dynamic_shapes=None):
        shapes = call.dynamic_shapes if dynamic_shapes is None else dynamic_shapes
        program = torch_export.draft_export(call.model, call.args, call.kwargs, dynamic_shapes=shapes, **call.options)
        if reads_user_inputs(program):
            raise ValueError(
                "draft_export assumed the outcome of a branch on values computed from the inputs; "
                "the program would be wrong for inputs that take the other branch"
            )
        assumed = torch_export.draft_export_assumptions(program)
        warnings.warn(
            "torch.export could not trace a branch on tensor values (data-dependent guard); the program "
            "was captured with torch.export.draft_export, which assumes what the example inputs give there"
            + (": " + "; ".join(assumed[:4]) if assumed else "")
            + ". Inputs that take another branch may need another export.",
            DataDependentCaptureWarning,
            stacklevel=2,
        )
        return program


class OnMeta(CaptureStrategy):
    """``inner`` with the example inputs on the ``meta`` device: for a model whose weights are on
    ``meta`` (streamed from a checkpoint, ``weights=``), where an op refuses CPU inputs next to meta
    weights (``F.linear``). The values are never needed to capture. It sees only its own kind's
    failures (meta ones), as ``inner`` sees real ones."""

    def __init__(self, inner: CaptureStrategy):
        self.inner = inner
        self.name = f"meta:{inner.name}"

    def applies(self, failures):
        return self.inner.applies([f for f in failures if isinstance(f.strategy, OnMeta)])

    def export(self, call, dynamic_shapes=None):
        return self.inner.export(call.on_meta(), dynamic_shapes)

    def _capture(self, call, failures):
        attempt = self.inner._capture(call.on_meta(), [f for f in failures if isinstance(f.strategy, OnMeta)])
        attempt.strategy = self
        return attempt

    def __repr__(self) -> str:
        return f"OnMeta({self.inner!r})"


#: The strategies of every capture, in the order they are tried.
STRATEGIES: tuple[CaptureStrategy, ...] = (TorchExport(), SizeOblivious(), SuggestedFixes(), DraftExport())


def strategies_for(*, on_meta: bool = False) -> tuple[CaptureStrategy, ...]:
    """:data:`STRATEGIES`, then each again with the inputs on ``meta`` for a model on ``meta``."""
    if not on_meta:
        return STRATEGIES
    return STRATEGIES + tuple(OnMeta(strategy) for strategy in STRATEGIES)


def capture(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict | None,
    dynamic_shapes: Any,
    *,
    on_meta: bool = False,
    strategies: Sequence[CaptureStrategy] | None = None,
    options: dict | None = None,
    fixed: Mapping[str, torch.Tensor] | None = None,
) -> Capture:
    """Capture ``model`` with the first strategy that works (see the module doc).

    ``dynamic_shapes`` are taken as ``torch.onnx.export(dynamo=True)`` takes them (axis names as
    strings become ``Dim.DYNAMIC``). ``options`` are further ``torch.export.export`` keywords.
    ``fixed``: keyword inputs held in the program as constants, their values computed on while
    capturing (``export_modular(fixed_inputs=...)``, :func:`fixed_into`); every strategy sees them so.
    Raises :class:`~onnx_modular.errors.CaptureError` naming the module and listing every attempt
    when all fail; its cause is the first strategy's error.
    """
    call = CaptureCall(model, tuple(args), dict(kwargs or {}), torch_compat.export_dims(dynamic_shapes), dict(options or {}))
    chosen = strategies_for(on_meta=on_meta) if strategies is None else strategies
    with fixed_into(model, fixed or {}):
        return first_success(chosen, lambda strategy, failures: strategy(call, failures), model)


@contextlib.contextmanager
def fixed_into(model: torch.nn.Module, fixed: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """``model.forward`` given ``fixed`` keyword inputs itself while the context is open: the
    capture traces them as constants of the program (not inputs), and their values are computed
    on (:func:`torch_export.fixed_values`). The root stays ``model``, so module paths are unchanged."""
    if not fixed:
        yield
        return
    own = "forward" in vars(model)
    forward = model.forward
    model.forward = functools.partial(forward, **fixed)
    try:
        with torch_export.fixed_values(fixed.values()):
            yield
    finally:
        if own:
            model.forward = forward
        else:
            del model.forward


def first_success(
    strategies: Sequence[CaptureStrategy],
    attempt: Callable[[CaptureStrategy, list[Attempt]], Attempt],
    model: torch.nn.Module,
) -> Capture:
    """The loop of :func:`capture`: ``attempt(strategy, failures)`` for each strategy that
    :meth:`~CaptureStrategy.applies` (the first always runs), until one gives a program.

    ``attempt`` runs the strategy; :func:`capture` calls it on its :class:`CaptureCall`, and
    transformers' exporter (:mod:`onnx_modular.hf.exporter`) runs its whole ``export_program`` per
    strategy, so that each attempt traces the model once, as transformers expects.
    """
    attempts: list[Attempt] = []
    for strategy in strategies:
        if attempts and not strategy.applies(attempts):
            continue
        with torch_export.partial_graphs_logged():
            result = attempt(strategy, attempts)
        attempts.append(result)
        if result.ok:
            return Capture(result.program, result.name, attempts, result.dynamic_shapes)
    raise diagnostics.capture_error([(a.name, a.error) for a in attempts], model) from attempts[0].error


def reads_user_inputs(program: torch.export.ExportedProgram) -> bool:
    """Whether a data-dependent value of the program (ops tagged ``data_dependent_output`` or
    ``dynamic_output_shape``: ``.item()``, ``nonzero``) is computed from a user input, not only
    from weights, buffers and constants. Only then can the assumed outcome differ between inputs."""
    data_dependent = {torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape}
    user_inputs = set(program.graph_signature.user_inputs)
    # where data-dependent values are born: ops tagged so (item, _local_scalar_dense, nonzero, ...)
    stack = [
        node
        for node in program.graph.nodes
        if node.op == "call_function" and data_dependent & set(getattr(node.target, "tags", ()))
    ]
    seen: set = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder" and node.name in user_inputs:
            return True
        stack.extend(node.all_input_nodes)
    return False
