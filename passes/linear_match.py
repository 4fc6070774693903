"""Recognizes a value computed as ``linear(x, weight, bias)``, whatever spelling the graph uses.

Spellings, by graph dialect:

* ``symbolic_trace``: ``call_module`` of an ``nn.Linear`` (its forward not overridden);
* Dynamo / FX: ``F.linear`` (= ``torch._C._nn.linear``) with positional or keyword arguments;
* export before decompositions: ``aten.linear.default``;
* export after ``run_decompositions()``: ``aten.mm(x2d, t(W))`` or ``aten.addmm(b, x2d, t(W))`` where
  ``t`` is ``aten.t``, ``aten.permute(W, [1, 0])`` or ``aten.transpose(W, 0, 1)``; optionally a bias
  ``aten.add`` (before or after the reshape), and a reshape back to the leading dims, in which case
  ``x2d`` must be ``x`` with its leading dims flattened (last dim unchanged);
* hand-written products with the weight in ``nn.Linear`` layout, in any dialect: ``x @ W.T``,
  ``torch.matmul(x, W.t())``, ``x.matmul(W.transpose(0, 1))``, ``torch.mm(x2d, W.permute(1, 0))``,
  ``W.mT``, ``aten.matmul(x, aten.numpy_T(W))`` ..., optionally ``+ b``. (``x @ W`` with W stored
  ``[in, out]`` is no linear of a weight the op could take as it is, and is not matched.)

A match is only reported when it provably computes ``linear(input, weight, bias)`` on the value the
match's output node produces; anything doubtful is no match.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx, nn

from .fx_utils import (
    ADD_FUNCTIONS,
    ADD_METHODS,
    ADDMM_FUNCTIONS,
    LINEAR_FUNCTIONS,
    MATMUL_FUNCTIONS,
    MATMUL_METHODS,
    MM_FUNCTIONS,
    MM_METHODS,
    PERMUTE_FUNCTIONS,
    TRANSPOSE_ATTRIBUTES,
    TRANSPOSE_FUNCTIONS_NO_DIMS,
    TRANSPOSE_PAIR_FUNCTIONS,
    TRANSPOSE_PAIR_METHODS,
    first_input,
    get_arg,
    get_module,
    has_plain_forward,
    is_call,
    is_view,
    node_dtype,
    node_shape,
    shapes_equal,
    sizes_equal,
)

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class ModuleParameter:
    """A parameter of a ``call_module`` linear; rewriting turns it into a ``get_attr`` node."""

    qualified_name: str
    """Attribute path from the GraphModule, e.g. ``mlp.gate_proj.weight``."""
    value: torch.Tensor

    @property
    def name(self) -> str:
        return self.qualified_name


@dataclasses.dataclass(frozen=True)
class RowSlice:
    """Rows ``start:stop`` (dim 0) of a weight or bias: one projection's share of a fused one
    (``fused_projection.py``); rewriting turns it into an ``aten.slice`` of ``source``, a view."""

    source: fx.Node | ModuleParameter
    start: int
    stop: int

    @property
    def name(self) -> str:
        return f"{self.source.name}[{self.start}:{self.stop}]"


Operand = fx.Node | ModuleParameter | RowSlice


def operand_shape(operand: Operand | None) -> tuple | None:
    if isinstance(operand, RowSlice):
        shape = operand_shape(operand.source)
        return None if not shape else (operand.stop - operand.start, *shape[1:])
    if isinstance(operand, ModuleParameter):
        return tuple(operand.value.shape)
    return node_shape(operand)


def operand_dtype(operand: Operand | None) -> torch.dtype | None:
    if isinstance(operand, RowSlice):
        return operand_dtype(operand.source)
    if isinstance(operand, ModuleParameter):
        return operand.value.dtype
    return node_dtype(operand)


def operand_name(operand: Operand | None) -> str:
    return "None" if operand is None else operand.name


@dataclasses.dataclass(frozen=True)
class LinearMatch:
    """``output`` holds ``linear(input, weight, bias)``."""

    output: fx.Node
    input: fx.Node
    weight: Operand
    bias: Operand | None
    spelling: str
    value_nodes: tuple[fx.Node, ...]
    """Nodes computing the linear's result, output first; every one but ``output`` is private to it."""
    input_nodes: tuple[fx.Node, ...] = ()
    """Reshapes of ``input`` that feed the matrix product (export graphs flatten leading dims)."""
    weight_nodes: tuple[fx.Node, ...] = ()
    """Transposes of ``weight`` that feed the matrix product."""

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        return self.value_nodes + self.input_nodes + self.weight_nodes

    @property
    def out_features(self):
        shape = operand_shape(self.weight)
        return None if shape is None or len(shape) != 2 else shape[0]


def match_linear(node: object, gm: fx.GraphModule | None) -> LinearMatch | None:
    """The linear computation ending at ``node``, or None when ``node`` is not one."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_module":
        return _match_linear_module(node, gm)
    if node.op == "call_function" and node.target in LINEAR_FUNCTIONS:
        return _match_linear_function(node)
    if node.op in ("call_function", "call_method"):
        return _match_decomposed_linear(node)
    return None


def is_absorbed_by_user(match: LinearMatch, gm: fx.GraphModule | None) -> bool:
    """True when ``match`` is the inner part of a larger linear match (e.g. ``mm`` of ``view(mm) + b``).

    Anchoring on the outermost match keeps one block per linear instead of one per partial spelling.
    """
    if len(match.output.users) != 1:
        return False
    user = next(iter(match.output.users))
    outer = match_linear(user, gm)
    return outer is not None and match.output in outer.value_nodes


# ---------------------------------------------------------------------------------------------------
# Whole-linear spellings
# ---------------------------------------------------------------------------------------------------


def _match_linear_module(node: fx.Node, gm: fx.GraphModule | None) -> LinearMatch | None:
    module = get_module(gm, node.target)
    if module is None or not has_plain_forward(module, nn.Linear) or len(node.args) + len(node.kwargs) != 1:
        return None
    x = get_arg(node, 0, "input", None)
    if not isinstance(x, fx.Node):
        return None
    weight = ModuleParameter(f"{node.target}.weight", module.weight)
    bias = ModuleParameter(f"{node.target}.bias", module.bias) if module.bias is not None else None
    return LinearMatch(node, x, weight, bias, "nn.Linear", (node,))


def _match_linear_function(node: fx.Node) -> LinearMatch | None:
    x = get_arg(node, 0, "input", None)
    weight = get_arg(node, 1, "weight", None)
    bias = get_arg(node, 2, "bias", None)
    if not isinstance(x, fx.Node) or not isinstance(weight, fx.Node):
        return None
    if bias is not None and not isinstance(bias, fx.Node):
        return None
    spelling = "aten.linear" if node.target is aten.linear.default else "F.linear"
    return LinearMatch(node, x, weight, bias, spelling, (node,))


# ---------------------------------------------------------------------------------------------------
# Decomposed spellings: [add(] [view(] [add(] mm|addmm(x2d, t(W)) [, b)] [)] [, b)]
# ---------------------------------------------------------------------------------------------------


def _match_decomposed_linear(node: fx.Node) -> LinearMatch | None:
    value_nodes = [node]
    current = node
    bias: fx.Node | None = None

    split = _split_bias_add(current)
    if split is not None:
        current, bias = split
        value_nodes.append(current)

    unflatten: fx.Node | None = None
    if is_view(current):
        unflatten = current
        current = first_input(current)
        if not isinstance(current, fx.Node):
            return None
        value_nodes.append(current)
        if bias is None:
            split = _split_bias_add(current)
            if split is not None:
                current, bias = split
                value_nodes.append(current)

    core = current
    if is_call(core, MM_FUNCTIONS, MM_METHODS) and len(core.args) == 2 and not core.kwargs:
        x2d, transposed_weight = core.args
        spelling = "aten.mm" if core.target is aten.mm.default else "torch.mm"
        spelling += " + add" if bias is not None else ""
    elif is_call(core, MATMUL_FUNCTIONS, MATMUL_METHODS) and len(core.args) == 2 and not core.kwargs:
        x2d, transposed_weight = core.args  # x of any rank: matmul(x, W^T) is linear(x, W)
        spelling = "matmul + add" if bias is not None else "matmul"
    elif is_call(core, ADDMM_FUNCTIONS) and bias is None and len(core.args) == 3:
        if any(core.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")) or set(core.kwargs) - {"beta", "alpha"}:
            return None
        bias, x2d, transposed_weight = core.args
        if not isinstance(bias, fx.Node):
            return None
        spelling = "aten.addmm"
    else:
        return None

    if not isinstance(x2d, fx.Node):
        return None
    weight, weight_nodes = _untranspose(transposed_weight)
    if weight is None:
        return None
    # The partial results (mm before its bias or reshape) must not be read elsewhere: only the
    # output's value is what the linear produces.
    if any(len(inner.users) != 1 for inner in value_nodes[1:]):
        return None

    x: fx.Node = x2d
    input_nodes: tuple[fx.Node, ...] = ()
    if unflatten is not None:
        x = _flattened_source(x2d, unflatten)
        if x is None:
            return None
        input_nodes = (x2d,)
        spelling += " (reshaped)"
    return LinearMatch(node, x, weight, bias, spelling, tuple(value_nodes), input_nodes, weight_nodes)


def _split_bias_add(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(main, bias)`` when ``node`` adds a 1-D bias of the last dim's size to ``main`` (same dtype)."""
    if not is_call(node, ADD_FUNCTIONS, ADD_METHODS) or len(node.args) != 2:
        return None
    if set(node.kwargs) - {"alpha"} or node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = node.args
    for main, bias in ((a, b), (b, a)):
        if not isinstance(main, fx.Node) or not isinstance(bias, fx.Node):
            continue
        main_shape, bias_shape = node_shape(main), node_shape(bias)
        # A bias is exactly [out_features]; anything else (a residual, a [1, F] tensor) is not one.
        if main_shape is None or bias_shape is None or len(bias_shape) != 1 or len(main_shape) < 2:
            continue
        if sizes_equal(bias_shape[0], main_shape[-1]) and node_dtype(main) == node_dtype(bias):
            return main, bias
    return None


def _untranspose(node: object) -> tuple[fx.Node | None, tuple[fx.Node, ...]]:
    """``(W, (transpose,))`` when ``node`` is a 2-D weight ``W`` transposed; ``(None, ())`` otherwise."""
    if not isinstance(node, fx.Node) or node.kwargs or not node.args:
        return None, ()
    weight = node.args[0]
    if not isinstance(weight, fx.Node):
        return None, ()
    weight_shape = node_shape(weight)
    if weight_shape is None or len(weight_shape) != 2:
        return None, ()
    return (weight, (node,)) if _transposes_2d(node) else (None, ())


def _dims_mod_2(dims: object) -> tuple[int, int] | None:
    """Two literal dims as dims of a 2-D tensor (-1 is 1), or None."""
    if isinstance(dims, (tuple, list)) and len(dims) == 2 and all(type(d) is int for d in dims):
        return dims[0] % 2, dims[1] % 2
    return None


def _transposes_2d(node: fx.Node) -> bool:
    """``node`` transposes its first argument, a 2-D tensor (checked by the caller)."""
    args = node.args[1:]
    swap = _dims_mod_2(args) in ((0, 1), (1, 0))  # transpose(W, 0, 1) and the like
    if node.op == "call_method":
        if node.target == "t":
            return not args
        if node.target == "permute":  # .permute(1, 0) or .permute((1, 0))
            return _dims_mod_2(args[0] if len(args) == 1 else args) == (1, 0)
        return node.target in TRANSPOSE_PAIR_METHODS and swap
    if node.op != "call_function":
        return False
    if node.target in TRANSPOSE_FUNCTIONS_NO_DIMS:
        return not args
    if node.target is getattr:
        return len(args) == 1 and args[0] in TRANSPOSE_ATTRIBUTES
    if node.target in PERMUTE_FUNCTIONS:
        return len(args) == 1 and _dims_mod_2(args[0]) == (1, 0)
    return node.target in TRANSPOSE_PAIR_FUNCTIONS and swap


def _flattened_source(x2d: fx.Node, unflatten: fx.Node) -> fx.Node | None:
    """``x`` when ``x2d`` is ``x`` with leading dims flattened and ``unflatten`` restores those dims.

    Only then is ``unflatten(mm(x2d, W.t()))`` equal to ``linear(x, W)``.
    """
    if not is_view(x2d):
        return None
    x = first_input(x2d)
    if not isinstance(x, fx.Node):
        return None
    x_shape, x2d_shape, out_shape = node_shape(x), node_shape(x2d), node_shape(unflatten)
    if x_shape is None or x2d_shape is None or out_shape is None:
        return None
    if len(x2d_shape) != 2 or len(x_shape) < 1 or len(out_shape) != len(x_shape):
        return None
    if not sizes_equal(x_shape[-1], x2d_shape[-1]) or not shapes_equal(out_shape[:-1], x_shape[:-1]):
        return None
    return x
