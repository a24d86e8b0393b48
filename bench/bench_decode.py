"""Decode and prefill speed of decoder files in plain onnxruntime, side by side in one run.

Files are named on the command line (``NAME=PATH``, the first is the baseline of the ratios);
each must take ``input_ids``, ``attention_mask`` and ``past_key_values.N.key|value`` (our
``export --task causal-lm-with-past --io-names optimum``, ``onnx-modular optimize``'s file, and
onnxruntime-genai's builder file all do) or ``input.past_key_values.layers.N.keys|values``
(transformers' own exporter, ``transformers.exporters``). One intra-op thread, sequential execution; the files
take turns run by run (``--rounds`` x ``--runs`` runs each, the order rotated every turn: a file run second in a turn runs
2-20% faster, so each file takes each place equally often), so that
a change of the machine's load hits every file alike; the result is the median of each file's runs (``--low``: also
the 10th percentile, the runs that had a core to themselves on a machine shared with other jobs). Kernels per token: the nodes of onnxruntime's optimized model
(``SessionOptions.optimized_model_filepath``) of each file.

    python bench/bench_decode.py builder=b/model.onnx ours=m.onnx ours_opt=m.opt.onnx --past 16 64

The machine is shared: read the ratios, not the milliseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import _common
import numpy as np
import onnx
import onnxruntime as ort


def _session(path: str, optimized: str | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    if optimized:
        options.optimized_model_filepath = optimized
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def _kernels(path: str) -> int:
    with tempfile.TemporaryDirectory() as folder:
        target = os.path.join(folder, "optimized.onnx")
        _session(path, target)
        return len(onnx.load(target, load_external_data=False).graph.node)


#: The window fed to transformers' files of sliding-window models (transformers' default for Olmo3,
#: wider than any case here, so that every file computes the same).
SLIDING_WINDOW = 4096


def _static(dim, default: int | None) -> int:
    """A cache axis: a number, a symbol spelled as one (transformers' exporter names its KV heads ``"4"``), or
    ``default``."""
    if isinstance(dim, int):
        return dim
    if isinstance(dim, str) and dim.isdigit():
        return int(dim)
    if default is None:
        raise SystemExit(f"bench_decode: the cache's head count is symbolic ({dim!r})")
    return default


def _feeds(session: ort.InferenceSession, past: int, length: int, vocab: int, head_size: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in session.get_inputs():
        if value.name == "input_ids":
            feeds[value.name] = rng.integers(0, vocab, (1, length)).astype(np.int64)
        elif value.name == "attention_mask":
            feeds[value.name] = np.ones((1, past + length), np.int64)
        elif value.name == "position_ids":  # onnxruntime-genai folders of models that take them
            feeds[value.name] = np.arange(past, past + length, dtype=np.int64)[None]
        elif value.name.endswith("_sliding_window_tensor"):  # transformers' exporter: a sliding layer's window
            feeds[value.name] = np.array(SLIDING_WINDOW, np.int64)
        elif "past_key_values" in value.name:
            heads = _static(value.shape[1], None)
            size = _static(value.shape[3], head_size)  # the builder's 'kv_cache_dim'
            feeds[value.name] = rng.standard_normal((1, heads, past, size)).astype(np.float32)
        else:
            raise SystemExit(f"bench_decode: no feed for input {value.name!r}")
    return feeds


def _present(past: str, outputs: dict) -> str:
    """The output that carries a past input's next value: ``present.N.key`` (ours, the builder's) or
    ``output.past_key_values.layers.N.keys`` for ``input.past_key_values.layers.N.keys`` (transformers' exporter)."""
    for name in (past.replace("past_key_values", "present"), past.replace("input.", "output.", 1)):
        if name in outputs:
            return name
    raise SystemExit(f"bench_decode: no output carries {past!r} on")


def _greedy(session: ort.InferenceSession, prompt: np.ndarray, steps: int, head_size: int) -> list[int]:
    names = [o.name for o in session.get_outputs()]
    names_in = {i.name for i in session.get_inputs()}
    feeds = _feeds(session, 0, prompt.shape[1], 1, head_size)
    feeds["input_ids"] = prompt
    tokens = []
    for _ in range(steps):
        outputs = dict(zip(names, session.run(None, feeds)))
        token = int(outputs["logits"][0, -1].argmax())
        tokens.append(token)
        past = {n: outputs[_present(n, outputs)] for n in feeds if "past_key_values" in n}
        length = next(iter(past.values())).shape[2] + 1
        feeds = {"input_ids": np.array([[token]], np.int64), "attention_mask": np.ones((1, length), np.int64), **past}
        if "position_ids" in names_in:
            feeds["position_ids"] = np.array([[length - 1]], np.int64)
    return tokens


def _generate(checkpoint: str, prompt: np.ndarray, steps: int) -> list[int]:
    """transformers' greedy tokens on the checkpoint (float32, eager)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.from_numpy(prompt), do_sample=False, max_new_tokens=steps, min_new_tokens=steps,
                             eos_token_id=None, pad_token_id=0)
    return [int(t) for t in out[0, prompt.shape[1]:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", metavar="NAME=PATH")
    parser.add_argument("--past", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--prefill", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--head-size", type=int, default=None,
                        help="for cache inputs whose head size is symbolic (default: another file's static head size, else 64)")
    parser.add_argument("--greedy", type=int, default=0, metavar="N",
                        help="also generate N greedy tokens from a 16-token prompt and report agreement with the first file")
    parser.add_argument("--low", action="store_true",
                        help="also print each case's 10th percentile (a machine shared with other jobs: the runs that got a core)")
    parser.add_argument("--checkpoint", metavar="CKPT",
                        help="with --greedy: also compare every file's tokens with transformers' generate on CKPT")
    args = parser.parse_args()
    files = dict(item.split("=", 1) for item in args.files)
    sessions = {name: _session(path) for name, path in files.items()}
    if args.head_size is None:  # the builder's 'kv_cache_dim' is symbolic: ours states it
        static = [v.shape[3] for s in sessions.values() for v in s.get_inputs() if "past_key_values" in v.name
                  and isinstance(v.shape[3], int)]
        args.head_size = static[0] if static else 64
    kernels = {name: _kernels(path) for name, path in files.items()}
    cases = [(f"decode past {p}", p, 1, args.runs) for p in args.past]
    if args.prefill:
        cases.append((f"prefill {args.prefill}", 0, args.prefill, max(3, args.runs // 5)))
    names = list(files)
    if args.greedy:
        prompt = np.random.default_rng(1).integers(0, args.vocab, (1, 16)).astype(np.int64)
        generated = {n: _greedy(s, prompt, args.greedy, args.head_size) for n, s in sessions.items()}
        for name in names[1:]:
            same = sum(a == b for a, b in zip(generated[name], generated[names[0]]))
            first = next((i for i, (a, b) in enumerate(zip(generated[name], generated[names[0]])) if a != b), None)
            print(f"greedy tokens {name} vs {names[0]}: {same}/{args.greedy} equal"
                  + (f" (first difference at token {first})" if first is not None else ""))
        if args.checkpoint:
            expected = _generate(args.checkpoint, prompt, args.greedy)
            for name in names:
                same = sum(a == b for a, b in zip(generated[name], expected))
                print(f"greedy tokens {name} vs transformers' generate: {same}/{args.greedy} equal", flush=True)
    if args.rounds == 0:
        return
    print(f"onnxruntime {ort.__version__}, 1 intra-op thread, files taking turns run by run, "
          f"{args.rounds * args.runs} runs each (prefill: {args.rounds * max(3, args.runs // 5)}), medians")
    print("kernels per run (onnxruntime's optimized graph): " + ", ".join(f"{n} {kernels[n]}" for n in names))
    width = max(len(n) for n in names) + 5
    ratio_width = width + len(names[0]) + 2
    print(f"{'case':<18}" + "".join(f"{n + ' ms':>{width}}" for n in names)
          + "".join(f"{n + '/' + names[0]:>{ratio_width}}" for n in names[1:]))
    for label, past, length, runs in cases:
        feeds = {n: _feeds(s, past, length, args.vocab, args.head_size) for n, s in sessions.items()}
        for name in names:  # warm-up
            sessions[name].run(None, feeds[name])
        times = {n: [] for n in names}
        for index in range(args.rounds * runs):  # one run of each file in turn: the same load for all
            shift = index % len(names)  # rotated, so that each file takes each place in the turn equally often
            order = names[shift:] + names[:shift]
            for name in order:
                times[name].append(_common.run_latency(sessions[name], feeds[name], 1, warmup=False))
        rows = [(label, {n: statistics.median(v) * 1e3 for n, v in times.items()})]
        if args.low:
            rows.append((label + " p10", {n: statistics.quantiles(v, n=10)[0] * 1e3 for n, v in times.items()}))
        for row, values in rows:
            ratios = "".join(f"{values[n] / values[names[0]]:>{ratio_width - 1}.2f}x" for n in names[1:])
            print(f"{row:<18}" + "".join(f"{values[n]:>{width}.2f}" for n in names) + ratios, flush=True)


if __name__ == "__main__":
    main()
