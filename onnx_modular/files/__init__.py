"""The file tools: what users do with an ONNX file that has local functions; none imports torch.

- :mod:`~onnx_modular.files.inline`: inlining into a copy, written atomically;
- :mod:`~onnx_modular.calls.flat`: the inlined, optimized flat copy, its nodes labelled by module;
- :mod:`~onnx_modular.files.extract`: one module call (or class) as a model of its own, with ONNX test data;
- :mod:`~onnx_modular.files.replace`: a block's graph as the body of a call's (or class's) function;
- :mod:`~onnx_modular.files.split.tool`: the model cut into stages at module boundaries, a manifest, ``run_stages``;
- :mod:`~onnx_modular.files.convert.tool`: precision (float16, bfloat16) and int4/int8 weights chosen per module;
- :mod:`~onnx_modular.files.view`: the file served to Netron locally;
- :mod:`~onnx_modular.files.modularize.tool`: the module hierarchy of a flat file (torch's exporters,
  Optimum) rebuilt from its scopes with the export's passes.

They stand on the rooms below them: :mod:`onnx_modular.storage` (the file in and out),
:mod:`onnx_modular.calls` (a file's call tree and the capture of its calls' values) and
:mod:`onnx_modular.check` (onnxruntime runs and parity). The names below are re-exported for
convenience; each has one home.

Example::

    from onnx_modular.files import function_tree, load_model_file

    tree = function_tree(load_model_file("gpt2.onnx"))
    print(tree.format(max_depth=2))
"""

from onnx_modular.calls.tree import MAX_TREE_CALLS, function_tree
from onnx_modular.check.parity import OutputParity, ParityReport, Tolerance, check_file
from onnx_modular.files.inline import inline_file
from onnx_modular.runtime.inputs import check_feeds, model_inputs, random_inputs
from onnx_modular.storage.checks import MAX_DIMENSION, MAX_NESTING, check_model_structure
from onnx_modular.storage.load import load_model_file

__all__ = [
    "MAX_DIMENSION",
    "MAX_NESTING",
    "MAX_TREE_CALLS",
    "load_model_file",
    "check_model_structure",
    "function_tree",
    "inline_file",
    "model_inputs",
    "random_inputs",
    "check_feeds",
    "Tolerance",
    "OutputParity",
    "ParityReport",
    "check_file",
]
