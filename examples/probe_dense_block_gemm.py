"""What one dense block costs the dense path's GEMMs, and where a fixed cost could hide.

A call whose 128-row blocks are all sparse but one pays the dense path's two GEMMs for that block: on an
H100 (2026-11-28) about 31 us for gate times up and 22 us for the down projection's store at 1024 rows,
with DRAM at 23-34% of its peak and the SMs at 9-13% (Nsight Compute), and no faster with K split in
more ranges. This times ``dense_block_gemm`` alone, under CUDA graphs, with one dense block (or none:
launch, set-up and exit only), in several launch variants, beside cuBLAS computing the same block's
product (``torch.mm`` on its 128 rows), so the gap to cuBLAS can be split into what the grid, the pairs,
the K split and the caches cost:

    python examples/probe_dense_block_gemm.py --m 1024 --flush-l2   # weights out of L2 first
    python examples/probe_dense_block_gemm.py --m 1024 2048 4096

Read the ``--flush-l2`` times: ``cuda_graph_time_ms`` times one replay at a time, so without the flush
each cell also holds the host's launch of the graph, which is what a near-empty graph's replay mostly
shows (17-19 us on an H100 host, 2026-11-28); the flush's own time, subtracted, holds it too and
cancels it.

GEMMs: ``up`` (x [M, K] W_up^T, the store epilogue on gate times up's shape), ``gate x up`` (the same
with the gate's TwELL output applied) and ``down`` (h [M, F] W_down^T, the store). Variants: ``pairs``
(the op's launch: 2-CTA clusters on every SM, K split by the device where few tiles are dense),
``single`` (1-CTA clusters), ``tiles only`` (single CTAs, a grid of just the dense block's tiles),
``split 2``/``split 4`` (K split as asked, over every tile of the call) and ``whole K`` (no split).
"""

from __future__ import annotations

import argparse

import torch

import twell_compile  # noqa: F401  (loads the CUDA extension's build helpers)
from twell_compile.kernels import build
from twell_compile.testing import cuda_graph_time_ms, make_problem, marked_block_nnz

INT32_MAX = 2**31 - 1
CAP = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--flush-l2", action="store_true",
                        help="overwrite a 256 MB buffer before each GEMM (inside the graph; its own time subtracted)")
    args = parser.parse_args()
    ext = build.cuda_extension()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    k, f = args.hidden, args.intermediate
    scratch = torch.empty(1 << 28, dtype=torch.uint8, device="cuda") if args.flush_l2 else None
    flush_us = 1000 * cuda_graph_time_ms(lambda: scratch.fill_(1), args.reps) if scratch is not None else 0.0

    def timed(fn) -> float:
        def body():
            if scratch is not None:
                scratch.fill_(1)
            fn()
        return 1000 * cuda_graph_time_ms(body, args.reps) - flush_us

    rows = []
    for m in args.m:
        p = make_problem(m, k, f, nnz_per_row=24.0, dense_block_share=0.0)
        tiles_n = -(-f // 128)
        packed = torch.empty((m, tiles_n, CAP), dtype=torch.int32, device="cuda")
        counts = torch.empty((m, tiles_n), dtype=torch.int32, device="cuda")
        backup = torch.empty((m, f), dtype=p.x.dtype, device="cuda")
        ext.gate_twell_gemm(p.x, p.gate_weight, None, packed, counts, backup, marked_block_nnz(m, ()),
                            sms, 2, 256, 0)
        h = (p.x @ p.up_weight.t()).relu_()
        gemms = {  # name: (a, b, c, gate, output columns)
            "up": (p.x, p.up_weight, torch.empty((m, f), dtype=p.x.dtype, device="cuda"), None, f),
            "gate x up": (p.x, p.up_weight, backup.clone(), (packed, counts), f),
            "down": (h, p.down_weight, torch.empty((m, k), dtype=p.x.dtype, device="cuda"), None, k),
        }
        one, none = marked_block_nnz(m, (0,)), marked_block_nnz(m, ())
        for name, (a, b, c, gate, n) in gemms.items():
            g_packed, g_counts = gate if gate is not None else (None, None)
            n_tiles = -(-n // 128)
            variants = {  # name: (ctas, cluster, k_splits)
                "pairs": (sms - sms % 2, 2, 0),
                "single": (sms, 1, 0),
                "tiles only": (n_tiles, 1, 0),
                "whole K": (sms, 1, 1),
                "split 2": (sms, 1, 2),
                "split 4": (sms, 1, 4),
            }
            a128, b_t = a[:128], b.t()
            cublas = timed(lambda: torch.mm(a128, b_t))
            for variant, (ctas, cluster, k_splits) in variants.items():
                def run(blocks, ctas=ctas, cluster=cluster, k_splits=k_splits):
                    ext.dense_block_gemm(a, b, None, c, blocks, g_packed, g_counts, 0, 0, INT32_MAX, ctas, cluster,
                                         128, k_splits)
                busy, idle = timed(lambda: run(one)), timed(lambda: run(none))
                rows.append((m, name, variant, busy, idle, cublas))
                print(m, name, variant, f"{busy:.1f} {idle:.1f} {cublas:.1f}", flush=True)

    print(f"\nGPU: {torch.cuda.get_device_name()}  K={k} F={f} {p.x.dtype}, one dense block of 128 rows "
          f"(none: every block sparse), CUDA-graph replays, median us"
          + (f", weights out of L2 (a {flush_us:.1f} us fill subtracted)" if scratch is not None else ""))
    print(f"{'M':>6}  {'GEMM':<10} {'variant':<11} {'one block':>10} {'none':>8} {'cuBLAS 128':>11} {'/cuBLAS':>8}")
    for m, name, variant, busy, idle, cublas in rows:
        print(f"{m:>6}  {name:<10} {variant:<11} {busy:>10.1f} {idle:>8.1f} {cublas:>11.1f} {busy / cublas:>8.2f}")


if __name__ == "__main__":
    main()
