"""The module calls of an ONNX file, shared by every file tool, torch-free.

* :mod:`~onnx_modular.calls.tree`: the call tree of a file (:class:`~onnx_modular.format.calltree.CallTree`);
* :mod:`~onnx_modular.calls.targets`: calls found by path, class or glob; one call given bodies of
  its own; a call's values exposed as outputs of the main graph;
* :mod:`~onnx_modular.calls.capture`: every call's outputs (or a few calls' inputs and outputs) from
  onnxruntime runs of the real model, a batch of calls under a byte budget at a time (two files
  compared side by side: ``paired_calls``).
* :mod:`~onnx_modular.calls.bodies`: a call's own body as a computation (names out, weights by
  hash) and what differs between two (``diff``);
* :mod:`~onnx_modular.calls.scoped`: the call tree a flat file's recorded scopes give (``modularize``).

``extract``, ``replace``, ``convert``, ``diff``, ``split``, ``modularize`` and ``localize`` use these,
and nothing else reads a file's calls.
"""
