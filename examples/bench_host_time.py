"""Host time per call of the twell op against the dense MLP, at decode and small batch sizes.

    python examples/bench_host_time.py [--m 1 16 64 256 4096]

Without CUDA graphs (eager, or torch.compile's default mode) a decode-sized call is paced by the host:
this times back-to-back calls with no sync between them, so the GPU work overlaps and what is left is
the host's. Each line gives microseconds per call, host time (the loop) / total (after the final
sync), for the dense MLP and the op (twice, alternating, to show drift; ``op`` serves repeat calls from
the layer's lease, ``op_no_lease`` runs each through the Python path), the lease's C++ call alone
(``fast_mlp``), the op's CUDA implementation without the dispatcher and without leases (``twell_mlp``),
and its one host call alone (``mlp_forward``).

Without a GPU (or with ``--cpu``) it times what does not depend on one: the op's dispatch and input
checks, as the op's time minus that of its reference kernel called directly, on tiny CPU tensors
(``--hidden 8 --intermediate 16`` by default there) so that the arithmetic is negligible, in each grad
mode (the autograd layer only runs outside ``torch.inference_mode``).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import twell_compile  # noqa: F401
from twell_compile import kernels
from twell_compile.testing import kernel_config, make_problem


def host_time_us(fn, calls: int = 1000) -> tuple[float, float]:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(30):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    sync()
    done = time.perf_counter()
    return (issued - start) / calls * 1e6, (done - start) / calls * 1e6


def cpu_dispatch_overhead(args) -> None:
    k, f = args.hidden or 8, args.intermediate or 16
    torch.manual_seed(0)
    x = torch.randn(1, k)
    gated = (torch.randn(f, k), torch.randn(f, k), torch.randn(k, f))
    relu = (torch.randn(f, k), torch.randn(k, f))
    cases = {
        "gated_relu_mlp": (lambda: torch.ops.twell.gated_relu_mlp(x, *gated),
                           lambda: kernels.reference_gated_relu_mlp(x, *gated, None, None, None)),
        "relu_mlp": (lambda: torch.ops.twell.relu_mlp(x, *relu),
                     lambda: kernels.reference_relu_mlp(x, *relu, None, None)),
    }
    modes = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    print(f"CPU, K={k} N={f}, M=1: us per call, best of {args.rounds} rounds of {args.calls} calls")
    for name, (op_call, reference_call) in cases.items():
        for mode, context in modes.items():
            with context():
                op_us = min(host_time_us(op_call, args.calls)[0] for _ in range(args.rounds))
                ref_us = min(host_time_us(reference_call, args.calls)[0] for _ in range(args.rounds))
            print(f"{name:<15} {mode:<15} op {op_us:6.2f}  reference kernel {ref_us:6.2f}  "
                  f"dispatch + checks {op_us - ref_us:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 256, 4096])
    parser.add_argument("--hidden", type=int, default=None, help="default 2048 (GPU), 8 (CPU)")
    parser.add_argument("--intermediate", type=int, default=None, help="default 5632 (GPU), 16 (CPU)")
    parser.add_argument("--nnz", type=float, default=24.0)
    parser.add_argument("--cpu", action="store_true", help="the CPU measurement even where there is a GPU")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5, help="CPU: rounds per measurement (best is kept)")
    parser.add_argument("--profile", action="store_true",
                        help="GPU: also profile the op's Python host code (cProfile, by own time) at each M")
    args = parser.parse_args()
    if args.cpu or not torch.cuda.is_available():
        cpu_dispatch_overhead(args)
        return
    from twell_compile.kernels import build, twell_mlp

    k, f = args.hidden or 2048, args.intermediate or 5632
    ext = build.cuda_extension()
    op = torch.ops.twell.gated_relu_mlp
    print(f"GPU: {torch.cuda.get_device_name()}  K={k} N={f} nnz={args.nnz}  (us per call, host / total)")
    for m in args.m:
        p = make_problem(m, k, f, nnz_per_row=args.nnz)
        x, wg, wu, wd = p.x, p.gate_weight, p.up_weight, p.down_weight
        times = {}
        for rep in range(2):
            times[f"dense{rep}"] = host_time_us(lambda: F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd),
                                                args.calls)
            times[f"op{rep}"] = host_time_us(lambda: op(x, wg, wu, wd), args.calls)
            with kernel_config(fast_calls=False):  # every call on the Python path (no lease)
                times[f"op_no_lease{rep}"] = host_time_us(lambda: op(x, wg, wu, wd), args.calls)
        with kernel_config(route_by_density=False):  # a lease without the router's limit, to time it alone
            op(x, wg, wu, wd)
            # (a declined call returns None at once, which would pass for a very fast lease)
            if ext.fast_mlp(x, wg, None, wu, None, wd, None) is not None:
                times["fast_mlp"] = host_time_us(lambda: ext.fast_mlp(x, wg, None, wu, None, wd, None), args.calls)
            else:
                print(f"M={m}: no lease serves this call (chunked-kernel calls get none): fast_mlp not timed")
        with kernel_config(fast_calls=False):  # the Python path alone, without a grant after every call
            times["twell_mlp"] = host_time_us(lambda: twell_mlp.twell_mlp(x, wg, None, wu, None, wd, None), args.calls)
        plan = twell_mlp.call_plan(m, f, wd.shape[0], x.device)
        if plan.cuda is not None:
            w_down_t = twell_mlp.DOWN_WEIGHT_T.get(wd)
            times["mlp_forward"] = host_time_us(
                lambda: ext.mlp_forward(plan.cuda, x, wg, None, wu, None, wd, w_down_t, None), args.calls)
        print(f"M={m:<6} " + "  ".join(f"{name} {h:.1f}/{t:.1f}" for name, (h, t) in times.items()))
        if args.profile:
            profile_host_code(lambda: op(x, wg, wu, wd), args.calls)


def profile_host_code(fn, calls: int) -> None:
    """Where the host time of ``fn`` goes, by function (own time, cProfile's overhead included)."""
    import cProfile
    import pstats

    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
