"""Store torch's stack traces with paths relative to their import root.

Each node torch translates carries its Python stack (``pkg.torch.onnx.stack_trace``: ``File
"/home/alice/proj/.venv/lib/python3.11/site-packages/transformers/...py", line 310, in
forward``). Shipped as is, a model names the folders of the machine that exported it. The paths
are rewritten as :func:`onnx_modular.format.metadata.source_path` stores them
(``transformers/models/gpt2/modeling_gpt2.py``): the file and line stay findable, the
folders above the import root go.
"""

from __future__ import annotations

import re

import onnx_ir as ir

from onnx_modular.format import metadata

__all__ = ["RelativeStackTracesPass"]

_FILE = re.compile(r'File "([^"]+)"')


def relative_trace(trace: str) -> str:
    """``trace`` with every ``File "<absolute path>"`` made relative (:func:`metadata.source_path`)."""
    return _FILE.sub(lambda match: f'File "{metadata.source_path(match.group(1))}"', trace)


class RelativeStackTracesPass(ir.passes.InPlacePass):
    """Rewrite the paths of torch's stack traces on every node (main graph and functions).

    Example::

        RelativeStackTracesPass()(model)
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for graph in (model.graph, *model.functions.values()):
            for node in ir.traversal.RecursiveGraphIterator(graph):
                trace = node.metadata_props.get(metadata.TORCH_STACK_TRACE)
                relative = relative_trace(trace) if trace else trace
                if relative != trace:
                    node.metadata_props[metadata.TORCH_STACK_TRACE] = relative
                    modified = True
        return ir.passes.PassResult(model, modified=modified)
