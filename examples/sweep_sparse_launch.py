"""How the sparse kernel should split its work at a given token count: CUDA-graph replays of the whole
twell MLP call for each launch choice, beside the dense MLP, in one run.

Choices: one CTA per token with its output columns split over ``splits`` CTAs (128 or 256 threads;
each split computes the token's up projections again), or the entry split: a cluster of ``c`` CTAs per
token, each taking a share of its active units over all columns (256 threads). The call plan normally
picks the entry split for calls of at most 128 rows; this measures where it pays. ``path/sparse`` and
``path/dense`` time the plan's own launch with every block forced onto the sparse or the dense path,
which shows where the device-side choice between them should switch. ``ksplit/N`` sets the K ranges
per tile of the wgmma GEMMs (gate, and the dense path past 64 rows); ``chunked/R`` runs the chunked
sparse kernel (csrc/twell_sparse_chunked.cu) for calls of at least R rows (0: never); ``cublas/A-B``
the dense MLP through cuBLAS for calls of A to B rows (``cublas/0``: never); ``gatetile/128`` or
``/256`` the gate GEMM's schedule (config.gate_gemm_tile_m); ``gemvcluster/C`` the decode GEMVs' CTAs per
cluster (config.decode_gemv_cluster; 0: their own choice); ``densegemv/0`` runs the dense path of calls of at
most 64 rows on the wgmma GEMMs instead of the split-K GEMVs (config.decode_dense_gemv); ``route/1`` routes
the layer by its observed density (config.route_by_density, the op's default, off for every other choice here
so that each times the path it names; timed once the route has settled); parts combine with ``+``.

    python examples/sweep_sparse_launch.py --m 128 256 512 1024 2048 4096 --nnz 24 39
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import twell_compile  # noqa: F401  (registers torch.ops.twell)
from twell_compile.kernels import twell_mlp
from twell_compile.testing import cuda_graph_time_ms, make_problem, relative_error

CHOICES = ["columns/128", "columns/256", "entries/2", "entries/4", "entries/8"]
default_column_splits = twell_mlp._column_splits
default_threads, default_cluster = twell_mlp._sparse_threads, twell_mlp._sparse_cluster
default_thresholds = (twell_mlp.config.dense_block_density, twell_mlp.config.decode_dense_block_density,
                      twell_mlp.config.chunked_dense_block_density, twell_mlp.config.heavy_block_overflow_tiles)
default_k_splits = twell_mlp.config.gemm_k_splits
default_factor = twell_mlp.config.small_batch_density_factor
default_chunked_rows = twell_mlp.config.chunked_sparse_rows
default_cublas_rows = twell_mlp.config.cublas_rows
default_gate_tile_m = twell_mlp.config.gate_gemm_tile_m
default_gemv_cluster = twell_mlp.config.decode_gemv_cluster
default_dense_gemv = twell_mlp.config.decode_dense_gemv


def dense_mlp(x, wg, wu, wd):
    return F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)


def use_choice(choice: str) -> None:
    """Points the call plan at one launch choice (module-level hooks of twell_mlp and its config) and
    drops cached plans. ``path/sparse`` and ``path/dense`` keep the plan's launch and force every block
    onto one path; ``heavy/N`` and ``density/X`` keep it and set one threshold of the dense-block test
    (``density/X`` the large-call density, which calls of 129-4096 rows scale by ``factor/F``);
    ``ksplit/N`` sets the wgmma GEMMs' K ranges per tile (0: their own choice, 1: no split);
    ``chunked/R`` runs the chunked sparse kernel from R rows on (0: never); ``cublas/A-B`` gives calls of
    A to B rows to cuBLAS's dense MLP (``cublas/0``: none, the TwELL path everywhere); ``gatetile/T``
    sets the gate GEMM's schedule (128 ping-pong, 256 cooperative where its tiles fill the GPU);
    ``gemvcluster/C`` the decode GEMVs' cluster size (0: chosen per launch); ``densegemv/0`` the dense path
    of calls of at most 64 rows on the wgmma GEMMs; ``route/1`` routing by observed density. Parts
    joined by ``+`` combine (``path/dense+ksplit/1``)."""
    twell_mlp._column_splits = default_column_splits
    twell_mlp._sparse_threads, twell_mlp._sparse_cluster = default_threads, default_cluster
    cfg = twell_mlp.config
    (cfg.dense_block_density, cfg.decode_dense_block_density, cfg.chunked_dense_block_density,
     cfg.heavy_block_overflow_tiles) = default_thresholds
    cfg.gemm_k_splits = default_k_splits
    cfg.small_batch_density_factor = default_factor
    cfg.chunked_sparse_rows = default_chunked_rows
    cfg.cublas_rows = default_cublas_rows
    cfg.gate_gemm_tile_m = default_gate_tile_m
    cfg.decode_gemv_cluster = default_gemv_cluster
    cfg.decode_dense_gemv = default_dense_gemv
    cfg.route_by_density = False  # every choice times the path it names, unless it says route/1
    for part in choice.split("+"):
        _apply(part)
    twell_mlp._PLANS.clear()


def _apply(part: str) -> None:
    kind, value, *splits = part.split("/")
    cfg = twell_mlp.config
    if kind == "path":
        if value == "sparse":
            cfg.dense_block_density = cfg.decode_dense_block_density = cfg.chunked_dense_block_density = float("inf")
            cfg.heavy_block_overflow_tiles = 2**31 - 1
        elif value == "dense":
            cfg.dense_block_density = cfg.decode_dense_block_density = cfg.chunked_dense_block_density = 0.0
    elif kind == "heavy":
        cfg.heavy_block_overflow_tiles = int(value)
    elif kind == "density":
        cfg.dense_block_density = cfg.decode_dense_block_density = cfg.chunked_dense_block_density = float(value)
    elif kind == "factor":
        cfg.small_batch_density_factor = float(value)
    elif kind == "ksplit":
        cfg.gemm_k_splits = int(value)
    elif kind == "chunked":
        cfg.chunked_sparse_rows = int(value)
    elif kind == "cublas":
        cfg.cublas_rows = twell_mlp._row_range(value)
    elif kind == "gatetile":
        cfg.gate_gemm_tile_m = int(value)
    elif kind == "gemvcluster":
        cfg.decode_gemv_cluster = int(value)
    elif kind == "densegemv":
        cfg.decode_dense_gemv = value != "0"
    elif kind == "route":
        cfg.route_by_density = value != "0"
    elif kind == "columns":
        twell_mlp._sparse_threads = lambda m, threads=int(value): threads
        twell_mlp._sparse_cluster = lambda m, sms: 1
        if splits:
            twell_mlp._column_splits = lambda m, d, sms, vec8, n=int(splits[0]): n
    elif kind == "entries":
        twell_mlp._sparse_threads = lambda m: 256
        twell_mlp._sparse_cluster = lambda m, sms, cluster=int(value): cluster
    else:
        raise SystemExit(f"unknown choice {part!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--nnz", type=float, nargs="+", default=[24, 39])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--skew", action="store_true", help="skewed sparsity (heavy tokens and units), as bench_mlp.py")
    parser.add_argument("--choices", nargs="+", default=CHOICES,
                        help="columns/THREADS[/SPLITS] (SPLITS: the plan's own when left out), entries/CLUSTER, "
                             "path/sparse, path/dense (the plan's launch, every block forced onto one path), "
                             "heavy/TILES or density/FRACTION (the plan's launch, that dense-block threshold set; "
                             "calls of 129-4096 rows scale the density by factor/F, default 0.68), "
                             "ksplit/N (the wgmma GEMMs' K ranges per tile; 0 their own choice), chunked/R (the "
                             "chunked sparse kernel from R rows on; 0 never), cublas/A-B (calls of A-B rows "
                             "through cuBLAS; cublas/0 never), gatetile/128 or gatetile/256 (the gate GEMM's "
                             "schedule), route/1 (routing by observed density); join with +")
    args = parser.parse_args()
    rows = []
    for m in args.m:
        for nnz in args.nnz:
            # Skewed: as bench_mlp.py, half the base density so that the mean stays near the target.
            p = make_problem(m, 2048, 5632, nnz_per_row=nnz / 2 if args.skew else nnz, skew=args.skew)
            x, wg, wu, wd = p.x, p.gate_weight, p.up_weight, p.down_weight
            use_choice("path/auto")
            default = twell_mlp.sparse_launch(m, 2048, torch.cuda.get_device_properties(0).multi_processor_count, True)
            reference = torch.ops.twell.gated_relu_mlp(x, wg, wu, wd).float()
            t_dense = cuda_graph_time_ms(lambda: dense_mlp(x, wg, wu, wd), args.reps)
            times = {}
            for choice in args.choices:
                use_choice(choice)
                out = torch.ops.twell.gated_relu_mlp(x, wg, wu, wd)
                err = relative_error(out, reference)  # reads back: a route's first report is in by the next call
                assert err < 1e-2, f"{choice} at M={m}: relative difference {err:.2e} from the default launch"
                times[choice] = cuda_graph_time_ms(lambda: torch.ops.twell.gated_relu_mlp(x, wg, wu, wd), args.reps)
            rows.append((m, nnz, default, t_dense, times))
            print(m, nnz, f"dense {t_dense * 1e3:.1f} us", {c: round(t * 1e3, 1) for c, t in times.items()}, flush=True)
    use_choice("path/auto")

    print(f"\nGPU: {torch.cuda.get_device_name()}  K=2048 N=5632 bf16, {'skewed' if args.skew else 'uniform'}, "
          "CUDA-graph replays, median us; ratio = dense / twell")
    print(f"{'M':>6} {'nnz':>4} {'default':>14} {'dense':>7} " + " ".join(f"{c:>16}" for c in args.choices))
    for m, nnz, default, t_dense, times in rows:
        name = (f"entries/{default.cluster}" if default.entry_split
                else f"columns/{default.threads}/{default.splits}")
        cells = " ".join(f"{t * 1e3:>8.1f} ({t_dense / t:4.2f}x)" for t in times.values())
        print(f"{m:>6} {nnz:>4.0f} {name:>14} {t_dense * 1e3:>7.1f} {cells}")


if __name__ == "__main__":
    main()
