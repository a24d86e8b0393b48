"""FX passes run between torch's decomposition and its type promotion (torch imported here).

``relax_view_strides``: turn stride-checked ``aten.view`` into ``aten.reshape`` before type promotion.
``attention_to_4d``: scaled-dot-product attention of other ranks given the 4-D operands torch's
translator requires (see its docstring).
``empty_reshapes``: a reshape to a shape with a static 0 (an empty tensor) becomes ``full`` of
that shape, since ONNX ``Reshape`` reads a 0 as "copy this dimension" (see its docstring).
``scalars_to_tensors``: a Python number where an op's schema wants a ``Tensor`` (``1.0 - mask``
decomposes to ``aten.sub.Tensor(1.0, mask)``) becomes a 0-d tensor before type promotion (see its
docstring).
``squeeze_only_ones``: ``squeeze(dim)`` of a dimension whose size is not 1 (a no-op in torch, an
error in ONNX) drops that dimension (see its docstring).

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

__all__ = ["attention_to_4d", "empty_reshapes", "relax_view_strides", "scalars_to_tensors", "squeeze_only_ones"]

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


def _insert_call(graph, before, target, args, kwargs, like, meta) -> torch.fx.Node:
    """Insert ``target(*args, **kwargs)`` before the node ``before``, with ``meta`` and its fake
    value (``meta["val"]``) computed in the fake mode of the tensor ``like``."""
    from torch._guards import detect_fake_mode

    with graph.inserting_before(before):
        new = graph.call_function(target, args, kwargs)
    new.meta.update(meta)
    values = torch.fx.node.map_arg(args, lambda arg: arg.meta["val"])
    mode = detect_fake_mode([like])
    with mode if mode is not None else contextlib.nullcontext():
        new.meta["val"] = target(*values, **kwargs)
    return new


def empty_reshapes(graph_module: torch.fx.GraphModule) -> int:
    """Replace a reshape whose result has a static size 0 by ``aten.full`` of that shape, in place.

    torch's translation writes ``aten.reshape(x, [2, 1, 8, 0])`` as ONNX ``Reshape`` without
    ``allowzero``, where a 0 means "copy the input's dimension at this position": onnxruntime
    refuses the file ("Invalid position of 0") or, when that dimension exists, makes a tensor of
    the wrong shape. Found on a GLM-5 decoder whose rotary part has size 0
    (``k_rot.view(batch, 1, seq, qk_rope_head_dim)``). A tensor with no elements has no values, so
    ``full(shape, 0)`` of the same shape, dtype and device is exactly the reshape's result; the
    other sizes stay as they were (symbolic ones included).

    Runs after :func:`relax_view_strides` (every view is a reshape by then).

    Returns:
        The number of nodes rewritten.
    """
    graph = graph_module.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.reshape.default:
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or not any(type(size) is int and size == 0 for size in value.shape):
            continue
        shape = [size if type(size) is int else node.args[1][d] for d, size in enumerate(value.shape)]
        if any(not isinstance(size, (int, torch.fx.Node)) or (isinstance(size, int) and size < 0) for size in shape):
            continue  # a symbolic size with no node of its own: leave the reshape
        kwargs = {"dtype": value.dtype, "device": value.device}
        full = _insert_call(graph, node, torch.ops.aten.full.default, (shape, 0), kwargs, like=value, meta=node.meta)
        node.replace_all_uses_with(full)
        graph.erase_node(node)
        count += 1
    if count:
        graph.lint()
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


def scalars_to_tensors(graph_module: torch.fx.GraphModule) -> int:
    """Give a Python number passed where an ATen op's schema declares ``self: Tensor`` its own 0-d
    tensor, in place.

    torch's decomposition of ``aten.rsub.Scalar`` (``1.0 - attention_mask``, XLNet, ProphetNet)
    writes ``aten.sub.Tensor(1.0, mask)``: the number first. When the tensor is an integer or
    bool mask, the type-promotion pass that runs next casts it to float and re-runs the node
    against ``aten.sub``'s overloads, none of which takes a number first ("Cannot find a compatible
    OpOverload for aten.sub"). ``torch.onnx.export`` fails there too.

    The number becomes ``aten.scalar_tensor(number, dtype=torch.result_type(other, number))``,
    ``other`` being the op's first tensor operand, only where a tensor operand is promoted
    (elsewhere torch translates the number as it is, and the graph stays as it was). Exact: a 0-d
    tensor of that dtype promotes with ``other`` to the same dtype the number did (its category is
    at least ``other``'s, and a 0-d operand of a higher category decides the result dtype), and
    the value is the same.

    Returns:
        The number of operands rewritten.
    """
    graph = graph_module.graph
    count = 0
    for node in list(graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not node.args:
            continue
        first = node.args[0]
        schema = target._schema.arguments
        if not isinstance(first, (bool, int, float)) or not schema or str(schema[0].type) != "Tensor":
            continue
        others = [arg.meta.get("val") for arg in node.args[1:] if isinstance(arg, torch.fx.Node)]
        other = next((value for value in others if isinstance(value, torch.Tensor)), None)
        if other is None:
            continue
        dtype = torch.result_type(other, first)
        if all(value.dtype == dtype for value in others if isinstance(value, torch.Tensor)):
            continue  # no promotion, nothing re-run: torch translates the number as it is
        kept = {key: node.meta[key] for key in ("nn_module_stack", "stack_trace", "source_fn_stack") if key in node.meta}
        kwargs = {"dtype": dtype, "device": other.device}
        scalar = _insert_call(graph, node, torch.ops.aten.scalar_tensor.default, (first,), kwargs, like=other, meta=kept)
        node.args = (scalar, *node.args[1:])
        count += 1
    if count:
        graph.lint()
        graph_module.recompile()
    return count


def squeeze_only_ones(graph_module: torch.fx.GraphModule) -> int:
    """Keep only the dimensions of size 1 in ``aten.squeeze.dim(s)``, in place.

    torch's ``squeeze(dim)`` leaves a dimension whose size is not 1 as it is; ONNX ``Squeeze``
    rejects it ("Dimension of input 2 must be 1 instead of 4": onnxruntime refuses the file).
    torch's translation writes every listed dimension. Found on the RNNT heads of Parakeet and
    Nemotron ASR (``joint.squeeze(2)`` over 4 symbols). A dimension whose size is statically not 1
    is dropped from the list; a squeeze left with none is a copy of its input (the same shape, dtype
    and values; the node keeps its name). Symbolic sizes are left as they are. ``prims.view_of``, which the same squeeze
    decomposes to in other graphs and which torch's translation has no function for, is its input.

    Returns:
        The number of nodes rewritten.
    """
    graph = graph_module.graph
    count = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.prims.view_of.default:
            # what a squeeze of no size-1 dimension decomposes to, elsewhere: the same tensor (a
            # clone, which translates to Identity; the node and its name stay, as later steps name it)
            node.target = torch.ops.aten.clone.default
            count += 1
            continue
        if node.op != "call_function" or node.target not in (torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims):
            continue
        source = node.args[0]
        value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or len(node.args) < 2:
            continue
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        rank = max(value.dim(), 1)
        if not all(isinstance(d, int) for d in dims):
            continue
        kept = [d for d in dims if value.dim() == 0 or type(value.shape[d % rank]) is not int or value.shape[d % rank] == 1]
        if len(kept) == len(dims):
            continue
        if kept:
            node.target = torch.ops.aten.squeeze.dims
            node.args = (source, kept)
        else:
            node.target = torch.ops.aten.clone.default
            node.args = (source,)
        count += 1
    if count:
        graph.lint()
        graph_module.recompile()
    return count
