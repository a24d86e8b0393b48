#!/usr/bin/env python
"""Sweep the coverage catalogue's causal-LM rows through ``export --genai``: each row's tiny
model (the catalogue's config (``tests/catalogue/``), random weights, seed 0) saved with
``save_pretrained``, exported with :func:`onnx_modular.hf.genai.export_genai` (parity checked),
then run through onnxruntime-genai's ``Generator`` (greedy, 20 new tokens) against
``model.generate``. Each row runs in a child process with a time limit and is appended to
``docs/coverage-genai.json`` as it ends (``--resume`` keeps the rows there).

    python scripts/sweep_genai.py [--budget-minutes 60] [--timeout 240] [--resume] [--types llama,olmo3]
    python scripts/sweep_genai.py --resume --redo-classes BartForCausalLM,Gemma4ForCausalLM

Outcomes: ``ok`` (genai's tokens equal generate's), ``differ``, ``refused`` (a GenaiError: what
genai lacks), ``error`` (the export or the check failed otherwise), ``timeout``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pathlib
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the catalogue of models (tests/catalogue/)
OUT = ROOT / "docs" / "coverage-genai.json"

#: Builder classes of onnxruntime-genai 0.18 (``onnxruntime_genai/models/builder.py`` dispatches on
#: ``config.architectures[0]``), the causal LMs among them.
BUILDER_CLASSES = frozenset({
    "ChatGLMForConditionalGeneration", "ChatGLMModel", "Ernie4_5ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
    "Gemma3ForCausalLM", "GptOssForCausalLM", "GraniteForCausalLM", "GraniteMoeHybridForCausalLM",
    "HunYuanDenseV1ForCausalLM", "InternLM2ForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "LlamaForCausalLM",
    "MistralForCausalLM", "NemotronForCausalLM", "OlmoForCausalLM", "PhiForCausalLM", "Phi3ForCausalLM",
    "PhiMoEForCausalLM", "Phi3SmallForCausalLM", "Phi3VForCausalLM", "Phi4MMForCausalLM", "Qwen2ForCausalLM",
    "Qwen3ForCausalLM", "SmolLM3ForCausalLM", "VideoChatFlashQwenForCausalLM",
})


def _row(model_type: str, class_name: str, queue) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import transformers
    from catalogue import building

    from onnx_modular.files.genai_config import GenaiError
    from onnx_modular.hf.genai import export_genai

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    started = time.perf_counter()
    result = {"model_type": model_type, "class_name": class_name, "builder": class_name in BUILDER_CLASSES}
    try:
        model = building.build(model_type, class_name)[0]
        config = model.config.get_text_config()
        if getattr(config, "eos_token_id", None) is None and getattr(model.generation_config, "eos_token_id", None) is None:
            model.generation_config.eos_token_id = config.vocab_size - 1  # genai needs one; the check stops at it
            result["note"] = "eos_token_id set to vocab_size - 1"
        with tempfile.TemporaryDirectory() as tmp:
            model.config.architectures = [class_name]
            model.save_pretrained(pathlib.Path(tmp) / "ckpt")
            del model
            torch.manual_seed(0)
            folder = export_genai(pathlib.Path(tmp) / "ckpt", pathlib.Path(tmp) / "genai")
        check = folder.check
        result.update(outcome="ok" if check.ok else "differ", equal=check.equal,
                      generated=len(check.transformers) - len(check.prompt), type=check.model_type)
    except GenaiError as e:
        result.update(outcome="refused", error=str(e).splitlines()[0][:300])
    except Exception as e:  # the row records it
        outcome = "differ" if "differ from transformers' generate" in str(e) else "error"
        result.update(outcome=outcome, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                      where=traceback.format_exc().splitlines()[-3][:200])
    result["seconds"] = round(time.perf_counter() - started, 1)
    queue.put(result)


def run_row(context, target, model_type: str, class_name: str, timeout: float, base: dict) -> dict:
    """``target(model_type, class_name, queue)`` in a child process of ``context``: the row it put on the
    queue, or ``base`` with outcome ``timeout`` (killed after ``timeout`` seconds) or ``error``."""
    queue = context.Queue()
    child = context.Process(target=target, args=(model_type, class_name, queue))
    child.start()
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
        return {**base, "outcome": "timeout", "seconds": timeout}
    return queue.get() if not queue.empty() else {**base, "outcome": "error", "error": f"child exited with {child.exitcode}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-minutes", type=float, default=60)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--types", default=None)
    parser.add_argument("--redo-classes", default=None, help="with --resume: sweep these classes (comma-separated) again")
    args = parser.parse_args()
    catalogue = json.loads((ROOT / "docs" / "coverage.json").read_text())["rows"]
    rows = [(r["model_type"], r["class_name"]) for r in catalogue if r["task"] == "causal-lm" and r["modular_ok"]]
    if args.types:
        rows = [r for r in rows if r[0] in args.types.split(",")]
    done = json.loads(OUT.read_text())["rows"] if args.resume and OUT.exists() else []
    redo = set((args.redo_classes or "").split(","))
    done = [r for r in done if r["class_name"] not in redo]
    seen = {(r["model_type"], r["class_name"]) for r in done}
    deadline = time.time() + args.budget_minutes * 60
    context = multiprocessing.get_context("spawn")
    for model_type, class_name in rows:
        if (model_type, class_name) in seen:
            continue
        if time.time() > deadline:
            break
        base = {"model_type": model_type, "class_name": class_name, "builder": class_name in BUILDER_CLASSES}
        result = run_row(context, _row, model_type, class_name, args.timeout, base)
        done.append(result)
        print(json.dumps(result), flush=True)
        totals: dict[str, int] = {}
        for row in done:
            totals[row["outcome"]] = totals.get(row["outcome"], 0) + 1
        OUT.write_text(json.dumps({"planned": len(rows), "totals": totals, "rows": done}, indent=1) + "\n")


if __name__ == "__main__":
    main()
