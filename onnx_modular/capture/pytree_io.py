"""The model's inputs and outputs as torch.export sees them: pytree types, names, dynamic shapes.

torch.export flattens ``(args, kwargs)`` and the return value into tensors with
``torch.utils._pytree``. Three things follow for the ONNX file:

* Objects torch cannot flatten stop the export. transformers' KV caches (``DynamicCache``,
  ``EncoderDecoderCache``, ...) are the common case; transformers ships the pytree
  registration itself, and :func:`register_input_types` calls it through
  :mod:`~onnx_modular.capture.library_hooks`.
* torch names graph inputs after its placeholders (``past_key_values_0``) and outputs after
  the last op (``linear_14``). :func:`leaf_names` gives the dotted path of each tensor in the
  model's own structure instead (``past_key_values.layers.0.keys``, ``logits``), the names
  transformers' own ONNX exporter uses.
* ``dynamic_shapes`` must mirror the flattened structure. :func:`expand_dynamic_shapes` lets
  one ``{axis: Dim}`` stand for every tensor of a cache.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from onnx_modular.capture import library_hooks
from onnx_modular.errors import InvalidInputError

__all__ = ["expand_dynamic_shapes", "input_leaf_names", "leaf_names", "output_leaf_names", "register_input_types"]

logger = logging.getLogger(__name__)

#: Values torch.export takes as they are (tensors become inputs, the rest constants).
_PLAIN = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def _is_namedtuple(value: Any) -> bool:
    """A ``collections.namedtuple`` / ``typing.NamedTuple`` instance (not registered by type in
    ``SUPPORTED_NODES``: torch's pytree recognizes them by these attributes)."""
    return isinstance(value, tuple) and hasattr(type(value), "_fields") and hasattr(type(value), "_make")


def _unflattenable(value: Any, path: str, found: list[tuple[str, Any]], depth: int = 0) -> None:
    """Collect ``(path, object)`` for objects in ``value`` that torch's pytree cannot flatten."""
    if isinstance(value, _PLAIN) or depth > 20:
        return
    if _is_namedtuple(value):  # torch's pytree flattens every NamedTuple through its generic entry
        for field in value._fields:
            _unflattenable(getattr(value, field), f"{path}.{field}", found, depth + 1)
        return
    node = pytree.SUPPORTED_NODES.get(type(value))
    if node is None:
        if isinstance(value, torch.nn.Module):
            return  # a module passed as input is torch.export's own error to give
        found.append((path, value))
        return
    if node.flatten_with_keys_fn is not None:  # named as the user wrote it: kwargs.state.0
        for key, child in node.flatten_with_keys_fn(value)[0]:
            _unflattenable(child, _key_path(path, (key,)), found, depth + 1)
        return
    children, _ = node.flatten_fn(value)
    for index, child in enumerate(children):
        _unflattenable(child, f"{path}.{index}", found, depth + 1)


def register_input_types(model: torch.nn.Module, named_values: Mapping[str, Any]) -> None:
    """Make every object in ``named_values`` flattenable by torch.export, or say which is not.

    Model libraries register their types through :mod:`onnx_modular.capture.library_hooks`
    (transformers' caches: :mod:`onnx_modular.hf.hooks`); anything else unknown is an :class:`InvalidInputError`
    naming where it sits.

    Raises:
        InvalidInputError: An input (or output) object torch cannot flatten.
    """

    def unflattenable() -> list[tuple[str, Any]]:
        found: list[tuple[str, Any]] = []
        for name, value in named_values.items():
            _unflattenable(value, name, found)
        return found

    found = unflattenable()
    if found and library_hooks.make_flattenable(model, [value for _, value in found]):
        found = unflattenable()
    if found:
        path, value = found[0]
        raise InvalidInputError(
            f"`{path}` is a {type(value).__module__}.{type(value).__qualname__}, which torch.export "
            "cannot flatten into tensors.",
            module_path="",
            hint="Register the type with torch.utils._pytree.register_pytree_node (or "
            "torch.export.register_dataclass), or pass its tensors directly.",
        )


# -- names ---------------------------------------------------------------------------


def _attribute_paths(value: Any, path: str, paths: dict[int, str], depth: int = 0, seen: set | None = None) -> None:
    """``id(tensor) -> dotted path`` through mappings, sequences and plain objects' attributes."""
    seen = set() if seen is None else seen
    if depth > 20 or id(value) in seen:
        return
    seen.add(id(value))  # objects that refer back to each other are walked once
    if isinstance(value, torch.Tensor):
        paths.setdefault(id(value), path)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _attribute_paths(item, f"{path}.{key}", paths, depth + 1, seen)
    elif _is_namedtuple(value):
        for key in value._fields:
            _attribute_paths(getattr(value, key), f"{path}.{key}", paths, depth + 1, seen)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _attribute_paths(item, f"{path}.{index}", paths, depth + 1, seen)
    elif hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type)):
        for key, item in vars(value).items():
            if not key.startswith("_"):
                _attribute_paths(item, f"{path}.{key}", paths, depth + 1, seen)


def _key_path(prefix: str, keys: tuple) -> str:
    parts = [prefix]
    for key in keys:
        if isinstance(key, pytree.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, pytree.MappingKey):
            parts.append(str(key.key))
        elif isinstance(key, pytree.GetAttrKey):
            parts.append(key.name)
        else:
            parts.append(str(key).strip(".[]'\""))
    return ".".join(part for part in parts if part)


def leaf_names(named_values: list[tuple[str, Any]]) -> list[str]:
    """Dotted names of the tensors of ``named_values``, in torch's flattening order.

    A tensor is named by its attribute path when it has one (``past_key_values.layers.0.keys``
    rather than the cache's flattened index), else by its pytree key path.

    Example::

        leaf_names([("input_ids", ids), ("past_key_values", cache)])
        # ['input_ids', 'past_key_values.layers.0.keys', 'past_key_values.layers.0.values', ...]
    """
    names: list[str] = []
    for prefix, value in named_values:
        paths: dict[int, str] = {}
        _attribute_paths(value, prefix, paths)
        for keys, leaf in pytree.tree_flatten_with_path(value)[0]:
            if isinstance(leaf, torch.Tensor):
                name = paths.get(id(leaf))
                if name is None or name in names:  # one tensor twice (return y, y): its place, not its first path
                    name = _key_path(prefix, keys)
                names.append(name)
    return names


def _bound_inputs(model: torch.nn.Module, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """``(forward parameter name, value)`` in the order torch.export flattens ``(args, kwargs)``."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = []
    for index, value in enumerate(args):
        named.append((positional[index] if index < len(positional) else f"args.{index}", value))
    named.extend(kwargs.items())
    return named


def input_leaf_names(model: torch.nn.Module, args: tuple, kwargs: dict) -> list[str]:
    """Names of the tensors of ``(args, kwargs)``: forward()'s parameter names, dotted inside."""
    return leaf_names(_bound_inputs(model, args, kwargs))


def output_leaf_names(outputs: Any) -> list[str]:
    """Names of the tensors ``forward`` returned: ``output`` for a lone tensor, ``output.0``
    for tuple items, the keys of a dict or ``ModelOutput`` (``logits``), the fields of a NamedTuple (``y``)."""
    if isinstance(outputs, Mapping):
        return leaf_names(list(outputs.items()))
    if _is_namedtuple(outputs):
        return leaf_names([(field, getattr(outputs, field)) for field in outputs._fields])
    return leaf_names([("output", outputs)])


def check_outputs(outputs: Any) -> None:
    """Refuse a return value with no tensor, or with values ONNX cannot output (str, int, ...).

    ``None`` inside a container is allowed (torch.export drops it).
    """
    leaves = pytree.tree_flatten_with_path(outputs)[0]
    for keys, leaf in leaves:
        if not isinstance(leaf, torch.Tensor) and leaf is not None:
            where = _key_path("output", keys)
            shown = repr(leaf)
            raise InvalidInputError(
                f"forward() returned a value of type {type(leaf).__name__} at {where} ({shown[:60]}{'...' if len(shown) > 60 else ''}); "
                "ONNX outputs can only be tensors.",
                module_path="",
                hint="Return tensors only (in tuples, lists or dicts): wrap numbers with torch.tensor(...) or drop them.",
            )
    if not any(isinstance(leaf, torch.Tensor) for _, leaf in leaves):
        raise InvalidInputError(
            f"forward() returned {type(outputs).__name__ if outputs is not None else 'None'}, with no tensor in it: "
            "the ONNX model would have no output.",
            module_path="",
            hint="Return the tensors the model computes.",
        )


# -- dynamic shapes ------------------------------------------------------------------


def _is_axes_spec(spec: Any) -> bool:
    return isinstance(spec, dict) and bool(spec) and all(isinstance(axis, int) for axis in spec)


def _spread(spec: dict[int, Any], value: Any) -> Any:
    """``spec`` for every tensor of ``value`` (of high enough rank), mirroring its pytree."""
    if isinstance(value, torch.Tensor):
        return spec if value.dim() > max(spec) else None
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_spread(spec, item) for item in value)
    if type(value) is dict:
        return {key: _spread(spec, item) for key, item in value.items()}
    node = pytree.SUPPORTED_NODES.get(type(value))
    if node is not None:
        children, _ = node.flatten_fn(value)
        return [_spread(spec, child) for child in children]
    return None


def expand_dynamic_shapes(model: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> Any:
    """Let one ``{axis: Dim}`` given for a non-tensor input apply to each of its tensors.

    ``dynamic_shapes={"past_key_values": {0: batch, 2: past}}`` becomes the per-tensor list
    torch.export wants for the flattened cache. Anything else is returned as it is.
    """
    if not dynamic_shapes:
        return dynamic_shapes
    named = _bound_inputs(model, args, kwargs)
    if isinstance(dynamic_shapes, dict):
        values = dict(named)
        return {
            key: _spread(spec, values[key])
            if key in values and _is_axes_spec(spec) and not isinstance(values[key], torch.Tensor)
            else spec
            for key, spec in dynamic_shapes.items()
        }
    if isinstance(dynamic_shapes, (list, tuple)) and len(dynamic_shapes) == len(named):
        return type(dynamic_shapes)(
            _spread(spec, value) if _is_axes_spec(spec) and not isinstance(value, torch.Tensor) else spec
            for spec, (_, value) in zip(dynamic_shapes, named)
        )
    return dynamic_shapes
