"""The torch side of an export: capture, the eager reference run, input/output names, the call tree.

* :mod:`~onnx_modular.capture.strategies`: the capture strategies (torch.export, size-oblivious,
  torch's suggested fixes, draft_export, on meta), tried in turn, the winner recorded;
* :mod:`~onnx_modular.capture.torch_compat`: the only module on torch's private API (decompose,
  translate, the translation registry, the hooks the strategies and symbols need);
* :mod:`~onnx_modular.capture.reference_run`: the eager reference run that records every module call;
* :mod:`~onnx_modular.capture.pytree_io`: pytree input/output names and dynamic shapes;
* :mod:`~onnx_modular.capture.fx_call_tree`: the call tree from the FX program's module stacks;
* :mod:`~onnx_modular.capture.fx_fixes`: the FX pass run inside torch's decomposition;
* :mod:`~onnx_modular.capture.symbols`: sizes torch proved equal made one symbol and one FX node;
* :mod:`~onnx_modular.capture.selection`: the ``modules=`` option;
* :mod:`~onnx_modular.capture.diagnostics`: which module a torch error came from;
* :mod:`~onnx_modular.capture.library_hooks`: what model libraries (transformers, filled in by
  :mod:`onnx_modular.hf.hooks`) add to a capture, without the core importing them.
"""
