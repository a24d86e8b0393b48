"""FX passes run between torch's decomposition and its type promotion (torch imported here).

``relax_view_strides``: turn stride-checked ``aten.view`` into ``aten.reshape`` before type promotion.

Root cause (found on T5 with SDPA attention, and on windowed-attention vision models):
torch's ONNX decomposition re-traces the program while keeping
``aten.scaled_dot_product_attention`` as one op. During that re-trace the op's fake
kernel reports the flash-attention output layout, ``(B, H, S, D)`` with strides that
make ``.transpose(1, 2)`` contiguous. The re-trace therefore drops the model's
``.contiguous()`` and records ``reshape`` as the cheaper ``view``. The type-promotion
interpreter that runs next evaluates the same op through its math decomposition,
which returns a *contiguous* layout; the recorded ``view`` is now impossible and
fake-tensor propagation raises ``Cannot view a tensor with shape ... as ...``.

The recorded program is still correct as a value computation: strides only decide
whether a reshape can be a view. ONNX has no strides (``view`` and ``reshape``
both become ``Reshape``), so rewriting every ``view`` as ``reshape`` is exact for
export and removes the whole class of failure, for any op whose fake kernels
disagree about layouts.
"""

from __future__ import annotations

import torch

__all__ = ["relax_view_strides"]

_VIEW_OPS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def relax_view_strides(graph_module: torch.fx.GraphModule) -> int:
    """Replace ``aten.view`` / ``aten._unsafe_view`` with ``aten.reshape`` in place.

    Args:
        graph_module: A decomposed graph module; modified in place.

    Returns:
        The number of nodes rewritten.

    Example::

        count = relax_view_strides(program.graph_module)
    """
    count = 0
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target in _VIEW_OPS:
            node.target = torch.ops.aten.reshape.default
            count += 1
    if count:
        graph_module.recompile()
    return count
