"""How evenly the dense-path GEMMs' persistent CTAs share a partly dense call's tiles (CPU only).

The wgmma GEMMs (csrc/twell_gemm.cu) walk every output tile in grouped order (groups of 8 row tiles,
``tile_coords``), strided over the grid (66 CTA pairs on an H100), and the dense-path GEMMs skip the
tiles whose row tile holds no dense block. This counts, for dense blocks spread evenly (as
``make_problem(dense_block_share=...)`` places them) or at random, how many dense tiles the busiest CTA
pair gets against the mean. The call takes about as long as its busiest pair.

    python examples/simulate_dense_walk.py --m 4096 8192 16384 --shares 0.125 0.25
"""

from __future__ import annotations

import argparse
import random


def tile_coords(tile: int, n_tiles_m: int, n_tiles_n: int, group_m: int) -> tuple[int, int]:
    """The kernel's grouped order (csrc/twell_gemm.cu, tile_coords)."""
    in_group = group_m * n_tiles_n
    first_m = (tile // in_group) * group_m
    rows_in_group = min(n_tiles_m - first_m, group_m)
    r = tile % in_group
    return first_m + r % rows_in_group, r // rows_in_group


def dense_tiles_per_pair(m: int, tile_m: int, dense_blocks: set[int], n_tiles_n: int = 44, cluster: int = 2,
                         sms: int = 132, group_m: int = 8) -> list[int]:
    n_tiles_m = -(-m // tile_m)
    units_n = -(-n_tiles_n // cluster)
    stride = sms // cluster
    blocks_per_tile = tile_m // 128
    per_pair = [0] * stride
    for unit in range(n_tiles_m * units_n):
        pm, _ = tile_coords(unit, n_tiles_m, units_n, group_m)
        if any(pm * blocks_per_tile + i in dense_blocks for i in range(blocks_per_tile)):
            per_pair[unit % stride] += 1
    return per_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.125, 0.25])
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"{'M':>6} {'share':>6} {'tile_m':>6} {'dense tiles (even)':>11} {'even: max/mean':>15} {'random: max/mean':>17}")
    for m in args.m:
        blocks = m // 128
        for share in args.shares:
            n = round(share * blocks)
            even = {i * blocks // n for i in range(n)}
            scattered = set(random.Random(args.seed).sample(range(blocks), n))
            for tile_m in (128, 256):
                cells, totals = [], []
                for dense in (even, scattered):
                    per_pair = dense_tiles_per_pair(m, tile_m, dense)
                    mean = sum(per_pair) / len(per_pair)
                    cells.append(f"{max(per_pair)}/{mean:.2f} = {max(per_pair) / mean:.2f}")
                    totals.append(sum(per_pair))
                print(f"{m:>6} {share:>6.3f} {tile_m:>6} {totals[0]:>11} {cells[0]:>15} {cells[1]:>17}")


if __name__ == "__main__":
    main()
