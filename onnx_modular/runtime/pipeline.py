"""A split decoder run as a pipeline (torch-free): the stages of a folder ``split`` wrote from a
with-cache file, each one a :class:`StageWorker` holding its onnxruntime session and the KV cache
of its own layers, driven by the one greedy loop (:func:`~onnx_modular.runtime.generation.greedy_steps`).

In one process (:func:`generate_stages`) the workers are plain objects called in turn; on Ray
(:mod:`onnx_modular.runtime.cluster`) each is an actor in its own worker process, and only what
crosses a cut travels between them (the hidden state, the mask and rotary tables of the step, a
few size scalars): the cache never leaves its stage. Several groups of sequences (micro-batches)
can be in flight at once; each worker keeps one cache per group.

What the client reads (:func:`read_stages`) is checked before anything runs: the manifest as
untrusted input (:mod:`onnx_modular.storage.manifest`), each stage's declared inputs and outputs
against the manifest, every model input one the loop makes (``input_ids``, ``attention_mask``,
``position_ids``, ``cache_position``) or a cache tensor the same stage returns (so each layer's
cache stays with its stage), and one stage returning ``logits``. A worker loads its stage with
every tool's bounds (:func:`~onnx_modular.storage.manifest.check_stage_file`) before onnxruntime
sees it, and compares the session with the manifest again: a file swapped after the check is named.

Example::

    tokens = generate_stages("stages/", [[5, 17, 33]], max_new_tokens=8)   # one process
"""

from __future__ import annotations

import os
import pathlib
import resource
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnx_modular.errors import InvalidInputError
from onnx_modular.format.text import shown
from onnx_modular.runtime.decoder_checks import check_length, new_tokens, token_ids
from onnx_modular.runtime.generation import MADE_INPUTS, cache_key, empty_past, greedy_steps, step_inputs
from onnx_modular.runtime.sessions import run, session
from onnx_modular.storage.load import load_model_file, stored_bytes
from onnx_modular.storage.manifest import STAGE_OUTPUT, check_stage_file, read_manifest

__all__ = ["MANIFEST", "StagePlan", "StageWorker", "read_stages", "is_split_folder", "generate_stages", "batch_groups", "peak_rss"]

#: The manifest of a folder ``split`` wrote (``files/split/stages.py`` writes and reads it too).
MANIFEST = "manifest.json"
#: The output the greedy loop reads from the last stage.
LOGITS = "logits"


def _bad_stage(k: int, why: str, hint: str | None = None) -> InvalidInputError:
    return InvalidInputError(
        f"stage {k}: {why}",
        hint=hint or "Write the folder again with `onnx-modular split` from a with-cache file "
        "(export --task causal-lm-with-past); a pipeline runs only what split writes.",
    )


@dataclass(frozen=True)
class StagePlan:
    """One stage as the manifest and its file declare it, checked (:func:`read_stages`)."""

    index: int
    file: str  # absolute path of the stage's model
    inputs: dict[str, str]  # stage input -> model input, or ``stage_<j>/<name>``
    outputs: tuple[str, ...]
    cache: dict[str, tuple[str, str]] = field(default_factory=dict)  # cache key -> (input, output)
    forwarded: tuple[str, ...] = ()  # the outputs later stages (or the loop: logits) read
    reads_from: tuple[int, ...] = ()  # the earlier stages it reads values of
    weights_bytes: int = 0


def is_split_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder holding a split ``manifest.json`` (and not a ``--generation`` folder)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def _shape(arg: Any) -> list:
    return list(arg.type.tensor_type.shape.dim)


def _plan(k: int, stage: dict, file: pathlib.Path, read_later: set[str], last: bool) -> StagePlan:
    """Stage ``k`` checked against its file's declared inputs and outputs (weights left unread)."""
    model = load_model_file(file, values=False)
    inputs = {v.name: v for v in model.graph.input}
    outputs = [v.name for v in model.graph.output]
    if set(stage["inputs"]) != set(inputs):
        listed, declared = sorted(set(stage["inputs"]) - set(inputs)), sorted(set(inputs) - set(stage["inputs"]))
        raise _bad_stage(k, f"the manifest and the file {shown(stage['file'])!r} disagree on its inputs: only in the "
                            f"manifest {[shown(n) for n in listed[:4]]}, only in the file {[shown(n) for n in declared[:4]]}.")
    missing = [name for name in stage["outputs"] if name not in outputs]
    if missing:
        raise _bad_stage(k, f"the manifest lists outputs {[shown(n) for n in missing[:4]]} that the file "
                            f"{shown(stage['file'])!r} does not return.")
    returned = {cache_key(name): name for name in stage["outputs"]}
    cache, reads_from = {}, set()
    for name, source in stage["inputs"].items():
        match = STAGE_OUTPUT.fullmatch(source)
        if match:
            reads_from.add(int(match.group(1)))
            continue
        if source != name:
            raise _bad_stage(k, f"its input {shown(name)!r} is fed the model input {shown(source)!r}: a pipeline "
                                "feeds a model input under its own name.")
        if name in MADE_INPUTS:
            continue
        key = cache_key(name)
        if len(_shape(inputs[name])) != 4 or key not in returned:
            raise _bad_stage(k, f"it reads the model input {shown(name)!r}, which is neither one the loop makes "
                                f"({', '.join(MADE_INPUTS)}) nor a cache tensor this stage returns: each layer's "
                                "cache must stay in the stage of its layer.")
        cache[key] = (name, returned[key])
    forwarded = [n for n in stage["outputs"] if f"stage_{k}/{n}" in read_later or (last and n == LOGITS)]
    if last and LOGITS not in stage["outputs"]:
        raise _bad_stage(k, "the last stage does not return logits, which the greedy loop reads.")
    return StagePlan(k, str(file), dict(stage["inputs"]), tuple(stage["outputs"]), cache, tuple(forwarded),
                     tuple(sorted(reads_from)), stored_bytes(file, model))


def read_stages(folder: str | os.PathLike) -> list[StagePlan]:
    """The stages of ``folder`` as a pipeline runs them, checked (see the module's docstring);
    no weight is read and nothing runs.

    Raises:
        InvalidInputError: Not a split folder, a manifest that does not match its files, a model
            input that is not the loop's or a stage's own cache (the message names the stage).
        InvalidModelFileError: A stage file that cannot be read.
    """
    folder = pathlib.Path(folder)
    manifest, files = read_manifest(folder, MANIFEST)
    stages = manifest["stages"]
    read_later = {source for stage in stages for source in stage["inputs"].values()}
    plans = [_plan(k, stage, files[k], read_later, k == len(stages) - 1) for k, stage in enumerate(stages)]
    if not any(plan.cache for plan in plans):
        raise InvalidInputError(
            f"{shown(str(folder))!r} holds stages without a KV cache: the pipeline decodes with-cache files only.",
            hint="Export with --task causal-lm-with-past, then split that file.",
        )
    return plans


def batch_groups(batch: int, groups: int | None, stages: int) -> list[slice]:
    """The sequences of a batch cut into ``groups`` micro-batches of near-equal size (default: as
    many as there are stages, at most one a sequence), each in flight on its own."""
    count = min(batch, stages) if groups is None else groups
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= batch:
        raise InvalidInputError(f"micro_batches must be an integer from 1 to the batch size {batch}; got {groups!r}.",
                                hint="Give at most one micro-batch a sequence.")
    bounds = np.linspace(0, batch, count + 1).round().astype(int)
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


class StageWorker:
    """One stage: its onnxruntime session and, per group of sequences, the cache of its layers.

    :meth:`step` runs one step of one group: the inputs the loop makes (from the ids and the past
    length), the group's cache (empty on its first step), and the values earlier stages return
    (each an argument: the dict that stage's :meth:`step` returned); it keeps the new cache and
    returns only what later stages read (``logits``: the last position only).
    """

    def __init__(self, plan: StagePlan, threads: int | None = None, execution_provider: str | None = None):
        self.plan = plan
        self._base_rss = peak_rss()
        started = time.perf_counter()
        path = pathlib.Path(plan.file)
        if not path.is_file():
            raise _bad_stage(plan.index, f"the file {shown(str(path))!r} is missing on {socket.gethostname()}.",
                             hint="Give every machine the stages folder at the same path (copy it, or a shared folder).")
        check_stage_file(path, plan.index)  # the bounds of every tool, in the process that runs it

        def configure(options: Any) -> None:
            if threads:
                options.intra_op_num_threads = int(threads)

        self.session = session(str(path), execution_provider, configure=configure, what=f"stage {plan.index}")
        declared = {arg.name: arg for arg in self.session.get_inputs()}
        if set(declared) != set(plan.inputs):
            raise _bad_stage(plan.index, f"the file {shown(str(path))!r} onnxruntime loaded declares other inputs than the "
                                         "manifest (changed since it was read).")
        self.inputs = declared
        self.caches: dict[Any, dict[str, np.ndarray]] = {}
        self.seconds = 0.0
        self.load_seconds = time.perf_counter() - started
        self.sent_bytes = 0
        self.decode_sent_bytes = 0
        self.decode_tokens = 0

    def step(self, group: Any, ids: np.ndarray, past: int, *upstream: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        plan = self.plan
        if past == 0:
            self.caches.pop(group, None)
        cache = self.caches.get(group, {})
        values: dict[str, np.ndarray] = {}
        for given in upstream:
            values.update(given)
        feeds = step_inputs({n: a for n, a in self.inputs.items() if n in plan.inputs and plan.inputs[n] == n}, ids, past)
        for name, source in plan.inputs.items():
            if STAGE_OUTPUT.fullmatch(source):
                if source not in values:
                    raise _bad_stage(plan.index, f"it was not given {shown(source)!r}.")
                feeds[name] = values[source]
        for key, (name, _) in plan.cache.items():
            feeds[name] = cache[key] if key in cache else empty_past(self.inputs[name], ids.shape[0], f"stage {plan.index}")
        started = time.perf_counter()
        names, arrays = run(self.session, feeds, what=f"stage {plan.index}")
        self.seconds += time.perf_counter() - started
        produced = dict(zip(names, arrays))
        self.caches[group] = {key: produced[output] for key, (_, output) in plan.cache.items()}
        sent = {f"stage_{plan.index}/{name}": produced[name] for name in plan.forwarded}
        if LOGITS in plan.forwarded:
            sent[f"stage_{plan.index}/{LOGITS}"] = np.ascontiguousarray(produced[LOGITS][:, -1, :])
        size = sum(int(a.nbytes) for a in sent.values())
        self.sent_bytes += size
        if past > 0:
            self.decode_sent_bytes += size
            self.decode_tokens += int(ids.shape[0] * ids.shape[1])
        return sent

    def release(self, group: Any) -> None:
        self.caches.pop(group, None)

    def info(self) -> dict[str, Any]:
        """Where the stage runs and what it costs: pid, node, weights, peak RSS, run time, bytes sent."""
        return {
            "stage": self.plan.index,
            "pid": os.getpid(),
            "node": _node(),
            "weights_bytes": self.plan.weights_bytes,
            "peak_rss_bytes": peak_rss(),
            "base_rss_bytes": self._base_rss,
            "seconds": round(self.seconds, 6),
            "load_seconds": round(self.load_seconds, 6),
            "sent_bytes_per_token": self.decode_sent_bytes / self.decode_tokens if self.decode_tokens else None,
        }


def peak_rss() -> int:
    """This process's peak resident set, in bytes: Linux's ``VmHWM`` (``ru_maxrss`` keeps the peak
    of the process that forked this one across ``exec``), else ``ru_maxrss`` (KiB)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _node() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostname()


def logits_of(plans: Sequence[StagePlan], sent: Mapping[str, np.ndarray]) -> np.ndarray:
    """The last stage's last-position logits from what it returned."""
    return sent[f"stage_{plans[-1].index}/{LOGITS}"]


def prompt_tokens(input_ids: Any, max_new_tokens: int) -> np.ndarray:
    """The prompt as ``[batch, length]`` int64 ids (a flat list is one sequence) and ``max_new_tokens``,
    checked as every route of ``generate`` checks them (:mod:`onnx_modular.runtime.decoder_checks`)."""
    ids = token_ids(input_ids)
    check_length(ids.shape[1], new_tokens(max_new_tokens), None)
    return ids


def generate_stages(
    folder: str | os.PathLike,
    input_ids: Any,
    max_new_tokens: int = 20,
    *,
    threads: int | None = None,
    execution_provider: str | None = None,
    stats: list | None = None,
) -> np.ndarray:
    """Greedy generation with the stages of ``folder`` in this process, one after the other (the
    tokens of ``generate`` on the whole file). ``stats``: a list that receives each stage's
    :meth:`StageWorker.info`.

    Raises:
        InvalidInputError: A folder that is not a split of a with-cache file (:func:`read_stages`).
        VerificationError: onnxruntime cannot load or run a stage.
    """
    plans = read_stages(folder)
    workers = [StageWorker(plan, threads, execution_provider) for plan in plans]
    tokens = prompt_tokens(input_ids, max_new_tokens)
    loop = greedy_steps(tokens, max_new_tokens)
    try:
        step, past = next(loop)
        while True:
            returned: list[dict] = []
            for plan, worker in zip(plans, workers):
                returned.append(worker.step(0, step, past, *(returned[j] for j in plan.reads_from)))
            step, past = loop.send(logits_of(plans, returned[-1]))
    except StopIteration as done:
        tokens = done.value
    if stats is not None:
        stats.extend(worker.info() for worker in workers)
    return tokens
