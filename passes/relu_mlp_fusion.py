"""Rewrites ReLU MLP blocks into ``torch.ops.twell`` calls.

* gated:     ``down(relu(gate(x)) * up(x))`` -> ``twell.gated_relu_mlp(x, Wg, Wu, Wd, bg, bu, bd)``
* non-gated: ``down(relu(up(x)))``            -> ``twell.relu_mlp(x, Wu, Wd, bu, bd)``

Gate and up may also be pieces of one fused projection, ``gate, up = gate_up(x).chunk(2, -1)``
(``fused_projection.py``); the op then takes row slices of the fused weight, views of it.

Blocks are found from their down projection backwards, in one walk over the graph; nothing is
retraced. A block is rewritten only when the rewrite is provably equivalent: its intermediate values
are read by nothing outside it, gate and up read the same input, the weight shapes agree, and no op
between its first and last node can modify what it reads. Every candidate gets a reason, and
near-misses (SiLU/GELU MLPs, ReLU after the product, an op wedged between ReLU and the product) are
reported so users see why nothing was rewritten.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any

import torch
from torch import fx

from .fx_utils import (
    MUL_FUNCTIONS,
    MUL_METHODS,
    RELU,
    activation_name,
    common_module_path,
    first_input,
    format_node_code,
    format_nodes_code,
    format_shape,
    is_call,
    is_clamp_relu,
    is_inplace_call,
    nodes_inside_autodiff_transforms,
    is_relu,
    may_mutate,
    module_stack,
    node_dtype,
    node_shape,
    shapes_equal,
    sizes_equal,
    skip_identity_views,
    stack_entry_path,
    target_name,
)
from .fused_projection import match_projection
from .linear_match import (
    LinearMatch,
    ModuleParameter,
    Operand,
    RowSlice,
    is_absorbed_by_user,
    match_linear,
    operand_dtype,
    operand_name,
    operand_shape,
)
from .report import GATED, LEFT_ALONE, NON_GATED, REWRITTEN, CandidateBlock

# Metadata describing *which call* a node was; wrong for the fused op, so not copied onto it.
_CALL_SPECIFIC_META = ("source_fn_stack", "torch_fn", "original_aten")

aten = torch.ops.aten

_SIGMOID_FUNCTIONS = frozenset({torch.sigmoid, aten.sigmoid.default})
_SIGMOID_METHODS = frozenset({"sigmoid"})

_ROLE_GATE = "the gate projection output"
_ROLE_UP = "the up projection output"
_ROLE_ACTIVATION = "the relu output"
_ROLE_PRODUCT = "the product relu(gate) * up"
_ROLE_DOWN = "the down projection's partial result"


@dataclasses.dataclass
class _Activation:
    node: fx.Node
    name: str
    linear: LinearMatch
    views: tuple[fx.Node, ...]
    """Identity reshapes between the linear and the activation."""
    parts: tuple[fx.Node, ...] = ()
    """Further nodes of a decomposed activation (the sigmoid of ``t * sigmoid(t)``)."""


@dataclasses.dataclass
class _Block:
    """A structural match, checked and then rewritten or left alone."""

    kind: str
    down: LinearMatch
    up: LinearMatch
    activation: _Activation
    gate: LinearMatch | None = None
    private: dict[fx.Node, str] = dataclasses.field(default_factory=dict)
    """Nodes whose values must not be read outside the block -> their role, for reasons."""
    shared: set[fx.Node] = dataclasses.field(default_factory=set)
    """Reshapes of x and transposes of weights: others may read them too."""

    @property
    def output(self) -> fx.Node:
        return self.down.output

    @property
    def x(self) -> fx.Node:
        return self.gate.input if self.gate is not None else self.up.input

    @property
    def linears(self) -> list[LinearMatch]:
        return [m for m in (self.gate, self.up, self.down) if m is not None]

    @property
    def owned(self) -> set[fx.Node]:
        """Nodes only this block computes (its shared reshapes and transposes excluded)."""
        return {*self.private, self.output}

    @property
    def nodes(self) -> set[fx.Node]:
        return self.owned | self.shared


@dataclasses.dataclass
class _NearMiss:
    """Something MLP-shaped that is not a ReLU MLP block (reported, never rewritten)."""

    kind: str
    output: fx.Node
    nodes: set[fx.Node]
    problem: str


class ReluMlpFusionPass:
    """Finds gated and non-gated ReLU MLP blocks in a GraphModule and rewrites them into twell ops.

    ``options`` is anything with boolean ``gated`` and ``non_gated`` attributes (``TwellOptions``);
    None means both on. Calling the pass mutates ``gm`` (lint and recompile included when anything
    changed) and returns one ``CandidateBlock`` per block found, in graph order.
    """

    name = "relu_mlp_fusion"

    def __init__(self, options: Any = None) -> None:
        self.gated = bool(getattr(options, "gated", True))
        self.non_gated = bool(getattr(options, "non_gated", True))

    def __call__(self, gm: fx.GraphModule) -> list[CandidateBlock]:
        graph = gm.graph
        position = {node: i for i, node in enumerate(graph.nodes)}
        self._in_transforms = nodes_inside_autodiff_transforms(graph)
        found = [m for m in (self._match_at(node, gm) for node in list(graph.nodes)) if m is not None]
        # Everything is judged and printed on the graph as it was, before any rewrite changes it.
        planned = [
            (
                match,
                _module_path(match, position),
                format_nodes_code(sorted(_region(match), key=position.__getitem__)),
                self._reason_to_leave_alone(match, gm, position),
            )
            for match in found
        ]

        candidates: list[CandidateBlock] = []
        claimed: dict[fx.Node, str] = {}  # nodes owned by rewritten blocks -> their module path
        replaced: dict[fx.Node, fx.Node] = {}  # old block outputs -> fused nodes
        for match, path, before, reason in planned:
            if not reason:
                overlap = next((claimed[n] for n in match.nodes if n in claimed), None)
                if overlap is not None:
                    reason = f"shares nodes with the block at {overlap}, which was rewritten first"
            if reason:
                candidates.append(CandidateBlock(match.kind, LEFT_ALONE, reason, path, before))
                _bump_counter("left_alone")
                continue
            after = self._rewrite(match, gm, position, replaced, path)
            claimed.update(dict.fromkeys(match.owned, path))
            candidates.append(CandidateBlock(match.kind, REWRITTEN, _describe(match), path, before, after))
            _bump_counter("gated_relu_mlp" if match.kind == GATED else "relu_mlp")

        if replaced:
            graph.lint()
            gm.recompile()
        return candidates

    # -----------------------------------------------------------------------------------------------
    # Matching (read-only)
    # -----------------------------------------------------------------------------------------------

    def _match_at(self, node: fx.Node, gm: fx.GraphModule) -> _Block | _NearMiss | None:
        """The block whose down projection ends at ``node``, if any."""
        down = match_linear(node, gm)
        if down is None or is_absorbed_by_user(down, gm):
            return None
        hidden, hidden_views = skip_identity_views(down.input)

        # Activation first: t * sigmoid(t) (decomposed SiLU) is an activation, not a gated product.
        activation = _activation_over_linear(hidden, gm)
        if activation is not None:
            return _non_gated_block(down, hidden_views, activation)
        product = _product_parts(hidden, gm)
        if product is not None:
            return _gated_block(down, hidden, hidden_views, product)
        return _near_miss(down, hidden, gm)

    # -----------------------------------------------------------------------------------------------
    # Checks
    # -----------------------------------------------------------------------------------------------

    def _reason_to_leave_alone(self, match: _Block | _NearMiss, gm: fx.GraphModule, position) -> str:
        """Empty when the block may be rewritten; otherwise why not, in words."""
        if isinstance(match, _NearMiss):
            return match.problem
        activation = match.activation
        if activation.name != RELU:
            return f"activation is {activation.name}, not relu"
        if not is_relu(activation.node, gm):
            return f"relu call {activation.node.name} has unexpected arguments"
        if is_clamp_relu(activation.node) and _gradients_may_flow(activation.node):
            # (the twell ops' backward is relu's; under no_grad or inference_mode nothing differs)
            return (f"{activation.node.name} is relu spelled as a clamp, whose gradient at exactly 0 is 1 "
                    f"where relu's is 0; compiled with gradients enabled, it is left alone")
        if is_inplace_call(activation.node) and _pieces_overlap(match.gate, match.up):
            return (f"the in-place {activation.node.name} writes into a piece of the projection that "
                    f"overlaps the up projection's piece")
        if is_inplace_call(activation.node) and match.gate is not None and match.gate.output is match.up.output:
            return (f"the in-place {activation.node.name} writes into the value the up projection's "
                    f"product reads too (gate and up are one value)")
        if match.output in self._in_transforms:
            return ("it runs inside a torch.func grad or jvp transform or a forward-mode AD level, which the "
                    "twell ops' autograd does not support")
        if match.kind == GATED and not self.gated:
            return "gated rewrites are disabled (options.gated=False)"
        if match.kind == NON_GATED and not self.non_gated:
            return "non-gated rewrites are disabled (options.non_gated=False)"
        if match.gate is not None and match.gate.input is not match.up.input:
            return f"gate and up read different inputs ({match.gate.input.name} vs {match.up.input.name})"
        return (
            _escaping_value(match)
            or _shape_problem(match)
            or _dtype_problem(match)
            or _mutation_inside(match, gm, position)
        )

    # -----------------------------------------------------------------------------------------------
    # Rewriting
    # -----------------------------------------------------------------------------------------------

    def _rewrite(self, block: _Block, gm: fx.GraphModule, position, replaced, path: str) -> str:
        """Replaces the block by one fused call; returns the new code for the report."""
        graph = gm.graph
        new_nodes: list[fx.Node] = []
        attrs: dict[str, fx.Node] = {}  # one get_attr per parameter (a fused weight feeds two slices)

        def operand(value: Operand | None) -> fx.Node | None:
            if value is None:
                return None
            if isinstance(value, RowSlice):  # a fused projection's share: a view of its rows
                sliced = graph.call_function(aten.slice.Tensor, (operand(value.source), 0, value.start, value.stop))
                new_nodes.append(sliced)
                return sliced
            if isinstance(value, ModuleParameter):
                if value.qualified_name not in attrs:
                    attrs[value.qualified_name] = graph.get_attr(value.qualified_name)
                    new_nodes.append(attrs[value.qualified_name])
                return attrs[value.qualified_name]
            # An earlier rewrite may have replaced the node this block reads (chained blocks).
            return replaced.get(value, value)

        with graph.inserting_before(block.output):
            x = operand(block.x)
            if block.kind == GATED:
                target = torch.ops.twell.gated_relu_mlp.default
                weights = [operand(m.weight) for m in (block.gate, block.up, block.down)]
                biases = [operand(m.bias) for m in (block.gate, block.up, block.down)]
            else:
                target = torch.ops.twell.relu_mlp.default
                weights = [operand(m.weight) for m in (block.up, block.down)]
                biases = [operand(m.bias) for m in (block.up, block.down)]
            # Biases positional (None where absent) so printed graphs look the same for every block.
            fused = graph.create_node("call_function", target, (x, *weights, *biases), name=target._opname)
        fused.meta = _fused_meta(block.output, path)
        new_nodes.append(fused)

        block.output.replace_all_uses_with(fused)
        replaced[block.output] = fused
        _erase_dead(block.nodes, gm, position)
        return format_nodes_code(new_nodes)


# ---------------------------------------------------------------------------------------------------
# Structure helpers
# ---------------------------------------------------------------------------------------------------


def _mul_operands(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """The two tensors of an elementwise ``a * b`` (operator, torch.mul, aten.mul.Tensor, .mul)."""
    if not is_call(node, MUL_FUNCTIONS, MUL_METHODS) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if isinstance(a, fx.Node) and isinstance(b, fx.Node):
        return a, b
    return None


def _skip_views(node: Any) -> fx.Node | None:
    return skip_identity_views(node)[0] if isinstance(node, fx.Node) else None


def _activation_over_linear(node: Any, gm: fx.GraphModule) -> _Activation | None:
    """``act(linear(...))`` for any known activation (ReLU or a near-miss one)."""
    if not isinstance(node, fx.Node):
        return None
    name = activation_name(node, gm)
    parts: tuple[fx.Node, ...] = ()
    if name is not None:
        source = first_input(node)
    else:
        source, parts = _decomposed_silu(node)
        name = "silu"
    if not isinstance(source, fx.Node):
        return None
    source, views = skip_identity_views(source)
    linear = match_projection(source, gm)
    if linear is None:
        return None
    return _Activation(node, name, linear, views, parts)


def _decomposed_silu(node: fx.Node) -> tuple[fx.Node | None, tuple[fx.Node, ...]]:
    """``(t, (sigmoid,))`` when ``node`` is ``t * sigmoid(t)``, SiLU after ``run_decompositions``."""
    operands = _mul_operands(node)
    for value, gate in (operands, operands[::-1]) if operands is not None else ():
        if is_call(gate, _SIGMOID_FUNCTIONS, _SIGMOID_METHODS) and first_input(gate) is value:
            return value, (gate,)
    return None, ()


@dataclasses.dataclass
class _ProductParts:
    activation: _Activation
    up: LinearMatch
    activation_views: tuple[fx.Node, ...]
    up_views: tuple[fx.Node, ...]


def _product_parts(node: fx.Node, gm: fx.GraphModule) -> _ProductParts | None:
    """``act(gate(x)) * up(y)`` in either operand order (x and y are compared later)."""
    operands = _mul_operands(node)
    if operands is None:
        return None
    for activation_side, up_side in (operands, operands[::-1]):
        activation_node, activation_views = skip_identity_views(activation_side)
        activation = _activation_over_linear(activation_node, gm)
        if activation is None:
            continue
        up_node, up_views = skip_identity_views(up_side)
        up = match_projection(up_node, gm)
        if up is not None:
            return _ProductParts(activation, up, activation_views, up_views)
    return None


def _non_gated_block(down: LinearMatch, hidden_views: tuple[fx.Node, ...], activation: _Activation) -> _Block:
    block = _Block(NON_GATED, down, activation.linear, activation)
    _add_linear(block, activation.linear, _ROLE_UP)
    block.private.update(dict.fromkeys(activation.views, _ROLE_UP))
    activation_nodes = (activation.node, *activation.parts, *hidden_views, *down.input_nodes)
    block.private.update(dict.fromkeys(activation_nodes, _ROLE_ACTIVATION))
    _add_down(block, down)
    return block


def _gated_block(down: LinearMatch, product: fx.Node, product_views: tuple[fx.Node, ...],
                 parts: _ProductParts) -> _Block:
    activation, up = parts.activation, parts.up
    block = _Block(GATED, down, up, activation, gate=activation.linear)
    _add_linear(block, activation.linear, _ROLE_GATE)
    block.private.update(dict.fromkeys(activation.views, _ROLE_GATE))
    block.private.update(dict.fromkeys((activation.node, *activation.parts, *parts.activation_views), _ROLE_ACTIVATION))
    _add_linear(block, up, _ROLE_UP)
    block.private.update(dict.fromkeys(parts.up_views, _ROLE_UP))
    block.private.update(dict.fromkeys((product, *product_views, *down.input_nodes), _ROLE_PRODUCT))
    _add_down(block, down)
    return block


def _add_linear(block: _Block, linear: LinearMatch, role: str) -> None:
    block.private.update(dict.fromkeys(linear.value_nodes, role))
    block.shared.update(linear.input_nodes, linear.weight_nodes)


def _add_down(block: _Block, down: LinearMatch) -> None:
    block.private.update(dict.fromkeys(down.value_nodes[1:], _ROLE_DOWN))
    block.shared.update(down.weight_nodes)


def _near_miss(down: LinearMatch, hidden: fx.Node, gm: fx.GraphModule) -> _NearMiss | None:
    """Recognizes MLP-like shapes that are not ReLU MLP blocks, to report them (one level deep, cheap)."""
    nodes = {*down.nodes, hidden}

    # down(act(gate(x) * up(x))): the activation acts on the product, not on the gate.
    name = activation_name(hidden, gm)
    if name is not None:
        product = _skip_views(first_input(hidden))
        operands = _mul_operands(product) if product is not None else None
        linears = [match_projection(_skip_views(o), gm) for o in operands or ()]
        if operands and all(linears):
            nodes.update((product, *(n for m in linears for n in m.nodes)))
            problem = f"{name} is applied to the product (down({name}(gate(x) * up(x)))), not to the gate"
            return _NearMiss(GATED, down.output, nodes, problem)
        return None

    # down(op(act(gate(x))) * up(x)): an op sits between the activation and the product.
    operands = _mul_operands(hidden)
    if operands is not None:
        # down(act(gate(x)) * act(up(x))) (dReLU, as in TurboSparse): both factors activated.
        both = [_activation_over_linear(_skip_views(o), gm) for o in operands]
        if all(both):
            nodes.update(n for a in both for n in (a.node, *a.parts, *a.linear.nodes))
            problem = (f"both factors of the product are activated ({both[0].name}(gate(x)) * {both[1].name}(up(x))); "
                       f"the op multiplies by up(x) itself")
            return _NearMiss(GATED, down.output, nodes, problem)
        for wedged, other in (operands, operands[::-1]):
            activation = _activation_over_linear(_skip_views(first_input(wedged)), gm)
            up = match_projection(_skip_views(other), gm) if activation is not None else None
            if up is not None:
                nodes.update((wedged, activation.node, *activation.linear.nodes, *up.nodes))
                problem = f"{_op_name(wedged, gm)} sits between the {activation.name} and the product"
                return _NearMiss(GATED, down.output, nodes, problem)
        return None

    # down(op(act(gate(x)) * up(x))) or down(op(act(up(x)))): an op sits between the block and down.
    # (A linear there is no near-miss: it is the down projection of a block of its own.)
    inner = _skip_views(first_input(hidden))
    if inner is None or match_linear(hidden, gm) is not None:
        return None
    product = _product_parts(inner, gm)
    if product is not None:
        activation = product.activation
        nodes.update((inner, activation.node, *activation.linear.nodes, *product.up.nodes))
        problem = f"{_op_name(hidden, gm)} sits between the product and the down projection"
        return _NearMiss(GATED, down.output, nodes, problem)
    activation = _activation_over_linear(inner, gm)
    if activation is not None:
        nodes.update((activation.node, *activation.linear.nodes))
        problem = f"{_op_name(hidden, gm)} sits between the {activation.name} and the down projection"
        return _NearMiss(NON_GATED, down.output, nodes, problem)
    return None


def _op_name(node: fx.Node, gm: fx.GraphModule) -> str:
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return f"{type(module).__name__} ({node.name})"
    if node.op == "call_method":
        return f".{node.target}() ({node.name})"
    return f"{target_name(node.target)} ({node.name})"


# ---------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------


def _escaping_value(block: _Block) -> str:
    """A reason when an intermediate value of the block is read outside it (so it must stay). Its
    shared nodes (x's reshapes, weight transposes) stay in the graph, so a read by one of them is a read
    from outside too."""
    inside = block.owned
    for node, role in block.private.items():
        for user in node.users:
            if user not in inside:
                return f"{role} ({node.name}) has another user: {user.name}"
    return ""


def _shape_problem(block: _Block) -> str:
    """A reason when weight shapes are unknown or do not chain ``x[..., D] -> [F] -> [D_out]``."""
    labels = ("gate", "up", "down") if block.gate is not None else ("up", "down")
    linears = dict(zip(labels, block.linears))
    unknown = [
        operand_name(operand)
        for linear in linears.values()
        for operand in (linear.weight, linear.bias)
        if operand is not None and operand_shape(operand) is None
    ]
    if unknown:
        return f"shapes unknown (no shape metadata for {', '.join(unknown)})"
    weights = {label: operand_shape(linear.weight) for label, linear in linears.items()}
    for label, shape in weights.items():
        if len(shape) != 2:
            return f"{label} weight has shape {format_shape(shape)}, not [out_features, in_features]"
    first = "gate" if block.gate is not None else "up"
    hidden, in_features = weights[first]
    if block.gate is not None and not shapes_equal(weights["gate"], weights["up"]):
        return (
            f"gate weight {format_shape(weights['gate'])} and up weight {format_shape(weights['up'])} "
            f"differ (the product would broadcast or fail)"
        )
    if not sizes_equal(weights["down"][1], hidden):
        return (
            f"down weight {format_shape(weights['down'])} does not take the {hidden} features "
            f"{first} produces"
        )
    for label, linear in linears.items():
        bias_shape = operand_shape(linear.bias)
        if bias_shape is not None and not shapes_equal(bias_shape, weights[label][:1]):
            return f"{label} bias has shape {format_shape(bias_shape)}, expected [{weights[label][0]}]"
    x_shape = node_shape(block.x)
    # Without metadata on x (symbolic_trace), a wrong last dim fails in the op's own check exactly
    # where the original linear would have failed; with metadata we refuse up front.
    if x_shape is not None:
        if len(x_shape) == 0 or not sizes_equal(x_shape[-1], in_features):
            return f"x has shape {format_shape(x_shape)} but {first} weight expects {in_features} input features"
        out_shape = node_shape(block.output)
        expected = (*x_shape[:-1], weights["down"][0])
        if out_shape is not None and not shapes_equal(out_shape, expected):
            return f"block output has shape {format_shape(out_shape)}, expected {format_shape(expected)}"
    return ""


# The dtypes the twell ops take (twell_compile/validation.py, SUPPORTED_DTYPES; a test keeps them equal).
OP_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _dtype_problem(block: _Block) -> str:
    """A reason when a known dtype of x or of a weight or bias is one the ops do not take (an integer
    MLP computes in eager, and would fail in the op)."""
    operands = {"x": node_dtype(block.x)}
    for label, linear in zip(("gate", "up", "down") if block.gate is not None else ("up", "down"), block.linears):
        operands[f"{label} weight"] = operand_dtype(linear.weight)
        operands[f"{label} bias"] = operand_dtype(linear.bias) if linear.bias is not None else None
    for name, dtype in operands.items():
        if dtype is not None and dtype not in OP_DTYPES:
            return f"{name} has dtype {dtype}, which the twell ops do not take"
    return ""


def _gradients_may_flow(node: fx.Node) -> bool:
    """Whether a gradient may reach ``node`` where the graph runs. Dynamo graphs record each value as
    traced (grad mode switched inside the graph included; the graph is recompiled for another grad mode
    outside it); other graphs are judged by the grad mode the pass runs in."""
    value = node.meta.get("example_value")
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    return torch.is_grad_enabled()


def _pieces_overlap(gate: LinearMatch | None, up: LinearMatch | None) -> bool:
    """Gate and up are pieces of one fused projection whose rows overlap: an in-place activation of the
    gate's piece then changes part of the up piece too, which the fused op would not see."""
    if gate is None or up is None:
        return False
    a, b = gate.weight, up.weight
    if not (isinstance(a, RowSlice) and isinstance(b, RowSlice)):
        return False
    same = a.source is b.source or a.source.name == b.source.name
    return same and a.start < b.stop and b.start < a.stop


def _mutation_inside(block: _Block, gm: fx.GraphModule, position: dict[fx.Node, int]) -> str:
    """A reason when an op between the block's first node and its output may change what it reads.

    The fused call runs where the block's output was, so x and the weights must hold the values the
    gate and up projections saw; in-place ops or global-state changes (autocast, grad mode) in
    between could break that.
    """
    inside = block.nodes
    node = min(inside, key=position.__getitem__)
    while node is not block.output:
        if node not in inside and may_mutate(node, gm):
            return (
                f"{node.name} ({format_node_code(node)}) runs inside the block and may modify its inputs "
                f"or global state (grad mode, autocast)"
            )
        node = node.next
    return ""


# ---------------------------------------------------------------------------------------------------
# Rewrite helpers
# ---------------------------------------------------------------------------------------------------


def _fused_meta(output: fx.Node, module_path: str) -> dict[str, Any]:
    """The block output's metadata (same value: ``val``/``example_value``, stack trace) for the fused node."""
    meta = {k: v for k, v in output.meta.items() if k not in _CALL_SPECIFIC_META}
    stack = meta.get("nn_module_stack")
    if stack and module_path:
        # The fused call belongs to the MLP module, not to its down projection: drop deeper entries.
        meta["nn_module_stack"] = {
            key: entry
            for key, entry in stack.items()
            if _is_prefix_path(stack_entry_path(entry), module_path)
        }
    return meta


def _is_prefix_path(prefix: str, path: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def _erase_dead(nodes: set[fx.Node], gm: fx.GraphModule, position: dict[fx.Node, int]) -> None:
    """Erases the block's nodes that are now unused, then pure helpers only they used (view sizes).

    Deliberately not ``graph.eliminate_dead_code()``: that would also drop unrelated nodes the user's
    graph keeps on purpose (e.g. export's ``_guards_fn`` call).
    """
    graph = gm.graph
    heap = [(-position[n], n.name, n) for n in nodes if n in position]
    heapq.heapify(heap)
    queued = set(nodes)
    while heap:
        _, _, node = heapq.heappop(heap)
        if node.users or node.op in ("placeholder", "output", "get_attr"):
            continue
        if node not in nodes and (node.op not in ("call_function", "call_method") or _impure(node, gm)):
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        for source in inputs:
            if source not in queued and source in position:
                queued.add(source)
                heapq.heappush(heap, (-position[source], source.name, source))


def _impure(node: fx.Node, gm: fx.GraphModule) -> bool:
    return may_mutate(node, gm) or node.is_impure()


# ---------------------------------------------------------------------------------------------------
# Reporting helpers
# ---------------------------------------------------------------------------------------------------


def _region(match: _Block | _NearMiss) -> set[fx.Node]:
    """The nodes shown as the block's 'before' code (compute nodes, not inputs or parameters)."""
    return {n for n in match.nodes if n.op not in ("placeholder", "get_attr", "output")}


def _module_path(match: _Block | _NearMiss, position: dict[fx.Node, int]) -> str:
    """Module the block lives in: the common prefix of its nodes' module stacks (Dynamo, export), else
    of the modules it calls and the parameters it reads (symbolic_trace), else its node names."""
    region = _region(match)
    innermost = [stack[-1] for stack in map(module_stack, region) if stack]
    path = common_module_path(innermost) if innermost else ""
    if path:
        return path
    owners = [n.target for n in region if n.op == "call_module"]
    owners += [a.target.rpartition(".")[0] for n in region for a in n.all_input_nodes if a.op == "get_attr"]
    path = common_module_path([owner for owner in owners if owner])
    if path:
        return path
    ordered = sorted(region, key=position.__getitem__)
    return f"nodes {ordered[0].name}..{ordered[-1].name}" if ordered else match.output.name


def _describe(block: _Block) -> str:
    spellings = ", ".join(sorted({m.spelling for m in block.linears}))
    if block.kind == GATED:
        return f"down(relu(gate(x)) * up(x)) with x = {block.x.name} ({spellings})"
    return f"down(relu(up(x))) with x = {block.x.name} ({spellings})"


def _bump_counter(key: str) -> None:
    # Mirrors Inductor's pattern-matcher counters, so tests and users can read them the same way.
    from torch._dynamo.utils import counters

    counters["twell"][key] += 1
