"""The weight caches under CUDA graphs (``pytest -m cuda``; kernels/weight_cache.py): a captured graph
reads the cached W_down^T, so that copy stays allocated while its weight lives, and a change of
W_down reaches it in place, at the next call outside the graph or through ``weights_changed``."""

from __future__ import annotations

import pytest
import torch

import twell_compile
from helpers import KERNELS_ONLY, eager_gated, requires_twell_kernels
from twell_compile.kernels import weight_cache
from twell_compile.testing import kernel_config, make_problem, relative_error

pytestmark = pytest.mark.cuda


def _captured(problem):
    """A graph of one op call (after a warm-up call on the capture's stream), and its output."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.twell.gated_relu_mlp(*problem.gated_args())
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = torch.ops.twell.gated_relu_mlp(*problem.gated_args())
    return graph, out


def _replayed_right(graph, out, problem) -> bool:
    graph.replay()
    torch.cuda.synchronize()
    return relative_error(out, eager_gated(*problem.gated_args())) < 1e-2


@requires_twell_kernels
@pytest.mark.parametrize("refresh", ["eager call", "weights_changed"])
def test_a_graph_reads_w_down_as_changed(refresh):
    with kernel_config(**KERNELS_ONLY):
        problem = make_problem(8, 2048, 5632, nnz_per_row=24.0, bias=True)
        graph, out = _captured(problem)
        assert _replayed_right(graph, out, problem)
        with torch.no_grad():
            problem.down_weight.mul_(-2)
        if refresh == "eager call":
            torch.ops.twell.gated_relu_mlp(*problem.gated_args())
        else:
            twell_compile.weights_changed()
        assert _replayed_right(graph, out, problem)


@requires_twell_kernels
def test_the_copy_a_graph_reads_outlives_clearing_and_eviction(monkeypatch):
    with kernel_config(**KERNELS_ONLY):
        problem = make_problem(8, 2048, 5632, nnz_per_row=24.0)
        graph, out = _captured(problem)
        weight_cache.DOWN_WEIGHT_T.clear()
        monkeypatch.setattr(weight_cache.DOWN_WEIGHT_T, "_max_entries", 1)
        for _ in range(3):  # other layers' entries, evicting the oldest unpinned
            weight_cache.DOWN_WEIGHT_T.get(torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16))
        torch.empty(64 << 20, device="cuda", dtype=torch.uint8).fill_(0xFF)  # reuse freed memory, if any
        assert _replayed_right(graph, out, problem)


@requires_twell_kernels
def test_a_refill_on_another_stream_is_waited_for():
    """weights_changed refills the copy a graph reads on the stream it is called on; a later call on
    another stream must wait for that copy, as for a first fill (here it is queued behind a long kernel,
    so a call that did not wait would read the old values)."""
    with kernel_config(**KERNELS_ONLY):
        problem = make_problem(8, 2048, 5632, nnz_per_row=24.0)
        _captured(problem)
        with torch.no_grad():
            problem.down_weight.mul_(-2)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)
            twell_compile.weights_changed()
        (entry,) = [e for e in weight_cache.DOWN_WEIGHT_T._entries.values()
                    if e.source is not None and e.source() is problem.down_weight]
        assert entry.fill.stream == side.cuda_stream
        out = torch.ops.twell.gated_relu_mlp(*problem.gated_args())
        torch.cuda.synchronize()
        assert relative_error(out, eager_gated(*problem.gated_args())) < 1e-2
