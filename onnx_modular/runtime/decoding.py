"""``onnx_modular.generate``: greedy tokens from whatever holds a decoder with its cache, torch-free.

* one ``.onnx`` file or a ``--generation`` folder: :func:`onnx_modular.runtime.generation.generate`;
* a folder ``split`` wrote from such a file: its stages as a pipeline in this process
  (:func:`onnx_modular.runtime.pipeline.generate_stages`), or with ``ray_address`` each stage on
  its own worker of a Ray cluster (:func:`onnx_modular.runtime.cluster.generate_on_ray`).

Every route runs the one greedy loop (:func:`~onnx_modular.runtime.generation.greedy_steps`), so
the tokens are the same.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from onnx_modular.runtime import generation
from onnx_modular.runtime.pipeline import generate_stages, is_split_folder

__all__ = ["generate"]


def generate(
    path: str | os.PathLike,
    input_ids: Any,
    max_new_tokens: int = 20,
    *,
    execution_provider: str | None = None,
    ray_address: str | None = None,
    stages_per_node: int | None = None,
    resources: Mapping | Sequence | None = None,
    micro_batches: int | None = None,
    threads: int | None = None,
    timeout: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> np.ndarray:
    """Greedy generation in onnxruntime: the prompt followed by ``max_new_tokens`` tokens
    (``int64``, ``[batch, length + max_new_tokens]``), the tokens of transformers'
    ``model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n)``.

    ``path``: a with-cache ``.onnx`` file, a ``--generation`` folder, or a folder ``split`` wrote
    from a with-cache file (its stages run as a pipeline, each keeping its layers' cache).
    ``ray_address``: run the stages on the Ray cluster there (``ray start --head`` prints it), one
    worker a stage (``stages_per_node``, ``resources``, ``micro_batches``, ``timeout``: see
    :func:`~onnx_modular.runtime.cluster.generate_on_ray`). ``threads``: onnxruntime's intra-op
    threads of each stage. ``progress(done, max_new_tokens)``: called as each new token of a file or a
    ``--generation`` folder is chosen.

    Example::

        import onnx_modular
        tokens = onnx_modular.generate("llama.int4.onnx", [[1, 306, 4966]], max_new_tokens=20)
        tokens = onnx_modular.generate("stages/", [[1, 306, 4966]], ray_address="10.0.0.1:6379")

    Raises:
        InvalidInputError: The path is missing, the file or the stages take inputs the loop cannot
            build, Ray options without ``ray_address``.
        VerificationError: onnxruntime cannot load or run a file.
        PipelineError: On Ray, a stage's worker died, gave no answer in time or could not load it.
    """
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        from onnx_modular.errors import InvalidInputError

        raise InvalidInputError(f"path must be a file or folder path, not {type(path).__name__}.",
                                hint='generate("model.onnx", [[1, 2]])')
    ray_options = {"stages_per_node": stages_per_node, "resources": resources, "micro_batches": micro_batches,
                   "timeout": timeout}
    if ray_address is not None:
        from onnx_modular.runtime.cluster import DEFAULT_TIMEOUT, generate_on_ray

        ray_options["timeout"] = DEFAULT_TIMEOUT if timeout is None else timeout
        return generate_on_ray(path, input_ids, max_new_tokens, address=ray_address, threads=threads, **ray_options).tokens
    given = sorted(name for name, value in ray_options.items() if value is not None)
    if given:
        from onnx_modular.errors import InvalidInputError

        raise InvalidInputError(f"{', '.join(given)} go with ray_address=.", hint="Pass ray_address='IP:PORT'.")
    if is_split_folder(path):
        return generate_stages(path, input_ids, max_new_tokens, threads=threads, execution_provider=execution_provider)
    if threads is not None:
        from onnx_modular.errors import InvalidInputError

        raise InvalidInputError("threads= sets the threads of a split folder's stages; this is one file or a --generation folder.",
                                hint="Drop threads=, or give the folder split wrote.")
    return generation.generate(path, input_ids, max_new_tokens, execution_provider=execution_provider, progress=progress)
