"""Numerics against PyTorch: verify a file, localize a divergence, check block by block.

* :mod:`~onnx_modular.check.verification`: onnxruntime (modular, flat) vs PyTorch outputs;
* :mod:`~onnx_modular.check.localization`: the first module call that diverges;
* :mod:`~onnx_modular.check.blockwise`: block by block, for models whose weights are streamed.

The file-only comparison (no PyTorch) is :mod:`onnx_modular.files.parity`.
"""
