"""The dense-path GEMVs of decode-sized calls (``csrc/twell_decode_gemv.cu``) against a float64 reference
(``pytest -m cuda``).

They run only when the call's decision block is dense: then every output element is checked (gate
times up: h = relu(gate) * round(x W_up^T + b), the gate read from the decode gate's TwELL output,
including tiles past capacity whose backup row the same kernel overwrites with h; store: out =
round(h W_down^T + b)); when the block is sparse, nothing may be written. Outputs start poisoned.
"""

from __future__ import annotations

import pytest
import torch

from helpers import requires_twell_kernels, twell_to_dense
from twell_compile.testing import make_problem

pytestmark = pytest.mark.cuda
TILE = 128
CAP = 8
INT_MAX = 2**31 - 1
DENSE = (0, 0, INT_MAX)  # thresholds that make the block dense once it has an active unit
SPARSE = (INT_MAX, INT_MAX, INT_MAX)


def _ext():
    from twell_compile.kernels import build

    return build.cuda_extension()


def _decode_gate(x, w, bias):
    m, f = x.shape[0], w.shape[0]
    tiles = -(-f // TILE)
    packed = torch.full((m, tiles, CAP), -7, dtype=torch.int32, device=x.device)
    counts = torch.full((m, tiles), -7, dtype=torch.int32, device=x.device)
    dense = torch.full((m, f), float("nan"), dtype=x.dtype, device=x.device)
    block_nnz = torch.zeros(2, dtype=torch.int32, device=x.device)
    _ext().decode_gate_twell(x, w, bias, packed, counts, dense, block_nnz)
    return packed, counts, dense, block_nnz


def _exact(a, b, bias):
    """The float64 product (plus bias)."""
    out = a.double() @ b.double().t()
    return out + bias.double() if bias is not None else out


def _assert_within_ulps(out, expected, ulps):
    """Every element within `ulps` units in the last place of the 16-bit dtype of the exact value (the
    fp32 split-K sums round once or twice on the way), and none left unwritten."""
    assert not out.isnan().any(), "an element was not written"
    diff = (out.double() - expected).abs()
    # |x| * 2^-(significand bits - 1) is at least one ulp of x. Near zero the fp32 sums' own error (a
    # few fp32 ulps of the terms, which are far larger than the result) dominates: allow 2^-12 of the
    # output's scale there.
    ulp = expected.abs() * (2.0 ** -7 if out.dtype == torch.bfloat16 else 2.0 ** -10)
    ulp = ulp + 2.0 ** -12 * expected.square().mean().sqrt()
    assert (diff <= ulps * ulp).all(), f"off by up to {(diff / ulp).max().item():.2f} ulps"


@requires_twell_kernels
@pytest.mark.parametrize("m,k,f,nnz,skew", [
    (1, 2048, 5632, 24.0, False),    # the 2B shape at one row
    (16, 2048, 5632, 600.0, False),  # almost every tile past capacity: h over the gate's backup rows
    (40, 264, 1000, 20.0, False),    # three MMA row tiles, 9 K chunks, a partial last tile
    (64, 2048, 5632, 40.0, True),    # four MMA row tiles, heavy rows and units
    (7, 2048, 136, 20.0, False),     # two column tiles: clusters of 16 where the GPU schedules them
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_gate_times_up_and_store(m, k, f, nnz, skew, dtype, bias):
    p = make_problem(m, k, f, 264, nnz_per_row=nnz, skew=skew, dtype=dtype, bias=bias)
    packed, counts, dense, block_nnz = _decode_gate(p.x, p.gate_weight, p.gate_bias)
    gate = twell_to_dense(packed, counts, dense)  # the decode gate's own rounding (its test checks it)
    _ext().decode_dense_gemv(p.x, p.up_weight, p.up_bias, dense, block_nnz, packed, counts, *DENSE)
    torch.cuda.synchronize()
    # h = g * round(up), rounded again: within two ulps of g times the exact up projection.
    _assert_within_ulps(dense, gate * _exact(p.x, p.up_weight, p.up_bias), 2)

    out = torch.full((m, 264), float("nan"), dtype=dtype, device="cuda")
    _ext().decode_dense_gemv(dense, p.down_weight, p.down_bias, out, block_nnz, None, None, *DENSE)
    torch.cuda.synchronize()
    _assert_within_ulps(out, _exact(dense, p.down_weight, p.down_bias), 1)


@requires_twell_kernels
@pytest.mark.parametrize("cluster", [0, 1, 5, 8, 16], ids=lambda c: f"cluster{c}")
def test_store_down_projection_with_many_chunks_and_few_tiles(cluster):
    """The 2B down projection's proportions: K = 5632, 16 column tiles (clusters of 16 on an H100/H200
    by default); every cluster size the launch may take gives the same sums up to fp32 order."""
    a = torch.randn(33, 5632, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 5632, device="cuda", dtype=torch.bfloat16) / 75
    bias = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    out = torch.full((33, 2048), float("nan"), dtype=torch.bfloat16, device="cuda")
    block_nnz = torch.tensor([1, 0], dtype=torch.int32, device="cuda")  # one active unit: dense at threshold 0
    _ext().decode_dense_gemv(a, b, bias, out, block_nnz, None, None, *DENSE, cluster)
    torch.cuda.synchronize()
    _assert_within_ulps(out, _exact(a, b, bias), 1)


@requires_twell_kernels
@pytest.mark.parametrize("gated", [True, False], ids=["gate-times-up", "store"])
def test_sparse_block_is_left_alone(gated):
    p = make_problem(16, 256, 1000, 256, nnz_per_row=24.0)
    packed, counts, dense, block_nnz = _decode_gate(p.x, p.gate_weight, None)
    c = torch.full((16, 1000 if gated else 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    if gated:
        before = dense.clone()
        _ext().decode_dense_gemv(p.x, p.up_weight, None, dense, block_nnz, packed, counts, *SPARSE)
        torch.cuda.synchronize()
        assert torch.equal(dense.isnan(), before.isnan()) and torch.equal(dense.nan_to_num(), before.nan_to_num())
    else:
        _ext().decode_dense_gemv(dense.nan_to_num(), p.down_weight, None, c, block_nnz, None, None, *SPARSE)
        torch.cuda.synchronize()
        assert c.isnan().all()


@requires_twell_kernels
def test_decode_dense_gemv_rejects_more_than_64_rows():
    a = torch.randn(65, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(65, 128, device="cuda", dtype=torch.bfloat16)
    block_nnz = torch.zeros(2, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="at most 64 rows"):
        _ext().decode_dense_gemv(a, b, None, c, block_nnz, None, None, *DENSE)
    with pytest.raises(RuntimeError, match="cluster must be 0"):
        _ext().decode_dense_gemv(a[:64], b, None, c[:64], block_nnz, None, None, *DENSE, 17)


@requires_twell_kernels
@pytest.mark.parametrize("m,k,f,nnz,skew", [
    (1, 2048, 5632, 24.0, False),    # the 2B shape at one row: clusters of 8, half the slots absent ranks
    (16, 2048, 5632, 600.0, False),  # almost every tile past capacity: the pairs' second counts
    (64, 2048, 5632, 40.0, True),    # heavy rows and units
    (7, 2048, 136, 20.0, False),     # two column tiles: clusters of 16 where the GPU schedules them
])
def test_gate_parts_sum_to_the_block_totals_and_steer_the_dense_path(m, k, f, nnz, skew):
    """Given gate_parts the decode gate writes one (active units, tiles past capacity) pair per CTA
    into slots that start as garbage, zeros for the ranks its clusters lack, and leaves block_nnz
    alone: the same TwELL output, and pairs that sum to the totals the zeroed-counter form adds up.
    The dense-path GEMV reads the same test from them."""
    p = make_problem(m, k, f, 264, nnz_per_row=nnz, skew=skew)
    packed, counts, dense, block_nnz = _decode_gate(p.x, p.gate_weight, p.gate_bias)
    tiles = -(-f // TILE)
    packed2, counts2 = torch.full_like(packed, -7), torch.full_like(counts, -7)
    dense2 = torch.full_like(dense, float("nan"))
    untouched = torch.full((2,), -7, dtype=torch.int32, device="cuda")
    parts = torch.full((tiles * 16 * 2,), -7, dtype=torch.int32, device="cuda")
    _ext().decode_gate_twell(p.x, p.gate_weight, p.gate_bias, packed2, counts2, dense2, untouched, 0, parts)
    torch.cuda.synchronize()
    assert torch.equal(counts2, counts)
    assert torch.equal(twell_to_dense(packed2, counts2, dense2), twell_to_dense(packed, counts, dense))
    pairs = parts.view(tiles, 16, 2)
    assert (pairs >= 0).all(), "a slot was not written"
    assert pairs.sum(dim=(0, 1)).tolist() == block_nnz.tolist()
    assert untouched.tolist() == [-7, -7]

    for thresholds, written in ((DENSE, True), (SPARSE, False)):
        out = torch.full((m, 264), float("nan"), dtype=dense.dtype, device="cuda")
        h = torch.randn(m, f, dtype=dense.dtype, device="cuda")
        _ext().decode_dense_gemv(h, p.down_weight, None, out, untouched, None, None, *thresholds, 0, parts)
        torch.cuda.synchronize()
        if written:
            _assert_within_ulps(out, _exact(h, p.down_weight, None), 1)
        else:
            assert out.isnan().all(), "a sparse block's dense path wrote"
