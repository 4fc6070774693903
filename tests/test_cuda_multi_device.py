"""The twell ops on a GPU that is not the current one (``pytest -m cuda``; skipped without two Hopper GPUs).

A model spread over GPUs (Hugging Face's ``device_map="auto"``, or two models on two GPUs) calls the ops
on cuda:1 while cuda:0 is current. Every launch must then still run on cuda:1 and on its current stream:
the results are checked against float64 as in ``test_cuda_kernels.py``, and nothing may be allocated on
cuda:0 (its allocator's peak is checked, which also catches buffers freed within the call).
"""

from __future__ import annotations

import pytest
import torch

import twell_compile
from helpers import requires_twell_kernels
from test_cuda_kernels import KERNELS_ONLY, _check
from twell_compile.testing import kernel_config, make_problem, problem_references

pytestmark = pytest.mark.cuda

requires_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
OTHER = torch.device("cuda", 1)

# (rows, (K, F, D), settings): one case per launch family of the CUDA path.
LAUNCHES = {
    "decode": (7, (2048, 5632, 2048), KERNELS_ONLY),
    "row_by_row": (4097, (2048, 5632, 2048), KERNELS_ONLY),
    "chunked": (40000, (2048, 5632, 2048), KERNELS_ONLY),
    "general_triton": (300, (257, 1031, 131), KERNELS_ONLY),  # unaligned rows: the general path
    "cublas_route": (300, (2048, 5632, 2048), {}),  # 33-512 rows go to cuBLAS as shipped
}


def _call(problem, gated: bool):
    if gated:
        return torch.ops.twell.gated_relu_mlp(*problem.gated_args())
    return torch.ops.twell.relu_mlp(*problem.non_gated_args())


@requires_two_gpus
@requires_twell_kernels
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_ops_on_a_gpu_that_is_not_current(launch, gated):
    m, (k, f, d), settings = LAUNCHES[launch]
    torch.cuda.set_device(0)
    problem = make_problem(m, k, f, d, nnz_per_row=24.0, gated=gated, bias=True, dense_rows=(0,), device=OTHER)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(OTHER)
    before = torch.cuda.memory_allocated(0)
    torch.cuda.reset_peak_memory_stats(0)
    with kernel_config(poison_buffers=True, **settings):
        for _ in range(3):  # the first calls build the weight caches; routing reads earlier reports
            out = _call(problem, gated)
    torch.cuda.synchronize(OTHER)
    assert torch.cuda.current_device() == 0
    assert out.device == OTHER
    assert torch.cuda.max_memory_allocated(0) == before, "the call allocated on cuda:0"
    _check(out, *problem_references(problem, gated), f"{launch} on cuda:1 with cuda:0 current")


@requires_two_gpus
@requires_twell_kernels
def test_one_layer_on_each_gpu_alternating():
    # Two layers of the same shape, one per GPU, called in turn with cuda:0 current: weight caches,
    # launch plans and routing are per weight and device, so neither call may see the other's.
    torch.cuda.set_device(0)
    problems = [make_problem(4097, 2048, 5632, 2048, nnz_per_row=24.0, bias=True, device=device)
                for device in (torch.device("cuda", 0), OTHER)]
    with kernel_config(poison_buffers=True, **KERNELS_ONLY):
        for _ in range(2):
            for problem in problems:
                out = _call(problem, True)
                torch.cuda.synchronize(out.device)
                _check(out, *problem_references(problem), f"layer on {out.device}")


@requires_two_gpus
@requires_twell_kernels
@pytest.mark.parametrize("launch", ["decode", "row_by_row", "chunked"])
def test_cuda_graph_on_the_second_gpu(launch):
    m, (k, f, d), settings = LAUNCHES[launch]
    torch.cuda.set_device(0)
    problem = make_problem(m, k, f, d, nnz_per_row=24.0, bias=True, device=OTHER)
    with kernel_config(**settings), torch.cuda.device(OTHER):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _call(problem, True)  # warm-up: weight caches, plans
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _call(problem, True)
        problem.x.copy_(make_problem(m, k, f, d, nnz_per_row=24.0, bias=True, device=OTHER).x)
        graph.replay()
        torch.cuda.synchronize(OTHER)
    _check(out, *problem_references(problem), f"{launch}, CUDA graph on cuda:1")


class _TwoGpuMlps(torch.nn.Module):
    """Two gated ReLU MLP blocks, the first on cuda:0 and the second on cuda:1, the activation moved
    between them as accelerate's hooks move it for ``device_map="auto"``."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList()
        for device in (torch.device("cuda", 0), OTHER):
            block = torch.nn.ModuleDict({
                "gate": torch.nn.Linear(hidden, intermediate), "up": torch.nn.Linear(hidden, intermediate),
                "down": torch.nn.Linear(intermediate, hidden)})
            with torch.no_grad():  # paper-like sparsity: a negative gate bias
                block["gate"].bias.fill_(-2.5 * block["gate"].weight.norm(dim=1).mean().item())
            self.blocks.append(block.to(device=device, dtype=torch.bfloat16))

    def forward(self, x):
        for block in self.blocks:
            x = x.to(block["gate"].weight.device)
            x = x + block["down"](torch.relu(block["gate"](x)) * block["up"](x))
        return x


@requires_two_gpus
@requires_twell_kernels
def test_compiled_model_spread_over_two_gpus():
    torch.manual_seed(0)
    torch.cuda.set_device(0)
    model = _TwoGpuMlps(256, 1024).eval()
    x = torch.randn(2, 600, 256, device="cuda", dtype=torch.bfloat16)  # 1200 rows: past the cuBLAS route's sizes
    with torch.no_grad():
        expected = model(x)
        compiled = torch.compile(model, backend="twell")
        with twell_compile.record_sparsity() as recorder:
            out = compiled(x)
    assert out.device == OTHER
    calls = recorder.calls()
    assert [c.path for c in calls] == ["twell", "twell"], calls
    err = (out.float() - expected.float()).norm() / expected.float().norm()
    assert err < 2e-2, err
