"""Put lifted constants back into the bodies that use them: a copy for reading, not for running.

:class:`~onnx_modular.passes.export.fold_weights.FoldWeightsPass` lifts every body ``Constant`` to one
shared main-graph initializer, passed down as formal inputs (``const_int64_2_8_-1_16``): onnxruntime
then creates 16 initializers for GPT-2 instead of one per call (264 in 12 layers), and creates
its session faster (``docs/benchmarks.md``). The price is paid by readers: in Netron every
``GPT2Block`` body shows those formal inputs as 16 more input boxes with their edges, where the
module structure used to be. Lifting only some constants gives part of the gain back (measured in
``docs/benchmarks.md``, "Lifted constants and Netron"), so the file keeps them lifted, and the
viewer (``onnx-modular view``) shows a copy where this pass has undone the lifting: a formal
input whose argument is the same lifted constant at every call becomes a ``Constant`` node in
the body again, one per use, which Netron draws inside the node that reads it (``shape⟨4⟩`` on a
``Reshape``), as it drew them before constants were lifted. Repeated from the main graph down.

Only the constants the file lists in ``pkg.onnx_modular.lifted_constants`` are moved; weights
and weight folds stay formal inputs. The result computes the same values (it is checked by the
tests), but it is meant for display: running it brings back the per-call constants.

Example::

    SinkLiftedConstantsPass()(model)   # model: onnx_ir.Model of a modular file
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_modular.format import metadata
from onnx_modular.passes.functions import keep_formal_inputs

__all__ = ["SinkLiftedConstantsPass"]


def function_call_sites(model: ir.Model) -> dict[ir.OperatorIdentifier, list[ir.Node]]:
    sites: dict[ir.OperatorIdentifier, list[ir.Node]] = {}
    for owner in [model.graph, *model.functions.values()]:
        for node in ir.traversal.RecursiveGraphIterator(owner):
            if node.op_identifier() in model.functions:
                sites.setdefault(node.op_identifier(), []).append(node)
    return sites


def constant_argument(value: ir.Value | None, lifted: set[str]) -> ir.TensorProtocol | None:
    """The tensor of a lifted main-graph constant, or of a ``Constant`` node's output; else ``None``."""
    if value is None:
        return None
    if value.is_initializer():
        tensor = value.const_value if value.name in lifted else None
    else:
        producer = value.producer()
        if producer is None or producer.op_type != "Constant" or producer.domain not in ("", "ai.onnx"):
            return None
        attribute = producer.attributes.get("value")
        tensor = attribute.as_tensor() if attribute is not None and attribute.type == ir.AttributeType.TENSOR else None
    if tensor is None or isinstance(tensor, ir.ExternalTensor):
        return None
    return tensor


def same_tensor(a: ir.TensorProtocol, b: ir.TensorProtocol) -> bool:
    return a is b or (a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and a.tobytes() == b.tobytes())


class SinkLiftedConstantsPass(ir.passes.InPlacePass):
    """Turn formal inputs that always receive the same lifted constant back into body ``Constant`` nodes.

    One ``Constant`` per use (Netron folds a constant into its reader only when it has one use).
    Arguments that become unused (the lifted initializers, the constants in callers) are removed,
    and ``pkg.onnx_modular.lifted_constants`` lists what is left.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        lifted = set(metadata.lifted_constants(model))
        if not lifted or not model.functions:
            return ir.passes.PassResult(model, modified=False)
        modified = False
        for _ in range(len(model.functions) + 1):  # each round moves the constants one call level down
            if not self._round(model, lifted):
                break
            modified = True
        if modified:
            self._drop_unused(model, lifted)
        return ir.passes.PassResult(model, modified=modified)

    def _round(self, model: ir.Model, lifted: set[str]) -> bool:
        changed = False
        for fid, calls in function_call_sites(model).items():
            function = model.functions[fid]
            sunk: dict[int, ir.TensorProtocol] = {}
            for index, formal in enumerate(function.inputs):
                if formal.is_graph_output():  # passed straight through: it must stay a value
                    continue
                tensors = [constant_argument(call.inputs[index] if index < len(call.inputs) else None, lifted) for call in calls]
                if tensors and tensors[0] is not None and all(t is not None and same_tensor(t, tensors[0]) for t in tensors):
                    sunk[index] = tensors[0]
            if not sunk:
                continue
            for index, tensor in sunk.items():
                formal = function.inputs[index]
                for count, use in enumerate(list(formal.uses())):
                    name = formal.name if count == 0 else f"{formal.name}_{count}"
                    constant = ir.node("Constant", [], attributes={"value": tensor}, name=f"{name}.constant")
                    output = constant.outputs[0]
                    output.name, output.dtype, output.shape = name, tensor.dtype, ir.Shape(tuple(tensor.shape))
                    use.node.graph.insert_before(use.node, constant)
                    use.node.replace_input_with(use.idx, output)
            keep_formal_inputs(function, calls, [i for i in range(len(function.inputs)) if i not in sunk])
            changed = True
        return changed

    @staticmethod
    def _drop_unused(model: ir.Model, lifted: set[str]) -> None:
        for owner in [model.graph, *model.functions.values()]:
            for node in reversed(list(ir.traversal.RecursiveGraphIterator(owner))):
                if node.op_type == "Constant" and not any(output.uses() or output.is_graph_output() for output in node.outputs):
                    node.graph.remove(node, safe=True)
        for name in sorted(lifted):
            value = model.graph.initializers.get(name)
            if value is not None and not value.uses() and not value.is_graph_output():
                del model.graph.initializers[name]
        left = sorted(name for name in lifted if name in model.graph.initializers)
        if left:
            model.metadata_props[metadata.LIFTED_CONSTANTS] = _json(left)
        else:
            model.metadata_props.pop(metadata.LIFTED_CONSTANTS, None)


def _json(names: list[str]) -> str:
    import json

    return json.dumps(names)
