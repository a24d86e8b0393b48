"""FX passes run between torch's decomposition and its type promotion (torch imported here).

``relax_view_strides``: turn stride-checked ``aten.view`` into ``aten.reshape`` before type promotion.
``attention_to_4d``: scaled-dot-product attention of other ranks given the 4-D operands torch's
translator requires (see its docstring).

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

import contextlib

import torch

__all__ = ["attention_to_4d", "relax_view_strides"]

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


def attention_to_4d(graph_module: torch.fx.GraphModule) -> int:
    """Give ``aten.scaled_dot_product_attention`` of rank 3 or above 4 the 4-D operands torch's
    translator requires ("only 4D query, key, and value are supported"), in place.

    PyTorch's SDPA takes any number of leading batch dimensions ``(*B, H, L, E)``, and real models
    use them (windowed vision backbones with ``(B, windows, H, L, E)``). The leading dimensions
    are merged into one (``reshape(-1, H, L, E)``; a 3-D ``(B, L, E)`` becomes ``(1, B, L, E)``),
    the mask is broadcast to the scores' shape ``(*B, H, L, S)`` and merged the same way, and the
    output gets its leading dimensions back. Exact: attention is computed independently for every
    leading index.

    Returns:
        The number of attention nodes rewritten.
    """
    from torch._guards import detect_fake_mode

    aten = torch.ops.aten
    graph = graph_module.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.scaled_dot_product_attention.default:
            continue
        q, k, v = node.args[:3]
        values = [x.meta.get("val") if isinstance(x, torch.fx.Node) else None for x in (q, k, v)]
        if any(not isinstance(value, torch.Tensor) for value in values):
            continue
        rank = values[0].dim()
        if rank == 4 or rank < 3 or any(value.dim() != rank for value in values):
            continue
        mode = detect_fake_mode(values)

        def call(target, args, node=node, mode=mode):
            with graph.inserting_before(node):
                new = graph.call_function(target, tuple(args))
            real = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
            real = [[s.meta["val"] if isinstance(s, torch.fx.Node) else s for s in a] if isinstance(a, list) else a for a in real]
            with mode if mode is not None else contextlib.nullcontext():
                new.meta["val"] = target(*real)
            new.meta.update({key: node.meta[key] for key in ("nn_module_stack", "stack_trace", "source_fn_stack") if key in node.meta})
            return new

        def size(x: torch.fx.Node, dim: int):
            value = x.meta["val"].shape[dim]
            return value if isinstance(value, int) else call(aten.sym_size.int, [x, dim])

        def merged(x: torch.fx.Node, rank: int = rank):
            shape = [-1] + [size(x, d) for d in range(rank - 3, rank)] if rank > 4 else [1] + [size(x, d) for d in range(3)]
            return call(aten.reshape.default, [x, shape])

        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        args = [merged(q), merged(k), merged(v)]
        if isinstance(mask, torch.fx.Node):
            scores = [size(q, d) for d in range(rank - 1)] + [size(k, rank - 2)]
            args.append(merged(call(aten.expand.default, [mask, scores])))
        elif len(node.args) > 3:
            args.append(mask)
        args.extend(node.args[4:])
        kwargs = {key: value for key, value in node.kwargs.items() if key != "attn_mask"}  # in args now, or None
        with graph.inserting_before(node):
            attention = graph.call_function(node.target, tuple(args), kwargs)
        attention.meta.update(node.meta)
        with mode if mode is not None else contextlib.nullcontext():
            fake = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
            attention.meta["val"] = node.target(*fake, **{k2: (v2.meta["val"] if isinstance(v2, torch.fx.Node) else v2) for k2, v2 in kwargs.items()})
        output = call(aten.reshape.default, [attention, [size(q, d) for d in range(rank - 1)] + [size(v, rank - 1)]])
        output.meta.update({key: value for key, value in node.meta.items() if key != "val"})
        output.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(output)
        graph.erase_node(node)
        count += 1
    if count:
        graph.lint()
        graph_module.recompile()
    return count
