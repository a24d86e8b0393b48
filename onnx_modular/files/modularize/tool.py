"""``modularize``: rebuild the module hierarchy of a flat ONNX file someone else exported.

A flat file still carries its module structure, in one of three forms (read in this order):

    torch name_scopes   torch's dynamo exporter (the default since torch 2.9) writes
                        ``pkg.torch.onnx.name_scopes`` and ``pkg.torch.onnx.class_hierarchy`` on
                        every node: module paths and classes, root first, the FX node last
    namespace           the same chain in one string, ``: Cls/h.0: pkg.Block/add: aten.add``
                        (Model Explorer's key; some tools keep only this one)
    scope names         TorchScript-era exporters (and Optimum's exports made with them) name
                        nodes by scope: ``/model/layers.0/self_attn/q_proj/MatMul``; module
                        paths only, no classes

Each is translated into what the export pipeline's own passes read: a
:class:`~onnx_modular.format.calltree.CallTree` and each main-graph node's stack of call keys
(:mod:`onnx_modular.calls.scoped`, with the readers of :mod:`onnx_modular.format.scopes`; where no
scope is recorded, :mod:`onnx_modular.calls.inferred` infers calls from repeated blocks).
Then ``passes/export/pipeline.modularize_passes`` (helper inlining, outlining, dedupe, naming) runs as in
``export_modular``: weights are passed into the calls as formal inputs, identical bodies are
shared (dedupe compares bodies, not names), a module whose nodes are interleaved with another's
is made convex the same way. Classes known: domain ``pkg.<package>`` (the top of the class's
module path), with the version when the file tells it (torch's own classes: the producer's
version), else ``unknown``. Scope names only: domain ``pkg.unknown``, functions named after the
path's last attribute (``layers.0`` -> ``layers``, ``self_attn``), class left empty.

The weights are never loaded: external data is read through onnx_ir's lazy tensors one at a
time while the new file is written, and onnxruntime runs both files from their folders. The
written file is verified against the flat one on the same inputs (given, or random from the
input types) inside the atomic save: a mismatch leaves nothing behind.

Example::

    report = modularize("gpt2.flat.onnx", "gpt2.onnx")
    print(report)      # calls, functions, nodes moved into calls / left for lack of a scope, parity

This module is the tool (reading the file, running the passes, the checked save); the report is
:mod:`onnx_modular.files.modularize.report`.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from onnx_modular.calls import inferred, scoped
from onnx_modular.calls.scoped import SOURCES
from onnx_modular.calls.tree import count_from_ir
from onnx_modular.check.parity import ParityReport, Tolerance, compare_outputs
from onnx_modular.errors import InvalidInputError, InvalidModelFileError, ParityError
from onnx_modular.files.modularize.report import ModularizeReport
from onnx_modular.format import metadata
from onnx_modular.format.calltree import CallTree, ModuleCall
from onnx_modular.format.scopes import Scopes
from onnx_modular.format.text import shown
from onnx_modular.passes.export import pipeline
from onnx_modular.runtime import inputs as runtime_inputs
from onnx_modular.runtime import sessions
from onnx_modular.storage import save
from onnx_modular.storage.checks import check_expanded_size
from onnx_modular.storage.limits import check_count
from onnx_modular.storage.load import load_model_file
from onnx_modular.storage.proto import uses_external_data

__all__ = ["ModularizeReport", "modularize", "file_stacks", "SOURCES", "INFERRED_SOURCE", "DEFAULT_TOLERANCE"]

#: Outlining moves nodes, it does not change them: the outputs must agree to this (float32).
DEFAULT_TOLERANCE = Tolerance(atol=1e-6, rtol=0.0)
#: ``report.source`` of a call tree inferred from the graph's structure (no scopes recorded).
INFERRED_SOURCE = "structure (inferred)"


# -- reading the scopes ------------------------------------------------------------------------


def file_stacks(model: ir.Model) -> tuple[str, dict[ir.Node, Scopes | None]]:
    """The first of :data:`SOURCES` the main graph's nodes carry, and each node's scopes by it
    (``None``: the node carries none).

    Raises:
        InvalidModelFileError: No node carries any, or the file is modular already.
    """
    found = scoped.recorded_stacks(model)
    if found is None:
        raise _no_scopes(len(model.graph))
    return found


def _no_scopes(nodes: int, repeats: bool | None = None) -> InvalidModelFileError:
    """No scopes recorded (and, when ``repeats`` is False, no block that repeats either)."""
    message = (
        f"The file carries no module scopes: none of its {nodes} main-graph nodes has torch's "
        f"{metadata.NAME_SCOPES!r} and {metadata.CLASS_HIERARCHY!r}, a {metadata.NAMESPACE!r} "
        "chain, or a TorchScript scope name ('/model/layers.0/self_attn/MatMul')"
    )
    if repeats is False:
        message += (
            f", and no block of {inferred.MIN_BLOCK_NODES} nodes or more repeats in its graph "
            "(same ops, attributes, shapes and weight shapes, back to back), so no call can be inferred."
        )
        hint = ("The file has nothing to share; to outline it anyway, export the model with "
                "onnx_modular.export_modular if you have the PyTorch model.")
    else:
        message += "."
        hint = ("Export the model with torch.onnx.export(..., dynamo=True) (which records them), or with "
                "onnx_modular.export_modular if you have the PyTorch model; --infer auto (infer='auto') "
                "infers calls from repeated blocks.")
    return InvalidModelFileError(message, hint=hint)


# -- constants and domains -------------------------------------------------------------------


#: Names exporters give the constants they store as initializers: torch's translator ``val_<n>``
#: and ``<node>/<input>``, TorchScript ``onnx::MatMul_<n>`` and ``/model/Constant_output_0``.
_CONSTANT_NAME = re.compile(r"^val_\d+$|/|::")


def _constants(model: ir.Model, tree: CallTree, *, inferred_only: bool = False) -> list[str]:
    """The initializers that are an exporter's constants, not a module's weights.

    Listed in :data:`~onnx_modular.format.metadata.LIFTED_CONSTANTS` as our exports list theirs:
    ``tree`` does not count them as parameters, ``view`` shows them inside the bodies. A weight is
    named ``<module path>.<attribute>`` (the state dict's name); an integer, boolean or scalar
    tensor named by the exporter's own patterns, not under a module path, is a constant.
    """
    paths = {call.module_path for call in tree.walk() if call.module_path}
    constants = []
    for name, value in model.graph.initializers.items():
        # Inferred calls have no module paths, and a stripped file's names say nothing: by value only.
        if not inferred_only and (name.rpartition(".")[0] in paths or not _CONSTANT_NAME.search(name)):
            continue
        # An optimizer's fold of weights is named like a constant (torch's ``val_308``, the
        # transposed tied ``lm_head.weight``): float tensors count as weights, scalars do not.
        size = math.prod(value.shape.numpy()) if value.shape is not None and value.shape.is_static() else None
        if value.dtype is not None and value.dtype.is_floating_point() and (size is None or size > 1):
            continue
        constants.append(name)
    return constants


def _domain(call: ModuleCall) -> str:
    if call.version and call.version != metadata.UNKNOWN_PACKAGE:
        return f"pkg.{call.package}.{call.version}"
    return f"pkg.{call.package}"



# -- the tool ----------------------------------------------------------------------------------


def modularize(
    path: str | os.PathLike,
    output: str | os.PathLike,
    *,
    dedupe: bool = True,
    modules: str | int | Sequence[str] | None = "all",
    inputs: str | os.PathLike | Mapping[str, np.ndarray] | None = None,
    tolerance: Tolerance | None = None,
    verify: bool = True,
    execution_provider: str | None = None,
    infer: str = "auto",
    output_names: Sequence[str] | None = None,
) -> ModularizeReport:
    """Rebuild the module hierarchy of the flat ONNX file ``path`` into ``output``.

    Args:
        path: A flat ONNX file (torch's dynamo exporter, or named by scope as TorchScript-era
            exporters and Optimum name nodes).
        output: The modular file to write (atomically; its weights external when ``path``'s are).
        dedupe: Share one function among identical calls (the layers of a stack).
        modules: Which calls become functions: ``"all"``, a maximum depth (1: the root's
            children), or class names/globs (``GPT2Block``, ``*Attention``; scope-named files:
            the function names, ``layers``, ``self_attn``). The others stay inline in their parent.
        inputs: Inputs for the check (an ``.npz`` file or arrays by name); random from the
            declared input types by default.
        tolerance: Of the check, modular against flat; default ``atol=1e-6``.
        verify: Run the check (the file is written only when it passes).
        execution_provider: onnxruntime's provider for the check (CPU by default).
        infer: ``"auto"``: where the file records no scopes (all of it, or runs of nodes of a file
            that has them elsewhere), infer calls from repeated blocks (``calls/inferred.py``);
            ``"always"``: infer even where scopes are recorded; ``"never"``: recorded scopes only.
        output_names: New names of the graph outputs, in order, as ``torch.onnx.export``'s
            ``output_names`` gives them (``["logits", ...]``): torch's file names them after
            the graph's last nodes (``linear_28``), since it keeps no forward() return names.

    Returns:
        A :class:`ModularizeReport`.

    Raises:
        InvalidModelFileError: ``path`` is not a readable ONNX file, carries no scopes, or is
            modular already. Nothing is written.
        InvalidInputError: A bad ``modules``, ``inputs`` or ``output``.
        ModularizeError: A module's nodes cannot be outlined (named by its path).
        ParityError: The modular file's outputs differ from the flat file's; nothing written.
    """
    source_path = pathlib.Path(path)
    destination = save.check_destination(output, reads=[path])
    if destination.resolve() == source_path.resolve():
        raise InvalidInputError(
            f"The output {shown(str(output))} is the input file.", hint="Write the modular file to another path."
        )
    proto = load_model_file(source_path, values=False)  # the checks; weights not read
    check_expanded_size(proto, name=shown(str(source_path)))  # call bombs and endless Loops, before any work
    external = uses_external_data(proto)
    feeds = runtime_inputs.feeds_for(proto, inputs) if verify else None
    del proto
    model = ir.load(str(source_path))  # external weights stay on disk (lazy tensors)
    _rename_outputs(model, output_names)
    if infer not in ("auto", "always", "never"):
        raise InvalidInputError(f"infer must be 'auto', 'always' or 'never', got {infer!r}.")
    found = scoped.recorded_stacks(model)  # refuses a modular file, whatever ``infer`` says
    inference = None
    if found is None or infer == "always":
        if infer == "never":
            raise _no_scopes(len(model.graph))
        # Shapes first: the signatures compare them (TorchScript-era files declare few).
        if any(value.shape is None or value.type is None for node in model.graph for value in node.outputs):
            common_passes.ShapeInferencePass(strict_mode=False)(model)
        inference = inferred.infer_calls(model)
        keys = inference.keys
        if not inference.regions and found is not None:
            raise InvalidModelFileError(
                f"No block of {inferred.MIN_BLOCK_NODES} nodes or more repeats in the graph of {shown(str(source_path))} "
                "(same ops, attributes, shapes and weight shapes, back to back): infer='always' finds no call.",
                hint="The file records module scopes: run with infer='auto' (--infer auto) to use them.",
            )
        if not inference.regions:
            raise _no_scopes(len(model.graph), repeats=False)
        source, tree = INFERRED_SOURCE, inference.tree
        scopes = {node: None for node in model.graph if node not in keys}
    else:
        source, scopes = found
        tree, keys = scoped.build_tree(scopes, scoped.root_class(model), scoped.torch_version(model))
        if infer == "auto" and any(stack is None for stack in scopes.values()):
            inference = inferred.infer_calls(model, subset=inferred.unscoped_runs(model, scopes))
            more = inference.keys
            if inference.regions and not any(call.key in tree for call in inference.tree.walk() if not call.is_root):
                tree = inferred.merged(tree, inference.tree, keys, more, model)
                keys.update(more)
                scopes.update(dict.fromkeys(more, ()))
            else:
                inference = None
    check_count("MAX_MODULES", sum(1 for _ in tree.walk()) - 1, "its module calls", from_file=shown(str(source_path)))
    selected = scoped.selected(tree, modules)
    nodes = len(model.graph)
    unscoped_nodes = {node for node, stack in scopes.items() if stack is None}

    weightless = scoped.weightless_modules(model, tree, keys)
    passes = pipeline.modularize_passes(
        stacks=keys, selected=selected, tree=tree, signatures={}, dedupe=dedupe, domain_of=_domain
    )
    # Types and shapes of the values the file leaves undeclared (TorchScript exports declare few):
    # dedupe compares the bodies' input and output shapes, and an unknown one differs from any.
    # onnx_ir runs onnx's inference without the initializers' values; a failure leaves the model as it is.
    if source != INFERRED_SOURCE:  # the inferred mode ran it before its search (where shapes lacked)
        passes.insert(0, common_passes.ShapeInferencePass(strict_mode=False))
    try:
        pipeline.run(passes, model)
    except ir.passes.PreconditionError as e:
        raise InvalidModelFileError(
            f"{shown(str(source_path))} cannot be modularized: {e}",
            hint="Sort the graph topologically (onnx_ir's TopologicalSortPass) and try again.",
        ) from e
    model.metadata_props[metadata.MODULARIZED_FROM] = source if inference is None or source == INFERRED_SOURCE else (
        f"{source} + {INFERRED_SOURCE}"
    )
    if inference is not None:
        inferred.mark_inferred(model, inference)
    constants = _constants(model, tree, inferred_only=source == INFERRED_SOURCE)
    if constants:
        model.metadata_props[metadata.LIFTED_CONSTANTS] = json.dumps(constants)
    functions = {call.function for call in tree.walk() if call.function is not None}
    had_nodes = {key for stack in keys.values() for key in stack}  # the calls that had nodes
    stayed = [node for node in model.graph if node.op_identifier() not in model.functions]
    count_from_ir(tree, model)

    parity = None
    with save.staged_save(model, destination, external_data=True if external else None) as staged:
        if verify:
            parity = _check(source_path, staged, feeds, tolerance or DEFAULT_TOLERANCE, execution_provider)
    return ModularizeReport(
        path=destination,
        source=source,
        tree=tree,
        calls=sum(1 for call in tree.walk() if call.function is not None),
        functions=len(functions),
        max_depth=tree.max_depth,
        nodes=nodes,
        nodes_in_calls=max(nodes - len(stayed), 0),
        nodes_in_parent=len(stayed),
        unscoped=sum(1 for node in stayed if node in unscoped_nodes),
        unscoped_total=len(unscoped_nodes),
        absorbed=[call.call_name for call in tree.walk() if call.key in had_nodes and call.selected and call.function is None],
        parity=parity,
        inferred=inference,
        unrecovered=scoped.merged_calls(model, tree, scopes) + weightless,
    )


def _rename_outputs(model: ir.Model, names: Sequence[str] | None) -> None:
    """Give the graph outputs ``names`` (in order); refused before anything is written when the
    count differs, a name repeats or is taken by another value, or an output is a graph input or
    a weight (renaming it would rename that too)."""
    if names is None:
        return
    names = list(names)
    outputs = list(model.graph.outputs)
    if len(names) != len(outputs) or len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise InvalidInputError(
            f"output_names needs {len(outputs)} distinct names, one per output ({', '.join(v.name or '?' for v in outputs)}); "
            f"got {names!r}.",
            hint="Give one name per graph output, in order: --output-names logits,present.0.key,...",
        )
    taken = {v.name for v in model.graph.inputs} | set(model.graph.initializers)
    for node in model.graph:
        taken |= {v.name for v in node.outputs if v is not None and v not in outputs}
    clash = sorted(set(names) & taken)
    plain = [v.name for v in outputs if v.is_graph_input() or v.is_initializer()]
    if clash or plain:
        raise InvalidInputError(
            (f"output_names {clash} are names of other values of the file." if clash else "")
            + (f" Outputs {plain} are graph inputs or weights, which keep their names." if plain else ""),
            hint="Choose other names, or keep the file's.",
        )
    for value, name in zip(outputs, names):
        value.name = name


def _check(flat: pathlib.Path, staged: pathlib.Path, feeds, tolerance: Tolerance, execution_provider) -> ParityReport:
    """The staged modular file against the flat one, in onnxruntime on the same feeds (the outputs
    matched by position: ``output_names`` renames them)."""
    names, expected = sessions.run(flat, feeds, what="flat file", execution_provider=execution_provider)
    got_names, got = sessions.run(staged, feeds, what="modular file", execution_provider=execution_provider)
    if len(got_names) != len(names):
        raise ParityError(
            f"The modular file's outputs {got_names} are not the flat file's {names}.",
            hint="This is a bug in onnx_modular's outlining; please report it with the file.",
        )
    report = compare_outputs(got_names, got, None, expected, reference_name="flat file", tolerance=tolerance)
    if not report.ok:
        raise ParityError(
            f"The modular file differs from the flat file beyond atol={tolerance.atol}, rtol={tolerance.rtol}; "
            f"nothing was written.\n{report}",
            report=report,
            hint="Report the file; keep the flat file, or pass modules= to outline fewer modules.",
        )
    return report
