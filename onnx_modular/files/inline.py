"""Inlining local functions into a copy of a file, written atomically (``onnx.inliner``)."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

import onnx

from onnx_modular.calls.flat import inline_model, optimize_flat
from onnx_modular.errors import InvalidInputError, InvalidModelFileError
from onnx_modular.format.text import first_line
from onnx_modular.passes.function_order import sort_functions_proto
from onnx_modular.storage import save
from onnx_modular.storage.checks import check_expanded_size
from onnx_modular.storage.load import load_external_data, load_model_file
from onnx_modular.storage.proto import inline_functions, shown, uses_external_data

__all__ = ["inline_file"]


def _resolve_function_ids(model: onnx.ModelProto, selectors: Sequence[str]) -> list[tuple[str, str]]:
    """``name`` or ``domain:name`` -> the ``(domain, name)`` of matching local functions."""
    available = sorted({(f.domain, f.name) for f in model.functions})
    resolved: list[tuple[str, str]] = []
    for selector in selectors:
        domain, sep, name = selector.rpartition(":")
        matches = [(d, n) for d, n in available if n == name and (not sep or d == domain)]
        if not matches:
            listed = ", ".join(f"{d}:{n}" for d, n in available[:12])
            if len(available) > 12:
                listed += f" and {len(available) - 12} more"
            raise InvalidInputError(
                f"No local function matches {selector!r}. Functions in the model: {listed or '(none)'}."
            )
        resolved += [m for m in matches if m not in resolved]
    return resolved


def inline_file(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    *,
    only: Sequence[str] | None = None,
    optimize: bool = False,
    opset_version: int | None = None,
) -> onnx.ModelProto:
    """Write a copy of ``source`` with local functions inlined, atomically.

    ``opset_version`` converts the copy to that opset of the default domain, body by body
    (functions left by ``only`` stay functions; see :class:`onnx_modular.passes.export.opset_conversion.ConvertOpsetPass`).

    ``optimize=True`` then runs onnxscript's full optimizer on the flat graph, the same one
    ``torch.onnx.export`` runs (constant folding, common subexpressions, constants lifted to
    initializers, equal initializers merged), so the per-call copies of constants become one
    shared initializer each, as in torch's own flat file.

    Every inlined node keeps its metadata, rebased onto the call it came from (torch's
    ``namespace``, which Model Explorer nests by, names ``h.1`` for the nodes of ``h.1``), and
    carries that call's ``pkg.onnx_modular.*`` keys (:mod:`onnx_modular.calls.flat`).

    Uses ``onnx.inliner.inline_local_functions`` (everything) or
    ``onnx.inliner.inline_selected_functions`` (the functions named in ``only``, each
    ``name`` or ``domain:name``; calls nested inside them stay calls unless selected too).
    A model with external data gets its own copy of the weights (``<destination>.<8 hex>.data``).
    Nothing is left at ``destination`` if any step fails.

    Returns:
        The inlined model (weights not loaded when they are external).

    Example::

        inline_file("gpt2.onnx", "gpt2.flat.onnx")
        inline_file("gpt2.onnx", "gpt2.noblock.onnx", only=["GPT2Block"])
        inline_file("gpt2.onnx", "gpt2.deploy.onnx", optimize=True)
    """
    import onnx_ir as ir

    from onnx_modular.passes.export import opset_conversion as opset

    if opset_version is not None:
        opset.check_opset(opset_version, default=opset_version)  # before any work
    destination = save.check_destination(destination, reads=[source])  # before the work: a bad path fails fast
    model = load_model_file(source)
    check_expanded_size(model, name=repr(str(source)))  # before onnx.inliner expands anything
    external = uses_external_data(model)
    if external:
        load_external_data(model, pathlib.Path(source).parent, name=repr(str(source)), model_path=source)
    try:
        if only:
            flat = inline_functions(model, _resolve_function_ids(model, only))
        else:  # each inlined node labelled with its own call (calls/flat.py)
            flat = inline_model(model)
    except (onnx.checker.ValidationError, RuntimeError) as e:
        raise InvalidModelFileError(f"onnx.inliner cannot inline {str(source)!r}: {shown(first_line(e))}") from e
    if optimize:  # the one flat-plus-optimize recipe, as export_modular(flat_file=...) writes
        flat = optimize_flat(flat)
    if opset_version is not None:
        converted = ir.from_proto(flat)
        opset.ConvertOpsetPass(opset_version)(converted)
        flat = ir.to_proto(converted)
    sort_functions_proto(flat)  # functions left by `only`, callee-first (passes/function_order.py)
    with save.atomic_write(destination) as staging:
        try:
            onnx.save(flat, str(staging.model_path), save_as_external_data=external, location=staging.data_location)
        except (OSError, ValueError) as e:
            raise InvalidInputError(f"Writing {str(destination)!r} failed: {e}") from e
    return flat

