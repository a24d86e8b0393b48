"""A file run in onnxruntime, torch-free: the layer below everything that runs a file.

* :mod:`~onnx_modular.runtime.sessions`: sessions, runs, the in-memory flat copy, temporary files;
* :mod:`~onnx_modular.runtime.inputs`: declared inputs, valid random feeds, feed checks, ``--inputs`` files.
* :mod:`~onnx_modular.runtime.generation`: the greedy decoding loop, and a with-cache file decoded with it;
* :mod:`~onnx_modular.runtime.pipeline`: a split decoder's stages as a pipeline, each holding its layers' cache;
* :mod:`~onnx_modular.runtime.cluster`: those stages on Ray workers, one a stage (``pip install "onnx-modular[ray]"``);
* :mod:`~onnx_modular.runtime.decoding`: ``onnx_modular.generate``, which picks among them.

Verification (:mod:`onnx_modular.check`), the call capture (:mod:`onnx_modular.calls`), profiling
and the file tools all run files through it; it imports none of them (docs/design.md, "Code map").
"""
