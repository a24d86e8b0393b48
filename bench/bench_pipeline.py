"""A split decoder on Ray workers against the whole file in one process (docs/pipeline.md).

    python bench/bench_pipeline.py [--layers 8] [--hidden 512] [--vocab 8000] [--stages 3] [--new 32]
                                   [--rounds 5] [--ray ADDR] [--json PATH]

A Llama with random weights is saved with ``save_pretrained``, exported with its cache (``export
CKPT --task causal-lm-with-past``) and cut (``split --stages N``). Without ``--ray`` a local Ray
instance is started here (``ray start --head`` on a free loopback port, its own folder) and its
processes are stopped by id at the end. Measured:

* **tokens**: the stages on Ray against ``onnx_modular.generate`` on the whole file;
* **memory**: each worker's peak RSS, and what its stage adds to the worker (peak - RSS before
  loading), against one process running the whole file (the same two figures, in a child process);
* **speed**: greedy decoding of ``--new`` tokens after an 8-token prompt with 1, 2 and 4 sequences
  (on Ray in one micro-batch, and in one a sequence), one intra-op thread everywhere, the two sides
  alternating each round, medians: per-token latency (wall time / new tokens) and throughput
  (sequence-tokens / s), each as a ratio to one process;
* **traffic**: the bytes each stage sends a token (what crosses its cut; the last stage: one row
  of logits), from the workers' own counts.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from onnx_modular.cli import main  # noqa: E402
from onnx_modular.runtime.cluster import generate_on_ray  # noqa: E402
from onnx_modular.runtime.generation import decoder_files, generate_with_sessions  # noqa: E402
from onnx_modular.runtime.sessions import session  # noqa: E402

PROMPT = [5, 17, 33, 200, 41, 7, 63, 99]

_WHOLE = """
import json, sys
sys.path.insert(0, {root!r})
import numpy as np
from onnx_modular.runtime.generation import generate_with_sessions
from onnx_modular.runtime.pipeline import peak_rss
from onnx_modular.runtime.sessions import session
base = peak_rss()
s = session({path!r}, configure=lambda o: setattr(o, "intra_op_num_threads", 1), what="whole file")
generate_with_sessions(s, s, np.array([{prompt!r}] * 4), {new})
print(json.dumps({{"base_rss_bytes": base, "peak_rss_bytes": peak_rss()}}))
"""


def build(root: pathlib.Path, args) -> tuple[pathlib.Path, pathlib.Path]:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 32, num_key_value_heads=4, max_position_embeddings=512, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    print(f"Llama: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {args.layers} layers, "
          f"hidden {args.hidden}, vocab {args.vocab}", flush=True)
    model.save_pretrained(root / "ckpt")
    whole, stages = root / "llama.onnx", root / "stages"
    assert main(["export", str(root / "ckpt"), "--task", "causal-lm-with-past", "-o", str(whole), "--no-verify"]) == 0
    assert main(["split", str(whole), "--stages", str(args.stages), "-o", str(stages), "--no-data"]) == 0
    return whole, stages


def start_ray(temp_dir: str) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    subprocess.run([str(pathlib.Path(sys.executable).with_name("ray")), "start", "--head", f"--port={port}",
                    "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}",
                    "--object-store-memory=200000000"], env=env, check=True, capture_output=True)
    return f"127.0.0.1:{port}"


def stop_ray(temp_dir: str) -> None:
    """The processes of the instance whose folder is ``temp_dir`` and their children, by id."""
    def ours() -> list[int]:
        table = {}
        for entry in pathlib.Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    line = (entry / "cmdline").read_bytes().decode(errors="replace")
                    parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                table[int(entry.name)] = (parent, line)
        own = {pid for pid, (_, line) in table.items() if temp_dir in line}
        return sorted(own | {pid for pid, (parent, _) in table.items() if parent in own})

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in ours():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(3)


def whole_memory(whole: pathlib.Path, new: int) -> dict:
    code = _WHOLE.format(root=str(ROOT), path=str(whole), prompt=PROMPT, new=new)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main_bench() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ray", default=None, metavar="ADDR", help="an existing cluster (default: start one here)")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()
    results: dict = {"settings": vars(args)}
    with tempfile.TemporaryDirectory(prefix="om-pipe-", dir="/tmp") as tmp:
        root = pathlib.Path(tmp)
        whole, stages = build(root, args)
        temp_dir = str(root / "ray")
        address = args.ray or start_ray(temp_dir)
        import ray

        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        try:
            results.update(measure(whole, stages, address, args))
        finally:
            ray.shutdown()
            if args.ray is None:
                stop_ray(temp_dir)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


def measure(whole: pathlib.Path, stages: pathlib.Path, address: str, args) -> dict:
    file, _ = decoder_files(whole)
    one = session(file, configure=lambda o: setattr(o, "intra_op_num_threads", 1), what="whole file")
    out: dict = {"speed": []}
    for batch, groups in ((1, 1), (2, 1), (2, 2), (4, 1), (4, 4)):
        ids = np.array([PROMPT] * batch) + np.arange(batch)[:, None]
        expected = generate_with_sessions(one, one, ids, args.new)
        local, remote = [], []
        for r in range(args.rounds):
            for side in (("one", "ray") if r % 2 == 0 else ("ray", "one")):
                started = time.perf_counter()
                if side == "one":
                    tokens = generate_with_sessions(one, one, ids, args.new)
                    local.append(time.perf_counter() - started)
                else:
                    last = generate_on_ray(stages, ids, args.new, address=address, threads=1, micro_batches=groups)
                    tokens = last.tokens
                    remote.append(last.decode_seconds)  # the stages' load is not a token's
                np.testing.assert_array_equal(tokens, expected)
        one_s, ray_s = statistics.median(local), statistics.median(remote)
        out["speed"].append({
            "sequences": batch, "micro_batches": groups,
            "one_process_ms_per_token": 1000 * one_s / args.new, "ray_ms_per_token": 1000 * ray_s / args.new,
            "one_process_tokens_per_s": batch * args.new / one_s, "ray_tokens_per_s": batch * args.new / ray_s,
        })
        print(f"{batch} sequence(s) in {groups} micro-batch(es): one process {1000 * one_s / args.new:.1f} ms a token "
              f"({batch * args.new / one_s:.0f} tokens/s), Ray stages {1000 * ray_s / args.new:.1f} ms a token "
              f"({batch * args.new / ray_s:.0f} tokens/s): latency {ray_s / one_s:.2f}x, throughput {one_s / ray_s:.2f}x "
              "(tokens equal)", flush=True)
    memory = whole_memory(whole, args.new)
    out["whole_file"] = memory
    out["stages"] = last.stages
    print(f"whole file in one process: peak RSS {memory['peak_rss_bytes'] / 1e6:.0f} MB "
          f"({(memory['peak_rss_bytes'] - memory['base_rss_bytes']) / 1e6:.0f} MB over the bare process)")
    for stage in last.stages:
        added = stage["peak_rss_bytes"] - stage["base_rss_bytes"]
        print(f"stage {stage['stage']} (pid {stage['pid']} on {stage['node']}): weights {stage['weights_bytes'] / 1e6:.0f} MB, "
              f"peak RSS {stage['peak_rss_bytes'] / 1e6:.0f} MB ({added / 1e6:.0f} MB over the bare worker: "
              f"{added / max(1, memory['peak_rss_bytes'] - memory['base_rss_bytes']):.2f}x the whole file's), "
              f"sends {stage['sent_bytes_per_token']:.0f} bytes a token")
    return out


if __name__ == "__main__":
    main_bench()
