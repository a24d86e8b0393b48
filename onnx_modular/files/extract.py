"""One module call as a model of its own, with the values it really receives as ONNX test data.

``extract("gpt2.onnx", "h.1.attn", "out/")`` writes the function of that call as a model:
its body is the graph (nested functions kept), its formal inputs are the graph inputs under
their formal names, and the weights and lifted constants the call receives become initializers
under those names. A class (``GPT2Block``) gives one model per distinct function of that class
(identical calls share one function: a 12-layer GPT-2 gives one model).

Where the calls of one function receive different weights (``h.0`` and ``h.1`` of a
``GPT2Block``), the weights are initializers that are also graph inputs (ONNX's overridable
initializers): the values are the first call's, and each call's data set feeds its own. A
formal input every call feeds from the same initializer (one call, or shared constants) is a
plain initializer, a constant for compilers.

The output folder holds one test case per model, in ONNX's layout (what
``onnx.backend.test.loader.load_model_tests`` and onnxruntime's ``onnx_test_runner`` read)::

    out/GPT2Block/model.onnx
    out/GPT2Block/test_data_set_0/input_0.pb ... output_0.pb     (call h.0)
    out/GPT2Block/test_data_set_1/...                             (call h.1)

The data (``with_data=True``) comes from one onnxruntime run of the whole model on copies of
the functions on each call's chain that also return the call's inputs and outputs
(:func:`onnx_modular.calls.targets.expose`); every data set is checked on the extracted model
before anything is written. The folder is built in a private temporary folder and moved into
place whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
from collections.abc import Mapping

import numpy as np
import onnx
import onnx.numpy_helper

from onnx_modular.calls import targets as _calls
from onnx_modular.calls.capture import call_values
from onnx_modular.check.drift import measure
from onnx_modular.check.parity import default_tolerance
from onnx_modular.errors import InvalidInputError, ParityError, SaveError
from onnx_modular.format import metadata
from onnx_modular.format.text import shown
from onnx_modular.runtime import sessions as runtime
from onnx_modular.runtime.inputs import feeds_for
from onnx_modular.storage import save
from onnx_modular.storage.checks import check_expanded_size
from onnx_modular.storage.folders import check_output_folder, new_folder
from onnx_modular.storage.load import load_model_file
from onnx_modular.storage.proto import function_label

__all__ = ["extract", "write_data_set", "check_output_folder", "Extraction", "ExtractedModel", "DataSet", "MODEL_FILE", "EXTRACTED_FROM"]

#: The model file of a test case (ONNX's test-case layout).
MODEL_FILE = "model.onnx"
#: Model metadata of an extracted model: the file it was extracted from.
EXTRACTED_FROM = metadata.EXTRACTED_FROM


@dataclasses.dataclass
class DataSet:
    """One call's values: ``folder/input_<i>.pb``, ``output_<i>.pb``; the extracted model's
    largest difference from the whole model's values, per output."""

    call_name: str
    folder: pathlib.Path
    max_abs: dict[str, float]


@dataclasses.dataclass
class ExtractedModel:
    """One written model (one test case)."""

    path: pathlib.Path
    function: str
    call_names: list[str]
    inputs: list[str]
    initializers: list[str]
    data_sets: list[DataSet] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Extraction:
    """What :func:`extract` wrote."""

    source: str
    target: str
    output: pathlib.Path
    models: list[ExtractedModel]

    def __str__(self) -> str:
        lines = []
        for model in self.models:
            lines.append(
                f"{model.path}: function {model.function}, calls {', '.join(model.call_names)}; "
                f"{len(model.inputs)} inputs, {len(model.initializers)} initializers"
            )
            for data in model.data_sets:
                worst = max(data.max_abs.values(), default=0.0)
                lines.append(f"  {data.folder.name}: call {data.call_name}, max abs difference {worst:.3g}")
        return "\n".join(lines)


#: Longest folder name made from a call or function name: room for a ``_<n>`` suffix under the
#: file systems' 255-byte NAME_MAX (a longer name is cut and ends with a hash of the whole).
_CASE_NAME_MAX = 200


#: Largest value written as one test-data file: a ``TensorProto`` is a protobuf message, 2 GiB at most.
MAX_RECORDED_BYTES = 2**31 - 2**16


def _case_name(text: str, taken: set[str]) -> str:
    name = re.sub(r"[^A-Za-z0-9._@-]", "_", text) or "call"
    if name.startswith("."):
        name = "_" + name
    if len(name) > _CASE_NAME_MAX:
        name = name[: _CASE_NAME_MAX - 9] + "~" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return _calls.unique_name(name, taken)


@dataclasses.dataclass
class _Formal:
    name: str
    source: str | None  # the initializer every call feeds it from (a plain initializer)
    default: str | None  # else the first call's initializer (an overridable one), if all calls feed one

    @property
    def is_input(self) -> bool:
        return self.source is None


def _formals(model: onnx.ModelProto, function: onnx.FunctionProto, sites: list[metadata.ExpandedCall]) -> list[_Formal]:
    formals = []
    main_names = _calls.main_graph_names(model)  # once, not per call
    for index, name in enumerate(function.input):
        sources = [_calls.initializer_source(model, site, index, main_names=main_names) for site in sites]
        if all(s is not None for s in sources) and len(set(sources)) == 1:
            formals.append(_Formal(name, sources[0], None))
        elif all(s is not None for s in sources):
            formals.append(_Formal(name, None, sources[0]))
        else:
            formals.append(_Formal(name, None, None))
    return formals


def _value_info(function: onnx.FunctionProto, name: str) -> onnx.ValueInfoProto | None:
    for value in function.value_info:
        if value.name == name:
            return value
    return None


def _site_type(model: onnx.ModelProto, site: metadata.ExpandedCall, actuals, index: int, name: str):
    """The type the body holding the call declares for its ``index``-th actual, under ``name``."""
    if index >= len(actuals) or not actuals[index]:
        return None
    graph = model.graph
    body = site.caller.function if site.caller is not None else None
    values = body.value_info if body is not None else [*graph.input, *graph.value_info, *graph.output]
    for value in values:
        if value.name == actuals[index] and value.type.HasField("tensor_type"):
            typed = onnx.ValueInfoProto()
            typed.CopyFrom(value)
            typed.name = name
            return typed
    return None


def _from_array(name: str, array: np.ndarray) -> onnx.ValueInfoProto:
    elem = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
    return onnx.helper.make_tensor_value_info(name, elem, list(array.shape))


def _dims(value: onnx.ValueInfoProto) -> str:
    tensor_type = value.type.tensor_type
    elem = onnx.TensorProto.DataType.Name(tensor_type.elem_type).lower() if tensor_type.elem_type else "?"
    if not tensor_type.HasField("shape"):
        return f"{elem}[...]"
    dims = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor_type.shape.dim]
    return f"{elem}[{', '.join(dims)}]"


def _is_static(value: onnx.ValueInfoProto) -> bool:
    tensor_type = value.type.tensor_type
    dims = tensor_type.shape.dim
    return tensor_type.HasField("shape") and len(dims) > 0 and all(d.HasField("dim_value") for d in dims)


def _load_tensor(model_tensor: onnx.TensorProto, name: str, folder: str) -> onnx.TensorProto:
    tensor = onnx.TensorProto()
    tensor.CopyFrom(model_tensor)
    tensor.name = name
    if onnx.external_data_helper.uses_external_data(tensor):
        onnx.external_data_helper.load_external_data_for_tensor(tensor, folder)
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]
    return tensor


def _input_type(model, function, sites, formal, index, first, initializers, notes) -> onnx.ValueInfoProto:
    """The type of a formal input: declared in the body, else as the first call receives it
    (captured values), the weight it is bound to, or its call site's declaration (with a note)."""
    name, call = formal.name, sites[0].call_name
    declared = _value_info(function, name)
    if declared is None and first is not None and first[0].get(index) is not None:
        declared = _from_array(name, first[0][index])
        notes.append(f"{name}: no type in the body; {_dims(declared)} as the call {call} receives it")
    elif declared is None and formal.source is not None:
        tensor = initializers[formal.source]
        declared = onnx.helper.make_tensor_value_info(name, tensor.data_type, list(tensor.dims))
    elif declared is None and (declared := _site_type(model, sites[0], sites[0].node.input, index, name)):
        notes.append(f"{name}: no type in the body; {_dims(declared)} as the call site declares it")
    if declared is None:
        raise InvalidInputError(
            f"The formal input {name!r} of {function.name} has no declared type.",
            module_path=call,
            hint="Extract with --with-data: the types are then taken from the values the call receives.",
        )
    return declared


def _output_type(model, function, sites, name, index, first, notes) -> onnx.ValueInfoProto | None:
    """The type of a body output: declared, else as the first call returns it, else its call site's."""
    declared = _value_info(function, name)
    if declared is None and first is not None and first[1][index] is not None:
        declared = _from_array(name, first[1][index])
        notes.append(f"{name}: no type in the body; {_dims(declared)} as the call {sites[0].call_name} returns it")
    elif declared is None and (declared := _site_type(model, sites[0], sites[0].node.output, index, name)):
        notes.append(f"{name}: no type in the body; {_dims(declared)} as the call site declares it")
    return declared


def _build(
    model: onnx.ModelProto,
    source: str,
    function: onnx.FunctionProto,
    sites: list[metadata.ExpandedCall],
    formals: list[_Formal],
    captured: Mapping[str, tuple[dict[int, np.ndarray], list[np.ndarray]]] | None,
) -> onnx.ModelProto:
    folder = os.path.dirname(os.path.abspath(source))
    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    lifted_sources = metadata.lifted_constants(model)
    names = [site.call_name for site in sites]
    first = captured[names[0]] if captured else None
    graph = onnx.GraphProto(name=function.name)
    graph.node.extend(function.node)
    notes = []
    for index, formal in enumerate(formals):
        declared = _input_type(model, function, sites, formal, index, first, initializers, notes)
        if formal.is_input:
            graph.input.append(declared)
        source_name = formal.source or formal.default
        if source_name is not None:
            graph.initializer.append(_load_tensor(initializers[source_name], formal.name, folder))
    for index, name in enumerate(function.output):
        declared = _output_type(model, function, sites, name, index, first, notes)
        graph.output.append(declared if declared is not None else onnx.ValueInfoProto(name=name))
    boundary = set(function.input) | set(function.output)
    graph.value_info.extend(v for v in function.value_info if v.name not in boundary)
    body_path = metadata.strip_call_index(names[0])
    written_for = metadata.body_module_path(function)
    if metadata.NO_OP_CALLS in metadata.props(function):  # the body's calls without ops, now the graph's
        _calls.set_prop(graph, metadata.NO_OP_CALLS, metadata.props(function)[metadata.NO_OP_CALLS])
    _calls.rebase_body(graph, written_for, body_path)

    extracted = _calls.standalone_model(model, graph, "onnx_modular.extract")
    props = metadata.props(function)
    entries = {
        metadata.EXTRACTED_FROM: source,
        metadata.MODULE_PATH: body_path,
        metadata.MODULE_PATHS: json.dumps(names),
    }
    for key in (metadata.CLASS, metadata.PACKAGE, metadata.PACKAGE_VERSION, metadata.SOURCE):
        if key in props:
            entries[key] = props[key]
    lifted = [f.name for f in formals if (f.source or f.default) in lifted_sources]
    if lifted:
        entries[metadata.LIFTED_CONSTANTS] = json.dumps(lifted)
    onnx.helper.set_model_props(extracted, entries)

    label = function_label((function.domain, function.name, function.overload))
    lines = [
        (
            f"{function.name}: the function {label} of {'the calls' if len(names) > 1 else 'the call'} "
            f"{', '.join(names)}, extracted from {os.path.basename(source)} by onnx_modular."
        ),
        "Dims as the body declares them (symbolic ones stay symbolic):",
    ]
    weights = {tensor.name for tensor in graph.initializer}
    for value in [*graph.input, *graph.output]:
        if value.name in weights:
            continue
        fixed = " (static in the body: fixed by the call site at export)" if _is_static(value) else ""
        lines.append(f"  {value.name}: {_dims(value)}{fixed}")
    lines.append(f"Initializers: {len(graph.initializer)} (the weights and constants the call receives).")
    overridable = [f.name for f in formals if f.default is not None]
    if overridable:
        lines.append(
            f"Weights that differ between the calls ({len(overridable)}) are initializers that are also graph "
            f"inputs: the values are {names[0]}'s; each test data set feeds its call's own."
        )
    lines += notes
    if captured:
        for name in names:
            inputs = captured[name][0]
            shapes = [f"{formals[i].name}{list(a.shape)}" for i, a in inputs.items() if a is not None]
            lines.append(f"At the call {name}: {', '.join(shapes)}")
    extracted.doc_string = "\n".join(lines)
    return extracted


def write_data_set(folder: pathlib.Path, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> pathlib.Path:
    """One ONNX test data set: ``folder/input_<i>.pb`` and ``output_<i>.pb`` (TensorProtos named
    after the model's inputs and outputs, in the model's order), as ``onnx_test_runner`` reads them."""
    folder.mkdir()
    for prefix, arrays in (("input", inputs), ("output", outputs)):
        for i, (name, array) in enumerate(arrays.items()):
            tensor = onnx.numpy_helper.from_array(np.asarray(array), name)
            (folder / f"{prefix}_{i}.pb").write_bytes(tensor.SerializeToString())
    return folder


def _write_case(
    extracted: onnx.ModelProto,
    folder: pathlib.Path,
    formals: list[_Formal],
    sites: list[str],
    captured,
) -> list[tuple[str, pathlib.Path, dict[str, float]]]:
    """Save the model in ``folder``, check it (onnx.checker, onnxruntime), write and check the data sets."""
    import onnx_ir as ir

    folder.mkdir()
    path = folder / MODEL_FILE
    as_ir = ir.from_proto(extracted)
    external = save.wants_external_data(as_ir, None)
    try:
        ir.save(as_ir, path, external_data=f"{MODEL_FILE}.data" if external else None)
    except OSError as e:
        raise SaveError(f"Writing {path.name} failed: {e}", hint="Check free disk space and permissions.") from e
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as e:
        raise SaveError(
            f"The ONNX checker rejected the extracted model of {', '.join(sites)}: {runtime.first_line(e)}",
            module_path=sites[0],
            hint="This is a bug in onnx_modular or an unusual file; please report it with the model.",
        ) from e
    session = runtime.session(str(path))  # onnxruntime loads it
    results = []
    if captured is None:
        return results
    input_names = [value.name for value in extracted.graph.input]
    output_names = [value.name for value in extracted.graph.output]
    index_of = {f.name: i for i, f in enumerate(formals)}
    for k, name in enumerate(sites):
        inputs, outputs = captured[name]
        feeds = {n: inputs[index_of[n]] for n in input_names}
        missing = [n for n, a in feeds.items() if a is None]
        if missing:
            raise InvalidInputError(f"The call {name} does not receive {missing[0]!r}.", module_path=name)
        _, actual = runtime.run(session, feeds, what=f"extracted model of {name}")
        differences = {}
        for out_name, got, expected in zip(output_names, actual, outputs):
            tolerance = default_tolerance(expected.dtype)
            measured = measure(got, expected, tolerance)
            differences[out_name] = measured.max_abs
            if not measured.within():
                raise ParityError(
                    f"The extracted model does not reproduce the output {out_name!r} of the call {name}: "
                    f"max abs difference {differences[out_name]:.3g} (atol {tolerance.atol:g}, rtol {tolerance.rtol:g}).",
                    module_path=name,
                    hint="Nothing was written. A body with random ops differs on every run; otherwise check the file "
                    "with `onnx-modular verify`, and report it with the model.",
                )
        for n, array in [*feeds.items(), *zip(output_names, outputs)]:
            if np.asarray(array).nbytes > MAX_RECORDED_BYTES:
                raise SaveError(
                    f"The value {shown(n)!r} of the call {shown(name)} holds {np.asarray(array).nbytes / 2**30:.2f} GiB; a test "
                    "data file (one TensorProto, as onnx's test runners read it) cannot exceed protobuf's 2 GiB limit.",
                    module_path=name,
                    hint="Nothing was written. Extract without --with-data, or record smaller inputs (--inputs).",
                )
        data = write_data_set(folder / f"test_data_set_{k}", {n: feeds[n] for n in input_names}, dict(zip(output_names, outputs)))
        results.append((name, data, differences))
    return results


def extract(
    path: str | os.PathLike,
    call: str,
    out: str | os.PathLike,
    *,
    with_data: bool = False,
    inputs: str | os.PathLike | Mapping[str, np.ndarray] | None = None,
) -> Extraction:
    """Write the function of one module call (or of every call of a class) as a model of its own.

    Args:
        path: The modular ``.onnx`` file.
        call: A call path (``h.1.attn``, ``shared@1``) or a class (``GPT2Block``, the qualified
            class, a function name, a glob).
        out: A new (or empty) folder; it gets one test-case folder per model
            (``<call path>/`` or ``<function>/``, each with ``model.onnx``).
        with_data: Also write each call's inputs and outputs from one onnxruntime run of the
            whole model, as ``test_data_set_<n>/input_<i>.pb`` / ``output_<i>.pb`` (one data set
            per call), checked on the extracted model.
        inputs: The whole model's inputs for that run (an ``.npz`` file or arrays by name);
            random inputs from the declared shapes (seed 0, as ``verify``) by default.

    Returns:
        What was written, with the largest difference of each data set.

    Raises:
        InvalidInputError: Unknown call or class (the closest names are listed), an output
            folder that exists and is not empty, inputs that do not fit.
        InvalidModelFileError: The file cannot be read, or calls a function it does not hold.
        ParityError: The extracted model does not reproduce a call's outputs. Nothing is written.

    Example::

        result = extract("gpt2.onnx", "GPT2Block", "blocks/", with_data=True)
        print(result)
    """
    folder = check_output_folder(out)
    source = str(path)
    model = load_model_file(path)
    check_expanded_size(model, name=repr(source))  # a call bomb is refused at once, as tree and verify refuse it
    target = _calls.resolve_target(model, call)
    calls = _calls.module_calls(model)
    functions = {(f.domain, f.name, f.overload): f for f in model.functions}
    cases: list[tuple[onnx.FunctionProto, list[str], list[_Formal]]] = []
    for fid in target.functions:
        names = target.calls_of(fid, calls)
        sites = [calls[name] for name in names]
        cases.append((functions[fid], names, _formals(model, functions[fid], sites)))
    captured = None
    if with_data:
        feeds = feeds_for(model, inputs)
        wanted = {
            name: [i for i, f in enumerate(formals) if f.is_input] for _, names, formals in cases for name in names
        }
        captured = call_values(model, path, wanted, feeds)
    elif inputs is not None:
        raise InvalidInputError("inputs= is for the test data: pass with_data=True (--with-data) too.")
    built = []
    for function, names, formals in cases:
        sites = [calls[name] for name in names]
        built.append(_build(model, source, function, sites, formals, captured))
    models: list[ExtractedModel] = []
    with new_folder(folder, "the extracted models") as staged:
        taken: set[str] = set()
        for (function, names, formals), extracted in zip(cases, built):
            case = _case_name(function.name if target.is_class else names[0], taken)
            results = _write_case(extracted, staged / case, formals, names, captured)
            models.append(
                ExtractedModel(
                    path=folder / case / MODEL_FILE,
                    function=function_label((function.domain, function.name, function.overload)),
                    call_names=names,
                    inputs=[v.name for v in extracted.graph.input],
                    initializers=[t.name for t in extracted.graph.initializer],
                    data_sets=[DataSet(n, folder / case / d.name, diffs) for n, d, diffs in results],
                )
            )
    return Extraction(source, call, folder, models)

