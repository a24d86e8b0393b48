"""PyTorch values for the checks: inputs normalized and copied, pytrees flattened, tensors <-> numpy.

torch is imported inside each function, so that importing this module (and
:func:`onnx_modular.verify` without a model) does not import it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

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


def normalize_inputs(args: Any, kwargs: dict | None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` as a tuple and a dict: ``None`` is no positional input, a lone value one."""
    if args is None:
        args = ()
    elif not isinstance(args, tuple):
        args = (args,)
    return args, dict(kwargs or {})


def copy_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Deep copies of the inputs, for runs that may change them (a KV cache grows in place)."""
    try:
        return copy.deepcopy(tuple(args)), copy.deepcopy(dict(kwargs))
    except Exception:  # inputs that cannot be copied are used as they are
        return tuple(args), dict(kwargs)


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
