"""Our int4 files against onnxruntime-genai's builder's, on a decoder trained here: KL, top-1, perplexity, bytes, decode.

For each shape (``--shapes llama qwen3 phi3``) the decoder of ``onnx_modular.hf.trained`` (``bench``
size: hidden 192, 4 layers, byte vocabulary, trained on ``pydoc_data.topics``; cached) is

* exported with its cache (``export --task causal-lm-with-past --io-names optimum``): the float file;
* built by the builder: ``python -m onnxruntime_genai.models.builder -i CKPT -o DIR -p int4 -e cpu``
  (its default, RTN) and with ``--extra_options algo_config=k_quant_mixed``;
* made by us: ``optimize --quantize int4`` (the builder's recipe, uniform) and
  ``optimize --quantize auto --calibration calib.npz`` (calibration: 8 windows of 128 bytes of the training text),
  within the uniform int4 file's size (the default) and within 1.02x the builder's file (``--max-size BYTES``).

Every file is measured against the float file on held-out text (16 windows of 128 bytes the model
never saw, ``onnx_modular.quality``): mean next-token KL, top-1 agreement, perplexity; bytes are
the model and its data file. Then per-token decode of ``auto`` against the builder's default in
plain onnxruntime (``auto`` within 1.02x the builder's bytes; ``bench_decode.py``: one intra-op thread, the two files taking turns, medians).

    python bench/bench_quality.py [--shapes llama qwen3 phi3] [--keep DIR] [--rounds 5]

The machine is shared: read the ratios, not the milliseconds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _builder(checkpoint: str, out: str, extra: list[str]) -> str:
    if not os.path.exists(os.path.join(out, "model.onnx")):
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", checkpoint, "-o", out, "-p", "int4",
                        "-e", "cpu", *extra], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return os.path.join(out, "model.onnx")


def _files(shape: str, folder: str) -> dict[str, str]:
    from onnx_modular import optimize
    from onnx_modular.cli import main as cli
    from onnx_modular.hf.trained import calibration_ids, trained_checkpoint

    checkpoint = str(trained_checkpoint(shape, "bench"))
    os.makedirs(folder, exist_ok=True)
    exported = os.path.join(folder, "m.onnx")
    if not os.path.exists(exported):
        assert cli(["export", checkpoint, "--task", "causal-lm-with-past", "--io-names", "optimum", "-o", exported,
                    "--no-verify"]) == 0
    calibration = os.path.join(folder, "calib.npz")
    np.savez(calibration, input_ids=calibration_ids(count=8, length=128))
    files = {"float": exported,
             "builder int4": _builder(checkpoint, os.path.join(folder, "builder"), []),
             "builder k_quant_mixed": _builder(checkpoint, os.path.join(folder, "builder_kqm"),
                                               ["--extra_options", "algo_config=k_quant_mixed"])}
    from onnx_modular.check.quality import file_bytes

    budget = str(int(file_bytes(files["builder int4"]) * 1.02))
    for name, options in (("ours int4", {"quantize": "int4"}), ("ours auto", {"quantize": "auto", "calibration": calibration}),
                          ("ours auto 1.02x builder", {"quantize": "auto", "calibration": calibration, "max_size": budget})):
        path = os.path.join(folder, name.replace(" ", "_") + ".onnx")
        if not os.path.exists(path):
            report = optimize(exported, path, max_positions=512, **options)
            print(report.quantization.text(), flush=True)
        files[name] = path
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["llama", "qwen3", "phi3"])
    parser.add_argument("--keep", default=None, metavar="DIR", help="build the files in DIR and keep them (reused when there)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()

    from onnx_modular import quality
    from onnx_modular.hf.trained import held_out_ids

    root = args.keep or tempfile.mkdtemp(prefix="bench_quality-")
    held = held_out_ids(count=16, length=128)
    for shape in args.shapes:
        files = _files(shape, os.path.join(root, shape))
        base = None
        print(f"\n{shape} (held-out text: {held.size} positions)")
        print(f"{'file':<24}{'KL (nats)':>12}{'top-1':>9}{'perplexity':>12}{'bytes':>12}{'bytes/builder':>15}")
        for name, path in files.items():
            report = quality(path, files["float"], held)
            base = base or (report.bytes if name == "builder int4" else None)
            ratio = f"{report.bytes / base:.3f}x" if base else ""
            print(f"{name:<24}{report.kl_mean:>12.3g}{report.top1:>9.2%}{report.perplexity:>12.4f}{report.bytes:>12,}{ratio:>15}",
                  flush=True)
        if args.rounds:
            subprocess.run([sys.executable, os.path.join(HERE, "bench_decode.py"), f"builder={files['builder int4']}",
                            f"auto={files['ours auto 1.02x builder']}", "--past", "16", "64", "--prefill", "0", "--vocab", "256",
                            "--head-size", "32", "--rounds", str(args.rounds), "--runs", str(args.runs)], check=True)


if __name__ == "__main__":
    main()
