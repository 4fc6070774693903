"""Host time per call of the twell op against the dense MLP, at decode and small batch sizes.

    python examples/bench_host_time.py [--m 1 16 64 256 4096]

Without CUDA graphs (eager, or torch.compile's default mode) a decode-sized call is paced by the host:
this times back-to-back calls with no sync between them, so the GPU work overlaps and what is left is
the host's. Each line gives microseconds per call, host time (the loop) / total (after the final
sync), for the dense MLP and the op (twice, alternating, to show drift), the op's CUDA implementation
without the dispatcher (``twell_mlp``), and its one host call alone (``mlp_forward``). GPU only.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import twell_compile  # noqa: F401
from twell_compile.kernels import build, twell_mlp
from twell_compile.testing import make_problem


def host_time_us(fn, calls: int = 1000) -> tuple[float, float]:
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (issued - start) / calls * 1e6, (done - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 256, 4096])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--nnz", type=float, default=24.0)
    args = parser.parse_args()
    k, f = args.hidden, args.intermediate
    ext = build.cuda_extension()
    op = torch.ops.twell.gated_relu_mlp
    print(f"GPU: {torch.cuda.get_device_name()}  K={k} N={f} nnz={args.nnz}  (us per call, host / total)")
    for m in args.m:
        p = make_problem(m, k, f, nnz_per_row=args.nnz)
        x, wg, wu, wd = p.x, p.gate_weight, p.up_weight, p.down_weight
        times = {}
        for rep in range(2):
            times[f"dense{rep}"] = host_time_us(lambda: F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd))
            times[f"op{rep}"] = host_time_us(lambda: op(x, wg, wu, wd))
        times["twell_mlp"] = host_time_us(lambda: twell_mlp.twell_mlp(x, wg, None, wu, None, wd, None))
        plan = twell_mlp.call_plan(m, f, k, x.device)
        if plan.cuda is not None:
            w_down_t = twell_mlp.DOWN_WEIGHT_T.transposed(wd)
            times["mlp_forward"] = host_time_us(
                lambda: ext.mlp_forward(plan.cuda, x, wg, None, wu, None, wd, w_down_t, None))
        print(f"M={m:<6} " + "  ".join(f"{name} {h:.1f}/{t:.1f}" for name, (h, t) in times.items()))


if __name__ == "__main__":
    main()
