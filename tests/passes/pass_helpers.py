"""Helpers for the pass unit tests: call trees and module-call stacks from plain data (no torch)."""

from __future__ import annotations

import onnx
import onnx_ir as ir

from onnx_modular.format import metadata
from onnx_modular.format.calltree import CallTree, ModuleCall

PACKAGE, VERSION = "testpkg", "1.0"
DOMAIN = f"pkg.{PACKAGE}.{VERSION}"


def call_tree(*calls: tuple[str, str]) -> CallTree:
    """A call tree from ``(key, class name)`` pairs; the key is ``path`` or ``path@n``.

    A call's parent is the longest key-path prefix among the earlier calls (the root otherwise).
    """
    root = ModuleCall("", "", 0, f"{PACKAGE}.Model", PACKAGE, VERSION)
    made: dict[str, ModuleCall] = {}
    for key, class_name in calls:
        path, _, index = key.partition("@")
        parent = root
        for other in made.values():
            other_path = other.module_path
            if path.startswith(other_path + ".") and len(other_path) > len(parent.module_path):
                parent = other
        call = ModuleCall(
            key, path, int(index or 0), f"{PACKAGE}.layers.{class_name}", PACKAGE, VERSION,
            source=f"layers.py:{len(made) + 1}", parent=parent,
        )
        parent.children.append(call)
        made[key] = call
    return CallTree(root)


def set_stacks(model: ir.Model, stacks: dict[str, tuple[str, ...]]) -> None:
    """``node.meta[metadata.STACK]`` for the main-graph node producing each named value."""
    producers = {value.name: node for node in model.graph for value in node.outputs}
    for value_name, stack in stacks.items():
        producers[value_name].meta[metadata.STACK] = stack


def function(model: ir.Model, name: str) -> ir.Function:
    (found,) = [f for f in model.functions.values() if f.name == name]
    return found


def signature_names(function: ir.Function) -> tuple[list[str], list[str]]:
    return [v.name for v in function.inputs], [v.name for v in function.outputs]


def check(model: ir.Model) -> None:
    """onnx.checker on the serialized model (functions included)."""
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)


def as_initializers(model: ir.Model, fed: set[str], constants: dict, scale: float, seed: int = 0) -> ir.Model:
    """Every main-graph input not in ``fed`` made an initializer, as the export lifts weights and
    constants: the value in ``constants`` by name, else random normal weights times ``scale``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for value in [v for v in model.graph.inputs if v.name not in fed]:
        array = constants.get(value.name)
        if array is None:  # a weight
            array = rng.standard_normal(list(value.shape)).astype(np.float32) * scale
        value.const_value = ir.tensor(array, name=value.name)
        model.graph.inputs.remove(value)
        model.graph.register_initializer(value)
    return model
