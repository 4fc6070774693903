"""Programmatic dependent launch of decode-sized calls (``config.programmatic_launch``; ``pytest -m cuda``).

With it on, each kernel of a decode-sized call may be scheduled before the kernel ahead of it in the
stream ends, and waits for it on the device (csrc/cluster_launch.cuh). What could go wrong is order:
a kernel reading its input before the op that writes it is done, or overwriting a buffer a kernel
before it still reads, and then the op that follows reading ours too early. So: the answer must be
bit for bit the plain launches' (the kernels are deterministic), on every path of a decode call, in
chains of layers with PyTorch kernels between the calls and without, eager and in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import twell_compile  # noqa: F401
from helpers import KERNEL_PATHS as PATHS, KERNELS_ONLY, requires_twell_kernels
from twell_compile.kernels import twell_mlp
from twell_compile.testing import check_output, kernel_config, make_problem, problem_references

pytestmark = [pytest.mark.cuda, requires_twell_kernels]


def _op(problem, gated: bool):
    if gated:
        return torch.ops.twell.gated_relu_mlp(*problem.gated_args())
    return torch.ops.twell.relu_mlp(*problem.non_gated_args())


@pytest.mark.parametrize("m", [1, 16, 32, 33, 1024, 131072])
def test_only_decode_calls_launch_programmatically(m):
    device = torch.device("cuda")
    plan = twell_mlp.call_plan(m, 5632, 2048, device)
    decode = plan.cuda is not None and plan.cuda.decode_gate
    assert decode == (m <= 32)  # 33-512 rows go to cuBLAS by default
    if plan.cuda is not None:
        assert plan.cuda.programmatic == decode
        with kernel_config(programmatic_launch=False):
            assert not twell_mlp.call_plan(m, 5632, 2048, device).cuda.programmatic


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "non_gated"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", ["uniform", "skewed", "first_token_dense", "half_dense"])
@pytest.mark.parametrize("m", [1, 5, 16, 32])
def test_decode_call_matches_plain_launches(m, case, path, gated):
    nnz = {"uniform": 24.0, "skewed": 12.0, "first_token_dense": 24.0, "half_dense": 2816.0}[case]
    problem = make_problem(m, 2048, 5632, nnz_per_row=nnz, gated=gated, bias=not gated, skew=case == "skewed",
                           dense_rows=(0,) if case == "first_token_dense" else ())
    outs = {}
    for on in (False, True):
        with kernel_config(programmatic_launch=on, poison_buffers=True, **PATHS[path]):
            assert twell_mlp.call_plan(m, 5632, 2048, problem.x.device).cuda.programmatic == on
            outs[on] = _op(problem, gated)
    assert torch.equal(outs[True], outs[False])
    result = check_output(outs[True], *problem_references(problem, gated))
    assert result.failure is None, result.failure


def _layers(n: int, m: int):
    """n decode-sized MLP layers of the 2B shape (K = D = 2048), different weights and sparsity each."""
    problems = [make_problem(m, 2048, 5632, nnz_per_row=nnz, skew=i % 2 == 1)
                for i, nnz in zip(range(n), (24.0, 12.0, 60.0, 300.0))]
    return [(p.gate_weight, p.up_weight, p.down_weight) for p in problems], problems[0].x


def _chain(x, layers, with_norm: bool):
    """Residual MLP layers, with a norm and an add between the twell calls or the add alone."""
    for wg, wu, wd in layers:
        x = x + torch.ops.twell.gated_relu_mlp(F.rms_norm(x, (x.shape[-1],)) if with_norm else x, wg, wu, wd)
    return x


@pytest.mark.parametrize("with_norm", [True, False], ids=["norm_and_add", "add_only"])
@pytest.mark.parametrize("m", [1, 16])
def test_layer_chain_eager_and_in_graph(m, with_norm):
    layers, x = _layers(4, m)
    with kernel_config(programmatic_launch=False, **KERNELS_ONLY):
        plain = _chain(x, layers, with_norm)
    assert (plain - x).abs().amax() > 0  # the layers contribute: not a chain of zeros
    with kernel_config(programmatic_launch=True, **KERNELS_ONLY):
        eager = _chain(x, layers, with_norm)
        assert torch.equal(eager, plain)
        static_x = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _chain(static_x, layers, with_norm)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = _chain(static_x, layers, with_norm)
        for trial in range(3):  # fresh inputs each replay, copied in just before it
            fresh = torch.randn_like(x) * x.std()
            static_x.copy_(fresh)
            graph.replay()
            expected = _chain(fresh, layers, with_norm)
            assert torch.equal(static_out, expected), f"replay {trial}"
