"""One symbol per size torch proved equal, and one FX node per size the graph already holds.

:func:`share_equal_sizes` runs on the decomposed program, before translation. It makes input
symbols that torch proved equal one symbol (:func:`~onnx_modular.capture.torch_compat.unify_equal_symbols`),
then lets each size expression that became the same as one computed before reuse that node:

* the ``sym_size`` nodes that read the past length from layer 0's, 1's and 2's cache tensors
  become one node (they read the same symbol);
* a sum ``past + sequence`` that layer 0's attention computed for itself (because, in torch's
  eyes, its past length was another symbol) reuses the one the decoder computed before the
  layers, which the other layers already receive.

A node is reused only by nodes inside the same module call or a call nested in it (its
``nn_module_stack`` keys are a prefix of theirs), so no call ever takes a value computed
inside a sibling call: layer 1 never reads a size from inside layer 0. Nodes whose
expression did not change keep their own place, so a program without such symbols is left
as it is. Without this, torch's split symbols made decoder layers of one checkpoint export
differ in which sizes they take as inputs, and deduplication kept several copies.
"""

from __future__ import annotations

import torch

from onnx_modular.capture import torch_compat

__all__ = ["share_equal_sizes"]

_SYNTHETIC_KEY_PREFIX = "_empty_nn_module_stack"
_DATA_DEPENDENT = {torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape}


def share_equal_sizes(program: torch.export.ExportedProgram) -> dict[str, str]:
    """Unify the input symbols torch proved equal and share the size nodes that became equal.

    Returns:
        ``{replaced symbol: kept symbol}`` (empty when torch kept no equal symbols apart).

    Example::

        program = torch_compat.decompose(program, registry)
        share_equal_sizes(program)   # before torch_compat.translate(program, registry)
    """
    before = {node: torch_compat.symbolic_expr(node.meta.get("val")) for node in program.graph.nodes}
    replaced = torch_compat.unify_equal_symbols(program)
    if not replaced:
        return replaced
    graph = program.graph
    seen: dict[tuple, list[tuple[tuple[str, ...], torch.fx.Node]]] = {}
    changed_keys: set[tuple] = set()
    candidates = []
    for node in graph.nodes:
        expr = torch_compat.symbolic_expr(node.meta.get("val"))
        if expr is None or node.op != "call_function" or _DATA_DEPENDENT & set(getattr(node.target, "tags", ())):
            continue
        key = (type(node.meta["val"]), expr)
        if expr != before.get(node):
            changed_keys.add(key)
        candidates.append((node, key))
    removed = 0
    for node, key in candidates:
        if key not in changed_keys:
            continue
        stack = _call_keys(node)
        earlier = next((kept for scope, kept in seen.get(key, ()) if stack[: len(scope)] == scope), None)
        if earlier is None:
            seen.setdefault(key, []).append((stack, node))
            continue
        node.replace_all_uses_with(earlier)
        graph.erase_node(node)
        removed += 1
    if removed:
        program.graph_module.recompile()
    return replaced


def _call_keys(node: torch.fx.Node) -> tuple[str, ...]:
    """The module-call keys of ``node`` (outermost first), the root's and torch's synthetic ones left out."""
    stack = node.meta.get("nn_module_stack") or {}
    return tuple(
        key for key, (path, _) in stack.items() if path != "" and not key.startswith(_SYNTHETIC_KEY_PREFIX)
    )
