"""MLP-level benchmark: dense eager (cuBLAS), dense torch.compile, the gate GEMM alone, and twell.

All four are timed in the same run with CUDA events (median after warm-up) on the same inputs, at
the paper's 2B shape by default, for several token counts, densities, and uniform/skewed sparsity.
The last lines printed are the summary table; ``--json`` also writes every number to a file.

At up to 4096 rows the timed calls rotate through several weight sets (``--weight-sets``), enough that
the sets' gate weights hold twice the GPU's L2 cache, as a model's layers called in turn do: with one
set, the 23 MB gate weight of the 2B shape stays in the 50 MB L2 from call to call, which flatters
TwELL (it reads all of the gate but only the active rows of the others, where dense reads all 69 MB).
Errors are checked on the first set.

    python examples/bench_mlp.py                      # the full grid (several minutes)
    python examples/bench_mlp.py --m 131072 --nnz 24  # one point
"""

from __future__ import annotations

import argparse
import itertools
import json
import torch
import torch.nn.functional as F

import twell_compile  # noqa: F401  (registers torch.ops.twell)
from twell_compile import reference
from twell_compile.testing import cuda_graph_time_ms, cuda_time_ms, make_problem, relative_error


def dense_mlp(x, wg, wu, wd):
    return F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)


def weight_sets(requested: int, m: int, gate_weight: torch.Tensor) -> int:
    """``requested``, or for 0: at up to 4096 rows, enough sets that their gate weights hold twice the
    L2 cache (a model's layers do not find their weights in L2); above, one."""
    if requested > 0:
        return requested
    if m > 4096:
        return 1
    l2 = torch.cuda.get_device_properties(gate_weight.device).L2_cache_size
    return max(2, -(-2 * l2 // (gate_weight.numel() * gate_weight.element_size())))


def rotating(sets, call):
    """A function of no arguments that calls ``call(*weights)`` with the next weight set each time."""
    turn = itertools.cycle(sets)
    return lambda: call(*next(turn))


def reps_for(m: int) -> int:
    return 10 if m >= 65536 else 30 if m >= 4096 else 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--m", type=int, nargs="+", default=[131072, 16384, 4096, 256, 16, 1])
    parser.add_argument("--nnz", type=float, nargs="+", default=[24, 29, 39, 80])
    parser.add_argument("--kinds", nargs="+", default=["uniform", "skewed"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--json", default=None, help="write all results to this file")
    parser.add_argument("--weight-sets", type=int, default=0,
                        help="weight sets the timed calls rotate through; 0 (default): at up to 4096 rows "
                             "enough that their gate weights hold twice the L2 cache, else one")
    parser.add_argument("--graph-calls", type=int, default=8,
                        help="calls captured in each timed CUDA graph (times are per call): more spread the "
                             "graph's launch, which a replay timed alone includes, over them, as a model "
                             "captured whole does")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    k, f = args.hidden, args.intermediate

    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  dtype {args.dtype}  K={k} N={f}", flush=True)
    compiled_dense = torch.compile(dense_mlp, dynamic=True)
    rows = []
    for m in args.m:
        for kind in args.kinds:
            for nnz in args.nnz:
                # Skewed: heavy tokens and units (testing.make_problem), on half the base density; the heavy
                # units are active on about half of all rows, so the mean lands far above the target
                # (80-90 at the 2B shape for a target of 24): the mean measured is what the table prints.
                problem = make_problem(m, k, f, nnz_per_row=nnz / 2 if kind == "skewed" else nnz,
                                       skew=kind == "skewed", dtype=dtype)
                x, wg, wu, wd = problem.x, problem.gate_weight, problem.up_weight, problem.down_weight
                # Further weight sets from problems of the same kind: x's density column meets each set's
                # activated weight alike, so every set keeps the target density on x.
                n_sets = weight_sets(args.weight_sets, m, wg)
                sets = [(wg, wu, wd)] + [
                    (p.gate_weight, p.up_weight, p.down_weight) for p in (
                        make_problem(1, k, f, nnz_per_row=nnz / 2 if kind == "skewed" else nnz,
                                     skew=kind == "skewed", dtype=dtype) for _ in range(n_sets - 1))]
                with twell_compile.record_sparsity() as rec:
                    out = torch.ops.twell.gated_relu_mlp(x, wg, wu, wd)
                (stats,) = rec.calls()
                ref = reference.gated_relu_mlp(x.double(), wg.double(), wu.double(), wd.double())
                err_twell = relative_error(out, ref)
                err_dense = relative_error(dense_mlp(x, wg, wu, wd), ref)
                del ref, out
                reps = reps_for(m)
                twell_mlp = torch.ops.twell.gated_relu_mlp
                # Three warm-up calls per weight set, every side: a layer's first TwELL calls make its
                # re-laid W_down, its density reports and its lease, none of which a timed call should pay.
                warm = 3 * n_sets
                t_dense = cuda_time_ms(rotating(sets, lambda g, u, d: dense_mlp(x, g, u, d)), reps, warm)
                t_compiled = cuda_time_ms(rotating(sets, lambda g, u, d: compiled_dense(x, g, u, d)), reps, warm)
                t_gate = cuda_time_ms(rotating(sets, lambda g, u, d: F.linear(x, g)), reps, warm)
                t_twell = cuda_time_ms(rotating(sets, lambda g, u, d: twell_mlp(x, g, u, d)), reps, warm)
                # Small batches are launch-bound in eager mode, and up to 16384 rows the op's host time before
                # its first launch still shows; CUDA graphs (mode="reduce-overhead") show the kernels.
                graphed = m <= 16384
                calls = args.graph_calls
                t_dense_graph = (cuda_graph_time_ms(rotating(sets, lambda g, u, d: dense_mlp(x, g, u, d)), reps, calls)
                                 if graphed else None)
                t_twell_graph = (cuda_graph_time_ms(rotating(sets, lambda g, u, d: twell_mlp(x, g, u, d)), reps, calls)
                                 if graphed else None)
                # The path the timed calls took: a layer whose blocks mostly go dense is routed to cuBLAS
                # after its first calls (config.route_by_density).
                with twell_compile.record_sparsity() as rec:
                    torch.ops.twell.gated_relu_mlp(x, wg, wu, wd)
                (timed,) = rec.calls()
                row = dict(m=m, kind=kind, target_nnz=nnz, mean_nnz=stats.mean_nnz_per_row,
                           max_nnz=stats.max_nnz_per_row, overflow_rows=stats.overflow_rows,
                           dense_blocks=f"{stats.dense_blocks}/{stats.blocks}", dense_ms=t_dense,
                           compiled_ms=t_compiled, gate_ms=t_gate, twell_ms=t_twell,
                           speedup_vs_dense=t_dense / t_twell, speedup_vs_compiled=t_compiled / t_twell,
                           twell_over_gate=t_twell / t_gate, err_twell=err_twell, err_dense=err_dense,
                           dense_graph_ms=t_dense_graph, twell_graph_ms=t_twell_graph, path=timed.path,
                           weight_sets=n_sets)
                rows.append(row)
                print(json.dumps(row), flush=True)
                del problem, x, wg, wu, wd, sets
                torch.cuda.empty_cache()

    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), fh, indent=1)
    print(f"\nGPU: {torch.cuda.get_device_name()}  (K={k}, N={f}, {args.dtype}; ms are CUDA-event medians; "
          f"graphs of {args.graph_calls} call(s), times per call; 'sets': weight sets the calls rotate through; "
          f"'vs comp' is against torch.compile'd dense, whose per-call Dynamo overhead the op, called bare, "
          f"does not pay: at small M it mostly measures that overhead)")
    header = (f"{'M':>7} {'kind':<8} {'nnz':>6} {'max':>5} {'dense':>8} {'compiled':>8} {'gate':>8} {'twell':>8} "
              f"{'vs dense':>8} {'vs comp':>7} {'/gate':>6} {'err':>8} {'dense err':>9} {'dense blk':>9} "
              f"{'graphs: dense':>13} {'twell':>7} {'ratio':>6} {'path':>7} {'sets':>4}")
    print(header)
    for r in rows:
        print(f"{r['m']:>7} {r['kind']:<8} {r['mean_nnz']:>6.1f} {r['max_nnz']:>5} {r['dense_ms']:>8.3f} "
              f"{r['compiled_ms']:>8.3f} {r['gate_ms']:>8.3f} {r['twell_ms']:>8.3f} {r['speedup_vs_dense']:>7.2f}x "
              f"{r['speedup_vs_compiled']:>6.2f}x {r['twell_over_gate']:>6.2f} {r['err_twell']:>8.1e} "
              f"{r['err_dense']:>9.1e} {r['dense_blocks']:>9} " + (
                  f"{r['dense_graph_ms']:>13.3f} {r['twell_graph_ms']:>7.3f} "
                  f"{r['dense_graph_ms'] / r['twell_graph_ms']:>5.2f}x" if r['twell_graph_ms'] else f"{'-':>13} {'-':>7} {'-':>6}")
              + f" {r['path']:>7} {r['weight_sets']:>4}")


if __name__ == "__main__":
    main()
