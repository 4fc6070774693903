"""Which tiles the dense path's GEMMs should run on partly dense calls: the TwELL path (routing off) with
its gate-times-up and down GEMMs on 256-row cooperative tiles (the default) against 128-row ping-pong
tiles, on calls where a share of the 128-row blocks is dense (``make_problem(dense_block_share=...)``).
A 256-row tile runs whenever one of its two blocks is dense, so scattered dense blocks leave half of
each such tile idle; 128-row tiles run only the dense blocks. The 128-row (ping-pong) tiles split K by
themselves where few tiles are dense (csrc/twell_entries.h, adaptive_split_room) and then sum in
another order: "differ" in the bits column is expected there.

    python examples/probe_dense_tile_m.py --m 8192 16384 --shares 0.125 1
"""

from __future__ import annotations

import argparse

import torch

import twell_compile  # noqa: F401  (registers torch.ops.twell)
from twell_compile.kernels import twell_mlp
from twell_compile.testing import cuda_graph_time_ms, make_problem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--nnz", type=float, default=24)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.125, 1])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--placement", choices=["even", "random"], default="even",
                        help="dense blocks spread evenly (close to the GEMMs' worst case) or at random")
    args = parser.parse_args()
    config = twell_mlp.config
    config.route_by_density = False
    rows = []
    for m in args.m:
        for share in args.shares:
            p = make_problem(m, 2048, 5632, nnz_per_row=args.nnz, dense_block_share=share, dense_block_placement=args.placement)
            args_ = p.gated_args()
            times, outs = {}, {}
            for tile_m in (256, 128):
                config.gemm_tile_m = config.down_gemm_tile_m = tile_m
                outs[tile_m] = torch.ops.twell.gated_relu_mlp(*args_)
                times[tile_m] = cuda_graph_time_ms(lambda: torch.ops.twell.gated_relu_mlp(*args_), args.reps)
            same = torch.equal(outs[256], outs[128])
            rows.append((m, share, times, same))
            print(m, share, {k: round(v * 1e3, 1) for k, v in times.items()}, "same bits" if same else "DIFFERENT", flush=True)
    print(f"\nGPU: {torch.cuda.get_device_name()}  2B shape, bf16, {args.nnz:.0f} active units per row in sparse blocks, "
          f"80 in dense ones ({args.placement}); TwELL path, CUDA-graph replays, median us")
    print(f"{'M':>6} {'share':>6} {'m256':>9} {'m128':>9} {'m128/m256':>10} bits")
    for m, share, t, same in rows:
        print(f"{m:>6} {share:>6.3f} {t[256] * 1e3:>9.1f} {t[128] * 1e3:>9.1f} {t[128] / t[256]:>10.2f} {'same' if same else 'differ'}")


if __name__ == "__main__":
    main()
