"""What ``optimize`` reports: :class:`Fusion`, one class's body and what a step did with it, and
:class:`OptimizeReport`, the whole run (``text()`` for the terminal; ``--json`` through
:mod:`onnx_modular.format.records`)."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Fusion", "OptimizeReport"]


@dataclasses.dataclass
class Fusion:
    """One class's body (one local function) and what a step did with it.

    Attributes:
        step: ``rms_norm``, ``skip_norm``, ``attention``, ``skip_layer_norm``, ``mha``, ``activation`` or ``moe``.
        function: The function's name (``LlamaAttention``).
        module_class: Its module class when the file records it, else the function name.
        fused: Whether the rewrite was kept.
        op: The fused op written (``com.microsoft.GroupQueryAttention``).
        reason: Why it was not fused (``None`` when fused).
        max_abs_diff: The largest difference between its calls' outputs before and after (verified runs).
        calls: How many calls of it were compared.
        packed_qkv: (attention) its query, key and value projections became one MatMul.
    """

    step: str
    function: str
    module_class: str
    fused: bool
    op: str
    reason: str | None = None
    max_abs_diff: float | None = None
    calls: int = 0
    packed_qkv: bool = False


@dataclasses.dataclass
class OptimizeReport:
    """What :func:`optimize` did.

    Attributes:
        source, output: The files.
        fusions: One entry per class body a step rewrote or refused.
        attention: The fused attention ops (``"GroupQueryAttention"``; ``"Attention"`` for packed
            self-attention without a cache, ``"MultiHeadAttention"`` for the rest; joined by ``+``
            when several) when every attention body was fused, else ``None``.
        added_inputs: Formal inputs added to function signatures (threaded from the main graph,
            computed there from ``attention_mask``); the main graph's own inputs are unchanged.
        verified: Whether the steps were checked in onnxruntime (``verify=True``).
        nodes_before, nodes_after: Nodes per run with every call expanded (``onnx-modular tree``'s counts).
        quantization: With ``quantize``: what was quantized and the accuracy guard's report.
    """

    source: str
    output: str
    fusions: list[Fusion]
    attention: str | None
    added_inputs: list[str]
    verified: bool
    nodes_before: int = 0
    nodes_after: int = 0
    quantization: Any = None  # optimize_quantize.Quantization with quantize=
    left_padding: float | None = None  # the logits' drift on a left-padded batch, when beyond tolerance

    @property
    def fused_classes(self) -> list[str]:
        return sorted({f.module_class for f in self.fusions if f.fused})

    @property
    def packed_qkv(self) -> list[str]:
        return sorted({f.module_class for f in self.fusions if f.fused and f.packed_qkv})

    @property
    def not_fused(self) -> list[Fusion]:
        return [f for f in self.fusions if not f.fused]

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["fused_classes"] = self.fused_classes
        data["packed_qkv"] = self.packed_qkv
        return data

    def text(self) -> str:
        checked = (" (each step verified in onnxruntime)" if self.left_padding is None else
                   f" (each step verified in onnxruntime on a prompt, a decode step, a long prompt and a right-padded batch; "
                   f"NOT on left-padded batches: the logits differ by {self.left_padding:.3g} on their real tokens, as the "
                   "fused attention reads positions from the mask; pad on the right or run one prompt at a time)")
        lines = [f"Optimized {self.source} -> {self.output}" + (checked if self.verified else " (not verified)")]
        width = max([len(f.module_class) + (0 if f.function == f.module_class else len(f.function) + 3)
                     for f in self.fusions] + [10])
        step_width = max([len(f.step) for f in self.fusions] + [9])
        for fusion in self.fusions:
            status = f"fused -> {fusion.op}" if fusion.fused else f"not fused: {fusion.reason}"
            drift = f"  max diff {fusion.max_abs_diff:.2e} over {fusion.calls} calls" if fusion.max_abs_diff is not None else ""
            label = fusion.module_class if fusion.function == fusion.module_class else f"{fusion.module_class} ({fusion.function})"
            lines.append(f"  {fusion.step:<{step_width}} {label:<{width}}  {status}{drift}")
        if not self.fusions:
            lines.append("  nothing to fuse (no RMS norm, residual norm or attention found)")
        lines.append(f"Attention: {self.attention or 'not fused'}"
                     + (f"; inputs added to function signatures: {', '.join(self.added_inputs)}" if self.added_inputs else ""))
        if self.packed_qkv:
            lines.append(f"Query, key and value projections packed (one weight, one GEMM): {', '.join(self.packed_qkv)}")
        lines.append(f"Nodes per run (calls expanded): {self.nodes_before:,} -> {self.nodes_after:,}")
        if self.quantization is not None:
            lines.append(self.quantization.text())
        return "\n".join(lines)
