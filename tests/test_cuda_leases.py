"""Leases on the GPU (``pytest -m cuda``; kernels/leases.py, csrc/twell_fast_call.cpp): after a call has
taken the Python path, its layer's repeat calls of the same size run in C++ with the same bits; a lease
serves only calls exactly like the one it was granted for, ends where the density router's next report
is due, and is dropped whenever what it was derived from changes (the settings, the weights in place,
the router's state). Calls it does not cover take the Python path and give the right answer."""

from __future__ import annotations

import pytest
import torch

import twell_compile
from helpers import KERNELS_ONLY, eager_gated, requires_twell_kernels
from twell_compile.kernels import leases, twell_mlp
from twell_compile.kernels.density_route import ROUTER
from twell_compile.testing import kernel_config, make_problem, relative_error

pytestmark = pytest.mark.cuda


def _gated(problem, x=None):
    args = problem.gated_args()
    return torch.ops.twell.gated_relu_mlp(x if x is not None else args[0], *args[1:])


def _python_path(problem, x=None):
    with kernel_config(fast_calls=False):
        return _gated(problem, x)


@pytest.fixture(autouse=True)
def _fresh_leases():
    ROUTER.clear()
    yield
    ROUTER.clear()  # revokes every lease too


@requires_twell_kernels
@pytest.mark.parametrize("m", [1, 8, 100, 2048], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_repeat_calls_run_from_the_lease_with_the_same_bits(m, gated):
    """m = 1 and 8: decode GEMVs; 100: the cuBLAS route by row count; 2048: the wgmma gate and the
    row-by-row sparse kernel. Routing by density is off, so the first call's lease has no limit."""
    with kernel_config(route_by_density=False):
        problem = make_problem(m, 2048, 5632, nnz_per_row=24.0, gated=gated, bias=True, dense_rows=(0,))
        act = problem.gate_weight if gated else problem.up_weight

        def call():
            if gated:
                return torch.ops.twell.gated_relu_mlp(*problem.gated_args())
            return torch.ops.twell.relu_mlp(*problem.non_gated_args())

        assert leases.calls_left(act) == -1
        first = call()  # the Python path, which grants the lease
        assert leases.calls_left(act) == leases.UNLIMITED
        served = [call() for _ in range(3)]
        assert leases.calls_left(act) == leases.UNLIMITED - 3
    for out in served:
        assert torch.equal(out, first)
    expected = eager_gated(*problem.gated_args()) if gated else None
    if gated:
        assert relative_error(first, expected) < 1e-2


@requires_twell_kernels
def test_a_lease_serves_only_the_call_it_was_granted_for():
    with kernel_config(route_by_density=False):
        problem = make_problem(8, 2048, 5632, nnz_per_row=24.0, bias=True)
        _gated(problem)
        # Another token count or another stream takes the Python path; the same rows shaped otherwise
        # are served from the lease.
        other_rows = make_problem(4, 2048, 5632, nnz_per_row=24.0).x
        assert _gated(problem, other_rows).shape == (4, 2048)
        three_d = problem.x.view(2, 4, 2048)
        assert torch.equal(_gated(problem, three_d), _python_path(problem).view(2, 4, 2048))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            on_side = _gated(problem)
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(on_side, _python_path(problem))
        # A bias that is not the lease's: the call is still right (the Python path).
        bias = problem.down_bias + 1
        args = list(problem.gated_args())
        args[6] = bias
        assert relative_error(torch.ops.twell.gated_relu_mlp(*args), eager_gated(*args)) < 1e-2


@requires_twell_kernels
def test_weights_changed_in_place_are_seen():
    """W_down^T is part of the lease; an in-place update bumps W_down's version, so the next call takes
    the Python path, which rebuilds it."""
    with kernel_config(route_by_density=False):
        problem = make_problem(8, 2048, 5632, nnz_per_row=24.0, bias=True)
        _gated(problem)
        _gated(problem)
        with torch.no_grad():
            problem.down_weight.mul_(-2)
        out = _gated(problem)
        assert relative_error(out, eager_gated(*problem.gated_args())) < 1e-2
        assert torch.equal(_gated(problem), out)  # and the new lease serves the new weights


@requires_twell_kernels
def test_the_settings_revoke_every_lease():
    with kernel_config(route_by_density=False):
        problem = make_problem(8, 2048, 5632, nnz_per_row=24.0)
        _gated(problem)
        assert leases.calls_left(problem.gate_weight) > 0
        twell_mlp.config.decode_gemv_cluster = twell_mlp.config.decode_gemv_cluster  # any assignment
        assert leases.calls_left(problem.gate_weight) == -1
    with kernel_config(fast_calls=False, route_by_density=False):
        _gated(problem)
        assert leases.calls_left(problem.gate_weight) == -1


@requires_twell_kernels
def test_a_recorder_sees_every_call():
    with kernel_config(route_by_density=False):
        problem = make_problem(8, 2048, 5632, nnz_per_row=24.0)
        _gated(problem)
        with twell_compile.record_sparsity() as rec:
            for _ in range(3):
                _gated(problem)
        assert [call.path for call in rec.calls()] == ["twell"] * 3


@requires_twell_kernels
def test_a_routed_layer_leases_up_to_its_next_report():
    """With routing by density on, the first calls report; once their reports have landed, a call gets
    a lease for the calls before the next report due (one in ``route_report_every``), and the call after
    them takes the Python path and reports."""
    every = 8
    with kernel_config(route_report_every=every, cublas_rows=(1, 0)):
        problem = make_problem(16, 2048, 5632, nnz_per_row=24.0)
        weight = problem.gate_weight
        expected = _python_path(problem)  # (fast_calls off: no lease, but the router counts it)
        ROUTER.clear()
        _gated(problem)
        _gated(problem)  # the router's first two calls report: no lease
        assert leases.calls_left(weight) == -1
        torch.cuda.synchronize()  # the reports land
        assert torch.equal(_gated(problem), expected)  # reads them; call 2 of 8: a lease for calls 3-7
        assert leases.calls_left(weight) == every - 3
        for _ in range(every - 3):
            assert torch.equal(_gated(problem), expected)
        assert leases.calls_left(weight) == 0
        _gated(problem)  # call 8: the Python path, which reports, and the report revokes the lease
        assert leases.calls_left(weight) == -1
        assert ROUTER.share(weight, "decode") == 0.0


@requires_twell_kernels
def test_a_dense_layer_leases_the_cublas_route():
    with kernel_config(route_report_every=8, cublas_rows=(1, 0)):
        problem = make_problem(16, 2048, 5632, nnz_per_row=24.0, dense_rows=tuple(range(16)))
        for _ in range(3):  # two reports, then a call that reads them and goes to cuBLAS
            _gated(problem)
            torch.cuda.synchronize()
        assert ROUTER.share(problem.gate_weight, "decode") == 1.0
        assert leases.calls_left(problem.gate_weight) == 8 - 3
        out = _gated(problem)  # from the lease: the cuBLAS route, eager's bits
        assert leases.calls_left(problem.gate_weight) == 8 - 4
        assert torch.equal(out, eager_gated(*problem.gated_args()))
        with twell_compile.record_sparsity() as rec:  # the Python path, which tells the path it took
            _gated(problem)
        assert rec.calls()[0].path == "cublas"


def _leased_decode_layer():
    """A 16-row layer the router watches (set ``route_report_every=8`` and ``cublas_rows=(1, 0)``) after
    its first three calls: two reports, landed, then a call that leased calls 3-7. (problem, its gate
    weight, a function giving the router's state of its decode class.)"""
    problem = make_problem(16, 2048, 5632, nnz_per_row=24.0)
    weight = problem.gate_weight
    for _ in range(3):
        _gated(problem)
        torch.cuda.synchronize()
    assert leases.calls_left(weight) == 8 - 3
    return problem, weight, lambda: ROUTER._layer(weight, create=False).classes["decode"]


@requires_twell_kernels
def test_the_router_counts_the_calls_leases_served():
    """A lease's served calls are added to the router's count at the layer's next Python-path call, which
    ends the lease, also when that call (on another stream) grants another: the report still comes at
    call 8."""
    with kernel_config(route_report_every=8, cublas_rows=(1, 0)):
        problem, weight, state = _leased_decode_layer()
        _gated(problem)
        _gated(problem)  # calls 3 and 4 from the lease
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _gated(problem)  # call 5, on the Python path: counts 3 and 4, leases 6-7 on its stream
        torch.cuda.current_stream().wait_stream(side)
        assert state().calls == 6 and leases.calls_left(weight) == 2
        _gated(problem)  # call 6, back on the first stream: the Python path again, a lease for call 7
        assert state().calls == 7 and leases.calls_left(weight) == 1
        _gated(problem)  # call 7 from it
        assert leases.calls_left(weight) == 0
        pending = len(ROUTER._layer(weight, create=False).pending)
        _gated(problem)  # call 8 reports
        assert len(ROUTER._layer(weight, create=False).pending) == pending + 1
        assert state().calls == 9 and leases.calls_left(weight) == -1


@requires_twell_kernels
def test_a_call_on_the_python_path_ends_the_lease():
    """A call the lease does not serve (here one under a recorder, never served) ends it: the router
    counted that call, so the lease granted before it would have served one call too many, the call
    due to report."""
    with kernel_config(route_report_every=8, cublas_rows=(1, 0)):
        problem, weight, state = _leased_decode_layer()
        for _ in range(4):
            _gated(problem)  # calls 3-6 from the lease
        with twell_compile.record_sparsity():
            _gated(problem)  # call 7 on the Python path: counts the four, ends the lease, grants none
        assert state().calls == 8 and leases.calls_left(weight) == -1
        pending = len(ROUTER._layer(weight, create=False).pending)
        _gated(problem)  # call 8 reports
        assert len(ROUTER._layer(weight, create=False).pending) == pending + 1


@requires_twell_kernels
def test_a_lease_whose_w_down_changed_is_spent_at_the_next_grant():
    """W_down changed in place while its layer's calls have another size (say a training step between
    decode steps): the next grant of any layer spends the lease, which lets its stale W_down^T go."""
    with kernel_config(route_by_density=False):
        layer, other = (make_problem(8, 2048, 5632, nnz_per_row=24.0) for _ in range(2))
        _gated(layer)
        assert leases.calls_left(layer.gate_weight) == leases.UNLIMITED
        with torch.no_grad():
            layer.down_weight.mul_(-2)
        _gated(other)
        assert leases.calls_left(layer.gate_weight) == 0
        out = _gated(layer)  # the Python path, with the new W_down, and a new lease
        assert relative_error(out, eager_gated(*layer.gated_args())) < 1e-2
        assert leases.calls_left(layer.gate_weight) == leases.UNLIMITED
        assert torch.equal(_gated(layer), out)


@requires_twell_kernels
def test_calls_under_capture_take_the_python_path_and_replay_right():
    with kernel_config(route_by_density=False):
        problem = make_problem(8, 2048, 5632, nnz_per_row=24.0, bias=True)
        expected = _gated(problem)
        assert leases.calls_left(problem.gate_weight) > 0
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _gated(problem)  # warm-up on the capture's stream
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            out = _gated(problem)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
        assert torch.equal(_gated(problem), expected)


@requires_twell_kernels
def test_freed_weights_never_match():
    """A lease keeps weak references to the weights: a new layer at the freed addresses is not served
    from the old layer's lease."""
    with kernel_config(**KERNELS_ONLY):
        for seed in range(3):
            torch.manual_seed(seed)
            problem = make_problem(8, 2048, 5632, nnz_per_row=24.0)
            _gated(problem)
            out = _gated(problem)
            assert relative_error(out, eager_gated(*problem.gated_args())) < 1e-2
            del problem


@requires_twell_kernels
def test_the_leases_of_a_deleted_model_go_at_the_next_grant():
    """A lease holds the transposed W_down it was granted with; once the weights are gone it is dropped
    at the next grant (of any layer), so a deleted model's copies do not stay allocated."""
    import gc
    import weakref

    with kernel_config(route_by_density=False):
        old = make_problem(8, 2048, 5632, nnz_per_row=24.0)
        _gated(old)
        down_t = weakref.ref(twell_mlp.DOWN_WEIGHT_T.get(old.down_weight))
        del old
        gc.collect()
        assert down_t() is not None  # the cache and the lease still hold it
        new = make_problem(8, 2048, 5632, nnz_per_row=24.0)
        _gated(new)  # its W_down^T fills the cache, which drops the dead entry; its grant drops the lease
        gc.collect()
        assert down_t() is None
