"""Where routing by observed density should send a layer to cuBLAS: the TwELL path against the cuBLAS MLP
on calls whose 128-row blocks are partly dense.

``density_route.py`` routes a layer once the average share of its blocks that take the dense path
reaches a threshold. This times, in one run and under CUDA graphs, the TwELL path (routing off) and the
cuBLAS MLP on activations where a chosen share of the blocks is dense (their rows at ``--dense-nnz``
active units, above every dense-block threshold) and the rest sparse (``--nnz``), so the crossover
share can be read per row count. The dense blocks are spread evenly over the call (or at random). The share printed is
the one the router would see (the kernels' own block test, run on the dense activation). ``routed`` is the
op's default, routing by observed density (``density_route.ENTER_SHARES``), timed once settled.

    python examples/sweep_route_share.py --m 1024 4096 16384 --nnz 24 39
"""

from __future__ import annotations

import argparse

import torch

import twell_compile  # noqa: F401  (registers torch.ops.twell)
from twell_compile.kernels import twell_mlp
from twell_compile.kernels.triton_kernels import DECISION_ROWS
from twell_compile.testing import cuda_graph_time_ms, make_problem, relative_error
from twell_compile import stats


def dense_blocks_share(x, wg, m: int) -> float:
    """The share of blocks the TwELL path sends dense, by the router's test on the dense activation."""
    plan = twell_mlp.call_plan(m, wg.shape[0], x.shape[1], x.device)
    active = stats.active_units(x @ wg.t())
    dense = twell_mlp._activation_dense_blocks(active, plan.report_thresholds, plan.gate.cap, plan.gate.tile_n)
    return int(dense) / -(-m // DECISION_ROWS)


def set_route(name: str) -> None:
    """``twell``: the TwELL path (routing off, so its dense path runs ``config.gemm_tile_m`` and
    ``down_gemm_tile_m``, which main() sets to ``--twell-tile-m``); ``cublas``: the cuBLAS MLP; ``routed``:
    routing by observed density, the op's default (its TwELL calls run ``config.partly_dense_tile_m``)."""
    twell_mlp.config.route_by_density = name == "routed"
    twell_mlp.config.cublas_rows = (1, 10**9) if name == "cublas" else (1, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[768, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--nnz", type=float, nargs="+", default=[24, 39])
    parser.add_argument("--dense-nnz", type=float, default=80)
    parser.add_argument("--shares", type=float, nargs="+", default=[0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 1])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--graph-calls", type=int, default=1,
                        help="calls captured in each timed CUDA graph (times are per call; see cuda_graph_time_ms)")
    parser.add_argument("--placement", choices=["even", "random"], default="even",
                        help="dense blocks spread evenly (close to the dense-path GEMMs' worst case) or at random")
    parser.add_argument("--twell-tile-m", type=int, choices=[128, 256], default=twell_mlp.config.partly_dense_tile_m,
                        help="the twell column's dense-path tiles (default: the routed op's, partly_dense_tile_m)")
    args = parser.parse_args()
    config = twell_mlp.config
    config.gemm_tile_m = config.down_gemm_tile_m = args.twell_tile_m
    rows = []
    for m in args.m:
        for nnz in args.nnz:
            for share in args.shares:
                p = make_problem(m, 2048, 5632, nnz_per_row=nnz, dense_block_share=share, dense_block_nnz=args.dense_nnz,
                                 dense_block_placement=args.placement)
                x, wg, wu, wd = p.x, p.gate_weight, p.up_weight, p.down_weight
                set_route("twell")
                seen = dense_blocks_share(x, wg, m)
                times, outs = {}, {}
                for route in ("twell", "cublas", "routed"):
                    set_route(route)
                    for _ in range(3):  # the routed layer's first reports land and set its route
                        outs[route] = torch.ops.twell.gated_relu_mlp(x, wg, wu, wd)
                        torch.cuda.synchronize()
                    times[route] = cuda_graph_time_ms(lambda: torch.ops.twell.gated_relu_mlp(x, wg, wu, wd), args.reps,
                                                      args.graph_calls)
                for route in ("cublas", "routed"):
                    err = relative_error(outs[route], outs["twell"])
                    assert err < 1e-2, f"M={m} share {share}: {route} differs from twell by {err:.2e}"
                rows.append((m, nnz, share, seen, times))
                print(m, nnz, share, f"seen {seen:.3f}", {k: round(v * 1e3, 1) for k, v in times.items()}, flush=True)

    print(f"\nGPU: {torch.cuda.get_device_name()}  K=2048 N=5632 bf16, dense blocks ({args.placement}) at {args.dense_nnz:.0f} "
          f"active units per row, twell's dense path on {args.twell_tile_m}-row tiles, CUDA-graph replays "
          f"({args.graph_calls} call(s) a graph), median us per call; "
          "/cublas > 1: slower than the cuBLAS MLP; routed: the op's default, routing by observed density, once settled")
    print(f"{'M':>6} {'nnz':>4} {'share':>6} {'seen':>6} {'twell':>9} {'cublas':>9} {'routed':>9} "
          f"{'twell/cublas':>13} {'routed/cublas':>14}")
    for m, nnz, share, seen, times in rows:
        t, c, r = times["twell"] * 1e3, times["cublas"] * 1e3, times["routed"] * 1e3
        print(f"{m:>6} {nnz:>4.0f} {share:>6.3f} {seen:>6.3f} {t:>9.1f} {c:>9.1f} {r:>9.1f} {t / c:>13.2f} {r / c:>14.2f}")


if __name__ == "__main__":
    main()
