"""The chunked sparse kernel (csrc/twell_sparse_chunked.cu) against a float64 reference (``pytest -m
cuda``; skipped without a Hopper GPU).

It serves calls of at least ``config.chunked_sparse_rows`` rows; here that limit is lowered so that
small problems take it too. Rows with more than 256 active units in sparse blocks ("heavy" rows) go to
the compact dense path (csrc/twell_heavy_rows.cu), so the adversarial cases check the two together.
Buffers are poisoned, so unwritten rows show.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import twell_compile
from helpers import requires_twell_kernels
from test_cuda_kernels import ADVERSARIAL, _check, _run
from twell_compile.kernels import build, twell_mlp
from twell_compile.testing import _normal_quantile, kernel_config, make_problem

pytestmark = pytest.mark.cuda

# Every call past the entry-split sizes, the ones the plan would give to cuBLAS included.
CHUNKED = dict(chunked_sparse_rows=129, cublas_rows=(1, 0), route_by_density=False)


def _run_chunked(problem, gated, path="auto", **extra):
    with kernel_config(**CHUNKED, **extra):
        return _run(problem, gated, path)


def _plan_is_chunked(m, f, d):
    with kernel_config(**CHUNKED):
        return twell_mlp.call_plan(m, f, d, torch.device("cuda")).cuda.chunked


@requires_twell_kernels
@pytest.mark.parametrize("m", [129, 300, 4097])
@pytest.mark.parametrize("shape", [(2048, 5632, 2048), (264, 1000, 200), (1024, 2048, 512)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_uniform_sparsity(m, shape, dtype, bias, gated):
    k, f, d = shape
    assert _plan_is_chunked(m, f, d)
    problem = make_problem(m, k, f, d, nnz_per_row=min(24.0, f / 8), gated=gated, bias=bias, dtype=dtype)
    for path in ("auto", "sparse"):
        _check(*_run_chunked(problem, gated, path), f"m={m} {shape} {dtype} bias={bias} gated={gated} {path}")


# Rows of 41-256 active units: two to seven pieces each (bfloat16; 33-256, two to eight in float16),
# their partials summed by the first; heavier rows of the skewed case go to the compact dense path.
MULTI_PIECE = {"pieces_2_to_4": dict(nnz_per_row=80.0), "pieces_up_to_7": dict(nnz_per_row=200.0, skew=True)}


@requires_twell_kernels
@pytest.mark.parametrize("case", sorted(ADVERSARIAL) + sorted(MULTI_PIECE))
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("path", ["auto", "sparse"])
def test_adversarial_sparsity(case, gated, path):
    kwargs = dict(ADVERSARIAL.get(case) or MULTI_PIECE[case])
    k, f, d = 2048, 5632, 2048
    if kwargs["nnz_per_row"] < 1:
        kwargs["nnz_per_row"] *= f
    problem = make_problem(1000, k, f, d, gated=gated, bias=True, **kwargs)
    _check(*_run_chunked(problem, gated, path), f"{case} gated={gated} path={path}")


@requires_twell_kernels
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_many_chunks_per_cta_and_deterministic(gated, monkeypatch):
    # Four CTAs for a 4097-row call: each runs several chunks back to back (the slice pipeline carries
    # over from one chunk to the next), with warps running up to a slice apart. Each grid's result must
    # be exact and the same run to run. Across grids they agree to rounding only: a piece's load order
    # (and so its down projection's summation order) is planned with the 7 other pieces of its quarter
    # warp, and the grid decides which pieces those are.
    problem = make_problem(4097, 2048, 5632, gated=gated, bias=True, nnz_per_row=60.0, skew=True)
    first, ref64, dense_same_dtype = _run_chunked(problem, gated, "sparse")
    _check(first, ref64, dense_same_dtype, "all SMs")
    again, _, _ = _run_chunked(problem, gated, "sparse")
    assert torch.equal(first, again)
    monkeypatch.setattr(twell_mlp, "_num_sms", lambda device: 4)
    few, _, _ = _run_chunked(problem, gated, "sparse")
    _check(few, ref64, dense_same_dtype, "4 CTAs")
    few_again, _, _ = _run_chunked(problem, gated, "sparse")
    assert torch.equal(few, few_again)
    scale = ref64.abs().max().item()
    assert (first.double() - few.double()).abs().max().item() <= 2e-2 * scale


@requires_twell_kernels
def test_agrees_with_the_row_by_row_kernel():
    # The chunked kernel sums a piece's entries in its planned load order and the up projection in
    # slices, so the two kernels agree to rounding, not bit for bit.
    problem = make_problem(2048, 2048, 5632, nnz_per_row=24.0, bias=True)
    chunked, ref64, _ = _run_chunked(problem, True)
    with kernel_config(chunked_sparse_rows=0):
        row_by_row, _, _ = _run(problem, True, "auto")
    scale = ref64.abs().max().item()
    assert (chunked.double() - row_by_row.double()).abs().max().item() <= 2e-2 * scale


@requires_twell_kernels
def test_cuda_graph_capture_and_replay():
    problem = make_problem(1024, 2048, 5632, nnz_per_row=24.0, bias=True)
    args = problem.gated_args()
    with kernel_config(**CHUNKED):
        eager = torch.ops.twell.gated_relu_mlp(*args)  # warm-up: builds the plan and the weight caches
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = torch.ops.twell.gated_relu_mlp(*args)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(static_out, eager)


@requires_twell_kernels
def test_weight_update_invalidates_sliced_weights():
    problem = make_problem(1024, 2048, 5632, nnz_per_row=24.0)
    args = list(problem.gated_args())
    with kernel_config(**CHUNKED):
        before = torch.ops.twell.gated_relu_mlp(*args)
        with torch.no_grad():
            args[2].mul_(-2.0)  # in place: the up weight
            args[3].mul_(0.5)  # and the down weight
        after = torch.ops.twell.gated_relu_mlp(*args)
    torch.testing.assert_close(after, before * -1.0, rtol=2e-2, atol=2e-2 * before.abs().max().item())


@requires_twell_kernels
def test_shapes_that_do_not_fit_are_declined():
    ext = build.cuda_extension()
    assert ext.chunked_sparse_fits(2048, 5632, 2048, 2, True)
    assert not ext.chunked_sparse_fits(4096, 11008, 4096, 2, True)  # two slices of 11008 units: 352 KB
    assert not ext.chunked_sparse_fits(2048, 5632, 2044, 2, True)  # D % 8
    assert not _plan_is_chunked(4097, 11008, 4096)
    assert not _plan_is_chunked(128, 5632, 2048)  # the entry split's sizes
    with kernel_config(chunked_sparse_rows=0):
        assert not twell_mlp.call_plan(131072, 5632, 2048, torch.device("cuda")).cuda.chunked


def _recorded_run(problem, gated, **extra):
    with twell_compile.record_sparsity() as rec:
        result = _run_chunked(problem, gated, "auto", **extra)
    (call,) = rec.calls()
    return result, call


@requires_twell_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_heavy_rows_run_densely_without_their_blocks(dtype, gated):
    # Fully active rows spread over sparse blocks (the first, the last, a partial last block's): they run
    # as a compact dense MLP of their own, and every block stays sparse.
    heavy = (0, 5, 127, 128, 700, 1000, 1031)
    problem = make_problem(1032, 2048, 5632, nnz_per_row=24.0, dense_rows=heavy, gated=gated, bias=True, dtype=dtype)
    (out, ref64, dense_same_dtype), call = _recorded_run(problem, gated)
    _check(out, ref64, dense_same_dtype, f"heavy rows {dtype} gated={gated}")
    assert call.dense_blocks == 0 and call.max_nnz_per_row == 5632


@requires_twell_kernels
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_too_many_heavy_rows_send_their_block_dense(gated):
    # Block 0 has 17 heavy rows (past heavy_block_overflow_tiles = 16): the dense path; block 1 has 16.
    heavy = tuple(range(17)) + tuple(range(128, 144))
    problem = make_problem(300, 2048, 5632, nnz_per_row=24.0, dense_rows=heavy, gated=gated, bias=True)
    (out, ref64, dense_same_dtype), call = _recorded_run(problem, gated)
    _check(out, ref64, dense_same_dtype, f"17 and 16 heavy rows gated={gated}")
    assert (call.dense_blocks, call.blocks) == (1, 3)


@requires_twell_kernels
def test_heavy_rows_count_as_rows_at_the_threshold_density():
    # 400 active units per row everywhere: each row is heavy and counts as a row at 1.8% (101 units), so a
    # full block (12928 of 12975 at most) stays sparse but over 16 heavy rows sends it dense anyway.
    problem = make_problem(256, 2048, 5632, nnz_per_row=400.0, bias=True)
    _, call = _recorded_run(problem, True)
    assert call.dense_blocks == 2
    (out, ref64, dense_same_dtype), call = _recorded_run(problem, True, heavy_block_overflow_tiles=2**31 - 1)
    _check(out, ref64, dense_same_dtype, "every row heavy, no per-block limit")
    assert call.dense_blocks == 0


@requires_twell_kernels
@pytest.mark.parametrize("dense_blocks, expected", [(6, 10), (4, 4)])
def test_every_block_goes_dense_when_most_would(dense_blocks, expected):
    # 10 blocks, the first ones at 160 active units per row (past 1.8%): with 6 of 10 such blocks the
    # others follow them onto the dense path; with 4 they stay sparse.
    f = 5632
    problem = make_problem(1280, 2048, f, nnz_per_row=24.0, bias=True)
    x = problem.x.clone()
    x[: 128 * dense_blocks, 0] = _normal_quantile(160 / f)  # column 0 carries each row's density shift
    (out, ref64, dense_same_dtype), call = _recorded_run(dataclasses.replace(problem, x=x), True)
    _check(out, ref64, dense_same_dtype, f"{dense_blocks} dense blocks of 10")
    assert call.dense_blocks == expected
