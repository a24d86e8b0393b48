"""A folder onnxruntime-genai runs: ``onnx-modular export CKPT --genai -o DIR`` and
``onnx-modular genai M.onnx --checkpoint CKPT -o DIR``.

The folder holds ``model.onnx`` (modular: every module call a local function), with the names
genai's ``Generator`` drives (``input_ids``, ``attention_mask``, ``position_ids`` when the model
takes them, ``past_key_values.N.key/value`` in, ``logits`` and ``present.N.key/value`` out),
``genai_config.json`` (:mod:`onnx_modular.files.genai_config`) and the checkpoint's tokenizer
files and ``generation_config.json``. Before it is published it is run through genai's
``Generator`` (greedy) on a prompt, and its tokens compared with ``model.generate``'s: the
:class:`GenerationCheck` goes into the report; different tokens are a :class:`ParityError`
(nothing written, unless ``keep_on_mismatch``).

What genai can drive, it drives as a plain decoder: a cache of keys and values per layer (layers
may differ in KV heads and head size: genai reads each layer's from the file when the buffer is
not shared). Sliding-window layers keep their whole past in this file (the graph masks the
window, as transformers' mask does), so genai needs no ``sliding_window`` section. Layers of
other kinds (recurrent states, convolutions), or keys and values of different sizes (multi-head
latent attention), are refused before the export (:class:`GenaiError`).

Example::

    from onnx_modular.hf.genai import export_genai, write_genai_folder
    folder = export_genai("llama_ckpt", "llama_genai")          # export, check, write
    print(folder.check)                                         # 20 of 20 tokens equal
    write_genai_folder("m.onnx", "llama_ckpt", "m_genai")       # a file exported with --io-names optimum
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import torch
import transformers
from transformers import DynamicCache

from onnx_modular.check.dispatch import verify_export
from onnx_modular.check.parity import user_tolerance
from onnx_modular.errors import InvalidInputError, MissingDependencyError, ParityError
from onnx_modular.files.genai_config import GenaiError, decoder_io, genai_config
from onnx_modular.files.genai_pipeline import STAGE_FILE, pipeline_config
from onnx_modular.hf import command
from onnx_modular.hf.cache_axes import dynamic_shapes, optimum_io_names
from onnx_modular.hf.checkpoint import load_checkpoint, model_and_inputs
from onnx_modular.hf.exporter import ModularOnnxConfig, ModularOnnxExporter, modular_result
from onnx_modular.hf.versions import cache_argument, returned_cache
from onnx_modular.runtime.pipeline import MANIFEST, is_split_folder, read_stages
from onnx_modular.storage import locks, save
from onnx_modular.storage.folders import check_output_folder, new_folder
from onnx_modular.storage.load import load_model_file

__all__ = ["GENAI_STAGES", "GenaiFolder", "GenerationCheck", "check_generation", "export_genai", "write_genai_folder"]

#: The stages of ``export --genai``: the folder is written aside and run through genai (``genai``)
#: before it is moved into place (``save``).
GENAI_STAGES = ("load", "export", "verify", "genai", "save")

#: Attention layer kinds that keep keys and values of every position (the window or chunk is a mask).
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})

MODEL_FILE = "model.onnx"
CONFIG_FILE = "genai_config.json"


@dataclasses.dataclass
class GenerationCheck:
    """Greedy tokens of genai's ``Generator`` on the folder against transformers' ``generate``."""

    prompt: list[int]
    genai: list[int]
    transformers: list[int]
    steps: int
    model_type: str

    @property
    def ok(self) -> bool:
        return self.genai == self.transformers

    @property
    def equal(self) -> int:
        """New tokens equal before the first difference."""
        new = zip(self.genai[len(self.prompt) :], self.transformers[len(self.prompt) :])
        return next((i for i, (a, b) in enumerate(new) if a != b), min(len(self.genai), len(self.transformers)) - len(self.prompt))

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ok": self.ok, "equal": self.equal}

    def __str__(self) -> str:
        generated = len(self.transformers) - len(self.prompt)
        verdict = "PASS" if self.ok else "FAIL"
        return (
            f"onnxruntime-genai (model.type {self.model_type!r}) against transformers' generate, greedy, prompt of "
            f"{len(self.prompt)} tokens: {self.equal} of {generated} new tokens equal "
            f"(up to {self.steps}, stopping at end of sequence): {verdict}"
        )


@dataclasses.dataclass
class GenaiFolder:
    """What :func:`export_genai` and :func:`write_genai_folder` return."""

    path: pathlib.Path
    config: dict
    check: GenerationCheck | None
    report: Any = None  # the parity report of the export (ParityReport), None for a file given
    exported: Any = None  # transformers' ExportedModel
    optimized: Any = None  # optimize's OptimizeReport when the folder carries the fused file


def _genai():
    try:
        import onnxruntime_genai
    except ImportError as e:
        raise MissingDependencyError(
            f"Checking the folder needs onnxruntime-genai: {e}", hint="pip install 'onnx-modular[genai]'."
        ) from e
    return onnxruntime_genai


def check_drivable(config: Any, source: str | os.PathLike = "") -> None:
    """Refuse, before any work, a decoder genai cannot drive: layers that are not attention over
    keys and values (genai's runtime feeds recurrent or convolution states only to its builder's
    own graphs)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = set(getattr(text, "layer_types", None) or ())
    other = sorted(kinds - ATTENTION_LAYERS)
    if other:
        raise GenaiError(
            f"{str(source) or 'This model'} has {', '.join(other)} layers: onnxruntime-genai's Generator drives a cache "
            "of keys and values only with the files it builds itself (its states for recurrent and convolution layers "
            "follow its builder's layout).",
            hint="Export with --task causal-lm-with-past --io-names optimum and run the file with onnxruntime.",
        )


def genai_inputs(model: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
    """The with-past sample inputs of ``model`` as genai feeds them: a cache of whole keys and
    values for every layer (transformers' own cache keeps only the window of a sliding layer, and
    a 0-d size tensor genai cannot feed), and ``position_ids`` when the model takes them (genai
    computes them from the mask, as ``generate`` does)."""
    argument = cache_argument(model)
    ids = inputs["input_ids"]
    batch, length = ids.shape
    past = inputs["attention_mask"].shape[1] - length
    prefix = torch.randint(0, model.config.get_text_config().vocab_size, (batch, past), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = returned_cache(model(input_ids=prefix, use_cache=True, **{argument: DynamicCache()}))
    layers = getattr(cache, "layers", None)
    if type(cache) is not DynamicCache or not layers or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers or ()}) or [type(cache).__name__]
        raise GenaiError(
            f"{type(model).__name__} keeps a cache of {', '.join(kinds)}, not keys and values per layer: genai cannot feed it.",
            hint="Export with --task causal-lm-with-past --io-names optimum and run the file with onnxruntime.",
        )
    odd = sorted({(layer.keys.shape[-1], layer.values.shape[-1]) for layer in layers if layer.keys.shape[-1] != layer.values.shape[-1]})
    if odd:
        raise GenaiError(
            f"{type(model).__name__}'s cache keeps keys and values of different sizes (key, value) {odd} (multi-head latent "
            "attention): genai allocates a layer's key and value caches with one head size.",
            hint="Export with --task causal-lm-with-past --io-names optimum and run the file with onnxruntime.",
        )
    out = {**{k: v for k, v in inputs.items() if k != argument}, argument: cache}
    if "position_ids" in inspect.signature(model.forward).parameters:
        out["position_ids"] = torch.arange(past, past + length).unsqueeze(0).expand(batch, -1).contiguous()
    return out


def _prompt(config: dict, length: int = 8) -> list[int]:
    """A fixed prompt of ordinary ids (no end-of-sequence, padding or start token)."""
    special = {config["model"]["bos_token_id"], config["model"]["pad_token_id"]}
    eos = config["model"]["eos_token_id"]
    special |= set(eos) if isinstance(eos, list) else {eos}
    vocab = config["model"]["vocab_size"]
    candidates = [i for i in torch.randperm(vocab, generator=torch.Generator().manual_seed(0)).tolist() if i not in special]
    return candidates[:length]


def check_generation(
    folder: str | os.PathLike, model: torch.nn.Module, *, prompt: list[int] | None = None, steps: int = 20
) -> GenerationCheck:
    """Run ``folder`` through genai's ``Generator`` (greedy) on ``prompt`` (default: 8 fixed ids)
    for up to ``steps`` new tokens, and ``model.generate`` (greedy) the same way; both stop at the
    end-of-sequence token of ``genai_config.json``.

    Raises:
        GenaiError: genai cannot load or run the folder.
    """
    og = _genai()
    folder = pathlib.Path(folder)
    config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    prompt = list(prompt) if prompt is not None else _prompt(config)
    try:
        runtime = og.Model(str(folder))
        params = og.GeneratorParams(runtime)
        params.set_search_options(
            do_sample=False, num_beams=1, max_length=len(prompt) + steps, min_length=0, repetition_penalty=1.0,
            no_repeat_ngram_size=0,
        )
        generator = og.Generator(runtime, params)
        generator.append_tokens(np.array([prompt], dtype=np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        tokens = [int(t) for t in generator.get_sequence(0)]
        del generator, params, runtime
    except Exception as e:  # genai raises RuntimeError (OrtException) with its own message
        raise GenaiError(
            f"onnxruntime-genai could not run the folder: {type(e).__name__}: {e}",
            hint="Report it with the folder's genai_config.json; the file itself runs in onnxruntime (onnx-modular verify).",
        ) from e
    settings = transformers.GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=steps, repetition_penalty=1.0,
        eos_token_id=config["model"]["eos_token_id"], pad_token_id=config["model"]["pad_token_id"],
    )
    # The model's own generation settings out of the way (a forced end-of-sequence token at max_length
    # in MBart's and Marian's, suppressed tokens): genai applies none of them in a greedy search.
    own, model.generation_config = model.generation_config, settings
    try:
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), generation_config=settings)[0].tolist()
    finally:
        model.generation_config = own
    return GenerationCheck(prompt, tokens, expected, steps, config["model"]["type"])


def _read_json(folder: pathlib.Path, name: str) -> dict | None:
    """A checkpoint's JSON settings, read bounded (no FIFO, no huge file); a typed error when it is not an object."""
    from onnx_modular.storage.limits import MAX_MANIFEST_BYTES
    from onnx_modular.storage.load import read_regular_file

    path = folder / name
    if not path.is_file():
        return None
    try:
        value = json.loads(bytes(read_regular_file(path, str(path), limit=MAX_MANIFEST_BYTES)).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise InvalidInputError(f"{str(path)!r} is not valid JSON: {str(e)[:200]}.", hint=f"Fix or regenerate {name}.") from None
    if not isinstance(value, dict):
        raise InvalidInputError(f"{str(path)!r} holds a JSON {type(value).__name__}, not an object of settings.",
                                hint=f"Fix or regenerate {name}.")
    return value


def _check_checkpoint(checkpoint: str | os.PathLike) -> None:
    """The checkpoint folder's links, ``config.json`` (types and sizes) and runtime files, before any work:
    a tokenizer file that is a link or not a regular file would be left out of the folder without a word."""
    from onnx_modular.hf.meta import check_checkpoint_config

    command.check_checkpoint_links(checkpoint)
    folder = pathlib.Path(checkpoint)
    if not folder.is_dir():
        return
    check_checkpoint_config(folder)
    for name in command.RUNTIME_FILES:
        if os.path.lexists(folder / name) and (os.path.islink(folder / name) or not (folder / name).is_file()):
            raise InvalidInputError(
                f"{str(folder / name)!r} is a link or not a regular file: it is never followed, so the genai folder "
                "would lack it and genai could not use the folder.",
                hint=f"Replace the link by the file itself (cp -L {name} {name}.copy && mv {name}.copy {name}).",
            )


def _write_config(staged: pathlib.Path, checkpoint: pathlib.Path, model: onnx.ModelProto, **options: Any) -> dict:
    hf_config = _read_json(checkpoint, "config.json")
    if hf_config is None:
        raise InvalidInputError(f"{str(checkpoint)!r} has no config.json.", hint="Give the checkpoint folder save_pretrained wrote.")
    config = genai_config(model, hf_config, _read_json(checkpoint, "generation_config.json"), filename=MODEL_FILE, **options)
    (staged / CONFIG_FILE).write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")
    return config


def _checked(check: GenerationCheck | None, keep_on_mismatch: bool, report: Any = None) -> None:
    if check is not None and not check.ok and not keep_on_mismatch:
        raise ParityError(
            f"onnxruntime-genai's greedy tokens differ from transformers' generate: {check}\n"
            f"  genai:        {check.genai}\n  transformers: {check.transformers}",
            report=report,
            hint="Rerun with --keep-on-mismatch to write the folder anyway (exit code 1) and inspect it.",
        )


def _optimized(model_path: pathlib.Path, staged: pathlib.Path) -> Any:
    """``model_path`` rewritten into onnxruntime's fused kernels as ``staged/model.onnx``."""
    from onnx_modular.files.optimize.tool import optimize

    return optimize(model_path, staged / MODEL_FILE)


def export_genai(
    source: str | os.PathLike,
    output: str | os.PathLike,
    *,
    verify: bool = True,
    check: bool = True,
    keep_on_mismatch: bool = False,
    steps: int = 20,
    prompt: list[int] | None = None,
    opset_version: int | None = None,
    dedupe: bool = True,
    dtype: str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    share_buffer: bool | None = None,
    intra_op_threads: int | None = None,
    optimize: bool = False,
    log: Callable[[str], None] = lambda text: None,
    progress: Any = None,
) -> GenaiFolder:
    """Export the decoder of the checkpoint folder ``source`` into the folder ``output`` for
    onnxruntime-genai (see the module's docstring), check it against PyTorch (``verify``) and
    through genai's ``Generator`` (``check``: ``steps`` greedy tokens against ``generate``), then
    publish it (all files or none). ``share_buffer``/``intra_op_threads``: as
    :func:`~onnx_modular.files.genai_config.genai_config`. ``optimize``: the folder carries the
    file rewritten by :func:`onnx_modular.optimize` (fused kernels, verified step by step); with
    its ``GroupQueryAttention`` genai shares the past and present buffers (docs/optimize.md).

    Raises:
        GenaiError: genai cannot drive this model (before any work), or cannot run the folder.
        InvalidInputError: ``output`` is a ``.onnx`` file or its parent is missing; a bfloat16 export.
        ParityError: The file differs from PyTorch, or genai's tokens from ``generate`` (nothing
            written unless ``keep_on_mismatch``).
    """
    output, source = pathlib.Path(output), str(source)
    if output.suffix == ".onnx" or output.is_file():
        raise InvalidInputError(
            f"--genai writes a folder (model.onnx, genai_config.json, tokenizer files), so {str(output)!r} must be a folder.",
            hint="Give a folder: -o out/.",
        )
    if dtype in ("bfloat16", "bf16"):
        raise InvalidInputError(
            "onnxruntime-genai runs the file with onnxruntime, whose CPU provider has no bfloat16 kernels.",
            hint="Export in float32 (--dtype float32) or float16.",
        )
    save.check_destination(output / CONFIG_FILE if output.is_dir() else output)
    _check_checkpoint(source)
    if pathlib.Path(source).is_dir():  # refuse what genai cannot drive before loading anything
        check_drivable(transformers.AutoConfig.from_pretrained(source, local_files_only=True), source)
    stage = progress.stage if progress is not None else command._logged_stage(log)
    tolerance = user_tolerance(rtol, atol)
    with stage("load") as detail:
        model, inputs, _ = model_and_inputs(source, "causal-lm-with-past", dtype=dtype)
        check_drivable(model.config, source)
        inputs = genai_inputs(model, inputs)
        detail.append(f"({type(model).__name__}, {str(next(model.parameters()).dtype).replace('torch.', '')})")
    with stage("export"):
        config = ModularOnnxConfig(dynamic=True, dynamic_shapes=dynamic_shapes(inputs), opset_version=opset_version,
                                   dedupe=dedupe, verify=False)
        exported = ModularOnnxExporter().export(model, inputs, config)
        result = modular_result(exported)
        command._rename_io(result.model, optimum_io_names)
    report = failure = None
    if verify:
        with stage("verify"):
            try:
                report = verify_export(result, tolerance=tolerance)
            except ParityError as e:
                report, failure = result.report, e
    if failure is not None and not keep_on_mismatch:
        raise failure
    parent = output.parent if str(output.parent) else pathlib.Path(".")
    with locks.temp_folder(parent) as tmpdir:
        staged = tmpdir / "out"
        staged.mkdir()
        with stage("genai") as detail:
            if optimize:
                (tmpdir / "plain").mkdir()
                result.save(tmpdir / "plain" / MODEL_FILE)
                optimized = _optimized(tmpdir / "plain" / MODEL_FILE, staged)
            else:
                result.save(staged / MODEL_FILE)
                optimized = None
            modes = command._copy_runtime_files(source, staged)
            structure = load_model_file(staged / MODEL_FILE, values=False)
            written = _write_config(staged, pathlib.Path(source), structure, share_buffer=share_buffer,
                                    intra_op_threads=intra_op_threads)
            generation = check_generation(staged, model, prompt=prompt, steps=steps) if check else None
            if generation is not None:
                detail.append(f"({generation.equal} of {len(generation.transformers) - len(generation.prompt)} tokens equal)")
            _checked(generation, keep_on_mismatch, report)
        with stage("save"):
            save.publish_folder(staged, output, modes=modes)
    folder = GenaiFolder(output, written, generation, report, exported, optimized)
    if failure is not None:
        raise failure
    _checked(generation, False, report)  # kept on mismatch: written, then the error (exit code 1)
    return folder


def _copy_stages(plans: list, folder: pathlib.Path, staged: pathlib.Path) -> list[onnx.ModelProto]:
    """Each stage's file and its external data copied to ``staged/stage_<k>/``, the manifest
    rewritten to name them (the folder is a split folder too); their structures, in order."""
    manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    models = []
    for plan, stage in zip(plans, manifest["stages"]):
        source = pathlib.Path(plan.file)
        target = staged / (STAGE_FILE % plan.index)
        target.parent.mkdir()
        shutil.copyfile(source, target)
        for location in sorted(save.referenced_data(source)):
            shutil.copyfile(source.parent / location, target.parent / location)
        stage["file"] = STAGE_FILE % plan.index
        models.append(load_model_file(target, values=False))
    (staged / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return models


def _write_pipeline_folder(
    folder: pathlib.Path, checkpoint: pathlib.Path, output: pathlib.Path, *, check: bool, keep_on_mismatch: bool,
    steps: int, prompt: list[int] | None, share_buffer: bool | None, intra_op_threads: int | None,
) -> GenaiFolder:
    """:func:`write_genai_folder` of a folder ``split`` wrote: genai's decoder pipeline, one stage a file."""
    plans = read_stages(folder)  # the manifest as untrusted input, each stage against its file
    output = check_output_folder(output)  # stage folders inside: a new folder, moved in whole
    command.check_checkpoint_links(checkpoint)
    hf_config = _read_json(checkpoint, "config.json")
    if hf_config is None:
        raise InvalidInputError(f"{str(checkpoint)!r} has no config.json.", hint="Give the checkpoint folder save_pretrained wrote.")
    with new_folder(output, "the genai folder", hint="Check free disk space and permissions.") as staged:
        models = _copy_stages(plans, folder, staged)
        written = pipeline_config(plans, models, hf_config, _read_json(checkpoint, "generation_config.json"),
                                  share_buffer=share_buffer, intra_op_threads=intra_op_threads)
        (staged / CONFIG_FILE).write_text(json.dumps(written, indent=4) + "\n", encoding="utf-8")
        for name, mode in command._copy_runtime_files(str(checkpoint), staged).items():
            os.chmod(staged / name, os.stat(staged / name).st_mode & mode)
        generation = None
        if check:
            model = load_checkpoint(checkpoint, "causal-lm-with-past")
            generation = check_generation(staged, model, prompt=prompt, steps=steps)
            _checked(generation, keep_on_mismatch)
    result = GenaiFolder(output, written, generation)
    _checked(generation, False)
    return result


def write_genai_folder(
    model_path: str | os.PathLike,
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    check: bool = True,
    keep_on_mismatch: bool = False,
    steps: int = 20,
    prompt: list[int] | None = None,
    share_buffer: bool | None = None,
    intra_op_threads: int | None = None,
    optimize: bool = False,
) -> GenaiFolder:
    """The genai folder of a decoder file already exported with its cache and Optimum's names
    (``onnx-modular export CKPT --task causal-lm-with-past --io-names optimum -o M.onnx``, or an
    optimized copy of it): the file (and its external data) copied in as ``model.onnx``,
    ``genai_config.json`` written from the file's inputs and outputs and ``checkpoint``'s
    configs, the tokenizer files copied; checked through genai against ``generate`` of the
    checkpoint's model when ``check``.

    ``model_path`` may also be a folder ``split`` wrote from a with-cache file (``--task
    causal-lm-with-past``, either names): the stages are copied in as ``stage_<k>/model.onnx``
    with the manifest, and ``genai_config.json`` runs them as genai's decoder pipeline
    (:func:`~onnx_modular.files.genai_pipeline.pipeline_config`; docs/pipeline.md).

    Raises:
        InvalidInputError: A split folder whose manifest does not match its stages (the stage named).
        GenaiError: The file's inputs or outputs are not what genai drives (a sliding-window
            cache exported without --genai, transformers' cache names), or genai cannot run it.
        ParityError: genai's tokens differ from ``generate`` (nothing written unless ``keep_on_mismatch``).
    """
    model_path, checkpoint, output = pathlib.Path(model_path), pathlib.Path(checkpoint), pathlib.Path(output)
    if output.suffix == ".onnx" or output.is_file():
        raise InvalidInputError(f"{str(output)!r} must be a folder (model.onnx, genai_config.json, tokenizer files).")
    if is_split_folder(model_path):
        if optimize:
            raise InvalidInputError("--optimize rewrites one file; a split folder's stages are copied as they are.",
                                    hint="Optimize the whole file first (onnx-modular optimize), then split it.")
        return _write_pipeline_folder(model_path, checkpoint, output, check=check, keep_on_mismatch=keep_on_mismatch,
                                      steps=steps, prompt=prompt, share_buffer=share_buffer,
                                      intra_op_threads=intra_op_threads)
    structure = load_model_file(model_path, values=False)
    decoder_io(structure)  # the file's names and cache, before anything is copied
    save.check_destination(output / CONFIG_FILE if output.is_dir() else output)
    _check_checkpoint(checkpoint)
    parent = output.parent if str(output.parent) else pathlib.Path(".")
    with locks.temp_folder(parent) as tmpdir:
        staged = tmpdir / "out"
        staged.mkdir()
        optimized = _optimized(model_path, staged) if optimize else None
        if optimized is None:
            shutil.copyfile(model_path, staged / MODEL_FILE)
            for location in sorted(save.referenced_data(model_path)):
                shutil.copyfile(model_path.parent / location, staged / location)
        structure = load_model_file(staged / MODEL_FILE, values=False)
        modes = command._copy_runtime_files(str(checkpoint), staged)
        written = _write_config(staged, checkpoint, structure, share_buffer=share_buffer, intra_op_threads=intra_op_threads)
        generation = None
        if check:
            model = load_checkpoint(checkpoint, "causal-lm-with-past")
            generation = check_generation(staged, model, prompt=prompt, steps=steps)
            _checked(generation, keep_on_mismatch)
        save.publish_folder(staged, output, modes=modes)
    folder = GenaiFolder(output, written, generation, optimized=optimized)
    _checked(generation, False)
    return folder

