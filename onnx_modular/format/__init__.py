"""The file contract, torch-free: every metadata key (file and in-memory), call naming, the call tree type.

* :mod:`~onnx_modular.format.metadata`: every key onnx_modular writes or reads, and the walks
  that resolve a call to its module path;
* :mod:`~onnx_modular.format.calltree`: :class:`CallTree` / :class:`ModuleCall`, the function tree
  of an export (built from FX in :mod:`onnx_modular.capture.fx_call_tree`, read from a file in
  :mod:`onnx_modular.calls.tree`);
* :mod:`~onnx_modular.format.text`: how names and values are shown in messages.
* :mod:`~onnx_modular.format.scopes`: torch's scope metadata on a flat file's nodes, read.
"""
