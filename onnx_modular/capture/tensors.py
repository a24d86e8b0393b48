"""PyTorch values for the checks: inputs normalized and copied, pytrees flattened, tensors <-> numpy.

torch is imported inside each function, so that importing this module (and
:func:`onnx_modular.verify` without a model) does not import it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_modular.errors import InvalidInputError
from onnx_modular.format.text import first_line

if TYPE_CHECKING:
    import torch

__all__ = [
    "normalize_inputs",
    "copy_inputs",
    "torch_outputs",
    "flatten_inputs",
    "flatten_outputs",
    "to_numpy",
    "to_torch",
]


def normalize_inputs(args: Any, kwargs: Any, model: Any = None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` as a tuple and a dict, by the one rule of every entry point
    (``export_modular``, ``result.verify``, ``localize``, ``onnx_modular.verify``).

    ``args``: a tuple or a list of positional inputs, one tensor, or ``None`` (no positional
    input). ``kwargs``: a mapping or ``None``. With ``model``, the inputs are bound to its
    ``forward`` signature first, so that a missing or extra input is named here rather than
    raised as a bare ``TypeError`` from inside ``forward()``.

    Raises:
        InvalidInputError: another kind of ``args`` or ``kwargs``, or inputs ``forward`` does not take.
    """
    import inspect

    import torch

    if args is None:
        args = ()
    elif isinstance(args, torch.Tensor):
        args = (args,)
    elif isinstance(args, list):
        args = tuple(args)
    elif not isinstance(args, tuple):
        raise InvalidInputError(
            f"args must be a tuple of positional inputs (or one tensor), not {type(args).__name__}.",
            hint="Pass args=(x,) for one input; keyword inputs go in kwargs={...}.",
        )
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise InvalidInputError(
            f"kwargs must be a dict of keyword inputs, not {type(kwargs).__name__}.", hint="Pass kwargs={'name': x}."
        )
    kwargs = dict(kwargs or {})
    if model is not None:
        try:
            signature = inspect.signature(model.forward)
        except (TypeError, ValueError):  # a builtin forward: nothing to bind against
            return args, kwargs
        try:
            signature.bind(*args, **kwargs)
        except TypeError as e:
            raise InvalidInputError(
                f"The inputs do not match {type(model).__name__}.forward{signature}: {e}",
                module_path="",
                hint="Pass args as a tuple (or list) of positional inputs and kwargs as a dict.",
            ) from None
    return args, kwargs


def copy_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Deep copies of the inputs, for runs that may change them (a KV cache grows in place).

    The caller's objects are never handed to a run. A tensor that is part of an autograd graph
    (a cache built by a forward outside ``torch.no_grad()``) cannot be deep-copied by
    ``copy.deepcopy``; it is copied detached (the checks compute values, not gradients).

    Raises:
        InvalidInputError: an input cannot be copied; it names the input and the reason.
    """
    memo: dict[int, Any] = {}
    keep_alive = []  # ids in the memo stay valid while the originals live
    for tensor in _reachable_tensors((args, kwargs)):
        if tensor.requires_grad and not tensor.is_leaf:
            memo[id(tensor)] = tensor.detach().clone()
            keep_alive.append(tensor)
    copied = []
    for name, value in [*((f"args[{i}]", a) for i, a in enumerate(args)), *dict(kwargs).items()]:
        try:
            copied.append(copy.deepcopy(value, memo))
        except Exception as e:
            raise InvalidInputError(
                f"The input `{name}` ({type(value).__qualname__}) cannot be copied: {type(e).__name__}: "
                f"{first_line(e)}. The model runs on copies so that your objects stay as given.",
                module_path="",
                hint="Pass inputs copy.deepcopy can copy (tensors, lists, dicts, transformers caches).",
            ) from e
    del keep_alive
    return tuple(copied[: len(args)]), dict(zip(kwargs, copied[len(args) :]))


def _reachable_tensors(value: Any, seen: set | None = None, depth: int = 0) -> list[torch.Tensor]:
    """Tensors inside ``value``: through mappings, sequences, sets and objects' attributes
    (``__dict__`` and ``__slots__``), each object visited once."""
    import torch

    seen = set() if seen is None else seen
    if depth > 50 or id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type(None), type)):
        return []
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        children = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        children = list(value)
    else:
        children = list(getattr(value, "__dict__", {}).values())
        for cls in type(value).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if isinstance(slot, str) and hasattr(value, slot):
                    children.append(getattr(value, slot))
    found = []
    for child in children:
        found += _reachable_tensors(child, seen, depth + 1)
    return found


def torch_outputs(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any] | None) -> list[torch.Tensor]:
    """The model's output tensors on copies of the inputs (which it may change, as a cache does)."""
    import torch

    args, kwargs = copy_inputs(args, kwargs or {})
    with torch.no_grad():
        return flatten_outputs(model(*args, **kwargs))


def flatten_inputs(args: Sequence[Any], kwargs: dict[str, Any] | None) -> list[torch.Tensor]:
    """Tensors of (args, kwargs) in the order torch.export makes them graph inputs."""
    import torch

    leaves = torch.utils._pytree.tree_leaves((tuple(args), dict(kwargs or {})))
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def with_fixed(kwargs: dict[str, Any], fixed: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(the file's keyword inputs, PyTorch's)`` for an export with ``fixed_inputs``: the file does
    not take the fixed inputs, PyTorch does (their fixed values when ``kwargs`` leaves them out).

    Raises:
        InvalidInputError: ``kwargs`` gives a fixed input another value than the file holds.
    """
    import torch

    for name, value in fixed.items():
        given = kwargs.get(name)
        if given is not None and not (
            isinstance(given, torch.Tensor) and given.shape == value.shape and torch.equal(given.cpu(), value.cpu())
        ):
            raise InvalidInputError(
                f"The input {name!r} was fixed into the file at export (fixed_inputs), with other values "
                "than the ones given here; the file cannot compute for them.",
                hint=f"Leave {name!r} out (its fixed value is used), or export again for these inputs.",
            )
    return {k: v for k, v in kwargs.items() if k not in fixed}, {**kwargs, **fixed}


def flatten_outputs(outputs: Any) -> list[torch.Tensor]:
    """Tensors of a model's return value, in the order of the ONNX graph outputs."""
    import torch

    return [leaf for leaf in torch.utils._pytree.tree_leaves(outputs) if isinstance(leaf, torch.Tensor)]


def to_numpy(tensor: Any) -> np.ndarray:
    """A torch tensor (bfloat16 included, through ml_dtypes) or array as a numpy array."""
    if isinstance(tensor, np.ndarray) or not hasattr(tensor, "detach"):
        return np.asarray(tensor)
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def to_torch(array: np.ndarray) -> torch.Tensor:
    """An onnxruntime output as a torch tensor (bfloat16 arrives as ml_dtypes' bfloat16)."""
    import torch

    array = np.asarray(array)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array if array.flags.writeable else array.copy())
