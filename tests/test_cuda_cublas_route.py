"""The cuBLAS route (``config.cublas_rows``; ``pytest -m cuda``): calls whose row count lies in the
range run the dense MLP through PyTorch's GEMMs, and give the bits eager PyTorch gives, NaN included;
they report their sparsity; they capture in CUDA graphs; the ends of the range are where the plan says.
Also ``torch.library.opcheck`` on CUDA inputs through each path the row count picks.
"""

from __future__ import annotations

import pytest
import torch

import twell_compile
from helpers import eager_gated, eager_relu, requires_twell_kernels
from twell_compile.kernels import twell_mlp
from twell_compile.testing import make_problem

pytestmark = pytest.mark.cuda

LOW, HIGH = twell_mlp.config.cublas_rows


def _op_and_eager(problem, gated: bool):
    if gated:
        return torch.ops.twell.gated_relu_mlp(*problem.gated_args()), eager_gated(*problem.gated_args())
    return torch.ops.twell.relu_mlp(*problem.non_gated_args()), eager_relu(*problem.non_gated_args())


@requires_twell_kernels
@pytest.mark.parametrize("m", [LOW, 300, HIGH])
@pytest.mark.parametrize("shape", [(2048, 5632, 2048), (257, 1031, 131)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_matches_eager_bitwise(m, shape, dtype, bias, gated):
    assert twell_mlp.call_plan(m, shape[1], shape[2], torch.device("cuda")).cublas
    problem = make_problem(m, *shape, nnz_per_row=24.0, gated=gated, bias=bias, dtype=dtype, dense_rows=(0,))
    out, expected = _op_and_eager(problem, gated)
    assert torch.equal(out, expected)


@requires_twell_kernels
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_nan_and_infinity_propagate_as_in_eager(gated):
    problem = make_problem(200, 256, 1000, 200, nnz_per_row=24.0, gated=gated, bias=True)
    problem.x[3, 7] = float("nan")
    problem.x[9, 1] = float("inf")
    out, expected = _op_and_eager(problem, gated)
    assert out.isnan().any()
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


@requires_twell_kernels
def test_records_the_activation_and_every_block_dense():
    problem = make_problem(256, 2048, 5632, nnz_per_row=24.0, dense_rows=(0,))
    with twell_compile.record_sparsity() as rec:
        torch.ops.twell.gated_relu_mlp(*problem.gated_args())
    (call,) = rec.calls()
    assert call.rows == 256 and call.max_nnz_per_row == 5632
    assert 20 < call.mean_nnz_per_row < 60
    assert (call.overflow_rows, call.dense_blocks, call.blocks) == (0, 2, 2)
    assert call.path == "cublas"


@requires_twell_kernels
def test_ends_of_the_range_run_the_twell_kernels():
    device = torch.device("cuda")
    assert not twell_mlp.call_plan(LOW - 1, 5632, 2048, device).cublas
    assert not twell_mlp.call_plan(HIGH + 1, 5632, 2048, device).cublas
    # Past the range the TwELL path runs: it reports the blocks its device-side test sent dense (none here).
    problem = make_problem(HIGH + 1, 2048, 5632, nnz_per_row=24.0)
    with twell_compile.record_sparsity() as rec:
        torch.ops.twell.gated_relu_mlp(*problem.gated_args())
    (call,) = rec.calls()
    assert call.dense_blocks == 0 and call.path == "twell"


@requires_twell_kernels
@pytest.mark.parametrize("m", [7, 300, 1024])  # decode kernels, the cuBLAS route, the row-by-row kernels
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_opcheck_on_every_cuda_path(m, gated):
    """torch.library.opcheck on CUDA inputs (tests/test_ops.py runs it on CPU): schema, fake kernel,
    autograd registration and AOT dispatch, through each path the CUDA kernel takes by row count."""
    problem = make_problem(m, 256, 1024, 256, nnz_per_row=24.0, gated=gated, bias=True)
    args = problem.gated_args() if gated else problem.non_gated_args()
    op = torch.ops.twell.gated_relu_mlp.default if gated else torch.ops.twell.relu_mlp.default
    torch.library.opcheck(op, tuple(a.detach().clone().requires_grad_() if a is not None else None for a in args))
