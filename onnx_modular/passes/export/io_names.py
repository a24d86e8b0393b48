"""Name the main graph's inputs and outputs after the model's own argument and output names."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import onnx_ir as ir

__all__ = ["NameGraphInputsOutputsPass"]

logger = logging.getLogger(__name__)


class NameGraphInputsOutputsPass(ir.passes.InPlacePass):
    """Rename graph inputs and outputs; names in both lists get ``input.`` / ``output.``.

    A name that occurs in both lists (a KV cache read and written back) is prefixed,
    as transformers' own ONNX exporter does. An output that is also an input, or that is
    listed twice, goes through an ``Identity`` so that each graph output has its own name.
    Lists whose length does not match the graph are left alone (the pass reports no change).

    Example::

        NameGraphInputsOutputsPass(["input_ids"], ["logits"])(model)
    """

    def __init__(self, input_names: Sequence[str], output_names: Sequence[str]):
        super().__init__()
        self.input_names = list(input_names)
        self.output_names = list(output_names)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        if len(self.input_names) != len(graph.inputs) or len(self.output_names) != len(graph.outputs):
            logger.debug(
                "Graph I/O not renamed: %d/%d input names for %d/%d inputs/outputs",
                len(self.input_names), len(self.output_names), len(graph.inputs), len(graph.outputs),
            )
            return ir.passes.PassResult(model, modified=False)
        input_names, output_names = _disambiguate(self.input_names, self.output_names)
        _separate_outputs(graph)
        taken = _value_names(graph)
        wanted = dict(zip(list(graph.inputs) + list(graph.outputs), input_names + output_names))
        for value, name in wanted.items():
            holder = taken.get(name)
            if holder is not None and holder is not value and holder not in wanted:
                if holder.producer() is not None:  # an inner value has the name: it moves
                    holder.name = _free_name(name, taken)
                    taken[holder.name] = holder
                else:  # an initializer keeps its name (weights are looked up by it)
                    wanted[value] = name = _free_name(name, taken)
                    taken[name] = value
        for value, name in wanted.items():
            value.name = name
        return ir.passes.PassResult(model, modified=True)


def _disambiguate(inputs: list[str], outputs: list[str]) -> tuple[list[str], list[str]]:
    both = set(inputs) & set(outputs)
    inputs = [f"input.{name}" if name in both else name for name in inputs]
    outputs = [f"output.{name}" if name in both else name for name in outputs]
    seen: dict[str, int] = {}
    unique = []
    for name in inputs + outputs:
        count = seen.get(name, 0)
        seen[name] = count + 1
        unique.append(name if count == 0 else f"{name}.{count}")
    return unique[: len(inputs)], unique[len(inputs) :]


def _separate_outputs(graph: ir.Graph) -> None:
    """Give every graph output a value of its own (not an input, not another output's)."""
    seen: set[int] = set()
    for index, value in enumerate(list(graph.outputs)):
        if value.is_graph_input() or id(value) in seen:
            identity = ir.node("Identity", [value])
            output = identity.outputs[0]
            output.shape, output.type = value.shape, value.type
            graph.append(identity)
            graph.outputs[index] = value = output
        seen.add(id(value))


def _value_names(graph: ir.Graph) -> dict[str, ir.Value]:
    names: dict[str, ir.Value] = {}
    for value in graph.inputs:
        names[value.name] = value
    for name, value in graph.initializers.items():
        names[name] = value
    for node in graph:
        for value in node.outputs:
            if value.name:
                names[value.name] = value
    return names


def _free_name(name: str, taken: dict[str, ir.Value]) -> str:
    index = 1
    while f"{name}__{index}" in taken:
        index += 1
    return f"{name}__{index}"
