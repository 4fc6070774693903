"""One-off: the op's host time with autograd_kernel.py against torch.library.register_autograd, alternating in one process."""
import sys, time, warnings
import torch
import twell_compile
from twell_compile import ops
from twell_compile.testing import make_problem
warnings.simplefilter("ignore")
op = torch.ops.twell.gated_relu_mlp
seen = []
orig = torch._ops.OpOverload.redispatch
spy = lambda self, ks, *a, **k: (seen.append(1), orig(self, ks, *a, **k))[1]
def t(fn, calls=2000):
    torch.cuda.synchronize(); s = time.perf_counter()
    for _ in range(calls): fn()
    h = time.perf_counter() - s; torch.cuda.synchronize()
    return h / calls * 1e6
print(torch.cuda.get_device_name())
for m in (1, 16):
    p = make_problem(m, 2048, 5632, nnz_per_row=24.0)
    args = (p.x, p.gate_weight, p.up_weight, p.down_weight)
    for mode in (torch.no_grad, torch.enable_grad):
        res = {"autograd_kernel": [], "register_autograd": []}
        with mode():
            for _ in range(30): op(*args)
            torch._ops.OpOverload.redispatch = spy
            seen.clear(); op(*args); direct = not seen
            torch._ops.OpOverload.redispatch = orig
            for r in range(10):
                if r == 0:  # the first round with only the original registration
                    first = t(lambda: op(*args))
                res["autograd_kernel"].append(t(lambda: op(*args)))
                torch.library._impls.discard("twell/gated_relu_mlp/Autograd")  # torch 2.11 refuses a Python override
                lib = torch.library.Library("twell", "IMPL")
                torch.library.register_autograd("twell::gated_relu_mlp", ops._gated_backward, setup_context=ops._gated_setup_context, lib=lib)
                res["register_autograd"].append(t(lambda: op(*args)))
                lib._destroy()
        med = {k: sorted(v)[len(v) // 2] for k, v in res.items()}
        print(f"M={m} {mode.__name__:12s} direct={direct} host us/call median of 10 rounds: " + "  ".join(f"{k} {v:.1f} (min {min(res[k]):.1f})" for k, v in med.items()) + f"  first {first:.1f}  saved {med['register_autograd'] - med['autograd_kernel']:.1f}")
