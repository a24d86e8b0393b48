"""An encoder in plain onnxruntime: ours (float and int8) against torch's flat export through onnxruntime's
transformers optimizer and ``quantize_dynamic`` (the route Optimum users take on CPU), side by side in one run.

    python bench/bench_encoder.py [--model bert|vit] [--layers 12] [--hidden 768] [--seqs 128] [--threads 1]
        [--rounds 5] [--runs 10] [--folder DIR] [--eager] [--int8] [--fixed]

A BERT-base-sized ``BertModel`` (hidden 768, 12 layers, 12 heads, intermediate 3072, vocabulary
30522, random weights; ``--model vit``: ``ViTModel`` of the same sizes, 224x224 images, patches of
16: 197 tokens) is exported these ways:

- ``ours``: ``onnx-modular export CKPT -o ours.onnx`` (dynamic batch and sequence); with ``--fixed``,
  ``export_modular(model, (input_ids,), kwargs={"attention_mask": ...})`` instead (what a user of the
  Python API gets by default: the example's shapes fixed; one sequence length then);
- ``ours_opt``: ``onnx-modular optimize ours.onnx -o ours.opt.onnx`` (Attention, SkipLayerNormalization, Gelu
  inside the bodies);
- ``ours_int8`` (``--int8``): ``onnx-modular optimize ours.onnx -o ours.int8.onnx --quantize int8``
  (dynamic int8 inside the bodies, chosen per call by the error of the outputs);
- ``flat``: ``torch.onnx.export(model, ..., dynamo=True)`` (dynamic batch and sequence);
- ``flat_ort``: ``flat`` through ``onnxruntime.transformers.optimizer.optimize_model(path,
  model_type='bert', num_heads=12, hidden_size=768)`` (``model_type='vit'`` for ViT);
- ``anchor`` (``--int8``): ``flat_ort`` through ``onnxruntime.quantization.quantize_dynamic(...,
  weight_type=QuantType.QInt8)``: int8 weights, ``MatMulInteger``/``DynamicQuantizeMatMul``;
- ``eager_ort`` (``--eager``, BERT): the flat export of the model loaded with ``attn_implementation="eager"``,
  through the transformers optimizer.

Batch 1, every position visible. For each thread count and sequence length: one session per file
(``intra_op_num_threads``, sequential execution), the files taking turns run by run (the order
reversed every turn), medians; the largest difference of ``last_hidden_state`` from torch's. Kernels:
the nodes of onnxruntime's optimized graph (one thread), with the fused ops named. ``--folder`` keeps
the files (and reuses them when present).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import io
import os
import pathlib
import statistics
import tempfile

import _common
import numpy as np
import onnx
import onnxruntime as ort
import torch
import transformers

_FUSED = ("MultiHeadAttention", "Attention", "QAttention", "SkipLayerNormalization", "LayerNormalization", "FastGelu",
          "BiasGelu", "Gelu", "MatMul", "FusedMatMul", "Gemm", "DynamicQuantizeMatMul", "MatMulInteger",
          "MatMulIntegerToFloat", "DynamicQuantizeLinear", "EmbedLayerNormalization")


def _session(path: str, threads: int = 1, optimized: str | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    if optimized:
        options.optimized_model_filepath = optimized
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def _kernels(path: str) -> collections.Counter:
    with tempfile.TemporaryDirectory() as folder:
        target = os.path.join(folder, "optimized.onnx")
        _session(path, 1, target)
        return collections.Counter(node.op_type for node in onnx.load(target, load_external_data=False).graph.node)


def _model(kind: str, layers: int, hidden: int, eager: bool = False):
    torch.manual_seed(0)
    sizes = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": hidden // 64,
             "intermediate_size": 4 * hidden}
    if kind == "vit":
        return transformers.ViTModel(transformers.ViTConfig(**sizes), add_pooling_layer=False).eval()
    model = transformers.BertModel(transformers.BertConfig(**sizes)).eval()
    if eager:
        other = transformers.BertModel._from_config(copy.deepcopy(model.config), attn_implementation="eager").eval()
        other.load_state_dict(model.state_dict())
        return other
    return model


def _inputs(kind: str, model, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    if kind == "vit":
        size = model.config.image_size
        return {"pixel_values": rng.standard_normal((1, 3, size, size)).astype(np.float32)}
    ids = rng.integers(0, model.config.vocab_size, (1, seq)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def _flat(kind: str, model, path: str, seq: int) -> None:
    inputs = {k: torch.from_numpy(v) for k, v in _inputs(kind, model, seq).items()}
    if kind == "vit":
        _common.flat_export(model, (inputs["pixel_values"],), {}, path, dynamic_shapes={"pixel_values": {0: torch.export.Dim("batch")}})
        return
    batch, length = torch.export.Dim("batch"), torch.export.Dim("sequence", max=model.config.max_position_embeddings)
    dynamic = {"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}}
    _common.flat_export(model, (inputs["input_ids"],), {"attention_mask": inputs["attention_mask"]}, path, dynamic_shapes=dynamic)


def _ort_optimized(kind: str, source: str, path: str, hidden: int) -> None:
    from onnxruntime.transformers.optimizer import optimize_model

    with contextlib.redirect_stdout(io.StringIO()):
        optimized = optimize_model(source, model_type=kind, num_heads=hidden // 64, hidden_size=hidden)
    optimized.save_model_to_file(path, use_external_data_format=True)


def _anchor(source: str, path: str) -> None:
    """Optimum's CPU route: ``quantize_dynamic`` with int8 weights on the optimized flat file."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with contextlib.redirect_stdout(io.StringIO()):
        quantize_dynamic(source, path, weight_type=QuantType.QInt8, use_external_data_format=True)


def _ours(kind: str, model, folder: pathlib.Path, path: str, fixed_seq: int | None) -> None:
    from onnx_modular import export_modular
    from onnx_modular.cli import main

    if fixed_seq is not None:  # the Python API's default: the example's shapes fixed
        inputs = {k: torch.from_numpy(v) for k, v in _inputs(kind, model, fixed_seq).items()}
        first = next(iter(inputs))
        with _common.quiet():
            export_modular(model, (inputs.pop(first),), kwargs=inputs).save(path)
        return
    model.save_pretrained(folder / "ckpt")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["export", str(folder / "ckpt"), "-o", path]) == 0


def _files(args, folder: pathlib.Path) -> tuple[torch.nn.Module, dict[str, str]]:
    from onnx_modular.cli import main

    model = _model(args.model, args.layers, args.hidden)
    names = ["ours", "ours_opt"] + (["ours_int8"] if args.int8 else []) + ["flat", "flat_ort"] \
        + (["anchor"] if args.int8 else []) + (["eager_ort"] if args.eager else [])
    files = {name: str(folder / f"{name}.onnx") for name in names}
    if not os.path.exists(files["ours"]):
        _ours(args.model, model, folder, files["ours"], args.seqs[0] if args.fixed else None)
    for name, extra in (("ours_opt", []), ("ours_int8", ["--quantize", "int8"])):
        if name in files and not os.path.exists(files[name]):
            assert main(["optimize", files["ours"], "-o", files[name], *extra]) == 0
    if not os.path.exists(files["flat"]):
        _flat(args.model, model, files["flat"], args.seqs[0])
    if not os.path.exists(files["flat_ort"]):
        _ort_optimized(args.model, files["flat"], files["flat_ort"], args.hidden)
    if "anchor" in files and not os.path.exists(files["anchor"]):
        _anchor(files["flat_ort"], files["anchor"])
    if "eager_ort" in files and not os.path.exists(files["eager_ort"]):
        eager = _model(args.model, args.layers, args.hidden, eager=True)
        _flat(args.model, eager, str(folder / "eager.onnx"), args.seqs[0])
        _ort_optimized(args.model, str(folder / "eager.onnx"), files["eager_ort"], args.hidden)
    return model, files


def _measure(model, files: dict[str, str], kind: str, seq: int, threads: int, turns: int) -> tuple[dict, dict]:
    """Medians (ms) and the largest difference from torch's ``last_hidden_state``, per file."""
    inputs = _inputs(kind, model, seq)
    with torch.no_grad():
        expected = model(**{k: torch.from_numpy(v) for k, v in inputs.items()}).last_hidden_state.numpy()
    sessions = {n: _session(p, threads) for n, p in files.items()}
    feeds = {n: {i.name: inputs[i.name] for i in s.get_inputs()} for n, s in sessions.items()}
    errors = {}
    for name, session in sessions.items():
        outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds[name])))
        errors[name] = _common.max_abs(outputs.get("last_hidden_state", next(iter(outputs.values()))), expected)
    names = list(files)
    times = {n: [] for n in names}
    for index in range(turns):
        for name in (names if index % 2 == 0 else names[::-1]):
            times[name].append(_common.run_latency(sessions[name], feeds[name], 1, warmup=index == 0))
    return {n: statistics.median(v) * 1e3 for n, v in times.items()}, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["bert", "vit"], default="bert")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--seqs", type=lambda text: [int(v) for v in text.split(",")], default=[128],
                        help="sequence lengths, comma-separated (BERT; ViT runs its 197 tokens)")
    parser.add_argument("--seq", type=int, default=None, help="one sequence length (as --seqs N)")
    parser.add_argument("--threads", type=lambda text: [int(v) for v in text.split(",")], default=[1])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--folder", default=None, help="keep the files here (reused when present)")
    parser.add_argument("--eager", action="store_true", help="also the flat export of the eager-attention model, optimized")
    parser.add_argument("--int8", action="store_true", help="also ours_int8 (optimize --quantize int8) and the anchor")
    parser.add_argument("--fixed", action="store_true", help="ours exported by export_modular with fixed shapes")
    parser.add_argument("--only", default=None, help="time only these files (comma-separated)")
    args = parser.parse_args()
    if args.seq is not None:
        args.seqs = [args.seq]
    if args.model == "vit":
        args.seqs, args.eager = [197], False
    with contextlib.ExitStack() as stack:
        folder = pathlib.Path(args.folder or stack.enter_context(tempfile.TemporaryDirectory()))
        folder.mkdir(parents=True, exist_ok=True)
        model, files = _files(args, folder)
        for name in files:
            kernels = _kernels(files[name])
            fused = ", ".join(f"{kernels[op]} {op}" for op in _FUSED if kernels[op])
            print(f"kernels {name}: {sum(kernels.values())} ({fused})")
        if args.only:
            files = {n: p for n, p in files.items() if n in args.only.split(",")}
        base = "anchor" if "anchor" in files else "flat_ort" if "flat_ort" in files else next(iter(files))
        ours = "ours_opt" if "ours_opt" in files else next(iter(files))
        for threads in args.threads:
            for seq in args.seqs:
                medians, errors = _measure(model, files, args.model, seq, threads, args.rounds * args.runs)
                print(f"\n{args.model}, batch 1, sequence {seq}, {threads} intra-op thread(s), {args.rounds * args.runs} "
                      "runs each, files taking turns, medians")
                for name in files:
                    print(f"{name:<9} {medians[name]:8.2f} ms  {medians[name] / medians[base]:.2f}x {base}"
                          f"  {medians[name] / medians[ours]:.2f}x {ours}  max |onnxruntime - torch| {errors[name]:.2e}")


if __name__ == "__main__":
    main()
