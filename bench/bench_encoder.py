"""An encoder in plain onnxruntime: ours, ours optimized, and torch's flat export through
onnxruntime's transformers optimizer, side by side in one run.

    python bench/bench_encoder.py [--layers 12] [--hidden 768] [--seq 128] [--rounds 5] [--runs 10] [--folder DIR] [--eager]

A BERT-base-sized ``BertModel`` (hidden 768, 12 layers, 12 heads, intermediate 3072, vocabulary
30522, random weights) is saved with ``save_pretrained`` and exported four ways:

- ``ours``: ``onnx-modular export CKPT -o ours.onnx``;
- ``ours_opt``: ``onnx-modular optimize ours.onnx -o ours.opt.onnx`` (MultiHeadAttention,
  SkipLayerNormalization inside the bodies);
- ``flat``: ``torch.onnx.export(model, ..., dynamo=True)`` (dynamic batch and sequence);
- ``flat_ort``: ``flat`` through ``onnxruntime.transformers.optimizer.optimize_model(path,
  model_type='bert', num_heads=12, hidden_size=768)``;
- ``eager_ort`` (``--eager``): the same from the model loaded with ``attn_implementation="eager"``
  (transformers' matmul-softmax-matmul attention instead of ``scaled_dot_product_attention``, the
  chain the optimizer's attention fusion was written for): the strongest file a user makes without us.

Batch 1, ``--seq`` tokens, every position visible. One intra-op thread, sequential execution,
the files taking turns run by run (the order reversed every turn; ``bench_decode``'s sessions and
kernel counts); medians. Kernels: the nodes of onnxruntime's optimized graph, with the fused ops
named. The outputs of every file are compared with torch's. ``--folder`` keeps the files (and
reuses them when present).
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
import torch
import transformers
from bench_decode import _session

_FUSED = ("MultiHeadAttention", "Attention", "SkipLayerNormalization", "LayerNormalization", "FastGelu", "BiasGelu",
          "Gelu", "MatMul", "FusedMatMul", "Gemm", "EmbedLayerNormalization")


def _kernels(path: str) -> collections.Counter:
    with tempfile.TemporaryDirectory() as folder:
        target = os.path.join(folder, "optimized.onnx")
        _session(path, target)
        return collections.Counter(node.op_type for node in onnx.load(target, load_external_data=False).graph.node)


def _flat(model, path: str, seq: int) -> None:
    ids = torch.randint(0, model.config.vocab_size, (1, seq))
    batch, length = torch.export.Dim("batch"), torch.export.Dim("sequence", max=model.config.max_position_embeddings)
    dynamic = {"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}}
    _common.flat_export(model, (ids,), {"attention_mask": torch.ones_like(ids)}, path, dynamic_shapes=dynamic)


def _ort_optimized(source: str, path: str, hidden: int) -> None:
    from onnxruntime.transformers.optimizer import optimize_model

    with contextlib.redirect_stdout(io.StringIO()):
        optimized = optimize_model(source, model_type="bert", num_heads=hidden // 64, hidden_size=hidden)
    optimized.save_model_to_file(path, use_external_data_format=True)


def _files(folder: pathlib.Path, layers: int, hidden: int, seq: int, eager: bool) -> tuple[torch.nn.Module, dict[str, str]]:
    from onnx_modular.cli import main

    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                     intermediate_size=4 * hidden)
    model = transformers.BertModel(config).eval()
    names = ("ours", "ours_opt", "flat", "flat_ort") + (("eager_ort",) if eager else ())
    files = {name: str(folder / f"{name}.onnx") for name in names}
    if not os.path.exists(files["ours"]):
        model.save_pretrained(folder / "ckpt")
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["export", str(folder / "ckpt"), "-o", files["ours"]]) == 0
    if not os.path.exists(files["ours_opt"]):
        assert main(["optimize", files["ours"], "-o", files["ours_opt"]]) == 0
    if not os.path.exists(files["flat"]):
        _flat(model, files["flat"], seq)
    if not os.path.exists(files["flat_ort"]):
        _ort_optimized(files["flat"], files["flat_ort"], hidden)
    if eager and not os.path.exists(files["eager_ort"]):
        eager_model = transformers.BertModel._from_config(copy.deepcopy(config), attn_implementation="eager").eval()
        eager_model.load_state_dict(model.state_dict())
        _flat(eager_model, str(folder / "eager.onnx"), seq)
        _ort_optimized(str(folder / "eager.onnx"), files["eager_ort"], hidden)
    return model, files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--folder", default=None, help="keep the files here (reused when present)")
    parser.add_argument("--eager", action="store_true", help="also the flat export of the eager-attention model, optimized")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        folder = pathlib.Path(args.folder or stack.enter_context(tempfile.TemporaryDirectory()))
        folder.mkdir(parents=True, exist_ok=True)
        model, files = _files(folder, args.layers, args.hidden, args.seq, args.eager)
        names = list(files)
        ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, args.seq)).astype(np.int64)
        feeds_all = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        with torch.no_grad():
            expected = model(torch.from_numpy(ids), attention_mask=torch.from_numpy(feeds_all["attention_mask"]))
        expected = expected.last_hidden_state.numpy()
        sessions = {n: _session(p) for n, p in files.items()}
        feeds = {n: {i.name: feeds_all[i.name] for i in s.get_inputs()} for n, s in sessions.items()}
        for name in names:
            got = sessions[name].run(None, feeds[name])[0]
            print(f"{name}: max |onnxruntime - torch| of last_hidden_state {_common.max_abs(got, expected):.2e}")
        for name in names:
            kernels = _kernels(files[name])
            fused = ", ".join(f"{kernels[op]} {op}" for op in _FUSED if kernels[op])
            print(f"kernels {name}: {sum(kernels.values())} ({fused})")
        times = {n: [] for n in names}
        for index in range(args.rounds * args.runs):
            for name in (names if index % 2 == 0 else names[::-1]):
                times[name].append(_common.run_latency(sessions[name], feeds[name], 1, warmup=index == 0))
    medians = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    print(f"batch 1, sequence {args.seq}, 1 intra-op thread, {args.rounds * args.runs} runs each, files taking turns, medians")
    for name in names:
        print(f"{name:<9} {medians[name]:8.2f} ms  {medians[name] / medians['flat_ort']:.2f}x flat_ort"
              f"  {medians[name] / medians['ours']:.2f}x ours")


if __name__ == "__main__":
    main()
