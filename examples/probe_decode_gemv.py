"""Where the decode gate GEMV's time goes: its time per launch against K, cluster size and weight
residency, beside cuBLAS's GEMM on the same operands, in one run.

    python examples/probe_decode_gemv.py [--m 1 16 64] [--k 256 1024 2048] [--clusters 0 4 8]

Each time is a CUDA-graph replay of 16 back-to-back launches, divided by 16 (the GPU's time per launch,
with no host in it). "warm": the same weight every launch, so it stays in L2 (23 MB at the 2B gate's
N = 5632, K = 2048); "cold": 8 copies of the weight in turn (185 MB), so each launch reads its weight
from HBM, as a model's layers do. At K = 256 each CTA of a cluster of 8 has one K chunk of 32, so that
row shows the GEMV's fixed cost (launch, cluster barriers, reduction, epilogue); the rows above it add
only the streaming of more K. GPU only.
"""

from __future__ import annotations

import argparse

import torch

import twell_compile  # noqa: F401
from twell_compile.kernels import build
from twell_compile.testing import cuda_graph_time_ms, make_problem

LAUNCHES = 16


def graph_time_us(step, launches: int = LAUNCHES) -> float:
    """Median replay time of a graph of step(0) .. step(launches - 1), per launch, in microseconds."""

    def steps():
        for i in range(launches):
            step(i)

    return 1e3 * cuda_graph_time_ms(steps, 20) / launches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--k", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--n", type=int, default=5632)
    parser.add_argument("--clusters", type=int, nargs="+", default=[0, 4, 8],
                        help="CTAs per cluster along K (0: the kernel's own choice)")
    parser.add_argument("--copies", type=int, default=8, help="weight copies cycled through for the cold rows")
    args = parser.parse_args()
    ext = build.cuda_extension()
    n = args.n
    print(f"GPU: {torch.cuda.get_device_name()}  N={n}  bf16, us per launch (graph of {LAUNCHES} launches)")
    print(f"{'M':>4} {'K':>5} {'cluster':>7} {'ours warm':>10} {'cuBLAS warm':>12} {'ours cold':>10} {'cuBLAS cold':>12}")
    for k in args.k:
        for m in args.m:
            p = make_problem(m, k, n, nnz_per_row=24.0)
            x = p.x
            weights = [p.gate_weight] + [p.gate_weight.clone() for _ in range(args.copies - 1)]
            n_tiles = -(-n // 128)
            packed = torch.empty((m, n_tiles, 8), dtype=torch.int32, device="cuda")
            counts = torch.empty((m, n_tiles), dtype=torch.int32, device="cuda")
            dense = torch.empty((m, n), dtype=x.dtype, device="cuda")
            block_nnz = torch.zeros(2, dtype=torch.int32, device="cuda")
            out = torch.empty((m, n), dtype=x.dtype, device="cuda")

            def cublas(i, cold):
                torch.mm(x, weights[i % len(weights) if cold else 0].t(), out=out)

            base = (graph_time_us(lambda i: cublas(i, False)), graph_time_us(lambda i: cublas(i, True)))
            for cluster in args.clusters:
                def ours(i, cold, cluster=cluster):
                    weight = weights[i % len(weights) if cold else 0]
                    ext.decode_gate_twell(x, weight, None, packed, counts, dense, block_nnz, cluster)

                warm, cold = graph_time_us(lambda i: ours(i, False)), graph_time_us(lambda i: ours(i, True))
                print(f"{m:>4} {k:>5} {cluster:>7} {warm:>10.1f} {base[0]:>12.1f} {cold:>10.1f} {base[1]:>12.1f}")


if __name__ == "__main__":
    main()
