"""Small FX helpers shared by the matchers: op spellings, argument access, metadata, formatting.

Graphs reach the passes in several dialects: Dynamo graphs (torch-level calls, ``example_value``
metadata), ``symbolic_trace`` graphs (``call_module`` nodes, usually no metadata), and export or
make_fx graphs (ATen ops, ``val`` metadata). Everything here works on all of them and never adds
shape guards.
"""

from __future__ import annotations

import functools
import inspect
import operator
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.node import _side_effectful_functions

aten = torch.ops.aten

# ---------------------------------------------------------------------------------------------------
# Op spellings
# ---------------------------------------------------------------------------------------------------

# torch.nn.functional.linear *is* torch._C._nn.linear; both names are listed for readers.
LINEAR_FUNCTIONS = frozenset({F.linear, torch._C._nn.linear, aten.linear.default})
MM_FUNCTIONS = frozenset({aten.mm.default, torch.mm})
MM_METHODS = frozenset({"mm"})
# x @ W.T and torch.matmul(x, W.t()) with a 2-D W: linear(x, W) for any rank of x.
MATMUL_FUNCTIONS = frozenset({operator.matmul, torch.matmul, aten.matmul.default})
MATMUL_METHODS = frozenset({"matmul", "__matmul__"})
ADDMM_FUNCTIONS = frozenset({aten.addmm.default})
# Transposes of a 2-D tensor, by the dims they take: none (t, .T, .mT), a permutation, or a pair.
TRANSPOSE_FUNCTIONS_NO_DIMS = frozenset({aten.t.default, torch.t, aten.numpy_T.default, aten.mT.default})
TRANSPOSE_ATTRIBUTES = frozenset({"T", "mT"})  # getattr(W, "T") in Dynamo and symbolic_trace graphs
PERMUTE_FUNCTIONS = frozenset({aten.permute.default, torch.permute})
TRANSPOSE_PAIR_FUNCTIONS = frozenset({aten.transpose.int, torch.transpose, torch.swapaxes, torch.swapdims})
TRANSPOSE_PAIR_METHODS = frozenset({"transpose", "swapaxes", "swapdims"})
# Reshapes that only change how the same elements are indexed (no copy semantics that matter here).
VIEW_FUNCTIONS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, torch.reshape})
VIEW_METHODS = frozenset({"view", "reshape"})
ADD_FUNCTIONS = frozenset({operator.add, torch.add, aten.add.Tensor})
ADD_METHODS = frozenset({"add"})
MUL_FUNCTIONS = frozenset({operator.mul, torch.mul, aten.mul.Tensor})
MUL_METHODS = frozenset({"mul"})

RELU = "relu"

# clamp(t, min=0) with no max, and clamp_min(t, 0): ReLU by other names. They give the same values as
# relu (NaN stays NaN, -0.0 stays -0.0), so a block spelled with them is rewritten like one with relu.
_CLAMP_FUNCTIONS = frozenset({
    torch.clamp, torch.clamp_, torch.clip, torch.clip_, aten.clamp.default, aten.clamp_.default,
    aten.clip.default, aten.clip_.default,
})
_CLAMP_METHODS = frozenset({"clamp", "clamp_", "clip", "clip_"})
_CLAMP_MIN_FUNCTIONS = frozenset({torch.clamp_min, torch.clamp_min_, aten.clamp_min.default, aten.clamp_min_.default})
_CLAMP_MIN_METHODS = frozenset({"clamp_min", "clamp_min_"})

# name -> spellings, for ReLU and for the activations reported as near-misses.
_ACTIVATION_FUNCTIONS: dict[str, frozenset] = {
    RELU: frozenset({torch.relu, torch.relu_, F.relu, F.relu_, aten.relu.default, aten.relu_.default}),
    "silu": frozenset({F.silu, aten.silu.default, aten.silu_.default}),
    "gelu": frozenset({F.gelu, aten.gelu.default, aten.gelu_.default}),
    "sigmoid": frozenset({torch.sigmoid, torch.sigmoid_, F.sigmoid, aten.sigmoid.default, aten.sigmoid_.default}),
    "tanh": frozenset({torch.tanh, torch.tanh_, F.tanh, aten.tanh.default, aten.tanh_.default}),
    "mish": frozenset({F.mish, aten.mish.default, aten.mish_.default}),
    "leaky_relu": frozenset({F.leaky_relu, F.leaky_relu_, aten.leaky_relu.default, aten.leaky_relu_.default}),
    "elu": frozenset({F.elu, F.elu_, aten.elu.default, aten.elu_.default}),
    "relu6": frozenset({F.relu6}),
    "hardswish": frozenset({F.hardswish, aten.hardswish.default, aten.hardswish_.default}),
    "softplus": frozenset({F.softplus, aten.softplus.default}),
}
_ACTIVATION_BY_FUNCTION = {fn: name for name, fns in _ACTIVATION_FUNCTIONS.items() for fn in fns}
_ACTIVATION_BY_METHOD = {
    "relu": RELU, "relu_": RELU, "sigmoid": "sigmoid", "sigmoid_": "sigmoid", "tanh": "tanh", "tanh_": "tanh",
}
_ACTIVATION_BY_MODULE: tuple[tuple[type[nn.Module], str], ...] = (
    (nn.ReLU, RELU),
    (nn.SiLU, "silu"),
    (nn.GELU, "gelu"),
    (nn.Sigmoid, "sigmoid"),
    (nn.Tanh, "tanh"),
    (nn.Mish, "mish"),
    (nn.LeakyReLU, "leaky_relu"),
    (nn.ELU, "elu"),
    (nn.ReLU6, "relu6"),
    (nn.Hardswish, "hardswish"),
    (nn.Softplus, "softplus"),
)

# Mutating builtins that carry no trailing underscore (x += y on tensors is in place).
_INPLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
    operator.imatmul, operator.setitem,
})


# ---------------------------------------------------------------------------------------------------
# Argument access
# ---------------------------------------------------------------------------------------------------

_MISSING = object()


def get_arg(node: fx.Node, index: int, name: str, default: Any = _MISSING) -> Any:
    """The argument at ``index`` or keyword ``name``; ``default`` (or KeyError) when absent."""
    if index < len(node.args):
        return node.args[index]
    if name in node.kwargs:
        return node.kwargs[name]
    if default is _MISSING:
        raise KeyError(f"{node.name} has no argument {name!r}")
    return default


def first_input(node: fx.Node) -> Any:
    """The first positional argument (the tensor a unary call or method acts on), or None."""
    if node.args:
        return node.args[0]
    return next(iter(node.kwargs.values()), None) if node.op in ("call_function", "call_module") else None


def get_module(gm: fx.GraphModule | None, target: str) -> nn.Module | None:
    if gm is None:
        return None
    try:
        return gm.get_submodule(target)
    except AttributeError:
        return None


def get_attr_value(gm: fx.GraphModule | None, target: str) -> Any:
    """The object a ``get_attr`` target names (parameter, buffer or constant), or None."""
    if gm is None:
        return None
    obj: Any = gm
    for atom in target.split("."):
        obj = getattr(obj, atom, None)
        if obj is None:
            return None
    return obj


def has_plain_forward(module: nn.Module, base: type[nn.Module]) -> bool:
    """``module`` is a ``base`` whose forward is not overridden and that no hook wraps (so a call of it
    computes what ``base`` does; a rewrite that reads its weights directly would skip the hooks)."""
    return (isinstance(module, base) and type(module).forward is base.forward and not _hooked(module))


def _hooked(module: nn.Module) -> bool:
    from torch.nn.modules import module as module_globals

    own = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
           getattr(module, "_backward_pre_hooks", None))
    shared = (module_globals._global_forward_hooks, module_globals._global_forward_pre_hooks,
              module_globals._global_backward_hooks, getattr(module_globals, "_global_backward_pre_hooks", None))
    return any(bool(hooks) for hooks in (*own, *shared))


# ---------------------------------------------------------------------------------------------------
# Op classification
# ---------------------------------------------------------------------------------------------------


def is_call(node: Any, functions: frozenset, methods: frozenset = frozenset()) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in functions
    if node.op == "call_method":
        return node.target in methods
    return False


def is_view(node: Any) -> bool:
    """A reshape (``Tensor.view(dtype)``, a reinterpretation of the bits, is none)."""
    if not is_call(node, VIEW_FUNCTIONS, VIEW_METHODS):
        return False
    return "dtype" not in node.kwargs and not any(isinstance(arg, torch.dtype) for arg in node.args[1:])


# (input, p, training) positionally in each; F.dropout's training defaults to True, so it must be given.
_DROPOUT_FUNCTIONS = frozenset({F.dropout, torch.dropout, aten.dropout.default})


def is_identity_dropout(node: Any) -> bool:
    """A dropout call that returns its input unchanged: training ``False`` or ``p`` 0, as literals.

    Dynamo and export bake the module's ``training`` flag into the graph (they guard on it), so in an
    eval-mode graph ``F.dropout(t, 0.1, False)`` is the identity. An ``nn.Dropout`` call_module of a
    symbolic_trace graph is not: the module may be put back in training mode after the rewrite.
    """
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in _DROPOUT_FUNCTIONS):
        return False
    if _inplace_flag(node) or set(node.kwargs) - {"p", "training", "train", "inplace"}:
        return False
    p = get_arg(node, 1, "p", 0.5)
    training = get_arg(node, 2, "train" if node.target is not F.dropout else "training", True)
    return training is False or (type(p) in (int, float) and p == 0)


_COPY_FUNCTIONS = frozenset({aten.clone.default, torch.clone})
_COPY_METHODS = frozenset({"clone", "contiguous"})


def is_value_identity(node: Any) -> bool:
    """A call whose result holds its input's values: an identity dropout, or a copy (``clone``,
    ``contiguous``; ``run_decompositions`` turns an eval-mode dropout into ``aten.clone``)."""
    return is_identity_dropout(node) or is_call(node, _COPY_FUNCTIONS, _COPY_METHODS)


def _is_zero_literal(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def is_clamp_relu(node: fx.Node) -> bool:
    """``node`` is ReLU spelled as a clamp (``clamp(t, min=0)``, ``clamp_min(t, 0)``, ``clip``): the same
    values, but a gradient of 1 at exactly 0 where relu's is 0."""
    return bool(_clamp_is_relu(node))


def is_inplace_call(node: fx.Node) -> bool:
    """``relu_``, ``clamp_``, ``F.relu(t, inplace=True)``, ...: a call that writes into its input."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        name = node.target._schema.name.split("::")[-1]
    return _inplace_name(name) or _inplace_flag(node)


def _inplace_name(name: object) -> bool:
    """PyTorch's naming of in-place calls: a trailing ``_`` (private ones too: ``torch._foreach_add_``,
    ``torch._fused_adam_``), not a dunder's."""
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def _clamp_is_relu(node: fx.Node) -> bool | None:
    """None when ``node`` is no clamp; else whether it is ``clamp(t, min=0)`` (no max, nothing else)."""
    if is_call(node, _CLAMP_MIN_FUNCTIONS, _CLAMP_MIN_METHODS):
        allowed, bounds = {"input", "min"}, (get_arg(node, 1, "min", None), None)
        positional = 2
    elif is_call(node, _CLAMP_FUNCTIONS, _CLAMP_METHODS):
        allowed, bounds = {"input", "min", "max"}, (get_arg(node, 1, "min", None), get_arg(node, 2, "max", None))
        positional = 3
    else:
        return None
    return (not set(node.kwargs) - allowed and len(node.args) <= positional
            and _is_zero_literal(bounds[0]) and bounds[1] is None)


def activation_name(node: fx.Node, gm: fx.GraphModule | None) -> str | None:
    """``"relu"``, ``"silu"``, ``"gelu"``, ... when ``node`` applies a known elementwise activation
    (a clamp is ``"relu"`` where it computes one, else ``"clamp"``)."""
    clamp = _clamp_is_relu(node)
    if clamp is not None:
        return RELU if clamp else "clamp"
    if node.op == "call_function":
        return _ACTIVATION_BY_FUNCTION.get(node.target)
    if node.op == "call_method":
        return _ACTIVATION_BY_METHOD.get(node.target)
    if node.op == "call_module":
        module = get_module(gm, node.target)
        if module is None:
            return None
        for cls, name in _ACTIVATION_BY_MODULE:
            if has_plain_forward(module, cls):
                return name
        # e.g. transformers' GELUActivation: named so near-misses read well, never matched as ReLU.
        cls_name = type(module).__name__
        if cls_name.endswith("Activation"):
            return cls_name[: -len("Activation")].lower() or cls_name
    return None


def is_relu(node: fx.Node, gm: fx.GraphModule | None) -> bool:
    """Any spelling of ReLU, in place or not. Extra arguments other than ``inplace`` rule it out."""
    clamp = _clamp_is_relu(node)
    if clamp is not None:
        return clamp
    if activation_name(node, gm) != RELU:
        return False
    extra = set(node.kwargs) - {"input", "inplace"}
    return not extra and len(node.args) <= 2


_INPLACE_DUNDER_METHODS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imatmul__",
})


@functools.cache
def _inplace_position(target: Any) -> int | None:
    """Where a Python function such as ``F.relu`` or ``F.dropout`` takes ``inplace`` positionally."""
    try:
        params = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("inplace") if "inplace" in params else None


def _inplace_flag(node: fx.Node) -> bool:
    if node.kwargs.get("inplace") is True:
        return True
    try:
        position = _inplace_position(node.target)
    except TypeError:  # unhashable target
        return False
    return position is not None and position < len(node.args) and node.args[position] is True


# Calls Dynamo records where a torch.func grad or jvp transform, or a forward-mode AD level, begins and
# ends. The twell ops' autograd supports neither (it is a reverse-mode autograd.Function without a jvp),
# so blocks between them are left alone. (vmap runs the ops through its per-sample fallback.)
_TRANSFORM_BEGINS = frozenset({"_grad_increment_nesting", "_jvp_increment_nesting", "_enter_dual_level"})
_TRANSFORM_ENDS = frozenset({"_grad_decrement_nesting", "_jvp_decrement_nesting", "_exit_dual_level"})


def nodes_inside_autodiff_transforms(graph: fx.Graph) -> set[fx.Node]:
    """The nodes that run inside a torch.func grad or jvp transform or a forward-mode AD level."""
    inside: set[fx.Node] = set()
    depth = 0
    for node in graph.nodes:
        name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        if name in _TRANSFORM_BEGINS:
            depth += 1
        elif name in _TRANSFORM_ENDS:
            depth = max(depth - 1, 0)
        elif depth:
            inside.add(node)
    return inside


def may_mutate(node: fx.Node, gm: fx.GraphModule | None) -> bool:
    """Conservatively: could running ``node`` change a tensor or global state another node reads?"""
    if node.op == "call_function":
        target = node.target
        if target in _INPLACE_OPERATORS or target in _side_effectful_functions:
            return True
        schema = getattr(target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
        if node.kwargs.get("out") is not None or _inplace_flag(node):
            return True
        return _inplace_name(getattr(target, "__name__", ""))
    if node.op == "call_method":
        name = node.target
        return (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_DUNDER_METHODS
    if node.op == "call_module":
        module = get_module(gm, node.target)
        if module is None:
            return True
        if getattr(module, "inplace", False):
            return True
        # torch.nn's own modules do not mutate their inputs (beyond ``inplace``); user leaves might.
        return not type(module).__module__.startswith("torch.nn.")
    return False


# ---------------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------------


def node_tensor_meta(node: fx.Node) -> Any:
    """What is known of the tensor ``node`` produces: an object with ``.shape`` and ``.dtype``, or None.

    Dynamo graphs store a fake tensor in ``meta['example_value']``, export/make_fx graphs in
    ``meta['val']``, ShapeProp in ``meta['tensor_meta']``; a ``get_attr`` node is read from its module.
    """
    for key in ("val", "example_value", "tensor_meta"):
        value = node.meta.get(key)
        if value is not None and hasattr(value, "shape") and hasattr(value, "dtype"):
            return value
    if node.op == "get_attr":
        value = get_attr_value(node.graph.owning_module, node.target)
        if isinstance(value, torch.Tensor):
            return value
    return None


def node_shape(node: Any) -> tuple | None:
    if not isinstance(node, fx.Node):
        return None
    meta = node_tensor_meta(node)
    return tuple(meta.shape) if meta is not None else None


def node_dtype(node: Any) -> torch.dtype | None:
    if not isinstance(node, fx.Node):
        return None
    meta = node_tensor_meta(node)
    return meta.dtype if meta is not None else None


def sizes_equal(a: Any, b: Any) -> bool:
    """True only when ``a == b`` is provable; symbolic sizes are compared without adding guards."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return bool(statically_known_true(a == b))


def shapes_equal(a: Sequence | None, b: Sequence | None) -> bool:
    if a is None or b is None or len(a) != len(b):
        return False
    return all(sizes_equal(x, y) for x, y in zip(a, b))


def format_shape(shape: Sequence | None) -> str:
    return "unknown" if shape is None else "[" + ", ".join(str(s) for s in shape) + "]"


# ---------------------------------------------------------------------------------------------------
# Module paths
# ---------------------------------------------------------------------------------------------------

# The traced root: ``L['self']``, or ``L['args'][0]`` where Dynamo enters the forward through a
# decorator's ``*args`` wrapper (Hugging Face transformers 5.24's Llama forward, for one).
# (The dot after it stays, so that a first ``._modules['name']`` is rewritten like the others.)
_DYNAMO_ROOT = re.compile(r"^L\['(?:args|kwargs)'\]\[[^\]]*\]|^L\['[^']*'\]|^L__self__")
_DYNAMO_MODULES = re.compile(r"\._modules\['([^']*)'\]")
_INDEX = re.compile(r"\[(\d+)\]")


def clean_module_path(path: str) -> str:
    """``L['self'].model.layers[0].mlp`` (or ``L['args'][0].model...``) -> ``model.layers.0.mlp`` (export
    paths pass through)."""
    path = _DYNAMO_ROOT.sub("", path)
    path = _DYNAMO_MODULES.sub(r".\1", path)
    return _INDEX.sub(r".\1", path).strip(".")


def stack_entry_path(entry: Any) -> str:
    """The cleaned module path of one ``nn_module_stack`` value (``(path, type)`` or a bare path)."""
    path = entry[0] if isinstance(entry, tuple) else entry
    return clean_module_path(str(path))


def module_stack(node: fx.Node) -> list[str]:
    """The cleaned module paths ``node`` was traced inside, outermost first ([] when unknown)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return []
    return [p for p in map(stack_entry_path, stack.values()) if p]


def common_module_path(paths: Iterable[str]) -> str:
    """The longest dotted prefix shared by all ``paths`` (``""`` when none)."""
    split = [p.split(".") for p in paths]
    if not split:
        return ""
    common = split[0]
    for parts in split[1:]:
        n = 0
        while n < min(len(common), len(parts)) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    return ".".join(common)


# ---------------------------------------------------------------------------------------------------
# Formatting nodes as Python-like code (for reports)
# ---------------------------------------------------------------------------------------------------


def target_name(target: Any) -> str:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"torch.ops.{target}"
    if isinstance(target, str):
        return target
    try:
        name = fx.node._get_qualified_name(target)
    except Exception:  # noqa: BLE001 - any callable without a qualified name still gets printed
        return getattr(target, "__name__", repr(target))
    return name.replace("_operator.", "operator.", 1) if name.startswith("_operator.") else name


def _format_arg(arg: Any) -> str:
    if isinstance(arg, fx.Node):
        return arg.name
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_format_arg(a) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner}{',' if len(arg) == 1 else ''})"
    if isinstance(arg, dict):
        return "{" + ", ".join(f"{k!r}: {_format_arg(v)}" for k, v in arg.items()) + "}"
    return repr(arg)


def _format_call_args(args: Sequence, kwargs: dict) -> str:
    parts = [_format_arg(a) for a in args] + [f"{k}={_format_arg(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def format_node_code(node: fx.Node) -> str:
    """One line of Python-like code for ``node``, e.g. ``relu = torch.relu(linear)``."""
    if node.op == "call_function":
        return f"{node.name} = {target_name(node.target)}({_format_call_args(node.args, node.kwargs)})"
    if node.op == "call_method":
        self_arg, *rest = node.args
        return f"{node.name} = {_format_arg(self_arg)}.{node.target}({_format_call_args(rest, node.kwargs)})"
    if node.op == "call_module":
        return f"{node.name} = self.{node.target}({_format_call_args(node.args, node.kwargs)})"
    if node.op == "get_attr":
        return f"{node.name} = self.{node.target}"
    if node.op == "placeholder":
        return f"{node.name} = <input {node.target}>"
    return f"return {_format_arg(node.args[0] if node.args else None)}"


def format_nodes_code(nodes: Iterable[fx.Node]) -> str:
    return "\n".join(format_node_code(n) for n in nodes)


# ---------------------------------------------------------------------------------------------------
# Reshape chains
# ---------------------------------------------------------------------------------------------------


def skip_identity_views(node: fx.Node, max_depth: int = 4) -> tuple[fx.Node, tuple[fx.Node, ...]]:
    """Looks through reshapes that end at the shape they started from, identity dropouts and copies.

    Functionalized in-place ops leave such round trips behind (``relu_`` on a 3-D tensor becomes
    ``view(view(relu(t), [N, F]), [B, S, F])`` after ``run_decompositions``), and eval-mode models
    their dropouts (T5's MLP: ``wo(dropout(relu(wi(x))))``), or copies (``is_value_identity``). Returns the
    deepest node with ``node``'s shape and value, and the nodes skipped (outermost first); reshapes
    need shape metadata.
    """
    shape = node_shape(node)
    best: tuple[fx.Node, tuple[fx.Node, ...]] = (node, ())
    chain: list[fx.Node] = []
    current = node
    only_identities = True  # so far: the value is node's whatever the shapes say
    for _ in range(max_depth):
        if is_view(current) and shape is not None:
            only_identities = False
        elif not is_value_identity(current):
            break
        source = first_input(current)
        if not isinstance(source, fx.Node):
            break
        chain.append(current)
        current = source
        if only_identities or shapes_equal(node_shape(current), shape):
            best = (current, tuple(chain))
    return best
