"""A folder ``split`` wrote, run: the stages in order in onnxruntime, each fed the model's inputs
and the outputs of the stages before it, as ``manifest.json`` says.

The manifest is read as untrusted input and every stage file is checked with the bounds of every
tool before anything runs (:mod:`onnx_modular.storage.manifest`). The folder's layout
(:data:`MANIFEST`, ``stage_<k>/``:data:`MODEL_FILE`) is defined here, where it is read.

Example::

    outputs = run_stages("stages/", {"input_ids": ids, "attention_mask": mask}, ["cuda", None])
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping, Sequence

import numpy as np

from onnx_modular.errors import InvalidInputError
from onnx_modular.format.text import shown
from onnx_modular.runtime import sessions as runtime
from onnx_modular.storage.manifest import check_feeds, check_stage_file, read_manifest

__all__ = ["MANIFEST", "MODEL_FILE", "run_stages"]

#: The manifest's name in the output folder.
MANIFEST = "manifest.json"
#: Each stage's model in its folder (ONNX's test-case layout, as ``extract`` writes).
MODEL_FILE = "model.onnx"


def _read_manifest(folder: pathlib.Path) -> tuple[dict, list[pathlib.Path]]:
    """The manifest read as untrusted input, and its stage files (:mod:`~onnx_modular.storage.manifest`)."""
    return read_manifest(folder, MANIFEST)


def run_stages(
    folder: str | os.PathLike,
    feeds: Mapping[str, np.ndarray],
    execution_providers: str | Sequence[str | None] | None = None,
) -> dict[str, np.ndarray]:
    """Run the stages :func:`split` wrote, in order, in onnxruntime; return the model's outputs.

    Args:
        folder: The folder with ``manifest.json``.
        feeds: The whole model's inputs by name.
        execution_providers: ``None`` (CPU), one provider for every stage (``"cuda"``), or one
            per stage (``None`` entries: CPU).

    Returns:
        The model's outputs by name, in the order of the manifest.

    Raises:
        InvalidInputError: Not a split folder, a missing input, a provider list of another length.
        ExecutionProviderError: This onnxruntime build lacks a provider.
        VerificationError: onnxruntime cannot load or run a stage.

    Example::

        outputs = run_stages("stages/", {"input_ids": ids, "attention_mask": mask}, ["cuda", None])
    """
    folder = pathlib.Path(folder)
    manifest, files = _read_manifest(folder)
    stages = manifest["stages"]
    feeds = check_feeds(feeds, len(stages))
    for k, file in enumerate(files):  # every stage with the bounds of every tool, before anything runs
        check_stage_file(file, k)
    if execution_providers is None or isinstance(execution_providers, str):
        providers = [execution_providers] * len(stages)
    else:
        providers = list(execution_providers)
        if len(providers) != len(stages):
            raise InvalidInputError(
                f"{len(providers)} execution providers for {len(stages)} stages.",
                hint="Give one provider for all stages, or one per stage.",
            )
    produced: dict[str, np.ndarray] = {}
    for k, (stage, provider) in enumerate(zip(stages, providers)):
        stage_feeds = {}
        for name, source in stage["inputs"].items():
            if source in produced:
                stage_feeds[name] = produced[source]
            elif source in feeds:
                stage_feeds[name] = feeds[source]
            else:
                raise InvalidInputError(
                    f"Stage {k} needs {shown(source)!r} (as its input {shown(name)!r}), which the inputs do not hold.",
                    hint=f"Give every model input the manifest names ({MANIFEST}).",
                )
        session = runtime.session(str(files[k]), provider, arena=False, what=f"stage {k}")  # one run
        names, arrays = runtime.run(session, stage_feeds, what=f"stage {k}")
        produced.update({f"stage_{k}/{name}": array for name, array in zip(names, arrays)})
    return {name: produced[source] for name, source in manifest["outputs"].items()}
