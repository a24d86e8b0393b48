"""Drop torch's debug metadata from ``Constant`` nodes inside function bodies.

In a flat file, onnxscript's optimizer lifts constants into initializers, which carry no node
metadata. A function body cannot hold initializers, so its constants stay ``Constant`` nodes,
each with torch's per-node metadata (``pkg.torch.onnx.stack_trace``, ``fx_node``,
``namespace``, ...: about 880 bytes, ten times the constant itself). Dropping it makes a body's
constants cost what the flat file's initializers cost: on an LSTM + GRU model, graph bytes go
from 1.31x to 1.07x torch's flat file. The nodes that compute keep their metadata.
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["StripConstantMetadataPass"]


class StripConstantMetadataPass(ir.passes.InPlacePass):
    """Clear ``metadata_props`` of the ``Constant`` nodes in every function body.

    Example::

        StripConstantMetadataPass()(model)
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for function in model.functions.values():
            for node in ir.traversal.RecursiveGraphIterator(function):
                if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.metadata_props:
                    node.metadata_props.clear()
                    modified = True
        return ir.passes.PassResult(model, modified=modified)
