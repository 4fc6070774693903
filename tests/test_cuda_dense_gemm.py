"""The dense path's wgmma GEMMs (``dense_block_gemm``) on their own, in every schedule (``pytest -m cuda``).

Gate times up must write exactly eager's ``relu(gate) * up`` of the rounded values in every column: the
products at active units, and ``0 * up`` everywhere else, which is -0 where up is negative and NaN where
it is not finite (an infinite weight puts +-inf in a whole column of up). Rows whose tile is past the
gate's capacity take the gate from the backup that h then overwrites. The store epilogue must write
the rounded product. Only the blocks the test marks dense are written: the other rows keep their
poison, also inside a 256-row tile that holds one dense and one sparse block.
"""

from __future__ import annotations

import pytest
import torch

from helpers import requires_twell_kernels, twell_to_dense
from twell_compile.testing import make_problem, marked_block_nnz

pytestmark = pytest.mark.cuda
CAP = 8
INT32_MAX = 2**31 - 1

# (cluster, tile_m, ctas): ping-pong on the whole GPU, single CTAs and pairs; the staged cooperative
# schedule on a small grid, so that its 256-row tiles run at this size (several tiles per CTA).
SCHEDULES = {"pingpong": (1, 128, None), "pingpong-pairs": (2, 128, None), "staged": (1, 256, 2),
             "staged-pairs": (2, 256, 4)}
# M = 520: blocks of 128 rows 0-4, the last of 8 rows. Blocks 0, 2, 3 and 4 dense, block 1 sparse: the
# first 256-row tile holds one of each, the last one 8 rows and a half past the end.
M, DENSE_BLOCKS = 520, (0, 2, 3, 4)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal bit patterns (so -0 differs from 0), any NaN matching any NaN."""
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan), f"{what}: NaN in other places"
    mismatch = (_bits(actual) != _bits(expected)) & ~nan
    assert not mismatch.any(), f"{what}: {int(mismatch.sum())} elements differ, first at {mismatch.nonzero()[0].tolist()}"


def _dense_block_gemm(a, b, bias, c, block_nnz, schedule, gate=None, ctas=None, k_splits=1):
    """dense_block_gemm into ``c`` in a SCHEDULES schedule, on its grid unless ``ctas`` is given (None in
    both: the whole GPU), K split as asked (0: automatic, 1: none)."""
    from twell_compile.kernels import build

    cluster, tile_m, schedule_ctas = SCHEDULES[schedule]
    ctas = ctas if ctas is not None else schedule_ctas
    if ctas is None:
        ctas = torch.cuda.get_device_properties(a.device).multi_processor_count
    packed, counts = gate if gate is not None else (None, None)
    build.cuda_extension().dense_block_gemm(a, b, bias, c, block_nnz, packed, counts, 0, 0, INT32_MAX, ctas,
                                            cluster, tile_m, k_splits)
    return c


@requires_twell_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_dense_path_gemms_write_eager_products_bitwise(dtype, schedule):
    from twell_compile.kernels import build

    # K = 264 (not a multiple of 64), 8 gate tiles (the last 104 wide), a 200-wide output (2 tiles).
    problem = make_problem(M, 264, 1000, 200, nnz_per_row=20.0, bias=True, dtype=dtype, dense_rows=(5, 200, 300))
    x, up_weight = problem.x.clone(), problem.up_weight.clone()
    up_weight[17, 3] = float("inf")  # up's column 17 is +-inf in every row
    x[400, 9] = float("nan")          # row 400: every gate and up value NaN (its tiles past capacity)
    rows_dense = torch.zeros(M, dtype=torch.bool, device="cuda")
    for blk in DENSE_BLOCKS:
        rows_dense[blk * 128:(blk + 1) * 128] = True
    all_blocks = marked_block_nnz(M, range(-(-M // 128)))
    some_blocks = marked_block_nnz(M, DENSE_BLOCKS)

    # The gate's TwELL output (ping-pong), then up rounded by the same GEMM engine (store epilogue).
    tiles = -(-1000 // 128)
    packed = torch.full((M, tiles, CAP), -7, dtype=torch.int32, device="cuda")
    counts = torch.full((M, tiles), -7, dtype=torch.int32, device="cuda")
    backup = torch.full((M, 1000), float("nan"), dtype=dtype, device="cuda")
    gate_block_nnz = torch.zeros_like(all_blocks)
    build.cuda_extension().gate_twell_gemm(x, problem.gate_weight, problem.gate_bias, packed, counts, backup,
                                           gate_block_nnz, torch.cuda.get_device_properties(0).multi_processor_count,
                                           1, 128, 1)
    assert (counts[5] > CAP).all() and (counts[200] > CAP).all() and (counts[400] > CAP).all()
    assert (counts <= CAP).float().mean() > 0.9
    up = _dense_block_gemm(x, up_weight, problem.up_bias, torch.full_like(backup, 3.0), all_blocks, "pingpong")
    assert up[:, 17].isinf().sum() > M // 2 and (up < 0).any()
    relu_gate = twell_to_dense(packed, counts, backup).to(dtype)  # exact: every value is a dtype value
    expected_h = relu_gate * up  # one rounding of an exact product, as the kernels' mul_pairs
    assert (_bits(expected_h) == _bits(torch.tensor(-0.0, dtype=dtype))).any(), "no -0 to check"

    h = _dense_block_gemm(x, up_weight, problem.up_bias, backup.clone(), some_blocks, schedule, (packed, counts))
    _assert_same_bits(h[rows_dense], expected_h[rows_dense], f"gate times up, {schedule}")
    _assert_same_bits(h[~rows_dense], backup[~rows_dense], f"gate times up left the sparse block alone, {schedule}")

    # The store epilogue: the ping-pong result bit for bit, close to float64, poison outside.
    h_finite = torch.where(h.isfinite(), h, torch.zeros_like(h))
    poison = torch.full((M, 200), float("nan"), dtype=dtype, device="cuda")
    out = _dense_block_gemm(h_finite, problem.down_weight, problem.down_bias, poison.clone(), some_blocks, schedule)
    reference = _dense_block_gemm(h_finite, problem.down_weight, problem.down_bias, poison.clone(), some_blocks,
                                  "pingpong")
    _assert_same_bits(out, reference, f"store, {schedule}")
    assert out[~rows_dense].isnan().all()
    out64 = h_finite.double() @ problem.down_weight.double().t() + problem.down_bias.double()
    err = (out[rows_dense].double() - out64[rows_dense]).norm() / out64[rows_dense].norm()
    assert err < 4e-3, err


@requires_twell_kernels
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("ctas", [3, None], ids=["ctas3", "ctas-all"])
def test_dense_path_gemms_walk_every_scattered_dense_tile_once(schedule, ctas):
    """The dense-path GEMMs walk only the row tiles holding a dense block, found in a bitmap of several
    32-block words: dense blocks scattered over three words (alone or as a pair in a 256-row tile), the
    last block 96 rows long. Each dense row gets the all-dense result's bits, the others keep their poison."""
    m = 93 * 128 + 96  # 94 blocks: bitmap words 0-2, the last one partly used
    dense_blocks = (0, 1, 5, 31, 32, 40, 41, 63, 64, 77, 93)
    problem = make_problem(m, 64, 136, nnz_per_row=8.0, bias=True)  # the store epilogue on x @ up.T
    rows_dense = torch.zeros(m, dtype=torch.bool, device="cuda")
    for blk in dense_blocks:
        rows_dense[blk * 128:(blk + 1) * 128] = True
    poison = torch.full((m, 136), float("nan"), dtype=problem.x.dtype, device="cuda")
    everything = _dense_block_gemm(problem.x, problem.up_weight, problem.up_bias, poison.clone(),
                                   marked_block_nnz(m, range(94)), "pingpong")
    cluster = SCHEDULES[schedule][0]
    if ctas is None:
        ctas = torch.cuda.get_device_properties(0).multi_processor_count
    out = _dense_block_gemm(problem.x, problem.up_weight, problem.up_bias, poison.clone(),
                            marked_block_nnz(m, dense_blocks), schedule, ctas=ctas - ctas % cluster)
    _assert_same_bits(out[rows_dense], everything[rows_dense], f"store, {schedule}")
    assert out[~rows_dense].isnan().all()


@requires_twell_kernels
@pytest.mark.parametrize("epilogue", ["store", "gate-times-up"])
@pytest.mark.parametrize("cluster", [1, 2], ids=["single", "pairs"])
def test_few_dense_tiles_split_k_by_themselves(epilogue, cluster):
    """The dense path's GEMMs split K on the device where few tiles are dense (adaptive_split_room): the
    call's 176 output tiles fill the grid, so the host splits nothing, but one dense block leaves 11 of
    them, and K = 2600 (41 slices) makes two ranges. Each dense row gets exactly what the GEMM split in
    two by request gives (the same ranges, summed in the same order), and is close to float64; the store's
    differ from the unsplit bits; the other rows keep what they held; two runs agree. With every block
    dense nothing splits."""
    from twell_compile.kernels import build

    m, k, n = 2000, 2600, 1400  # 16 blocks, the last of 80 rows; 11 column tiles
    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    if -(-m // 128) * -(-n // 128) < ctas:
        pytest.skip("more SMs than output tiles: the host splits K itself")
    gated = epilogue == "gate-times-up"
    problem = make_problem(m, k, n, nnz_per_row=20.0, bias=True)
    rows_dense = torch.zeros(m, dtype=torch.bool, device="cuda")
    rows_dense[3 * 128:4 * 128] = True
    one_block, all_blocks = marked_block_nnz(m, (3,)), marked_block_nnz(m, range(16))
    # The output's first contents: poison for the store; for gate times up, the gate's backup (the
    # tiles past capacity), beside its TwELL output.
    c0 = torch.full((m, n), float("nan"), dtype=problem.x.dtype, device="cuda")
    gate = None
    if gated:
        packed = torch.empty((m, -(-n // 128), CAP), dtype=torch.int32, device="cuda")
        counts = torch.empty((m, -(-n // 128)), dtype=torch.int32, device="cuda")
        build.cuda_extension().gate_twell_gemm(problem.x, problem.gate_weight, problem.gate_bias, packed, counts, c0,
                                               torch.zeros_like(all_blocks), ctas, 1, 128, 1)
        gate = (packed, counts)

    def run(blocks, k_splits):
        return _dense_block_gemm(problem.x, problem.up_weight, problem.up_bias, c0.clone(), blocks,
                                 "pingpong" if cluster == 1 else "pingpong-pairs", gate, k_splits=k_splits)

    adaptive, again = run(one_block, 0), run(one_block, 0)
    requested, whole = run(one_block, 2), run(one_block, 1)
    _assert_same_bits(adaptive[rows_dense], requested[rows_dense], f"{epilogue}: adaptive against requested split")
    assert torch.equal(_bits(adaptive), _bits(again)), "not deterministic"
    if gated:
        # Gate times up is +-0 wherever the gate is, all but ~20 units a row, so the sum order may not
        # show in its bits: the store (every element a sum) is the test that K was split.
        _assert_same_bits(adaptive[~rows_dense], c0[~rows_dense], "gate times up left the sparse blocks alone")
    else:
        assert not torch.equal(_bits(adaptive[rows_dense]), _bits(whole[rows_dense])), "K was not split"
        assert adaptive[~rows_dense].isnan().all()
    expected = problem.x[rows_dense].double() @ problem.up_weight.double().t() + problem.up_bias.double()
    if gated:
        expected = twell_to_dense(packed, counts, c0)[rows_dense].double() * expected
    err = (adaptive[rows_dense].double() - expected).norm() / expected.norm()
    assert err < 4e-3, err
    _assert_same_bits(run(all_blocks, 0), run(all_blocks, 1), f"{epilogue}: every block dense, nothing split")
