"""Pieces of a fused projection: ``gate, up = linear(x, W_gate_up).chunk(2, dim=-1)`` (Phi-3, GLM).

A piece of a linear's output, split along its last dim, is itself a linear of the same input: rows
``start:stop`` of the weight and of the bias. ``match_projection`` returns such a piece as a
``LinearMatch`` whose weight and bias are ``RowSlice``s, so the MLP pass checks and rewrites it like
any other projection; the rewrite hands the op row slices of the fused weight, which are views (rows
of a contiguous weight are contiguous), so nothing is copied.

Spellings: ``t.chunk(n, dim)``, ``torch.chunk``, ``aten.chunk``; ``t.split(size or sizes, dim)``,
``torch.split``, ``aten.split.Tensor``, ``aten.split_with_sizes``; each piece taken by ``getitem``.
Or a piece taken directly: ``t[..., a:b]`` (``aten.slice.Tensor`` in export graphs), ``t.narrow(-1,
start, length)``. The split must be along the last dim and its sizes known; anything else is no match.
"""

from __future__ import annotations

import itertools
import operator

import torch
from torch import fx

from .fx_utils import is_call, node_shape
from .linear_match import LinearMatch, RowSlice, match_linear

aten = torch.ops.aten

_CHUNK_FUNCTIONS = frozenset({torch.chunk, aten.chunk.default})
_CHUNK_METHODS = frozenset({"chunk"})
_SPLIT_FUNCTIONS = frozenset({torch.split, aten.split.Tensor, aten.split_with_sizes.default})  # torch.functional.split too
_SPLIT_METHODS = frozenset({"split", "split_with_sizes"})
# Argument names of the spec and the dim, across the spellings (torch.split, Tensor.split, aten).
_SPEC_NAMES = ("chunks", "split_size_or_sections", "split_size", "split_sizes")


def match_projection(node: object, gm: fx.GraphModule | None) -> LinearMatch | None:
    """The linear computation ending at ``node``, whole or a piece of a fused one's output."""
    return match_linear(node, gm) or match_linear_piece(node, gm) or match_linear_slice(node, gm)


def match_linear_slice(node: object, gm: fx.GraphModule | None) -> LinearMatch | None:
    """``node`` = ``linear(x, W, b)[..., a:b]`` (or a narrow), as ``linear(x, W[a:b], b[a:b])``."""
    spec = _slice_spec(node)
    if spec is None:
        return None
    source, kind, start, stop, dim = spec
    linear = match_linear(source, gm)
    total = linear.out_features if linear is not None else None
    if type(total) is not int or not _is_last_dim(dim, source):
        return None
    rows = _slice_bounds(kind, start, stop, total)
    return None if rows is None else _rows_of(linear, rows, node, (), f"{kind} of {linear.spelling}")


def match_linear_piece(node: object, gm: fx.GraphModule | None) -> LinearMatch | None:
    """``node`` = ``split(linear(x, W, b), ..., dim=-1)[i]``, as ``linear(x, W[rows], b[rows])``."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return None
    if len(node.args) != 2 or node.kwargs or type(node.args[1]) is not int:
        return None
    split, index = node.args
    spec = _split_spec(split)
    if spec is None:
        return None
    source, kind, sizes, dim = spec
    linear = match_linear(source, gm)
    total = linear.out_features if linear is not None else None
    if type(total) is not int or not _is_last_dim(dim, source):
        return None
    pieces = _pieces(kind, sizes, total)
    if pieces is None or not -len(pieces) <= index < len(pieces):
        return None
    # Pieces nothing reads (symbolic_trace keeps ``_`` of ``gate, _ = t.chunk(2, -1)``) go with the block.
    # Only pieces taken by indexing: any other reader with no users (the graph's output, a call for its
    # side effect) is not the block's to remove.
    unread = tuple(p for p in split.users
                   if p is not node and not p.users and p.op == "call_function" and p.target is operator.getitem)
    return _rows_of(linear, pieces[index], node, (split, *unread), f"{kind} piece of {linear.spelling}")


def _rows_of(linear: LinearMatch, rows: tuple[int, int], output: fx.Node, between: tuple[fx.Node, ...],
             spelling: str) -> LinearMatch:
    """``linear`` restricted to output features ``rows`` (start, stop), its value at ``output``, which
    ``between`` (the split, say) computes from the linear's."""
    weight = RowSlice(linear.weight, *rows)
    bias = RowSlice(linear.bias, *rows) if linear.bias is not None else None
    return LinearMatch(output, linear.input, weight, bias, spelling, (output, *between, *linear.value_nodes),
                       linear.input_nodes, linear.weight_nodes)


def _split_spec(node: object) -> tuple[fx.Node, str, object, object] | None:
    """``(tensor, "chunk" or "split", chunks or sizes, dim)`` of a chunk or split call."""
    if is_call(node, _CHUNK_FUNCTIONS, _CHUNK_METHODS):
        kind = "chunk"
    elif is_call(node, _SPLIT_FUNCTIONS, _SPLIT_METHODS):
        kind = "split"
    else:
        return None
    args, kwargs = node.args, node.kwargs
    if not args or set(kwargs) - {*_SPEC_NAMES, "dim"}:
        return None
    tensor = args[0]
    spec = args[1] if len(args) > 1 else next((kwargs[k] for k in _SPEC_NAMES if k in kwargs), None)
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)  # every spelling splits dim 0 by default
    if not isinstance(tensor, fx.Node) or spec is None or len(args) > 3:
        return None
    return tensor, kind, spec, dim


def _is_last_dim(dim: object, tensor: fx.Node) -> bool:
    if type(dim) is not int:
        return False
    if dim == -1:
        return True
    shape = node_shape(tensor)
    return shape is not None and dim == len(shape) - 1


def _pieces(kind: str, spec: object, total: int) -> list[tuple[int, int]] | None:
    """Each piece's ``(start, stop)`` along the split dim, as torch computes them; None if unknown or
    a piece would be empty."""
    if type(spec) is int:
        if spec < 1 or total < 1:
            return None
        size = -(-total // spec) if kind == "chunk" else spec  # chunk: pieces of ceil(total / chunks)
        return [(start, min(start + size, total)) for start in range(0, total, size)]
    if kind == "split" and isinstance(spec, (list, tuple)) and all(type(s) is int and s > 0 for s in spec):
        if sum(spec) != total:
            return None
        bounds = [0, *itertools.accumulate(spec)]
        return list(zip(bounds[:-1], bounds[1:]))
    return None


_SLICE_FUNCTIONS = frozenset({aten.slice.Tensor})
_NARROW_FUNCTIONS = frozenset({torch.narrow, aten.narrow.default})
_NARROW_METHODS = frozenset({"narrow"})


def _slice_spec(node: object) -> tuple[fx.Node, str, object, object, object] | None:
    """``(tensor, "slice" or "narrow", start, stop or length, dim)`` of a slice of one dim."""
    if not isinstance(node, fx.Node) or node.kwargs and not is_call(node, _SLICE_FUNCTIONS):
        return None
    args = node.args
    if node.op == "call_function" and node.target is operator.getitem and len(args) == 2:
        tensor, index = args
        # t[..., a:b], or t[:, a:b] with the rank known: a slice of the last dim only.
        if not isinstance(index, tuple) or not index or not isinstance(index[-1], slice):
            return None
        leading = index[:-1]
        if leading == (Ellipsis,):
            dim = -1
        elif all(s == slice(None) for s in leading):
            dim = len(leading)
        else:
            return None
        last = index[-1]
        if last.step not in (None, 1):
            return None
        return (tensor, "slice", last.start, last.stop, dim) if isinstance(tensor, fx.Node) else None
    if is_call(node, _SLICE_FUNCTIONS):
        if set(node.kwargs) - {"dim", "start", "end", "step"}:
            return None
        names = ("self", "dim", "start", "end", "step")
        values = dict(zip(names, args))
        values.update(node.kwargs)
        if values.get("step", 1) != 1 or not isinstance(values.get("self"), fx.Node):
            return None
        return values["self"], "slice", values.get("start"), values.get("end"), values.get("dim", 0)
    if is_call(node, _NARROW_FUNCTIONS, _NARROW_METHODS) and len(args) == 4 and isinstance(args[0], fx.Node):
        return args[0], "narrow", args[2], args[3], args[1]
    return None


def _slice_bounds(kind: str, start: object, stop: object, total: int) -> tuple[int, int] | None:
    """``(start, stop)`` of the rows a slice or narrow takes, as torch computes them; None if unknown
    or empty."""
    if kind == "narrow":  # narrow(dim, start, length): start may count from the end; no clamping
        if type(start) is not int or type(stop) is not int or stop < 0:
            return None
        first = start + total if start < 0 else start
        last = first + stop
        return (first, last) if 0 <= first < last <= total else None
    bounds = []
    for value, default in ((start, 0), (stop, total)):
        if value is None:
            value = default
        if type(value) is not int:
            return None
        if value < 0:
            value += total
        bounds.append(min(max(value, 0), total))
    return (bounds[0], bounds[1]) if bounds[0] < bounds[1] else None
