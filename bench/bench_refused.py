"""Decoders onnxruntime-genai's builder refuses: our optimized file against the best file a user
could make instead, transformers' own exporter with onnxruntime's CPU fusions, on the same weights.

    python bench/bench_refused.py [--types olmo2,arcee,olmo3] [--layers 12] [--hidden 768] [--rounds 5] [--int4]

For each model type: a decoder of about 110M parameters (hidden 768, 12 layers, 12 heads, 4 KV
heads, intermediate 2048, vocabulary 32000, random weights, seed 0) is saved with
``save_pretrained`` (and a small offline tokenizer), then

- ``builder``: ``python -m onnxruntime_genai.models.builder -i CKPT -o OUT -p fp32 -e cpu``, only to
  show that it refuses the class (its error's last line is printed);
- ``transformers``: ``transformers.exporters`` ``"onnx"`` with ``OnnxConfig(dynamic=True,
  ort_fusions="cpu")`` (torch's exporter, onnxscript's optimizer, onnxscript's onnxruntime fusions:
  RMS norm, skip norm, rotary, attention where its patterns match), exported with a past;
- ``ours``: ``onnx-modular export CKPT --task causal-lm-with-past --io-names optimum`` (``export CKPT
  --genai``'s model for a sliding-window model, which that export refuses);
- ``ours_opt``: ``onnx-modular optimize`` of that file.

Then ``bench/bench_decode.py`` on the three files (``transformers`` first: the ratios are to it):
kernels per decode step, per-token decode at past 16 and 64, prefill of 128 tokens, one intra-op
thread, the files taking turns run by run, medians; and 16 greedy tokens of each against the
transformers file's. With ``--int4`` the same again on the files quantized with the builder's int4
settings: ours through ``onnx-modular convert --quantize int4 --symmetric --accuracy-level 4
--block-size 32``, transformers' file through onnxruntime's ``MatMulNBitsQuantizer`` with the same
settings (what a user of that file would run).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import torch
import transformers

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


def checkpoint(folder: pathlib.Path, model_type: str, layers: int, hidden: int) -> transformers.PreTrainedModel:
    from test_genai import _tokenizer

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    config.architectures = [type(model).__name__]
    print(f"{model_type}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters",
          flush=True)
    model.save_pretrained(folder)
    _tokenizer(folder)
    return model


def builder_refusal(ckpt: pathlib.Path, out: pathlib.Path) -> str:
    run = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(out),
                          "-p", "fp32", "-e", "cpu"], capture_output=True, text=True)
    if run.returncode == 0:
        return "builds it"
    lines = [line for line in run.stderr.splitlines() if "Error" in line]
    return "refuses: " + (lines[-1] if lines else run.stderr.strip().splitlines()[-1])[:200]


def transformers_file(model, out: pathlib.Path) -> pathlib.Path:
    from transformers.exporters.auto import get_exporter_class
    from transformers.exporters.configs import OnnxConfig

    config = model.config
    prompt = torch.randint(0, config.vocab_size, (2, 4))
    with torch.no_grad():
        past = model(prompt, use_cache=True, past_key_values=transformers.DynamicCache(config=config)).past_key_values
    inputs = {"input_ids": torch.randint(0, config.vocab_size, (2, 3)), "attention_mask": torch.ones(2, 7, dtype=torch.long),
              "past_key_values": past, "use_cache": True}  # sizes other than 1: every axis stays dynamic
    exporter = get_exporter_class("onnx")()
    exporter.export(model, inputs, OnnxConfig(dynamic=True, ort_fusions="cpu")).save_pretrained(out)
    return out / "model.onnx"


def quantize_transformers_file(path: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    import logging

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)

    quantizer = MatMulNBitsQuantizer(onnx.load(str(path)), block_size=32, is_symmetric=True, accuracy_level=4)
    quantizer.process()
    quantizer.model.save_model_to_file(str(target), use_external_data_format=True)
    return target


def export_with_past(root: pathlib.Path) -> pathlib.Path:
    """``export --task causal-lm-with-past --io-names optimum``; for a sliding-window model, whose
    transformers cache that export refuses, the model of ``export --genai`` (every position's keys and
    values kept, the window in the mask; the same names, and ``position_ids``)."""
    try:
        cli("export", str(root / "ckpt"), "--task", "causal-lm-with-past", "--io-names", "optimum",
            "-o", str(root / "ours.onnx"))
        return root / "ours.onnx"
    except subprocess.CalledProcessError as error:
        print(f"  ours: export --task causal-lm-with-past refused ({error.stderr.strip().splitlines()[-1][:160]}); "
              "export --genai instead", flush=True)
    cli("export", str(root / "ckpt"), "--genai", "-o", str(root / "genai"))
    return root / "genai" / "model.onnx"


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "onnx_modular", *args], check=True, capture_output=True, text=True)


def bench(files: dict[str, pathlib.Path], rounds: int) -> None:
    subprocess.run([sys.executable, str(HERE / "bench_decode.py"), *(f"{n}={p}" for n, p in files.items()),
                    "--rounds", str(rounds), "--greedy", "16"], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="olmo2,arcee,olmo3")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--int4", action="store_true")
    args = parser.parse_args()
    for model_type in args.types.split(","):
        with tempfile.TemporaryDirectory(prefix=f"bench_refused_{model_type}_") as tmp:
            root = pathlib.Path(tmp)
            model = checkpoint(root / "ckpt", model_type, args.layers, args.hidden)
            print(f"  builder: {builder_refusal(root / 'ckpt', root / 'builder')}", flush=True)
            start = time.perf_counter()
            files = {"transformers": transformers_file(model, root / "transformers")}
            print(f"  transformers' exporter (ort_fusions='cpu'): {time.perf_counter() - start:.0f}s", flush=True)
            del model
            try:
                ours = export_with_past(root)
                cli("optimize", str(ours), "-o", str(root / "ours.opt.onnx"), "--max-positions", "2048",
                    "--json", str(root / "optimize.json"))
            except subprocess.CalledProcessError as error:
                print(f"  ours: failed: {error.stderr.strip().splitlines()[-1] if error.stderr else error}", flush=True)
                continue
            report = json.loads((root / "optimize.json").read_text())
            unfused = {f["module_class"]: f["reason"] for f in report["fusions"] if not f["fused"]}
            print(f"  optimize: attention {report['attention']}, fused {report['fused_classes']}"
                  + (f", left {unfused}" if unfused else ""), flush=True)
            files.update(ours=ours, ours_opt=root / "ours.opt.onnx")
            bench(files, args.rounds)
            if args.int4:
                quantized = {"transformers": quantize_transformers_file(files["transformers"], root / "transformers.q4.onnx")}
                for name in ("ours", "ours_opt"):
                    target = root / f"{name}.q4.onnx"
                    cli("convert", str(files[name]), "-o", str(target), "--quantize", "int4", "--symmetric",
                        "--accuracy-level", "4", "--block-size", "32", "--no-verify")
                    quantized[name] = target
                print("  int4:", flush=True)
                bench(quantized, args.rounds)


if __name__ == "__main__":
    main()
