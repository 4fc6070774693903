"""A few small twell kernel calls for compute-sanitizer (memcheck / racecheck), see gpu_session.sh.

    python examples/sanitize_case.py [--float16-chunked-only]
"""

import sys

import torch

import twell_compile  # noqa: F401
from twell_compile.kernels import twell_mlp
from twell_compile.testing import make_problem

default_num_sms = twell_mlp._num_sms
default_cublas_rows = twell_mlp.config.cublas_rows
twell_mlp.config.cublas_rows = (1, 0)  # every case below on the TwELL kernels, whatever its size
twell_mlp.config.route_by_density = False  # and whatever its density

CASES = [(7, (257, 1031, 131), True, float("inf")), (300, (264, 1000, 200), False, 0.01),
         (130, (2048, 5632, 2048), True, 0.0),
         (100, (2048, 5632, 2048), True, float("inf")),  # sparse clusters, wgmma gate
         (128, (264, 1000, 200), False, 0.01),  # likewise, non-gated, mixed paths
         (64, (2048, 5632, 2048), True, float("inf")),  # decode gate: 4 MMA row tiles
         (16, (2048, 5632, 2048), True, float("inf")),  # decode gate: 1 row tile, partials pushed
         (40, (264, 1000, 200), True, 0.0),  # decode gate, then the dense path
         (1, (2048, 5632, 2048), False, float("inf")),  # decode, non-gated
         (64, (2048, 5632, 2048), True, 0.0),  # decode GEMVs of the dense path
         (7, (2048, 5632, 2048), False, 0.0),  # likewise, non-gated
         (520, (2048, 5632, 2048), True, 0.004),  # several tiles per CTA, mixed paths
         (1950, (200, 2600, 1400), True, 0.01),  # CTA pairs in all three GEMMs, odd tile counts
         (300, (2056, 2600, 1400), True, 0.0),  # K split in 3 ranges in all three GEMMs
         (4126, (200, 2600, 1400), True, 0.01),  # cooperative 256-row tiles everywhere (below)
         # The chunked kernel (below), with row 0 (all units active) a heavy row run
         # by the compact dense path (csrc/twell_heavy_rows.cu); mixed paths, then
         # non-gated with every block sparse.
         (600, (264, 1000, 200), True, 0.024),  # 3072 units a block: about half dense
         (601, (264, 1000, 200), False, float("inf"))]
CHUNKED_ROWS = (600, 601)  # the cases above that run the chunked kernel


def run_case(m, shape, gated, density, dtype=torch.bfloat16):
    k, f, d = shape
    # The last case: 256-row tiles in all three GEMMs, a last tile whose second half lies past the end,
    # and a tile of one dense and one sparse block on the dense path. The gate runs the staged
    # cooperative schedule (the default) wherever its tiles fill the grid (M = 520, 600, 601 and 4126),
    # ping-pong elsewhere.
    twell_mlp.config.gemm_tile_m = twell_mlp.config.down_gemm_tile_m = 256 if m == 4126 else 128
    twell_mlp.config.gate_gemm_tile_m = 256 if m in (520, *CHUNKED_ROWS, 4126) else 128
    # (The dense path at M = 130 splits the down projection's K by itself: 4 ranges.)
    twell_mlp.config.gemm_k_splits = 3 if k == 2056 else 0
    # The chunked sparse kernel (csrc/twell_sparse_chunked.cu) at M = 600 and 601, four CTAs (several
    # chunks each).
    twell_mlp.config.chunked_sparse_rows = min(CHUNKED_ROWS) if m in CHUNKED_ROWS else 0
    twell_mlp._num_sms = (lambda device: 4) if m in CHUNKED_ROWS else default_num_sms
    config = twell_mlp.config
    config.dense_block_density = config.decode_dense_block_density = config.chunked_dense_block_density = density
    twell_mlp.config.heavy_block_overflow_tiles = 2**31 - 1 if density == float("inf") else 16
    p = make_problem(m, k, f, d, nnz_per_row=24.0, gated=gated, bias=True, dense_rows=(0,), dtype=dtype)
    out = torch.ops.twell.gated_relu_mlp(*p.gated_args()) if gated else torch.ops.twell.relu_mlp(*p.non_gated_args())
    torch.cuda.synchronize()
    print("ok", m, k, f, d, gated, density, dtype, tuple(out.shape), bool(out.isfinite().all()))


float16_chunked_only = "--float16-chunked-only" in sys.argv[1:]
if not float16_chunked_only:
    for case in CASES:
        run_case(*case)
# The chunked kernel's cases again in float16 (its own template instance; 40 entries a thread since
# 2026-11-27, as bfloat16).
for case in CASES:
    if case[0] in CHUNKED_ROWS:
        run_case(*case, dtype=torch.float16)

if float16_chunked_only:
    sys.exit(0)
# The cuBLAS route (config.cublas_rows): its relu-times-up pass (csrc/twell_cublas_mlp.cu) over a
# multiple of 8 values and with a tail of 7 (65 x 1031 values).
twell_mlp.config.cublas_rows = default_cublas_rows
for m, (k, f, d), gated in [(256, (2048, 5632, 2048), True), (65, (257, 1031, 131), True), (300, (264, 1000, 200), False)]:
    p = make_problem(m, k, f, d, nnz_per_row=24.0, gated=gated, bias=True, dense_rows=(0,))
    out = torch.ops.twell.gated_relu_mlp(*p.gated_args()) if gated else torch.ops.twell.relu_mlp(*p.non_gated_args())
    torch.cuda.synchronize()
    print("ok cublas", m, k, f, d, gated, tuple(out.shape), bool(out.isfinite().all()))
