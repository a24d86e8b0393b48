"""The call tree of a flat ONNX file that carries no names: repeated blocks found by structure.

``modularize`` reads module scopes where the file records them (``files/modularize/tool.py``). A file
converted from another framework, passed through a simplifier or renamed by a graph tool has
none; this module infers a call tree from the graph itself, in near-linear time:

1. **Skeleton.** The main-graph nodes that depend on a graph input, in the file's (topological)
   order. The others (``Constant``s, weight transposes: what depends on initializers only) follow
   their consumers later.
2. **Signatures.** Each skeleton node gets an integer for its op, domain, attributes, output
   types and shapes, and what it reads: an activation of a type and shape, a weight of a dtype and
   shape (its name is ignored), an integer constant's values.
3. **Repeats.** Candidate periods are the distances between consecutive nodes of equal signature
   (the most frequent ones); for each, one vectorized pass finds the runs where ``sig[i] ==
   sig[i + L]``: a run of length ``r`` holds ``(r + L) // L`` copies of an ``L``-node block. The
   run covering most nodes wins (the shorter period on ties), then the segments before and after
   it are searched again (an encoder's stack, then a decoder's).
4. **Boundaries.** A repeat can be cut at any phase; the cut kept has the most whole copies, then
   the fewest values live across it (values made before the cut and read after it): a transformer
   layer is cut where only the residual stream (and what every layer reads, the mask, the rotary
   tables) crosses, from the residual input to the residual output.
5. **Order.** Steps 1-4 run on the file's order and on a canonical depth-first walk from the
   outputs (a graph tool's re-sort interleaves the layers' nodes); the one covering more wins.
6. **Parts.** Inside a block, the offsets where no more values are live than at the block's
   start (in every copy) split it into parts: the attention and the MLP of a layer, each from the
   residual input to the residual add. A part with a ``Softmax`` is ``Attention``, one with two
   matrix products or more ``MLP``, else ``Part``.

Calls are named by position (``block.0``, ``block.0.attention``; ``stem`` before the repeats,
``head`` after them, ``bridge.<n>`` between two stacks), their classes by shape (``Block``,
``Block.Attention``, ``Stem``); every call is marked with :data:`~onnx_modular.format.metadata.INFERRED`.
Outlining, dedupe and naming are then the export's own passes (``passes/pipeline``), as for a file
with scopes: a body is shared only where the blocks' computations are identical.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from onnx_modular.calls import node_placement as inferred_order
from onnx_modular.format import metadata, records
from onnx_modular.format.calltree import CallTree, ModuleCall

__all__ = [
    "Inference", "Region", "infer_calls", "unscoped_runs", "merged", "mark_inferred", "MIN_BLOCK_NODES",
    "INFERRED_PACKAGE", "INFERRED_VALUE",
]

#: A repeated block has at least this many skeleton nodes (shorter repeats are an op's pattern,
#: not a module: ``Gather, Add`` twice in an embedding).
MIN_BLOCK_NODES = 4
#: Candidate periods tried per segment (the most frequent distances between equal signatures).
_PERIODS = 24
#: Segments searched for repeats in all (stacks of one file), and nesting of searches.
_MAX_REGIONS = 16
#: Cuts of a repeat (the best first) tried for a first copy with a few nodes more.
_EXTEND_TRIES = 8
#: The package of the inferred classes: their functions' domain is ``pkg.inferred``.
INFERRED_PACKAGE = "inferred"
#: The value of :data:`~onnx_modular.format.metadata.INFERRED` on inferred functions and call nodes.
INFERRED_VALUE = "structure"
#: Ops whose count names a part of a block.
_MATMULS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "MatMulNBits", "FusedMatMul"})


@dataclasses.dataclass
class Region:
    """``count`` consecutive copies of a block of ``length`` skeleton nodes: the regular ones from
    ``uniform``, and before them (``first``) a copy that holds a few nodes more (``extras``:
    what a layer computes once for all, a mask, kept out of the block), or none."""

    name: str
    uniform: int
    length: int
    count: int
    parts: list[tuple[int, int, str]] = dataclasses.field(default_factory=list)  # (offset, end, name)
    first: list[int] | None = None
    extras: list[int] = dataclasses.field(default_factory=list)

    @property
    def start(self) -> int:
        return min(self.first[0], *self.extras) if self.first is not None else self.uniform

    @property
    def end(self) -> int:
        return self.uniform + self.length * (self.count - (self.first is not None))

    def positions(self, copy: int) -> Sequence[int]:
        """Skeleton positions of the copy's nodes, in block order."""
        if self.first is not None:
            if copy == 0:
                return self.first
            copy -= 1
        return range(self.uniform + copy * self.length, self.uniform + (copy + 1) * self.length)


@dataclasses.dataclass
class Inference:
    """What :func:`infer_calls` found.

    Attributes:
        tree: The inferred call tree (root: the file's graph).
        keys: Each node's call keys, outermost first (nodes of the root absent).
        regions: The repeats found, in file order.
        skeleton: Nodes that depend on a graph input (the ones searched).
    """

    tree: CallTree
    keys: dict[ir.Node, tuple[str, ...]] = dataclasses.field(metadata=records.NOT_RECORDED)
    regions: list[Region] = dataclasses.field(default_factory=list)
    skeleton: int = 0

    @property
    def covered(self) -> int:
        """Skeleton nodes inside repeated blocks."""
        return sum(region.length * region.count for region in self.regions)


# -- signatures ----------------------------------------------------------------------------------


def _skeleton(nodes: Sequence[ir.Node], graph_inputs: Sequence[ir.Value]) -> list[ir.Node]:
    """The nodes that depend on a graph input, in order."""
    dependent: set[ir.Value] = set(graph_inputs)
    skeleton = []
    for node in nodes:
        if any(value in dependent for value in inferred_order.reads(node)):
            skeleton.append(node)
            dependent.update(node.outputs)
    return skeleton


def _type_key(value: ir.Value | None) -> tuple:
    if value is None:
        return ("none",)
    # Symbolic dims by position only: torch names each layer's cache length apart (s54, s60, ...).
    shape = None if value.shape is None else tuple(d if isinstance(d, int) else None for d in value.shape.dims)
    return (type(value.type).__name__, value.dtype, shape)


def _constant_key(value: ir.Value) -> tuple:
    """A weight by dtype and shape; an integer constant (a shape, an axis) by its values too."""
    tensor = value.const_value
    if tensor is None and value.producer() is not None and value.producer().op_type == "Constant":
        attr = value.producer().attributes.get("value")
        tensor = attr.value if attr is not None and attr.type == ir.AttributeType.TENSOR else None
    key: tuple = ("W", *_type_key(value))
    if tensor is not None and tensor.dtype is not None and not tensor.dtype.is_floating_point():
        size = int(np.prod(tensor.shape.numpy())) if tensor.shape is not None else 0
        if size <= 64:
            key += (tensor.numpy().tobytes(),)
    return key


def _attribute_key(attr: ir.Attr) -> object:
    if attr.type == ir.AttributeType.TENSOR:
        tensor = attr.value
        data = tensor.numpy().tobytes() if tensor.size <= 64 else tensor.size
        return ("T", str(tensor.dtype), tuple(tensor.shape), data)
    if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
        graphs = [attr.value] if attr.type == ir.AttributeType.GRAPH else list(attr.value)
        return ("G", tuple(tuple(n.op_type for n in g) for g in graphs))
    if attr.type == ir.AttributeType.TENSORS:
        return ("TS", len(attr.value))
    value = attr.value
    return tuple(value) if isinstance(value, list) else value


def _signatures(skeleton: Sequence[ir.Node], members: set[ir.Node]) -> np.ndarray:
    """One integer per node: equal for nodes of equal op, attributes, types and weight shapes
    (``members``: the nodes whose outputs are activations)."""
    ids: dict[tuple, int] = {}
    out = np.empty(len(skeleton), dtype=np.int64)
    for i, node in enumerate(skeleton):
        reads = []
        for value in node.inputs:
            if value is None:
                reads.append(None)
            elif value.producer() in members or (value.producer() is None and not value.is_initializer()):
                reads.append(("A", *_type_key(value)))
            else:
                reads.append(_constant_key(value))
        key = (
            node.domain,
            node.op_type,
            node.overload,
            tuple(sorted((name, _attribute_key(attr)) for name, attr in node.attributes.items())),
            tuple(reads),
            tuple(_type_key(value) for value in node.outputs),
        )
        out[i] = ids.setdefault(key, len(ids))
    return out


def _live(skeleton: Sequence[ir.Node], graph_outputs: Sequence[ir.Value]) -> np.ndarray:
    """``live[p]``: values made by skeleton nodes before position ``p`` and read at or after it."""
    position = {node: i for i, node in enumerate(skeleton)}
    last: dict[ir.Value, int] = {}
    for i, node in enumerate(skeleton):
        for value in inferred_order.reads(node):
            last[value] = i
    for value in graph_outputs:
        last[value] = len(skeleton)
    diff = np.zeros(len(skeleton) + 2, dtype=np.int64)
    for value, end in last.items():
        start = position.get(value.producer()) if value.producer() is not None else None
        if start is None or end <= start:
            continue
        diff[start + 1] += 1
        diff[end + 1] -= 1
    return np.cumsum(diff)[: len(skeleton) + 1]


# -- repeats -------------------------------------------------------------------------------------


def _periods(sig: np.ndarray, min_length: int) -> list[int]:
    """The most frequent distances between nearby nodes of equal signature (the 1st to 4th next
    one: a block whose every op occurs twice has no single-step distance of its length)."""
    order = np.lexsort((np.arange(len(sig)), sig))
    ordered = sig[order]
    counts: Counter = Counter()
    for lag in range(1, 5):
        same = ordered[lag:] == ordered[:-lag]
        gaps = (order[lag:] - order[:-lag])[same]
        counts.update(gaps[(gaps >= min_length) & (gaps <= len(sig) // 2)].tolist())
    if not counts:
        return []
    by_count = [gap for gap, _ in counts.most_common(_PERIODS)]
    by_cover = sorted(counts, key=lambda gap: (-counts[gap] * gap, gap))[: _PERIODS // 2]
    return sorted(set(by_count) | set(by_cover))


def _tiny(block: np.ndarray, min_length: int) -> bool:
    """Whether ``block`` repeats a run of fewer than ``min_length`` nodes (``Relu`` after ``Relu``)."""
    return any(len(block) % p == 0 and bool((block[p:] == block[:-p]).all()) for p in range(1, min_length))


def _best_repeat(sig: np.ndarray, min_length: int) -> tuple[int, int, int] | None:
    """(start, end, period) of the run of consecutive equal blocks covering most nodes."""
    best: tuple[int, int, int, int] | None = None  # (covered, -period, start, end)
    for period in _periods(sig, min_length):
        equal = np.concatenate(([False], sig[:-period] == sig[period:], [False]))
        edges = np.flatnonzero(equal[1:] != equal[:-1])
        starts, ends = edges[0::2], edges[1::2]  # runs of matches [start, end)
        if not len(starts):
            continue
        copies = (ends - starts + period) // period
        covered = np.where(copies >= 2, copies * period, 0)
        for i in np.argsort(-covered, kind="stable")[:3]:  # the best run not made of a tiny repeat
            candidate = (int(covered[i]), -period, int(starts[i]), int(ends[i]) + period)
            if candidate[0] == 0 or (best is not None and candidate[:2] <= best[:2]):
                break
            if not _tiny(sig[starts[i] : starts[i] + period], min_length):
                best = candidate
                break
    if best is None:
        return None
    return best[2], best[3], -best[1]


def _forks(skeleton: Sequence[ir.Node]) -> np.ndarray:
    """``forks[p]``: reads of the values made by the node before position ``p`` (a residual
    stream is read twice at a block's input: by the block's first op and by its residual add)."""
    forks = np.zeros(len(skeleton) + 1, dtype=np.int64)
    for i, node in enumerate(skeleton):
        forks[i + 1] = sum(len(value.uses()) + value.is_graph_output() for value in node.outputs)
    return forks


def _phase(start: int, end: int, period: int, live: np.ndarray, forks: np.ndarray) -> tuple[list[int], int]:
    """(first block's start for the best cuts, best first, copies): most whole copies in [start,
    end), then fewest live values at the cuts, then the cuts where the stream forks most."""
    scores: list[tuple[int, int, int, int]] = []
    for phase in range(min(period, end - start)):
        copies = (end - start - phase) // period
        if copies >= 2:
            cuts = start + phase + period * np.arange(copies + 1)
            scores.append((-copies, int(live[cuts].sum()), -int(forks[cuts].sum()), phase))
    if not scores:
        return [], 0
    scores.sort()
    return [start + score[3] for score in scores if score[0] == scores[0][0]], -scores[0][0]


def _extend_back(sig: np.ndarray, lo: int, first: int, period: int) -> tuple[list[int], list[int]] | None:
    """The copy before ``first`` where it holds a few nodes more (positions of the block's nodes,
    and of the others), or ``None``: the block's signatures, matched backwards as a subsequence."""
    block = sig[first : first + period]
    extras: list[int] = []
    matched: list[int] = []
    i, p = period - 1, first - 1
    while i >= 0 and p >= lo:
        if sig[p] == block[i]:
            matched.append(p)
            i -= 1
        else:
            extras.append(p)
            if len(extras) > max(2, period // 4):
                return None
        p -= 1
    return (matched[::-1], extras[::-1]) if i < 0 and extras else None


def _find_regions(sig: np.ndarray, live: np.ndarray, forks: np.ndarray, min_length: int) -> list[Region]:
    """The repeats, in order: the best one, then again on each side."""
    found: list[Region] = []
    segments = [(0, len(sig))]
    while segments and len(found) < _MAX_REGIONS:
        lo, hi = segments.pop()
        if hi - lo < 2 * min_length:
            continue
        repeat = _best_repeat(sig[lo:hi], min_length)
        if repeat is None:
            continue
        firsts, copies = _phase(lo + repeat[0], lo + repeat[1], repeat[2], live, forks)
        if copies < 2:
            continue
        # A cut where the copy before is the block with a few nodes more (the first layer, which
        # makes the mask for all) holds one copy more: the cut at the layer's start, not the MLP's.
        region = Region("", firsts[0], repeat[2], copies)
        for first in firsts[:_EXTEND_TRIES]:
            extended = _extend_back(sig, lo, first, region.length)
            if extended is not None:
                region.uniform, (region.first, region.extras) = first, extended
                region.count += 1
                break
        found.append(region)
        segments += [(lo, region.start), (region.end, hi)]
    found.sort(key=lambda region: region.start)
    for index, region in enumerate(found):
        region.name = "block" if index == 0 else f"block{index + 1}"
    return found


def _parts(skeleton: Sequence[ir.Node], live: np.ndarray, forks: np.ndarray, region: Region) -> list[tuple[int, int, str]]:
    """Offsets in the block where, in every copy, no more values are live than at its start and
    the stream forks (a residual input read twice)."""
    regular = region.count - (region.first is not None)
    starts = region.uniform + region.length * np.arange(regular)
    offsets = np.arange(1, region.length)
    inside = live[starts[:, None] + offsets[None, :]]  # copies x offsets
    forked = (forks[starts[:, None] + offsets[None, :]] >= 2).all(axis=0)
    cuts = offsets[(inside <= live[starts][:, None]).all(axis=0) & forked].tolist()
    bounds = [0, *cuts, region.length]
    spans = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    if len(spans) < 2:
        return []
    named: list[tuple[int, int, str]] = []
    seen: Counter = Counter()
    for a, b in spans:
        ops = Counter(node.op_type for node in skeleton[region.uniform + a : region.uniform + b])
        kind = "attention" if ops["Softmax"] else "mlp" if sum(ops[o] for o in _MATMULS) >= 2 else "part"
        seen[kind] += 1
        named.append((a, b, kind if seen[kind] == 1 else f"{kind}_{seen[kind] - 1}"))
    return named


# -- the tree ------------------------------------------------------------------------------------


def _class(name: str) -> str:
    return ".".join(part[:1].upper() + part[1:] if part != "mlp" else "MLP" for part in name.split("."))


def _call(path: str, qualified_class: str, parent: ModuleCall) -> ModuleCall:
    call = ModuleCall(path, path, 0, qualified_class, INFERRED_PACKAGE, metadata.UNKNOWN_PACKAGE, parent=parent)
    parent.children.append(call)
    return call


def _skeleton_keys(
    skeleton: Sequence[ir.Node], regions: list[Region], root: ModuleCall, gaps: bool = True
) -> dict[ir.Node, tuple[str, ...]]:
    """Calls for the repeats and (``gaps``) the stretches around them; each skeleton node's keys."""
    keys: dict[ir.Node, tuple[str, ...]] = {}
    bridges = 0

    def gap(lo: int, hi: int, name: str) -> None:
        if gaps and hi > lo:
            call = _call(name, _class(name.split(".")[0]), root)
            for node in skeleton[lo:hi]:
                keys[node] = (call.key,)

    position = 0
    for index, region in enumerate(regions):
        if region.start > position:
            gap(position, region.start, "stem" if index == 0 else f"bridge.{bridges}")
            bridges += index > 0
        cls = _class(region.name)
        for copy in range(region.count):
            block = _call(f"{region.name}.{copy}", cls, root)
            positions = region.positions(copy)
            for i in positions:
                keys[skeleton[i]] = (block.key,)
            for a, b, part in region.parts:
                call = _call(f"{block.key}.{part}", f"{cls}.{_class(part.split('_')[0])}", block)
                for i in positions[a:b]:
                    keys[skeleton[i]] = (block.key, call.key)
        position = region.end
    gap(position, len(skeleton), "head")
    return keys


def _search(
    skeleton: list[ir.Node], members: set[ir.Node], outputs: Sequence[ir.Value], min_block: int
) -> tuple[list[Region], np.ndarray, np.ndarray]:
    """The repeats of ``skeleton``, and its live values and forks at each position."""
    sig = _signatures(skeleton, members)
    live = _live(skeleton, outputs)
    forks = _forks(skeleton)
    return _find_regions(sig, live, forks, min_block), live, forks


def infer_calls(
    model: ir.Model, *, subset: Sequence[ir.Node] | None = None, min_block: int = MIN_BLOCK_NODES
) -> Inference:
    """Infer module calls of ``model``'s main graph from its structure.

    The whole graph: its nodes are then put in an order (still topological) where each inferred
    call's nodes are contiguous. ``subset`` (nodes of the main graph, in order): only those are
    searched and placed in calls (a file whose other nodes carry scopes), the order is left as
    it is. ``regions`` is empty when no block repeats.
    """
    graph = model.graph
    nodes = list(graph)
    skeleton = _skeleton(nodes, [value for value in graph.inputs if not value.is_initializer()])
    members = set(skeleton)
    if subset is not None:
        wanted = set(subset)
        skeleton = [node for node in skeleton if node in wanted]
        nodes = [node for node in nodes if node in wanted]
    root = ModuleCall("", "", 0, "", INFERRED_PACKAGE, metadata.UNKNOWN_PACKAGE)
    if len(skeleton) < 2 * min_block:
        return Inference(CallTree(root), {}, [], len(skeleton))
    regions, live, forks = _search(skeleton, members, graph.outputs, min_block)
    canonical = inferred_order.canonical(skeleton, graph.outputs)
    if canonical != skeleton:  # the file's order, or the canonical walk where it finds more
        again = _search(canonical, members, graph.outputs, min_block)
        if sum(r.length * r.count for r in again[0]) > sum(r.length * r.count for r in regions):
            skeleton, (regions, live, forks) = canonical, again
    if not regions:
        return Inference(CallTree(root), {}, [], len(skeleton))
    for region in regions:
        region.parts = _parts(skeleton, live, forks, region)
    keys = _skeleton_keys(skeleton, regions, root, gaps=subset is None)
    # The extras of a first copy (a mask made once, in the first layer) follow their readers, as constants.
    extras = {skeleton[i] for region in regions for i in region.extras}
    placed = [node for node in skeleton if node not in extras]
    readers = inferred_order.readers_of(nodes, set(placed))
    inferred_order.constant_keys(graph, nodes, keys, set(placed), readers)
    if subset is None:
        order = inferred_order.contiguous_order(graph, nodes, placed, keys, readers)
        if order != nodes:
            graph.remove(nodes, safe=False)
            graph.extend(order)
    return Inference(CallTree(root), keys, regions, len(skeleton))


# -- modularize's use ----------------------------------------------------------------------------

#: Unscoped nodes of a file with scopes are searched for repeats where this many follow each other.
MIXED_RUN = 4 * MIN_BLOCK_NODES


def unscoped_runs(model: ir.Model, scopes: Mapping[ir.Node, object]) -> list[ir.Node]:
    """The main-graph nodes without scopes (``scopes[node] is None``) in runs of :data:`MIXED_RUN`
    or more: where a file that records scopes elsewhere left a stretch unrecorded."""
    runs: list[ir.Node] = []
    run: list[ir.Node] = []
    for node in model.graph:
        if scopes.get(node) is None:
            run.append(node)
            continue
        runs += run if len(run) >= MIXED_RUN else []
        run = []
    return runs + (run if len(run) >= MIXED_RUN else [])


def merged(
    tree: CallTree, found: CallTree, keys: Mapping[ir.Node, tuple[str, ...]],
    more: Mapping[ir.Node, tuple[str, ...]], model: ir.Model,
) -> CallTree:
    """The recorded tree with the inferred calls added under its root, children in file order."""
    first: dict[str, int] = {}
    for position, node in enumerate(model.graph):
        for key in keys.get(node, ()) or more.get(node, ()):
            first.setdefault(key, position)
    for call in found.root.children:
        call.parent = tree.root
        tree.root.children.append(call)
    tree.root.children.sort(key=lambda call: first.get(call.key, len(first)))
    return CallTree(tree.root)


def mark_inferred(model: ir.Model, inference: Inference) -> None:
    """:data:`~onnx_modular.format.metadata.INFERRED` on the functions and call nodes of inferred calls."""
    keys = {call.key for call in inference.tree.walk() if not call.is_root}
    marked = set()
    for function in model.functions.values():
        if any(call.key in keys for call in function.meta.get(metadata.CALLS, ())):
            function.metadata_props[metadata.INFERRED] = INFERRED_VALUE
            marked.add(function.identifier())
    bodies = [model.graph, *(function.graph for function in model.functions.values())]
    for body in bodies:
        for node in body:
            if node.op_identifier() in marked:
                node.metadata_props[metadata.INFERRED] = INFERRED_VALUE
