"""``convert`` against the flat-graph tools, same model, same run.

    python bench/bench_convert.py [--layers 2] [--hidden 256] [--vocab 4000] [--repeat 3] [--latency]
    python bench/bench_convert.py --layers 12 --hidden 768 --vocab 32000 --latency   # 124M parameters

One Llama-shaped ``LlamaForCausalLM`` (random weights, no cache) exported once by onnx_modular.
Then, each timed (median of ``--repeat``) and measured against the float32 file in onnxruntime on
the same input ids (max abs difference of the logits over their range) and by size on disk:

* float16: ``convert(dtype="float16", keep=["LlamaRMSNorm"])`` on the modular file, and
  onnxconverter-common's ``convert_float_to_float16(keep_io_types=True)`` on the flat copy
  (``onnx-modular inline``) and on the modular file itself (it leaves function bodies alone);
* int4: ``convert(quantize="int4", exclude=["lm_head"])`` on the modular file, and onnxruntime's
  ``MatMulNBitsQuantizer`` on the flat copy with the same settings (block 32, asymmetric), lm_head
  excluded by its nodes' module path.

``--latency``: run time of the int4 files (accuracy_level 0 and 4) against the float32 file, one
intra-op thread, files alternated, medians. Prints ratios against the other tools.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import _common
import numpy as np
import onnx
import onnxruntime as ort
import torch

from onnx_modular import export_modular
from onnx_modular.calls.flat import inline_model
from onnx_modular.files.convert.tool import convert
from onnx_modular.format import metadata


def build(layers: int, hidden: int, vocab: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).eval()


def session(path, threads: int = 1):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def logits(path, ids) -> np.ndarray:
    sess = session(path, threads=2)
    return sess.run(["logits"], {sess.get_inputs()[0].name: ids})[0].astype(np.float32)


def size(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.parent.iterdir() if p.name.startswith(path.stem))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4000)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--latency", action="store_true")
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()

    model = build(args.layers, args.hidden, args.vocab)
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, args.vocab, (1, args.tokens))
    with tempfile.TemporaryDirectory(prefix="bench_convert-") as scratch:
        run(args, model, params, ids, pathlib.Path(scratch))


def run(args, model, params, ids, folder: pathlib.Path) -> None:
    from onnxconverter_common import float16
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    files = {}
    for name in ("modular", "flat", "ours_f16", "occ_f16_flat", "occ_f16_modular", "ours_q4", "ort_q4_flat", "ours_q4_acc4", "ort_q4_flat_acc4"):
        (folder / name).mkdir()
        files[name] = folder / name / f"{name}.onnx"
    with _common.quiet():
        export_modular(model, (ids,), files["modular"], external_data=True)
    print(f"Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: {params / 1e6:.1f}M parameters; "
          f"{args.tokens} tokens; median of {args.repeat} conversions")
    flat = inline_model(onnx.load(str(files["modular"])))
    onnx.save(flat, str(files["flat"]), save_as_external_data=True, location="flat.data")
    feeds = ids.numpy()
    reference = logits(files["modular"], feeds)
    spread = float(reference.max() - reference.min())

    def occ(source, target):
        loaded = onnx.load(str(source))
        converted = float16.convert_float_to_float16(loaded, keep_io_types=True)
        onnx.save(converted, str(target), save_as_external_data=True, location=target.stem + ".data")
        return converted

    head = [n.name for n in flat.graph.node if {e.key: e.value for e in n.metadata_props}.get(metadata.MODULE_PATH) == "lm_head"]

    def ort_q4(target, accuracy_level=None):
        quantizer = MatMulNBitsQuantizer(onnx.load(str(files["flat"])), bits=4, block_size=32, is_symmetric=False,
                                         accuracy_level=accuracy_level, nodes_to_exclude=head)
        quantizer.process()
        onnx.save(quantizer.model.model, str(target), save_as_external_data=True, location=target.stem + ".data")

    jobs = {
        "ours_f16": lambda: convert(files["modular"], files["ours_f16"], dtype="float16", keep=["LlamaRMSNorm"]),
        "occ_f16_flat": lambda: occ(files["flat"], files["occ_f16_flat"]),
        "occ_f16_modular": lambda: occ(files["modular"], files["occ_f16_modular"]),
        "ours_q4": lambda: convert(files["modular"], files["ours_q4"], quantize="int4", exclude=["lm_head"]),
        "ort_q4_flat": lambda: ort_q4(files["ort_q4_flat"]),
    }
    if args.latency:
        jobs["ours_q4_acc4"] = lambda: convert(files["modular"], files["ours_q4_acc4"], quantize="int4", exclude=["lm_head"], accuracy_level=4)
        jobs["ort_q4_flat_acc4"] = lambda: ort_q4(files["ort_q4_flat_acc4"], accuracy_level=4)
    rows = {}
    for name, job in jobs.items():
        seconds, _ = _common.median_time(job, args.repeat)
        try:
            drift = float(np.abs(logits(files[name], feeds) - reference).max()) / spread
        except Exception as e:  # onnxruntime refuses the file
            drift = f"does not run: {str(e).splitlines()[0].split('failed:')[-1].strip()[:110]}"
        rows[name] = (seconds, size(files[name]), drift)
    base = size(files["modular"])
    print(f"{'file':<18} {'convert s':>9} {'size MB':>8} {'x f32':>6} {'logits drift (of range)':>24}")
    print(f"{'float32 modular':<18} {'':>9} {base / 1e6:8.2f} {1.0:6.2f} {0.0:24.3%}")
    for name, (seconds, bytes_, drift) in rows.items():
        shown = f"{drift:24.3%}" if isinstance(drift, float) else f"  {drift}"
        print(f"{name:<18} {seconds:9.2f} {bytes_ / 1e6:8.2f} {bytes_ / base:6.2f}{shown}")
    functions = len(onnx.load(str(files["occ_f16_modular"]), load_external_data=False).functions)
    bodies = onnx.load(str(files["occ_f16_modular"]), load_external_data=False)
    fp16_in_bodies = sum(v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 for f in bodies.functions for v in f.value_info)
    print(f"onnxconverter-common on the modular file: {functions} functions, {fp16_in_bodies} float16 values inside them")
    print(f"ratios: convert time ours_f16 / occ_f16_flat {rows['ours_f16'][0] / rows['occ_f16_flat'][0]:.2f}x, "
          f"ours_q4 / ort_q4_flat {rows['ours_q4'][0] / rows['ort_q4_flat'][0]:.2f}x; "
          f"size ours_q4 / ort_q4_flat {rows['ours_q4'][1] / rows['ort_q4_flat'][1]:.3f}x")
    if args.latency:
        names = ["modular", "ours_q4", "ort_q4_flat", "ours_q4_acc4", "ort_q4_flat_acc4"]
        sessions = {name: session(files[name]) for name in names}
        feed = {sessions["modular"].get_inputs()[0].name: feeds}
        for sess in sessions.values():
            sess.run(None, feed)
        times = {name: [] for name in names}
        for _ in range(args.runs):  # alternate the files
            for name in names:
                start = time.perf_counter()
                sessions[name].run(None, feed)
                times[name].append(time.perf_counter() - start)
        print(f"run latency, one intra-op thread, {args.runs} rounds of alternating runs "
              "(median time; median of each round's ratio to float32, robust to the shared machine's load):")
        for name in names:
            ratio = statistics.median(t / f for t, f in zip(times[name], times["modular"]))
            print(f"  {name:<18} {statistics.median(times[name]) * 1e3:8.2f} ms  {ratio:5.2f}x float32")


if __name__ == "__main__":
    main()
