"""Plain-PyTorch reference implementations of the twell ops.

These stay in the project for good: they are the CPU path, the fallback on any device the CUDA kernels
do not cover, and the ground truth every kernel test compares against. The forward spells the MLP with
exactly the ops the rewritten model used, so on CPU the rewrite is bit-for-bit identical to eager.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def gated_relu_mlp(
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    gate_bias: Tensor | None = None,
    up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
) -> Tensor:
    """``down(relu(gate(x)) * up(x))`` with nn.Linear weight layouts."""
    hidden = F.relu(F.linear(x, gate_weight, gate_bias)) * F.linear(x, up_weight, up_bias)
    return F.linear(hidden, down_weight, down_bias)


def relu_mlp(
    x: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
) -> Tensor:
    """``down(relu(up(x)))`` with nn.Linear weight layouts."""
    return F.linear(F.relu(F.linear(x, up_weight, up_bias)), down_weight, down_bias)


def flat(t: Tensor) -> Tensor:
    """Leading dims folded into one, so weight gradients are a single matrix product. (Not
    ``reshape(-1, n)``, which cannot infer the rows of a tensor with no elements.)"""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _bias_grad(grad: Tensor) -> Tensor:
    return flat(grad).sum(0)


def gated_relu_mlp_backward(
    grad_out: Tensor,
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    gate_bias: Tensor | None,
    up_bias: Tensor | None,
    needs: tuple[bool, ...],
) -> tuple[Tensor | None, ...]:
    """Gradients for (x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias).

    The gate and up projections are recomputed rather than saved: the forward then keeps no
    (tokens x intermediate) activation alive, which is what the sparse kernels are for.
    ``needs`` is autograd's needs_input_grad, so unused gradients cost nothing.
    """
    gate = F.linear(x, gate_weight, gate_bias)
    up = F.linear(x, up_weight, up_bias)
    act = F.relu(gate)
    grad_hidden = F.linear(grad_out, down_weight.t())
    grad_up = grad_hidden * act
    # threshold_backward is what eager ReLU's backward uses: gradient passes where the output is > 0.
    grad_gate = torch.ops.aten.threshold_backward(grad_hidden * up, gate, 0)

    grad_x = grad_gate_w = grad_up_w = grad_down_w = grad_gate_b = grad_up_b = grad_down_b = None
    if needs[0]:
        grad_x = F.linear(grad_gate, gate_weight.t()) + F.linear(grad_up, up_weight.t())
    if needs[1]:
        grad_gate_w = flat(grad_gate).t() @ flat(x)
    if needs[2]:
        grad_up_w = flat(grad_up).t() @ flat(x)
    if needs[3]:
        grad_down_w = flat(grad_out).t() @ flat(act * up)
    if needs[4]:
        grad_gate_b = _bias_grad(grad_gate)
    if needs[5]:
        grad_up_b = _bias_grad(grad_up)
    if needs[6]:
        grad_down_b = _bias_grad(grad_out)
    return grad_x, grad_gate_w, grad_up_w, grad_down_w, grad_gate_b, grad_up_b, grad_down_b


def relu_mlp_backward(
    grad_out: Tensor,
    x: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    up_bias: Tensor | None,
    needs: tuple[bool, ...],
) -> tuple[Tensor | None, ...]:
    """Gradients for (x, up_weight, down_weight, up_bias, down_bias); recomputes the up projection."""
    up = F.linear(x, up_weight, up_bias)
    act = F.relu(up)
    grad_up = torch.ops.aten.threshold_backward(F.linear(grad_out, down_weight.t()), up, 0)

    grad_x = grad_up_w = grad_down_w = grad_up_b = grad_down_b = None
    if needs[0]:
        grad_x = F.linear(grad_up, up_weight.t())
    if needs[1]:
        grad_up_w = flat(grad_up).t() @ flat(x)
    if needs[2]:
        grad_down_w = flat(grad_out).t() @ flat(act)
    if needs[3]:
        grad_up_b = _bias_grad(grad_up)
    if needs[4]:
        grad_down_b = _bias_grad(grad_out)
    return grad_x, grad_up_w, grad_down_w, grad_up_b, grad_down_b
