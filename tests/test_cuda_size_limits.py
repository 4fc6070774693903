"""Sizes at and past the TwELL kernels' limits (``pytest -m cuda``; skipped without a Hopper GPU).

- Calls whose output and backup buffers hold more than 2**31 elements (M * F past int32) must come out
  exact on every path: the kernels index them in 64 bits.
- An intermediate size past the sparse kernel's shared memory (about 3.0-3.6 million units on an H200,
  by D) runs the dense MLP through cuBLAS, exactly, instead of a launch that fails; one just inside it
  runs the TwELL kernels, exactly. The private step-by-step path, called directly past it, raises a
  twell error.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import twell_compile  # noqa: F401
from twell_compile import stats
from twell_compile.kernels import build
from helpers import KERNEL_PATHS, requires_twell_kernels
from twell_compile.testing import check_output, kernel_config, make_problem, problem_references

pytestmark = pytest.mark.cuda


def _references_by_rows(problem, gated: bool, rows: int = 16384):
    """problem_references, computed a slice of rows at a time (the float64 hidden activation of a whole
    large call would take tens of GB)."""
    ref64, dense = [], []
    for start in range(0, problem.x.shape[0], rows):
        part = dataclasses.replace(problem, x=problem.x[start:start + rows])
        r, d = problem_references(part, gated)
        ref64.append(r)
        dense.append(d)
    return torch.cat(ref64), torch.cat(dense)


def _free_gib() -> float:
    free, _ = torch.cuda.mem_get_info()
    return free / 2**30


@requires_twell_kernels
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_outputs_past_int32_elements_are_exact(gated):
    """M * F > 2**31 (393216 rows at the 2B shape): the dense backup and the dense path's hidden
    activation hold more elements than int32 counts. Chunked kernel (the default at this size), the
    row-by-row kernel, and the dense path, each against the float64 reference."""
    if _free_gib() < 40:
        pytest.skip("needs about 40 GiB of free GPU memory")
    m, k, f = 3 * 131072, 2048, 5632
    assert m * f > 2**31
    problem = make_problem(m, k, f, nnz_per_row=24.0, gated=gated, skew=True, dense_rows=(0, m - 1))
    ref64, dense = _references_by_rows(problem, gated)
    op = torch.ops.twell.gated_relu_mlp if gated else torch.ops.twell.relu_mlp
    args = problem.gated_args() if gated else problem.non_gated_args()
    paths = {"default": {}, "row-by-row": dict(chunked_sparse_rows=0, **KERNEL_PATHS["sparse"]),
             "dense": KERNEL_PATHS["dense"]}
    for name, overrides in paths.items():
        with kernel_config(poison_buffers=True, **overrides), stats.record_sparsity() as recorder:
            out = op(*args)
        torch.cuda.synchronize()
        assert [c.path for c in recorder.calls()] == ["twell"], name
        result = check_output(out, ref64, dense)
        assert result.failure is None, f"{name}: {result.failure}"
        del out


def _exact_narrow_call_paths(m: int, f: int, gated: bool) -> list[str]:
    """Runs one call of K 16, D 24 and intermediate size ``f`` (biases on, the cuBLAS row range off, so
    that only the size decides the route), checks it against float64, and returns the paths it took."""
    problem = make_problem(m, 16, f, 24, nnz_per_row=24.0, gated=gated, bias=True)
    ref64, dense = problem_references(problem, gated)
    op = torch.ops.twell.gated_relu_mlp if gated else torch.ops.twell.relu_mlp
    args = problem.gated_args() if gated else problem.non_gated_args()
    with kernel_config(poison_buffers=True, **KERNEL_PATHS["auto"]), stats.record_sparsity() as recorder:
        out = op(*args)
        torch.cuda.synchronize()
    result = check_output(out, ref64, dense)
    assert result.failure is None, result.failure
    return [c.path for c in recorder.calls()]


@requires_twell_kernels
@pytest.mark.parametrize("m", [1, 16, 300])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_intermediate_past_the_sparse_kernels_shared_memory_runs_on_cublas(m, gated):
    ext = build.cuda_extension()
    assert ext.sparse_mlp_fits(-(-5632 // 64), 2048)
    assert not ext.sparse_mlp_fits(-(-3_600_000 // 64), 24)  # (232,448 bytes on an H100 or H200)
    assert _exact_narrow_call_paths(m, 3_600_000, gated) == ["cublas"]


@requires_twell_kernels
@pytest.mark.parametrize("m", [1, 129])  # the entry split at decode, the 128-thread launch past it
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_intermediate_just_inside_the_limit_runs_the_twell_kernels(m, gated):
    """The largest sizes the plan still gives the TwELL kernels (F = 3.5 million: 54,688 tiles of 64, so
    27,344 of the CUDA gate's 128 and about 115 KB of sparse-kernel shared memory) are exact."""
    assert build.cuda_extension().sparse_mlp_fits(-(-3_500_000 // 64), 24)
    assert _exact_narrow_call_paths(m, 3_500_000, gated) == ["twell"]


@requires_twell_kernels
@pytest.mark.parametrize("m", [1, 300])
def test_step_by_step_path_past_the_limit_raises_a_twell_error(m):
    """F = 7.3 million, past the sparse kernel's shared memory even at the CUDA gate's 128-column tiles:
    called directly, the private path raises before any launch (it used to fail in the sparse launch with
    CUDA's "invalid argument"; under pytest with xdist, twice, the process crashed there instead)."""
    from twell_compile.kernels import twell_mlp

    p = make_problem(m, 16, 7_300_000, 24, nnz_per_row=24.0, gated=True, bias=True)
    with pytest.raises(ValueError, match="past the TwELL kernels' limits"):
        twell_mlp._twell_mlp_general(p.x, p.gate_weight, p.gate_bias, p.up_weight, p.up_bias, p.down_weight,
                                     p.down_bias)
