"""transformers export backend: ``import onnx_modular.hf`` registers the format ``"onnx_modular"``.

transformers' exporters (``transformers.exporters``) then export, run, save, load and split
models for generation as modular ONNX files::

    import onnx_modular.hf
    from transformers.exporters.auto import get_exporter_class

    exporter = get_exporter_class("onnx_modular")()
    exported = exporter.export(model, {"input_ids": ids}, {"dynamic": True})
    exported(input_ids=ids).logits                      # onnxruntime
    exported.save_pretrained("out")                     # model.onnx (+ .data), export.json, config.json
    ExportedModel.from_pretrained("out")(input_ids=ids)
    exporter.export_for_generation(model, {"input_ids": ids}, {"dynamic": True})   # prefill, decode

This is the only place onnx_modular imports transformers (the extra ``onnx-modular[hf]``).
"""

from __future__ import annotations

from onnx_modular.errors import MissingDependencyError

try:
    import transformers
    from transformers.exporters import auto as _auto  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise MissingDependencyError(
        f"onnx_modular.hf needs transformers with its exporters (transformers>=5.23): {e}",
        hint="Install the extra: pip install 'onnx-modular[hf]'.",
    ) from e

from onnx_modular.hf.versions import check_transformers_version

check_transformers_version(transformers.__version__)  # before the modules that use transformers' API

from onnx_modular.hf.checkpoint import (  # noqa: E402
    TASKS,
    load_checkpoint,
    model_and_inputs,
    sample_inputs,
    supported_tasks,
)
from onnx_modular.hf.command import export_checkpoint  # noqa: E402
from onnx_modular.hf.exporter import (  # noqa: E402
    EXPORT_FORMAT,
    ModularOnnxConfig,
    ModularOnnxExporter,
    ModularOnnxModelRunner,
    modular_result,
    register,
)
from onnx_modular.hf.genai import export_genai, write_genai_folder  # noqa: E402
from onnx_modular.hf.generation import greedy_generate  # noqa: E402
from onnx_modular.hf.meta import model_on_meta, zero_cache  # noqa: E402

__all__ = [
    "EXPORT_FORMAT",
    "ModularOnnxConfig",
    "ModularOnnxExporter",
    "ModularOnnxModelRunner",
    "TASKS",
    "export_checkpoint",
    "export_genai",
    "write_genai_folder",
    "model_and_inputs",
    "greedy_generate",
    "load_checkpoint",
    "model_on_meta",
    "modular_result",
    "register",
    "sample_inputs",
    "supported_tasks",
    "zero_cache",
]

register()
