"""A split decoder's stages on a Ray cluster (torch-free; ``pip install "onnx-modular[ray]"``):
each stage an actor in its own worker process, holding the stage's onnxruntime session and its
layers' KV cache (:class:`~onnx_modular.runtime.pipeline.StageWorker`), the values that cross a
cut passed between them as Ray objects, the tokens chosen by the one greedy loop
(:func:`~onnx_modular.runtime.generation.greedy_steps`) in the calling process.

Several groups of sequences are in flight at once (micro-batches, by default as many as there
are stages): while stage 1 runs group 0's step, stage 0 runs group 1's; each actor runs its calls
in the order they were sent, so the stages work as a pipeline.

Placement: Ray's ``SPREAD`` by default (each stage its own worker process, spread over the nodes
as Ray can); ``stages_per_node=N`` reserves one node a group of N consecutive stages (a
``STRICT_SPREAD`` placement group: the cluster must have that many nodes); ``resources`` gives Ray
resources per stage (``{"CPU": 1}``, a custom resource a node was started with, one dict or one a
stage).

Faults give a one-line :class:`~onnx_modular.errors.PipelineError` naming the stage, within
``timeout`` seconds a call: a worker that dies (Ray reports it at once), a stage that gives no
answer, a stage its worker cannot load (missing on that machine, refused by the checks), a
cluster that cannot be joined or cannot place the stages. The actors, and the placement group,
are removed whatever happens; nothing is written anywhere.

Example::

    run = generate_on_ray("stages/", [[5, 17, 33]], 8, address="127.0.0.1:6379")
    run.tokens, [stage["pid"] for stage in run.stages]
"""

from __future__ import annotations

import io
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnx_modular.errors import InvalidInputError, MissingDependencyError, OnnxModularError, PipelineError
from onnx_modular.format.text import first_line, shown
from onnx_modular.runtime.generation import greedy_steps
from onnx_modular.runtime.pipeline import StagePlan, StageWorker, batch_groups, logits_of, prompt_tokens, read_stages

__all__ = ["PipelineRun", "StageActor", "generate_on_ray", "stage_resources"]

#: Seconds a call to a stage (its load included) may take before the run stops with an error.
DEFAULT_TIMEOUT = 120.0
#: The CPU a stage reserves in a placement group's bundle when no resources are given (Ray needs
#: a bundle to hold something; a stage's threads are onnxruntime's, not Ray's).
_TOKEN_CPU = 0.01


@dataclass
class PipelineRun:
    """The tokens (prompt + new, ``[batch, length]``) and each stage's :meth:`StageWorker.info`."""

    tokens: np.ndarray
    stages: list[dict[str, Any]]
    micro_batches: int
    seconds: float  # the whole run: checks, placement, the stages' load, decoding
    decode_seconds: float  # the greedy loop alone (prompt and new tokens)

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens.tolist(), "stages": self.stages, "micro_batches": self.micro_batches,
                "seconds": round(self.seconds, 6), "decode_seconds": round(self.decode_seconds, 6)}


class StageActor:
    """The Ray actor of one stage: a :class:`StageWorker`, whose load error is kept and reported
    by :meth:`info` (one line) rather than lost in Ray's actor-death message."""

    def __init__(self, plan: StagePlan, threads: int | None = None):
        self.worker: StageWorker | None = None
        self.error: str | None = None
        try:
            self.worker = StageWorker(plan, threads)
        except Exception as e:  # reported by info(), named by stage
            self.error = _reason(e)
        self.index = plan.index

    def info(self) -> dict[str, Any]:
        if self.worker is None:
            return {"stage": self.index, "pid": os.getpid(), "error": self.error}
        return self.worker.info()

    def step(self, group: Any, ids: np.ndarray, past: int, *upstream: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert self.worker is not None
        return self.worker.step(group, ids, past, *upstream)


def _reason(error: BaseException) -> str:
    text = " ".join(str(error).split()) if isinstance(error, OnnxModularError) else first_line(str(error))
    return shown(text or type(error).__name__)


def _cause(text: str) -> str:
    """The last ``SomeError: message`` line of Ray's report of a dead actor (its cause), or ``""``."""
    lines = [line.strip() for line in text.splitlines()]
    found = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception|Exit)\b.*:", line)]
    return shown(found[-1])[:300] if found else ""


def _probe(address: str, timeout: float) -> None:
    """A TCP connection to the cluster's address before Ray is asked to join it: Ray's client
    retries an address where nothing answers for minutes, printing as it goes."""
    if address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise InvalidInputError(f"{shown(address)!r} is not a Ray address (IP:PORT, or ray://HOST:PORT).",
                                hint="Pass the address `ray start --head` prints, e.g. 10.0.0.1:6379.")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise PipelineError(f"Nothing answers at the Ray address {shown(address)!r}: {e.strerror or e}.",
                            hint="Start the cluster with `ray start --head` and pass the address it prints "
                            "(IP:PORT, or ray://HOST:10001 from outside the cluster).") from None


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise MissingDependencyError(
            "Running stages on Ray needs the ray package.", hint='pip install "onnx-modular[ray]"'
        ) from None
    return ray


def stage_resources(spec: Mapping | Sequence | None, stages: int) -> list[dict[str, float]]:
    """One Ray resource dict a stage from ``spec``: ``None`` (none), one dict for every stage, or a
    list of one a stage. Keys: ``CPU``, ``GPU``, ``memory`` (bytes) or a custom resource a node
    was started with (``ray start --resources '{"big": 1}'``); values: numbers >= 0."""
    if spec is None:
        return [{} for _ in range(stages)]
    specs = [spec] * stages if isinstance(spec, Mapping) else list(spec) if isinstance(spec, (list, tuple)) else None
    if specs is None or len(specs) != stages:
        raise InvalidInputError(f"The resources must be one dict for every stage or a list of {stages} dicts (one a stage).",
                                hint='--stage-resources \'{"CPU": 1}\' or \'[{"a": 1}, {"b": 1}, {"b": 1}]\'')
    out = []
    for k, one in enumerate(specs):
        if not isinstance(one, Mapping) or not all(
            isinstance(key, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e15
            for key, v in one.items()
        ):
            raise InvalidInputError(f"The resources of stage {k} must map resource names to numbers >= 0; got {shown(repr(one))[:80]}.",
                                    hint='{"CPU": 1} or a custom resource: {"node_a": 1}')
        out.append({str(key): float(v) for key, v in one.items()})
    return out


def _actor_options(resources: dict[str, float]) -> dict[str, Any]:
    options: dict[str, Any] = {"max_restarts": 0, "max_task_retries": 0}
    custom = dict(resources)
    for key, option in (("CPU", "num_cpus"), ("GPU", "num_gpus"), ("memory", "memory")):
        if key in custom:
            options[option] = custom.pop(key)
    if custom:
        options["resources"] = custom
    return options


class _Cluster:
    """The Ray session, the actors and the placement group of one run; removed on exit."""

    def __init__(self, address: str, timeout: float):
        self.ray = _ray()
        self.timeout = timeout
        self.actors: list[Any] = []
        self.group = None
        self.joined = False
        self._streams = None
        if not self.ray.is_initialized():
            _probe(address, min(max(timeout, 2.0), 10.0))
            # Ray's driver prints what the cluster reports ("(raylet) A worker died ...") on this
            # process's stdout from a thread of its own; the run's own error says it in one line, and
            # stdout stays the command's (--json -). Restored once the session is shut down.
            self._streams = (sys.stdout, sys.stderr)
            sys.stdout = sys.stderr = io.StringIO()
            try:
                self.ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR,
                              configure_logging=True)
            except Exception as e:
                self.close()
                raise PipelineError(f"Cannot join the Ray cluster at {shown(address)!r}: {_reason(e)}",
                                    hint="Start one with `ray start --head` and pass the address it prints "
                                    "(IP:PORT, or ray://HOST:10001 from outside the cluster).") from None
            self.joined = True

    def place(self, plans: Sequence[StagePlan], resources: list[dict[str, float]], stages_per_node: int | None,
              threads: int | None) -> None:
        ray = self.ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = ray.remote(StageActor)
        if stages_per_node is not None:
            groups = [list(range(i, min(i + stages_per_node, len(plans)))) for i in range(0, len(plans), stages_per_node)]
            bundles = [_bundle([resources[k] for k in group]) for group in groups]
            self.group = ray.util.placement_group(bundles, strategy="STRICT_SPREAD")
            ready, _ = ray.wait([self.group.ready()], timeout=self.timeout)
            if not ready:
                nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
                raise PipelineError(
                    f"The cluster cannot place {len(plans)} stages at {stages_per_node} a node within {self.timeout:g} s: "
                    f"that needs {len(groups)} nodes with {bundles[0]} free each, and it has {nodes} alive.",
                    hint="Start more nodes (ray start --address HEAD:PORT on each machine) or raise --stages-per-node.")
        for plan in plans:
            options = _actor_options(resources[plan.index] or ({"CPU": _TOKEN_CPU} if self.group else {}))
            if self.group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=plan.index // stages_per_node)
            else:
                options["scheduling_strategy"] = "SPREAD"
            self.actors.append(actor.options(**options).remote(plan, threads))

    def infos(self, plans: Sequence[StagePlan], what: str) -> list[dict[str, Any]]:
        """Each actor's info, in stage order; a stage whose worker failed to load or died is named."""
        refs = [a.info.remote() for a in self.actors]
        infos = []
        for plan, ref in zip(plans, refs):
            info = self.get(ref, plan.index, what)
            if info.get("error"):
                raise PipelineError(f"stage {plan.index} could not be loaded by its worker (pid {info['pid']}): {info['error']}",
                                    stage_index=plan.index)
            infos.append(info)
        return infos

    def get(self, ref: Any, index: int, what: str, deadline: float | None = None) -> Any:
        ray = self.ray
        timeout = self.timeout if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait([ref], timeout=timeout)
        if not ready:
            raise PipelineError(f"stage {index} gave no answer within {self.timeout:g} s ({what}).", stage_index=index,
                                hint="Check the worker's machine (ray status); raise --timeout for slow stages.")
        try:
            return ray.get(ref)
        except Exception as e:
            raise self.error(e, index, what) from None

    def error(self, error: BaseException, index: int, what: str) -> PipelineError:
        ray = self.ray
        failed = getattr(error, "actor_id", None)
        for k, actor in enumerate(self.actors):  # the stage whose worker died, when Ray says which
            if failed is not None and getattr(getattr(actor, "_actor_id", None), "hex", lambda: None)() == failed:
                index = k
        if isinstance(error, ray.exceptions.RayTaskError) and isinstance(error.cause, OnnxModularError):
            return PipelineError(f"stage {index} failed ({what}): {_reason(error.cause)}", stage_index=index)
        if isinstance(error, ray.exceptions.RayActorError):
            cause = _cause(str(error))
            if getattr(error, "actor_init_failed", False):
                return PipelineError(f"stage {index}'s worker could not start ({what}): {cause}", stage_index=index,
                                     hint="Install onnx-modular[ray], this version, in the Python environment each node's "
                                     "`ray start` ran from.")
            return PipelineError(f"stage {index}'s worker died ({what})" + (f": {cause}" if cause else "."),
                                 stage_index=index,
                                 hint="See `ray status` and the worker's log on its node (out of memory, killed); run again.")
        return PipelineError(f"stage {index} failed ({what}): {type(error).__name__}: {_reason(error)}", stage_index=index)

    def close(self) -> None:
        ray = self.ray
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        if self.group is not None:
            try:
                ray.util.remove_placement_group(self.group)
            except Exception:
                pass
        if self.joined:
            ray.shutdown()
        if self._streams is not None:
            sys.stdout, sys.stderr = self._streams
            self._streams = None


def _bundle(resources: Sequence[dict[str, float]]) -> dict[str, float]:
    bundle: dict[str, float] = {}
    for one in resources:
        for key, value in (one or {"CPU": _TOKEN_CPU}).items():
            bundle[key] = bundle.get(key, 0.0) + value
    return bundle


def _drive(cluster: _Cluster, plans: Sequence[StagePlan], tokens: np.ndarray, max_new_tokens: int,
           groups: list[slice]) -> np.ndarray:
    """The greedy loop of every micro-batch, interleaved: a group's next step is sent as soon as
    its logits are back, so the stages work on other groups meanwhile."""
    ray = cluster.ray
    loops = {g: greedy_steps(tokens[part], max_new_tokens) for g, part in enumerate(groups)}
    pending: dict[Any, int] = {}  # the last stage's answer -> group
    chains: dict[int, list] = {}
    steps = dict.fromkeys(loops, 0)
    done: dict[int, np.ndarray] = {}

    def send(g: int, step: np.ndarray, past: int) -> None:
        refs: list[Any] = []
        for plan, actor in zip(plans, cluster.actors):
            refs.append(actor.step.remote(g, step, past, *(refs[j] for j in plan.reads_from)))
        chains[g] = refs
        pending[refs[-1]] = g

    def advance(g: int, logits: Any) -> None:
        try:
            step, past = loops[g].send(logits) if logits is not None else next(loops[g])
        except StopIteration as stop:
            done[g] = stop.value
            return
        send(g, step, past)

    for g in loops:
        advance(g, None)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=cluster.timeout)
        if not ready:
            g = next(iter(pending.values()))
            stuck = next((k for k, ref in enumerate(chains[g]) if not ray.wait([ref], timeout=0)[0]), len(plans) - 1)
            cluster.get(chains[g][stuck], stuck, f"step {steps[g]} of micro-batch {g}", deadline=time.monotonic())
        g = pending.pop(ready[0])
        sent = cluster.get(ready[0], len(plans) - 1, f"step {steps[g]} of micro-batch {g}")
        steps[g] += 1
        advance(g, logits_of(plans, sent))
    return np.concatenate([done[g] for g in sorted(done)], axis=0)


def generate_on_ray(
    folder: str | os.PathLike,
    input_ids: Any,
    max_new_tokens: int = 20,
    *,
    address: str,
    stages_per_node: int | None = None,
    resources: Mapping | Sequence | None = None,
    micro_batches: int | None = None,
    threads: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> PipelineRun:
    """Greedy generation with the stages of ``folder`` (a split of a with-cache file), each stage
    on its own Ray worker of the cluster at ``address`` (see the module's docstring).

    ``threads``: onnxruntime's intra-op threads in each stage (default: onnxruntime's).
    ``timeout``: seconds a stage's call may take (its load included).

    Raises:
        InvalidInputError: The folder is not a split of a with-cache file, a manifest that does not
            match its files, bad input ids or options (before the cluster is joined).
        MissingDependencyError: ray is not installed.
        PipelineError: The cluster cannot be joined or cannot place the stages; a stage cannot be
            loaded, dies or gives no answer in time (one line, the stage named).
    """
    started = time.monotonic()
    plans = read_stages(folder)
    tokens = prompt_tokens(input_ids, max_new_tokens)
    groups = batch_groups(tokens.shape[0], micro_batches, len(plans))
    if stages_per_node is not None and (isinstance(stages_per_node, bool) or not isinstance(stages_per_node, int)
                                        or stages_per_node < 1):
        raise InvalidInputError(f"stages_per_node must be an integer >= 1; got {stages_per_node!r}.")
    if not (isinstance(timeout, (int, float)) and 0 < timeout < 1e6):
        raise InvalidInputError(f"timeout must be a number of seconds > 0; got {timeout!r}.")
    per_stage = stage_resources(resources, len(plans))
    if not isinstance(address, str) or not address:
        raise InvalidInputError("address must name a Ray cluster (IP:PORT, or ray://HOST:10001).")
    cluster = _Cluster(address, float(timeout))
    try:
        cluster.place(plans, per_stage, stages_per_node, threads)
        cluster.infos(plans, "loading")
        decoding = time.monotonic()
        out = _drive(cluster, plans, tokens, max_new_tokens, groups)
        decoding = time.monotonic() - decoding
        infos = cluster.infos(plans, "reading its figures")
    finally:
        cluster.close()
    return PipelineRun(out, infos, len(groups), time.monotonic() - started, decoding)
