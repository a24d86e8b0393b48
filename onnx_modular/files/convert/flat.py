"""``convert(..., quantize=...)`` on a flat file (no local functions): onnxruntime's
``MatMulNBitsQuantizer`` itself, its ``nodes_to_exclude`` found from the nodes' module metadata
(a flat copy, ``calls/flat.py``). For :func:`onnx_modular.files.convert.tool.convert`."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

import onnx

from onnx_modular.errors import InvalidInputError
from onnx_modular.files.convert.report import Conversion, output_drifts, warn_left
from onnx_modular.files.convert.verify import folder_bytes, runnable, source_bytes
from onnx_modular.format import metadata
from onnx_modular.passes.precision.quantize_weights import (
    LEFT_OPS,
    LEFT_OPS_REASON,
    QUANTIZE_BITS,
    QUANTIZED_OPS,
    root_logging_kept,
)
from onnx_modular.runtime import sessions as runtime
from onnx_modular.runtime.inputs import feeds_for
from onnx_modular.storage import save
from onnx_modular.storage.proto import uses_external_data


def node_modules(model: onnx.ModelProto) -> dict[str, tuple[str, str]]:
    """Node name -> (module path, class) from the nodes' metadata (a flat copy, ``calls/flat.py``)."""
    found = {}
    for node in model.graph.node:
        props = {e.key: e.value for e in node.metadata_props}
        if metadata.MODULE_PATH in props and node.name:
            found[node.name] = (props[metadata.MODULE_PATH], props.get(metadata.CLASS, "").rsplit(".", 1)[-1])
    return found


def _flat_excluded(model: onnx.ModelProto, names: Sequence[str]) -> list[str]:
    """The nodes of a flat file whose module (path, a path below it, class or glob) a NAME selects."""
    import difflib
    import fnmatch

    modules = node_modules(model)
    chosen: list[str] = []
    for text in names:
        hits = [
            node for node, (path, cls) in modules.items()
            if path == text or path.startswith(text + ".") or fnmatch.fnmatchcase(path, text) or cls == text
            or (cls and fnmatch.fnmatchcase(cls, text))
        ]
        if not hits:
            known = sorted({p for p, _ in modules.values()} | {c for _, c in modules.values() if c})
            close = difflib.get_close_matches(text, known, n=5, cutoff=0.5)
            raise InvalidInputError(
                f"No node of the flat file belongs to a module or class {text!r}"
                + (f"; the closest names: {', '.join(close)}." if close else "."),
                hint="Give a module path (`model.layers.0`) or a class (`LlamaMLP`) as the nodes' metadata names them.",
            )
        chosen += [n for n in hits if n not in chosen]
    return chosen


def convert_flat(
    source: pathlib.Path, destination: pathlib.Path, model: onnx.ModelProto, *, quantize: str, exclude: Sequence[str],
    block_size: int, symmetric: bool, accuracy_level: int | None, inputs, seed: int,
) -> Conversion:
    """``quantize`` on a flat file: onnxruntime's ``MatMulNBitsQuantizer`` itself, its
    ``nodes_to_exclude`` found from the nodes' module metadata. The weights are loaded (the
    quantizer works on a model in memory)."""
    import onnx_ir as ir

    with root_logging_kept():
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from onnx_modular.storage.load import load_external_data

    excluded = _flat_excluded(model, exclude)
    feeds = feeds_for(model, inputs, seed=seed)
    names, values = runtime.run(str(source), feeds, what="original model")
    reference = dict(zip(names, values))
    work = onnx.ModelProto()
    work.CopyFrom(model)
    if uses_external_data(work):
        load_external_data(work, source.parent, name=repr(str(source)))
    quantizer = MatMulNBitsQuantizer(work, bits=QUANTIZE_BITS[quantize], block_size=block_size, is_symmetric=symmetric,
                                     accuracy_level=accuracy_level, nodes_to_exclude=excluded)
    quantizer.process()
    result = quantizer.model.model
    originals = {n.name: n for n in model.graph.node if n.name}
    suffix = f"_Q{QUANTIZE_BITS[quantize]}"
    made = []
    for node in result.graph.node:
        if node.op_type == "MatMulNBits" and node.name.endswith(suffix) and node.name[: -len(suffix)] in originals:
            original = originals[node.name[: -len(suffix)]]
            if not node.metadata_props:  # the quantizer's new node keeps the MatMul's module labels
                node.metadata_props.extend(original.metadata_props)
            made.append((node_modules(model).get(original.name, ("<main graph>", ""))[0], node.name))
    result.metadata_props.add(key=metadata.CONVERTED, value=json.dumps({
        "source": source.name, "dtype": None, "kept": [], "quantize": quantize, "bits": QUANTIZE_BITS[quantize],
        "block_size": block_size, "excluded": sorted({node_modules(model)[n][0] for n in excluded}),
    }))
    with save.staged_save(ir.serde.deserialize_model(result), destination, full_check=False) as staged:
        runnable(staged, None, quantize)
        names, values = runtime.run(str(staged), feeds, what="converted model")
        output_bytes = folder_bytes(staged.parent)
    outputs = output_drifts(dict(zip(names, values)), reference)
    skipped = _flat_left(result, set(excluded))
    warn_left(quantize, made, skipped)
    return Conversion(
        source=str(source), output=str(destination), dtype=None, quantize=quantize, block_size=block_size, kept=[],
        auto_kept=[], tolerance=None, excluded=sorted({node_modules(model)[n][0] for n in excluded}), quantized=made,
        skipped=skipped, weights=0, float32_weights=[], casts=0, split=[], outputs=outputs, calls=[], classes=[],
        source_bytes=source_bytes(source, model), output_bytes=output_bytes,
    )


def _flat_left(model: onnx.ModelProto, excluded: set[str]) -> list[tuple[str, str, str]]:
    """The weight-reading nodes onnxruntime's quantizer left in a flat file (it quantizes MatMul only)."""
    constants = {t.name for t in model.graph.initializer}
    modules = node_modules(model)
    left = []
    for node in model.graph.node:
        if node.op_type in QUANTIZED_OPS + LEFT_OPS and node.name not in excluded and len(node.input) > 1 and node.input[1] in constants:
            reason = LEFT_OPS_REASON if node.op_type in LEFT_OPS else (
                f"a {node.op_type} of a flat file: onnxruntime's MatMulNBitsQuantizer leaves it (the modular file's "
                "convert makes Gemm MatMulNBits + Add)" if node.op_type == "Gemm" else "onnxruntime's MatMulNBitsQuantizer left it")
            left.append((modules.get(node.name, ("<main graph>", ""))[0], node.name or node.output[0], reason))
    return left

