"""transformers' exporters: the "onnx_modular" format against the built-in "onnx" format.

Same random-weight Llama, same sample inputs, same config (dynamic=True), in one run: export time
(onnx_modular's includes its parity check on the final program), file size, and onnxruntime
latency with one intra-op thread, the two files alternating, medians of many runs.

    PYTHONPATH=. python bench/bench_hf_backend.py [--layers 4] [--hidden 256] [--runs 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import _common  # noqa: F401  (quiet logging and warnings)
import onnxruntime as ort
import torch
import transformers
from transformers.exporters.auto import get_exporter_class

import onnx_modular.hf  # noqa: F401


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--runs", type=int, default=200)
    options = parser.parse_args()
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=options.hidden, intermediate_size=options.hidden * 2,
        num_hidden_layers=options.layers, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 1000, (2, 16))

    def inputs():
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}

    files, export_seconds = {}, {}
    folder = tempfile.mkdtemp(prefix="bench_hf_")
    for export_format in ("onnx", "onnx_modular"):
        exporter = get_exporter_class(export_format)()
        start = time.perf_counter()
        exported = exporter.export(model, inputs(), exporter.config_class(dynamic=True))
        export_seconds[export_format] = time.perf_counter() - start
        exported.save_pretrained(os.path.join(folder, export_format))
        files[export_format] = os.path.join(folder, export_format, "model.onnx")

    options_ = ort.SessionOptions()
    options_.intra_op_num_threads = 1
    options_.log_severity_level = 3
    sessions = {name: ort.InferenceSession(path, options_, providers=["CPUExecutionProvider"]) for name, path in files.items()}
    feeds = {"input_ids": ids.numpy(), "attention_mask": torch.ones_like(ids).numpy()}
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for session in sessions.values():
        session.run(None, feeds)
    for _ in range(options.runs):  # alternate the two files
        for name, session in sessions.items():
            start = time.perf_counter()
            session.run(None, feeds)
            times[name].append(time.perf_counter() - start)

    def size(path):
        return sum(os.path.getsize(p) for p in (path, path + ".data") if os.path.exists(p))

    print(f"Llama {options.layers} layers, hidden {options.hidden}, input [2, 16], dynamic=True")
    print(f"{'format':<14}{'export s':>10}{'size MB':>10}{'ORT ms (median)':>18}")
    for name in sessions:
        print(f"{name:<14}{export_seconds[name]:>10.2f}{size(files[name]) / 1e6:>10.2f}"
              f"{statistics.median(times[name]) * 1e3:>18.3f}")
    flat, modular = "onnx", "onnx_modular"
    print(f"ratios onnx_modular/onnx: export {export_seconds[modular] / export_seconds[flat]:.2f}x, "
          f"latency {statistics.median(times[modular]) / statistics.median(times[flat]):.2f}x")


if __name__ == "__main__":
    main()
