"""RelativeStackTracesPass: torch's stack traces keep file and line, not the exporting machine's folders."""

from __future__ import annotations

import sys

import onnx_ir as ir

from onnx_modular.format import metadata
from onnx_modular.passes.export.relative_paths import RelativeStackTracesPass

MODEL = """
<ir_version: 10, opset_import: ["" : 18, "pkg.test" : 1]>
main (float[2] x) => (float[2] y) {
  s = Relu(x)
  y = pkg.test.Scale(s)
}
<domain: "pkg.test", opset_import: ["" : 18]>
Scale (input) => (output) {
  output = Neg(input)
}"""


def test_paths_become_relative_to_their_import_root(tmp_path, monkeypatch):
    root = tmp_path / "home" / "alice" / "site-packages"
    monkeypatch.setattr(sys, "path", [str(tmp_path / "home"), str(root)])
    trace = f'File "{root}/transformers/models/gpt2/modeling_gpt2.py", line 310, in forward\n    x = f(x)'
    model = ir.from_onnx_text(MODEL)
    body = next(iter(model.functions.values()))
    nodes = [*model.graph, *body]
    for node in nodes:
        node.metadata_props[metadata.TORCH_STACK_TRACE] = trace
    elsewhere = 'File "/opt/other/place/model.py", line 7, in forward'
    nodes[0].metadata_props[metadata.TORCH_STACK_TRACE] = elsewhere
    assert RelativeStackTracesPass()(model).modified
    assert nodes[0].metadata_props[metadata.TORCH_STACK_TRACE] == 'File "model.py", line 7, in forward'
    for node in nodes[1:]:  # the longest import root wins: site-packages, not home
        assert node.metadata_props[metadata.TORCH_STACK_TRACE] == (
            'File "transformers/models/gpt2/modeling_gpt2.py", line 310, in forward\n    x = f(x)'
        )
    assert not RelativeStackTracesPass()(model).modified  # relative paths stay as they are
    assert metadata.source_path("model.py") == "model.py"
