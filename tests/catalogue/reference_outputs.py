"""PyTorch's reference outputs that a row compares both files against, made informative: seeded
noise on weights whose outputs are all ~0 (:func:`with_signal`) and on ties that torch.topk would
break at random (:func:`without_ties`); what the row records about them (:func:`reference`)."""

from __future__ import annotations

from typing import Any

#: PyTorch's outputs all within this of 0 (float32's atol): a parity pass on them says nothing.
NEAR_ZERO = 1e-4


def reference_max_abs(expected: list) -> float | None:
    """The largest magnitude of the floating-point reference outputs (``None``: none is floating)."""
    values = [float(t.detach().abs().max()) for t in expected if t.is_floating_point() and t.numel()]
    return max(values) if values else None


def with_signal(model, inputs: dict[str, Any], expected: list) -> tuple[list, bool]:
    """``(expected, jittered)``: when PyTorch's outputs are all within :data:`NEAR_ZERO` of 0 (a
    random-weight head whose weights start at 0), every floating parameter gets seeded noise
    (std 0.02, as transformers' init) and the reference is computed again; the same in both
    children, so flat and modular compare the same model."""
    import torch

    magnitude = reference_max_abs(expected)
    if magnitude is None or magnitude > NEAR_ZERO:
        return expected, False
    _jitter(model)
    with torch.no_grad():
        return output_tensors(model(**inputs)), True


def _jitter(model) -> None:
    """Seeded noise (std 0.02, as transformers' init) on every floating parameter, in name order."""
    import torch

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters(), key=lambda item: item[0]):
            if parameter.is_floating_point():
                parameter.add_(torch.randn(parameter.shape, generator=generator).to(parameter.dtype) * 0.02)


def _unit_batch_norms(model) -> int:
    """Every batch norm's scale at 1 (PyTorch's own init; transformers draws some, RT-DETR's among
    them, from N(0, 0.02), and a dozen such layers in a row take the features to ~1e-17). The
    number of layers set."""
    import torch

    count = 0
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if "BatchNorm" in type(module).__name__ and isinstance(weight, torch.Tensor) and weight.is_floating_point():
                weight.fill_(1.0)
                count += 1
    return count


def _watched(model, inputs: dict[str, Any]) -> tuple[list, list]:
    """``(outputs, ties)``: the model's outputs, and each ``torch.topk`` whose input ties (check/ties.py)."""
    import torch

    from onnx_modular.check.ties import TieWatch

    with TieWatch() as watch, torch.no_grad():
        outputs = output_tensors(model(**inputs))
    return outputs, watch.ties


def without_ties(model, inputs: dict[str, Any], expected: list) -> tuple[list, bool, str | None]:
    """``(expected, changed, ties)``: when PyTorch's reference selects with ``torch.topk`` among
    equal values (random weights whose features vanish: every query's score is the bias), torch's
    kernel and ONNX's TopK pick different elements among the ties, both rightly, and the outputs
    differ by whole units: a parity check on them says nothing. The weights are then made to
    give distinct scores, seeded (the same in both children): jittered as :func:`with_signal`
    does, then, if ties remain, every batch norm's scale at 1 as well. ``ties`` says what was
    found and done (``None``: no tie; it ends in "remain" when neither broke them)."""
    outputs, ties = _watched(model, inputs)
    if not ties:
        return expected, False, None
    found = "; ".join(str(tie) for tie in ties[:3]) + ("; ..." if len(ties) > 3 else "")
    _jitter(model)
    outputs, left = _watched(model, inputs)
    if not left:
        return outputs, True, f"torch.topk on ties ({found}): broken by jittered weights"
    norms = _unit_batch_norms(model)
    outputs, left = _watched(model, inputs) if norms else (outputs, left)
    if not left:
        return outputs, True, f"torch.topk on ties ({found}): broken by jittered weights and {norms} batch norm scales at 1"
    rest = "; ".join(str(tie) for tie in left[:3])
    return outputs, True, f"torch.topk on ties ({found}): {TIES_REMAIN} ({rest})"


#: How :func:`without_ties` ends when no re-draw of the weights broke the ties.
TIES_REMAIN = "ties remain after jittered weights and batch norm scales at 1"


def reference(model, inputs: dict[str, Any], expected: list, record: dict[str, Any]) -> tuple[list, bool]:
    """PyTorch's reference as both children compare it (:func:`with_signal`, :func:`without_ties`),
    recorded (:func:`_signal_record`); ``(expected, False)`` when a parity check on it says nothing."""
    expected, jittered = with_signal(model, inputs, expected)
    expected, redrawn, ties = without_ties(model, inputs, expected)
    if ties:
        record["ties"] = ties
    return expected, _signal_record(record, expected, jittered or redrawn)


def _signal_record(record: dict[str, Any], expected: list, jittered: bool) -> bool:
    """Record the reference's magnitude; ``False`` (and the row's error) when it is still ~0."""
    record["reference_max_abs"] = reference_max_abs(expected)
    if jittered:
        record["jittered"] = True
    if record["reference_max_abs"] is not None and record["reference_max_abs"] <= NEAR_ZERO:
        record.update(ok=False, stage="reference", error=f"PyTorch's outputs are all within {NEAR_ZERO:g} of 0, jittered "
                      "weights too: a parity check on them says nothing")
        return False
    return True


def output_tensors(output) -> list:
    import torch

    leaves = torch.utils._pytree.tree_leaves(output.to_tuple() if hasattr(output, "to_tuple") else output)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def call_depth(call, level: int = 0) -> int:
    return max([level] + [call_depth(child, level + 1) for child in call.children])
