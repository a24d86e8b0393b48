"""Eager recording: run the model once in PyTorch and record every module call.

The run gives the reference outputs of the export and, per module call, the tensors that
``forward()`` received (bound to its parameter names) and returned (named from the return
structure). :class:`~onnx_modular.passes.export.outline_calls.OutlineModuleCallsPass` names the formal
inputs and outputs of each function from these records (docs/design.md, "Naming formal
inputs and outputs").

Names of the recorded tensors:

* inputs: the parameter name (``hidden_states``); items of a tuple or list parameter get
  ``_<index>``, of a dict ``_<key>``, other containers (a KV cache) ``_<n>`` in pytree order;
* outputs: ``output`` for a single tensor, ``output_0``, ``output_1``, ... for a tuple or list,
  the key for a dict or ``ModelOutput`` (``last_hidden_state``), nested items as for inputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import operator
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from onnx_modular.capture import tensors, torch_compat, torch_export
from onnx_modular.capture.call_hooks import call_hooks
from onnx_modular.passes.export.signatures import CallSignature, TensorSpec

__all__ = ["kept_as_given", "run", "tensor_specs", "output_specs", "lazy_values", "program_values"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def kept_as_given(model: torch.nn.Module) -> Iterator[Callable[[], None]]:
    """Give ``model`` back as it was when the block ends, normally or not: every module's
    training flag, parameter and buffer objects, and the buffers' values.

    Running a model in training mode updates its buffers (BatchNorm's ``running_mean``,
    ``num_batches_tracked``), and so does a forward that updates its own state (a ring buffer
    and its write pointer, ``buf.index_copy_(0, ptr, x); ptr.add_(1)``); the export runs it
    (eager reference, torch.export), so the buffers are copied first (parameters are not copied:
    forward does not change them, and they are the bulk of the memory).

    Yields:
        ``restore()``: puts the state back now (the export calls it after the eager reference
        run, so that torch.export captures the buffers the reference started from).
    """
    modules = list(model.modules())
    flags = [module.training for module in modules]
    parameters = [dict(module._parameters) for module in modules]
    buffers = [dict(module._buffers) for module in modules]
    values = {
        id(buffer): buffer.detach().clone()
        for held in buffers
        for buffer in held.values()
        if isinstance(buffer, torch.Tensor) and not buffer.is_meta
    }

    def restore() -> None:
        with torch.no_grad():
            for module, training, params, bufs in zip(modules, flags, parameters, buffers):
                module.training = training
                module._parameters.clear()
                module._parameters.update(params)
                module._buffers.clear()
                module._buffers.update(bufs)
                for buffer in bufs.values():
                    saved = values.get(id(buffer)) if isinstance(buffer, torch.Tensor) else None
                    if saved is None or torch.equal(buffer, saved):
                        continue
                    if buffer.shape == saved.shape and buffer.dtype == saved.dtype:
                        buffer.copy_(saved)
                    else:
                        buffer.data = saved.clone()

    try:
        yield restore
    finally:
        restore()


def unaliased(model: torch.nn.Module, outputs: Any) -> Any:
    """``outputs`` with every tensor that shares storage with one of ``model``'s buffers copied:
    putting the buffers back (``restore()`` of :func:`kept_as_given`) must not change the
    reference (a forward that returns the ring buffer it just wrote)."""
    held = {b.untyped_storage().data_ptr() for b in model.buffers() if isinstance(b, torch.Tensor) and not b.is_meta}
    if not held:
        return outputs

    def aliases(value: Any) -> bool:
        return isinstance(value, torch.Tensor) and not value.is_meta and value.untyped_storage().data_ptr() in held

    if not any(aliases(leaf) for leaf in torch.utils._pytree.tree_leaves(outputs)):
        return outputs  # the usual case: the outputs are left as they are (a cache object included)
    return torch.utils._pytree.tree_map(lambda value: value.detach().clone() if aliases(value) else value, outputs)


def tensor_specs(prefix: str, value: Any) -> list[TensorSpec]:
    """Specs of the tensors in ``value``, each holding its tensor (dropped later unless needed)."""
    specs: list[TensorSpec] = []
    if isinstance(value, torch.Tensor):
        specs.append(TensorSpec(prefix, torch_compat.torch_dtype_to_ir(value.dtype), tuple(value.shape), value))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            specs += tensor_specs(f"{prefix}_{i}", item)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            specs += tensor_specs(f"{prefix}_{key}", item)
    else:
        leaves = torch.utils._pytree.tree_leaves(value)
        for i, leaf in enumerate(leaf for leaf in leaves if isinstance(leaf, torch.Tensor)):
            specs.append(TensorSpec(f"{prefix}_{i}", torch_compat.torch_dtype_to_ir(leaf.dtype), tuple(leaf.shape), leaf))
    return specs


def output_specs(output: Any) -> list[TensorSpec]:
    """Specs of what forward() returned: ``output``, ``output_0``..., or the keys of a mapping."""
    if isinstance(output, Mapping):  # dict, transformers' ModelOutput (an OrderedDict)
        specs: list[TensorSpec] = []
        for key, item in output.items():
            specs += tensor_specs(str(key), item)
        return specs
    return tensor_specs("output", output)


def _keep_values_where_ambiguous(specs: list[TensorSpec]) -> list[TensorSpec]:
    """Keep a copy of a tensor only when another one of the call has the same dtype and shape."""
    counts: dict[tuple, int] = {}
    for spec in specs:
        counts[(spec.dtype, spec.shape)] = counts.get((spec.dtype, spec.shape), 0) + 1
    return [
        dataclasses.replace(spec, value=spec.value.detach().clone() if counts[(spec.dtype, spec.shape)] > 1 else None)
        for spec in specs
    ]


def run(model: torch.nn.Module, args: tuple, kwargs: dict):
    """Run the model once in PyTorch, recording every module call and its tensors.

    Calls are keyed by module *instance* and its n-th call: one instance can be reached
    under several attribute paths, and torch.export names each call by the path used,
    which :func:`onnx_modular.capture.fx_call_tree.build_call_tree` resolves. An exception of the
    model propagates unchanged (the caller wraps it in a ``CaptureError``).

    Returns:
        (outputs, signatures per (id(instance), n), calls in order as
        (id(instance), n, first module path, parent (id, n) or None)).

    Example::

        outputs, signatures, calls = run(model, (input_ids,), {})
    """
    signatures: dict[tuple[int, int], CallSignature] = {}
    calls: list[tuple[int, int, str, tuple[int, int] | None]] = []
    active: list[tuple[int, int]] = []
    pending: dict[tuple[int, int], tuple[list[TensorSpec], tuple[str, ...]]] = {}
    parameters: dict[str, inspect.Signature | None] = {}

    def pre(path: str, index: int, module: torch.nn.Module, hook_args: tuple, hook_kwargs: dict) -> None:
        if path not in parameters:
            try:
                parameters[path] = inspect.signature(module.forward)
            except (TypeError, ValueError):
                parameters[path] = None
        specs, absent = _input_specs(parameters[path], hook_args, hook_kwargs)
        pending[(id(module), index)] = (_keep_values_where_ambiguous(specs), absent)
        calls.append((id(module), index, path, active[-1] if active else None))
        active.append((id(module), index))

    def post(path: str, index: int, module: torch.nn.Module, hook_args: tuple, hook_kwargs: dict, output: Any) -> None:
        specs, absent = pending.pop((id(module), index))
        active.pop()
        outputs = _keep_values_where_ambiguous(output_specs(output))
        signatures[(id(module), index)] = CallSignature(specs, outputs, absent)

    # eager_control_flow: torch.cond branches run eagerly, so the hooks may record inside them
    with call_hooks(model, pre, post), torch.no_grad(), torch_export.eager_control_flow():
        outputs = model(*args, **kwargs)
    return outputs, signatures, calls


def _input_specs(parameters: inspect.Signature | None, args: tuple, kwargs: dict) -> tuple[list[TensorSpec], tuple[str, ...]]:
    """Specs of the tensors a call received, by forward()'s parameter names, and the parameters that were None."""
    specs: list[TensorSpec] = []
    absent: list[str] = []
    try:
        bound = parameters.bind(*args, **kwargs) if parameters else None
    except TypeError:
        bound = None
    if bound is not None:
        for name, parameter in parameters.parameters.items():
            if parameter.kind == inspect.Parameter.VAR_KEYWORD:
                for key, item in bound.arguments.get(name, {}).items():
                    specs += tensor_specs(key, item)
                    if item is None:
                        absent.append(key)
            elif name in bound.arguments:
                specs += tensor_specs(name, bound.arguments[name])
                if bound.arguments[name] is None:
                    absent.append(name)
            elif parameter.default is None:
                absent.append(name)  # not passed, so None
    return specs, tuple(absent)


def lazy_values(
    program: torch.export.ExportedProgram, args: tuple, kwargs: dict, loaders: dict | None = None
) -> Callable[[str], Any]:
    """``value_of(name)``: runs the program on the example inputs the first time it is asked.

    Only calls with several inputs (or outputs) of equal dtype and shape ask, so most
    exports never pay for the run. ``loaders`` (weights streamed from a checkpoint): parameters
    are read as ops use them (:func:`program_values`).
    """
    cache: dict[str, Any] | None = None

    def value_of(name: str) -> Any:
        nonlocal cache
        if cache is None:
            try:
                cache = program_values(program, *tensors.copy_inputs(args, kwargs), loaders)
            except Exception as e:  # names stay unresolved; the export itself is unaffected
                logger.info("Could not evaluate the program to resolve equal-shaped inputs: %s", e)
                cache = {}
        return cache.get(name)

    return value_of


def program_values(
    program: torch.export.ExportedProgram, args: tuple, kwargs: dict, loaders: dict | None = None
) -> dict[str, object]:
    """Run the (decomposed) program on real inputs; every FX node's result by node name.

    Uses the public ExportedProgram signature and ``torch.fx.Interpreter``. With
    ``loaders`` (state-dict name -> function returning the tensor), parameters are read
    when an op uses them and dropped after it, and only values that depend on the user
    inputs are recorded, so that weights are never all in memory at once.
    """
    from torch.export.graph_signature import InputKind

    leaves = iter(torch.utils._pytree.tree_leaves((tuple(args), dict(kwargs))))
    state = program.state_dict
    flat = []
    for spec in program.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            flat.append(next(leaves))
        elif loaders is not None and spec.target in loaders:
            flat.append(_Load(loaders[spec.target]))
        elif spec.target in state:
            flat.append(state[spec.target])
        else:
            flat.append(program.constants[spec.target])
    values: dict[str, object] = {}
    user_inputs = {
        node.name
        for node, spec in zip(program.graph.find_nodes(op="placeholder"), program.graph_signature.input_specs)
        if spec.kind == InputKind.USER_INPUT
    }
    depends: set[str] = set()
    crossing = _crossing(program.graph)

    class _Recorder(torch.fx.Interpreter):
        def fetch_args_kwargs_from_env(self, n):
            args_, kwargs_ = super().fetch_args_kwargs_from_env(n)
            if loaders is None:
                return args_, kwargs_
            return torch.utils._pytree.tree_map(lambda v: v() if isinstance(v, _Load) else v, (args_, kwargs_))

        def run_node(self, node):
            result = super().run_node(node)
            if loaders is not None:
                if node.name in user_inputs or any(i.name in depends for i in node.all_input_nodes):
                    depends.add(node.name)
                else:
                    return result  # a function of the weights alone: not recorded
            if crossing is not None and node.name not in crossing:
                return result  # a module's inner value (an attention's scores): never a call's input or output
            if isinstance(result, (tuple, list)):
                for i, item in enumerate(result):
                    values[f"{node.name}__{i}"] = item
            values[node.name] = result
            return result

    with torch.no_grad():
        _Recorder(program.graph_module).run(*flat)
    return values


def _crossing(graph: torch.fx.Graph) -> set[str] | None:
    """The nodes whose values cross a module boundary (a user in another module, a graph output,
    an input): the only values a call's inputs and outputs are made of. SegGpt's program holds
    10 GB of values inside its attentions; recording them all was the export's peak. ``None``
    when the program names no module (every value is then recorded)."""

    def stack(node: torch.fx.Node) -> tuple:
        return tuple((node.meta.get("nn_module_stack") or {}).keys())

    if not any(node.meta.get("nn_module_stack") for node in graph.nodes):
        return None
    found = set()
    for node in graph.nodes:
        mine = stack(node)
        users = list(node.users)
        if node.op == "placeholder" or any(u.op == "output" or stack(u) != mine for u in users):
            found.add(node.name)
    for node in reversed(list(graph.nodes)):  # a tuple whose item crosses: its items are recorded by the tuple's name too
        if node.op == "call_function" and node.target is operator.getitem and node.name in found:
            found.add(node.args[0].name)
    return found


class _Load:
    """A parameter read only when an op uses it (see :func:`program_values`)."""

    __slots__ = ("load",)

    def __init__(self, load):
        self.load = load

    def __call__(self):
        return self.load()
