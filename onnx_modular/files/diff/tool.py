"""Two ONNX files compared module call by module call: structure, numerics and time.

``diff(a, b)`` matches the calls of the two files' call trees
(:func:`~onnx_modular.calls.tree.function_tree`) by call name (module path and call index) and
class, and says for each call:

* structure: ``same``, ``changed``, ``added`` or ``removed``. A call is changed in its *own*
  body (nodes added or removed, op types, attributes, wiring, opset, the values of the weights
  its own nodes read, compared by hash) or only *below* it (its body is the same, a call it
  makes changed): ``changed_in`` is ``"own"`` or ``"below"``. Bodies are compared as computations,
  not by name: values are numbered in order of use, a call node counts by its module's class,
  and the weights a call only passes down are its callees' concern, so a body that ``replace``
  renamed or threaded a new weight through is not changed in its own right. A function name that
  differs (``GPT2Block`` -> ``GPT2Block_2``) is said, and is not by itself a change.
* numerics: both files run once in onnxruntime on the same inputs (given, or random from the
  declared input types, seed 0) with every call's outputs captured
  (:func:`~onnx_modular.calls.capture.paired_calls`, a batch at a time); per call the largest absolute and relative
  difference of its outputs (:func:`~onnx_modular.check.parity.max_differences`), the first call
  in execution order whose outputs differ, and the calls ranked by the drift they add
  (:attr:`CallDiff.added_drift`).
* time (``profile=True``): each call's inclusive kernel time in both files
  (:func:`~onnx_modular.profiling.run.profile`) and the ratio.

Weights are hashed where they are: inline bytes from the parsed file, external data read in
chunks from the byte range each tensor names (never a whole data file at once). Views: the
terminal tree (``str(result)``), a JSON list of call records, a self-contained HTML page with
the two trees side by side (:mod:`onnx_modular.files.diff.views`). No torch.

Example::

    result = onnx_modular.diff("gpt2.onnx", "gpt2.edited.onnx")
    print(result.format(max_depth=3))
    result.save(json="diff.json", html="diff.html")

This module is the tool: loading the two files, matching their calls, building the merged tree.
The result types are :mod:`~onnx_modular.files.diff.result`; bodies compared as computations,
:mod:`~onnx_modular.calls.bodies`; running and timing both files,
:mod:`~onnx_modular.files.diff.numerics`.
"""

from __future__ import annotations

import collections
import os
import pathlib
from collections.abc import Mapping

import numpy as np
import onnx

from onnx_modular.calls.bodies import Body, Tensors, body_of, compare, tensor_digest
from onnx_modular.calls.flat import inline_model
from onnx_modular.calls.tree import function_tree, weight_sources
from onnx_modular.errors import InvalidInputError
from onnx_modular.files.diff.numerics import call_drift, feeds_for_both, output_drift, times
from onnx_modular.files.diff.result import CHANGES, CallDiff, ModelDiff
from onnx_modular.format import metadata
from onnx_modular.format.calltree import CallTree, ModuleCall
from onnx_modular.format.scopes import enclosing_modules
from onnx_modular.format.text import shown
from onnx_modular.runtime.inputs import model_inputs
from onnx_modular.storage.checks import check_expanded_size
from onnx_modular.storage.limits import check_count
from onnx_modular.storage.load import load_model_file
from onnx_modular.storage.proto import function_id

__all__ = ["diff", "ModelDiff", "CallDiff", "CHANGES", "tensor_digest"]


# -- one file ----------------------------------------------------------------------------------


class _File:
    """One side: the model (structure and inline weights), its tree, bodies and tensors."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self.model = load_model_file(path)  # checked; external data stays on disk
        check_expanded_size(self.model, name=repr(self.path))
        self.tree = function_tree(self.model)
        self.functions = {function_id(f): f for f in self.model.functions}
        self.scopes = weight_sources(self.model)
        self.folder = pathlib.Path(os.path.dirname(os.path.abspath(self.path)))
        self.tensors = Tensors(self.model, self.folder, repr(self.path))
        self._bodies: dict[str, Body] = {}
        self.by_module = False

    def compare_by_module(self) -> None:
        """Compare by the module each node carries in its metadata (``pkg.onnx_modular.module_path``),
        as a flat copy is labelled (:func:`onnx_modular.calls.flat.inline_model`): one pseudo-call
        per module path, its own nodes as its body, nested by path. A file with functions is
        inlined first (a copy, labelled the same way)."""
        flat = self.model
        if self.model.functions:
            flat = onnx.ModelProto()
            flat.CopyFrom(self.model)
            flat = inline_model(flat)
        groups: dict[str, list[onnx.NodeProto]] = {}
        classes: dict[str, str] = {}
        order: dict[str, int] = {"": 0}  # module paths in order of first appearance, outer ones first
        for node in flat.graph.node:
            props = metadata.props(node)
            path = props.get(metadata.MODULE_PATH, "")
            groups.setdefault(path, []).append(node)
            for outer, outer_class in enclosing_modules(props, path):
                order.setdefault(outer, len(order))
                if outer_class:
                    classes.setdefault(outer, outer_class)
            order.setdefault(path, len(order))
            if path and props.get(metadata.CLASS):
                classes.setdefault(path, props[metadata.CLASS])
        if len(groups) <= 1 and "" in groups:
            raise InvalidInputError(
                f"{self.path!r} has no local functions, and its nodes carry no module paths "
                f"({metadata.MODULE_PATH}): there is nothing to match module calls by.",
                hint="Compare files written by onnx_modular (export_modular, or their flat copies: "
                "`onnx-modular inline`, export_modular(flat_file=True)); for any two files, compare the "
                "outputs with `onnx-modular verify FILE --expected OUT.npz`.",
            )
        root = ModuleCall(key="", module_path="", node_name=flat.graph.name or "main_graph", num_nodes=len(groups.get("", [])))
        made = {"": root}
        for path in sorted(p for p in order if p):  # a prefix sorts before the paths below it
            parent_path = path
            while parent_path and (parent_path == path or parent_path not in made):
                parent_path = parent_path.rpartition(".")[0]
            parent = made[parent_path]
            call = ModuleCall(key=path, module_path=path, qualified_class=classes.get(path, ""), parent=parent,
                              num_nodes=len(groups.get(path, [])), node_name=path)
            parent.children.append(call)
            made[path] = call
        for call in made.values():
            call.children.sort(key=lambda child: order[child.module_path])
        self.tree = CallTree(root)
        opsets = {o.domain: o.version for o in flat.opset_import}
        weights = {name: name for name in self.tensors.by_name}
        inputs = [v.name for v in model_inputs(flat)]
        for path in order:
            outputs = [v.name for v in flat.graph.output] if not path else []
            self._bodies[path] = body_of(
                groups.get(path, []), inputs if not path else [], outputs, weights, {}, opsets, self.tensors
            )
        self.by_module = True

    def body(self, call: ModuleCall) -> Body | None:
        if self.by_module:
            return self._bodies.get(call.module_path)
        if call.is_root:
            key = ""
        elif call.function is None:
            return None
        else:
            key = call.call_name
        if key not in self._bodies:
            opsets = {o.domain: o.version for o in self.model.opset_import}
            if call.is_root:
                graph = self.model.graph
                self._bodies[key] = body_of(
                    graph.node, [v.name for v in model_inputs(self.model)], [v.name for v in graph.output],
                    self.scopes[""], self.functions, opsets, self.tensors,
                )
            else:
                function = self.functions[(call.function[0], call.function[1], call.overload)]
                own = {o.domain: o.version for o in function.opset_import} or opsets
                self._bodies[key] = body_of(
                    function.node, list(function.input), list(function.output), self.scopes.get(call.call_name, {}),
                    self.functions, own, self.tensors, function_id(function),
                )
        return self._bodies[key]


# -- matching ----------------------------------------------------------------------------------


def _key(call: ModuleCall) -> tuple[str, str]:
    return (call.call_name, call.qualified_class)


def _merge(a: ModuleCall | None, b: ModuleCall | None, parent: CallDiff | None, file_a: _File, file_b: _File) -> CallDiff:
    call = b or a
    path = "" if call.is_root else call.call_name
    if a is None or b is None:
        node = CallDiff(path, call.qualified_class, "added" if a is None else "removed", a, b, parent=parent)
        node.children = [_merge(None if a is None else c, c if a is None else None, node, file_a, file_b) for c in call.children]
        return node
    node = CallDiff(path, call.qualified_class, "same", a, b, parent=parent)
    in_b = {_key(c): c for c in b.children}
    in_a = {_key(c): c for c in a.children}
    removed_after: dict[tuple[str, str] | None, list[ModuleCall]] = collections.defaultdict(list)
    previous = None
    for child in a.children:
        if _key(child) in in_b:
            previous = _key(child)
        else:
            removed_after[previous].append(child)
    children = [_merge(c, None, node, file_a, file_b) for c in removed_after[None]]
    for child in b.children:
        children.append(_merge(in_a.get(_key(child)), child, node, file_a, file_b))
        if _key(child) in in_a:
            children += [_merge(c, None, node, file_a, file_b) for c in removed_after.get(_key(child), [])]
    node.children = children
    body_a, body_b = file_a.body(a), file_b.body(b)
    if (body_a is None) != (body_b is None):
        own = ["no ops -> a function" if body_a is None else "a function -> no ops"]
    elif body_a is None:
        own = []
    else:
        own = compare(body_a, body_b, file_a.tensors, file_b.tensors)
    below = list(dict.fromkeys(c.path for c in children if c.change != "same"))
    if own or below:
        node.change = "changed"
        node.changed_in = "own" if own else "below"
        node.what = own + ([f"calls below changed: {', '.join(shown(p) for p in below)}"] if below else [])
        if not a.is_root and a.function is not None and b.function is not None and node.function_a != node.function_b:
            node.what.append(f"body: {node.function_a} -> {node.function_b}")
    return node


# -- the tool ----------------------------------------------------------------------------------


def diff(
    a: str | os.PathLike,
    b: str | os.PathLike,
    *,
    inputs: str | os.PathLike | Mapping[str, np.ndarray] | None = None,
    numerics: bool = True,
    profile: bool = False,
    runs: int = 10,
    threads: int | None = 1,
    seed: int = 0,
) -> ModelDiff:
    """Compare two ONNX files module call by module call: structure, numerics and (``profile``) time.

    Args:
        a, b: The two ``.onnx`` files (A the reference, B the one compared with it), each with
            local functions (a modular export; any file whose functions call each other).
        inputs: The inputs both files run on: an ``.npz`` file or arrays by name; random from A's
            declared input types by default (``seed``; symbolic dims 2, masks all ones).
        numerics: Run both files (every call's outputs captured); ``False``: structure only.
        profile: Also time every call in both files (onnxruntime's profiler, ``runs`` runs in all,
            in 3 rounds that alternate the files, each after 2 warm-up runs; ``threads`` intra-op
            threads: one by default, as repeated ratios on a shared machine agree best that way).
        seed: Seed of the random inputs.

    Returns:
        The merged call tree with each call's verdict, drift and times (:class:`ModelDiff`;
        ``result.differs`` is what the command's exit code says).

    Raises:
        InvalidModelFileError: A file cannot be read (missing, not ONNX, truncated, external data
            missing or outside its folder).
        InvalidInputError: A file without local functions or module paths on its nodes; files whose
            inputs differ (which input, and how; floating-point types may differ: B gets the same
            values cast to its type); given inputs that do not fit.
        VerificationError: onnxruntime cannot run a file.

    Example::

        result = diff("gpt2.onnx", "gpt2.fp16.onnx")
        print(result.first_drift.path, [c.path for c in result.ranked(3)])
    """
    if profile and isinstance(runs, int) and not isinstance(runs, bool):
        check_count("MAX_RUNS", runs, "--runs, the measured runs of the profile")  # before any work
    file_a, file_b = _File(a), _File(b)
    note = None
    if not file_a.model.functions or not file_b.model.functions:
        for file in (file_a, file_b):
            file.compare_by_module()
        note = (
            "compared by the module path on each node (a file has no local functions): modules, not calls "
            "(no call index); drift of the model outputs only"
        )
    root = _merge(file_a.tree.root, file_b.tree.root, None, file_a, file_b)
    result = ModelDiff(
        str(a), str(b), root, random_inputs=inputs is None, seed=seed, numerics=numerics, note=note,
        by_module=note is not None,
    )
    if numerics or profile:
        feeds, feeds_b = feeds_for_both(file_a, file_b, inputs, seed)
        result.inputs = {name: {"shape": list(x.shape), "dtype": str(x.dtype)} for name, x in feeds.items()}
        result.cast = {name: str(x.dtype) for name, x in feeds_b.items() if x.dtype != feeds[name].dtype}
        if numerics and note is not None:
            output_drift(root, file_a, file_b, feeds, feeds_b)
        elif numerics:
            call_drift(root, file_a, file_b, feeds, feeds_b)
        if profile:
            result.settings = times(root, file_a, file_b, feeds, feeds_b, runs, threads)
    return result
