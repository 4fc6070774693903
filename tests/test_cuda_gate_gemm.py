"""The gate GEMMs' TwELL output (wgmma GEMM, decode GEMV) against a float64 reference (``pytest -m cuda``).

Checks the format itself, not just the MLP built on it: every (row, tile) count is the true number of
active units, packed slots hold exactly the active (column, value) pairs, overflowing tiles hold the
rounded pre-activation in the backup, and the per-block totals that steer the dense/sparse decision
add up. Buffers start poisoned, so anything the kernel should have written and did not shows.
"""

from __future__ import annotations

import pytest
import torch

from helpers import requires_twell_kernels, twell_to_dense
from twell_compile.testing import make_problem

pytestmark = pytest.mark.cuda
TILE = 128
CAP = 8


# (cluster, tile_m, ctas, k_splits): ping-pong in single CTAs and in pairs on the whole GPU; the
# cooperative schedule on a grid of 2 CTAs, so that it runs (rather than falling back to ping-pong for
# want of tiles) at every shape, with many tiles per CTA; K split in 3 ranges (unequal where the
# K-slices do not divide by 3; one range where K is one slice) with many units per CTA.
SCHEDULES = {"single": (1, 128, None, 1), "pairs": (2, 128, None, 1), "coop": (1, 256, 2, 1),
             "coop-pairs": (2, 256, 2, 1), "split3": (2, 128, None, 3)}


def _run_gate(x, w, bias, cap=CAP, cluster=2, tile_m=128, ctas=None, k_splits=1, decode=False):
    from twell_compile.kernels import build

    m, f = x.shape[0], w.shape[0]
    tiles = -(-f // TILE)
    packed = torch.full((m, tiles, cap), -7, dtype=torch.int32, device=x.device)
    counts = torch.full((m, tiles), -7, dtype=torch.int32, device=x.device)
    dense = torch.full((m, f), float("nan"), dtype=x.dtype, device=x.device)
    block_nnz = torch.zeros(2 * -(-m // 128), dtype=torch.int32, device=x.device)
    if ctas is None:
        ctas = torch.cuda.get_device_properties(x.device).multi_processor_count
    if decode:
        build.cuda_extension().decode_gate_twell(x, w, bias, packed, counts, dense, block_nnz)
    else:
        build.cuda_extension().gate_twell_gemm(x, w, bias, packed, counts, dense, block_nnz, ctas, cluster, tile_m,
                                               k_splits)
    return packed, counts, dense, block_nnz


@requires_twell_kernels
@pytest.mark.parametrize("m,k,f,nnz,skew", [
    (300, 264, 1000, 20.0, False),   # tails in M and F, K of 264 (not a multiple of 64)
    (4097, 2048, 5632, 24.0, False),  # the 2B shape, many tiles per CTA (ping-pong and ring wrap-around)
    (1950, 200, 2600, 24.0, False),   # pairs: 21 column tiles (the last pair is half empty), a last row
                                      # tile of 30 rows (one multicast half wholly past the end)
    (1000, 2048, 5632, 600.0, False),  # almost every tile past capacity
    (2048, 2048, 5632, 40.0, True),   # skewed: heavy rows and units
    (129, 8, 130, 20.0, False),       # one K step, one column past a tile
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_gate_gemm_writes_exact_twell(m, k, f, nnz, skew, dtype, bias, schedule):
    problem = make_problem(m, k, f, nnz_per_row=nnz, skew=skew, dtype=dtype, bias=bias)
    x, w, b = problem.x, problem.gate_weight, problem.gate_bias
    _assert_exact_twell(x, w, b, *_run_gate(x, w, b, CAP, *SCHEDULES[schedule]))


@requires_twell_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_gate_gemm_bias_off_4_byte_alignment(dtype, schedule):
    # Every schedule loads the bias two columns at a time where it is 4-byte aligned (load_bias_pairs); a
    # view one element into a larger tensor takes the one-value loads instead, with the same bits out.
    problem = make_problem(300, 264, 1000, nnz_per_row=20.0, dtype=dtype, bias=True)
    x, w, b = problem.x, problem.gate_weight, problem.gate_bias
    shifted = torch.empty(b.numel() + 1, dtype=b.dtype, device=b.device)[1:]
    shifted.copy_(b)
    assert shifted.data_ptr() % 4 == 2
    aligned = _run_gate(x, w, b, CAP, *SCHEDULES[schedule])
    unaligned = _run_gate(x, w, shifted, CAP, *SCHEDULES[schedule])
    for a, u in zip(aligned, unaligned):
        assert torch.equal(a.view(torch.int16) if a.is_floating_point() else a,
                           u.view(torch.int16) if u.is_floating_point() else u)
    _assert_exact_twell(x, w, shifted, *unaligned)


@requires_twell_kernels
@pytest.mark.parametrize("m,k,f,nnz,skew", [
    (1, 2048, 5632, 24.0, False),    # decode at the 2B shape: one row, clusters of 8 CTAs
    (7, 264, 1000, 20.0, False),     # K of 264: 9 chunks of 32 over a cluster of 8 (2 per CTA; 3 CTAs
                                     # idle, one with a partial chunk)
    (16, 2048, 5632, 600.0, False),  # almost every tile past capacity
    (33, 8, 130, 20.0, False),       # one K chunk (a cluster of 1), three MMA row tiles, a 2-column tile
    (50, 2048, 5632, 40.0, True),    # skewed: heavy rows and units
    (64, 1000, 70000, 200.0, True),  # four MMA row tiles; units past 16-bit indices
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_decode_gate_writes_exact_twell(m, k, f, nnz, skew, dtype, bias):
    problem = make_problem(m, k, f, nnz_per_row=nnz, skew=skew, dtype=dtype, bias=bias)
    x, w, b = problem.x, problem.gate_weight, problem.gate_bias
    _assert_exact_twell(x, w, b, *_run_gate(x, w, b, CAP, decode=True))


def _assert_exact_twell(x, w, b, packed, counts, dense, block_nnz, cap=CAP):
    torch.cuda.synchronize()
    m, f, dtype = x.shape[0], w.shape[0], x.dtype
    tiles = -(-f // TILE)
    pre64 = x.double() @ w.double().t() + (b.double() if b is not None else 0.0)
    ref_bits = pre64.to(dtype)  # what eager's linear rounds to
    active = torch.zeros(m, tiles * TILE, dtype=torch.bool, device=x.device)
    active[:, :f] = ref_bits > 0
    ref_counts = active.view(m, tiles, TILE).sum(-1).int()
    # fp32 accumulation order may flip a value within an ulp of zero: allow a few in ten thousand
    assert (counts != ref_counts).sum().item() <= max(2, counts.numel() // 5000)

    # Every live slot names a column of its tile, once; then relu(gate) rebuilt from the format.
    fits = counts <= cap
    live = (torch.arange(cap, device=x.device) < counts[..., None]) & fits[..., None]
    cols = (packed.long() & 0xFFFFFFFF) & 0xFFFF
    assert (cols[live] < TILE).all()
    r, t, s = live.nonzero(as_tuple=True)
    hits = torch.zeros(m, tiles, TILE, dtype=torch.int32, device=x.device)
    hits.index_put_((r, t, cols[r, t, s]), torch.ones_like(r, dtype=torch.int32), accumulate=True)
    assert hits.max() <= 1, "a column was packed twice"
    gate = torch.zeros(m, tiles * TILE, dtype=torch.float64, device=x.device)
    gate[:, :f] = twell_to_dense(packed, counts, dense)
    expected = torch.zeros(m, tiles * TILE, dtype=torch.float64, device=x.device)
    expected[:, :f] = ref_bits.double().relu()
    assert not gate.isnan().any(), "an overflowing tile's backup was not written"
    err = (gate - expected).norm() / expected.norm()
    assert err < 2e-3, err

    blocks = -(-m // 128)
    per_row = torch.zeros(blocks * 128, dtype=torch.int64, device=x.device)
    per_row[:m] = counts.sum(1)
    assert torch.equal(per_row.view(blocks, 128).sum(1).int(), block_nnz[:blocks])
    per_row.zero_()
    per_row[:m] = (counts > cap).sum(1)
    assert torch.equal(per_row.view(blocks, 128).sum(1).int(), block_nnz[blocks:])


@requires_twell_kernels
def test_gate_gemm_rejects_unaligned_rows():
    from twell_compile.kernels import build

    x = torch.randn(256, 12, device="cuda", dtype=torch.bfloat16)  # 24-byte rows: not TMA-able
    w = torch.randn(128, 12, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="16-byte aligned rows"):
        _run_gate(x, w, None)


@requires_twell_kernels
@pytest.mark.parametrize("schedule,message", [
    (dict(cluster=3), "cluster must be 1 or 2"),
    (dict(tile_m=64), "tile_m must be 128 or 256"),
    (dict(k_splits=17), "k_splits must be 0 \\(automatic\\) to 16"),
    (dict(k_splits=-1), "k_splits must be 0 \\(automatic\\) to 16"),
], ids=["cluster", "tile_m", "k_splits_high", "k_splits_negative"])
def test_gate_gemm_rejects_bad_schedule(schedule, message):
    x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        _run_gate(x, w, None, **schedule)


@requires_twell_kernels
def test_decode_gate_rejects_more_than_64_rows():
    x = torch.randn(65, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="at most 64 rows"):
        _run_gate(x, w, None, decode=True)
