"""Routing by observed density on the GPU (``pytest -m cuda``; the logic is in test_density_route.py):
a layer whose calls keep sending blocks to the dense path moves to the cuBLAS route within a few calls
(at 1024 rows one dense block in eight is enough; at 16384 rows half of them are not), the host reading
the reports from pinned memory without waiting; it comes back when its activation turns sparse; a
dense layer is captured on cuBLAS in a CUDA graph, also under mode="reduce-overhead"; results match
eager on either route.
"""

from __future__ import annotations

import pytest
import torch

import twell_compile
from helpers import eager_gated, eager_relu, requires_twell_kernels
from twell_compile.kernels import twell_mlp
from twell_compile.testing import make_problem, relative_error

pytestmark = pytest.mark.cuda


def _call(problem, gated: bool):
    if gated:
        return torch.ops.twell.gated_relu_mlp(*problem.gated_args()), eager_gated(*problem.gated_args())
    return torch.ops.twell.relu_mlp(*problem.non_gated_args()), eager_relu(*problem.non_gated_args())


def _path_of_call(problem, gated: bool) -> str:
    with twell_compile.record_sparsity() as rec:
        out, expected = _call(problem, gated)
    (call,) = rec.calls()  # reads the statistics back: the GPU is idle after this
    if call.path == "cublas":
        assert torch.equal(out, expected)  # the route computes what eager computes
    else:
        assert relative_error(out, expected) < 1e-2
    return call.path


@requires_twell_kernels
@pytest.mark.parametrize("m", [16, 1024, 5000], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_a_dense_layer_moves_to_cublas_and_back_when_it_turns_sparse(m, gated):
    assert twell_mlp.config.route_by_density and twell_mlp.call_plan(m, 5632, 2048, torch.device("cuda")).route_class
    # 80 active units per row puts every block past the dense-path threshold at 129-4096 rows (0.75%)
    # and above (1.1%); at decode sizes (5%) dense rows do.
    problem = make_problem(m, 2048, 5632, nnz_per_row=80.0, gated=gated, bias=True,
                           dense_rows=tuple(range(m)) if m <= 128 else ())
    paths = [_path_of_call(problem, gated) for _ in range(4)]
    assert paths[0] == "twell" and paths[-1] == "cublas", paths
    # The same layer, now sparse (the density rides on x's first feature): it comes back to TwELL.
    sparse = make_problem(m, 2048, 5632, nnz_per_row=24.0, gated=gated, bias=True)
    problem.x = sparse.x
    paths = [_path_of_call(problem, gated) for _ in range(8 * twell_mlp.config.route_report_every)]
    assert paths[-1] == "twell", paths


@requires_twell_kernels
@pytest.mark.parametrize(("m", "dense_blocks", "path"),
                         [(1024, 1, "cublas"), (4096, 8, "twell"), (8192, 48, "cublas"), (16384, 64, "twell")],
                         ids=["m1024-one-of-8-dense", "m4096-8-of-32-dense", "m8192-48-of-64-dense",
                              "m16384-64-of-128-dense"])
def test_a_partly_dense_layer_goes_where_its_row_count_pays(m, dense_blocks, path):
    """One dense block costs the TwELL path about what all of them do, which loses to cuBLAS at 1024
    rows; from 4096 rows the dense path walks only the dense tiles, and a quarter (4096 rows) to a half
    (16384) of the blocks dense still pays; three quarters at 8192 do not (density_route.ENTER_SHARES)."""
    problem = make_problem(m, 2048, 5632, nnz_per_row=24.0, bias=True, dense_block_share=dense_blocks / (m // 128))
    paths = [_path_of_call(problem, True) for _ in range(4)]
    assert paths[0] == "twell" and paths[-1] == path, paths


@requires_twell_kernels
@pytest.mark.parametrize(("nnz", "path"), [(40.0, "cublas"), (28.0, "twell")], ids=["nnz40", "nnz28"])
def test_a_call_with_a_thin_sparse_wave_goes_to_cublas_from_a_lower_density(nnz, path):
    """Where the sparse kernel's second wave would be thin (8.5 rows per SM; a CTA per row, 8 CTAs an SM),
    40 active units per row go to cuBLAS though no block is dense by the kernels' own test (0.75%, 42
    units); 28 stay on TwELL (config.thin_wave_route_density, 0.62%)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m = 8 * sms + sms // 2
    assert twell_mlp.thin_sparse_wave(m, 2048, sms, twell_mlp.sparse_launch(m, 2048, sms, True))
    problem = make_problem(m, 2048, 5632, nnz_per_row=nnz, bias=True)
    with twell_compile.record_sparsity() as rec:
        out, expected = _call(problem, True)
    (first,) = rec.calls()
    assert first.path == "twell" and first.dense_blocks == 0, first
    assert relative_error(out, expected) < 1e-2
    paths = [_path_of_call(problem, True) for _ in range(3)]
    assert paths[-1] == path, paths


@requires_twell_kernels
def test_a_sparse_layer_stays_on_twell():
    problem = make_problem(1024, 2048, 5632, nnz_per_row=24.0, bias=True)
    assert {_path_of_call(problem, True) for _ in range(20)} == {"twell"}


@pytest.fixture
def cublas_calls(monkeypatch):
    """Counts the op's calls of the cuBLAS route (Python runs while a graph is captured, not when it is
    replayed). Outputs cannot tell the routes apart here: with every block dense, the TwELL path's GEMMs
    can give eager's bits too."""
    calls = []
    route = twell_mlp._cublas_mlp

    def counted(*args, **kwargs):
        calls.append(torch.cuda.is_current_stream_capturing())
        return route(*args, **kwargs)

    monkeypatch.setattr(twell_mlp, "_cublas_mlp", counted)
    return calls


@requires_twell_kernels
def test_a_dense_layer_is_captured_on_cublas_right_after_one_warm_up_call(cublas_calls):
    """As torch.compile's mode="reduce-overhead" runs it: one eager (warm-up) call, then the call captured
    in a graph at once, while the GPU may still be running the warm-up. The capture waits for the
    warm-up's report (host memory only) and captures the cuBLAS route; the replay matches eager."""
    problem = make_problem(2048, 2048, 5632, nnz_per_row=80.0)
    torch.ops.twell.gated_relu_mlp(*problem.gated_args())  # warm-up: TwELL, reports its dense blocks
    assert cublas_calls == []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.twell.gated_relu_mlp(*problem.gated_args())
    assert cublas_calls == [True]
    problem.x.copy_(make_problem(2048, 2048, 5632, nnz_per_row=80.0).x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_gated(*problem.gated_args()))


class _GatedMLP(torch.nn.Module):
    def __init__(self, problem):
        super().__init__()
        weights = (problem.gate_weight, problem.up_weight, problem.down_weight)
        self.gate_proj, self.up_proj, self.down_proj = (
            torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=w.dtype) for w in weights)
        with torch.no_grad():
            for linear, w in zip((self.gate_proj, self.up_proj, self.down_proj), weights):
                linear.weight.copy_(w)

    def forward(self, x):
        return self.down_proj(torch.relu(self.gate_proj(x)) * self.up_proj(x))


@requires_twell_kernels
def test_reduce_overhead_records_a_dense_layer_on_cublas(cublas_calls):
    """torch.compile(mode="reduce-overhead"): the first call warms up (the TwELL path, which reports), the
    second records the graph (the cuBLAS route, after waiting for that report), the third replays it."""
    problem = make_problem(2048, 2048, 5632, nnz_per_row=80.0)
    model = _GatedMLP(problem)
    compiled = torch.compile(model, backend="twell", mode="reduce-overhead")
    with torch.no_grad():
        outs = [compiled(problem.x).clone() for _ in range(3)]
        expected = model(problem.x)
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    assert sum(r.rewritten_count for r in twell_compile.last_reports()) == 1
    assert cublas_calls == [True]  # the recording, captured; no Python runs on replay
    for out in outs:
        assert relative_error(out, expected) < 1e-2


@requires_twell_kernels
def test_switched_off_the_row_count_alone_decides(monkeypatch):
    monkeypatch.setattr(twell_mlp.config, "route_by_density", False)
    problem = make_problem(1024, 2048, 5632, nnz_per_row=80.0)
    assert {_path_of_call(problem, True) for _ in range(6)} == {"twell"}
