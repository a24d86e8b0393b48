"""Exporting with weights streamed from a :class:`~onnx_modular.weights.sources.WeightSource`.

Three jobs, none of which holds more than one block of weights at a time:

* :func:`choose_blocks`: the module calls that are loaded, run and checked one at a time
  (the top-most modules holding at most ``max_block_bytes`` of weights).
* :func:`streamed`: run the model in PyTorch with each block's weights loaded just for its
  call (the eager reference of the export); records each block call's outputs.
* :meth:`Stream.attach_pass`: :class:`~onnx_modular.passes.export.attach_weights.AttachWeightsPass`
  gives every initializer of the translated model an ``ir.LazyTensor`` that reads its
  tensor from the source when the file is written. ``ir.save`` writes external data one
  tensor at a time (``onnx_ir.external_data``'s serial writer calls ``tofile`` per tensor),
  so each value lives only while it is written. A weight written as stored (same dtype,
  not folded) is copied from the safetensors file to the external-data file by the kernel
  (``os.copy_file_range``), never read into memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Iterator

import torch

from onnx_modular.capture.call_hooks import call_hooks
from onnx_modular.errors import InvalidInputError
from onnx_modular.passes.export.attach_weights import AttachWeightsPass
from onnx_modular.weights.sources import WeightPlan, materialized

__all__ = ["DEFAULT_BLOCK_FRACTION", "Blocks", "Stream", "check_model_device", "choose_blocks", "streamed"]

logger = logging.getLogger(__name__)

#: Default size of a block: this fraction of all weights (or the largest single module, if larger).
DEFAULT_BLOCK_FRACTION = 0.25


@dataclasses.dataclass
class Blocks:
    """The module paths loaded one at a time, and what the streamed PyTorch run recorded.

    Attributes:
        paths: Block module paths, in module order.
        nbytes: Weight bytes of each block.
        outputs: ``(module path, call index) -> output tensors`` of each block call.
        classes: Module path -> class name.
    """

    paths: list[str]
    nbytes: dict[str, int]
    outputs: dict[tuple[str, int], list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    classes: dict[str, str] = dataclasses.field(default_factory=dict)
    #: ``(module path, call index) -> {forward parameter name: tensor}`` of each block call (a
    #: tuple argument ``position_embeddings`` gives ``position_embeddings_0``, ``_1``, as the
    #: function's inputs are named): the block-wise check feeds each block PyTorch's own inputs.
    inputs: dict[tuple[str, int], dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)

    def __contains__(self, path: str) -> bool:
        return path in self.nbytes


def _tensor_names(module: torch.nn.Module, prefix: str, plan: WeightPlan) -> list[str]:
    dot = f"{prefix}." if prefix else ""
    names = [dot + n for n, _ in module.named_parameters(remove_duplicate=False)]
    names += [dot + n for n, _ in module.named_buffers(remove_duplicate=False)]
    return [n for n in names if n in plan.keys]


def choose_blocks(model: torch.nn.Module, plan: WeightPlan, max_block_bytes: int | None = None) -> Blocks:
    """The top-most modules whose weights fit ``max_block_bytes``.

    Starting from the root, a module whose weights exceed the budget is split into its
    children; modules without weights are not blocks. ``None`` means a quarter of all
    weights, raised to the largest module that owns weights directly (a module cannot
    be split below its own tensors).
    """
    total = plan.nbytes()
    if max_block_bytes is None:
        largest_leaf = max(
            (plan.nbytes(_direct_names(m, p, plan)) for p, m in model.named_modules()),
            default=0,
        )
        max_block_bytes = max(int(total * DEFAULT_BLOCK_FRACTION), largest_leaf)
    paths: list[str] = []
    nbytes: dict[str, int] = {}
    classes: dict[str, str] = {}

    def visit(path: str, module: torch.nn.Module) -> None:
        size = plan.nbytes(_tensor_names(module, path, plan))
        if size == 0:
            return
        if size <= max_block_bytes and path:
            paths.append(path)
            nbytes[path] = size
            classes[path] = type(module).__name__
            return
        for name, child in module.named_children():
            visit(f"{path}.{name}" if path else name, child)

    visit("", model)
    return Blocks(paths, nbytes, classes=classes)


def _direct_names(module: torch.nn.Module, path: str, plan: WeightPlan) -> list[str]:
    dot = f"{path}." if path else ""
    names = [dot + n for n, t in module._parameters.items() if t is not None]
    names += [dot + n for n, t in module._buffers.items() if t is not None]
    return [n for n in names if n in plan.keys]


def _resident_prefixes(model: torch.nn.Module, blocks: Blocks) -> list[str]:
    """Modules outside every block: their own tensors stay loaded for the whole run."""
    outside = []
    for path, _ in model.named_modules():
        if any(path == b or path.startswith(b + ".") for b in blocks.paths):
            continue
        outside.append(path)
    return outside


def _flat_tensors(value) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _named_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    """Copies of the tensors a call receives, by forward parameter name (``name_i`` inside a tuple)."""
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {}
    named: dict[str, torch.Tensor] = {}
    for name, value in bound.arguments.items():
        items = value.items() if isinstance(value, dict) else [(name, value)]
        for key, item in items:
            if isinstance(item, torch.Tensor):
                named[key] = item.detach().clone()
            elif isinstance(item, (tuple, list)):
                for i, element in enumerate(item):
                    if isinstance(element, torch.Tensor):
                        named[f"{key}_{i}"] = element.detach().clone()
    return named


@contextlib.contextmanager
def streamed(model: torch.nn.Module, plan: WeightPlan, blocks: Blocks, *, widen: bool = False) -> Iterator[Blocks]:
    """Within the ``with``, calling ``model`` loads each block's weights just for its call.

    Tensors of modules outside every block are loaded for the whole ``with``. The outputs
    of each block call are recorded in ``blocks.outputs`` (copies, by path and call index).
    ``widen``: bfloat16 weights are loaded as float32 (the reference of the widened check).
    """
    stacks: dict[str, list[contextlib.ExitStack]] = {}

    def load(path: str, index: int, module, args, kwargs) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(materialized(model, plan, [path], widen=widen))
        stacks.setdefault(path, []).append(stack)
        blocks.inputs[(path, index)] = _named_inputs(module, args, kwargs)

    def unload(path: str, index: int, module, args, kwargs, output) -> None:
        stacks[path].pop().close()
        blocks.outputs[(path, index)] = [t.detach().clone() for t in _flat_tensors(output)]

    # Outermost hooks: the block's weights are loaded before the reference run's own hooks
    # record the call, and unloaded after them, even when forward raises.
    try:
        with (
            call_hooks(model, load, unload, paths=blocks.paths, outermost=True),
            materialized(model, plan, _resident_prefixes(model, blocks), recurse=False, widen=widen),
        ):
            yield blocks
    finally:
        for pending in stacks.values():
            while pending:
                pending.pop().close()


class Stream:
    """What ``export_modular(..., weights=...)`` needs: the plan, the blocks, the mode.

    Args:
        model: The model (parameters on ``meta`` or not).
        weights: See :class:`~onnx_modular.weights.sources.WeightSource`.
        verify: ``True`` (block by block when the model has meta tensors, else whole),
            ``"blocks"``, ``"full"`` or ``False``.
        max_block_bytes: Budget of one block (see :func:`choose_blocks`).
    """

    def __init__(self, model: torch.nn.Module, weights, verify: bool | str = True, max_block_bytes: int | None = None):
        from onnx_modular.weights.sources import has_meta_tensors, plan_weights

        if verify not in (True, False, "blocks", "full"):
            raise InvalidInputError(f"verify must be True, False, 'blocks' or 'full', not {verify!r}.")
        self.model = model
        self.plan = plan_weights(model, weights)
        self.blocks = choose_blocks(model, self.plan, max_block_bytes)
        self.blockwise = verify == "blocks" or (verify is True and has_meta_tensors(model))

    def eager(self, *, widen: bool = False):
        """Context for the eager reference run: each block loaded just for its call (``widen``:
        bfloat16 weights as float32, for the reference of a bfloat16 file's widened check)."""
        return streamed(self.model, self.plan, self.blocks, widen=widen)

    def loaders(self) -> dict:
        """State-dict name -> function reading that tensor (for ``program_values``)."""
        return {name: (lambda name=name: self.plan.load(name)) for name in self.plan.keys}

    def attach_pass(self) -> AttachWeightsPass:
        """The pass that makes the translated model's initializers read from the checkpoint."""
        return AttachWeightsPass(self.plan.keys, self.plan.lazy_tensor)


def check_model_device(model: torch.nn.Module) -> None:
    """A model with meta tensors needs ``weights=``."""
    from onnx_modular.weights.sources import has_meta_tensors

    if has_meta_tensors(model):
        raise InvalidInputError(
            f"{type(model).__name__} has parameters or buffers on the meta device, which hold no values.",
            module_path="",
            hint="Pass weights=<safetensors file, shard folder or state dict> to take the values from there.",
        )
