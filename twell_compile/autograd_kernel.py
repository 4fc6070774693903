"""The twell ops' kernel at the Autograd dispatch key.

``torch.library.register_autograd`` registers a Python kernel there that, for a call that needs no
gradient (inference, ``torch.no_grad``), redispatches below autograd: a second trip through the C++
dispatcher into the device kernel's Python function, boxing every argument again, under two more
Python frames and a Dynamo guard. At decode sizes an eager call is paced by the host, and that trip was
a sizeable share of the op's host time (``examples/bench_host_time.py``). This kernel calls the device
kernel directly where the redispatch would reach it with nothing in between: the only key left below
autograd is the device's own (CPU, CUDA). Anything else there (the Python key of fake tensors,
dispatch modes and tensor subclasses; Meta; functionalization) takes the redispatch, and a call that
needs gradients runs an autograd.Function that does what ``register_autograd``'s does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_AFTER_AUTOGRAD = torch._C._after_autograd_keyset


def register_autograd_kernel(lib: torch.library.Library, op: torch._ops.OpOverload, backward: Callable,
                             setup_context: Callable, direct_kernels: dict[torch._C.DispatchKey, Callable]) -> None:
    """Registers ``op``'s Autograd kernel in ``lib``.

    ``setup_context(ctx, inputs, output)`` gets every schema argument (omitted optional ones as None),
    ``backward(ctx, grad_out)`` returns one gradient per argument passed, and ``direct_kernels`` maps a
    backend dispatch key to the kernel registered for it (the same function, undecorated), which a call
    needing no gradient may run directly. Every optional argument of ``op`` must default to None.
    """
    n_arguments = len(op._schema.arguments)
    # Keyed by the whole keyset left below autograd, which must be the backend's key alone (a raw
    # integer: hashing DispatchKey enums costs a microsecond a call).
    direct = {torch._C.DispatchKeySet(key).raw_repr(): kernel for key, kernel in direct_kernels.items()}

    def redispatch(keyset: torch._C.DispatchKeySet, args: tuple):
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & _AFTER_AUTOGRAD, *args)

    class Forward(torch.autograd.Function):
        # The keyset rides as the last argument, as in register_autograd's function; it takes no gradient.
        @staticmethod
        def forward(ctx, *args_and_keyset):
            *args, keyset = args_and_keyset
            output = redispatch(keyset, tuple(args))
            # The dispatcher drops trailing arguments equal to their defaults (None here).
            setup_context(ctx, (*args, *(None,) * (n_arguments - len(args))), output)
            return output

        @staticmethod
        def backward(ctx, grad_out):
            needs = ctx.needs_input_grad
            ctx.needs_input_grad = needs[:-1]  # the user's backward sees its own arguments only
            try:
                grads = backward(ctx, grad_out)
            finally:
                ctx.needs_input_grad = needs
            return (*grads, None)

    Forward.__name__ = f"TwellAutograd_{op._opname}"

    def autograd_kernel(keyset: torch._C.DispatchKeySet, *args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return Forward.apply(*args, keyset)
        kernel = direct.get((keyset & _AFTER_AUTOGRAD).raw_repr())
        if kernel is None:
            return redispatch(keyset, args)
        with torch._C._AutoDispatchBelowAutograd():
            return kernel(*args)

    # Hidden from Dynamo like the device kernels (ops.py): an eager call made while a compiled frame
    # runs is never traced into.
    lib.impl(op._schema.name.split("::")[1], torch._disable_dynamo(autograd_kernel), "Autograd", with_keyset=True)
