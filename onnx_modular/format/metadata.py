"""The file-format contract: metadata keys and call-name conventions (see docs/metadata.md).

Every key onnx_modular writes into a file, and every rule for reading call names back, lives
here; the exporter, the file tools, localization and the tests import them from this module.
It imports neither torch nor onnxruntime, and works on both ``onnx`` protos and ``onnx_ir``
objects (anything with ``metadata_props``).

Example::

    from onnx_modular.format import metadata

    for call in metadata.expanded_calls(onnx.load("gpt2.onnx")):
        print(call.call_name, call.function.name, call.depth)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from typing import Any

import onnx

__all__ = [
    "PREFIX",
    "subgraphs",
    "CLASS",
    "PACKAGE",
    "PACKAGE_VERSION",
    "SOURCE",
    "MODULE_PATH",
    "MODULE_PATHS",
    "CALL_INDEX",
    "CALL_COUNT",
    "NO_OP_CALLS",
    "LIFTED_CONSTANTS",
    "FIXED_INPUTS",
    "FIXED_VALUES_SHOWN",
    "fixed_inputs_prop",
    "TORCH_STACK_TRACE",
    "source_path",
    "PROFILE_ORIGIN",
    "NAMESPACE",
    "NAME_SCOPES",
    "CLASS_HIERARCHY",
    "CONVERTED_DOMAIN",
    "function_domain",
    "EXTRACTED_FROM",
    "SPLIT_FROM",
    "SPLIT_STAGE",
    "SPLIT_OPENED",
    "CONVERTED",
    "MODULARIZED_FROM",
    "INFERRED",
    "UNKNOWN_PACKAGE",
    "CALLS",
    "STACK",
    "GLOBAL_NAME",
    "SOURCE_NAME",
    "SIGNATURE_NOTES",
    "FOLDED",
    "INLINED_STACK",
    "CALL_METADATA_KEYS",
    "CLASS_KEYS",
    "FUNCTION_ONLY_KEYS",
    "call_props",
    "call_name",
    "split_call_name",
    "strip_call_index",
    "props",
    "lifted_constants",
    "is_module_function",
    "module_paths",
    "body_module_path",
    "resolve_module_path",
    "CallCounter",
    "first_call",
    "NoOpCall",
    "no_op_calls",
    "ExpandedCall",
    "expanded_calls",
]

PREFIX = "pkg.onnx_modular."

# -- keys on functions (and call nodes) ---------------------------------------------------------
#: Qualified class of the module (``transformers.models.gpt2.modeling_gpt2.GPT2Block``).
#: Its presence marks a module-call function. This key and the next two are the function's; a
#: call node repeats one only where its call's value differs (one body shared by two classes
#: whose computations are identical): read them with :func:`call_props`. ``SOURCE`` is on both.
CLASS = PREFIX + "class"
#: Top-level package that defines the class (``transformers``).
PACKAGE = PREFIX + "package"
#: That package's installed version (``5.23.0``).
PACKAGE_VERSION = PREFIX + "package_version"
#: ``file:line`` of the class definition.
SOURCE = PREFIX + "source"
#: Call nodes: full module path of the (first) call (``h.0.attn``).
MODULE_PATH = PREFIX + "module_path"
#: Call nodes: 0 for the first call of that module instance, 1 for the second, ...
CALL_INDEX = PREFIX + "call_index"
#: Functions: JSON list of the call names of every call using this definition.
MODULE_PATHS = PREFIX + "module_paths"
#: Functions: how many calls use this definition.
CALL_COUNT = PREFIX + "call_count"
#: Functions and the main graph: JSON list of ``[call name, qualified class, position, module path,
#: parent]`` for the module calls made in this body that produced no ops (``nn.Dropout`` in eval,
#: ``nn.Identity``): they have no function and no node (see :class:`NoOpCall`).
NO_OP_CALLS = PREFIX + "no_op_calls"
#: The model: JSON list of the main-graph initializers that hold ``Constant``s lifted out of
#: function bodies (shapes, scalars; they reach the bodies as formal inputs ``const_...``).
#: They are not weights: ``onnx-modular tree`` does not count them as parameters.
LIFTED_CONSTANTS = PREFIX + "lifted_constants"
#: The model: JSON ``{input name: {"dtype", "shape", "values"}}`` of the keyword inputs
#: ``export_modular(fixed_inputs=...)`` fixed into the program (the file does not take them and
#: serves only inputs of that layout). ``values`` is omitted beyond :data:`FIXED_VALUES_SHOWN` elements.
FIXED_INPUTS = PREFIX + "fixed_inputs"
FIXED_VALUES_SHOWN = 4096
#: torch's per-node Python stack (``File "...", line N, in forward``); its paths are stored
#: relative to their import root (:func:`source_path`).
TORCH_STACK_TRACE = "pkg.torch.onnx.stack_trace"
#: Nodes of the profiler's private flat copy only (:mod:`onnx_modular.profiling.attribution`): the
#: node's index in the copy's origin table while ``onnx.inliner`` inlines it; removed before the
#: copy runs, never in a saved file.
PROFILE_ORIGIN = PREFIX + "profile_origin"
#: The model of one extracted call (``onnx-modular extract``): the file it was extracted from.
EXTRACTED_FROM = PREFIX + "extracted_from"
#: A stage of a split model (``onnx-modular split``): the file it was cut from, ``"<k>/<stages>"``,
#: and the calls opened to reach the graph that was cut (JSON list, outermost first).
SPLIT_FROM = PREFIX + "split_from"
SPLIT_STAGE = PREFIX + "split_stage"
SPLIT_OPENED = PREFIX + "split_opened"
#: The model written by ``onnx-modular convert``: JSON object of what it did (``dtype``, ``kept``
#: calls, ``quantize``, ``bits``, ``block_size``, ``excluded`` calls, ``source`` file name).
CONVERTED = PREFIX + "converted"
#: ``ValueInfoProto`` metadata on a value whose float32 values leave a float16 conversion's finite
#: range (its largest magnitude on the original run): passes/precision/casts.py keeps its ops float32.
FLOAT32_RANGE = PREFIX + "float32_range"
#: On a node a fusion pass wrote: the module paths of the calls it was fused from (passes/fusions/).
FUSED_FROM = PREFIX + "fused_from"
#: torch's ``path: class/...`` chain (not ours; kept on every node).
NAMESPACE = "namespace"
#: torch's dynamo exporter's per-node lists (Python list reprs) that follow the :data:`NAMESPACE`
#: segments one to one: the module paths a node ran under, root (``""``) first and the FX node's
#: name last, and their classes (the op last). Not ours: a flat copy rebases them with the
#: namespace (:mod:`onnx_modular.calls.flat`), ``modularize`` rebuilds calls from them.
NAME_SCOPES = "pkg.torch.onnx.name_scopes"
CLASS_HIERARCHY = "pkg.torch.onnx.class_hierarchy"
#: A domain of the opset conversion's own (``passes/export/opset_conversion.py``): Split and Pad already
#: in their opset-13 form pass onnx's converter under it; never in a saved file.
CONVERTED_DOMAIN = PREFIX + "converted"


def function_domain(package: str, version: str) -> str:
    """The domain of a module's function: ``pkg.<package>.<version>`` (``pkg.transformers.5.23.0``)."""
    return f"pkg.{package}.{version}"

#: Model metadata written by ``modularize``: where the call tree of a flat file came from
#: (``torch name_scopes``, ``namespace`` or ``scope names``).
MODULARIZED_FROM = PREFIX + "modularized_from"
#: Functions and call nodes of calls that ``modularize`` inferred from the graph's structure (a
#: flat file without scopes, ``calls/inferred.py``): ``"structure"``. Their module paths
#: (``block.0``, ``block.0.attention``) and classes (``Block``, ``Block.Attention``) are
#: positions and shapes, not the model's: nobody recorded them.
INFERRED = PREFIX + "inferred"
#: The package (and version) of a module whose class a file does not tell: its domain is
#: ``pkg.unknown``; a known class of an unknown version gets ``pkg.<package>`` and this version.
UNKNOWN_PACKAGE = "unknown"

#: ``meta`` key (in memory only, never saved) of an ``onnx_ir.Function``: the
#: :class:`~onnx_modular.format.calltree.ModuleCall` objects it serves.
CALLS = "onnx_modular.calls"

#: ``meta`` key (in memory only) of a main-graph ``onnx_ir.Node`` before outlining: the
#: module-call keys (outermost first) the node ran under. Set by ``AnnotateStacksPass``,
#: read by ``OutlineModuleCallsPass`` and ``InlineHelperFunctionsPass``.
STACK = "onnx_modular.stack"

#: ``meta`` keys (in memory only) the passes leave for each other:
#: a function's name before NameFunctionsPass names it (OutlineModuleCallsPass),
GLOBAL_NAME = "onnx_modular.global_name"
#: a value's name in torch's translation (= FX node name), matched to eager signatures,
SOURCE_NAME = "onnx_modular.source_name"
#: a function's notes on inputs/outputs the signature matching could not name,
SIGNATURE_NOTES = "onnx_modular.signature_notes"
#: an initializer FoldWeightsPass computed (its sources' names).
FOLDED = "onnx_modular.folded"
#: Node metadata property (removed again within InlineHelperFunctionsPass) carrying
#: :data:`STACK` across onnx_ir's inliner, which copies ``metadata_props`` but not ``meta``.
INLINED_STACK = PREFIX + "internal.stack"

#: The keys every call node carries (and ``SOURCE`` where the class has one).
CALL_METADATA_KEYS = frozenset({MODULE_PATH, CALL_INDEX, NAMESPACE})
#: The module's keys: on its function; a call node keeps ``SOURCE`` (Netron's node panel shows a
#: node's metadata, and its type and domain already name the class, package and version) and the
#: others only where its call's differ. :data:`FUNCTION_ONLY_KEYS` are the ones it drops.
CLASS_KEYS = (CLASS, PACKAGE, PACKAGE_VERSION, SOURCE)
FUNCTION_ONLY_KEYS = (CLASS, PACKAGE, PACKAGE_VERSION)


def call_props(node, function) -> dict[str, str]:
    """A call node's metadata with its module's :data:`CLASS_KEYS` filled in from the function
    it calls: a node's own value wins (earlier files repeat all four on every call node; a call
    of another class than its shared body's keeps its own)."""
    merged = {key: value for key, value in props(function).items() if key in CLASS_KEYS} if function is not None else {}
    merged.update(props(node))
    return merged


# -- call names ----------------------------------------------------------------------------


def call_name(path: str, index: int = 0) -> str:
    """``h.0.attn`` for a first call, ``shared@1`` for the second call of ``shared``.

    A path that itself ends in ``@`` and digits (a ``ModuleDict`` key ``"lin@0"``) always carries
    its index (``lin@0@0``), so that :func:`split_call_name` never reads its end as an index.
    """
    if index or split_call_name(path) != (path, 0):
        return f"{path}@{index}"
    return path


def split_call_name(name: str) -> tuple[str, int]:
    """``"shared@1"`` -> ``("shared", 1)``; ``"h.0"`` -> ``("h.0", 0)``.

    A trailing ``@`` followed by digits is the call index; anything else is part of the path.
    """
    base, sep, index = name.rpartition("@")
    if sep and base and index.isdigit():
        return base, int(index)
    return name, 0


def strip_call_index(name: str) -> str:
    """``"shared@1"`` -> ``"shared"``."""
    return split_call_name(name)[0]


# -- reading metadata ----------------------------------------------------------------------


def lifted_constants(model: Any) -> set[str]:
    """Names of the main-graph initializers that hold lifted body constants (not weights)."""
    try:
        return set(json.loads(props(model).get(LIFTED_CONSTANTS, "[]")))
    except (ValueError, TypeError):
        return set()


def props(obj: Any) -> Mapping[str, str]:
    """``metadata_props`` as a mapping, for onnx protos (a repeated field) and onnx_ir objects (a dict)."""
    entries = obj.metadata_props
    if isinstance(entries, Mapping):
        return entries
    return {entry.key: entry.value for entry in entries}


def is_module_function(function: Any) -> bool:
    """Whether a function (proto or ``onnx_ir``) is a module call's function written by onnx_modular
    (torch's own helper functions are not)."""
    return function is not None and CLASS in props(function)


def _json_list(text: str | None) -> list:
    """A JSON list from metadata; anything else (not JSON, nested too deep to decode) is ``[]``."""
    if not text or not isinstance(text, str):
        return []
    try:
        decoded = json.loads(text)
    except (ValueError, RecursionError):
        return []
    return decoded if isinstance(decoded, list) else []


def module_paths(function: Any) -> list[str]:
    """The call names a function serves (its ``module_paths`` metadata), ``[]`` when absent."""
    return [path for path in _json_list(props(function).get(MODULE_PATHS)) if isinstance(path, str)]


def body_module_path(function: Any) -> str | None:
    """The module path a function body was written for (its first call), ``None`` when unknown.

    Call nodes inside the body are named relative to this path.
    """
    paths = module_paths(function)
    return strip_call_index(paths[0]) if paths else None


def resolve_module_path(node_name: str, node_module_path: str | None, caller: str | None, body_path: str | None) -> str:
    """The full module path of a call node, resolved through its caller (no call index).

    A body shared by ``h.0`` and ``h.1`` names its nested call nodes relative to itself
    (``attn``) and records the full path of its first call (``h.0.attn``) in the node's
    ``module_path``; under the caller ``h.1`` the call is ``h.1.attn``. A node whose module
    path is not below the body's own (an instance reached through another attribute) keeps
    it. Nodes without the metadata (files of other tools) are named ``caller/node name``.

    The call index is not in the node: a body called twice (``shared``, ``shared@1``) holds
    one ``linear`` node for ``shared.linear`` and ``shared.linear@1``. Count calls per path in
    execution order (:class:`CallCounter`), as torch does.

    Args:
        node_name: The call node's name (``attn``, ``shared@1``).
        node_module_path: Its ``module_path`` metadata (``None`` for files of other tools).
        caller: The full call name of the enclosing call (``None`` in the main graph).
        body_path: :func:`body_module_path` of the enclosing function.
    """
    if node_module_path is None:
        return f"{caller}/{node_name}" if caller else node_name
    if caller is not None and body_path and (
        node_module_path == body_path or node_module_path.startswith(body_path + ".")
    ):
        return strip_call_index(caller) + node_module_path[len(body_path) :]
    return node_module_path


class CallCounter:
    """Call names in execution order: the n-th call of a module path is ``path@n``.

    Names written in the file are exact for a body's first caller (the main graph, and the
    call a shared body was written for): :meth:`name` keeps their index and counts on from it.
    Under a shared body's other callers the index is counted.
    """

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def __call__(self, path: str) -> str:
        index = self._counts.get(path, 0)
        self._counts[path] = index + 1
        return call_name(path, index)

    def name(self, path: str, node_name: str, exact: bool) -> str:
        """The call name of a call node at ``path``; ``exact``: the node name's index is the call's."""
        if not exact:
            return self(path)
        index = split_call_name(node_name)[1]
        self._counts[path] = max(self._counts.get(path, 0), index + 1)
        return call_name(path, index)


def first_call(function: Any) -> str | None:
    """The call name a body was written for (the first of its ``module_paths``)."""
    paths = module_paths(function)
    return paths[0] if paths else None


@dataclasses.dataclass(frozen=True)
class NoOpCall:
    """One entry of :data:`NO_OP_CALLS`: a module call made in a body that produced no ops.

    Attributes:
        name: The call name relative to the body (as call node names are: ``resid_dropout``).
        qualified_class: The module's class.
        position: Calls with functions made in the body before it (its place among them).
        module_path: Full module path of the call under the body's first caller.
        parent: Index of the enclosing no-op call in the same list (-1: made by the body itself).
    """

    name: str
    qualified_class: str
    position: int
    module_path: str
    parent: int = -1

    def to_json(self) -> list:
        return [self.name, self.qualified_class, self.position, self.module_path, self.parent]


def no_op_calls(body: Any) -> list[NoOpCall]:
    """The :class:`NoOpCall` entries recorded in a body's (function or graph) :data:`NO_OP_CALLS`."""
    entries = []
    for entry in _json_list(props(body).get(NO_OP_CALLS)):
        if (
            isinstance(entry, list)
            and len(entry) == 5
            and all(isinstance(item, str) for item in entry[:2] + entry[3:4])
            and all(isinstance(item, int) for item in entry[2:3] + entry[4:])
        ):
            entries.append(NoOpCall(*entry))
    return entries


# -- the expanded calls of a file ----------------------------------------------------------


@dataclasses.dataclass
class ExpandedCall:
    """One module call in a model, with shared bodies expanded under each caller.

    Attributes:
        call_name: Full call name (``h.1.attn``, ``shared@1``).
        node: The call node (``onnx.NodeProto``); ``None`` for a call without ops.
        function: The called function (``onnx.FunctionProto``); ``None`` for a call without ops.
        depth: 1 for calls in the main graph, 2 for calls inside those, ...
        caller: The enclosing call (``None`` in the main graph).
        no_op: The :class:`NoOpCall` entry of a call without ops.
    """

    call_name: str
    node: onnx.NodeProto | None
    function: onnx.FunctionProto | None
    depth: int
    caller: ExpandedCall | None = dataclasses.field(default=None, repr=False)
    no_op: NoOpCall | None = None


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The graphs held by a node's attributes (If/Loop/Scan bodies)."""
    for attribute in node.attribute:  # by field, whatever type the attribute declares (a hostile file may lie)
        if attribute.HasField("g"):
            yield attribute.g
        yield from attribute.graphs


class NoOpCalls:
    """Places a body's recorded no-op calls among its calls with functions, in execution order.

    Call indices count every call of a module path, with or without ops, so walkers of a
    file (the tree, :func:`expanded_calls`, localization) take the no-op calls due before
    each call with a function (:meth:`before_next`) and the rest at the end (:meth:`rest`).
    """

    def __init__(self, body: Any, caller: str | None, body_path: str | None, counter: CallCounter, exact: bool):
        self._entries = no_op_calls(body) if body is not None else []
        self._next = 0
        self._seen = 0
        self._caller, self._body_path, self._counter, self._exact = caller, body_path, counter, exact

    def _take(self, limit: int | None) -> list[tuple[str, NoOpCall]]:
        taken = []
        while self._next < len(self._entries) and (limit is None or self._entries[self._next].position <= limit):
            entry = self._entries[self._next]
            path = resolve_module_path(entry.name, entry.module_path, self._caller, self._body_path)
            taken.append((self._counter.name(path, entry.name, self._exact), entry))
            self._next += 1
        return taken

    def before_next(self) -> list[tuple[str, NoOpCall]]:
        """(call name, entry) of the no-op calls due before the next call with a function."""
        taken = self._take(self._seen)
        self._seen += 1
        return taken

    def rest(self) -> list[tuple[str, NoOpCall]]:
        return self._take(None)


def expanded_calls(
    model: onnx.ModelProto, *, module_calls_only: bool = True, include_no_ops: bool = False
) -> Iterator[ExpandedCall]:
    """Every call of a local function reachable from the main graph, in execution order.

    A function shared by N calls is expanded N times, so this counts calls, not definitions.
    Calls inside If/Loop/Scan subgraphs are included, at the depth of their node. Call
    indices count every call of a module path in execution order, the recorded calls
    without ops included (``include_no_ops`` also yields those, with ``function=None``).
    Works on any ONNX model; ``module_calls_only`` keeps calls of module-call functions
    (torch's helper functions, if any survive, are skipped, their bodies not entered).

    Example::

        names = [call.call_name for call in expanded_calls(onnx.load("m.onnx"))]
    """
    functions = {(f.domain, f.name, f.overload): f for f in model.functions}
    counter = CallCounter()

    def no_op_entries(pending: list[tuple[str, NoOpCall]], caller: ExpandedCall | None, depth: int):
        made: list[ExpandedCall] = []
        for name, entry in pending:
            parent = made[entry.parent] if 0 <= entry.parent < len(made) else None
            call = ExpandedCall(name, None, None, depth if parent is None else parent.depth + 1, parent or caller, entry)
            made.append(call)
            if include_no_ops:
                yield call

    # Frames: (node iterator, caller, depth, body path, the body's no-op calls, owns them,
    # exact: the body runs for the call it was written for, so its node names' indices hold).
    # Subgraph frames share their body's no-op calls; iterative, for deep files.
    root = NoOpCalls(model.graph, None, None, counter, True)
    stack: list[tuple[Iterator[onnx.NodeProto], ExpandedCall | None, int, str | None, NoOpCalls, bool, bool]] = [
        (iter(model.graph.node), None, 1, None, root, True, True)
    ]
    while stack:
        nodes, caller, depth, body_path, no_ops, owner, exact = stack[-1]
        node = next(nodes, None)
        if node is None:
            stack.pop()
            if owner:
                yield from no_op_entries(no_ops.rest(), caller, depth)
            continue
        graphs = list(subgraphs(node))
        for subgraph in reversed(graphs):
            stack.append((iter(subgraph.node), caller, depth, body_path, no_ops, False, exact))
        function = functions.get((node.domain, node.op_type, node.overload))
        if function is None or (module_calls_only and not is_module_function(function)):
            continue
        yield from no_op_entries(no_ops.before_next(), caller, depth)
        module_path = props(node).get(MODULE_PATH)
        caller_name = caller.call_name if caller is not None else None
        name = resolve_module_path(node.name or f"<{node.op_type}>", module_path, caller_name, body_path)
        if module_path is not None:
            name = counter.name(name, node.name, exact)
        call = ExpandedCall(name, node, function, depth, caller)
        yield call
        inner_path = body_module_path(function)
        inner_exact = name == first_call(function)
        inner_no_ops = NoOpCalls(function, name, inner_path, counter, inner_exact)
        stack.append((iter(function.node), call, depth + 1, inner_path, inner_no_ops, True, inner_exact))


def source_path(path: str) -> str:
    """``path`` as a file stores it (``pkg.onnx_modular.source``, torch's stack traces): relative
    to the import root that holds it, the longest ``sys.path`` entry it lies under
    (``transformers/models/gpt2/modeling_gpt2.py`` from site-packages, ``mymodels/net.py`` from
    the project folder), else its file name: never the exporting machine's absolute folders
    (a user's home folder name shipped with their model)."""
    import os
    import sys

    if not path or not os.path.isabs(path):
        return path
    absolute = os.path.normpath(path)
    best = ""
    for entry in sys.path:
        root = os.path.normpath(os.path.abspath(entry or os.getcwd()))
        if absolute.startswith(root.rstrip(os.sep) + os.sep) and len(root) > len(best):
            best = root
    return os.path.relpath(absolute, best).replace(os.sep, "/") if best else os.path.basename(absolute)


def fixed_inputs_prop(fixed: dict) -> str:
    """The :data:`FIXED_INPUTS` value of ``fixed`` (name -> tensor)."""
    described = {}
    for name, tensor in fixed.items():
        entry = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
        if tensor.numel() <= FIXED_VALUES_SHOWN:
            entry["values"] = tensor.detach().cpu().tolist()
        described[name] = entry
    return json.dumps(described)
