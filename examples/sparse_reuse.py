"""How often a block of tokens reuses the same weight rows: the arithmetic behind the sparse kernel's limit.

    python examples/sparse_reuse.py [--m 8192] [--nnz 24 39 80] [--skew] [--blocks 1 128 256 512 1024]

The sparse kernel (csrc/twell_sparse_mlp.cu) reads one row of W_up and one of W_down^T, 4 * hidden
bytes in bf16, for every (token, active unit) pair, so its L2 traffic grows with the pairs: about 26 GB
at the 2B shape, M = 131072 and 24 nonzeros per row. A kernel that took B tokens at a time and read
each unit's rows once for all the tokens of the block that use it would read only the block's union of
active units. This prints, on the benchmark's synthetic activations (``testing.make_problem``, float32
on the CPU), the union per block of B tokens, the pairs per union row (the reuse factor), and the
weight and x/out bytes per token each design reads. Computed, not timed: whether such a kernel runs
faster depends on more than traffic (shared memory holds only a slice of the union's rows at a time,
so the hidden dimension must be streamed in chunks, and per-token accumulators must stay in registers).
"""

from __future__ import annotations

import argparse

import torch

from twell_compile.testing import make_problem


def reuse_table(active: torch.Tensor, blocks: list[int], hidden: int) -> list[str]:
    """Rows of the table for one activation pattern (``active``: [tokens, units] bool)."""
    m, f = active.shape
    row_bytes = 2 * hidden * 2  # one bf16 row of W_up and one of W_down^T
    io_bytes = 2 * hidden * 2  # x read and out written once per token
    pairs_per_token = active.sum(1).double().mean().item()
    lines = []
    for b in blocks:
        usable = m // b * b
        if usable == 0:
            continue
        per_block = active[:usable].view(-1, b, f)
        union = per_block.any(1).sum(1).double()
        pairs = per_block.sum((1, 2)).double()
        union_per_token = union.sum().item() / usable
        reuse = pairs.sum().item() / max(union.sum().item(), 1.0)  # pairs per weight row read
        weight_kb = union_per_token * row_bytes / 1024
        lines.append(f"{b:>6} {union.mean().item():>9.0f} {union.mean().item() / f:>7.1%} {reuse:>8.2f} "
                     f"{weight_kb:>10.1f} {(weight_kb * 1024 + io_bytes) / (pairs_per_token * row_bytes + io_bytes):>9.2f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, default=8192, help="tokens (a multiple of the largest block)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--nnz", type=float, nargs="+", default=[24.0, 39.0, 80.0])
    parser.add_argument("--skew", action="store_true", help="also the skewed activations of the benchmark")
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 128, 256, 512, 1024])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(args.seed)
    cases = [(nnz, False) for nnz in args.nnz] + ([(max(args.nnz), True)] if args.skew else [])
    for nnz, skew in cases:
        p = make_problem(args.m, args.hidden, args.intermediate, nnz_per_row=nnz, skew=skew, dtype=torch.float32,
                         device="cpu", generator=generator)
        active = (p.x @ p.gate_weight.T) > 0
        kind = "skewed" if skew else "uniform"
        print(f"\n{kind}, M={args.m} K={args.hidden} N={args.intermediate}: "
              f"{active.sum(1).double().mean().item():.1f} active units per token (mean)")
        print(f"{'block':>6} {'union':>9} {'of N':>7} {'reuse':>8} {'W KB/tok':>10} {'traffic':>9}")
        for line in reuse_table(active, args.blocks, args.hidden):
            print(line)
    print("\nblock 1 is the per-token design; 'traffic' is the L2 bytes a block design reads per token "
          "(weights once per block, x and out once per token) over the per-token design's.")


if __name__ == "__main__":
    main()
