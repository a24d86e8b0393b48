"""Block-by-block verification: parity without the whole model in onnxruntime's memory.

The written file is evaluated in pieces, in the order of its graph:

* each *block* call (see :func:`onnx_modular.weights.streaming.choose_blocks`) runs in its own
  onnxruntime session holding only that call's weights: a one-node model calling the
  block's function, whose initializers point into the file's external data (nothing is
  copied); the session is dropped before the next block;
* a call that contains blocks (``LlamaModel`` around its layers) is opened and its body
  evaluated the same way;
* the nodes between blocks (masks, rotary tables, the final reshapes) run together as
  one small model per stretch.

Each block runs twice in its session. Fed PyTorch's own inputs to that call (recorded,
with its outputs, while the eager reference ran with that block's weights loaded:
:func:`onnx_modular.weights.streaming.streamed`), its outputs are compared with PyTorch's: the
block's error is its own, not the drift of every block before it (in float16, PyTorch's CPU
kernels accumulate in float32 and onnxruntime's do not: chained through 32 layers, that
drift reached 4.3e-1 on an 8B model, although no block was wrong). Fed what the ONNX model
computed before it, it carries the chain on to the graph outputs, which are compared with
PyTorch's as in a whole-model check (``ParityReport``, the per-dtype tolerance): the
end-to-end judgement. Inputs that cannot be matched to a recorded tensor by name, shape and
dtype (sizes, masks the parent computed) keep the ONNX model's values.

A bfloat16 file (onnxruntime's CPU provider has no bfloat16 kernels) is checked as the
in-memory path checks it (:func:`onnx_modular.check.verification.verify_bfloat16`): every piece
is widened to float32 (:class:`~onnx_modular.check.widen.WidenFloatPass`; one block's weights
at a time, read from the file's data and widened exactly) and compared with PyTorch run in
float32 on the same bfloat16 weights (``Stream.eager(widen=True)``), at
:func:`~onnx_modular.check.verification.widened_tolerance`.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
import torch

from onnx_modular.capture import tensors
from onnx_modular.check import parity
from onnx_modular.check.parity import Parity, ParityReport, Tolerance
from onnx_modular.check.verification import uses_bfloat16, widened_tolerance
from onnx_modular.check.widen import WidenFloatPass
from onnx_modular.errors import ParityError, VerificationError
from onnx_modular.format import metadata
from onnx_modular.runtime import sessions as runtime
from onnx_modular.storage.scratch import scratch_model_file
from onnx_modular.weights.streaming import Blocks

__all__ = ["BlockReport", "verify_blocks", "assert_blocks"]

@dataclasses.dataclass
class BlockReport:
    """Per-block parity (one :class:`~onnx_modular.check.parity.Parity` row, ``kind="block"``, per
    block call) plus the graph outputs' parity (``outputs``)."""

    blocks: list[Parity]
    outputs: ParityReport

    @property
    def ok(self) -> bool:
        return self.outputs.ok and all(b.ok for b in self.blocks)

    @property
    def first_failure(self) -> Parity | None:
        return next((b for b in self.blocks if not b.ok), None)

    def __str__(self) -> str:
        width = parity.name_column_width(b.module_path for b in self.blocks)
        header = f"{'block call':<{width}} {'class':<24} {'weights MB':>10} {'max abs':>10} {'chained':>10}  ok"
        lines = [
            "Block-by-block parity (onnxruntime, one block's weights at a time, vs PyTorch; max abs: on PyTorch's "
            "inputs to the block, chained: on the ONNX model's)",
            header,
        ]
        for b in self.blocks:
            name = b.module_path + (f"@{b.call_index}" if b.call_index else "")
            chained = "-" if b.chained_max_abs is None else f"{b.chained_max_abs:.2e}"
            lines.append(
                f"{parity.fit_name(name, width):<{width}} {b.module_class[:24]:<24} "
                f"{b.weight_bytes / 2**20:>10.1f} {b.max_abs:>10.2e} {chained:>10}  {'yes' if b.ok else 'NO'}"
            )
        lines.append(str(self.outputs))
        return "\n".join(lines)


class _Evaluator:
    def __init__(
        self, model: ir.Model, blocks: Blocks, workdir: pathlib.Path, tolerance: Tolerance | None,
        execution_provider: str | None = None, widen: bool = False,
    ):
        self.model = model
        self.widen = widen  # a bfloat16 file: each piece runs widened to float32
        self.execution_provider = execution_provider
        self.blocks = blocks
        self.workdir = workdir
        self.tolerance = tolerance
        self.report: list[Parity] = []
        self._holds_blocks: dict[ir.OperatorIdentifier, bool] = {}

    # -- what a call is ---------------------------------------------------------------

    def _function(self, node: ir.Node) -> ir.Function | None:
        return self.model.functions.get(node.op_identifier())

    def _holds_block(self, function: ir.Function) -> bool:
        key = function.identifier()
        if key not in self._holds_blocks:
            self._holds_blocks[key] = False  # recursion guard
            self._holds_blocks[key] = any(
                (inner := self._function(n)) is not None
                and (n.metadata_props.get(metadata.MODULE_PATH) in self.blocks or self._holds_block(inner))
                for n in function
            )
        return self._holds_blocks[key]

    # -- evaluation -------------------------------------------------------------------

    def run(
        self, nodes: Sequence[ir.Node], env: dict[ir.Value, object], outputs: Sequence[ir.Value],
        caller: str | None = None, body_path: str | None = None,
    ) -> None:
        """Evaluate ``nodes`` in order; ``env`` maps values to arrays or to initializer values.

        ``caller`` and ``body_path``: the enclosing call and the path its body was written for
        (:func:`~onnx_modular.format.metadata.resolve_module_path`); ``None`` in the main graph.
        """
        stretch: list[ir.Node] = []
        for node in nodes:
            function = self._function(node)
            path = node.metadata_props.get(metadata.MODULE_PATH)
            if path is not None:
                path = metadata.resolve_module_path(node.name or "", path, caller, body_path)
            if function is not None and (path in self.blocks or self._holds_block(function)):
                self._run_stretch(stretch, env, nodes, outputs)
                stretch = []
                if path in self.blocks:
                    self._run_block(node, path, env)
                else:
                    inner: dict[ir.Value, object] = {
                        formal: env[actual] for formal, actual in zip(function.inputs, node.inputs) if actual is not None
                    }
                    self.run(list(function), inner, function.outputs, path, metadata.body_module_path(function))
                    for actual, formal in zip(node.outputs, function.outputs):
                        env[actual] = inner[formal]
            else:
                stretch.append(node)
        self._run_stretch(stretch, env, nodes, outputs)

    def _run_stretch(self, stretch: list[ir.Node], env, container: Sequence[ir.Node], outputs: Sequence[ir.Value]) -> None:
        if not stretch:
            return
        inside = set(stretch)
        produced = [v for n in stretch for v in n.outputs]
        later = {id(n) for n in container} - {id(n) for n in inside}
        needed = [
            v for v in produced
            if v in outputs or any(id(use.node) in later for use in v.uses())
        ]
        if not needed:
            return
        results = self._session(stretch, env, needed)
        env.update(zip(needed, results))

    def _run_block(self, node: ir.Node, path: str, env) -> None:
        index = int(node.metadata_props.get(metadata.CALL_INDEX, "0"))
        own = self._torch_inputs(node, self.blocks.inputs.get((path, index), {}), env)
        if own:
            chained, on_torch_inputs = self._session([node], env, list(node.outputs), variants=[own])
        else:
            chained = on_torch_inputs = self._session([node], env, list(node.outputs))
        env.update(zip(node.outputs, chained))
        expected = self.blocks.outputs.get((path, index))
        block = self._compare(path, index, on_torch_inputs, expected)
        block.inputs_from_torch = len(own)
        if own:
            block.chained_max_abs = self._compare(path, index, chained, expected).max_abs
        self.report.append(block)

    def _torch_inputs(self, node: ir.Node, recorded: dict[str, torch.Tensor], env) -> dict[ir.Value, np.ndarray]:
        """The node's inputs that PyTorch's call received: by the function's input name, same shape and dtype."""
        function = self._function(node)
        own: dict[ir.Value, np.ndarray] = {}
        if function is None or not recorded:
            return own
        for formal, actual in zip(function.inputs, node.inputs):
            tensor = recorded.get(formal.name)
            current = env.get(actual) if actual is not None else None
            if tensor is None or current is None or isinstance(current, ir.Value):
                continue
            array = tensors.to_numpy(tensor)
            current = np.asarray(current)
            if array.shape == current.shape and array.dtype == current.dtype:
                own[actual] = array
        return own

    def _compare(self, path: str, index: int, actual: list[np.ndarray], expected: list[torch.Tensor] | None) -> Parity:
        pairs: list[tuple[np.ndarray, torch.Tensor]] = []
        if expected is not None:
            if len(actual) == len(expected):
                pairs = list(zip(actual, expected))
            else:  # match by shape where unique
                for tensor in expected:
                    same = [a for a in actual if tuple(a.shape) == tuple(tensor.shape)]
                    if len(same) == 1:
                        pairs.append((same[0], tensor))
        worst, worst_rel, ok, used = 0.0, 0.0, bool(pairs), self.tolerance
        for array, tensor in pairs:
            reference = tensors.to_numpy(tensor)
            abs_error, rel_error = parity.max_differences(array, reference)
            worst, worst_rel = max(worst, abs_error), max(worst_rel, rel_error)
            used = self.tolerance or (
                widened_tolerance([tensor]) if self.widen else parity.default_tolerance(tensor.dtype)
            )
            ok = ok and parity.allclose(array, reference, used)
        return Parity(
            metadata.call_name(path, index), kind="block", module_path=path, call_index=index,
            function=self.blocks.classes.get(path, ""), weight_bytes=self.blocks.nbytes.get(path, 0),
            outputs_compared=len(pairs), modular_max_abs=worst, modular_max_rel=worst_rel, ok=ok, tolerance=used,
        )

    def _session(self, nodes: list[ir.Node], env, wanted: list[ir.Value], variants=()) -> list[np.ndarray] | list[list[np.ndarray]]:
        """Run ``nodes`` as one model: arrays from ``env`` are fed, initializers are referenced.

        With ``variants`` (``{value: array}`` replacing some fed values), the same session runs once
        on ``env`` and once per variant, and the list of each run's outputs is returned.
        """
        mapping: dict[ir.Value, ir.Value] = {}
        inputs, initializers, feeds, sources = [], [], {}, []
        widened = False
        for node in nodes:
            for value in node.inputs:
                if value is None or value in mapping or any(value in n.outputs for n in nodes):
                    continue
                source = env.get(value)
                if isinstance(source, ir.Value):  # an initializer of the file
                    tensor, kind = source.const_value, source.type
                    if self.widen and tensor is not None and tensor.dtype == ir.DataType.BFLOAT16:
                        tensor = ir.tensor(tensor.numpy().astype(np.float32), name=tensor.name)  # exact
                        kind, widened = ir.TensorType(ir.DataType.FLOAT), True
                    copy = ir.Value(name=f"w{len(mapping)}", type=kind, shape=source.shape, const_value=tensor)
                    initializers.append(copy)
                elif source is not None:
                    array = np.asarray(source)
                    copy = ir.Value(
                        name=f"x{len(mapping)}",
                        type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                        shape=ir.Shape(array.shape),
                    )
                    inputs.append(copy)
                    feeds[copy.name] = array
                    sources.append(value)
                else:
                    raise VerificationError(f"Block-wise verification found no value for {value.name!r}.")
                mapping[value] = copy
        clones = []
        for node in nodes:
            outputs = [ir.Value(name=f"y{len(mapping) + i}_{id(o)}", type=o.type, shape=o.shape) for i, o in enumerate(node.outputs)]
            for original, new in zip(node.outputs, outputs):
                mapping[original] = new
            clones.append(
                ir.Node(
                    node.domain, node.op_type,
                    [mapping[v] if v is not None else None for v in node.inputs],
                    attributes=[_copy_attr(a) for a in node.attributes.values()],
                    overload=node.overload, outputs=outputs, version=node.version, name=node.name,
                )
            )
        graph = ir.Graph(
            inputs, [mapping[v] for v in wanted], nodes=clones, initializers=initializers,
            opset_imports=dict(self.model.opset_imports), name="block",
        )
        piece = ir.Model(graph, ir_version=self.model.ir_version, functions=list(self.model.functions.values()))
        runs = [[feeds[i.name] for i in inputs]]
        runs += [[variant.get(value, feeds[i.name]) for value, i in zip(sources, inputs)] for variant in variants]
        # next to the model: external initializers keep pointing into the file's data
        # (the widened weights go to the piece's own data, removed with it)
        with scratch_model_file(piece, near=self.workdir / "model.onnx", name="block.onnx", external_data=widened) as path:
            session = runtime.session(path, self.execution_provider, prepacking=False)
            results = [runtime.run(session, inputs, what="block of the model")[1] for inputs in runs]
            return results if variants else results[0]


def _copy_attr(attr: ir.Attr) -> ir.Attr:
    if attr.is_ref():
        return ir.RefAttr(attr.name, attr.ref_attr_name, attr.type)
    return ir.Attr(attr.name, attr.type, attr.value)


def verify_blocks(
    path: str | pathlib.Path,
    inputs: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    blocks: Blocks,
    *,
    tolerance: Tolerance | None = None,
    execution_provider: str | None = None,
) -> BlockReport:
    """Evaluate the file at ``path`` block by block in onnxruntime and compare with PyTorch.

    ``execution_provider``: onnxruntime's provider for every piece (CPU by default), as in
    :func:`onnx_modular.runtime.sessions.session`.

    ``blocks`` carries the block paths and PyTorch's outputs of each block call (from
    :func:`onnx_modular.weights.streaming.streamed`); ``expected`` are PyTorch's graph outputs.
    """
    path = pathlib.Path(path)
    model = ir.load(path)  # initializers stay in the external data until a block reads them
    widen = uses_bfloat16(model)
    if widen:  # types, casts and constants; the weights are widened piece by piece
        WidenFloatPass(initializers=False)(model)
        if tolerance is None:
            tolerance_of_outputs = widened_tolerance(expected)
    env: dict[ir.Value, object] = {}
    if len(model.graph.inputs) != len(inputs):
        raise VerificationError(f"The model has {len(model.graph.inputs)} inputs but {len(inputs)} tensors were given.")
    for value, tensor in zip(model.graph.inputs, inputs):
        env[value] = tensors.to_numpy(tensor) if isinstance(tensor, torch.Tensor) else np.asarray(tensor)
    for value in model.graph.initializers.values():
        env[value] = value
    # Pieces are written next to the model, so that their external-data paths resolve.
    evaluator = _Evaluator(model, blocks, path.parent, tolerance, execution_provider, widen=widen)
    evaluator.run(list(model.graph), env, model.graph.outputs)
    outputs = []
    for value in model.graph.outputs:
        source = env[value]
        outputs.append(source.const_value.numpy() if isinstance(source, ir.Value) else source)
    names = [v.name for v in model.graph.outputs]
    report = parity.compare_outputs(
        names, outputs, None, [tensors.to_numpy(t) for t in expected],
        tolerance=tolerance_of_outputs if widen and tolerance is None else tolerance,
    )
    if widen:
        used = tolerance or tolerance_of_outputs
        report.reference = "PyTorch float32"
        report.note = (
            "bfloat16 file checked block by block on float32-widened pieces, against PyTorch in float32 on the "
            f"same bfloat16 weights (atol {used.atol:.3g}: the file's own constants are bfloat16)"
        )
    return BlockReport(evaluator.report, report)


def assert_blocks(report, *, result=None) -> None:
    """Raise :class:`ParityError` naming the first block call beyond tolerance."""
    first = report.first_failure
    if first is None:
        return
    raise ParityError(
        f"Block {first.module_path!r} ({first.module_class}) differs from PyTorch: max abs {first.max_abs:.3e}"
        + ("" if first.outputs_compared else " (its outputs could not be matched)")
        + f".\n{report}",
        report=report.outputs,
        result=result,
        module_path=first.module_path,
        hint="Inspect error.report; loosen rtol/atol if the drift is expected (e.g. float16).",
    )
