"""The per-module accuracy guard of ``MatMulNBits`` at ``accuracy_level=4`` (int8 activation compute).

onnxruntime's ``MatMulNBits`` with ``accuracy_level=4`` quantizes its input to int8 block by block
(a scale per block of ``block_size`` values of a row) before the int4 x int8 products. A block
holding a massive activation (a few channels 1,000x the others, as in Qwen3-0.6B and
Phi-3.5-mini: onnxruntime #29849) rounds its other values to nothing, and greedy tokens flip
silently. The guard finds the module calls whose int8 compute flips the top token and keeps
those calls at a safe level (0: float compute on the same int4 weights).

How (:func:`guard_accuracy`, on a file already quantized at level 4):

1. Reference: the file with every ``MatMulNBits`` at the safe level, run on a random prompt with
   an empty cache and one decode step on the cache that prompt made (the reference inputs
   ``optimize`` verifies with); the top token at every position.
2. Candidates: the module calls with a ``MatMulNBits`` at level 4 in their own body (and the main
   graph's own), in execution order. A trial runs the file with a set of candidates at level 4
   and the others at the safe level; it *flips* when a top token differs from the reference.
3. When the file as quantized flips a token, each candidate is run alone at level 4 (the others
   at the safe level) and ranked by how far that moves the logits: its own int8 compute. The
   most harmful are kept at the safe level, one by one, until the calls left at level 4 flip no
   token. At most :data:`MAX_KEPT` calls are kept this way; past that the whole file goes to the
   safe level (``whole_file``), as it does at once when there are more candidates than
   :data:`~onnx_modular.storage.limits.MAX_GUARD_TRIALS` (ranking them runs the file once per call).
   A file that flips nothing costs two runs.

Bodies are shared per class: a kept call whose function serves other calls too gets bodies of its
own (:func:`~onnx_modular.calls.targets.specialize`, along its chain of callers: the decoder
layer holding it becomes a function of its own); when every call of a function is kept, the
shared body is changed instead. Trials run in memory on a copy whose candidate calls all have
bodies of their own. Torch-free.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import numpy as np
import onnx

from onnx_modular.calls import targets as _calls
from onnx_modular.format import metadata
from onnx_modular.runtime import sessions as runtime
from onnx_modular.storage.limits import limit
from onnx_modular.storage.proto import function_id

__all__ = ["GuardReport", "guard_accuracy", "MAX_KEPT", "SAFE_LEVEL", "INT8_COMPUTE", "GUARD_KEY"]

#: ``accuracy_level`` of MatMulNBits computing with int8 activations.
INT8_COMPUTE = 4
#: The level kept calls get: float compute (the input's type).
SAFE_LEVEL = 0
#: Past this many kept calls, the whole file goes to the safe level.
MAX_KEPT = 8
#: The main graph's own MatMulNBits, as a candidate.
MAIN_GRAPH = "<main graph>"
#: The file's record of the guard (JSON: level, safe_level, kept).
GUARD_KEY = metadata.PREFIX + "accuracy_guard"
#: Tokens of the reference prompt.
PROMPT_LENGTH = 16
#: On calibration ids (:mod:`onnx_modular.check.quality`), int8 compute is harmful past these: the mean
#: next-token KL against the same file at the safe level (nats), or the top-1 agreement below.
#: A trained 4-layer Llama's whole int4 file at level 4: KL 6.7e-5, top-1 99.7% on held-out text.
KL_LIMIT = 1e-3
TOP1_LIMIT = 0.99
#: Decode steps timed (each file, taking turns) for the cost of the kept calls.
COST_STEPS = 15
#: The reference inputs: ``(tokens, past caches or None, seed) -> feeds`` (a prompt with an empty
#: cache, or a decode step on the caches given); ``optimize``'s own (:func:`onnx_modular.files.optimize.tool._prompt_feeds`).
FeedMaker = Callable[[int, "list[np.ndarray] | None", int], "dict[str, np.ndarray]"]


@dataclasses.dataclass
class GuardReport:
    """What :func:`guard_accuracy` found.

    Attributes:
        level / safe_level: The file's accuracy level (4) and the one kept calls get (0).
        candidates: Calls with a MatMulNBits at ``level`` in their own body.
        kept: The calls kept at ``safe_level``, in execution order.
        whole_file: More than :data:`MAX_KEPT` calls flipped tokens: every MatMulNBits is at ``safe_level``.
        positions: Top tokens compared (every prompt position and one decode step).
        flipped_unguarded: Positions whose top token differs from the safe level's with every call at ``level``.
        flipped_guarded: The same with the kept calls at ``safe_level`` (0: the search stops there).
        trials: Files run (one onnxruntime session each).
        split: Functions copied so that kept calls have bodies of their own.
        drift: Per kept call, the largest logit difference when it alone computes at ``level``
            (on calibration ids: its mean next-token KL).
        seconds: The guard's time (its trial runs).
        measured_on: ``"a random prompt"`` (flips of the top token decide) or ``"calibration ids"``
            (the mean next-token KL and the top-1 agreement decide: :data:`KL_LIMIT`, :data:`TOP1_LIMIT`).
        kl_unguarded / top1_unguarded / kl_guarded / top1_guarded: Those measures against the safe level.
        decode_cost: The guarded file's per-token decode time over the unguarded file's (measured,
            one thread, taking turns; ``None`` when nothing is kept).
    """

    level: int
    safe_level: int
    candidates: int
    kept: list[str]
    whole_file: bool
    positions: int
    flipped_unguarded: int
    flipped_guarded: int
    trials: int
    split: int = 0
    drift: dict[str, float] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    measured_on: str = "a random prompt"
    kl_unguarded: float = 0.0
    top1_unguarded: float = 1.0
    kl_guarded: float = 0.0
    top1_guarded: float = 1.0
    decode_cost: float | None = None

    def _measures(self, kl: float, top1: float) -> str:
        return f"; mean KL {kl:.3g}, top-1 {top1:.2%}" if self.measured_on == "calibration ids" else ""

    def text(self) -> str:
        head = (f"Accuracy guard (int8 compute, accuracy_level={self.level}): {self.positions} top tokens of {self.measured_on} "
                f"compared with the same int4 weights at accuracy_level={self.safe_level}; {self.trials} trial runs, {self.seconds:.1f} s")
        if not self.kept:
            return head + (f"\n  within limits ({self.flipped_unguarded} flips{self._measures(self.kl_unguarded, self.top1_unguarded)}): "
                           f"all {self.candidates} calls stay at accuracy_level={self.level}")
        lines = [head, f"  unguarded: {self.flipped_unguarded} of {self.positions} top tokens flip"
                 + self._measures(self.kl_unguarded, self.top1_unguarded)]
        if self.whole_file:
            lines.append(f"  more than {MAX_KEPT} calls flip tokens: every MatMulNBits at accuracy_level={self.safe_level}")
        else:
            lines.append(f"  kept at accuracy_level={self.safe_level} ({len(self.kept)} of {self.candidates} calls; "
                         "the logits' largest change when the call alone computes in int8):")
            lines += [f"    {name}  {self.drift[name]:.3g}" if name in self.drift else f"    {name}" for name in self.kept]
        lines.append(f"  guarded: {self.flipped_guarded} of {self.positions} top tokens flip"
                     + self._measures(self.kl_guarded, self.top1_guarded))
        if self.decode_cost is not None:
            lines.append(f"  decode cost: {self.decode_cost:.2f}x the unguarded file's per-token time "
                         f"(measured here, {COST_STEPS} steps each, one thread)")
        return "\n".join(lines)


def _nbits(body, level: int | None = None) -> list[onnx.NodeProto]:
    """The MatMulNBits (and QMoE: the same accuracy levels) nodes of ``body`` (at ``level`` when given; no
    attribute means level 0)."""
    found = []
    for node in body.node:
        if node.op_type not in ("MatMulNBits", "QMoE") or node.domain != "com.microsoft":
            continue
        if level is None or node_level(node) == level:
            found.append(node)
    return found


def node_level(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "accuracy_level"), 0)


def set_node_level(nodes: Sequence[onnx.NodeProto], level: int) -> None:
    for node in nodes:
        kept = [a for a in node.attribute if a.name != "accuracy_level"]
        del node.attribute[:]
        node.attribute.extend(kept)
        if level:
            node.attribute.append(onnx.helper.make_attribute("accuracy_level", level))


def set_accuracy_level(model: onnx.ModelProto, level: int) -> onnx.ModelProto:
    """Every ``MatMulNBits`` of ``model`` (main graph and functions) at ``level``, in place; returns ``model``."""
    for body in [model.graph, *model.functions]:
        set_node_level(_nbits(body), level)
    return model


def _candidates(model: onnx.ModelProto, level: int) -> list[str]:
    """Calls with MatMulNBits at ``level`` in their own body, in execution order (the main graph first)."""
    names = [MAIN_GRAPH] if _nbits(model.graph, level) else []
    names += [name for name, call in _calls.module_calls(model).items()
              if call.function is not None and _nbits(call.function, level)]
    return names


def _own_bodies(model: onnx.ModelProto, names: Sequence[str]) -> tuple[dict[str, list[onnx.NodeProto]], int]:
    """Give each call of ``names`` bodies of its own; its MatMulNBits nodes by name, and the functions copied."""
    before = len(model.functions)
    for name in names:
        if name != MAIN_GRAPH:
            _calls.specialize(model, name, including_call=True)
    calls = _calls.module_calls(model)
    nodes = {name: _nbits(model.graph if name == MAIN_GRAPH else calls[name].function) for name in names}
    return nodes, len(model.functions) - before


class _Trials:
    """Runs of the file with chosen candidates at ``level`` and the others at ``safe_level``."""

    def __init__(self, model: onnx.ModelProto, folder: str | os.PathLike | None, candidates: list[str],
                 level: int, safe_level: int, feeds: FeedMaker, seed: int, calibration: np.ndarray | None = None):
        self.work = onnx.ModelProto()
        self.work.CopyFrom(model)
        self.nodes, _ = _own_bodies(self.work, candidates)
        self.folder = folder
        self.level, self.safe_level = level, safe_level
        self.count = 0
        self.feeds = feeds
        self.seed = seed
        self.calibration = calibration
        self.reference: np.ndarray | None = None
        self.reference = self.logits([])
        self.last: tuple[int, float, float] = (0, 0.0, 1.0)  # flips, KL, top-1 of the last judged trial
        self.unguarded: tuple[int, float, float] = (0, 0.0, 1.0)  # those of the file as quantized

    def _calibration_logits(self) -> np.ndarray:
        from onnx_modular.check.quality import file_logits

        logits = file_logits(self.work.SerializeToString(), self.calibration,
                             external_data_folder=None if self.folder is None else str(self.folder), what="the guard's trial file")
        return logits.reshape(-1, logits.shape[-1])

    def logits(self, at_level: Sequence[str]) -> np.ndarray:
        """Logits at every position (rows) with the calls ``at_level`` at the file's level, the other
        candidates at the safe level."""
        chosen = set(at_level)
        for name, nodes in self.nodes.items():
            set_node_level(nodes, self.level if name in chosen else self.safe_level)
        self.count += 1
        if self.calibration is not None:
            return self._calibration_logits()
        session = runtime.session(self.work.SerializeToString(), external_data_folder=self.folder, what="the guard's trial file")
        prompt = self.feeds(PROMPT_LENGTH, None, self.seed)
        outputs = runtime.run(session, prompt, what="guard's trial file")[1]
        rows = [outputs[0].reshape(-1, outputs[0].shape[-1])]
        caches = sum(1 for name, value in prompt.items() if value.ndim == 4)
        if caches:
            step = self.feeds(1, list(outputs[1: 1 + caches]), self.seed + 1)
            ids = next(k for k, v in step.items() if v.ndim == 2 and "mask" not in k and "position" not in k)
            # every trial decodes the reference's next token (the reference run: its own)
            following = self.reference[PROMPT_LENGTH - 1].argmax() if self.reference is not None else rows[0][-1].argmax()
            step[ids] = np.full_like(step[ids], following)
            logits = runtime.run(session, step, what="guard's trial file")[1][0]
            rows.append(logits.reshape(-1, logits.shape[-1]))
        return np.concatenate(rows)

    def flipped(self, at_level: Sequence[str]) -> int:
        """Whether the trial harms (0: no): on a random prompt, the positions whose top token differs
        from the reference's; on calibration ids, past :data:`KL_LIMIT` or below :data:`TOP1_LIMIT`."""
        logits = self.logits(at_level)
        flips = int((logits.argmax(-1) != self.reference.argmax(-1)).sum())
        if self.calibration is None:
            self.last = (flips, 0.0, 1.0 - flips / len(logits))
            return flips
        kl, top1 = _kl(self.reference, logits), 1.0 - flips / len(logits)
        self.last = (flips, kl, top1)
        return flips if kl > KL_LIMIT or top1 < TOP1_LIMIT else 0

    def drift(self, at_level: Sequence[str]) -> float:
        """How far the logits move from the reference's: the largest difference (on calibration ids, the mean KL)."""
        logits = self.logits(at_level)
        return _kl(self.reference, logits) if self.calibration is not None else float(np.abs(logits - self.reference).max())


def _kl(reference: np.ndarray, logits: np.ndarray) -> float:
    from onnx_modular.check.quality import compare_logits

    ids = np.zeros((1, 1), np.int64)
    return compare_logits(reference[None], logits[None], ids).kl_mean


def _search(trials: _Trials, candidates: list[str], max_kept: int) -> tuple[list[str], bool, int, dict[str, float]]:
    """The calls to keep at the safe level, whether the whole file goes there, the unguarded flips
    and the logits' drift of each candidate alone at the file's level (when needed)."""
    harmed = trials.flipped(candidates)
    unguarded = trials.last[0]
    trials.unguarded = trials.last
    if not harmed:
        return [], False, unguarded, {}
    if len(candidates) > limit("MAX_GUARD_TRIALS"):  # one run per call to rank them: past the bound, all to the safe level
        return list(candidates), True, unguarded, {}
    alone = {name: trials.drift([name]) for name in candidates}  # each call's own int8 compute
    kept: list[str] = []
    for name in sorted(candidates, key=lambda n: -alone[n]):
        if len(kept) == max_kept:
            return list(candidates), True, unguarded, alone
        kept.append(name)
        if not trials.flipped([n for n in candidates if n not in kept]):
            break
    order = {name: index for index, name in enumerate(candidates)}
    return sorted(kept, key=order.get), False, unguarded, alone


def _apply(model: onnx.ModelProto, kept: Sequence[str], safe_level: int) -> int:
    """Kept calls to ``safe_level`` in ``model``: a function all of whose calls are kept is changed
    in place; other kept calls get bodies of their own. Returns the functions copied."""
    calls = _calls.module_calls(model)
    by_function: dict = {}
    for call in calls.values():
        if call.function is not None:
            by_function.setdefault(function_id(call.function), []).append(call.call_name)
    whole = {fid for fid, names in by_function.items() if set(names) <= set(kept)}
    own = [name for name in kept if name != MAIN_GRAPH and function_id(calls[name].function) not in whole]
    _, copied = _own_bodies(model, own)
    for fid in whole:
        set_node_level(_nbits(next(f for f in model.functions if function_id(f) == fid)), safe_level)
    calls = _calls.module_calls(model)
    for name in kept:
        set_node_level(_nbits(model.graph if name == MAIN_GRAPH else calls[name].function), safe_level)
    return copied


def guard_accuracy(model: onnx.ModelProto, folder: str | os.PathLike | None, feeds: FeedMaker, *,
                   level: int = INT8_COMPUTE, safe_level: int = SAFE_LEVEL, seed: int = 0,
                   max_kept: int = MAX_KEPT, calibration: np.ndarray | None = None) -> GuardReport:
    """Keep at ``safe_level`` the calls of ``model`` whose MatMulNBits at ``level`` flip a top token.

    Args:
        model: A quantized modular file (``MatMulNBits`` at ``level`` in its bodies); changed in place.
        folder: Where its external data is.
        feeds: The reference inputs (:data:`FeedMaker`): a prompt of :data:`PROMPT_LENGTH` tokens, then one decode step.
        level / safe_level: The file's accuracy level and the one kept calls get.
        seed: Of the reference prompt.
        max_kept: Past this many kept calls, every MatMulNBits goes to ``safe_level`` (``whole_file``).
        calibration: Token ids ``[n, seq]``: the trials run them as prompts and are judged on the mean
            next-token KL and top-1 agreement against the safe level (:data:`KL_LIMIT`, :data:`TOP1_LIMIT`)
            instead of the top-token flips of a random prompt.

    Returns:
        A :class:`GuardReport`; the guard's choice is also recorded in the file's metadata (:data:`GUARD_KEY`).

    Example::

        report = guard_accuracy(onnx.load("m.q4.onnx", load_external_data=False), "folder/of/m", feeds)
    """
    import json
    import time

    start = time.perf_counter()
    candidates = _candidates(model, level)
    if not candidates:
        return GuardReport(level, safe_level, 0, [], False, 0, 0, 0, 0)
    unguarded_model = onnx.ModelProto()
    unguarded_model.CopyFrom(model)
    trials = _Trials(model, folder, candidates, level, safe_level, feeds, seed, calibration)
    kept, whole_file, unguarded, alone = _search(trials, candidates, max_kept)
    before = trials.unguarded
    after = trials.last if kept and not whole_file else (before if not kept else (0, 0.0, 1.0))
    guarded = after[0] if kept else before[0]  # the search stops when the calls left at ``level`` are within limits
    if whole_file:
        for body in [model.graph, *model.functions]:
            set_node_level(_nbits(body, level), safe_level)
        split = 0
    else:
        split = _apply(model, kept, safe_level)
    _calls.set_prop(model, GUARD_KEY, json.dumps({"level": level, "safe_level": safe_level, "kept": kept,
                                                  "whole_file": whole_file}))
    cost = _decode_cost(model, unguarded_model, folder, feeds, seed) if kept else None
    return GuardReport(level, safe_level, len(candidates), kept, whole_file, int(trials.reference.shape[0]), unguarded,
                       guarded, trials.count, split, {n: alone[n] for n in kept if n in alone},
                       time.perf_counter() - start, "calibration ids" if calibration is not None else "a random prompt",
                       before[1], before[2], after[1], after[2], cost)


def _decode_cost(guarded: onnx.ModelProto, unguarded: onnx.ModelProto, folder, feeds: FeedMaker, seed: int) -> float | None:
    """The guarded file's median decode-step time over the unguarded file's (one thread, taking turns)."""
    import statistics
    import time

    def prepare(model: onnx.ModelProto):
        session = runtime.session(model.SerializeToString(), external_data_folder=folder, what="the guard's timed file",
                                  configure=lambda options: setattr(options, "intra_op_num_threads", 1))
        prompt = feeds(PROMPT_LENGTH, None, seed)
        outputs = runtime.run(session, prompt, what="the guard's timed file")[1]
        caches = sum(1 for value in prompt.values() if value.ndim == 4)
        if not caches:
            return session, prompt
        return session, feeds(1, list(outputs[1: 1 + caches]), seed + 1)

    runs = [prepare(guarded), prepare(unguarded)]
    times: list[list[float]] = [[], []]
    for step in range(2 * COST_STEPS):
        for index in ((0, 1) if step % 2 else (1, 0)):
            session, step_feeds = runs[index]
            begin = time.perf_counter()
            session.run(None, step_feeds)
            times[index].append(time.perf_counter() - begin)
    return statistics.median(times[0][2:]) / statistics.median(times[1][2:])
