"""The ``torch.ops.twell`` operators: schemas, fake kernels, autograd and autocast rules.

Two functional ops (no mutation, outputs never alias inputs):

* ``twell::gated_relu_mlp(x, gate_weight, up_weight, down_weight, gate_bias?, up_bias?, down_bias?)``
  computes ``down(relu(gate(x)) * up(x))``;
* ``twell::relu_mlp(x, up_weight, down_weight, up_bias?, down_bias?)`` computes ``down(relu(up(x)))``.

Weights and biases are taken exactly as ``nn.Linear`` stores them, so the FX pass can hand the model's
own parameters to the op. Every device runs the plain-PyTorch reference (``reference.py``) unless a
device-specific kernel is registered below; CUDA goes through ``kernels.cuda_*``, the seam where the
TwELL kernels plug in.

The ops are defined with ``torch.library.Library`` and registered key by key (device kernels, fake
kernel, autograd), as ``torch.library.custom_op`` would register them, but without its per-call Python
wrapper around the device kernel (keyword handling, an aliasing check of every result): at decode sizes
an eager call is paced by the host, and that wrapper cost 2-3 us a call on a CPU
(``examples/bench_host_time.py --cpu``). What it checked is tested instead (fresh outputs, opcheck).
For the same reason the Autograd key's kernel (``autograd_kernel.py``) calls the device kernel directly
when no gradient is needed, where ``register_autograd``'s would redispatch to it, and the CUDA kernel
offers each call to its layer's lease first (``kernels/leases.py``): a repeat call of one size then runs
in C++ with no more Python than this module's frame.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from . import kernels, reference, stats
from .kernels import leases
from .autograd_kernel import register_autograd_kernel
from .validation import check_gated, check_non_gated, fast_check_gated, fast_check_non_gated

_LIB = torch.library.Library("twell", "DEF")


def _define(schema: str, reference_kernel, cuda_kernel, fake_kernel, backward, setup_context) -> torch._ops.OpOverload:
    """Defines ``twell::<schema>`` with a reference kernel for every device, a CUDA kernel, a fake kernel
    and an autograd formula. The device kernels are hidden from Dynamo (as custom_op hides them), so an
    eager call inside a compiled region never gets traced into."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
    _LIB.impl(name, torch._disable_dynamo(reference_kernel), "CompositeExplicitAutograd")
    _LIB.impl(name, torch._disable_dynamo(cuda_kernel), "CUDA")
    torch.library.register_fake(f"twell::{name}", fake_kernel, lib=_LIB)
    op = getattr(torch.ops.twell, name).default
    register_autograd_kernel(_LIB, op, backward, setup_context,
                             {torch._C.DispatchKey.CPU: reference_kernel, torch._C.DispatchKey.CUDA: cuda_kernel})
    return op


def _padded_needs(ctx, n_inputs: int) -> tuple[bool, ...]:
    # needs_input_grad only covers the arguments actually passed; omitted optional biases need none.
    needs = tuple(ctx.needs_input_grad)
    return needs + (False,) * (n_inputs - len(needs))


# ---------------------------------------------------------------------------------------------------
# gated: down(relu(gate(x)) * up(x))
# ---------------------------------------------------------------------------------------------------


def _gated_reference(x, gate_weight, up_weight, down_weight, gate_bias=None, up_bias=None, down_bias=None):
    fast_check_gated(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)
    return kernels.reference_gated_relu_mlp(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)


def _gated_cuda(x, gate_weight, up_weight, down_weight, gate_bias=None, up_bias=None, down_bias=None):
    fast = leases.FAST_MLP  # a repeat call its layer's lease covers runs in C++ (kernels/leases.py)
    if fast is not None and stats.active_recorder() is None:
        out = fast(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias)
        if out is not None:
            return out
    fast_check_gated(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)
    return kernels.cuda_gated_relu_mlp(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)


def _gated_fake(x, gate_weight, up_weight, down_weight, gate_bias=None, up_bias=None, down_bias=None):
    check_gated(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)
    return x.new_empty((*x.shape[:-1], down_weight.shape[0]))


def _gated_setup_context(ctx, inputs, output):
    x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias = inputs
    # Only inputs are saved; the backward recomputes gate and up (see reference.gated_relu_mlp_backward).
    ctx.save_for_backward(x, gate_weight, up_weight, down_weight, gate_bias, up_bias)


def _gated_backward(ctx, grad_out):
    x, gate_weight, up_weight, down_weight, gate_bias, up_bias = ctx.saved_tensors
    needs = _padded_needs(ctx, 7)
    grads = reference.gated_relu_mlp_backward(
        grad_out, x, gate_weight, up_weight, down_weight, gate_bias, up_bias, needs
    )
    return grads[: len(ctx.needs_input_grad)]


gated_relu_mlp = _define(
    "gated_relu_mlp(Tensor x, Tensor gate_weight, Tensor up_weight, Tensor down_weight, Tensor? gate_bias=None, "
    "Tensor? up_bias=None, Tensor? down_bias=None) -> Tensor",
    _gated_reference, _gated_cuda, _gated_fake, _gated_backward, _gated_setup_context,
)


# ---------------------------------------------------------------------------------------------------
# non-gated: down(relu(up(x)))
# ---------------------------------------------------------------------------------------------------


def _relu_reference(x, up_weight, down_weight, up_bias=None, down_bias=None):
    fast_check_non_gated(x, up_weight, down_weight, up_bias, down_bias)
    return kernels.reference_relu_mlp(x, up_weight, down_weight, up_bias, down_bias)


def _relu_cuda(x, up_weight, down_weight, up_bias=None, down_bias=None):
    fast = leases.FAST_MLP
    if fast is not None and stats.active_recorder() is None:
        out = fast(x, up_weight, up_bias, None, None, down_weight, down_bias)
        if out is not None:
            return out
    fast_check_non_gated(x, up_weight, down_weight, up_bias, down_bias)
    return kernels.cuda_relu_mlp(x, up_weight, down_weight, up_bias, down_bias)


def _relu_fake(x, up_weight, down_weight, up_bias=None, down_bias=None):
    check_non_gated(x, up_weight, down_weight, up_bias, down_bias)
    return x.new_empty((*x.shape[:-1], down_weight.shape[0]))


def _relu_setup_context(ctx, inputs, output):
    x, up_weight, down_weight, up_bias, down_bias = inputs
    ctx.save_for_backward(x, up_weight, down_weight, up_bias)


def _relu_backward(ctx, grad_out):
    x, up_weight, down_weight, up_bias = ctx.saved_tensors
    grads = reference.relu_mlp_backward(grad_out, x, up_weight, down_weight, up_bias, _padded_needs(ctx, 5))
    return grads[: len(ctx.needs_input_grad)]


relu_mlp = _define(
    "relu_mlp(Tensor x, Tensor up_weight, Tensor down_weight, Tensor? up_bias=None, Tensor? down_bias=None) -> Tensor",
    _relu_reference, _relu_cuda, _relu_fake, _relu_backward, _relu_setup_context,
)


# ---------------------------------------------------------------------------------------------------
# autocast: behave like the nn.Linear calls the op replaced
# ---------------------------------------------------------------------------------------------------


def note_weight_casts(weights, dtype: torch.dtype, device_type: str) -> None:
    """Warns once where autocast casts a CUDA call's weights: each call then gets new weight tensors, so
    nothing the kernels keep per weight (re-laid copies, density routes, leases) carries over to the
    layer's next call, and every call casts (and re-lays) its weights again."""
    if device_type == "cuda" and any(
            isinstance(w, Tensor) and w.is_floating_point() and w.dtype not in (dtype, torch.float64) for w in weights):
        _warn_weight_casts_once()


@functools.cache
def _warn_weight_casts_once() -> None:
    warnings.warn("twell: under torch.autocast the MLP weights are cast on every call, as nn.Linear's are, so "
                  "the TwELL kernels' per-weight state (re-laid weight copies, routing by density, leases) "
                  "cannot follow a layer from one call to the next; for full speed, cast the model itself "
                  "(model.to(torch.bfloat16)).", RuntimeWarning, stacklevel=3)


def _register_autocast_like_linear(op: torch._ops.OpOverload, device_type: str) -> None:
    """Casts floating inputs to the *current* autocast dtype, as autocast does for ``linear``.

    ``torch.library.register_autocast`` fixes one dtype at registration; autocast regions choose
    theirs (bfloat16 or float16) at run time, so the dtype is read when the op is called. float64
    inputs are left alone, as autocast leaves them for linear.
    """
    autocast_key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    dispatch_key = getattr(torch._C.DispatchKey, autocast_key)

    def cast(arg):
        if isinstance(arg, Tensor) and arg.is_floating_point() and arg.dtype != torch.float64:
            return arg.to(torch.get_autocast_dtype(device_type))
        return arg

    def call_without_autocast(*args, **kwargs):
        note_weight_casts(args[1:], torch.get_autocast_dtype(device_type), device_type)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(dispatch_key)):
            return op(*(cast(a) for a in args), **{k: cast(v) for k, v in kwargs.items()})

    # Python dispatcher (used while AOTAutograd/make_fx trace) and the C++ dispatcher (eager).
    op.py_impl(dispatch_key)(call_without_autocast)
    _LIB.impl(op._schema.name.split("::")[1], lambda _ks, *args: call_without_autocast(*args),
              autocast_key, with_keyset=True)


for _op in (gated_relu_mlp, relu_mlp):
    for _device_type in ("cpu", "cuda"):
        _register_autocast_like_linear(_op, _device_type)
