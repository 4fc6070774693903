"""Routing by observed density (``twell_compile/kernels/density_route.py``), CPU-only: how reports move a
layer's route, which calls report, what a layer is, and how ``twell_mlp`` follows the route (with a
stand-in extension). The CUDA side (reports landing in pinned memory, CUDA graphs) is in
test_cuda_density_route.py."""

from __future__ import annotations

import gc
import time
import types

import pytest
import torch

from twell_compile import stats
from twell_compile.kernels import build, density_route, twell_mlp
from twell_compile.kernels.density_route import DensityRouter, _ReportWords


def _report(router, weight, size_class, dense, blocks=8):
    router.report(weight, size_class, torch.tensor(dense), blocks)


def test_the_entering_share_grows_with_the_row_count():
    enter = density_route.enter_share
    assert enter(513, "small") == enter(1024, "small") == 0.05
    assert enter(2048, "small") == pytest.approx(0.06)
    assert enter(2896, "small") == pytest.approx(0.18, abs=1e-3)  # halfway in log2 between 2048 and 4096
    assert enter(8192, "large") == pytest.approx(0.55)
    assert enter(16384, "large") == enter(32767, "large") == 0.75
    assert enter(16, "decode") == enter(128, "decode") == 0.5  # one block: the share of dense calls
    shares = [enter(m, "small") for m in range(513, 32768, 97)]
    assert shares == sorted(shares)


def test_a_layer_goes_to_cublas_once_its_average_dense_share_reaches_the_entering_share():
    router, weight = DensityRouter(), torch.randn(8, 4)
    assert router.decide(weight, "small", 8, 1024) == (False, True)  # nothing known: TwELL, and report
    _report(router, weight, "small", 0, blocks=8)
    assert router.share(weight, "small") == 0.0
    assert router.decide(weight, "small", 8, 1024)[0] is False
    _report(router, weight, "small", 1, blocks=8)  # average (0 + 1/8) / 2 = 1/16, over 1024 rows' 0.05
    assert router.share(weight, "small") == pytest.approx(1 / 16)
    assert router.decide(weight, "small", 8, 1024)[0] is True


def test_a_large_call_needs_a_larger_share_than_a_small_one():
    small_calls, large_calls = DensityRouter(), DensityRouter()
    weight = torch.randn(8, 4)
    for router in (small_calls, large_calls):
        _report(router, weight, "large", 4, blocks=16)  # 1/4
    assert small_calls.decide(weight, "large", 8, 2048)[0] is True  # enters at 0.06
    assert large_calls.decide(weight, "large", 8, 16384)[0] is False  # enters at 0.75
    _report(large_calls, weight, "large", 16, blocks=16)  # (1/4 + 1) / 2 = 0.625
    assert large_calls.decide(weight, "large", 8, 16384)[0] is False
    _report(large_calls, weight, "large", 16, blocks=16)  # (0.625 + 1) / 2 = 0.8125
    assert large_calls.decide(weight, "large", 8, 16384)[0] is True


def test_a_routed_layer_comes_back_only_below_half_its_entering_share():
    router, weight = DensityRouter(), torch.randn(8, 4)
    _report(router, weight, "large", 8)  # share 1: routed
    assert router.decide(weight, "large", 8, 16384)[0] is True
    _report(router, weight, "large", 0)  # 0.5: below the entering 0.75, not below half of it
    assert router.decide(weight, "large", 8, 16384)[0] is True
    _report(router, weight, "large", 0)  # 0.25
    assert router.decide(weight, "large", 8, 16384)[0] is False
    _report(router, weight, "large", 8)  # (0.25 + 1) / 2 = 0.625: below 0.75, stays on TwELL
    assert router.decide(weight, "large", 8, 16384)[0] is False


def test_size_classes_and_layers_are_routed_apart():
    router, dense_layer, sparse_layer = DensityRouter(), torch.randn(8, 4), torch.randn(8, 4)
    _report(router, dense_layer, "small", 8)
    assert router.decide(dense_layer, "small", 8, 1024)[0] is True
    assert router.decide(dense_layer, "decode", 8, 1024)[0] is False  # another class: its own thresholds
    assert router.decide(sparse_layer, "small", 8, 1024)[0] is False
    assert router.share(sparse_layer, "small") is None


def test_the_first_calls_then_one_in_n_report():
    router, weight = DensityRouter(), torch.randn(8, 4)
    reports = [router.decide(weight, "small", 4, 1024)[1] for _ in range(13)]
    # calls 0 and 1 (FIRST_REPORTS), then calls 4, 8 and 12
    assert [i for i, r in enumerate(reports) if r] == [0, 1, 4, 8, 12]
    assert density_route.FIRST_REPORTS == 2


def test_a_layer_is_its_weight_storage_and_a_freed_weight_forgets_its_route():
    router = DensityRouter()
    weight = torch.randn(64, 32)
    _report(router, weight, "small", 8)
    assert router.decide(weight, "small", 8, 1024)[0] is True
    assert router.decide(weight.detach(), "small", 8, 1024)[0] is True  # another tensor, the same storage
    assert router.share(torch.randn(64, 32), "small") is None
    assert len(router) == 1
    del weight
    gc.collect()
    router.decide(torch.randn(8, 4), "small", 8, 1024)  # a new layer: expired ones are dropped
    assert len(router) == 1


def test_reports_are_read_once_landed_oldest_first():
    """A GPU report is an int32 word of pinned memory that holds -1 until its copy lands; a call reads
    the landed ones in order, from host memory alone (so it may also while a CUDA graph is captured),
    and hands their words back. Simulated here with words of an unpinned tensor, landed by hand."""
    router, weight = DensityRouter(), torch.randn(8, 4)
    router._words = words = _ReportWords(2, pinned=False)
    router.decide(weight, "small", 8, 1024)
    first, second = words.take(), words.take()
    assert words.take() is None  # every word in flight
    router._layer(weight, create=False).pending += [("small", first, 8), ("small", second, 8)]
    words.tensor[second] = 8  # the later one landed first: it waits for the older one
    assert router.decide(weight, "small", 8, 1024)[0] is False
    words.tensor[first] = 8
    assert router.decide(weight, "small", 8, 1024)[0] is True
    assert router.share(weight, "small") == 1.0
    assert words.take() is not None and words.take() is not None


def test_a_capture_waits_for_the_reports_in_flight():
    """A captured call takes its layer's route for every replay, so it first waits (host memory only,
    at most CAPTURE_WAIT_S) for the reports in flight; here one lands from another thread after 50 ms."""
    import threading

    router, weight = DensityRouter(), torch.randn(8, 4)
    router._words = words = _ReportWords(1, pinned=False)
    router.decide(weight, "small", 8, 1024)
    layer = router._layer(weight, create=False)
    layer.pending.append(("small", words.take(), 8))
    router._read_landed(layer)  # without waiting: still in flight
    assert layer.pending
    lander = threading.Timer(0.05, lambda: words.tensor.fill_(8))
    lander.start()
    router._await_reports(weight, density_route.CAPTURE_WAIT_S)
    lander.join()
    assert not layer.pending and router.share(weight, "small") == 1.0


def test_a_capture_waiting_for_reports_does_not_hold_up_other_calls(monkeypatch):
    """The wait holds the router's lock only to read: another thread's calls (here another layer's, not
    captured) are decided meanwhile, and the captured call still takes the route its reports give."""
    import threading

    router = DensityRouter()
    captured, other = torch.randn(8, 4), torch.randn(8, 4)
    router._words = words = _ReportWords(1, pinned=False)
    router.decide(captured, "small", 8, 1024)
    router._layer(captured, create=False).pending.append(("small", words.take(), 8))
    monkeypatch.setattr(density_route, "_capturing", lambda weight: weight is captured)
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("captured", router.decide(captured, "small", 8, 1024)))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()  # waiting for the report
    started = time.monotonic()
    assert router.decide(other, "small", 8, 1024) == (False, True)  # not held up by the wait
    assert time.monotonic() - started < 0.5
    words.tensor.fill_(8)  # the report lands: every block dense
    waiter.join(timeout=density_route.CAPTURE_WAIT_S)
    assert result["captured"] == (True, False)  # cuBLAS, and a captured call never reports


def test_paused_calls_neither_read_nor_feed_the_router():
    """``paused()`` (explain's analysis run): calls take the row count's route and leave no trace."""
    router, weight = DensityRouter(), torch.randn(8, 4)
    for _ in range(2):
        _report(router, weight, "small", 8)
    assert router.decide(weight, "small", 8, 1024)[0] is True
    calls = router._layer(weight, create=False).classes["small"].calls
    fresh = torch.randn(8, 4)
    with density_route.paused():
        assert router.decide(weight, "small", 8, 1024) == (False, False)
        assert router.lease_calls(weight, "small", 8) == 0
        _report(router, weight, "small", 0)
        assert router.decide(fresh, "small", 8, 1024) == (False, False)
        router.count_calls(weight, "small", 5)  # calls a lease served before: still counted
    assert router._layer(weight, create=False).classes["small"].calls == calls + 5
    assert router.share(weight, "small") == 1.0 and len(router) == 1  # no report read, no layer added
    assert router.decide(weight, "small", 8, 1024)[0] is True


def test_words_of_a_dropped_layer_come_back_once_landed():
    router, words = DensityRouter(), _ReportWords(1, pinned=False)
    router._words = words
    weight = torch.randn(8, 4)
    router.decide(weight, "small", 8, 1024)
    word = words.take()
    router._layer(weight, create=False).pending.append(("small", word, 8))
    router.clear()  # the layer goes while its report is in flight
    assert words.take() is None
    words.tensor[word] = 3  # landed
    assert words.take() == word and words.landed(word) is None  # handed out again, reset to -1


def test_reports_of_nothing_are_ignored():
    router, weight = DensityRouter(), torch.randn(8, 4)
    router.report(weight, "small", torch.tensor(0), 0)
    assert router.share(weight, "small") is None


class _RecordingExtension:
    """Stand-in for the CUDA extension: the one-call path declines, the step-by-step path's kernels and
    the cuBLAS route record their names (as in test_kernel_dispatch.py)."""

    MlpPlan = types.SimpleNamespace

    def __init__(self):
        self.calls = []

    def chunked_sparse_fits(self, *args):
        return True

    def sparse_mlp_fits(self, *args):  # (the plan's size check)
        return True

    def mlp_forward(self, *args):
        self.calls.append("mlp_forward")
        return None

    def end_lease(self, weight):  # leases granted through the stand-in serve nothing
        return (-1, 0)

    def cublas_mlp(self, x, w_act, *args):
        self.calls.append("cublas_mlp")
        return x.new_empty(x.shape[0], args[-2].shape[0]), x.new_zeros(x.shape[0], w_act.shape[0])

    def __getattr__(self, name):
        return lambda *args: self.calls.append(name)


@pytest.fixture
def recording_extension(monkeypatch):
    ext = _RecordingExtension()
    monkeypatch.setattr(twell_mlp, "_PLANS", {})
    monkeypatch.setattr(twell_mlp, "_num_sms", lambda device: 132)
    monkeypatch.setattr(build, "cuda_extension", lambda: ext)
    monkeypatch.setattr(twell_mlp, "ROUTER", DensityRouter())
    return ext


def test_size_classes_follow_the_dense_block_thresholds(recording_extension):
    device = torch.device("cuda", 0)
    classes = {m: twell_mlp.call_plan(m, 5632, 2048, device).route_class for m in (1, 32, 300, 1024, 4096, 4097,
                                                                                  32767, 32768, 131072)}
    # 33-512 rows always go to cuBLAS, chunked calls (from 32768 rows) are never routed.
    assert classes == {1: "decode", 32: "decode", 300: None, 1024: "small", 4096: "small", 4097: "large",
                       32767: "large", 32768: None, 131072: None}


def test_watched_calls_run_the_dense_path_on_128_row_tiles(recording_extension, monkeypatch):
    """Routing sends calls that go mostly dense to cuBLAS, so below the chunked kernel's sizes the dense
    path serves calls with a minority of dense blocks, where 256-row tiles would run half idle."""
    device = torch.device("cuda", 0)

    def tiles(m):
        cuda = twell_mlp.call_plan(m, 5632, 2048, device).cuda
        return cuda.gemm_tile_m, cuda.down_gemm_tile_m

    assert tiles(1024) == tiles(4096) == tiles(32767) == (128, 128)
    assert tiles(32768) == tiles(131072) == (256, 256)  # chunked calls are not routed
    monkeypatch.setattr(twell_mlp.config, "route_by_density", False)
    assert tiles(4096) == (256, 256)
    monkeypatch.setattr(twell_mlp.config, "route_by_density", True)
    monkeypatch.setattr(twell_mlp.config, "partly_dense_tile_m", 0)
    assert tiles(4096) == (256, 256)


def test_twell_mlp_follows_the_route_and_the_setting(recording_extension, monkeypatch):
    ext = recording_extension
    weight, down = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    x = torch.randn(1024, 32, dtype=torch.bfloat16)

    def call():
        ext.calls.clear()
        out = twell_mlp.twell_mlp(x, weight, None, weight, None, down, None)
        assert out.shape == (1024, 32)
        return ext.calls[0]

    # The stand-in gate leaves every block sparse: the layer's reports keep it on the TwELL path.
    assert [call() for _ in range(3)] == ["mlp_forward"] * 3
    assert twell_mlp.ROUTER.share(weight, "small") == 0.0
    # Reports of every block dense (as the TwELL path would make them) send its next calls to cuBLAS.
    for _ in range(3):
        twell_mlp.ROUTER.report(weight, "small", torch.tensor(8), 8)
    assert call() == "cublas_mlp"
    # Switched off, the row count alone decides.
    monkeypatch.setattr(twell_mlp.config, "route_by_density", False)
    assert call() == "mlp_forward"
    monkeypatch.setattr(twell_mlp.config, "route_by_density", True)
    # Routed calls report from their dense activation (all zeros here: no block dense), and the
    # average falls until the layer comes back.
    routes = [call() for _ in range(8 * twell_mlp.config.route_report_every)]
    assert routes[0] == "cublas_mlp" and routes[-1] == "mlp_forward"


def test_activation_dense_blocks_make_the_kernels_test():
    act = torch.full((300, 200), -1.0)
    act[:128, :5] = 1.0  # block 0: 640 active units, in tile 0
    act[128:256, :2] = float("nan")  # block 1: 256 (NaN counts as active, as in the statistics)
    act[256:, :3] = 2.0  # last block, 44 rows: 132
    act[256:260, 130:140] = 3.0  # ... and 4 of its rows with 10 active units in tile 1: 172 in all
    def count(act, thresholds, cap):
        return twell_mlp._activation_dense_blocks(stats.active_units(act), thresholds, cap, tile_n=128)

    assert int(count(act, (300, 150, 2**31 - 1), cap=8)) == 2  # blocks 0 and 2, by their active units
    assert int(count(act, (200, 200, 2**31 - 1), cap=8)) == 2  # blocks 0 and 1
    assert int(count(act, (1000, 1000, 3), cap=8)) == 1  # block 2, by its 4 row-tiles past capacity
    assert int(count(act, (1000, 1000, 4), cap=8)) == 0
    assert int(count(act, (1000, 1000, 0), cap=9)) == 1  # 10 > 9
    # The same test as the statistics' block_dense, on the counts the gate kernels would write.
    nnz = torch.tensor([640, 256, 172], dtype=torch.int32)
    over = torch.tensor([0, 0, 4], dtype=torch.int32)
    assert twell_mlp.block_dense(torch.cat([nnz, over]), (300, 150, 3)).tolist() == [True, False, True]


def test_thin_sparse_waves_on_132_sms():
    """The row-by-row sparse kernel runs 8 CTAs of one row each per SM: 1056 rows fill a wave on 132 SMs,
    and up to 1188 rows the second wave is at most an eighth full."""
    def thin(m, d=2048):
        return twell_mlp.thin_sparse_wave(m, d, 132, twell_mlp.sparse_launch(m, d, 132, True))

    assert [m for m in range(129, 4097) if thin(m)] == list(range(1057, 1189))
    assert not thin(1152, d=4096)  # four column groups a thread: residency not fixed by the kernel
    assert not thin(1152, d=2044)  # rows not 16 bytes: one element per access, other launches
    assert not twell_mlp.thin_sparse_wave(64, 2048, 132, twell_mlp.sparse_launch(64, 2048, 132, True))


def test_every_python_path_call_ends_the_layers_lease(recording_extension, monkeypatch):
    """Each call on the Python path ends its layer's lease first, whatever its size, and the calls the
    lease served go to the router's count where it routes by density: that call is counted too, and
    may change the layer's route, so a lease granted before it must not serve on."""
    from twell_compile.kernels import leases

    ext = recording_extension
    ended = []

    def end_lease(weight):
        ended.append(weight)
        return twell_mlp._ROUTE_TAGS["small"], 5  # a lease of the "small" class that served 5 calls

    ext.end_lease = end_lease
    monkeypatch.setattr(leases, "_ext", ext)
    monkeypatch.setattr(leases, "FAST_MLP", lambda *args: None)
    weight, down = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)

    def call(m):
        twell_mlp.twell_mlp(torch.randn(m, 32, dtype=torch.bfloat16), weight, None, weight, None, down, None)

    call(1024)  # the router does not know the layer yet: nothing to count in
    state = twell_mlp.ROUTER._layer(weight, create=False).classes["small"]
    assert ended == [weight] and state.calls == 1
    call(1024)
    assert len(ended) == 2 and state.calls == 1 + 5 + 1
    call(300)  # a call of the cuBLAS rows, which the router does not watch, ends it too
    assert len(ended) == 3 and state.calls == 12
    monkeypatch.setattr(twell_mlp.config, "route_by_density", False)
    call(1024)  # ended, not counted
    assert len(ended) == 4 and state.calls == 12
    monkeypatch.setattr(leases, "FAST_MLP", None)  # no lease granted in this process yet: nothing to end
    call(1024)
    assert len(ended) == 4


def test_thin_waves_route_from_a_lower_density(recording_extension, monkeypatch):
    device = torch.device("cuda", 0)
    kernels = twell_mlp._dense_thresholds(1152, 5632, False)
    plan = twell_mlp.call_plan(1152, 5632, 2048, device)
    assert plan.thresholds == kernels and plan.route_class == "small"
    assert plan.route_thresholds == (int(128 * 5632 * 0.0062), int(128 * 5632 * 0.0062), kernels[2])
    assert plan.route_thresholds[0] < kernels[0]  # 34.9 against 42.1 active units per row
    for m in (1024, 1280, 4096, 32768):  # full enough waves, or chunked (not routed)
        assert twell_mlp.call_plan(m, 5632, 2048, device).route_thresholds is None
    monkeypatch.setattr(twell_mlp.config, "thin_wave_route_density", 0.0)
    assert twell_mlp.call_plan(1152, 5632, 2048, device).route_thresholds is None
    monkeypatch.setattr(twell_mlp.config, "thin_wave_route_density", 0.5)  # never above the kernels' test
    assert twell_mlp.call_plan(1152, 5632, 2048, device).route_thresholds is None


@pytest.mark.parametrize("route_density", [0.0062, 0.0], ids=["thin-wave-test", "kernels-test"])
def test_reports_of_thin_wave_calls_count_blocks_by_the_route_test(recording_extension, monkeypatch, route_density):
    """A 1152-row call at 36 active units per row: no block is dense for the kernels (42 units a row), but
    each is for the route, so both the TwELL path's and the cuBLAS route's reports count all nine."""
    monkeypatch.setattr(twell_mlp.config, "thin_wave_route_density", route_density)
    m, f, k = 1152, 5632, 32
    weight, down = torch.randn(f, k, dtype=torch.bfloat16), torch.randn(k, f, dtype=torch.bfloat16)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    blocks = m // 128
    block_nnz = torch.cat([torch.full((blocks,), 36 * 128, dtype=torch.int32), torch.zeros(blocks, dtype=torch.int32)])
    monkeypatch.setattr(recording_extension, "mlp_forward", lambda *args: (
        x.new_zeros(m, k), torch.zeros(m, 44, dtype=torch.int32), block_nnz))
    twell_mlp.twell_mlp(x, weight, None, weight, None, down, None)
    expected = 1.0 if route_density else 0.0
    assert twell_mlp.ROUTER.share(weight, "small") == expected

    act = torch.zeros(m, f, dtype=torch.bfloat16)
    act[:, torch.arange(36) * 128] = 1.0  # one unit in each of 36 tiles: none past capacity
    monkeypatch.setattr(recording_extension, "cublas_mlp", lambda *args: (x.new_zeros(m, k), act))
    other = torch.randn(f, k, dtype=torch.bfloat16)  # a second layer, reporting from the cuBLAS route
    twell_mlp._cublas_mlp(x, other, None, other, None, down, None, report=twell_mlp.call_plan(m, f, k, x.device))
    assert twell_mlp.ROUTER.share(other, "small") == expected


def test_a_lease_covers_the_calls_before_the_next_report():
    """``lease_calls`` (kernels/leases.py): after its first reports, a layer's calls may skip the router up
    to the next call due to report; counted afterwards (``count_calls``), the call after them reports as
    ``decide`` would have had it."""
    router, weight = DensityRouter(), torch.randn(8, 4)
    assert router.lease_calls(weight, "small", 8) == 0  # an unknown layer
    assert router.decide(weight, "small", 8, 1024) == (False, True)
    assert router.lease_calls(weight, "small", 8) == 0  # its second call is due to report too
    assert router.decide(weight, "small", 8, 1024) == (False, True)
    assert router.lease_calls(weight, "small", 8) == 6  # calls 2-7
    router.count_calls(weight, "small", 6)
    assert router.lease_calls(weight, "small", 8) == 0  # call 8 is next, and reports
    assert router.decide(weight, "small", 8, 1024) == (False, True)
    assert router.decide(weight, "small", 8, 1024) == (False, False)
    assert router.lease_calls(weight, "small", 8) == 6  # calls 10-15
    router.count_calls(weight, "small", 2)  # a lease that served only two of them
    assert router.lease_calls(weight, "small", 8) == 4
    assert router.lease_calls(weight, "decode", 8) == 0  # classes apart
    router.count_calls(weight, "decode", 5)  # nothing to count them in
    router.count_calls(torch.randn(8, 4), "small", 5)


def test_no_lease_while_reports_are_in_flight():
    router, weight = DensityRouter(), torch.randn(8, 4)
    router._words = words = _ReportWords(1, pinned=False)
    for _ in range(3):
        router.decide(weight, "small", 8, 1024)
    router._layer(weight, create=False).pending.append(("small", words.take(), 8))
    assert router.lease_calls(weight, "small", 8) == 0
    words.tensor.fill_(0)  # landed; the next decide reads it
    router.decide(weight, "small", 8, 1024)
    assert router.lease_calls(weight, "small", 8) == 4


def test_reports_and_clearing_revoke_leases(monkeypatch):
    from twell_compile.kernels import leases

    revoked = []
    monkeypatch.setattr(leases, "revoke", lambda weight: revoked.append(weight))
    monkeypatch.setattr(leases, "revoke_all", lambda: revoked.append("all"))
    router, weight = DensityRouter(), torch.randn(8, 4)
    _report(router, weight, "small", 1)
    assert revoked == [weight]
    router.clear()
    assert revoked[-1] == "all"
    twell_mlp.config.route_report_every = twell_mlp.config.route_report_every  # any setting
    assert revoked[-1] == "all" and len(revoked) == 3


def test_a_layer_is_its_storage_not_its_address(monkeypatch):
    """A new weight at a freed weight's address (its storage kept alive by ``resize_(0)``, as FSDP
    does) starts afresh: it does not inherit the old layer's route. One address for every weight stands
    in for the address reuse."""
    real_key = density_route.weight_key
    monkeypatch.setattr(density_route, "weight_key", lambda weight: ("one address", *real_key(weight)[1:]))
    router = DensityRouter()
    old = torch.randn(8, 4)
    for _ in range(3):
        router.report(old, "small", torch.tensor(8), 8)  # every block dense: routed to cuBLAS
    assert router.share(old, "small") == 1.0
    old.untyped_storage().resize_(0)
    new = torch.randn(8, 4)
    assert router.share(new, "small") is None
    assert router.decide(new, "small", 8, 1024) == (False, True)  # a first call: TwELL, and it reports


def test_a_report_whose_copy_fails_leaves_nothing_pending(monkeypatch):
    class FailingCount:  # stands in for a CUDA count whose copy fails
        is_cuda = True

    router, weight = DensityRouter(), torch.randn(8, 4)
    router._words = _ReportWords(4, pinned=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(TypeError):
        router.report(weight, "small", FailingCount(), 8)
    layer = router._layer(weight, create=False)
    assert layer is None or not layer.pending
    assert router.lease_calls(weight, "small", 8) == 0  # (no layer state yet: no lease either way)
