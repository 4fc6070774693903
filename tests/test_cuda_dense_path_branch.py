"""Decode-sized calls captured into a CUDA graph fork the dense path onto a branch of the graph
(``config.decode_dense_branch``, csrc/twell_mlp_forward.cpp). The graph holds both paths and the
device picks one per replay, so a graph captured on sparse inputs must give exact results whichever
path each replay takes, and the same bits as a graph captured without the fork (``pytest -m cuda``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import twell_compile  # noqa: F401
from helpers import KERNELS_ONLY, requires_twell_kernels
from twell_compile.testing import check_output, kernel_config, make_problem, problem_references

pytestmark = pytest.mark.cuda

K, F, D = 2048, 5632, 2048  # the paper's 2B shape


def _replay_inputs(m: int) -> dict[str, torch.Tensor]:
    """Inputs for the captured weights (the density shift is carried by x alone, make_problem)."""
    return {
        "sparse": make_problem(m, K, F, D, nnz_per_row=24.0).x,
        "first_token_dense": make_problem(m, K, F, D, nnz_per_row=24.0, dense_rows=(0,)).x,
        "half_active": make_problem(m, K, F, D, nnz_per_row=F / 2).x,
    }


@requires_twell_kernels
@pytest.mark.parametrize("m", [1, 17, 64])  # the decode GEMVs' three row tilings
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_graph_takes_either_path_on_replay_with_the_same_bits_forked_or_not(m, gated):
    problem = make_problem(m, K, F, D, nnz_per_row=24.0, gated=gated, bias=True)
    op = torch.ops.twell.gated_relu_mlp if gated else torch.ops.twell.relu_mlp
    inputs = _replay_inputs(m)
    outs = {}
    for branch in (True, False):
        with kernel_config(**KERNELS_ONLY, decode_dense_branch=branch, poison_buffers=True):
            args = list(problem.gated_args() if gated else problem.non_gated_args())
            args[0] = args[0].clone()
            op(*args)  # warm-up: build, weight cache
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = op(*args)
            for name, x in inputs.items():
                args[0].copy_(x)
                graph.replay()
                torch.cuda.synchronize()
                outs[branch, name] = static_out.clone()
                result = check_output(static_out, *problem_references(dataclasses.replace(problem, x=x), gated))
                assert result.failure is None, f"branch={branch}, {name}: {result.failure}"
    for name in inputs:
        assert torch.equal(outs[True, name], outs[False, name]), name


@requires_twell_kernels
def test_eager_decode_call_does_not_fork():
    """The fork is for graphs only: eagerly its event calls would cost the host more than it saves."""
    problem = make_problem(1, K, F, D, nnz_per_row=24.0)
    with kernel_config(**KERNELS_ONLY, decode_dense_branch=True):
        torch.ops.twell.gated_relu_mlp(*problem.gated_args())  # warm-up
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            torch.ops.twell.gated_relu_mlp(*problem.gated_args())
            torch.cuda.synchronize()
    names = {event.name for event in prof.events()}
    assert any(name.startswith("cudaLaunchKernel") for name in names), sorted(names)  # runtime calls are seen
    assert not any("cudaStreamWaitEvent" in name or "cudaEventRecord" in name for name in names), sorted(names)
