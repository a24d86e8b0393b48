"""A file run in onnxruntime, torch-free: the layer below everything that runs a file.

* :mod:`~onnx_modular.runtime.sessions`: sessions, runs, the in-memory flat copy, temporary files;
* :mod:`~onnx_modular.runtime.inputs`: declared inputs, valid random feeds, feed checks, ``--inputs`` files.
* :mod:`~onnx_modular.runtime.generation`: greedy decoding with a with-cache file (``onnx_modular.generate``).

Verification (:mod:`onnx_modular.check`), the call capture (:mod:`onnx_modular.calls`), profiling
and the file tools all run files through it; it imports none of them (docs/design.md, "Code map").
"""
