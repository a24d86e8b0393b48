"""Which lifted constants pay: onnxruntime session creation with body constants lifted or not.

    python bench/bench_lifted_constants.py [--layers 12] [--rounds 121]

GPT-2 (d=256, weights perturbed as in ``bench_runtime.py``), exported in this run by
``torch.onnx.export(dynamo=True)`` (flat) and by ``export_modular`` four times, with
``FoldWeightsPass``'s constant lifting set to: every constant (the default), only constants of
more than one element (onnxruntime's ``ConstantSharing`` merges equal scalar initializers, so
scalars might not pay), only the int64 ones (shapes), none. One intra-op thread; every round
creates one session of each file, in an order that flips each round; medians of ``--rounds`` of
the calling thread's CPU time, as ratios to the flat file of the same round set. The viewer's
display copy (``onnx-modular view``, constants back in their bodies) is a separate file that is
never run, so it costs the file nothing.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import tempfile

import _common
import bench_runtime
import models
import onnx
import onnx_ir as ir

from onnx_modular import export_modular
from onnx_modular.format import metadata
from onnx_modular.passes.export import pipeline
from onnx_modular.passes.export.fold_weights import FoldWeightsPass


def _elements(value: ir.Value) -> int:
    return math.prod(value.shape.numpy()) if value.shape is not None and value.shape.is_static() else 2


POLICIES = {
    "all (default)": True,
    "more than one element": lambda value: _elements(value) > 1,
    "int64 only": lambda value: value.dtype == ir.DataType.INT64,
    "none": False,
}


def export_variants(layers: int, folder: pathlib.Path) -> dict[str, pathlib.Path]:
    model, args, kwargs = bench_runtime.trained_like(lambda: models.gpt2(n_layer=layers, d=256))()
    paths = {"flat (torch)": folder / "flat.onnx"}
    _common.flat_export(model, args, kwargs, paths["flat (torch)"])
    default = pipeline.FoldWeightsPass
    try:
        for index, (name, policy) in enumerate(POLICIES.items()):
            pipeline.FoldWeightsPass = lambda policy=policy: FoldWeightsPass(constants=policy)
            paths[name] = folder / f"modular{index}.onnx"
            export_modular(model, args, paths[name], kwargs=kwargs, verify=False)
    finally:
        pipeline.FoldWeightsPass = default
    return paths


def block_inputs(path: pathlib.Path) -> tuple[int, int]:
    """(formal inputs of one block, of which lifted constants)."""
    proto = onnx.load(str(path), load_external_data=False)
    lifted = metadata.lifted_constants(proto)
    block = next(f for f in proto.functions if f.name == "GPT2Block")
    call = next(n for n in proto.graph.node if n.op_type == "GPT2Block")
    return len(block.input), sum(1 for name in call.input if name in lifted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=121)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = export_variants(options.layers, pathlib.Path(tmp))
        created = {name: [] for name in paths}
        for round_ in range(options.rounds):
            order = list(paths) if round_ % 2 == 0 else list(reversed(paths))
            for name in order:
                (_, cpu), session = bench_runtime.create(paths[name])
                created[name].append(cpu)
                del session
        flat = statistics.median(created["flat (torch)"])
        print(f"GPT-2, {options.layers} layers, d=256; session creation, CPU ms, medians of {options.rounds}")
        print("| constants lifted | block inputs (lifted constants) | session (ms) | ratio to flat |")
        print("|---|---|---|---|")
        for name, times in created.items():
            inputs = "-" if name.startswith("flat") else "{} ({})".format(*block_inputs(paths[name]))
            print(f"| {name} | {inputs} | {statistics.median(times) * 1000:.1f} | {statistics.median(times) / flat:.3f} |")


if __name__ == "__main__":
    main()
