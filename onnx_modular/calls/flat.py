"""The flat copy of a modular file: every call inlined, each inlined node labelled with its own call.

``onnx.inliner`` copies a body's nodes with their ``metadata_props`` as they are. In a modular
file a body shared by ``h.0`` and ``h.1`` was recorded for its first call, so its nodes carry
torch's ``namespace`` of ``h.0`` (``: GPT2Model/h.0: GPT2Block/add_4: aten.add.Tensor``), and
inlined under ``h.1`` they would still say ``h.0``: Model Explorer, which nests a flat graph's
nodes by their ``namespace``, would put both blocks' nodes in one layer. The call node, with
onnx_modular's keys (module path, class, package), disappears.

:func:`inline_model` therefore gives every call its own copy of the body first, with each node's
``namespace`` (and torch's ``pkg.torch.onnx.name_scopes`` / ``class_hierarchy``, which follow it
segment by segment) rebased from the body's first call onto this call, and the call node's
``pkg.onnx_modular.*`` keys (``module_path`` resolved for this call, ``class``, ``package``,
``package_version``, ``source``) carried onto the nodes of its body; then ``onnx.inliner``
inlines as before. Nodes without a ``namespace`` (made by an optimizer) get their call's. The
copies exist only inside this step: the flat graph has the same nodes as onnx.inliner's.

Example::

    flat = inline_model(onnx.load("gpt2.onnx"))          # what `onnx-modular inline` writes
    flat = inline_model(model, optimize=True)            # + onnxscript's optimizer, for deployment
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
from collections.abc import Iterator

import onnx
import onnx.inliner

from onnx_modular.errors import InvalidInputError, InvalidModelFileError
from onnx_modular.format import metadata, scopes
from onnx_modular.format.text import first_line, shown
from onnx_modular.storage import save
from onnx_modular.storage.proto import all_nodes, inline_functions

__all__ = [
    "CARRIED_CALL_KEYS",
    "CLASS_HIERARCHY",
    "FLAT_SUFFIX",
    "NAME_SCOPES",
    "flat_file_path",
    "inline_model",
    "optimize_flat",
    "relocate_calls",
    "staged_with_flat",
]

#: ``flat_file=True`` writes ``<stem>.flat.onnx`` beside ``<stem>.onnx``.
FLAT_SUFFIX = ".flat.onnx"

#: torch's per-node lists that follow the ``namespace`` segments one to one (keys of format/metadata.py).
NAME_SCOPES = metadata.NAME_SCOPES
CLASS_HIERARCHY = metadata.CLASS_HIERARCHY
#: The call node's keys carried onto the nodes of its body in a flat copy (innermost call wins).
CARRIED_CALL_KEYS = (metadata.MODULE_PATH, metadata.CLASS, metadata.PACKAGE, metadata.PACKAGE_VERSION, metadata.SOURCE)

_FunctionId = tuple[str, str, str]


def _segments(namespace: str | None) -> list[str]:
    return namespace.split("/") if namespace else []


def _scope(segment: str) -> str:
    """``"h.0.attn: pkg.GPT2Attention"`` -> ``"h.0.attn"`` (``""`` for the root's ``": pkg.Model"``)."""
    return segment.split(": ", 1)[0]


def _rebase(path: str, home: str, actual: str) -> str | None:
    """``path`` with the module path ``home`` replaced by ``actual`` at its start; ``None`` if not below."""
    if path == home or path.startswith((home + ".", home + "@")):
        return actual + path[len(home) :]
    return None


def _set(node: onnx.NodeProto, key: str, value: str) -> None:
    for entry in node.metadata_props:
        if entry.key == key:
            entry.value = value
            return
    node.metadata_props.add(key=key, value=value)


def _relocate_node(node: onnx.NodeProto, home: str | None, call_segments: list[str]) -> None:
    """Rebase ``node``'s namespace (recorded under the body's first call ``home``) onto the call."""
    props = metadata.props(node)
    namespace = props.get(metadata.NAMESPACE)
    if namespace is None:
        if call_segments:
            _set(node, metadata.NAMESPACE, "/".join(call_segments))
        return
    segments = _segments(namespace)
    if home is None or not call_segments:
        return
    own = next((i for i, segment in enumerate(segments) if _scope(segment) == home), None)
    if own is None:
        return  # not recorded under the body's first call: a file of another tool, left as it is
    actual = _scope(call_segments[-1])
    rest = []
    for segment in segments[own + 1 :]:
        scope, sep, cls = segment.partition(": ")
        rebased = _rebase(scope, home, actual)
        rest.append(f"{rebased if rebased is not None else scope}{sep}{cls}")
    new = [*call_segments, *rest]
    _set(node, metadata.NAMESPACE, "/".join(new))
    # torch writes these as Python list reprs, one entry per namespace segment.
    for key, part in ((NAME_SCOPES, 0), (CLASS_HIERARCHY, 1)):
        if key not in props:
            continue
        old = scopes.literal_list(props[key])
        if old is not None and len(old) == len(segments):
            _set(node, key, str([segment.partition(": ")[2 * part] for segment in new]))


def relocate_calls(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give every call of a local function its own copy of the body, relabelled for that call.

    Works in place on ``model`` (its graph's call nodes are pointed at the copies and
    ``model.functions`` replaced by them) and returns it. Inlining the result gives the same
    graph as inlining ``model``, with each node's metadata naming the call it came from.
    Iterative (no recursion), so deep files are fine; the copies hold no weights.
    """
    functions: dict[_FunctionId, onnx.FunctionProto] = {(f.domain, f.name, f.overload): f for f in model.functions}
    if not functions:
        return model
    taken = {(f.domain, f.name) for f in model.functions}
    copies: list[onnx.FunctionProto] = []
    # Work list: (call node, its namespace segments, its resolved module path).
    pending: list[tuple[onnx.NodeProto, list[str], str | None]] = []

    def enqueue(nodes, caller_path: str | None, body_path: str | None) -> None:
        for node in all_nodes(nodes):
            if (node.domain, node.op_type, node.overload) not in functions:
                continue
            props = metadata.props(node)
            path = props.get(metadata.MODULE_PATH)
            if path is not None:
                path = metadata.resolve_module_path(node.name, path, caller_path, body_path)
                _set(node, metadata.MODULE_PATH, path)
            pending.append((node, _segments(props.get(metadata.NAMESPACE)), path))

    enqueue(model.graph.node, None, None)
    while pending:
        call, call_segments, call_path = pending.pop()
        function = functions[(call.domain, call.op_type, call.overload)]
        body = onnx.FunctionProto()
        body.CopyFrom(function)
        index = len(copies)
        while (body.domain, f"{function.name}__call{index}") in taken:
            index += 1
        body.name = f"{function.name}__call{index}"
        taken.add((body.domain, body.name))
        home = metadata.body_module_path(function)
        carried = {key: value for key, value in metadata.call_props(call, function).items() if key in CARRIED_CALL_KEYS}
        for node in all_nodes(body.node):
            _relocate_node(node, home, call_segments)
            if (node.domain, node.op_type, node.overload) not in functions:
                for key, value in carried.items():
                    _set(node, key, value)
        enqueue(body.node, call_path, home)
        call.op_type = body.name
        copies.append(body)
    del model.functions[:]
    model.functions.extend(copies)
    return model


def inline_model(model: onnx.ModelProto, *, optimize: bool = False) -> onnx.ModelProto:
    """``model`` with every local function inlined (:func:`relocate_calls`, then ``onnx.inliner``).

    ``optimize=True`` then runs onnxscript's optimizer on the flat graph, the one
    ``torch.onnx.export`` runs (constant folding, common subexpressions, constants lifted to
    initializers, equal initializers merged), which keeps node metadata.

    ``model``'s functions and call nodes are rewritten on the way (:func:`relocate_calls`; pass a
    copy to keep it). Raises what ``onnx.inliner`` raises.
    """
    flat = inline_functions(relocate_calls(model))
    return optimize_flat(flat) if optimize else flat


# Ops whose output size comes from an input's values, not its size: a 150-byte file can ask
# ConstantOfShape or Expand for 1024**3 elements.
_GROWING_OPS = frozenset(
    {"ConstantOfShape", "Expand", "Tile", "Range", "Resize", "Upsample", "Pad", "OneHot", "CenterCropPad", "Col2Im"}
)


def _fold_only_small_outputs(node) -> bool | None:
    """onnxscript's constant folder evaluates a node and only then checks its output's size:
    refuse to fold, before evaluation, a node whose output (after shape inference) is larger than
    the folder's own output limit, or of unknown size when its op can grow. ``None``: the
    folder's default rules."""
    from onnxscript.optimizer import constant_folding

    limit = constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT

    for output in node.outputs:
        shape = output.shape
        if shape is None or not shape.is_static():
            if node.op_type in _GROWING_OPS:
                return False
            continue
        if math.prod(int(d) for d in shape) > limit:
            return False
    return None


def optimize_flat(flat: onnx.ModelProto) -> onnx.ModelProto:
    """onnxscript's full optimizer on a flat graph, the one ``torch.onnx.export`` runs (constant
    folding, common subexpressions, constants lifted to initializers, equal initializers merged),
    with the fold-size guard (:func:`_fold_only_small_outputs`): the one recipe of
    ``export_modular(flat_file=...)``, ``result.save(flat_file=...)`` and ``onnx-modular inline --optimize``."""
    import onnx_ir as ir
    import onnxscript.optimizer

    optimized = ir.serde.deserialize_model(flat)
    onnxscript.optimizer.optimize_ir(optimized, should_fold=_fold_only_small_outputs)
    result = ir.serde.serialize_model(optimized)
    _keep_present_lifted_constants(result)
    return result


def _keep_present_lifted_constants(model: onnx.ModelProto) -> None:
    """The optimizer folds and merges initializers: the list of lifted constants keeps only
    those still in the graph (the key goes when none is left), so that it names no ghost."""
    lifted = metadata.lifted_constants(model)
    if not lifted and not any(entry.key == metadata.LIFTED_CONSTANTS for entry in model.metadata_props):
        return
    present = sorted(lifted & {tensor.name for tensor in model.graph.initializer})
    kept = [entry for entry in model.metadata_props if entry.key != metadata.LIFTED_CONSTANTS]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    if present:
        model.metadata_props.add(key=metadata.LIFTED_CONSTANTS, value=json.dumps(present))


# -- the deployment copy written beside a modular file (export_modular(flat_file=...)) ----------


def flat_file_path(
    f: str | os.PathLike | None, flat_file: bool | str | os.PathLike | None, *, streamed: bool = False
) -> pathlib.Path | None:
    """Where ``export_modular(f, flat_file=...)`` writes the flat copy (``None``: it does not).

    ``True`` puts ``<stem>.flat.onnx`` beside ``f``; a path is used as given. Checked before
    any export work (``streamed``: the export streams its weights, ``weights=``).
    """
    if flat_file is None or flat_file is False:
        return None
    if streamed:
        raise InvalidInputError(
            "flat_file= needs every weight in memory, which weights= (streaming) avoids.",
            hint="Export the modular file, then run `onnx-modular inline --optimize` where memory allows.",
        )
    if f is None:
        raise InvalidInputError(
            "flat_file= writes the flat copy beside the modular file, but no file f was given.",
            hint="Pass f (the modular file's path) too, or run `onnx-modular inline --optimize` on a saved file.",
        )
    if flat_file is True:
        modular = pathlib.Path(f)
        path = modular.with_name(modular.stem + FLAT_SUFFIX)
    elif isinstance(flat_file, (str, os.PathLike)) and not isinstance(os.fspath(flat_file), bytes):
        path = pathlib.Path(flat_file)
    else:
        raise InvalidInputError(
            f"flat_file must be True or a file path, not {type(flat_file).__name__}.",
            hint="flat_file=True writes <name>.flat.onnx beside the modular file.",
        )
    if os.path.abspath(path) == os.path.abspath(f):
        raise InvalidInputError(
            f"flat_file {str(path)!r} is the modular file's own path.", hint="Give the flat copy another name."
        )
    return save.check_destination(path)


def flat_model(path: str | os.PathLike):
    """The deployment copy of the modular file at ``path``: inlined (:func:`inline_model`) and
    optimized by onnxscript, as an ``onnx_ir.Model`` with its weights in memory."""
    import onnx_ir as ir

    model = onnx.load(str(path), load_external_data=True)
    try:
        flat = inline_model(model, optimize=True)
    except (onnx.checker.ValidationError, RuntimeError) as e:
        raise InvalidModelFileError(f"onnx.inliner cannot inline the model: {shown(first_line(e))}") from e
    return ir.from_proto(flat)


@contextlib.contextmanager
def staged_with_flat(
    model, path: str | os.PathLike, flat_path: pathlib.Path | None, *, external_data: bool | None = None
) -> Iterator[tuple[pathlib.Path, pathlib.Path | None]]:
    """Stage the modular ``model`` at ``path`` and, with ``flat_path``, its flat deployment copy.

    Yields the two staged files (the second ``None`` without ``flat_path``) for checks; both are
    checked by ``onnx.checker`` and moved into place together after the ``with`` body, or neither
    (``files.save.atomic_writes``). The flat copy is built from the staged modular file, so it is the
    file's own flat graph; it stores its weights as the modular file does (external data or not).

    Example::

        with staged_with_flat(model_ir, "m.onnx", pathlib.Path("m.flat.onnx")) as (modular, flat):
            verify(modular); verify(flat)   # raising here writes neither
    """
    if flat_path is None:
        with save.staged_save(model, path, external_data=external_data) as staged:
            yield staged, None
        return
    external = save.wants_external_data(model, external_data)
    with save.atomic_writes([path, flat_path]) as (modular_staging, flat_staging):
        staged = save.write_checked(model, modular_staging, external_data=external)
        staged_flat = save.write_checked(flat_model(staged), flat_staging, external_data=external)
        yield staged, staged_flat
