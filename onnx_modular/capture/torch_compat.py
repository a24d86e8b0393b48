"""The only module that touches torch's private ONNX exporter API.

torch's public ``torch.onnx.export(dynamo=True)`` always inlines local
functions (its version converter runs an inline pass and ``optimize=True`` inlines
again), so onnx_modular drives the two private stages it needs directly:

* ``_core._prepare_exported_program_for_export`` (decompose), re-done step by step
  here so that :func:`onnx_modular.capture.fx_fixes.relax_view_strides` can run
  between the decomposition and the type-promotion interpreter;
* ``_core._exported_program_to_onnx_program`` (translate).

The hooks into torch.export's own internals that capturing needs (fake-tensor constants,
constraint violations, ``draft_export``, the shape environment) are in
:mod:`onnx_modular.capture.torch_export`: this module is the translator's side only.

Private API can change in any torch release: ``pyproject.toml`` admits torch
``>=2.13,<2.16`` (:data:`ADMITTED_TORCH_VERSIONS`), and where those releases differ this
module branches on :data:`TORCH_VERSION`. Each registry is built as ``torch.onnx.export``
builds it (``_compat.export_compat``): torchlib at the translation opset, then the
``custom_translation_table`` entries through ``ONNXRegistry.register_op``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Callable, Mapping

import onnx_ir as ir
import torch

from onnx_modular.capture import torch_export

__all__ = [
    "ADMITTED_TORCH_VERSIONS",
    "TESTED_TORCH_VERSIONS",
    "TORCH_VERSION",
    "check_torch_version",
    "export_dims",
    "decompose",
    "default_opset",
    "dynamic_axis_names",
    "fx_node_of",
    "registry",
    "torch_dtype_to_ir",
    "translate",
]

#: Releases the test suite ran against (``bash scripts/test-torch.sh <version>``).
TESTED_TORCH_VERSIONS = ("2.13.0", "2.15.0")
#: ``[low, high)`` as (major, minor), the range ``pyproject.toml`` admits.
ADMITTED_TORCH_VERSIONS = ((2, 13), (2, 16))


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


#: The installed torch as (major, minor): what the version branches below test.
TORCH_VERSION = _major_minor(torch.__version__)

logger = logging.getLogger(__name__)


def check_torch_version() -> None:
    """Warn if the installed torch is outside the admitted range (its private API may differ)."""
    low, high = ADMITTED_TORCH_VERSIONS
    if not low <= TORCH_VERSION < high:
        warnings.warn(
            f"onnx_modular supports torch >={low[0]}.{low[1]},<{high[0]}.{high[1]} "
            f"(tested: {', '.join(TESTED_TORCH_VERSIONS)}), found {torch.__version__}. "
            "It uses private torch.onnx internals that may have changed.",
            RuntimeWarning,
            stacklevel=3,
        )


def _exporter():
    from torch.onnx._internal.exporter import _core, _fx_passes, _registration

    return _core, _fx_passes, _registration


def registry(opset_version: int | None = None, custom_translation_table: Mapping[Callable, Callable] | None = None):
    """The registry ``torch.onnx.export`` would translate with, plus library translations.

    Built at ``max(opset_version, 18)``: torchlib picks, per op, the implementation for that
    opset (``Attention`` for SDPA at 23), and below 18 torch translates at 18 and converts
    (:class:`~onnx_modular.passes.export.opset_conversion.ConvertOpsetPass` does that per body). ``custom_translation_table`` entries
    are registered as ``torch.onnx.export`` registers them (they take precedence); ops
    that torch cannot translate but an imported library can (:func:`onnx_modular.capture.library_hooks.translations`;
    transformers' in :mod:`onnx_modular.hf.hooks`) are registered last, only where torch has none.
    """
    from onnx_modular.capture import library_hooks

    opset = max(opset_version or default_opset(), default_opset())
    libraries = tuple(library_hooks.translations().items())
    if not custom_translation_table:
        return _cached_registry(opset, libraries)
    reg = _new_registry(opset)
    for torch_op, onnx_op in custom_translation_table.items():
        if isinstance(onnx_op, (list, tuple)):  # as torch.onnx.export
            raise TypeError("The value in custom_translation_table should be a single callable, not a sequence")
        # register_op keys anything hashable: {1: 2} would be accepted and the export written without it.
        if not isinstance(torch_op, torch._ops.OpOverload | torch._ops.OpOverloadPacket) and not callable(torch_op):
            raise TypeError(f"the key {torch_op!r} is not a torch op (e.g. torch.ops.aten.add.Tensor)")
        if not callable(onnx_op):
            raise TypeError(f"the value for {torch_op!r} is {type(onnx_op).__name__}, not an onnxscript function")
        reg.register_op(torch_op, onnx_op, is_complex=False)
    _fill_gaps(reg, libraries)
    return reg


@functools.lru_cache(maxsize=8)
def _cached_registry(opset: int, libraries: tuple):
    """Cached (building takes ~0.3 s) and never mutated: a custom table gets a registry of its own."""
    reg = _new_registry(opset)
    _fill_gaps(reg, libraries)
    return reg


def _new_registry(opset: int):
    _, _, _registration = _exporter()
    # torchvision ops are registered only when torchvision imports; the warning is noise here.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    return _registration.ONNXRegistry.from_torchlib(opset_version=opset)


def _fill_gaps(reg, libraries: tuple) -> None:
    from onnx_modular.capture import translations

    for torch_op, onnx_op in libraries:
        if not reg.is_registered(torch_op):
            reg.register_op(torch_op, onnx_op, is_complex=False)
    for torch_op, onnx_op, is_complex in translations.translations():  # ops torchlib lacks
        if not any(decomp.is_complex == is_complex for decomp in reg.get_decomps(torch_op)):
            reg.register_op(torch_op, onnx_op, is_complex=is_complex)
    for torch_op, onnx_op in translations.refinements():  # torchlib's refuses some arguments
        reg.register_op(torch_op, onnx_op, is_complex=False)


def default_opset() -> int:
    """The opset torch's translator writes by default (torchlib's, 18)."""
    from torch.onnx._internal.exporter import _constants

    return _constants.TORCHLIB_OPSET


def export_dims(dynamic_shapes):
    """``dynamic_shapes`` for ``torch.export``: axis names (strings) become ``Dim.DYNAMIC``, as in
    ``torch.onnx.export``; Dims, hints and the structure stay as given."""
    from torch.onnx._internal.exporter import _dynamic_shapes

    return _dynamic_shapes.convert_str_to_export_dim(dynamic_shapes)[0]


def decompose(program: torch.export.ExportedProgram, reg) -> torch.export.ExportedProgram:
    """torch's ONNX decompositions, with view strides relaxed before type promotion.

    Mirrors ``_core._prepare_exported_program_for_export``; see
    :mod:`onnx_modular.capture.fx_fixes` for why the extra step is needed. ``reg`` is a
    :func:`registry` (ops it translates, custom ones included, are not decomposed).
    """
    from onnx_modular.capture.fx_fixes import (
        attention_to_4d,
        empty_reshapes,
        relax_view_strides,
        scalars_to_tensors,
        squeeze_only_ones,
    )

    _, _fx_passes, _ = _exporter()
    with (
        torch_export.size_oblivious(),  # as torch does
        _rnn_decompositions(program),
    ):
        program = _fx_passes.decompose_with_registry(program, reg)
        graph_module = program.graph_module
        relax_view_strides(graph_module)
        empty_reshapes(graph_module)
        attention_to_4d(graph_module)
        scalars_to_tensors(graph_module)
        squeeze_only_ones(graph_module)
        _fx_passes.insert_type_promotion_nodes(graph_module)
        graph_module = _fx_passes.remove_assertion_nodes(graph_module)
        program._graph_module = graph_module
    return program


def _rnn_decompositions(program: torch.export.ExportedProgram):
    """torch >= 2.15 decomposes LSTM/GRU into ``while_loop`` when shapes are dynamic, so that the
    sequence length is not specialized to the example's; 2.13 and 2.14 unroll the loop."""
    if TORCH_VERSION >= (2, 15):
        from torch.onnx._internal.exporter import _capture_strategies

        return _capture_strategies.patch_dynamic_shape_rnn_decompositions(program.range_constraints)
    return contextlib.nullcontext()


def translate(program: torch.export.ExportedProgram, reg) -> ir.Model:
    """FX -> ONNX IR with torch's translator. Every ONNX node keeps its FX node in ``meta``.

    The nodes are written at ``reg``'s opset; the default-domain import still says torchlib's
    (torch fixes it with a version converter that inlines): set it with
    :class:`~onnx_modular.passes.export.default_opset.SetDefaultOpsetPass`.
    """
    _core, _, _ = _exporter()
    onnx_program = _core._exported_program_to_onnx_program(program, registry=reg)
    return onnx_program.model


def torch_dtype_to_ir(dtype: torch.dtype) -> ir.DataType:
    """The translator's own dtype table, so that signatures match what it emits."""
    _core, _, _ = _exporter()
    return _core.torch_dtype_to_onnx_dtype(dtype)


def dynamic_axis_names(inputs: list[ir.Value], dynamic_shapes) -> dict[str, str]:
    """``{torch's symbol: the user's axis name}`` for the graph inputs (``s72`` -> ``batch``), for
    :class:`~onnx_modular.passes.export.dynamic_axes.RenameDynamicAxesPass`.

    torch renames only string axes; ``Dim`` objects carry a name too, and torch's own mapping
    function reads both.
    """
    if not dynamic_shapes:
        return {}
    from torch.onnx._internal.exporter import _dynamic_shapes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dict(_dynamic_shapes.create_rename_mapping(inputs, dynamic_shapes))


def fx_node_of(node: ir.Node) -> torch.fx.Node | None:
    """The FX node an ONNX node was translated from (set by torch's translator)."""
    return node.meta.get("node")
