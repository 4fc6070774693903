"""Input checks shared by the real kernels and the fake (meta) kernels of the twell ops.

Running them in the fake kernel means a bad call fails when the graph is traced, with a message that
names the argument, instead of deep inside a GEMM. Size checks go through ``torch._check`` when sizes
are symbolic, so dynamic-shape tracing records them without adding guards.

The device kernels run on real tensors, where every size is an int, once per eager call: they use
``fast_check_gated`` / ``fast_check_non_gated``, one pass of plain comparisons that falls back to the
full check (which names the problem) only when something is off. At decode sizes an eager call is paced
by the host, and the full check, a call and a closure per condition, cost about as much as the rest of
the op's Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _require(cond, message: Callable[[], str]) -> None:
    """``message`` is only built on failure: these checks run on every call, in the hot path."""
    if isinstance(cond, bool):
        if not cond:
            raise ValueError(message())
    else:  # SymBool under dynamic shapes
        torch._check(cond, message)


def check_mlp_inputs(
    op_name: str,
    x: Tensor,
    weights: Sequence[tuple[str, Tensor]],
    biases: Sequence[tuple[str, Tensor | None]],
) -> None:
    """Checks dtypes, devices and shapes of an MLP op call.

    ``weights`` is ``[(name, tensor), ...]`` in nn.Linear layout ``[out_features, in_features]``,
    chained: the first reads ``x``'s last dim, and for the gated op the first two (gate and up) are
    parallel. ``biases`` pairs each bias with the weight of the same index (None where absent).
    """
    prefix = f"twell.{op_name}:"
    _require(x.dim() >= 1, lambda: f"{prefix} x must have at least one dimension, got a 0-d tensor")
    _require(
        x.dtype in SUPPORTED_DTYPES,
        lambda: f"{prefix} x has dtype {x.dtype}; supported dtypes are float32, float16, bfloat16 and float64",
    )
    for name, t in [*weights, *((n, b) for n, b in biases if b is not None)]:
        _require(
            t.dtype == x.dtype,
            lambda name=name, t=t: f"{prefix} {name} has dtype {t.dtype} but x has dtype {x.dtype}; all inputs must share one "
            f"dtype (cast them, or run under torch.autocast)",
        )
        _require(
            t.device == x.device,
            lambda name=name, t=t: f"{prefix} {name} is on device {t.device} but x is on {x.device}; all inputs must be on one device",
        )
    for name, w in weights:
        _require(w.dim() == 2, lambda name=name, w=w: f"{prefix} {name} must be 2-D [out_features, in_features], got shape {tuple(w.shape)}")
    for (name, b), (wname, w) in zip(biases, weights):
        if b is not None:
            _require(b.dim() == 1, lambda name=name, b=b: f"{prefix} {name} must be 1-D, got shape {tuple(b.shape)}")
            _require(
                b.shape[0] == w.shape[0],
                lambda name=name, b=b, wname=wname, w=w: f"{prefix} {name} has {b.shape[0]} elements but {wname} has {w.shape[0]} output features",
            )


def check_gated(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias) -> None:
    name = "gated_relu_mlp"
    check_mlp_inputs(
        name,
        x,
        [("gate_weight", gate_weight), ("up_weight", up_weight), ("down_weight", down_weight)],
        [("gate_bias", gate_bias), ("up_bias", up_bias), ("down_bias", down_bias)],
    )
    _require(
        gate_weight.shape == up_weight.shape,
        lambda: f"twell.{name}: gate_weight {tuple(gate_weight.shape)} and up_weight {tuple(up_weight.shape)} "
        f"must have the same shape [intermediate, hidden]",
    )
    _require(
        x.shape[-1] == gate_weight.shape[1],
        lambda: f"twell.{name}: x has {x.shape[-1]} features in its last dim but gate_weight expects "
        f"{gate_weight.shape[1]} (gate_weight shape {tuple(gate_weight.shape)})",
    )
    _require(
        down_weight.shape[1] == gate_weight.shape[0],
        lambda: f"twell.{name}: down_weight {tuple(down_weight.shape)} must take {gate_weight.shape[0]} input "
        f"features, the intermediate size of gate_weight",
    )


def check_non_gated(x, up_weight, down_weight, up_bias, down_bias) -> None:
    name = "relu_mlp"
    check_mlp_inputs(
        name,
        x,
        [("up_weight", up_weight), ("down_weight", down_weight)],
        [("up_bias", up_bias), ("down_bias", down_bias)],
    )
    _require(
        x.shape[-1] == up_weight.shape[1],
        lambda: f"twell.{name}: x has {x.shape[-1]} features in its last dim but up_weight expects "
        f"{up_weight.shape[1]} (up_weight shape {tuple(up_weight.shape)})",
    )
    _require(
        down_weight.shape[1] == up_weight.shape[0],
        lambda: f"twell.{name}: down_weight {tuple(down_weight.shape)} must take {up_weight.shape[0]} input "
        f"features, the intermediate size of up_weight",
    )


# ---------------------------------------------------------------------------------------------------
# the device kernels' fast path: concrete sizes only (never call these on fake or symbolic tensors)
# ---------------------------------------------------------------------------------------------------


def _bias_ok(b: Tensor, n: int, dtype: torch.dtype, device: torch.device) -> bool:
    return b.dim() == 1 and b.shape[0] == n and b.dtype is dtype and b.device == device


def _non_gated_ok(x, up_weight, down_weight, up_bias, down_bias) -> bool:
    """True only where ``check_non_gated`` passes (it may be stricter, never looser)."""
    dtype, device = x.dtype, x.device
    if not (dtype in SUPPORTED_DTYPES and x.dim() >= 1 and up_weight.dim() == 2 and down_weight.dim() == 2):
        return False
    f, k = up_weight.shape
    return (
        down_weight.shape[1] == f and x.shape[-1] == k
        and up_weight.dtype is dtype and down_weight.dtype is dtype
        and up_weight.device == device and down_weight.device == device
        and (up_bias is None or _bias_ok(up_bias, f, dtype, device))
        and (down_bias is None or _bias_ok(down_bias, down_weight.shape[0], dtype, device))
    )


def _gated_ok(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias) -> bool:
    """True only where ``check_gated`` passes (it may be stricter, never looser): the non-gated op's
    conditions with the gate as its activated projection, and an up projection just like the gate."""
    return (
        _non_gated_ok(x, gate_weight, down_weight, gate_bias, down_bias)
        and up_weight.shape == gate_weight.shape and up_weight.dtype is x.dtype and up_weight.device == x.device
        and (up_bias is None or _bias_ok(up_bias, gate_weight.shape[0], x.dtype, x.device))
    )


def fast_check_gated(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias) -> None:
    """``check_gated`` for real tensors: the same errors, at a fraction of the host time when none."""
    if not _gated_ok(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias):
        check_gated(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)


def fast_check_non_gated(x, up_weight, down_weight, up_bias, down_bias) -> None:
    """``check_non_gated`` for real tensors: the same errors, at a fraction of the host time when none."""
    if not _non_gated_ok(x, up_weight, down_weight, up_bias, down_bias):
        check_non_gated(x, up_weight, down_weight, up_bias, down_bias)
