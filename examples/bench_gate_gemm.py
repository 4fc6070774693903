"""The gate GEMM alone: its TwELL-pack epilogue against a plain store epilogue on the same mainloop, in
each schedule, against cuBLAS's dense gate GEMM; same run, alternating rounds (the GPU's clock moves).

    python examples/bench_gate_gemm.py [--m 131072 16384] [--rounds 2] [--bias]

``--bias`` gives the gate a bias (as Hugging Face Llama with ``mlp_bias=True`` has), in cuBLAS's GEMM
and in ours; small values, so the activation keeps its sparsity.

"pack" is the gate as the op runs it (``gate_twell_gemm``; by default 2x256, the staged schedule:
CTA pairs of cooperative 256-row tiles, the packing epilogue staged through shared memory and run by a
fourth warpgroup; 2x128 is ping-pong tiles); "store" is the dense-path GEMM with every block
forced dense (``dense_block_gemm``), which writes the whole [M, N] product (2x256 there: the staged
schedule too, a fourth warpgroup writing the staged tile out). GPU only.

``--launches N`` only launches cuBLAS, then pack (2x256, then 2x128) and store in CTA pairs, N times
each, untimed, for Nsight Compute, e.g. ``ncu --clock-control none --section SpeedOfLight -k
regex:"gemm|nvjet" python examples/bench_gate_gemm.py --m 128 --launches 3``.

``--sustain S`` runs cuBLAS and each pack schedule back to back for S seconds each while
``nvidia-smi`` samples the SM clock and the board power every 100 ms, and prints each one's time per
call with its median clock and power: at full tensor load the GPU is power-limited, so a kernel that
draws more power runs at a lower clock.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

import twell_compile  # noqa: F401
from twell_compile.kernels import build
from twell_compile.testing import cuda_time_ms, make_problem

SCHEDULES = ((2, 128), (1, 128), (2, 256))  # (CTAs per cluster, tile rows)


def cublas_kernel_names(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> list[str]:
    """The kernels cuBLAS runs for the dense gate (their names give its tile shape and cluster)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        F.linear(x, w, b)
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def sustained(fn, seconds: float) -> tuple[float, float, float]:
    """fn() back to back for `seconds`: (ms per call, median SM clock in MHz, median power in W)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-i", str(torch.cuda.current_device()), "-lms", "100"],
                           stdout=subprocess.PIPE, text=True)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    smi.terminate()
    samples = [line.split(",") for line in smi.communicate()[0].splitlines() if line.count(",") == 1]
    samples = samples[len(samples) // 5:]  # past the ramp
    clock = statistics.median(float(c) for c, _ in samples) if samples else float("nan")
    power = statistics.median(float(w) for _, w in samples) if samples else float("nan")
    return 1e3 * elapsed / calls, clock, power


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[131072, 16384])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--launches", type=int, default=0, help="untimed launches for a profiler (see above)")
    parser.add_argument("--bias", action="store_true", help="a gate bias, in every GEMM timed")
    parser.add_argument("--sustain", type=float, default=0.0, help="seconds of back-to-back calls each (see above)")
    args = parser.parse_args()
    k, f = args.hidden, args.intermediate
    ext = build.cuda_extension()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"GPU: {torch.cuda.get_device_name()}  K={k} N={f}  (ms, CUDA-event medians of 10)")
    for m in args.m:
        p = make_problem(m, k, f, nnz_per_row=24.0)
        x, w = p.x, p.gate_weight
        b = (0.01 * torch.randn(f, device="cuda")).to(x.dtype) if args.bias else None
        n_tiles, n_blocks = -(-f // 128), -(-m // 128)
        packed = torch.empty((m, n_tiles, 8), dtype=torch.int32, device="cuda")
        counts = torch.empty((m, n_tiles), dtype=torch.int32, device="cuda")
        dense = torch.empty((m, f), dtype=x.dtype, device="cuda")
        block_nnz = torch.zeros(2 * n_blocks, dtype=torch.int32, device="cuda")
        all_dense = torch.full((2 * n_blocks,), 1 << 30, dtype=torch.int32, device="cuda")

        def pack(cluster, tile_m):
            block_nnz.zero_()
            ext.gate_twell_gemm(x, w, b, packed, counts, dense, block_nnz, sms, cluster, tile_m)

        def store(cluster, tile_m):
            ext.dense_block_gemm(x, w, b, dense, all_dense, None, None, 0, 0, 0, sms, cluster, tile_m)

        if args.launches:
            for run in (lambda: F.linear(x, w, b), lambda: pack(2, 256), lambda: pack(2, 128), lambda: store(2, 128)):
                for _ in range(args.launches):
                    run()
            torch.cuda.synchronize()
            print(f"M={m}: {args.launches} launches each of cuBLAS, pack and store")
            continue
        if args.sustain:
            for name, run in (("cuBLAS", lambda: F.linear(x, w, b)), ("pack 2x256", lambda: pack(2, 256)),
                              ("pack 2x128", lambda: pack(2, 128)), ("cuBLAS again", lambda: F.linear(x, w, b))):
                ms, clock, power = sustained(run, args.sustain)
                print(f"M={m} sustained {name}: {ms:.3f} ms per call, SM clock {clock:.0f} MHz, {power:.0f} W")
            continue
        print(f"M={m}{' with bias' if args.bias else ''} cuBLAS runs: {', '.join(cublas_kernel_names(x, w, b))}")
        for r in range(args.rounds):
            times = {"cuBLAS": cuda_time_ms(lambda: F.linear(x, w, b), 10)}
            for cluster, tile_m in SCHEDULES:
                times[f"pack {cluster}x{tile_m}"] = cuda_time_ms(lambda: pack(cluster, tile_m), 10)
                times[f"store {cluster}x{tile_m}"] = cuda_time_ms(lambda: store(cluster, tile_m), 10)
            print(f"M={m} round {r}: " + "  ".join(f"{name} {t:.3f}" for name, t in times.items()))


if __name__ == "__main__":
    main()
