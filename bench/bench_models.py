"""Export time and structure per model: onnx_modular vs torch.onnx.export(dynamo=True), same run.

    python bench/bench_models.py [--repeat 3] [--models gpt2,llama,...]

Prints one markdown row per model: functions, definitions, depth, max abs diff against
torch (onnxruntime on the modular file), and median export wall time of both exporters
(verification off for onnx_modular, so that both only export and save).
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import _common
import models

from onnx_modular import export_modular
from onnx_modular.format import metadata

FACTORIES = {
    "gpt2": models.gpt2,
    "llama": models.llama,
    "bert": models.bert,
    "vit": models.vit,
    "t5": models.t5,
    "resnet": models.resnet,
    "llama-kv": models.llama_kv,  # one decode step with a DynamicCache
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--models", default=",".join(FACTORIES))
    # note: onnx_modular registers transformers' caches for torch.export on first use, and it
    # runs first here, so torch.onnx.export then accepts the DynamicCache too (without the
    # registration it fails: "Unsupported input type DynamicCache").
    options = parser.parse_args()
    print("| model | module calls as functions | function definitions | depth | max abs diff vs torch | onnx_modular export (s) | torch.onnx.export (s) | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for name in options.models.split(","):
        model, args, kwargs = FACTORIES[name]()
        with tempfile.TemporaryDirectory() as tmp:
            tmp = pathlib.Path(tmp)
            result = export_modular(model, args, tmp / "check.onnx", kwargs=kwargs)  # verified once
            calls = sum(int(f.metadata_props[metadata.CALL_COUNT]) for f in result.functions)
            modular_time, _ = _common.median_time(
                lambda model=model, args=args, kwargs=kwargs, tmp=tmp: export_modular(model, args, tmp / "m.onnx", kwargs=kwargs, verify=False), options.repeat
            )
            try:
                flat_time, _ = _common.median_time(
                    lambda model=model, args=args, kwargs=kwargs, tmp=tmp: _common.flat_export(model, args, kwargs, tmp / "flat.onnx"), options.repeat
                )
                flat_text, ratio = f"{flat_time:.2f}", f"{modular_time / flat_time:.2f}"
            except Exception as e:  # torch's own export fails on some models (T5)
                flat_text, ratio = f"fails: {type(e).__name__}", "-"
            print(
                f"| {name} | {calls} | {len(result.functions)} | {result.hierarchy.max_depth} | "
                f"{result.report.max_abs:.1e} | {modular_time:.2f} | {flat_text} | {ratio} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
