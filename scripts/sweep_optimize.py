#!/usr/bin/env python
"""Sweep the coverage catalogue's causal-LM rows through ``optimize``: each row's tiny model
(the catalogue's config (``tests/catalogue/``), random weights, seed 0) saved with
``save_pretrained``, exported with past (the ``export --genai`` export: whole keys and values per
layer, a sliding window masked in the graph; when genai refuses the model, ``export --task
causal-lm-with-past --io-names optimum``), then :func:`onnx_modular.optimize` (each step verified
in onnxruntime), then a few greedy tokens of the optimized file (:func:`onnx_modular.generate`)
against ``model.generate``. Each row runs in a child process with a time limit and is appended to
``docs/coverage-optimize.json`` as it ends (``--resume`` keeps the rows there).

    python scripts/sweep_optimize.py [--budget-minutes 60] [--timeout 240] [--resume] [--types llama,olmo3]
    python scripts/sweep_optimize.py --resume --redo-outcomes error,crash --redo-classes Gemma2ForCausalLM
    python scripts/sweep_optimize.py --resume --redo-outcomes export-error --types bert,roberta

Outcomes: ``fused`` (attention became GroupQueryAttention, tokens equal), ``unfused`` (optimize ran;
attention left, its reason recorded), ``differ`` (the optimized file's tokens are not generate's),
``crash`` (optimize raised: a bug, optimize must leave a body it cannot fuse as it is),
``export-error`` (no file to optimize), ``timeout``. The totals count rows with fused attention
against onnxruntime-genai's builder classes (``sweep_genai.BUILDER_CLASSES``) and the model types of
onnxruntime's transformers optimizer (``MODEL_TYPES``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import pathlib
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))  # the catalogue of models (tests/catalogue/)
OUT = ROOT / "docs" / "coverage-optimize.json"
GENAI = ROOT / "docs" / "coverage-genai.json"

from sweep_genai import BUILDER_CLASSES, run_row  # noqa: E402


def _ort_optimizer_types() -> frozenset[str]:
    """The model types of onnxruntime's transformers optimizer (``onnxruntime.transformers.optimizer.MODEL_TYPES``:
    19 in onnxruntime 1.32), whose fusions are written per type."""
    from onnxruntime.transformers.optimizer import MODEL_TYPES

    return frozenset(MODEL_TYPES)


ORT_OPTIMIZER_TYPES = _ort_optimizer_types()

PROMPT = [5, 9, 13, 7, 3, 11]
NEW_TOKENS = 4


def _export(ckpt: pathlib.Path, out: pathlib.Path) -> tuple[pathlib.Path, str, str | None]:
    """The with-past file: genai's export when genai drives the model, else the optimum one."""
    from onnx_modular.cli import main as cli
    from onnx_modular.files.genai_config import GenaiError
    from onnx_modular.hf.genai import export_genai

    try:
        export_genai(ckpt, out / "genai", verify=False, check=False)
        return out / "genai" / "model.onnx", "genai", None
    except GenaiError as refused:
        path = out / "m.onnx"
        errors = io.StringIO()
        with contextlib.redirect_stderr(errors):
            code = cli(["export", str(ckpt), "--task", "causal-lm-with-past", "-o", str(path), "--io-names", "optimum",
                        "--no-verify"])
        if code != 0 or not path.exists():
            # the fallback's own reason first (the row keeps the first line), then genai's
            lines = errors.getvalue().splitlines()
            said = next((line[len("error: "):] for line in lines if line.startswith("error:")), f"exited with {code}")
            tried = next((line.rsplit("; ", 1)[-1] for line in lines if line.startswith("Capture strategies tried:")), "")
            raise RuntimeError(f"export --task causal-lm-with-past: {said}{f' [last: {tried}]' if tried else ''} "
                               f"(genai: {str(refused).splitlines()[0][:150]})") from None
        return path, "optimum", str(refused).splitlines()[0][:200]


def _row(model_type: str, class_name: str, queue) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import transformers
    from catalogue import building

    import onnx_modular

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    started = time.perf_counter()
    result = {"model_type": model_type, "class_name": class_name, "builder": class_name in BUILDER_CLASSES,
              "ort_optimizer": model_type in ORT_OPTIMIZER_TYPES}
    stage = "build"
    try:
        model = building.build(model_type, class_name)[0].eval()
        config = model.config.get_text_config()
        if getattr(config, "eos_token_id", None) is None and getattr(model.generation_config, "eos_token_id", None) is None:
            model.generation_config.eos_token_id = config.vocab_size - 1  # genai's export needs one (as sweep_genai)
        with tempfile.TemporaryDirectory() as tmp:
            tmp = pathlib.Path(tmp)
            model.config.architectures = [class_name]
            model.save_pretrained(tmp / "ckpt")
            torch.manual_seed(0)
            stage = "export"
            path, result["export"], genai_refused = _export(tmp / "ckpt", tmp)
            if genai_refused:
                result["genai_refused"] = genai_refused
            stage = "optimize"
            report = onnx_modular.optimize(path, tmp / "opt.onnx", max_positions=64)
            attention = [f for f in report.fusions if f.step == "attention"]
            result.update(
                steps={step: sorted({f.module_class for f in report.fusions if f.fused and f.step == step})
                       for step in ("rms_norm", "skip_norm", "attention")},
                attention=report.attention,
                attention_reasons=sorted({f"{f.module_class}: {f.reason}" for f in attention if not f.fused}),
                max_abs_diff=max([f.max_abs_diff for f in report.fusions if f.fused and f.max_abs_diff is not None],
                                 default=None),
                nodes=[report.nodes_before, report.nodes_after],
            )
            stage = "generate"
            vocab = model.config.get_text_config().vocab_size
            prompt = [t % vocab for t in PROMPT]
            got = onnx_modular.generate(tmp / "opt.onnx", [prompt], NEW_TOKENS)[0].tolist()
        # the model's own generation settings out of the way (Marian's bad_words_ids, forced tokens):
        # the loop of onnx_modular.generate applies none of them
        settings = transformers.GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=NEW_TOKENS,
                                                 min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
        model.generation_config = settings
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), generation_config=settings)[0].tolist()
        result["tokens_equal"] = got == expected
        if not result["tokens_equal"]:
            result["outcome"] = "differ"
        else:
            result["outcome"] = "fused" if report.attention else "unfused"
    except Exception as e:  # the row records it
        outcome = {"build": "export-error", "export": "export-error", "optimize": "crash"}.get(stage, "error")
        result.update(outcome=outcome, stage=stage,
                      error=f"{type(e).__name__}: {str(e).splitlines()[0][:600] if str(e) else ''}",
                      where=[line[:200] for line in traceback.format_exc().splitlines()[-5:-1]])
    result["seconds"] = round(time.perf_counter() - started, 1)
    queue.put(result)


def _warm_up() -> None:
    """Imports paid once in this process: the children are forked from it."""
    import warnings

    warnings.filterwarnings("ignore")
    import catalogue.building  # noqa: F401
    import onnxruntime  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import onnx_modular
    import onnx_modular.cli
    import onnx_modular.files.optimize.tool
    import onnx_modular.hf.genai  # noqa: F401


def _totals(rows: list[dict]) -> dict:
    totals: dict = {}
    for row in rows:
        totals[row["outcome"]] = totals.get(row["outcome"], 0) + 1
    fused = [r for r in rows if r["outcome"] == "fused"]
    totals["attention_fused"] = len(fused)
    totals["attention_fused_builder_classes"] = sum(r["builder"] for r in fused)
    totals["attention_fused_not_builder"] = sum(not r["builder"] for r in fused)
    totals["attention_fused_ort_optimizer_types"] = sum(r["ort_optimizer"] for r in fused)
    totals["builder_classes_in_rows"] = sum(r["builder"] for r in rows)
    totals["ort_optimizer_types_in_rows"] = sum(r["ort_optimizer"] for r in rows)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-minutes", type=float, default=60)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--types", default=None,
                        help="sweep only these model types (comma-separated); with --resume and --redo-*, "
                             "the other types' rows are kept as they are")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--genai-first", action=argparse.BooleanOptionalAction, default=True,
                        help="sweep first the rows scripts/sweep_genai.py ran through genai (docs/coverage-genai.json)")
    parser.add_argument("--redo-classes", default=None, help="with --resume: sweep these classes (comma-separated) again")
    parser.add_argument("--redo-outcomes", default=None, help="with --resume: sweep rows with these outcomes again")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    catalogue = json.loads((ROOT / "docs" / "coverage.json").read_text())["rows"]
    rows = [(r["model_type"], r["class_name"]) for r in catalogue if r["task"] == "causal-lm" and r["modular_ok"]]
    planned = len(rows)  # the catalogue's rows, whatever --types sweeps this time
    types = set(args.types.split(",")) if args.types else None
    if types:
        rows = [r for r in rows if r[0] in types]
    done = json.loads(out.read_text())["rows"] if args.resume and out.exists() else []
    redo, outcomes = set((args.redo_classes or "").split(",")), set((args.redo_outcomes or "").split(","))
    # a row is swept again when --redo-* names it and --types (if given) takes it; the others are kept
    done = [r for r in done if (r["class_name"] not in redo and r["outcome"] not in outcomes)
            or (types is not None and r["model_type"] not in types)]
    seen = {(r["model_type"], r["class_name"]) for r in done}
    if args.genai_first and GENAI.exists():  # the rows genai's sweep drove first: decoders with a KV cache
        drivable = {r["class_name"] for r in json.loads(GENAI.read_text())["rows"] if r["outcome"] == "ok"}
        rows.sort(key=lambda r: r[1] not in drivable)
    deadline = time.time() + args.budget_minutes * 60
    _warm_up()
    context = multiprocessing.get_context("fork")
    for model_type, class_name in rows:
        if (model_type, class_name) in seen:
            continue
        if time.time() > deadline:
            break
        base = {"model_type": model_type, "class_name": class_name, "builder": class_name in BUILDER_CLASSES,
                "ort_optimizer": model_type in ORT_OPTIMIZER_TYPES}
        result = run_row(context, _row, model_type, class_name, args.timeout, base)
        done.append(result)
        print(json.dumps(result), flush=True)
        out.write_text(json.dumps({"planned": planned, "totals": _totals(done), "rows": done}, indent=1) + "\n")
    print(json.dumps(_totals(done), indent=1))


if __name__ == "__main__":
    main()
