"""Issue 63: a split decoder's stages as a pipeline. A Llama (8 layers, hidden 256, 8 heads, 4 KV
heads, random weights) exported with its KV cache by ``export CKPT --task causal-lm-with-past`` and
cut by ``split --stages 3``:

* ``split`` keeps each layer's cache in the stage of that layer (the manifest's cache inputs and
  outputs pair up inside each stage);
* ``genai STAGES_DIR --checkpoint CKPT`` writes genai's decoder pipeline, whose ``Generator`` gives
  ``generate``'s greedy tokens;
* ``generate STAGES_DIR --ray ADDR --json -`` on a local Ray instance (started here with ``ray start
  --head`` on a free loopback port, stopped by its own processes' ids) gives the same tokens, each
  stage in its own worker process; several sequences in flight give them too; a worker killed
  mid-generation, a missing stage, a manifest that lies, an address where nothing answers, stages
  the cluster cannot place: exit 2 with one line naming the stage, in bounded time, nothing
  written into the stages folder.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import onnx_modular  # noqa: E402
from onnx_modular.cli import main  # noqa: E402
from onnx_modular.runtime.generation import cache_key  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMPTS = [[5, 17, 33, 200, 41, 7, 63, 99], [9, 41, 7, 63, 1, 12, 3, 4], [700, 3, 18, 5, 77, 8, 250, 6], [11, 22, 33, 44, 55, 66, 77, 88]]
NEW = 12


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(checkpoint, whole file, stages folder): the issue's Llama, exported and cut by the commands."""
    root = tmp_path_factory.mktemp("pipeline")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        initializer_range=0.1,  # random weights whose greedy tokens vary (0.02 repeats one token)
    )
    transformers.LlamaForCausalLM(config).eval().save_pretrained(root / "ckpt")
    whole, stages = root / "llama.onnx", root / "stages"
    assert main(["export", str(root / "ckpt"), "--task", "causal-lm-with-past", "-o", str(whole), "--no-verify"]) == 0
    assert main(["split", str(whole), "--stages", "3", "-o", str(stages)]) == 0
    return root / "ckpt", whole, stages


@pytest.fixture(scope="module")
def expected(llama):
    _, whole, _ = llama
    tokens = onnx_modular.generate(whole, PROMPTS, max_new_tokens=NEW)
    assert len({tuple(row) for row in tokens[:, 8:].tolist()}) == len(PROMPTS)  # tokens that can differ
    return tokens


def _snapshot(folder: pathlib.Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def test_split_keeps_each_layers_cache_in_its_stage(llama, expected):
    _, _, stages = llama
    manifest = json.loads((stages / "manifest.json").read_text())
    layers = []
    for k, stage in enumerate(manifest["stages"]):
        cache_in = {cache_key(n) for n, source in stage["inputs"].items() if n == source and "past_key_values" in n}
        cache_out = {cache_key(n) for n in stage["outputs"] if "past_key_values" in n}
        assert cache_in == cache_out and cache_in, k  # the stage takes and returns the same layers' cache
        layers.append(sorted({int(key.split(".")[2]) for key in cache_in}))
        # what crosses a cut keeps its name (genai passes values between stages by name)
        assert all(source.split("/", 1)[1] == name for name, source in stage["inputs"].items() if source.startswith("stage_"))
    assert layers == [[0, 1, 2], [3, 4, 5], [6, 7]]
    # the stages in one process, one after the other: the whole file's tokens
    np.testing.assert_array_equal(onnx_modular.generate(stages, PROMPTS[:2], max_new_tokens=NEW), expected[:2])


def test_genai_runs_the_stages_as_its_decoder_pipeline(llama, expected, tmp_path, capsys):
    og = pytest.importorskip("onnxruntime_genai")
    checkpoint, _, stages = llama
    before = _snapshot(stages)
    out = tmp_path / "genai"
    assert main(["genai", str(stages), "--checkpoint", str(checkpoint), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "20 of 20 new tokens equal" in printed and "3 stages, decoder.pipeline" in printed
    config = json.loads((out / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    assert config["model"]["type"] == "decoder-pipeline" and "filename" not in decoder
    assert decoder["inputs"]["past_key_names"] == "input.past_key_values.layers.%d.keys"
    assert decoder["outputs"]["present_value_names"] == "output.past_key_values.layers.%d.values"
    assert (decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]) == (8, 4, 32)
    pipeline = [next(iter(entry.items())) for entry in decoder["pipeline"]]
    manifest = json.loads((stages / "manifest.json").read_text())
    assert [name for name, _ in pipeline] == ["stage_0", "stage_1", "stage_2"]
    for (_, entry), stage in zip(pipeline, manifest["stages"]):
        assert entry["inputs"] == list(stage["inputs"]) and entry["outputs"] == stage["outputs"]
        assert entry["run_on_prompt"] is entry["run_on_token_gen"] is True
        assert (out / entry["filename"]).is_file()
    # genai's Generator, greedy, on one prompt: the whole file's tokens (generate)
    model = og.Model(str(out))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(PROMPTS[0]) + NEW, min_length=len(PROMPTS[0]) + NEW)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([PROMPTS[0]], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    assert [int(t) for t in generator.get_sequence(0)] == expected[0].tolist()
    # the folder is a split folder too (its manifest names its stage files)
    np.testing.assert_array_equal(onnx_modular.generate(out, PROMPTS[:1], max_new_tokens=4), expected[:1, :12])
    assert _snapshot(stages) == before


def test_the_genai_pipeline_refuses_what_it_cannot_feed(llama, tmp_path, capsys):
    checkpoint, _, stages = llama
    lying = tmp_path / "lying"
    shutil.copytree(stages, lying)
    manifest = json.loads((lying / "manifest.json").read_text())
    # stage 2 fed a crossing value under another name than the one stage 1 returns
    stage = manifest["stages"][2]
    hidden = next(name for name, source in stage["inputs"].items() if source.startswith("stage_1/"))
    stage["inputs"][hidden] = "stage_1/" + manifest["stages"][1]["outputs"][0]
    (lying / "manifest.json").write_text(json.dumps(manifest))
    assert main(["genai", str(lying), "--checkpoint", str(checkpoint), "-o", str(tmp_path / "out"), "--no-check"]) == 2
    err = capsys.readouterr().err
    assert "stage 2" in err and "under one name" in err
    assert not (tmp_path / "out").exists()


# -- Ray ---------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process."""
    found = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            found[int(entry.name)] = (parent, line)
    return found


def _cluster_processes(temp_dir: str) -> list[int]:
    """The processes of the Ray instance whose folder is ``temp_dir``, and their children (workers)."""
    every = _processes()
    own = {pid for pid, (_, line) in every.items() if temp_dir in line}
    children = {pid for pid, (parent, _) in every.items() if parent in own}
    return sorted(own | children)


@pytest.fixture(scope="module")
def cluster():
    """``ray start --head`` on a free loopback port, its own folder; stopped by its processes' ids
    (``ray stop`` would stop every Ray instance of the machine)."""
    pytest.importorskip("ray")
    if not sys.platform.startswith("linux"):
        pytest.skip("the cluster's processes are found through /proc")
    temp_dir = tempfile.mkdtemp(prefix="om-ray-", dir="/tmp")  # short: Ray's socket paths are bounded
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "RAY_USAGE_STATS_ENABLED": "0"}
    ray_command = pathlib.Path(sys.executable).with_name("ray")
    started = subprocess.run(
        [str(ray_command), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
         "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}",
         "--object-store-memory=100000000"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert started.returncode == 0, started.stderr[-2000:]
    try:
        yield f"127.0.0.1:{port}", temp_dir
    finally:
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            for pid in _cluster_processes(temp_dir):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while _cluster_processes(temp_dir) and time.monotonic() < deadline:
                time.sleep(0.2)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "onnx_modular", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, stdin=subprocess.DEVNULL)


def _ids(prompts) -> list[str]:
    return [arg for ids in prompts for arg in ("--input-ids", ",".join(map(str, ids)))]


def test_each_stage_on_its_own_ray_worker_gives_generates_tokens(llama, expected, cluster, capsys):
    _, _, stages = llama
    address, _ = cluster
    before = _snapshot(stages)
    assert main(["generate", str(stages), *_ids(PROMPTS[:3]), "--max-new-tokens", str(NEW), "--ray", address, "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    np.testing.assert_array_equal(np.array(data["tokens"]), expected[:3])
    pids = [stage["pid"] for stage in data["stages"]]
    assert len(set(pids)) == 3 and os.getpid() not in pids  # three workers, none this process
    assert data["micro_batches"] == 3  # one group a sequence, as many as there are stages
    for k, stage in enumerate(data["stages"]):
        stage_file = stages / f"stage_{k}" / "model.onnx"
        assert stage["stage"] == k and stage["node"]
        assert stage["weights_bytes"] == stage_file.stat().st_size + (stage_file.parent / "model.onnx.data").stat().st_size
        assert stage["peak_rss_bytes"] >= stage["base_rss_bytes"] > 0 and stage["seconds"] > 0
        assert stage["sent_bytes_per_token"] > 0
    # the last stage sends one row of logits a token (float32, vocabulary 1000)
    assert data["stages"][-1]["sent_bytes_per_token"] == 4000
    assert _snapshot(stages) == before


def test_sequences_in_flight_on_ray_give_the_same_tokens(llama, expected, cluster):
    _, _, stages = llama
    address, _ = cluster
    import ray

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")  # joined once, for both runs
    try:
        for groups in (1, 4):
            tokens = onnx_modular.generate(stages, PROMPTS, max_new_tokens=NEW, ray_address=address, micro_batches=groups)
            np.testing.assert_array_equal(tokens, expected)
        assert ray.is_initialized()  # the caller's own session is left to it
    finally:
        ray.shutdown()


def _stage_workers(temp_dir: str) -> list[int]:
    return [pid for pid in _cluster_processes(temp_dir) if _processes().get(pid, (0, ""))[1].startswith("ray::StageActor")]


def test_a_worker_killed_mid_generation_ends_the_command_with_one_line(llama, cluster):
    _, _, stages = llama
    address, temp_dir = cluster
    before = _snapshot(stages)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(
        [sys.executable, "-m", "onnx_modular", "generate", str(stages), *_ids(PROMPTS[:1]), "--max-new-tokens", "240",
         "--ray", address], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            running = [pid for pid in _stage_workers(temp_dir) if ".step" in _processes().get(pid, (0, ""))[1]]
            if running:  # decoding has begun: a worker is running a step
                break
            time.sleep(0.05)
        assert process.poll() is None and running, "the generation ended before a worker could be killed"
        os.kill(running[0], signal.SIGKILL)
        killed = time.monotonic()
        out, err = process.communicate(timeout=90)
        elapsed = time.monotonic() - killed
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 2 and elapsed < 90
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: [pipeline] stage ") and "worker died" in lines[0], err
    assert "Traceback" not in err and out == ""
    assert _snapshot(stages) == before


def test_stages_the_cluster_cannot_place_are_refused_in_bounded_time(llama, cluster, capsys):
    _, _, stages = llama
    address, _ = cluster
    started = time.monotonic()
    assert main(["generate", str(stages), *_ids(PROMPTS[:1]), "--max-new-tokens", "2", "--ray", address,
                 "--stages-per-node", "1", "--timeout", "3"]) == 2
    assert time.monotonic() - started < 60
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs 3 nodes" in err and "it has 1 alive" in err, err


def test_a_stage_that_gives_no_answer_in_time_is_named(llama, cluster, capsys):
    _, _, stages = llama
    address, _ = cluster
    assert main(["generate", str(stages), *_ids(PROMPTS[:1]), "--ray", address, "--timeout", "0.001"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: [pipeline] stage 0 gave no answer within 0.001 s (loading).") and err.count("\n") == 1


def test_bad_stages_and_addresses_fail_before_any_worker(llama, tmp_path, capsys):
    pytest.importorskip("ray")
    _, _, stages = llama
    missing = tmp_path / "missing"
    shutil.copytree(stages, missing)
    (missing / "stage_1" / "model.onnx").unlink()
    lying = tmp_path / "lying"
    shutil.copytree(stages, lying)
    manifest = json.loads((lying / "manifest.json").read_text())
    cache = next(n for n in manifest["stages"][1]["inputs"] if n.startswith("input.past_key_values"))
    manifest["stages"][1]["inputs"]["renamed"] = manifest["stages"][1]["inputs"].pop(cache)
    (lying / "manifest.json").write_text(json.dumps(manifest))
    foreign = tmp_path / "foreign"  # stage 0 no longer returns layer 0's keys: its cache would leave the stage
    shutil.copytree(stages, foreign)
    manifest = json.loads((foreign / "manifest.json").read_text())
    manifest["stages"][0]["outputs"] = [n for n in manifest["stages"][0]["outputs"] if "layers.0.keys" not in n]
    manifest["outputs"] = {k: v for k, v in manifest["outputs"].items() if "layers.0.keys" not in k}
    (foreign / "manifest.json").write_text(json.dumps(manifest))
    snapshots = {folder: _snapshot(folder) for folder in (missing, lying, foreign)}
    port = _free_port()  # nothing answers there
    for folder, words in ((missing, "stage 1"), (lying, "stage 1"), (foreign, "stage 0")):
        assert main(["generate", str(folder), *_ids(PROMPTS[:1]), "--ray", f"127.0.0.1:{port}"]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, err
        assert _snapshot(folder) == snapshots[folder]
    started = time.monotonic()
    result = _run(["generate", str(stages), *_ids(PROMPTS[:1]), "--ray", f"127.0.0.1:{port}"], timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("error: [pipeline] Nothing answers at the Ray address")
    assert result.stderr.count("\n") == 1 and time.monotonic() - started < 60


def test_the_stage_running_code_imports_no_torch():
    code = (
        "import sys\n"
        "import onnx_modular.runtime.cluster, onnx_modular.runtime.decoding, onnx_modular.cli.pipeline\n"
        "import onnx_modular.files.genai_pipeline\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_micro_batches_and_resources_are_checked():
    from onnx_modular.errors import InvalidInputError
    from onnx_modular.runtime.cluster import stage_resources
    from onnx_modular.runtime.pipeline import batch_groups

    assert batch_groups(4, None, 3) == [slice(0, 1), slice(1, 3), slice(3, 4)]  # one group a stage
    assert batch_groups(2, None, 3) == [slice(0, 1), slice(1, 2)]  # at most one a sequence
    assert batch_groups(5, 2, 3) == [slice(0, 2), slice(2, 5)]
    for bad in (0, 6, True, 1.5):
        with pytest.raises(InvalidInputError, match="micro_batches"):
            batch_groups(5, bad, 3)
    assert stage_resources({"CPU": 1}, 2) == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert stage_resources([{"a": 1}, {"GPU": 0.5}], 2) == [{"a": 1.0}, {"GPU": 0.5}]
    for bad in ([{"CPU": 1}], {"CPU": -1}, {"CPU": "1"}, "CPU"):
        with pytest.raises(InvalidInputError, match="resources"):
            stage_resources(bad, 2)


def test_ray_options_without_ray_are_refused(llama, capsys):
    _, whole, stages = llama
    assert main(["generate", str(stages), "--input-ids", "1,2", "--micro-batches", "2"]) == 2
    assert "--micro-batches go with --ray" in capsys.readouterr().err
    from onnx_modular.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="micro_batches go with ray_address"):
        onnx_modular.generate(stages, [[1, 2]], micro_batches=2)
    assert main(["generate", str(whole), "--input-ids", "1,2", "--ray", "127.0.0.1:1"]) == 2  # a file is no stages folder
    assert "holds no manifest.json" in capsys.readouterr().err
    assert main(["generate", str(whole), "--input-ids", "1,2", "--threads", "1"]) == 2
    assert "--threads sets the threads of a split folder's stages" in capsys.readouterr().err


def _stage_model(inputs: dict[str, list], outputs: dict[str, list]):
    from onnx import TensorProto, helper

    def value(name, dims):
        elem = TensorProto.INT64 if name in ("input_ids", "attention_mask", "position_ids", "cache_position") else TensorProto.FLOAT
        return helper.make_tensor_value_info(name, elem, dims)

    graph = helper.make_graph([], "stage", [value(n, d) for n, d in inputs.items()], [value(n, d) for n, d in outputs.items()])
    return helper.make_model(graph)


@pytest.mark.parametrize("names", [
    ("input.past_key_values.layers.{i}.{kind}s", "output.past_key_values.layers.{i}.{kind}s"),
    ("past_key_values.{i}.{kind}", "present.{i}.{kind}"),
])
def test_the_genai_pipeline_config_reads_either_cache_names_torch_free(names):
    """Two stages of one layer each, from ONNX declarations alone: the templates, sizes and entries."""
    from onnx_modular.files.genai_config import GenaiError
    from onnx_modular.files.genai_pipeline import pipeline_config
    from onnx_modular.runtime.pipeline import StagePlan

    past, present = names
    cache = {i: {kind: (past.format(i=i, kind=kind), present.format(i=i, kind=kind)) for kind in ("key", "value")} for i in (0, 1)}
    kv = ["batch", 2, "past", 16]
    plans, models = [], []
    for i in (0, 1):
        ins = {"input_ids": ["batch", "seq"], "attention_mask": ["batch", "total"]} if i == 0 else {"hidden": ["batch", "seq", 32]}
        ins.update({cache[i][k][0]: kv for k in ("key", "value")})
        outs = {cache[i][k][1]: kv for k in ("key", "value")}
        outs.update({"hidden": ["batch", "seq", 32]} if i == 0 else {"logits": ["batch", "seq", 50]})
        sources = {n: ("stage_0/hidden" if n == "hidden" else n) for n in ins}
        plans.append(StagePlan(i, f"/x/stage_{i}/model.onnx", sources, tuple(outs),
                               {f"{k}{i}": (cache[i][k][0], cache[i][k][1]) for k in ("key", "value")}))
        models.append(_stage_model(ins, outs))
    config = pipeline_config(plans, models, {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 2,
                                              "max_position_embeddings": 64, "eos_token_id": 2})
    decoder = config["model"]["decoder"]
    assert config["model"]["type"] == "decoder-pipeline" and config["model"]["vocab_size"] == 50
    assert decoder["inputs"] == {"input_ids": "input_ids", "attention_mask": "attention_mask",
                                 "past_key_names": past.format(i="%d", kind="key"),
                                 "past_value_names": past.format(i="%d", kind="value")}
    assert decoder["outputs"]["present_key_names"] == present.format(i="%d", kind="key")
    assert (decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]) == (2, 2, 16)
    assert [list(entry) for entry in decoder["pipeline"]] == [["stage_0"], ["stage_1"]]
    assert decoder["pipeline"][1]["stage_1"]["filename"] == "stage_1/model.onnx"
    # an input genai does not feed is refused, naming the stage
    plans[0].inputs["cache_position"] = "cache_position"
    with pytest.raises(GenaiError, match="stage 0 takes 'cache_position'"):
        pipeline_config(plans, models, {"eos_token_id": 2})
