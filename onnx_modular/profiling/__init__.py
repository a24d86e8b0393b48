"""Run time per module call in onnxruntime (``onnx_modular.profile``), torch-free.

* :mod:`~onnx_modular.profiling.run`: the profiled runs (``profile``);
* :mod:`~onnx_modular.profiling.attribution`: which module call each onnxruntime kernel belongs to;
* :mod:`~onnx_modular.profiling.report`: the report (times per kernel, call and class);
* :mod:`~onnx_modular.profiling.views`: the terminal tree, the Chrome trace, the HTML flame chart.

(Named ``profiling`` so that the package never shadows the ``onnx_modular.profile`` function.)
"""
