"""One symbol per size torch proved equal, and one FX node per size the graph already holds.

:func:`share_equal_sizes` runs on the decomposed program, before translation. It makes input
symbols that torch proved equal one symbol (:func:`unify_equal_symbols`),
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

from onnx_modular.capture import torch_export

__all__ = ["share_equal_sizes", "unify_equal_symbols"]

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
    before = {node: torch_export.symbolic_expr(node.meta.get("val")) for node in program.graph.nodes}
    replaced = unify_equal_symbols(program)
    if not replaced:
        return replaced
    graph = program.graph
    seen: dict[tuple, list[tuple[tuple[str, ...], torch.fx.Node]]] = {}
    changed_keys: set[tuple] = set()
    candidates = []
    for node in graph.nodes:
        expr = torch_export.symbolic_expr(node.meta.get("val"))
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


def unify_equal_symbols(program: torch.export.ExportedProgram) -> dict[str, str]:
    """Make input symbols that torch proved equal one symbol; returns ``{replaced: kept}``.

    torch.export gives every input axis its own symbol and merges two when it meets their
    equality (a ``Dim`` shared by several inputs, a ``cat`` of two tensors). When the equality
    was already implied by an earlier guard (``s70 + s81 == s70 + s85`` from a matmul), torch
    records the guard but no replacement, and the symbols stay apart: a Llama KV cache traced
    by transformers' exporter keeps one past-length symbol per layer although its ``Dim`` is
    shared, so each layer reads "its" length from another input and the layers stop looking
    alike. Every guard (and deferred runtime assert) that says ``k*a == k*b`` for two input
    symbols is read back, and the shape environment gets the replacement torch would have made:
    every fake value of the program then shows the kept symbol (the first in input order).
    Only equalities torch itself relies on are used, so the program means what it meant.
    """
    shape_env, inputs = torch_export.shape_env_of(program), _input_symbols(program)
    if shape_env is None or len(inputs) < 2:
        return {}
    order = {symbol: i for i, symbol in enumerate(inputs)}
    kept = _merged_symbols(_linear_differences(shape_env, order), order)
    replaced = {}
    for symbol in inputs:
        target = _root(kept, symbol)
        if target != symbol and torch_export.replace_symbol(program, symbol, target, "onnx_modular: proven equal to an input symbol"):
            replaced[str(symbol)] = str(target)
    return replaced


def _input_symbols(program: torch.export.ExportedProgram) -> list:
    """The symbols of the program's input sizes, in input order."""
    inputs = []
    for node in program.graph.find_nodes(op="placeholder"):
        for size in getattr(node.meta.get("val"), "shape", ()):
            if isinstance(size, torch.SymInt):
                inputs.extend(s for s in sorted(size.node.expr.free_symbols, key=str) if s not in inputs)
    return inputs


def _linear_differences(shape_env, order: dict) -> list:
    """Each equality torch relies on (guards, deferred runtime asserts) as "difference == 0", in the
    symbols torch kept, where it is linear in input symbols."""
    import sympy

    facts = [guard.expr for guard in shape_env.guards]
    facts += [ra.expr for asserts in shape_env.deferred_runtime_asserts.values() for ra in asserts]
    differences = []
    for fact in facts:
        if isinstance(fact, sympy.Eq):
            difference = sympy.expand(shape_env.replace(fact.lhs - fact.rhs))
            terms = difference.as_coefficients_dict()
            if len(terms) >= 2 and all(term in order or term == 1 for term in terms):
                differences.append(difference)
    return differences


def _root(kept: dict, symbol):
    while symbol in kept:
        symbol = kept[symbol]
    return symbol


def _merged_symbols(differences: list, order: dict) -> dict:
    """Union-find over input symbols (the root is the first in input order): ``k*a - k*b == 0``
    merges a and b; a merge may bring another difference to that form."""
    import sympy

    kept: dict = {}
    merged = True
    while merged:
        merged, remaining = False, []
        for difference in differences:
            if kept:
                difference = sympy.expand(difference.xreplace({s: _root(kept, s) for s in difference.free_symbols}))
            terms = difference.as_coefficients_dict()
            if len(terms) == 2 and 1 not in terms and sum(terms.values()) == 0:
                first, second = sorted(terms, key=order.__getitem__)
                kept[second], merged = first, True
            elif len(difference.free_symbols) > 1:
                remaining.append(difference)
        differences = remaining
    return kept
