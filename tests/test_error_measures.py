"""The error measures the kernel tests and the fuzzer judge outputs by (``twell_compile.testing``)."""

from __future__ import annotations

import torch

from twell_compile import reference
from twell_compile.testing import check_output, elementwise_bound, make_problem, problem_references, relative_error, worst_element


def _bf16_case(m: int = 4096):
    problem = make_problem(m, 64, 256, nnz_per_row=8.0, device="cpu", generator=torch.Generator().manual_seed(0))
    return problem_references(problem)


def test_dense_same_dtype_is_within_its_own_bound():
    ref64, dense = _bf16_case()
    worst, dense_worst, _ = worst_element(dense, ref64, dense)
    assert worst == dense_worst
    assert worst <= elementwise_bound(dense_worst, torch.bfloat16)


def test_one_wrong_row_of_many_fails_elementwise_though_not_by_norm():
    ref64, dense = _bf16_case()
    bad = dense.clone()
    bad[1234] = 0  # one row of 4096 never written (as if a kernel skipped it, with zeros there)
    assert relative_error(bad, ref64) <= 1.5 * relative_error(dense, ref64) + 0.02  # the norm barely moves
    worst, dense_worst, (row, _) = worst_element(bad, ref64, dense)
    assert row == 1234
    assert worst > elementwise_bound(dense_worst, torch.bfloat16)


def test_one_active_unit_missed_is_caught():
    problem = make_problem(512, 64, 256, nnz_per_row=8.0, device="cpu", generator=torch.Generator().manual_seed(1))
    x, wg, wu, wd = problem.x, problem.gate_weight, problem.up_weight, problem.down_weight
    h = torch.relu(x.double() @ wg.double().t()) * (x.double() @ wu.double().t())
    ref64 = h @ wd.double().t()
    dense = reference.gated_relu_mlp(x, wg, wu, wd)
    row = int(h.ne(0).sum(1).argmax())  # the row with the most active units: one of them counts least
    unit = int(h[row].abs().argmax())
    h_missing = h.clone()
    h_missing[row, unit] = 0
    bad = (h_missing @ wd.double().t()).to(torch.bfloat16)
    worst, dense_worst, (where, _) = worst_element(bad, ref64, dense)
    assert where == row and worst > elementwise_bound(dense_worst, torch.bfloat16)


def test_rows_whose_reference_is_zero_must_stay_zero():
    ref64 = torch.zeros(3, 8, dtype=torch.float64)
    ref64[0] = 1.0
    dense = ref64.to(torch.bfloat16)
    leaked = dense.clone()
    leaked[2, 5] = 1e-3  # a row with nothing active and no bias: any value is a wrong read
    worst, dense_worst, where = worst_element(leaked, ref64, dense)
    assert where == (2, 5) and dense_worst == 0 and worst > elementwise_bound(dense_worst, torch.bfloat16)
    assert worst_element(dense, ref64, dense)[0] == 0


def test_nan_is_never_within_bound():
    ref64, dense = _bf16_case(256)
    bad = dense.clone()
    bad[7, 3] = float("nan")
    worst, dense_worst, where = worst_element(bad, ref64, dense)
    assert where == (7, 3)
    assert not worst <= elementwise_bound(dense_worst, torch.bfloat16)


def test_check_output_names_the_first_bound_broken():
    ref64, dense = _bf16_case()
    assert check_output(dense, ref64, dense).failure is None
    nan = dense.clone()
    nan[9, 1] = float("nan")
    assert check_output(nan, ref64, dense).failure.startswith("NaN in rows [9]")
    off = dense.clone()
    off[100, 3] += 0.5 * ref64[100].pow(2).mean().sqrt()  # half the row's RMS on one element of 4096 x 64
    assert check_output(off, ref64, dense).failure.startswith("element (100, 3)")
    scaled = dense * 1.05
    assert check_output(scaled, ref64, dense).failure.startswith("relative error")
