"""A/B of one kernel setting (a field of ``twell_compile.kernels.twell_mlp.config``) on the twell MLP op.

Both values run in one process on the same inputs. Each output is checked against a float64
reference, and whether the two are bit for bit equal is reported (settings that only change when a
kernel may be scheduled, as ``programmatic_launch``, must give equal bits; ones that change a sum's
order need not). Times alternate between the values, round by round: CUDA graphs of ``--graph-calls``
calls (each value's graph captured under it) and eager CUDA events. The dense MLP (three cuBLAS GEMMs)
is timed in the same rounds for the ratios. The table is printed last.

    python examples/ab_kernel_setting.py --setting programmatic_launch --values 0 1 --m 1 16 4096
    python examples/ab_kernel_setting.py --setting decode_gemv_cluster --values 0 4 --m 1 16 32 64
"""

from __future__ import annotations

import argparse
import statistics

import torch

import twell_compile  # noqa: F401  (registers torch.ops.twell)
from twell_compile.kernels import twell_mlp
from twell_compile.testing import (check_output, cuda_graph_time_ms, cuda_time_ms, kernel_config, make_problem,
                                   problem_references)

from bench_mlp import dense_mlp


def _parse_value(setting: str, text: str):
    """A value of the setting, typed as its current value is."""
    current = getattr(twell_mlp.config, setting)
    if isinstance(current, bool):
        return text not in ("0", "false", "False", "")
    return type(current)(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", required=True, help="a field of twell_mlp.config")
    parser.add_argument("--values", nargs=2, required=True, metavar=("A", "B"), help="B is compared with A")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 32, 1024, 4096, 16384, 131072])
    parser.add_argument("--nnz", type=float, nargs="+", default=[24.0])
    parser.add_argument("--kinds", nargs="+", default=["uniform"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--graph-calls", type=int, default=8)
    args = parser.parse_args(argv)
    if not hasattr(twell_mlp.config, args.setting):
        parser.error(f"no setting {args.setting!r} in twell_mlp.config")
    values = [_parse_value(args.setting, v) for v in args.values]
    a, b = values
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}; {args.setting}: A = {a!r}, B = {b!r}",
          flush=True)
    rows = []
    for m in args.m:
        for kind in args.kinds:
            for nnz in args.nnz:
                problem = make_problem(m, 2048, 5632, nnz_per_row=nnz / 2 if kind == "skewed" else nnz,
                                       skew=kind == "skewed")
                x, wg, wu, wd = problem.x, problem.gate_weight, problem.up_weight, problem.down_weight
                ref64, dense_same = problem_references(problem)
                op = lambda: torch.ops.twell.gated_relu_mlp(x, wg, wu, wd)  # noqa: E731
                outs = []
                for value in values:
                    with kernel_config(**{args.setting: value}):
                        outs.append(op())
                same = torch.equal(outs[0], outs[1])
                checks = [check_output(out, ref64, dense_same) for out in outs]
                reps = 10 if m >= 65536 else 50
                graph, eager = ([], []), ([], [])  # per value, A then B
                dense_graph, dense_eager = [], []
                for _ in range(args.rounds):
                    for side, value in enumerate(values):
                        with kernel_config(**{args.setting: value}):
                            graph[side].append(cuda_graph_time_ms(op, reps, args.graph_calls))
                            eager[side].append(cuda_time_ms(op, reps))
                    dense_graph.append(cuda_graph_time_ms(lambda: dense_mlp(x, wg, wu, wd), reps, args.graph_calls))
                    dense_eager.append(cuda_time_ms(lambda: dense_mlp(x, wg, wu, wd), reps))
                med = statistics.median
                row = dict(m=m, kind=kind, nnz=nnz, same=same, ok=all(c.failure is None for c in checks),
                           rel=max(c.err for c in checks),
                           g_a=med(graph[0]), g_b=med(graph[1]), g_dense=med(dense_graph),
                           e_a=med(eager[0]), e_b=med(eager[1]), e_dense=med(dense_eager))
                rows.append(row)
                print(row, flush=True)
                del outs, ref64, dense_same
                torch.cuda.empty_cache()
    print(f"\nGPU: {torch.cuda.get_device_name()}; {args.setting}: A = {a!r}, B = {b!r}; medians of {args.rounds} "
          f"alternating rounds; us per call; graphs of {args.graph_calls} calls")
    print("| M | kind | nnz | bitwise equal | exact | graph A | graph B | B/A | dense | x dense A | x dense B "
          "| eager A | eager B | B/A |")
    print("|" + "---|" * 14)
    for r in rows:
        us = lambda v: f"{v * 1000:.1f}"  # noqa: E731
        print(f"| {r['m']} | {r['kind']} | {r['nnz']:g} | {r['same']} | {r['ok']} | {us(r['g_a'])} | {us(r['g_b'])} "
              f"| {r['g_b'] / r['g_a']:.3f} | {us(r['g_dense'])} | {r['g_dense'] / r['g_a']:.2f}x "
              f"| {r['g_dense'] / r['g_b']:.2f}x | {us(r['e_a'])} | {us(r['e_b'])} | {r['e_b'] / r['e_a']:.3f} |")


if __name__ == "__main__":
    main()
