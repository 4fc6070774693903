"""A/B of programmatic dependent launch (``config.programmatic_launch``) on the twell MLP op.

Both settings run in one process on the same inputs: outputs must be bit for bit equal (the kernels
are deterministic, and the setting changes only when a kernel may be scheduled), and each is checked
against a float64 reference. Times alternate between the settings, round by round: CUDA graphs of
``--graph-calls`` calls (each setting's graph captured under it) and eager CUDA events. The dense
MLP (three cuBLAS GEMMs) is timed in the same rounds for the ratios. The table is printed last.

    python examples/ab_programmatic_launch.py --m 1 16 4096 131072
"""

from __future__ import annotations

import argparse
import statistics

import torch

import twell_compile  # noqa: F401  (registers torch.ops.twell)
from twell_compile.testing import (check_output, cuda_graph_time_ms, cuda_time_ms, kernel_config, make_problem,
                                   problem_references)

from bench_mlp import dense_mlp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 32, 1024, 4096, 16384, 131072])
    parser.add_argument("--nnz", type=float, nargs="+", default=[24.0])
    parser.add_argument("--kinds", nargs="+", default=["uniform"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--graph-calls", type=int, default=8)
    args = parser.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    rows = []
    for m in args.m:
        for kind in args.kinds:
            for nnz in args.nnz:
                problem = make_problem(m, 2048, 5632, nnz_per_row=nnz / 2 if kind == "skewed" else nnz,
                                       skew=kind == "skewed")
                x, wg, wu, wd = problem.x, problem.gate_weight, problem.up_weight, problem.down_weight
                ref64, dense_same = problem_references(problem)
                op = lambda: torch.ops.twell.gated_relu_mlp(x, wg, wu, wd)  # noqa: E731
                outs = {}
                for on in (False, True):
                    with kernel_config(programmatic_launch=on):
                        outs[on] = op()
                same = torch.equal(outs[False], outs[True])
                check = check_output(outs[True], ref64, dense_same)
                reps = 10 if m >= 65536 else 50
                graph = {False: [], True: []}
                eager = {False: [], True: []}
                dense_graph, dense_eager = [], []
                for _ in range(args.rounds):
                    for on in (False, True):
                        with kernel_config(programmatic_launch=on):
                            graph[on].append(cuda_graph_time_ms(op, reps, args.graph_calls))
                            eager[on].append(cuda_time_ms(op, reps))
                    dense_graph.append(cuda_graph_time_ms(lambda: dense_mlp(x, wg, wu, wd), reps, args.graph_calls))
                    dense_eager.append(cuda_time_ms(lambda: dense_mlp(x, wg, wu, wd), reps))
                med = statistics.median
                row = dict(m=m, kind=kind, nnz=nnz, same=same, ok=check.failure is None, rel=check.err,
                           g_off=med(graph[False]), g_on=med(graph[True]), g_dense=med(dense_graph),
                           e_off=med(eager[False]), e_on=med(eager[True]), e_dense=med(dense_eager))
                rows.append(row)
                print(row, flush=True)
                del outs, ref64, dense_same
                torch.cuda.empty_cache()
    print(f"\nGPU: {torch.cuda.get_device_name()}; medians of {args.rounds} alternating rounds; us per call; "
          f"graphs of {args.graph_calls} calls")
    print("| M | kind | nnz | bitwise equal | exact | graph off | graph on | on/off | dense | x dense off | x dense on "
          "| eager off | eager on | on/off |")
    print("|" + "---|" * 14)
    for r in rows:
        us = lambda v: f"{v * 1000:.1f}"  # noqa: E731
        print(f"| {r['m']} | {r['kind']} | {r['nnz']:g} | {r['same']} | {r['ok']} | {us(r['g_off'])} | {us(r['g_on'])} "
              f"| {r['g_on'] / r['g_off']:.3f} | {us(r['g_dense'])} | {r['g_dense'] / r['g_off']:.2f}x "
              f"| {r['g_dense'] / r['g_on']:.2f}x | {us(r['e_off'])} | {us(r['e_on'])} | {r['e_on'] / r['e_off']:.3f} |")


if __name__ == "__main__":
    main()
