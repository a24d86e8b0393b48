"""Tools for ONNX files with local functions; none of them imports torch.

- :mod:`~onnx_modular.files.load`: checked loading (a protobuf wire scan, then structure checks);
- :mod:`~onnx_modular.files.checks`: the structure checks (sizes, missing functions, recursion);
- :mod:`~onnx_modular.files.tree`: the call tree of a file (:class:`~onnx_modular.format.calltree.CallTree`);
- :mod:`~onnx_modular.files.inline`: inlining into a copy, written atomically;
- :mod:`~onnx_modular.files.runtime`: onnxruntime sessions, runs, the flat copy, temporary files;
- :mod:`~onnx_modular.files.inputs`: declared inputs, valid random feeds, feed checks;
- :mod:`~onnx_modular.files.parity`: the parity report (modular, flat, reference);
- :mod:`~onnx_modular.files.profile`: run time per module call (``onnx_modular.profile``), with
  :mod:`~onnx_modular.files.attribution` (which call each kernel belongs to),
  :mod:`~onnx_modular.files.profile_report` (the report: times per kernel, call and class) and
  :mod:`~onnx_modular.files.profile_views` (Chrome trace, HTML flame chart);
- :mod:`~onnx_modular.files.extract`: one module call (or class) as a model of its own, with ONNX test data;
- :mod:`~onnx_modular.files.replace`: a block's graph as the body of a call's (or class's) function.

Example::

    from onnx_modular.files import function_tree, load_model_file

    tree = function_tree(load_model_file("gpt2.onnx"))
    print(tree.format(max_depth=2))
"""

from onnx_modular.files.checks import MAX_DIMENSION, MAX_NESTING, check_model_structure
from onnx_modular.files.inline import inline_file
from onnx_modular.files.inputs import check_feeds, model_inputs, random_inputs
from onnx_modular.files.load import load_model_file
from onnx_modular.files.parity import OutputParity, ParityReport, Tolerance, check_file
from onnx_modular.files.tree import MAX_TREE_CALLS, function_tree

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
