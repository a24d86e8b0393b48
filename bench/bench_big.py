"""Big Llama-shaped models (1B, 3B, 8B) exported from safetensors, weights streamed.

For each size: random weights are written to a sharded safetensors folder (with
``config.json`` and ``model.safetensors.index.json``, as ``save_pretrained`` writes them),
then each measured step runs in its own child process, which reports its own peak RSS
(``VmHWM`` from ``/proc/self/status``) before it exits:

* ``onnx_modular``: ``export_modular(model_on_meta(folder), (input_ids,), out, weights=folder)``
  (input_ids of shape (1, 8), model on meta, weights streamed, block-by-block verification
  unless ``--no-verify``);
* ``torch capture``: ``torch.onnx.export(meta_model, dynamo=True)`` (no weights: what torch
  does on meta);
* ``torch + apply_weights`` (``--torch-weights``): the same plus ``ONNXProgram.apply_weights``
  with the state dict loaded from the folder and ``save``, torch's way to a file (in memory,
  and not made durable: ``save`` does not fsync);
* ``durable copy``: the same number of bytes as the exported data file written to the same
  folder and fsynced (64 MiB writes of random bytes), the disk's speed for the save stage.

Each stage's time is printed. Inside the export, the bench times (by wrapping, in its child
process only) the eager reference run, each ``torch.export`` attempt, ``ir.save``, the
``onnx.checker`` pass and the fsyncs. With ``--rounds N`` the three runs alternate N times
(the machine is shared, so medians and ratios come from one run).

    python bench/bench_big.py --size 1b --dtype float32 --dir /tmp/big --torch-weights --rounds 3
    python bench/bench_big.py --size 8b --dtype float16 --no-verify --dir /tmp/big
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

SIZES = {  # Llama 3.2 1B / 3B, Llama 3.1 8B shapes (1b: TinyLlama)
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=4096, tie_word_embeddings=True),
    # TinyLlama-1.1B's shape (bench_scale.py's 1.03B model, the figure issue 13 starts from)
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False),
    "1b-llama3": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}
SHARD_BYTES = 2 * 1024**3


def _config(size: str, dtype: str):
    import transformers

    return transformers.LlamaConfig(**SIZES[size], head_dim=SIZES[size]["hidden_size"] // SIZES[size]["num_attention_heads"],
                                    dtype=dtype, use_cache=False, architectures=["LlamaForCausalLM"])


def write_checkpoint(size: str, dtype: str, folder: pathlib.Path) -> None:
    """Random weights, one shard (<= 2 GiB) in memory at a time."""
    import torch
    from safetensors.torch import save_file

    from onnx_modular.hf.meta import model_on_meta

    config = _config(size, dtype)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    model = model_on_meta(config)
    state = model.state_dict(keep_vars=True)
    seen, names = set(), []
    for name, tensor in state.items():  # tied tensors once, as save_pretrained does
        if id(tensor) not in seen:
            seen.add(id(tensor))
            names.append(name)
    generator = torch.Generator().manual_seed(0)
    shards, current, current_bytes = [], {}, 0
    for name in names:
        meta = state[name]
        if meta.dim() == 1:
            value = torch.ones(meta.shape, dtype=meta.dtype)

        else:
            value = (torch.randn(meta.shape, generator=generator) * 0.02).to(meta.dtype)
        value = value.detach()
        if current and current_bytes + value.nbytes > SHARD_BYTES:
            shards.append(current)
            _save_shard(current, folder, len(shards), save_file)
            current, current_bytes = {}, 0
        current[name] = value
        current_bytes += value.nbytes
    shards.append(current)
    _save_shard(current, folder, len(shards), save_file)
    total = len(shards)
    weight_map = {}
    for index in range(1, total + 1):
        old = folder / f"shard-{index}.safetensors"
        new = folder / f"model-{index:05d}-of-{total:05d}.safetensors"
        old.rename(new)
        for name in json.loads(_header(new)):
            if name != "__metadata__":
                weight_map[name] = new.name
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _save_shard(tensors: dict, folder: pathlib.Path, index: int, save_file) -> None:
    save_file(tensors, str(folder / f"shard-{index}.safetensors"))
    tensors.clear()


def _header(path: pathlib.Path) -> bytes:
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        return file.read(length)


def _own_peak_gib() -> float:
    """This process's peak RSS since exec (VmHWM). Not ``ru_maxrss`` from the parent: that
    also counts the parent's pages the child held between fork and exec."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024**2
    return float("nan")


def _runqueue_seconds() -> float:
    """Time this process's threads spent runnable but waiting for a CPU (``/proc/<pid>/task/*/schedstat``,
    second field): on a shared machine, the part of a stage's wall time that is other jobs' load."""
    total = 0
    for stat in pathlib.Path("/proc/self/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return total / 1e9


def _timed(owner, attribute: str, key: str, parts: dict) -> None:
    """Wrap ``owner.attribute`` so that its calls add their wall time to ``parts[key]`` and the
    process's CPU time (all threads, kernel included) to ``parts[key + " cpu"]``, its time waiting
    for a CPU to ``parts[key + " runqueue"]``; the rest of the wall time is I/O and sleep."""
    original = getattr(owner, attribute)

    def wrapper(*args, **kwargs):
        start, cpu, waited = time.perf_counter(), time.process_time(), _runqueue_seconds()
        try:
            return original(*args, **kwargs)
        finally:
            parts[key] = parts.get(key, 0.0) + time.perf_counter() - start
            parts[key + " cpu"] = parts.get(key + " cpu", 0.0) + time.process_time() - cpu
            parts[key + " runqueue"] = parts.get(key + " runqueue", 0.0) + _runqueue_seconds() - waited
            parts[key + " calls"] = parts.get(key + " calls", 0) + 1

    setattr(owner, attribute, wrapper)


def child_export(folder: str, out: str, verify: bool) -> None:
    import onnx
    import onnx_ir as ir
    import torch

    from onnx_modular import export_modular
    from onnx_modular.capture import reference_run, torch_compat
    from onnx_modular.hf.meta import model_on_meta
    from onnx_modular.storage import save

    parts: dict = {}  # sub-stages, timed by wrapping (this child only)
    _timed(reference_run, "run", "eager run", parts)
    _timed(torch_compat, "capture", "torch.export", parts)
    _timed(ir, "save", "ir.save", parts)
    _timed(onnx.checker, "check_model", "onnx.checker", parts)
    _timed(save, "_fsync", "fsync", parts)
    start = time.perf_counter()
    model = model_on_meta(folder)
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    result = export_modular(
        model, (ids,), out, kwargs={"use_cache": False}, weights=folder, verify="blocks" if verify else False
    )
    seconds = time.perf_counter() - start
    report = {"seconds": seconds, "timings": result.timings, "parts": parts, "peak_gib": _own_peak_gib()}
    if result.blocks is not None:
        report["blocks"] = len(result.blocks.blocks)
        report["block_max_abs"] = max(b.max_abs for b in result.blocks.blocks)
        report["logits_max_abs"] = result.report.max_abs
        report["ok"] = result.blocks.ok
        print(result.blocks, file=sys.stderr)
    print(json.dumps(report))


def child_torch(folder: str, out: str, apply: bool) -> None:
    import torch

    from onnx_modular.hf.meta import model_on_meta

    model = model_on_meta(folder)
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    start = time.perf_counter()
    program = torch.onnx.export(model, (ids,), dynamo=True, optimize=False, verbose=False)
    stages = {"export": time.perf_counter() - start}
    if apply:
        from safetensors.torch import load_file

        mark = time.perf_counter()
        state = {}
        for shard in sorted(pathlib.Path(folder).glob("*.safetensors")):
            state.update(load_file(str(shard)))
        if model.config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        stages["load"] = time.perf_counter() - mark
        mark = time.perf_counter()
        program.apply_weights(state)
        stages["apply_weights"] = time.perf_counter() - mark
        mark = time.perf_counter()
        program.save(out, external_data=True)
        stages["save"] = time.perf_counter() - mark
    report = {"seconds": time.perf_counter() - start, "timings": stages}
    report["peak_gib"] = _own_peak_gib()
    print(json.dumps(report))


def _measure(argv: list[str]) -> dict:
    """Run a child; its peak RSS is the VmHWM it reports (``os.wait4``'s ``ru_maxrss`` is kept
    as a cross-check: it can include the parent's memory at fork time)."""
    import tempfile

    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[1]))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen([sys.executable, __file__, *argv], stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if child.returncode != 0:
        print(stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"child {argv[:2]} failed")
    result = json.loads(stdout.strip().splitlines()[-1])
    result["ru_maxrss_gib"] = usage.ru_maxrss / 1024**2  # KiB on Linux
    result["peak_rss_gib"] = result.pop("peak_gib")
    result["stderr_tail"] = stderr[-4000:]
    return result


def durable_copy(folder: pathlib.Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to a new file in ``folder`` and fsync it (then removed)."""
    chunk = os.urandom(1024 * 1024) * 64
    path = folder / "durable-copy.bin"
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, memoryview(chunk)[: min(len(chunk), nbytes - written)])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def _bytes(folder: pathlib.Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in folder.glob(pattern))


def _stages(timings: dict) -> str:
    return ", ".join(f"{k} {v:.1f}s" for k, v in timings.items())


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_export":
        return child_export(sys.argv[2], sys.argv[3], sys.argv[4] == "1")
    if len(sys.argv) > 1 and sys.argv[1] == "_torch":
        return child_torch(sys.argv[2], sys.argv[3], sys.argv[4] == "1")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--dir", required=True, help="scratch folder (needs ~2x the weights' size)")
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument("--torch", action="store_true", help="also torch.onnx.export on the meta model")
    parser.add_argument("--torch-weights", action="store_true", help="also torch + apply_weights (loads all weights)")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the runs this many times; medians")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint (and the last export)")
    options = parser.parse_args()
    root = pathlib.Path(options.dir) / f"llama-{options.size}-{options.dtype}"
    folder, out = root / "checkpoint", root / "out"
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if not (folder / "model.safetensors.index.json").exists():
        write_checkpoint(options.size, options.dtype, folder)
    weights = _bytes(folder, "*.safetensors")
    print(f"llama-{options.size} {options.dtype}: weights {weights / 1024**3:.2f} GiB "
          f"(written in {time.perf_counter() - start:.0f} s)", flush=True)
    runs: dict[str, list[dict]] = {"ours": [], "torch": [], "copy": []}
    torch_route = options.torch or options.torch_weights
    for round_ in range(options.rounds):
        ours = _measure(["_export", str(folder), str(out / "model.onnx"), "0" if options.no_verify else "1"])
        tail = ours.pop("stderr_tail")
        if round_ == 0 and not options.no_verify:
            print(tail, file=sys.stderr)
        ours["file_bytes"] = _bytes(out, "model.onnx*")
        runs["ours"].append(ours)
        print(f"[{round_}] onnx_modular: {ours['seconds']:.1f} s, peak RSS {ours['peak_rss_gib']:.2f} GiB "
              f"= {ours['peak_rss_gib'] * 1024**3 / weights:.2f} x weights, file {ours['file_bytes'] / 1024**3:.2f} GiB; "
              f"stages {_stages(ours['timings'])}; inside: "
              + ", ".join(f"{k} {v:.1f}s" if isinstance(v, float) else f"{k} {v}" for k, v in ours["parts"].items()),
              flush=True)
        if "blocks" in ours:
            print(f"  verified block by block: {ours['blocks']} blocks, ok={ours['ok']}, "
                  f"max abs per block {ours['block_max_abs']:.2e}, logits max abs {ours['logits_max_abs']:.2e}")
        if not (options.keep and round_ == options.rounds - 1):
            for path in out.glob("model.onnx*"):
                path.unlink()
        runs["copy"].append({"seconds": durable_copy(out, ours["file_bytes"])})
        print(f"[{round_}] durable copy of {ours['file_bytes'] / 1024**3:.2f} GiB (write + fsync): "
              f"{runs['copy'][-1]['seconds']:.1f} s", flush=True)
        if torch_route:
            theirs = _measure(["_torch", str(folder), str(out / "torch.onnx"), "1" if options.torch_weights else "0"])
            runs["torch"].append(theirs)
            what = "capture + load + apply_weights + save" if options.torch_weights else "capture only (no weights written)"
            print(f"[{round_}] torch.onnx.export(dynamo=True) on meta, {what}: {theirs['seconds']:.1f} s, peak RSS "
                  f"{theirs['peak_rss_gib']:.2f} GiB = {theirs['peak_rss_gib'] * 1024**3 / weights:.2f} x weights; "
                  f"stages {_stages(theirs['timings'])}", flush=True)
            for path in out.glob("torch.onnx*"):
                path.unlink()
    ours_total = _median([r["seconds"] for r in runs["ours"]])
    ours_save = _median([r["timings"]["save"] for r in runs["ours"]])
    copy = _median([r["seconds"] for r in runs["copy"]])
    print(f"medians of {options.rounds} round(s): onnx_modular {ours_total:.1f} s (stages "
          + _stages({k: _median([r["timings"][k] for r in runs["ours"]]) for k in runs["ours"][0]["timings"]})
          + f"); durable copy {copy:.1f} s ({runs['ours'][0]['file_bytes'] / copy / 1e6:.0f} MB/s)")
    print(f"  save stage / durable copy: {ours_save / copy:.2f}x (per round: "
          + ", ".join(f"{r['timings']['save'] / c['seconds']:.2f}" for r, c in zip(runs["ours"], runs["copy"])) + ")")
    if runs["torch"]:
        theirs_total = _median([r["seconds"] for r in runs["torch"]])
        print(f"  onnx_modular / torch's route: {ours_total / theirs_total:.2f}x ({ours_total:.1f} s / {theirs_total:.1f} s; "
              "per round: " + ", ".join(f"{a['seconds'] / b['seconds']:.2f}" for a, b in zip(runs["ours"], runs["torch"])) + ")")
    if not options.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
