"""onnxruntime's one contrib op in the ONNX domain, made known to onnx's checker.

onnxruntime registers ``SimplifiedLayerNormalization`` (RMS norm) in the default domain ``""``
(since version 1), not in ``com.microsoft``; onnx has no such op, so ``onnx.checker`` refuses every
file that uses it ("No Op registered for SimplifiedLayerNormalization"), such as the files of
``onnx-modular optimize`` and of onnxruntime-genai's builder. :func:`register` gives onnx the same
signature onnxruntime declares (``contrib_defs.cc``), once per process, so that those files pass
the checks every writer runs. Ops of ``com.microsoft`` need nothing: the checker skips unknown domains.
"""

from __future__ import annotations

import onnx
import onnx.defs

__all__ = ["register"]

_FLOATS = ["tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"]


def register() -> None:
    """Register ``SimplifiedLayerNormalization`` (domain ``""``, version 1) unless onnx knows it."""
    if onnx.defs.has("SimplifiedLayerNormalization", ""):
        return
    param = onnx.defs.OpSchema.FormalParameter
    option = onnx.defs.OpSchema.FormalParameterOption
    attribute = onnx.defs.OpSchema.Attribute
    kind = onnx.defs.OpSchema.AttrType
    schema = onnx.defs.OpSchema(
        "SimplifiedLayerNormalization", "", 1,
        "onnxruntime's RMS normalization (registered by onnxruntime in the ONNX domain).",
        inputs=[param("X", "T"), param("scale", "V")],
        outputs=[param("Y", "V"), param("inv_std_var", "U", param_option=option.Optional)],
        type_constraints=[("T", _FLOATS, "input"), ("U", ["tensor(float)", "tensor(double)"], "stash"),
                          ("V", _FLOATS, "scale and output")],
        attributes=[attribute("axis", kind.INT, "normalized axes, from this one"),
                    attribute("epsilon", kind.FLOAT, "added to the mean square"),
                    attribute("stash_type", kind.INT, "precision of the computation")],
    )
    onnx.defs.register_schema(schema)
