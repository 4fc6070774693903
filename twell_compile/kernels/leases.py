"""Leases: a layer's repeat calls of one size served in C++ (``csrc/twell_fast_call.cpp``).

At decode sizes without CUDA graphs (torch.compile's default mode, or eager) the host sets the pace, and
the op's Python between the dispatcher and the kernels (checks, the per-shape plan, the density router,
the weight caches) cost more host time than Inductor's whole dense MLP (H200: 109-135 us a layer under
cProfile against about 68; examples/results/README.md, "Decoding without CUDA graphs"). A layer's calls of
one size make the same choices each time, so after a call has taken the Python path
(``twell_mlp.twell_mlp``) it may grant its layer a lease: that call's plan, its route (TwELL or cuBLAS)
and W_down^T as the weight cache made it, for a number of calls: no limit where the density router does
not watch the size, else until the router's next report is due (``DensityRouter.lease_calls``). Every
call on the Python path first ends its layer's lease (``end``) and adds the calls it served to the
router's count: the router counted that call too, and may route the layer otherwise after it, so no
lease outlives a call it did not serve. The op's
CUDA kernel (``ops.py``) first offers each call to ``FAST_MLP``, which serves it when every operand is the
one the lease was granted for (data, sizes, strides, dtype, device; the weights alive, W_down's version
unchanged), on the granting stream, outside graph capture, and returns None otherwise; calls under a
sparsity recorder are not offered. The two ways give the same bits.

Whatever a lease was derived from may change, and then leases are revoked: the settings
(``twell_mlp.config``), the router's state (a layer's lease when it reports, all when it is cleared), the
weight caches (when cleared). ``config.fast_calls`` (``TWELL_FAST_CALLS=0``) grants none.

Nothing here builds the extension: leases exist only once a call has run the kernels.
"""

from __future__ import annotations

from torch import Tensor

UNLIMITED = 2**62
"""The calls a lease may serve where nothing limits them."""

FAST_MLP = None
"""The extension's ``fast_mlp`` once a lease has been granted in this process, else None."""

_ext = None


def grant(x2: Tensor, act_weight: Tensor, act_bias: Tensor | None, up_weight: Tensor | None,
          up_bias: Tensor | None, down_weight: Tensor, down_bias: Tensor | None, cuda_plan, down_t: Tensor | None,
          calls: int, tag: int = -1) -> bool:
    """Grants the layer of ``act_weight`` a lease for ``calls`` more calls shaped like this one: the TwELL
    path with ``cuda_plan`` (the extension's ``MlpPlan``, not chunked) and ``down_t``, or the cuBLAS route
    where both are None. The calls it serves are counted under ``tag`` (``end``). Whether it was
    granted (never while a graph is captured, nor for inference-tensor weights)."""
    global FAST_MLP, _ext
    if _ext is None:
        from . import build

        _ext = build.cuda_extension()
        FAST_MLP = _ext.fast_mlp
    return _ext.grant_lease(x2, act_weight, act_bias, up_weight, up_bias, down_weight, down_bias, cuda_plan, down_t,
                            calls, tag)


def end(act_weight: Tensor) -> tuple[int, int]:
    """Ends the lease of ``act_weight``'s layer: (tag, calls it served), (-1, 0) where it has none."""
    return (-1, 0) if _ext is None else _ext.end_lease(act_weight)


def revoke(act_weight: Tensor) -> None:
    """Drops the lease of ``act_weight``'s layer, if any."""
    if _ext is not None:
        _ext.revoke_lease(act_weight)


def revoke_all() -> None:
    """Drops every lease."""
    if _ext is not None:
        _ext.revoke_all_leases()


def calls_left(act_weight: Tensor) -> int:
    """How many calls the lease of ``act_weight``'s layer may still serve; -1 where it has none."""
    return -1 if _ext is None else _ext.lease_calls_left(act_weight)
