"""The only module that touches torch's private ONNX exporter API.

torch 2.13's public ``torch.onnx.export(dynamo=True)`` always inlines local
functions (its version converter runs an inline pass and ``optimize=True`` inlines
again), so onnx_modular drives the two private stages it needs directly:

* ``_core._prepare_exported_program_for_export`` (decompose), re-done step by step
  here so that :func:`onnx_modular.passes.relax_views.relax_view_strides` can run
  between the decomposition and the type-promotion interpreter;
* ``_core._exported_program_to_onnx_program`` (translate).

Private API can change in any torch release, so the tested versions are pinned.
"""

from __future__ import annotations

import functools
import logging
import warnings

import onnx_ir as ir
import torch

__all__ = [
    "TESTED_TORCH_VERSIONS",
    "check_torch_version",
    "capture",
    "decompose",
    "translate",
    "add_opset_imports",
    "default_opset",
    "fx_node_of",
    "program_values",
    "rename_dynamic_axes",
    "torch_dtype_to_ir",
]

TESTED_TORCH_VERSIONS = ("2.13.0",)

logger = logging.getLogger(__name__)


def check_torch_version() -> None:
    """Warn once if the installed torch is not a tested version."""
    base = torch.__version__.split("+")[0]
    if base not in TESTED_TORCH_VERSIONS:
        warnings.warn(
            f"onnx_modular was tested with torch {', '.join(TESTED_TORCH_VERSIONS)}, "
            f"found {torch.__version__}. It uses private torch.onnx internals that may have changed.",
            RuntimeWarning,
            stacklevel=3,
        )


def _exporter():
    from torch.onnx._internal.exporter import _core, _fx_passes, _registration

    return _core, _fx_passes, _registration


@functools.lru_cache(maxsize=4)
def registry(opset_version: int | None = None):
    """torch's registry of aten -> ONNX decompositions (cached: building it takes ~0.3 s)."""
    _, _, _registration = _exporter()
    # torchvision ops are registered only when torchvision imports; the warning is noise here.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    if opset_version is None:
        return _registration.ONNXRegistry.from_torchlib()
    return _registration.ONNXRegistry.from_torchlib(opset_version=opset_version)


def default_opset() -> int:
    from torch.onnx._internal.exporter import _constants

    return _constants.TORCHLIB_OPSET


def capture(model: torch.nn.Module, args: tuple, kwargs: dict | None, dynamic_shapes) -> torch.export.ExportedProgram:
    """torch.export in non-strict mode (public API; kept here so all torch entry points sit together)."""
    return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)


def decompose(program: torch.export.ExportedProgram, opset_version: int | None = None) -> torch.export.ExportedProgram:
    """torch's ONNX decompositions, with view strides relaxed before type promotion.

    Mirrors ``_core._prepare_exported_program_for_export``; see
    :mod:`onnx_modular.passes.relax_views` for why the extra step is needed.
    """
    from onnx_modular.passes.relax_views import relax_view_strides

    _, _fx_passes, _ = _exporter()
    reg = registry(opset_version)
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):  # as torch does
        program = _fx_passes.decompose_with_registry(program, reg)
        graph_module = program.graph_module
        relax_view_strides(graph_module)
        _fx_passes.insert_type_promotion_nodes(graph_module)
        graph_module = _fx_passes.remove_assertion_nodes(graph_module)
        program._graph_module = graph_module
    return program


def translate(program: torch.export.ExportedProgram, opset_version: int | None = None) -> ir.Model:
    """FX -> ONNX IR with torch's translator. Every ONNX node keeps its FX node in ``meta``."""
    _core, _, _ = _exporter()
    onnx_program = _core._exported_program_to_onnx_program(program, registry=registry(opset_version))
    return onnx_program.model


def torch_dtype_to_ir(dtype: torch.dtype) -> ir.DataType:
    """The translator's own dtype table, so that signatures match what it emits."""
    _core, _, _ = _exporter()
    return _core.torch_dtype_to_onnx_dtype(dtype)


def rename_dynamic_axes(model: ir.Model, dynamic_shapes) -> None:
    """Name symbolic dims after the user's ``Dim`` / string axis names (``batch``, not ``s72``).

    torch only does this for string axes; Dim objects carry a name too.
    """
    if not dynamic_shapes:
        return
    from torch.onnx._internal.exporter import _dynamic_shapes, _ir_passes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mapping = _dynamic_shapes.create_rename_mapping(model.graph.inputs, dynamic_shapes)
    if mapping:
        _ir_passes.rename_axis(model, mapping)


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
            if isinstance(result, (tuple, list)):
                for i, item in enumerate(result):
                    values[f"{node.name}__{i}"] = item
            values[node.name] = result
            return result

    with torch.no_grad():
        _Recorder(program.graph_module).run(*flat)
    return values


class _Load:
    """A parameter read only when an op uses it (see :func:`program_values`)."""

    __slots__ = ("load",)

    def __init__(self, load):
        self.load = load

    def __call__(self):
        return self.load()


def fx_node_of(node: ir.Node) -> torch.fx.Node | None:
    """The FX node an ONNX node was translated from (set by torch's translator)."""
    return node.meta.get("node")


def add_opset_imports(model: ir.Model) -> None:
    """torch's opset-import pass: every domain used gets an import where it is used."""
    from torch.onnx._internal.exporter import _ir_passes

    _ir_passes.add_opset_imports(model)
