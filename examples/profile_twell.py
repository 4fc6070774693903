"""Per-kernel time of one twell MLP call (torch.profiler), to see where the time goes.

    python examples/profile_twell.py --m 131072 --nnz 24
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import twell_compile  # noqa: F401
from twell_compile.testing import make_problem


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=131072)
    parser.add_argument("--nnz", type=float, default=24.0)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--skew", action="store_true")
    parser.add_argument("--non-gated", action="store_true")
    args = parser.parse_args()
    p = make_problem(args.m, args.hidden, args.intermediate, nnz_per_row=args.nnz, skew=args.skew,
                     gated=not args.non_gated)

    def call():
        if args.non_gated:
            return torch.ops.twell.relu_mlp(*p.non_gated_args())
        return torch.ops.twell.gated_relu_mlp(*p.gated_args())

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    print(f"GPU: {torch.cuda.get_device_name()}  M={args.m} nnz={args.nnz} skew={args.skew}  (5 calls)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
