"""Per-kernel time of one twell MLP call (torch.profiler), to see where the time goes.

    python examples/profile_twell.py --m 131072 --nnz 24
"""

from __future__ import annotations

import argparse
import re

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
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--bias", action="store_true", help="biases on all three projections (as bench_model.py's)")
    parser.add_argument("--non-gated", action="store_true")
    parser.add_argument("--dense-path", action="store_true", help="every block forced onto the dense path")
    parser.add_argument("--dense-block-share", type=float, default=0.0,
                        help="this share of the 128-row blocks at 80 active units per row (dense)")
    parser.add_argument("--dense-block-placement", choices=["even", "random"], default="even")
    parser.add_argument("--k-splits", type=int, default=None, help="the wgmma GEMMs' K ranges per tile (0: automatic)")
    parser.add_argument("--chunked-rows", type=int, default=None,
                        help="run the chunked sparse kernel for calls of at least this many rows (0: never)")
    parser.add_argument("--flush-l2", action="store_true",
                        help="overwrite a 256 MB buffer before each call, so the call finds its weights out of L2, "
                             "as each layer of a model does")
    parser.add_argument("--heat", type=int, default=0, metavar="N",
                        help="run N 8192^3 bf16 matrix products before each call, so the call runs at the clock "
                             "of a GPU under sustained load, as in a whole model")
    parser.add_argument("--plain", type=int, default=0, metavar="CALLS",
                        help="only make CALLS calls, without torch.profiler (for Nsight Compute / Systems)")
    args = parser.parse_args()
    from twell_compile.kernels import twell_mlp

    twell_mlp.config.route_by_density = False  # profile the TwELL kernels even where a dense layer would leave them
    if args.dense_path:
        config = twell_mlp.config
        config.dense_block_density = config.decode_dense_block_density = config.chunked_dense_block_density = 0.0
    if args.k_splits is not None:
        twell_mlp.config.gemm_k_splits = args.k_splits
    if args.chunked_rows is not None:
        twell_mlp.config.chunked_sparse_rows = args.chunked_rows
    p = make_problem(args.m, args.hidden, args.intermediate, nnz_per_row=args.nnz, skew=args.skew,
                     gated=not args.non_gated, bias=args.bias, dtype=getattr(torch, args.dtype),
                     dense_block_share=args.dense_block_share, dense_block_placement=args.dense_block_placement)

    scratch = torch.empty(1 << 28, dtype=torch.uint8, device="cuda") if args.flush_l2 else None
    heat = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) if args.heat else None

    def call():
        for _ in range(args.heat):
            heat @ heat
        if scratch is not None:
            scratch.fill_(1)
        if args.non_gated:
            return torch.ops.twell.relu_mlp(*p.non_gated_args())
        return torch.ops.twell.gated_relu_mlp(*p.gated_args())

    if args.plain:
        for _ in range(args.plain):
            call()
        torch.cuda.synchronize()
        return
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    print(f"GPU: {torch.cuda.get_device_name()}  M={args.m} nnz={args.nnz} skew={args.skew} dtype={args.dtype} "
          f"dense_path={args.dense_path} dense_block_share={args.dense_block_share} ({args.dense_block_placement}) "
          f"k_splits={args.k_splits} chunked_rows={args.chunked_rows} "
          f"flush_l2={args.flush_l2} heat={args.heat} bias={args.bias}  (5 calls)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    # The same per kernel, under short names (the templates' epilogue tells the wgmma GEMMs apart).
    for event in prof.key_averages():
        if event.device_time_total > 0 and event.count:
            print(f"  {short_name(event.key):<44} {event.count // 5:>3} per call  {event.device_time_total / event.count:9.1f} us")


EPILOGUES = {"0": "pack (gate)", "1": "gate times up", "2": "store (down)"}


def short_name(name: str) -> str:
    """'twell_gemm_kernel<..., Epilogue)1, 2, 128>(...)' -> 'twell_gemm_kernel gate times up, 2, 128'."""
    base = re.search(r"(\w+_kernel\w*|\w+)(?=<|\(|$)", name)
    label = base.group(1) if base else name[:40]
    epilogue = re.search(r"Epilogue\)(\d)(?:, (\d+), (\d+))?", name)
    if epilogue:
        label += f" {EPILOGUES.get(epilogue.group(1), epilogue.group(1))}"
        if epilogue.group(2) and label.startswith("twell_gemm_kernel"):
            label += f" c{epilogue.group(2)} m{epilogue.group(3)}"
    return label


if __name__ == "__main__":
    main()
