"""Random ``nn.Module`` trees for property-based tests (issue 7).

Hypothesis draws a :class:`ModelSpec` (plain frozen dataclasses, so a failing example
prints as a readable spec); :func:`build` turns it into modules deterministically,
with weights, buffers and inputs from a seeded ``torch.Generator``.

What a generated model can contain:

* nesting depth 1-4: blocks (:class:`FuzzBlock`, :class:`FuzzCell`, :class:`FuzzUnit`,
  one generic interpreter under three class names) with ``nn.Linear`` leaves;
* reuse: the same child called several times, and the same instance referenced from
  two parents (``ChildSpec(kind="ref")``: any module finished earlier in post-order,
  so never an ancestor: no recursion);
* parameter sharing: an ``nn.Linear`` whose ``weight`` is another Linear's Parameter;
* multiple outputs: a block returns 1-3 values (tuple, list or dict); the caller keeps
  a permutation or a subset (``CallSpec.pick``), possibly none (a dead call);
* pass-through and swapped outputs: a block may return its inputs, in any order;
* dead submodules: children that are never called, calls whose result is unused;
* keyword-only forward parameters (``gate``) at every level, the root included, and
  ``y`` passed by keyword;
* buffers (persistent or not) used in ``forward``;
* ops: add, mul, tanh, relu, matmul (with a parameter and between activations),
  sum/mean over a dim with ``keepdim``, reshape (+transpose), concat + split,
  split + concat (a feature roll), scalar constants, an ``arange`` constant, sizes
  read from the input shape (symbolic with a dynamic batch);
* optionally a dynamic batch dimension (``torch.export.Dim``).

Every activation has the shape ``(batch, width)``: each op maps such tensors back to
that shape, so any op can feed any other and the spec only has to pick indices.
Value indices in a spec count back from the most recent value (0 = the latest) and
are resolved modulo the number of values when the model is built: every drawn spec
is valid, and shrinking towards 0 gives a live chain rather than dead code.

Example::

    from hypothesis import given
    import fuzz_models

    @given(fuzz_models.model_specs())
    def test_something(spec):
        model, args, kwargs, dynamic_shapes = fuzz_models.build(spec)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from hypothesis import strategies as st

__all__ = [
    "OpSpec",
    "CallSpec",
    "ChildSpec",
    "BlockSpec",
    "ModelSpec",
    "FuzzBlock",
    "FuzzCell",
    "FuzzUnit",
    "model_specs",
    "build",
    "inputs_for",
    "UNARY_OPS",
    "BINARY_OPS",
]

UNARY_OPS = ("tanh", "relu", "sum", "mean", "reshape", "roll", "matmul_param", "buffer", "scale", "const", "size")
BINARY_OPS = ("add", "mul", "cat_split")
TERNARY_OPS = ("matmul",)
OPS = UNARY_OPS + BINARY_OPS + TERNARY_OPS

#: Upper bound on module calls executed under one block (reused blocks count each time).
CALL_BUDGET = 40


# -- the spec ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One tensor op. ``operands`` index the block's values so far, counting back from
    the latest (0); ``amount`` picks a variant."""

    kind: str
    operands: tuple[int, ...]
    amount: int = 0


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """A call of child ``child`` (index into the block's children).

    ``operands`` fill the child's positional inputs (``y`` passed as ``y=...`` when
    ``y_by_keyword``), ``gate`` its keyword-only input (when it has one), ``pick`` says
    which of its outputs the caller keeps, in which order (``()``: the call is dead).
    """

    child: int
    operands: tuple[int, ...]
    gate: int = 0
    pick: tuple[int, ...] = (0,)
    y_by_keyword: bool = False


@dataclasses.dataclass(frozen=True)
class ChildSpec:
    """A submodule: a new block, a new ``nn.Linear``, a Linear sharing the weight of an
    earlier Linear (``shared_weight``), or a reference to an earlier module (``ref``)."""

    kind: str  # "block" | "linear" | "linear_no_bias" | "shared_weight" | "ref"
    block: BlockSpec | None = None
    ref: int = 0


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """A module: ``forward(self, x[, y], *[, gate])`` running ``program`` on its values.

    The values start as the inputs ``[x, y, gate]`` (those present); each op appends
    its result(s), each call the outputs it picks. ``outputs`` indexes the final values:
    the inputs themselves give pass-through (and swapped) outputs. Several outputs are
    returned as a ``tuple``, a ``list`` or a ``dict`` (``container``).
    """

    cls: int
    n_inputs: int
    gate: bool
    children: tuple[ChildSpec, ...]
    program: tuple[OpSpec | CallSpec, ...]
    outputs: tuple[int, ...]
    persistent_buffer: bool = True
    container: str = "tuple"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A whole model: the root block, tensor sizes, a dynamic batch dim or not, a seed."""

    root: BlockSpec
    width: int
    batch: int
    dynamic: bool
    seed: int


# -- hypothesis strategies -------------------------------------------------------------

_small = st.integers(min_value=0, max_value=7)
#: A value index, biased to recent values (0 = the latest) so that most code is live.
_index = st.one_of(st.just(0), st.integers(0, 2), _small)


def _operands(n: int):
    return st.tuples(*[_index] * n)


@st.composite
def op_specs(draw) -> OpSpec:
    kind = draw(st.sampled_from(OPS))
    arity = 1 if kind in UNARY_OPS else 2 if kind in BINARY_OPS else 3
    return OpSpec(kind, draw(_operands(arity)), draw(_small))


@st.composite
def call_specs(draw) -> CallSpec:
    pick = draw(
        st.one_of(
            st.just((0,)),
            st.lists(_small, min_size=1, max_size=3).map(tuple),  # subset / permutation
            st.lists(_small, min_size=0, max_size=3).map(tuple),  # possibly () : a dead call
        )
    )
    return CallSpec(draw(_small), draw(_operands(2)), draw(_index), pick, draw(st.booleans()))


@st.composite
def child_specs(draw, depth: int, max_depth: int, first: bool = False) -> ChildSpec:
    kinds = ["linear", "linear_no_bias", "shared_weight", "ref"]
    if depth < max_depth:
        kinds = ["block", "block"] + kinds
    # The first child of a block above the deepest level is a block, so that the drawn
    # depth is the real depth (hypothesis favours small lists: left alone, most trees are flat).
    kind = "block" if first and depth < max_depth else draw(st.sampled_from(kinds))
    if kind == "block":
        return ChildSpec("block", draw(block_specs(depth + 1, max_depth)))
    return ChildSpec(kind, None, draw(_small))


@st.composite
def block_specs(draw, depth: int = 1, max_depth: int = 2, root: bool = False) -> BlockSpec:
    children = []
    if root or depth < max_depth or draw(st.booleans()):
        children.append(draw(child_specs(depth, max_depth, first=True)))
        children += draw(st.lists(child_specs(depth, max_depth), min_size=0, max_size=2))
    statements = st.one_of(op_specs(), call_specs()) if children else op_specs()
    program = list(draw(st.lists(statements, min_size=1, max_size=8)))
    if children and not any(isinstance(s, CallSpec) for s in program):
        # Call the first child at least once (other children may stay uncalled).
        position = len(program) if root else draw(st.integers(0, len(program)))
        program.insert(position, CallSpec(0, (0, 1), 0, (0,)))
    outputs = tuple(draw(st.lists(_index, min_size=1, max_size=3)))
    if root:
        outputs = (0,) + outputs[1:]  # the model returns its latest value: mostly live code
    return BlockSpec(
        cls=draw(st.integers(0, 2)),
        n_inputs=draw(st.integers(1, 2)),
        gate=draw(st.booleans()),
        children=tuple(children),
        program=tuple(program),
        outputs=outputs,
        persistent_buffer=draw(st.booleans()),
        container=draw(st.sampled_from(("tuple", "list", "dict"))),
    )


@st.composite
def model_specs(draw) -> ModelSpec:
    """A random model spec; ``build(spec)`` gives the model and its inputs."""
    max_depth = draw(st.integers(1, 4))
    return ModelSpec(
        root=draw(block_specs(1, max_depth, root=True)),
        width=draw(st.sampled_from((4, 6, 8))),
        batch=draw(st.integers(2, 3)),
        dynamic=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


# -- the modules -------------------------------------------------------------------------


class _Interpreter(nn.Module):
    """Runs a resolved plan: a list of ("op", kind, operands, amount) / ("call", ...) steps.

    The plan only holds integers and strings, so torch.export traces straight through
    the Python loop; ``self.calls`` maps a call step to the child attribute name.
    """

    def __init__(self, n_inputs: int, gate: bool, width: int, container: str = "tuple"):
        super().__init__()
        self.container = container
        self.n_inputs = n_inputs
        self.has_gate = gate
        self.width = width
        self.plan: list[tuple] = []
        self.output_indices: tuple[int, ...] = ()

    @property
    def n_outputs(self) -> int:
        return len(self.output_indices)

    def forward(self, x, y=None, *, gate=None):
        values = [x]
        if self.n_inputs == 2:
            values.append(y)
        if self.has_gate:
            values.append(gate)
        for step in self.plan:
            if step[0] == "op":
                _, kind, operands, amount = step
                values += _apply(self, kind, [values[i] for i in operands], amount)
            else:
                _, name, operands, gate_index, pick, y_by_keyword = step
                child = getattr(self, name)
                call_args = [values[i] for i in operands]
                call_kwargs = {"gate": values[gate_index]} if gate_index is not None else {}
                if y_by_keyword and len(call_args) == 2:
                    call_kwargs["y"] = call_args.pop()
                out = child(*call_args, **call_kwargs)
                if isinstance(out, dict):
                    out = tuple(out[f"out{i}"] for i in range(len(out)))
                elif not isinstance(out, (tuple, list)):
                    out = (out,)
                values += [out[i] for i in pick]
        outputs = [values[i] for i in self.output_indices]
        if len(outputs) == 1:
            return outputs[0]
        if self.container == "dict":
            return {f"out{i}": value for i, value in enumerate(outputs)}
        return outputs if self.container == "list" else tuple(outputs)

    def extra_repr(self) -> str:
        return (
            f"inputs={self.n_inputs}, gate={self.has_gate}, plan={self.plan}, "
            f"outputs={self.output_indices}, container={self.container}"
        )


class FuzzBlock(_Interpreter):
    pass


class FuzzCell(_Interpreter):
    pass


class FuzzUnit(_Interpreter):
    pass


_CLASSES = (FuzzBlock, FuzzCell, FuzzUnit)


#: Ops that move values between positions (reshapes, rolls, matmuls); the rest are pointwise.
_MOVING_OPS = ("reshape", "roll", "cat_split", "matmul_param", "matmul")


def _apply(module: _Interpreter, kind: str, operands: list[torch.Tensor], amount: int) -> list[torch.Tensor]:
    """One op of the plan; every result has the shape of its first operand, (batch, width)."""
    if kind in _MOVING_OPS:
        return _apply_moving(module, kind, operands, amount)
    return _apply_pointwise(module, kind, operands, amount)


def _apply_pointwise(module: _Interpreter, kind: str, operands: list[torch.Tensor], amount: int) -> list[torch.Tensor]:
    """The ops of :func:`_apply` that keep each value where it is (reductions broadcast back)."""
    width = module.width
    a = operands[0]
    if kind == "tanh":
        return [torch.tanh(a)]
    if kind == "relu":
        return [torch.relu(a)]
    if kind == "scale":
        return [a * float(amount % 3 + 2) - 1.0]
    if kind == "add":
        return [a + operands[1]]
    if kind == "mul":
        return [a * operands[1]]
    if kind == "sum":
        return [a - 0.25 * a.sum(dim=amount % 2 - 1, keepdim=True)]
    if kind == "mean":
        return [a * a.mean(dim=amount % 2 - 1, keepdim=True)]
    if kind == "buffer":
        return [a + module.buf]
    if kind == "const":
        return [a + torch.arange(width, dtype=a.dtype) * 0.25]
    if kind == "size":
        return [a * a.shape[0] + a.shape[-1]]
    raise ValueError(f"unknown op {kind!r}")


def _apply_moving(module: _Interpreter, kind: str, operands: list[torch.Tensor], amount: int) -> list[torch.Tensor]:
    """The ops of :func:`_apply` in :data:`_MOVING_OPS`."""
    width = module.width
    a = operands[0]
    if kind == "reshape":
        if amount % 2 == 0:
            return [a.reshape(-1, 2, width // 2).transpose(1, 2).reshape(-1, width)]
        return [a.reshape(-1).reshape(a.shape[0], width) * 0.5]
    if kind == "roll":
        k = 1 + amount % (width - 1)
        head, tail = torch.split(a, [k, width - k], dim=-1)
        return [torch.cat([tail, head], dim=-1)]
    if kind == "cat_split":
        both = torch.cat([a, operands[1]], dim=-1) * 0.5
        first, second = torch.split(both, width, dim=-1)
        return [second, first] if amount % 2 else [first, second]
    if kind == "matmul_param":
        return [torch.matmul(a, module.mat)]
    b, c = operands[1], operands[2]  # matmul
    return [torch.matmul(torch.matmul(a, b.transpose(0, 1)), c) / width]


# -- building ----------------------------------------------------------------------------


@dataclasses.dataclass
class _BuildState:
    width: int
    generator: torch.Generator
    pool: list[nn.Module] = dataclasses.field(default_factory=list)  # finished modules, post-order
    cost: dict[int, int] = dataclasses.field(default_factory=dict)  # id(module) -> calls it executes

    def randn(self, *shape: int, scale: float = 0.5) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator) * scale


def _arity(module: nn.Module) -> tuple[int, bool, int]:
    """(positional inputs, has keyword-only gate, outputs)."""
    if isinstance(module, _Interpreter):
        return module.n_inputs, module.has_gate, module.n_outputs
    return 1, False, 1


def _new_linear(state: _BuildState, bias: bool) -> nn.Linear:
    linear = nn.Linear(state.width, state.width, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(state.randn(state.width, state.width))
        if bias:
            linear.bias.copy_(state.randn(state.width))
    return linear


def _build_child(spec: ChildSpec, state: _BuildState) -> nn.Module:
    if spec.kind == "block":
        return _build_block(spec.block, state)
    if spec.kind == "ref" and state.pool:
        return state.pool[spec.ref % len(state.pool)]
    linears = [m for m in state.pool if isinstance(m, nn.Linear)]
    linear = _new_linear(state, bias=spec.kind != "linear_no_bias")
    if spec.kind == "shared_weight" and linears:
        linear.weight = linears[spec.ref % len(linears)].weight  # one Parameter, two modules
    state.pool.append(linear)
    state.cost[id(linear)] = 1
    return linear


def _back(index: int, n_values: int) -> int:
    """A spec index (0 = the latest value) as a position in the values list."""
    return n_values - 1 - index % n_values


def _build_block(spec: BlockSpec, state: _BuildState) -> _Interpreter:
    children = [_build_child(child, state) for child in spec.children]
    module = _CLASSES[spec.cls % len(_CLASSES)](spec.n_inputs, spec.gate, state.width, spec.container)
    names = []
    for i, child in enumerate(children):
        name = f"c{i}"
        module.add_module(name, child)
        names.append(name)

    n_values = spec.n_inputs + int(spec.gate)
    cost = 1
    for statement in spec.program:
        if isinstance(statement, OpSpec):
            operands = tuple(_back(i, n_values) for i in statement.operands)
            if statement.kind == "matmul_param" and not hasattr(module, "mat"):
                module.mat = nn.Parameter(state.randn(state.width, state.width))
            if statement.kind == "buffer" and not hasattr(module, "buf"):
                module.register_buffer("buf", state.randn(state.width), persistent=spec.persistent_buffer)
            module.plan.append(("op", statement.kind, operands, statement.amount))
            n_values += 2 if statement.kind == "cat_split" else 1
            continue
        index = statement.child % len(children)
        child = children[index]
        child_cost = state.cost[id(child)]
        if cost + child_cost > CALL_BUDGET:
            continue  # keep exports small: skip calls past the budget
        cost += child_cost
        n_inputs, has_gate, n_outputs = _arity(child)
        operands = tuple(_back(statement.operands[j % len(statement.operands)], n_values) for j in range(n_inputs))
        gate_index = _back(statement.gate, n_values) if has_gate else None
        pick = tuple(p % n_outputs for p in statement.pick)
        module.plan.append(("call", names[index], operands, gate_index, pick, statement.y_by_keyword))
        n_values += len(pick)
    module.output_indices = tuple(_back(i, n_values) for i in spec.outputs)
    state.pool.append(module)
    state.cost[id(module)] = cost
    return module


def inputs_for(spec: ModelSpec, model: _Interpreter, batch: int, seed: int) -> tuple[tuple, dict]:
    """Example inputs (args, kwargs) for the root of ``model`` at a given batch size."""
    generator = torch.Generator().manual_seed(seed)
    args = tuple(torch.randn(batch, spec.width, generator=generator) for _ in range(model.n_inputs))
    kwargs = {"gate": torch.randn(batch, spec.width, generator=generator)} if model.has_gate else {}
    return args, kwargs


def build(spec: ModelSpec) -> tuple[_Interpreter, tuple, dict, dict | None]:
    """(model in eval mode, args, kwargs, dynamic_shapes or None) for a spec."""
    state = _BuildState(spec.width, torch.Generator().manual_seed(spec.seed))
    model = _build_block(spec.root, state).eval()
    args, kwargs = inputs_for(spec, model, spec.batch, spec.seed + 1)
    dynamic_shapes = None
    if spec.dynamic:
        batch = torch.export.Dim("batch", min=2, max=64)
        dynamic_shapes = {"x": {0: batch}}
        if model.n_inputs == 2:
            dynamic_shapes["y"] = {0: batch}
        if model.has_gate:
            dynamic_shapes["gate"] = {0: batch}
    return model, args, kwargs, dynamic_shapes
