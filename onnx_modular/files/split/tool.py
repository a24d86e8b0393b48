"""One model cut into stages at module boundaries, with a manifest that chains them.

``split("llama.onnx", "stages/", stages=2)`` writes::

    stages/manifest.json
    stages/stage_0/model.onnx [model.onnx.data]  test_data_set_0/input_0.pb ... output_0.pb
    stages/stage_1/model.onnx ...

Cuts fall only between consecutive module calls of one graph. The graph is the main graph, or
the body of a call opened into it: to cut between decoder layers, the ``model`` call
(``LlamaModel``) is opened, i.e. that one call's body is inlined into the main graph, one level
only, so its calls (``model.embed_tokens``, ``model.layers.0``, ...) become calls of the main
graph; their functions stay functions. ``at=`` names the first call of each new stage (calls of
one graph: the graph they share is opened); ``stages=N`` picks the graph and the cuts that
balance the stored weight bytes (or the time each call takes in ``profile``, ``balance="time"``):
the main graph, then the graph with its heaviest call opened, and so on: the first graph
whose best cut is within :data:`SHALLOW_PREFERENCE` of the best of them (an encoder-decoder is
cut between the two, not inside the decoder for a slightly better balance; a decoder LM is
cut between its layers).

Every node of the cut graph belongs to the stage of the call it follows (nodes before the first
call to the first stage); a node that reads only weights and constants is copied into each
stage that uses it. Every tensor a stage produces and a later stage reads (hidden states,
masks, position ids, rotary tables) is an output of the one and an input of the other; a model
input is an input of each stage that reads it, except where a stage reads only the shape of
an input of another stage (the past length from layer 2's cache in the first stage) and has an
input of the same declared type: it reads that one's shape instead, so each KV-cache input goes
to the stage owning its layer. Each stage holds the functions and the weights it uses; a weight
two stages use is stored in both and reported (:attr:`Split.shared_weights`).

``manifest.json``: ``{"stages": [{"file", "inputs": {stage input: model input or
"stage_K/<output>"}, "outputs": [...]}], "outputs": {model output: "stage_K/<output>"}}``.
Each stage's test data are its real inputs and outputs from one onnxruntime run of the whole
model (random inputs, seed 0, unless given), checked on the stage before anything is written.
:func:`run_stages` runs the chain.

External data is read in place and copied tensor by tensor into each stage's own data file
(onnx_ir's writer, through :func:`onnx_modular.storage.save.write_checked`); the folder is
built in a private temporary folder and moved into place whole: all stages or nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from onnx_modular.calls.opening import open_call
from onnx_modular.calls.tree import call_weights
from onnx_modular.errors import InvalidInputError, SaveError
from onnx_modular.files.extract import check_output_folder, write_data_set
from onnx_modular.files.split.plan import SHALLOW_PREFERENCE, Cut, assign, plan_at, plan_stages
from onnx_modular.files.split.stage import check_stage, run_whole, stage_models, write_stage
from onnx_modular.files.split.stages import MANIFEST, MODEL_FILE, run_stages
from onnx_modular.format import metadata
from onnx_modular.runtime.inputs import feeds_for
from onnx_modular.storage import locks, save
from onnx_modular.storage.checks import check_expanded_size
from onnx_modular.storage.limits import check_count
from onnx_modular.storage.load import load_model_file

__all__ = ["split", "run_stages", "Split", "Stage", "MANIFEST", "MODEL_FILE", "SHALLOW_PREFERENCE", "BALANCES"]

#: What ``stages=N`` balances.
BALANCES = ("bytes", "time")


@dataclasses.dataclass
class Stage:
    """One written stage.

    Attributes:
        index: Its place in the chain (``stage_<index>``).
        path: Its model file.
        calls: The module calls of the cut graph it runs (call names, in order).
        inputs: Stage input -> model input name or ``stage_K/<output>``.
        outputs: Its outputs, in order.
        weight_bytes: Bytes of the weights it stores (lifted constants excluded).
        max_abs: Per output, the largest difference of the stage from the whole model's values.
    """

    index: int
    path: pathlib.Path
    calls: list[str]
    inputs: dict[str, str]
    outputs: list[str]
    weight_bytes: int
    max_abs: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Split:
    """What :func:`split` wrote.

    Attributes:
        source: The file that was cut.
        output: The folder written (``manifest.json``, ``stage_<k>/``).
        stages: The stages, in order.
        opened: The calls opened to reach the cut graph (outermost first; empty: the main graph).
        balance: ``"bytes"``, ``"time"``, or ``"at"`` when the cuts were named.
        stage_costs: What was balanced, per stage (bytes, or microseconds for ``"time"``).
        shared_weights: Weights stored in more than one stage -> the stages that store them.
        weight_bytes: Bytes of the source file's weights (lifted constants excluded).
        notes: What the user may not expect of the plan (``stages=N`` cutting inside decoder layers).
    """

    source: str
    output: pathlib.Path
    stages: list[Stage]
    opened: list[str]
    balance: str
    stage_costs: list[float]
    shared_weights: dict[str, list[int]]
    weight_bytes: int
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def manifest(self) -> pathlib.Path:
        return self.output / MANIFEST

    def __str__(self) -> str:
        unit = "us" if self.balance == "time" else "bytes"
        where = "the main graph" + (f" with {', '.join(self.opened)} opened" if self.opened else "")
        lines = [f"{self.source}: {len(self.stages)} stages cut between the calls of {where} ({self.balance})"]
        for stage, cost in zip(self.stages, self.stage_costs):
            calls = stage.calls[0] if len(stage.calls) == 1 else f"{stage.calls[0]} .. {stage.calls[-1]}"
            worst = max(stage.max_abs.values(), default=0.0)
            lines.append(
                f"  stage_{stage.index}: {_count(len(stage.calls), 'call')} ({calls}), {_count(len(stage.inputs), 'input')}, "
                f"{_count(len(stage.outputs), 'output')}, weights {stage.weight_bytes:,} bytes"
                + (f", {cost:,.0f} {unit}" if self.balance == "time" else "")
                + (f"; test data max abs difference {worst:.3g}" if stage.max_abs else "; no test data")
            )
        total = sum(stage.weight_bytes for stage in self.stages)
        lines.append(f"Weights: {total:,} bytes in the stages, {self.weight_bytes:,} in the source.")
        for name, where_stored in self.shared_weights.items():
            lines.append(f"  {name}: stored in stages {', '.join(map(str, where_stored))}")
        lines.append(f"Manifest: {self.manifest}")
        lines.extend(f"Note: {note}" for note in self.notes)
        return "\n".join(lines)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


# -- what each call stores ------------------------------------------------------------------


def _tensor_bytes(tensor: onnx.TensorProto) -> int:
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        itemsize = 1
    count = 1
    for dim in tensor.dims:
        count *= int(dim)
    return count * itemsize


def _weight_sizes(model: onnx.ModelProto) -> dict[str, int]:
    """Stored bytes per main-graph initializer; lifted constants (shapes, scalars) count 0."""
    lifted = metadata.lifted_constants(model)
    return {t.name: 0 if t.name in lifted else _tensor_bytes(t) for t in model.graph.initializer}


def _check_arguments(stages, at, balance) -> list[str] | None:
    if (stages is None) == (at is None):
        raise InvalidInputError("Give either stages= (--stages N) or at= (--at PATH ...), not both or neither.")
    if balance not in BALANCES:
        raise InvalidInputError(f"balance must be one of {', '.join(BALANCES)}, not {balance!r}.")
    if stages is not None:
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 2:
            raise InvalidInputError(f"stages must be an integer >= 2, not {stages!r}.")
        check_count("MAX_STAGES", stages, "stages")
        return None
    if isinstance(at, str):
        at = [at]
    at = list(at)
    if not at or not all(isinstance(a, str) and a for a in at):
        raise InvalidInputError(f"at must name one call path or more, not {at!r}.")
    check_count("MAX_STAGES", len(at) + 1, "stages (the cuts of at= and one)")
    if balance != "bytes":
        raise InvalidInputError("balance= chooses the cuts of stages=N; with at= the cuts are named.")
    return at


def split(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    stages: int | None = None,
    at: str | Sequence[str] | None = None,
    balance: str = "bytes",
    inputs: str | os.PathLike | Mapping[str, np.ndarray] | None = None,
    with_data: bool = True,
) -> Split:
    """Cut a modular file into stages at module boundaries and write them with a manifest.

    Args:
        path: The modular ``.onnx`` file.
        out_dir: A new (or empty) folder: ``manifest.json`` and ``stage_<k>/model.onnx`` with its
            test data (``test_data_set_0/input_<i>.pb``, ``output_<i>.pb``).
        stages: How many stages; the graph and cuts that balance ``balance``.
        at: The first call of each new stage (call paths of one graph, ``model.layers.2``).
        balance: ``"bytes"`` (stored weight bytes) or ``"time"`` (each call's time in
            :func:`onnx_modular.profile`, on the same inputs), for ``stages``.
        inputs: The whole model's inputs for the run that makes the test data (an ``.npz`` or
            arrays by name); random from the declared shapes (seed 0) by default.
        with_data: ``False`` skips that run (for a model onnxruntime cannot hold in memory): no
            test data, no check of the stages; types come from onnx's shape inference.

    Returns:
        What was written (:class:`Split`; ``str()`` is a report).

    Raises:
        InvalidInputError: Both or neither of ``stages``/``at``; a path that is not a call (the
            closest names are listed); cuts in different graphs (a cut inside a call); a cut at
            a graph's first call; more stages than calls; a call inside control flow; an output
            folder that is not new or empty. Nothing is written.
        InvalidModelFileError: The file cannot be read.
        ParityError: A stage does not reproduce the whole model's values. Nothing is written.

    Example::

        result = split("llama.onnx", "stages/", stages=2)
        outputs = run_stages("stages/", {"input_ids": ids, ...})
    """
    at = _check_arguments(stages, at, balance)
    folder = check_output_folder(out_dir)
    source = str(path)
    model = _load_source(path, source, inputs=inputs, balance=balance, with_data=with_data)
    feeds = feeds_for(model, inputs) if with_data else {}
    sizes = _weight_sizes(model)
    weight_bytes, cost_of = _costs(model, path, feeds, sizes, balance)
    notes: list[str] = []
    if at is not None:
        opened, cut_calls = plan_at(model, at)
    else:  # called from here: its warning names split()'s caller
        opened, cut_calls, notes = plan_stages(model, stages, cost_of, weight_bytes)
    for name in opened:
        model = open_call(model, name)
    cuts = assign(model, cut_calls)
    values = run_whole(model, path, cuts, feeds) if with_data else {}
    crossing = {name for cut in cuts for name in (*cut.inputs, *cut.outputs)}
    check_count("MAX_TEST_DATA_BYTES", sum(getattr(values.get(n), "nbytes", 0) for n in crossing),
                "The test data of the stages (the values they pass each other; --no-data skips it), in bytes,")
    built = stage_models(model, cuts, values, source, opened)
    manifest = _manifest(model, cuts)
    stored: dict[str, list[int]] = {}
    for k, cut in enumerate(cuts):
        for name in cut.initializers:
            if sizes.get(name, 0):
                stored.setdefault(name, []).append(k)
    shared = {name: where for name, where in stored.items() if len(where) > 1}
    source_folder = os.path.dirname(os.path.abspath(source))
    written = _write_folder(folder, cuts, built, manifest, values if with_data else None, sizes, source_folder)
    costs = [sum(cost_of(name) for name in cut.calls) for cut in cuts]
    return Split(source, folder, written, opened, balance if at is None else "at", costs, shared, sum(sizes.values()), notes)


def _load_source(path, source: str, *, inputs, balance: str, with_data: bool) -> onnx.ModelProto:
    """The file to cut (external data stays where it is), checked for bombs and for functions."""
    model = load_model_file(path)  # external data stays where it is
    check_expanded_size(model, name=repr(source))  # call bombs and endless Loops, before any work
    if not model.functions:
        raise InvalidInputError(
            f"{source!r} has no local functions: there are no module boundaries to cut at.",
            hint="Export the model with onnx_modular.export_modular first.",
        )
    if not with_data and inputs is not None:
        raise InvalidInputError("inputs= are for the test-data run, which with_data=False (--no-data) skips.")
    if not with_data and balance == "time":
        raise InvalidInputError("balance='time' runs the model to profile it; with_data=False (--no-data) is for "
                                "models that are not run.", hint="Balance by bytes, or keep the test data.")
    return model


def _costs(model: onnx.ModelProto, path, feeds, sizes: Mapping[str, int], balance: str):
    """(stored weight bytes of a call, what ``balance`` balances of a call), by call name; for
    ``"time"``, each call's inclusive time in :func:`onnx_modular.profile` (5 runs on ``feeds``)."""
    weights = call_weights(model)
    times: dict[str, float] = {}
    if balance == "time":
        from onnx_modular.profiling.run import profile

        report = profile(path, feeds, runs=5, warmup=1)
        times = {item.key: item.inclusive_us for item in report.calls()}

    def weight_bytes(name: str) -> float:
        return float(sum(sizes.get(w, 0) for w in weights.get(name, ())))

    def cost_of(name: str) -> float:
        return times.get(name, 0.0) if balance == "time" else weight_bytes(name)

    return weight_bytes, cost_of


def _manifest(model: onnx.ModelProto, cuts: list[Cut]) -> dict:
    """``manifest.json``: each stage's file, its inputs' sources and its outputs; the model's outputs."""
    producer_stage = {n: k for k, cut in enumerate(cuts) for n in cut.outputs}
    manifest_stages = []
    for k, cut in enumerate(cuts):
        sources = {}
        for name in cut.inputs:
            stage_k = producer_stage.get(name)
            sources[name] = f"stage_{stage_k}/{name}" if stage_k is not None and stage_k < k else name
        manifest_stages.append({"file": f"stage_{k}/{MODEL_FILE}", "inputs": sources, "outputs": list(cut.outputs)})
    return {
        "stages": manifest_stages,
        "outputs": {v.name: f"stage_{producer_stage[v.name]}/{v.name}" for v in model.graph.output},
    }


def _write_folder(folder: pathlib.Path, cuts: list[Cut], built: list[onnx.ModelProto], manifest: dict,
                  values: Mapping[str, np.ndarray] | None, sizes: Mapping[str, int], source_folder: str) -> list[Stage]:
    """Every stage (and, with ``values``, its checked test data) and the manifest, in a private
    temporary folder moved into place whole: all stages or nothing."""
    written: list[Stage] = []
    parent = folder.parent if str(folder.parent) else pathlib.Path(".")
    with save.interrupt_on_sigterm(), locks.temp_folder(parent) as tmp:
        staged = tmp / "out"
        staged.mkdir()
        for k, (cut, stage_model) in enumerate(zip(cuts, built)):
            stage_folder = staged / f"stage_{k}"
            model_path = write_stage(stage_model, stage_folder, folder / f"stage_{k}" / MODEL_FILE, source_folder)
            differences = {}
            if values is not None:
                stage_feeds = {n: values[n] for n in cut.inputs}
                expected = {n: values[n] for n in cut.outputs}
                differences = check_stage(model_path, k, stage_feeds, expected)
                write_data_set(stage_folder / "test_data_set_0", stage_feeds, expected)
            written.append(
                Stage(
                    k, folder / f"stage_{k}" / MODEL_FILE, cut.calls, manifest["stages"][k]["inputs"], list(cut.outputs),
                    sum(sizes.get(n, 0) for n in cut.initializers), differences,
                )
            )
        try:
            (staged / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
            os.replace(staged, folder)  # a folder that exists is empty (checked): rename(2) replaces it
        except OSError as e:
            raise SaveError(f"Moving the stages into {str(folder)!r} failed: {e}", hint="Check free disk space and permissions.") from e
    return written
