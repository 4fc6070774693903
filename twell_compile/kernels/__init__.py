"""Device kernels behind the twell ops.

``ops.py`` calls ``cuda_gated_relu_mlp`` / ``cuda_relu_mlp`` for CUDA tensors. bfloat16 and float16
inputs run the TwELL kernels (``twell_mlp.py``: wgmma gate GEMM with packing epilogue, sparse up/down
and dense-block path, built from ``csrc/``; Triton kernels for unaligned shapes) on Hopper. float32 and
float64 inputs (warned about once per dtype), and GPUs or machines where the kernels cannot run (reported
once as a warning), use the plain-PyTorch reference on the same device.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from .. import reference, stats
from . import build

_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def _use_kernels(x: Tensor, act_weight: Tensor, down_weight: Tensor) -> bool:
    """bf16/fp16 on a GPU the kernels run on, with every size nonzero but the rows (a call with no
    input features, units or outputs is plain arithmetic on its biases: the reference does it). Other
    dtypes are warned about once each: a float32 model compiled with the backend would otherwise run
    dense, with no sign of why."""
    if x.dtype not in _KERNEL_DTYPES:
        _warn_dtype_once(x.dtype)
        return False
    return (x.shape[-1] > 0 and act_weight.shape[0] > 0 and down_weight.shape[0] > 0
            and build.kernels_available(x.device))


@functools.cache
def _warn_dtype_once(dtype: torch.dtype) -> None:
    warnings.warn(f"twell: {dtype} inputs run the dense PyTorch reference on CUDA; the TwELL kernels take "
                  "bfloat16 and float16 (cast the model, e.g. model.to(torch.bfloat16), or run it under "
                  "torch.autocast).", RuntimeWarning, stacklevel=4)


def _record_reference_stats(op: str, x: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    """While a sparsity recorder is active, the reference path reports its activation's density too
    (the ReLU'd projection is recomputed for it, only then)."""
    recorder = stats.active_recorder()
    if recorder is not None:
        pre_activation = torch.nn.functional.linear(x, weight, bias)
        active = stats.active_units(pre_activation)
        recorder.add(op, reference.flat(active).sum(1), active.shape[-1], path="reference")


def reference_gated_relu_mlp(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias) -> Tensor:
    """The reference path of ``twell::gated_relu_mlp`` on any device, with sparsity recording."""
    _record_reference_stats("gated_relu_mlp", x, gate_weight, gate_bias)
    return reference.gated_relu_mlp(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias).contiguous()


def reference_relu_mlp(x, up_weight, down_weight, up_bias, down_bias) -> Tensor:
    """The reference path of ``twell::relu_mlp`` on any device, with sparsity recording."""
    _record_reference_stats("relu_mlp", x, up_weight, up_bias)
    return reference.relu_mlp(x, up_weight, down_weight, up_bias, down_bias).contiguous()


def _twell_mlp_on_its_device(x: Tensor, *args) -> Tensor:
    """``twell_mlp`` with x's device current. A model spread over several GPUs (Hugging Face's
    ``device_map="auto"``, say) calls the op on one GPU while another is current, and what the kernels
    and their host code take from the current device would then be another GPU's: the device the Triton
    kernels launch on, the stream the density reports are copied on, the capture test, the shared-memory
    limit of the chunked kernel's fit. The C++ entry points set their own guard; this covers the rest.
    Only a call on a GPU that is not current pays for switching."""
    from .twell_mlp import twell_mlp

    index = x.device.index
    if index is None or index == torch.cuda.current_device():
        return twell_mlp(x, *args)
    with torch.cuda.device(x.device):
        return twell_mlp(x, *args)


def cuda_gated_relu_mlp(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias) -> Tensor:
    if _use_kernels(x, gate_weight, down_weight):
        return _twell_mlp_on_its_device(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias)
    return reference_gated_relu_mlp(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)


def cuda_relu_mlp(x, up_weight, down_weight, up_bias, down_bias) -> Tensor:
    if _use_kernels(x, up_weight, down_weight):
        return _twell_mlp_on_its_device(x, up_weight, up_bias, None, None, down_weight, down_bias)
    return reference_relu_mlp(x, up_weight, down_weight, up_bias, down_bias)
