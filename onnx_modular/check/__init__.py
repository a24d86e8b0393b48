"""The one home of verification: numerics of a file in onnxruntime, against PyTorch or itself.

The onnxruntime half (torch-free; files run through :mod:`onnx_modular.runtime`):

* :mod:`~onnx_modular.check.parity`: the record types (:class:`Parity`, :class:`ParityReport`),
  tolerances and their defaults, the file-only comparison (modular against its flat copy).

The PyTorch half (imports torch when used):

* :mod:`~onnx_modular.check.verification`: onnxruntime (modular, flat) vs PyTorch outputs;
* :mod:`~onnx_modular.check.localization`: the first module call that diverges;
* :mod:`~onnx_modular.check.blockwise`: block by block, for models whose weights are streamed.
"""
