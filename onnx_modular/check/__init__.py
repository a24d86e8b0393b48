"""The one home of verification: numerics of a file in onnxruntime, against PyTorch or itself.

The onnxruntime half (torch-free; files run through :mod:`onnx_modular.runtime`):

* :mod:`~onnx_modular.check.parity`: the record types (:class:`Parity`, :class:`ParityReport`),
  tolerances and their defaults, the file-only comparison (modular against its flat copy).

The entry of an export's check: :func:`~onnx_modular.check.dispatch.verify_export` (plain,
bfloat16-widened, block by block, the flat copy), called by ``export_modular``,
``ModularExport.verify`` / ``.save`` and the transformers backend.

The PyTorch half (imports torch when used):

* :mod:`~onnx_modular.check.verification`: onnxruntime (modular, flat) vs PyTorch outputs;
* :mod:`~onnx_modular.check.localization`: the first module call that diverges;
* :mod:`~onnx_modular.check.blockwise`: block by block, for models whose weights are streamed.
"""

__all__ = ["verify_export", "assert_verified"]


def __getattr__(name: str):
    """``check.verify_export``: the one entry of an export's check, imported on first use."""
    if name in __all__:
        from onnx_modular.check import dispatch

        return getattr(dispatch, name)
    raise AttributeError(f"module 'onnx_modular.check' has no attribute {name!r}")
