"""TwELL CUDA kernels against a float64 reference (``pytest -m cuda``; skipped without a Hopper GPU).

Every case draws fresh random inputs, poisons every output and work buffer first (so unwritten
elements show as NaN), and requires the bf16/fp16 kernel error to be in line with the error of the
dense MLP computed by PyTorch in the same dtype, over the whole output and element by element.
"""

from __future__ import annotations


import pytest
import torch

import twell_compile  # noqa: F401
from twell_compile import reference
from helpers import KERNEL_PATHS, KERNELS_ONLY, requires_twell_kernels
from twell_compile.testing import check_output, kernel_config, make_problem, problem_references, relative_error

pytestmark = pytest.mark.cuda


# "default" is the op as shipped, cuBLAS route included; the others are KERNEL_PATHS (helpers.py).
PATHS = KERNEL_PATHS
DEFAULT = "default"


def _run(problem, gated: bool, path: str):
    overrides = {"poison_buffers": True, **({} if path == DEFAULT else PATHS[path])}
    with kernel_config(**overrides):
        if gated:
            out = torch.ops.twell.gated_relu_mlp(*problem.gated_args())
        else:
            out = torch.ops.twell.relu_mlp(*problem.non_gated_args())
    torch.cuda.synchronize()
    return (out, *problem_references(problem, gated))


def _check(out, ref64, dense_same_dtype, what: str):
    result = check_output(out, ref64, dense_same_dtype)
    assert result.failure is None, f"{what}: {result.failure}"
    return result.err


SHAPES = [
    (2048, 5632, 2048),  # the paper's 2B shape
    (257, 1031, 131),  # odd everything: scalar paths and tails
    (264, 1000, 200),  # multiples of 8 but not of the tiles
]


@requires_twell_kernels
@pytest.mark.parametrize("m", [1, 7, 64, 255, 256, 4097])  # up to 64: the decode gate
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_uniform_sparsity(m, shape, dtype, bias, gated):
    k, f, d = shape
    problem = make_problem(m, k, f, d, nnz_per_row=min(24.0, f / 8), gated=gated, bias=bias, dtype=dtype)
    for path in (DEFAULT, "auto", "sparse", "dense"):
        _check(*_run(problem, gated, path), f"m={m} {shape} {dtype} bias={bias} gated={gated} {path}")


ADVERSARIAL = {
    "one_full_row": dict(nnz_per_row=24.0, dense_rows=(5,)),
    "first_token_dense": dict(nnz_per_row=24.0, dense_rows=(0,)),
    "half_dense": dict(nnz_per_row=0.5),  # fraction below, scaled by the intermediate size
    "every_tile_over_capacity": dict(nnz_per_row=0.45),
    "skewed": dict(nnz_per_row=40.0, skew=True),
}


@requires_twell_kernels
@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("m", [40, 1000])  # 40: the decode gate (three 16-row MMA tiles)
def test_adversarial_sparsity(case, gated, path, m):
    kwargs = dict(ADVERSARIAL[case])
    k, f, d = 2048, 5632, 2048
    if kwargs["nnz_per_row"] < 1:
        kwargs["nnz_per_row"] *= f
    problem = make_problem(m, k, f, d, gated=gated, bias=True, **kwargs)
    _check(*_run(problem, gated, path), f"{case} gated={gated} path={path} m={m}")


@requires_twell_kernels
@pytest.mark.parametrize("m", [65, 100, 128])
@pytest.mark.parametrize("case", ["uniform", "one_full_row", "skewed"])
@pytest.mark.parametrize("shape", [(2048, 5632, 2048), (264, 1000, 200)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_clustered_sparse_kernel_past_decode_sizes(m, case, shape, gated):
    # 65-128 rows: the wgmma gate and dense path, with the sparse kernel's clusters sharing each row's units.
    from twell_compile.kernels import twell_mlp

    k, f, d = shape
    assert twell_mlp.sparse_launch(m, d, torch.cuda.get_device_properties(0).multi_processor_count, True).entry_split
    kwargs = dict(nnz_per_row=24.0) if case == "uniform" else dict(ADVERSARIAL[case])
    problem = make_problem(m, k, f, d, gated=gated, bias=True, **kwargs)
    for path in ("auto", "sparse", "dense"):
        _check(*_run(problem, gated, path), f"m={m} {case} {shape} gated={gated} {path}")


@requires_twell_kernels
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_many_tokens(gated):
    problem = make_problem(131072, 2048, 5632, gated=gated, nnz_per_row=24.0, skew=True)
    _check(*_run(problem, gated, "auto"), "M=131072 skewed")


@requires_twell_kernels
def test_intermediate_beyond_16_bit_indices():
    f = 70000
    problem = make_problem(64, 64, f, 64, nnz_per_row=200.0, skew=True)
    # make sure units past 65536 are active for some tokens
    pre = problem.x.float() @ problem.gate_weight.float().t()
    assert (pre[:, 65536:] > 0).any()
    for path in ("sparse", "dense"):
        _check(*_run(problem, True, path), f"F={f} {path}")


@requires_twell_kernels
def test_float32_uses_exact_reference():
    problem = make_problem(33, 64, 128, dtype=torch.float32, nnz_per_row=8.0)
    out = torch.ops.twell.gated_relu_mlp(*problem.gated_args())
    torch.testing.assert_close(out, reference.gated_relu_mlp(*problem.gated_args()))


@requires_twell_kernels
@pytest.mark.parametrize("m", [16, 1024, 4097])  # decode GEMVs, the cuBLAS-free kernels, row by row
@pytest.mark.parametrize("path", ["auto", "sparse", "dense"])
def test_row_slices_of_a_fused_weight_give_the_same_bits(m, path):
    # What the pass hands the op for a fused gate-and-up projection (passes/fused_projection.py): row
    # slices of one weight and bias. Up comes first in the fused weight here, so the gate's slice is
    # the one at a storage offset (Phi-3 puts the gate first). Same values as separate weights, the
    # same alignment, so the same bits.
    problem = make_problem(m, 2048, 5632, nnz_per_row=24.0, bias=True, dense_rows=(0,))
    fused_weight = torch.cat([problem.up_weight, problem.gate_weight])
    fused_bias = torch.cat([problem.up_bias, problem.gate_bias])
    f = problem.gate_weight.shape[0]
    sliced = (problem.x, fused_weight[f:], fused_weight[:f], problem.down_weight, fused_bias[f:], fused_bias[:f],
              problem.down_bias)
    assert sliced[1].storage_offset() == f * 2048 and sliced[1].is_contiguous()
    with kernel_config(poison_buffers=True, **PATHS[path]):
        expected = torch.ops.twell.gated_relu_mlp(*problem.gated_args())
        actual = torch.ops.twell.gated_relu_mlp(*sliced)
    assert torch.equal(actual, expected)
    _check(actual, *problem_references(problem, True), f"m={m} {path}, sliced weights")


@requires_twell_kernels
def test_no_aliasing_and_inputs_untouched():
    problem = make_problem(300, 256, 512, nnz_per_row=16.0, bias=True)
    before = [t.clone() for t in problem.gated_args()]
    out = torch.ops.twell.gated_relu_mlp(*problem.gated_args())
    for a, b in zip(problem.gated_args(), before):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert out.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()


@requires_twell_kernels
@pytest.mark.parametrize("m", [300, 1024])  # the cuBLAS route, the TwELL kernels
def test_cuda_graph_capture_and_replay(m):
    problem = make_problem(m, 2048, 5632, nnz_per_row=24.0, bias=True)
    args = problem.gated_args()
    static_x = args[0].clone()
    torch.ops.twell.gated_relu_mlp(static_x, *args[1:])  # warm-up: build, Triton JIT, weight cache
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = torch.ops.twell.gated_relu_mlp(static_x, *args[1:])
    for _ in range(2):
        fresh = make_problem(m, 2048, 5632, nnz_per_row=24.0)
        static_x.copy_(fresh.x)
        graph.replay()
        torch.cuda.synchronize()
        expected = reference.gated_relu_mlp(*[None if t is None else t.double() for t in (static_x, *args[1:])])
        assert relative_error(static_out, expected) < 1e-2


@requires_twell_kernels
def test_weight_update_invalidates_transposed_cache():
    problem = make_problem(640, 256, 512, nnz_per_row=16.0)  # past the cuBLAS route: the kernels use the cache
    args = list(problem.gated_args())
    torch.ops.twell.gated_relu_mlp(*args)
    with torch.no_grad():
        args[3].mul_(-2.0)  # in-place update of the down weight
    out = torch.ops.twell.gated_relu_mlp(*args)
    expected = reference.gated_relu_mlp(*[None if t is None else t.double() for t in args])
    assert relative_error(out, expected) < 1e-2


@requires_twell_kernels
@pytest.mark.parametrize("m", [4097, 40000], ids=["row_by_row", "chunked"])  # W_down^T; and the sliced weights
def test_call_on_another_stream_waits_for_the_weight_cache_fill(m):
    """Two streams share a layer's weights. The first call, on stream A, fills the weight caches behind a
    long sleep on A; a call on stream B issued right after finds the entries on the host at once and must
    wait for their fill on the device, not read the unwritten memory behind them."""
    problem = make_problem(m, 2048, 5632, nnz_per_row=24.0, bias=True, dense_rows=(0,))
    ref64, dense_same_dtype = problem_references(problem)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    for stream in (a, b):
        stream.wait_stream(torch.cuda.current_stream())
    with kernel_config(**KERNELS_ONLY):
        with torch.cuda.stream(a):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clock cycles before the fill
            out_a = torch.ops.twell.gated_relu_mlp(*problem.gated_args())
        with torch.cuda.stream(b):
            out_b = torch.ops.twell.gated_relu_mlp(*problem.gated_args())
    torch.cuda.synchronize()
    _check(out_a, ref64, dense_same_dtype, "stream A (the fill)")
    _check(out_b, ref64, dense_same_dtype, "stream B")


@requires_twell_kernels
def test_sparsity_stats_recorded_without_changing_results():
    problem = make_problem(1024, 2048, 5632, nnz_per_row=24.0, dense_rows=(0,))
    with twell_compile.record_sparsity() as rec:
        torch.ops.twell.gated_relu_mlp(*problem.gated_args())
    (call,) = rec.calls()
    assert call.rows == 1024 and call.max_nnz_per_row == 5632 and call.path == "twell"
    assert 20 < call.mean_nnz_per_row < 40
    assert call.overflow_rows >= 1


@requires_twell_kernels
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_stale_memory_in_reused_buffers_is_never_read(gated, path):
    """Without poisoning, work buffers come from the caching allocator holding whatever was there last.
    Fill that memory with random bits first; the result must not depend on it."""
    problem = make_problem(384, 64, 256, 64, nnz_per_row=128.0, gated=gated, bias=True)  # ~50%: most tiles overflow
    args = problem.gated_args() if gated else problem.non_gated_args()
    op = torch.ops.twell.gated_relu_mlp if gated else torch.ops.twell.relu_mlp
    expected, dense_same_dtype = problem_references(problem, gated)
    with kernel_config(**PATHS[path]):
        for _ in range(3):
            garbage = torch.randint(-2**31, 2**31 - 1, (1 << 22,), dtype=torch.int32, device="cuda")
            del garbage  # its blocks go back to the allocator, random bits and all
            out = op(*args)
            _check(out, expected, dense_same_dtype, f"stale buffers gated={gated} path={path}")


@requires_twell_kernels
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("path", ["dense", "auto"])
def test_gemm_schedules_match_bitwise(gated, path):
    """The wgmma GEMMs compute each output element exactly alike in every schedule: single CTAs, 2-CTA
    clusters sharing x / h tiles by multicast, the cooperative 256-row tiles, alone or in pairs. The shape
    makes each run everywhere (up to 187 SMs) with odd column-tile counts (21 for the gate, 11 for the
    down projection: the last pair's second tile does not exist) and a last row tile of 30 rows (a
    multicast half lies wholly past the end). Dense rows 0 and 700 make 256-row tiles that hold one
    dense and one sparse block: the cooperative dense path must leave the sparse half alone. K is kept
    whole (gemm_k_splits=1): with two blocks dense the ping-pong down projection would otherwise split it
    by itself (test_cuda_dense_gemm.py), which sums in another order, and the cooperative one cannot."""
    problem = make_problem(4126, 200, 2600, 1400, nnz_per_row=24.0, gated=gated, bias=True, dense_rows=(0, 700))
    outs = {}
    for cluster, tile_m in ((1, 128), (2, 128), (1, 256), (2, 256)):
        with kernel_config(gemm_cluster=cluster, gate_gemm_tile_m=tile_m, gemm_tile_m=tile_m, down_gemm_tile_m=tile_m,
                           gemm_k_splits=1):
            out, ref64, dense_same_dtype = _run(problem, gated, path)
        _check(out, ref64, dense_same_dtype, f"schedules gated={gated} path={path} cluster={cluster} tile_m={tile_m}")
        outs[cluster, tile_m] = out
    for key, out in outs.items():
        assert torch.equal(out, outs[1, 128]), key


@requires_twell_kernels
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("path", ["dense", "auto"])
def test_split_k_gemms_are_exact_and_deterministic(gated, path):
    """Where the output tiles are few (small M), the wgmma GEMMs may split each tile's K over several
    CTAs and sum the partial tiles in a fixed order (csrc/twell_gemm.cu). Every split count must be
    exact and give the same bits from run to run. K = 2056 is 33 slices of 64 (the last one partial):
    5 ranges are 7, 7, 7, 7 and 5 slices, and 16 requested become 11 ranges of 3. The down projection's
    K = 2600 is 41 slices; the last of 3 row tiles has 44 rows; dense rows 0 and 200 put both full
    blocks on the dense path (the automatic choice, 0, splits only the down projection, in 2 ranges)."""
    problem = make_problem(300, 2056, 2600, 1400, nnz_per_row=24.0, gated=gated, bias=True, dense_rows=(0, 200))
    for k_splits in (0, 2, 5, 16):
        with kernel_config(gemm_k_splits=k_splits):
            out, ref64, dense_same_dtype = _run(problem, gated, path)
            again, _, _ = _run(problem, gated, path)
        _check(out, ref64, dense_same_dtype, f"k_splits={k_splits} gated={gated} path={path}")
        assert torch.equal(again, out), k_splits


@requires_twell_kernels
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("m", [7, 300])
def test_triton_kernels_alone_stay_exact(gated, path, m):
    """With the wgmma GEMMs switched off (config.wgmma_kernels), the Triton gate and dense path, which
    otherwise run only for unaligned shapes, serve everything: narrow decode tiles (M = 7) and
    128-wide tiles (M = 300)."""
    problem = make_problem(m, 2048, 5632, 2048, nnz_per_row=24.0, gated=gated, bias=True, dense_rows=(0,))
    with kernel_config(wgmma_kernels=False):
        _check(*_run(problem, gated, path), f"triton only m={m} gated={gated} path={path}")


@requires_twell_kernels
@pytest.mark.parametrize("cluster", range(2, 9))
@pytest.mark.parametrize("m", [17, 32])
@pytest.mark.parametrize("case", ["uniform", "one_full_row"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_entry_split_at_every_cluster_size(cluster, m, case, gated, monkeypatch):
    # The decode rule (twell_mlp._sparse_cluster) picks 2 to 8 CTAs a row by the row count and the SM
    # count, so each size must be exact on any row count it may meet, a fully active row included.
    from twell_compile.kernels import twell_mlp

    monkeypatch.setattr(twell_mlp, "_sparse_cluster", lambda rows, sms: cluster)
    monkeypatch.setattr(twell_mlp, "_PLANS", {})
    k, f, d = 2048, 5632, 2048
    kwargs = dict(nnz_per_row=24.0) if case == "uniform" else dict(ADVERSARIAL[case])
    problem = make_problem(m, k, f, d, gated=gated, bias=True, **kwargs)
    assert twell_mlp.sparse_launch(m, d, torch.cuda.get_device_properties(0).multi_processor_count, True).cluster == cluster
    _check(*_run(problem, gated, "sparse"), f"cluster={cluster} m={m} {case} gated={gated}")


@requires_twell_kernels
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("path", ["auto", "dense"])
@pytest.mark.parametrize("m", [1, 16, 100, 300, 4097])
def test_one_call_path_matches_the_step_by_step_path_bitwise(gated, path, m, monkeypatch):
    """Aligned operands run in one host call (``mlp_forward``, csrc/twell_mlp_forward.cpp); the Python
    path that calls each kernel in turn (unaligned operands, Triton) must agree with it bit for bit,
    and the one-call path must decline, before any work, operands whose rows are not 16-byte aligned."""
    from twell_compile.kernels import build, twell_mlp

    k, f, d = 2048, 5632, 2048
    p = make_problem(m, k, f, d, nnz_per_row=24.0, gated=gated, bias=True, dense_rows=(0,))
    act = (p.gate_weight, p.gate_bias, p.up_weight, p.up_bias) if gated else (p.up_weight, p.up_bias, None, None)
    ext = build.cuda_extension()
    with kernel_config(poison_buffers=True, **PATHS[path]):  # KERNELS_ONLY: m = 100 and 300 too
        plan = twell_mlp.call_plan(m, f, d, p.x.device)
        w_down_t = twell_mlp.DOWN_WEIGHT_T.get(p.down_weight)
        one_call = ext.mlp_forward(plan.cuda, p.x, *act, p.down_weight, w_down_t, p.down_bias)
        step_by_step = twell_mlp._twell_mlp_general(p.x, *act, p.down_weight, p.down_bias)
        monkeypatch.setattr(twell_mlp, "_twell_mlp_general", None)  # the op must not need it here
        op_out = (torch.ops.twell.gated_relu_mlp(*p.gated_args()) if gated
                  else torch.ops.twell.relu_mlp(*p.non_gated_args()))
        unaligned_x = torch.empty(m, k + 1, dtype=p.x.dtype, device=p.x.device)[:, 1:]
        unaligned_x.copy_(p.x)
        declined = ext.mlp_forward(plan.cuda, unaligned_x, *act, p.down_weight, w_down_t, p.down_bias)
    assert one_call is not None and declined is None
    for a, b, name in zip(one_call, step_by_step[:3], ("out", "counts", "block_nnz")):
        assert torch.equal(a, b), name
    assert torch.equal(op_out, one_call[0])
    assert not one_call[0].isnan().any()


@requires_twell_kernels
@pytest.mark.parametrize("float16", [False, True], ids=["bf16", "fp16"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_entry_split_clusters_fit_in_one_wave(gated, float16):
    # The entry split takes the largest cluster (the plan's, down to 2) whose M clusters are all resident
    # at once (csrc/twell_sparse_mlp.cu, resident_entry_cluster): never more than the plan asks, and
    # the plan's own wherever a call has few rows.
    from twell_compile.kernels import build, twell_mlp

    ext = build.cuda_extension()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    picked = {}
    for m in (1, 8, 16, 24, 31, 32, 33, 48, 64, 100, 128):
        requested = twell_mlp.sparse_launch(m, 2048, sms, True).cluster
        if requested < 2:
            continue
        picked[m] = ext.sparse_entry_cluster(m, 44, 2048, requested, gated, float16)
        assert 2 <= picked[m] <= requested, (m, requested, picked[m])
    assert picked[1] == twell_mlp.sparse_launch(1, 2048, sms, True).cluster
    with pytest.raises(RuntimeError, match="requested cluster"):
        ext.sparse_entry_cluster(32, 44, 2048, 9, gated, float16)
    print(f"clusters picked on {torch.cuda.get_device_name()}: {picked}")
