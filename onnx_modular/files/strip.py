"""Strip an ONNX file of what names its modules: node names, metadata, doc strings, weight names.

What a file looks like after a converter or a graph tool that drops them: the inferred mode of
``modularize`` (``calls/inferred.py``) is measured and tested on such copies of torch's files.
The graph's inputs and outputs keep their names (the interface); every other value is renamed
``t<k>`` and every initializer ``w<k>``, in order; shapes (``value_info``) are kept.

Example::

    strip_names("gpt2.flat.onnx", "gpt2.stripped.onnx")
"""

from __future__ import annotations

import os
import pathlib

import onnx

from onnx_modular.storage import save
from onnx_modular.storage.load import load_model_file

__all__ = ["strip_names", "strip_proto"]


def _strip_nodes(nodes, rename: dict[str, str]) -> None:
    for node in nodes:
        node.name = ""
        node.doc_string = ""
        del node.metadata_props[:]
        node.input[:] = [rename.get(name, name) for name in node.input]
        node.output[:] = [rename.get(name, name) for name in node.output]
        for attr in node.attribute:
            attr.doc_string = ""
            graphs = [attr.g] if attr.HasField("g") else list(attr.graphs)
            for graph in graphs:
                _strip_nodes(graph.node, rename)
                for info in list(graph.input) + list(graph.output) + list(graph.value_info):
                    info.name = rename.get(info.name, info.name)


def strip_proto(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` stripped in place (and returned); see the module's doc."""
    graph = model.graph
    keep = {value.name for value in graph.input} | {value.name for value in graph.output}
    rename: dict[str, str] = {}
    for k, initializer in enumerate(graph.initializer):
        if initializer.name not in keep:
            rename[initializer.name] = f"w{k}"
    count = 0
    for node in graph.node:
        for name in node.output:
            if name and name not in keep and name not in rename:
                rename[name] = f"t{count}"
                count += 1
    for initializer in graph.initializer:
        initializer.name = rename.get(initializer.name, initializer.name)
        initializer.doc_string = ""
    for info in graph.value_info:
        info.name = rename.get(info.name, info.name)
        info.doc_string = ""
    for value in list(graph.input) + list(graph.output):
        value.doc_string = ""
    _strip_nodes(graph.node, rename)
    for function in model.functions:
        function.doc_string = ""
        del function.metadata_props[:]
        _strip_nodes(function.node, {})
    graph.name = "graph"
    graph.doc_string = ""
    model.doc_string = ""
    del graph.metadata_props[:]
    del model.metadata_props[:]
    return model


def strip_names(path: str | os.PathLike, output: str | os.PathLike) -> pathlib.Path:
    """Write a stripped copy of the ONNX file ``path`` to ``output`` (weights inline below 2 GB,
    else in ``<output>.data``, or a name of its own when that one is taken), atomically."""
    model = strip_proto(load_model_file(pathlib.Path(path), load_external_data=True))
    output = pathlib.Path(output)
    large = model.ByteSize() > 1_900_000_000
    with save.atomic_write(output) as staging:  # the one commit (and its guard), as every file
        onnx.save(
            model, str(staging.model_path), save_as_external_data=large, location=staging.data_location if large else None
        )
    return output
