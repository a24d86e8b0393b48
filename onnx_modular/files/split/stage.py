"""One ``split`` stage as a model: its graph, its types and metadata, its test data, written and checked.

:func:`stage_models` builds each stage from the opened main graph and its :class:`~onnx_modular.files.split.plan.Cut`:
the stage's nodes, inputs and outputs typed by onnx's shape inference (or the test-data run), the
initializers it reads, the functions it calls (each one's ``module_paths`` as the stage calls it),
the no-op calls it covers, and ``split_*`` metadata. :func:`run_whole` runs the whole model once with
every value that crosses a cut as an output (the test data); :func:`write_stage` writes a stage with
its own data file, :func:`check_stage` runs it against the whole model's values.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir

from onnx_modular.calls import targets
from onnx_modular.calls.opening import is_module_call, set_no_ops
from onnx_modular.check.drift import measure
from onnx_modular.check.parity import default_tolerance
from onnx_modular.errors import InvalidInputError, ParityError
from onnx_modular.files.split.plan import Cut
from onnx_modular.format import metadata
from onnx_modular.format.text import shown
from onnx_modular.runtime import sessions as runtime
from onnx_modular.storage import save
from onnx_modular.storage.proto import all_nodes, function_id

__all__ = ["check_stage", "run_whole", "stage_models", "write_stage"]


def stage_models(model: onnx.ModelProto, cuts: list[Cut], values: Mapping[str, np.ndarray], source: str,
                 opened: list[str]) -> list[onnx.ModelProto]:
    """Each stage's model (in memory; weights by reference): its nodes, typed inputs and outputs
    (onnx's shape inference, else the test-data run's arrays), initializers, functions and metadata."""
    types = _types(model)
    positions = _call_positions(model, cuts)
    count = len(cuts)
    return [_stage_model(model, cut, k, count, types, values, source, opened, positions[k]) for k, cut in enumerate(cuts)]


def _types(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Declared or inferred types of the main graph's values (onnx's shape inference, symbolic)."""
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    for tensor in bare.graph.initializer:  # shapes only: no weight is read
        tensor.ClearField("raw_data")
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT
        for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
            tensor.ClearField(field)
    known = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(bare, check_type=False, strict_mode=False)
        known.update({v.name: v for v in inferred.graph.value_info})
    except Exception:  # inference is a help here, not a requirement: types then come from the run
        pass
    known.update({v.name: v for v in model.graph.value_info})
    known.update({v.name: v for v in model.graph.input})
    known.update({v.name: v for v in model.graph.output})
    return known


def _value_info(name: str, types: Mapping[str, onnx.ValueInfoProto], array: np.ndarray | None) -> onnx.ValueInfoProto:
    value = types.get(name)
    if value is not None and value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
        if array is None or value.type.tensor_type.HasField("shape") and len(value.type.tensor_type.shape.dim) == array.ndim:
            typed = onnx.ValueInfoProto()
            typed.CopyFrom(value)
            typed.name = name
            return typed
    if array is None:
        raise InvalidInputError(
            f"onnx's shape inference gives no type for {shown(name)!r}, a value crossing a cut, and without the "
            "test-data run there is nothing else to take it from.",
            hint="Split with the test data (drop --no-data / with_data=False), or cut elsewhere.",
        )
    elem = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
    return onnx.helper.make_tensor_value_info(name, elem, [None] * array.ndim)  # rank known, sizes free


def _stage_model(
    model: onnx.ModelProto, cut: Cut, k: int, count: int, types, values, source: str, opened: list[str], positions
) -> onnx.ModelProto:
    graph = model.graph
    stage = onnx.GraphProto(name=f"{graph.name or 'main_graph'}_stage_{k}")
    for i in cut.nodes:
        node = onnx.NodeProto()
        node.CopyFrom(graph.node[i])
        if node.op_type == "Shape" and node.domain in ("", "ai.onnx"):
            node.input[0] = cut.shape_sources.get(node.input[0], node.input[0])
        stage.node.append(node)
    stage.input.extend(_value_info(n, types, values.get(n)) for n in cut.inputs)
    stage.output.extend(_value_info(n, types, values.get(n)) for n in cut.outputs)
    by_name = {t.name: t for t in graph.initializer}
    stage.initializer.extend(by_name[n] for n in cut.initializers)
    boundary = set(cut.inputs) | set(cut.outputs) | set(cut.initializers)
    inner = {n for node in stage.node for n in node.output} - boundary
    stage.value_info.extend(v for v in graph.value_info if v.name in inner)
    for entry in graph.metadata_props:
        if entry.key != metadata.NO_OP_CALLS:
            stage.metadata_props.add(key=entry.key, value=entry.value)
    first, last = positions
    recorded = metadata.no_op_calls(graph)
    mine = [i for i, e in enumerate(recorded) if first <= e.position and (last is None or e.position < last)]
    if mine:
        new_index = {old: new for new, old in enumerate(mine)}
        set_no_ops(stage, [
            dataclasses.replace(recorded[i], position=recorded[i].position - first,
                                parent=new_index.get(recorded[i].parent, -1))
            for i in mine
        ])
    built = targets.standalone_model(model, stage, "onnx_modular.split")
    lifted = [n for n in cut.initializers if n in metadata.lifted_constants(model)]
    entries = {
        metadata.SPLIT_FROM: os.path.basename(source),
        metadata.SPLIT_STAGE: f"{k}/{count}",
        metadata.SPLIT_OPENED: json.dumps(opened),
    }
    if lifted:
        entries[metadata.LIFTED_CONSTANTS] = json.dumps(lifted)
    onnx.helper.set_model_props(built, entries)
    _serve_stage_calls(built)
    built.doc_string = (
        f"Stage {k} of {count} of {os.path.basename(source)}, cut by onnx_modular at module boundaries: "
        f"calls {', '.join(cut.calls)}."
    )
    return built


def _serve_stage_calls(stage: onnx.ModelProto) -> None:
    """Each function's ``module_paths`` and ``call_count`` as the stage calls it; a body written
    for a call of another stage is rebased onto its first call here (its nested call names)."""
    served: dict = {}
    for call in metadata.expanded_calls(stage):
        served.setdefault(function_id(call.function), []).append(call.call_name)
    for function in stage.functions:
        names = served.get(function_id(function), [])
        if metadata.MODULE_PATHS not in metadata.props(function) or not names:
            continue
        written_for = metadata.body_module_path(function)
        targets.set_prop(function, metadata.MODULE_PATHS, json.dumps(names))
        targets.set_prop(function, metadata.CALL_COUNT, str(len(names)))
        targets.rebase_body(function, written_for, metadata.strip_call_index(names[0]))


def write_stage(built: onnx.ModelProto, folder: pathlib.Path, destination: pathlib.Path, source_folder: str) -> pathlib.Path:
    """Write one stage with onnx_ir: weights stored externally in the source are copied tensor by
    tensor into the stage's own data file (``model.onnx.data``); others as the size decides."""
    folder.mkdir()
    as_ir = ir.serde.deserialize_model(built)
    ir.external_data.set_base_dir(as_ir.graph, source_folder)
    staging = save.Staging(folder, destination)
    external = any(onnx.external_data_helper.uses_external_data(t) for t in built.graph.initializer)
    return save.write_checked(as_ir, staging, external_data=True if external else None)


def check_stage(path: pathlib.Path, k: int, feeds, expected: Mapping[str, np.ndarray]) -> dict[str, float]:
    names, actual = runtime.run(str(path), feeds, what=f"stage {k}")
    differences = {}
    for name, got in zip(names, actual):
        want = expected[name]
        tolerance = default_tolerance(want.dtype)
        measured = measure(got, want, tolerance)
        differences[name] = measured.max_abs
        if not measured.within():
            raise ParityError(
                f"Stage {k} does not reproduce the whole model's value {shown(name)!r}: max abs difference "
                f"{differences[name]:.3g} (atol {tolerance.atol:g}, rtol {tolerance.rtol:g}).",
                hint="Nothing was written. A model with random ops differs on every run; otherwise check the file "
                "with `onnx-modular verify`, and report it with the model.",
            )
    return differences



def run_whole(model: onnx.ModelProto, path, cuts: list[Cut], feeds) -> dict[str, np.ndarray]:
    """One run of the whole (opened) model with every crossing value as an extra output."""
    crossing = [n for cut in cuts for n in cut.outputs]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    present = {v.name for v in probe.graph.output}
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in dict.fromkeys(crossing) if n not in present)
    names, arrays = runtime.run(
        probe.SerializeToString(), feeds, what="model", external_data_folder=runtime.external_data_folder(path, model)
    )
    values = dict(zip(names, arrays))
    values.update(feeds)
    return values


def _call_positions(model: onnx.ModelProto, cuts: list[Cut]) -> list[tuple[int, int | None]]:
    """Per stage, the range of main-graph call positions (calls with functions) it covers."""
    functions = {function_id(f): f for f in model.functions}
    before = []
    count = 0
    for node in model.graph.node:
        before.append(count)
        count += sum(1 for n in all_nodes([node]) if is_module_call(n, functions))
    firsts = []
    for cut in cuts:
        calls = [i for i in cut.nodes if is_module_call(model.graph.node[i], functions)]
        firsts.append(before[calls[0]] if calls else 0)
    firsts[0] = 0
    return [(firsts[k], firsts[k + 1] if k + 1 < len(firsts) else None) for k in range(len(firsts))]
