"""``onnx-modular generate STAGES_DIR``: a split decoder's stages run as a pipeline, in this process
or, with ``--ray ADDR``, each stage on its own Ray worker (:mod:`onnx_modular.runtime.cluster`;
docs/pipeline.md). Never imports torch."""

from __future__ import annotations

import argparse
import json

from onnx_modular.cli.output import EXIT_OK, emit_json, stdout
from onnx_modular.errors import InvalidInputError

__all__ = ["add_pipeline_options", "run_pipeline", "uses_pipeline"]


def add_pipeline_options(parser: argparse.ArgumentParser) -> None:
    """``generate``'s options for a split folder's stages (docs/cli.md, ``generate``)."""
    parser.add_argument("--ray", default=None, metavar="ADDR",
                        help="a folder split wrote: run each stage on its own worker of the Ray cluster at ADDR "
                        "(IP:PORT that `ray start --head` prints, or ray://HOST:10001); needs onnx-modular[ray]")
    parser.add_argument("--stages-per-node", type=int, default=None, metavar="N",
                        help="with --ray: N consecutive stages on each node, one node a group (the cluster needs "
                        "that many nodes); default: Ray spreads the stages, one worker each")
    parser.add_argument("--stage-resources", default=None, metavar="JSON",
                        help='with --ray: Ray resources of each stage, one dict for all (\'{"CPU": 1}\') or a list of '
                        "one a stage (custom resources pin stages to the nodes started with them)")
    parser.add_argument("--micro-batches", type=int, default=None, metavar="N",
                        help="with --ray: the prompts cut into N groups in flight at once (default: one a stage, "
                        "at most one a prompt)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="a folder split wrote: onnxruntime's intra-op threads in each stage")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="with --ray: seconds a stage's call may take before the run stops (default 120)")


def uses_pipeline(args: argparse.Namespace) -> bool:
    """Whether ``generate`` runs a split folder's stages (``--ray``, or a folder with manifest.json)."""
    from onnx_modular.runtime.pipeline import is_split_folder

    if args.ray is None:
        ray_only = [f"--{n.replace('_', '-')}" for n in ("stages_per_node", "stage_resources", "micro_batches", "timeout")
                    if getattr(args, n) is not None]
        if ray_only:
            raise InvalidInputError(f"{', '.join(ray_only)} go with --ray.", hint="onnx-modular generate STAGES_DIR --ray ADDR ...")
    pipeline = args.ray is not None or is_split_folder(args.model)
    if not pipeline and args.threads is not None:
        raise InvalidInputError("--threads sets the threads of a split folder's stages; this is one file.",
                                hint="Drop --threads, or give the folder split wrote.")
    return pipeline


def _resources(text: str | None):
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as e:
        raise InvalidInputError(f"--stage-resources is not JSON: {e}.", hint='--stage-resources \'{"CPU": 1}\'') from None


def run_pipeline(args: argparse.Namespace, rows: list[list[int]]) -> int:
    """The stages of ``args.model`` on ``rows`` (the prompts), in this process or on Ray."""
    from onnx_modular.runtime.pipeline import generate_stages, is_split_folder

    if not is_split_folder(args.model):
        raise InvalidInputError(f"--ray runs the stages of a folder split wrote; {args.model!r} holds no manifest.json.",
                                hint="onnx-modular split M.onnx --stages 3 -o STAGES_DIR, then generate STAGES_DIR --ray ADDR.")
    if args.ray is None:
        stages: list = []
        tokens = generate_stages(args.model, rows, args.max_new_tokens, threads=args.threads, stats=stages)
        data = {"tokens": tokens.tolist(), "stages": stages}
    else:
        from onnx_modular.runtime.cluster import DEFAULT_TIMEOUT, generate_on_ray

        run = generate_on_ray(
            args.model, rows, args.max_new_tokens, address=args.ray, stages_per_node=args.stages_per_node,
            resources=_resources(args.stage_resources), micro_batches=args.micro_batches, threads=args.threads,
            timeout=DEFAULT_TIMEOUT if args.timeout is None else args.timeout,
        )
        tokens, data = run.tokens, run.to_dict()
    if emit_json(args.json, data):
        return EXIT_OK
    for row, ids in zip(tokens, rows):
        stdout(f"prompt {','.join(map(str, ids))} -> new {','.join(str(int(t)) for t in row[len(ids):])}")
    for stage in data["stages"]:
        stdout(f"stage {stage['stage']}: pid {stage['pid']} on {stage['node']}, weights {stage['weights_bytes']:,} bytes, "
               f"peak RSS {stage['peak_rss_bytes']:,} bytes, {stage['seconds']:.3f} s running")
    return EXIT_OK
