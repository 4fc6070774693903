"""The host-side choices of the CUDA path (CPU-only checks): which path a 128-row block takes, and how
the sparse kernel is launched at decode. The kernels make the same integer test on the device, so these
numbers are what decides where every output row is computed."""

from __future__ import annotations

import pytest
import torch

from twell_compile.kernels import twell_mlp

INT_MAX = 2**31 - 1


def test_dense_thresholds_large_and_decode_calls():
    f = 5632
    # 5000 rows: 39 full blocks and a last block of 8 rows, at 1.1% of their units (62 of 5632 per row).
    assert twell_mlp._dense_thresholds(5000, f, entry_split=False) == (int(128 * f * 0.011), int(8 * f * 0.011), 16)
    assert int(128 * f * 0.011) // 128 == 61
    # 129 to 4096 rows (one wave of sparse-kernel CTAs, stragglers set the time): 0.68 of that, 0.75%.
    small = 0.011 * 0.68
    for m, last in ((1000, 104), (4096, 128), (129, 1)):
        assert twell_mlp._dense_thresholds(m, f, entry_split=False) == (int(128 * f * small), int(last * f * small), 16)
    assert int(128 * f * small) // 128 == 42
    # Decode with the clustered sparse kernel: 5% of the (single, partial) block; heavy rows still count.
    assert twell_mlp._dense_thresholds(40, f, entry_split=True) == (int(128 * f * 0.05), int(40 * f * 0.05), 16)
    # Clustered past decode sizes too (the dense path is the wgmma GEMMs there, but the crossover is alike).
    assert twell_mlp._dense_thresholds(100, f, entry_split=True) == (int(128 * f * 0.05), int(100 * f * 0.05), 16)


def test_forced_paths_reach_the_thresholds(monkeypatch):
    config = twell_mlp.config
    for name in ("dense_block_density", "decode_dense_block_density"):
        monkeypatch.setattr(config, name, float("inf"))
    monkeypatch.setattr(config, "heavy_block_overflow_tiles", INT_MAX)
    for entry_split in (False, True):
        assert twell_mlp._dense_thresholds(7, 100, entry_split) == (INT_MAX, INT_MAX, INT_MAX)
    for name in ("dense_block_density", "decode_dense_block_density"):
        monkeypatch.setattr(config, name, 0.0)
    for entry_split in (False, True):
        assert twell_mlp._dense_thresholds(7, 100, entry_split)[:2] == (0, 0)


def test_block_dense_matches_the_device_test():
    # Two full blocks and a partial one: active units, then row-tiles past capacity.
    stats = torch.tensor([100, 101, 50, 0, 17, 0], dtype=torch.int32)
    dense = twell_mlp.block_dense(stats, (100, 40, 16))
    assert dense.tolist() == [False, True, True]


def test_sparse_kernel_clusters_at_decode():
    sms = 132
    # At most one CTA per SM in all (a CTA sharing its SM paces the launch), clusters of 2 at least.
    assert ([twell_mlp._sparse_cluster(m, sms) for m in (1, 16, 17, 24, 32, 33, 40, 64, 65, 128, 129, 4096)]
            == [8, 8, 7, 5, 4, 4, 3, 2, 2, 2, 1, 1])
    assert twell_mlp._sparse_threads(128) == 256 and twell_mlp._sparse_threads(129) == 128
    # On any SM count, up to 128 rows: the largest cluster of 2 to 8 that gives no SM two CTAs (or 2).
    for sms in (16, 78, 114, 132, 144):
        for m in range(1, 129):
            cluster = twell_mlp._sparse_cluster(m, sms)
            assert 2 <= cluster <= 8 and (m * cluster <= sms or cluster == 2), (sms, m, cluster)
            assert cluster == 8 or m * (cluster + 1) > sms, (sms, m, cluster)


def test_sparse_kernel_column_splits():
    # Small batches: enough CTAs for 132 SMs, at most one 128-column group per split; large: one CTA per row.
    assert twell_mlp._column_splits(1, 2048, 132, vec8=True) == 16
    assert twell_mlp._column_splits(64, 2048, 132, vec8=True) == 5
    assert twell_mlp._column_splits(100, 2048, 132, vec8=True) == 2  # past decode sizes: one CTA per SM
    assert twell_mlp._column_splits(256, 2048, 132, vec8=True) == 1
    assert twell_mlp._column_splits(131072, 2048, 132, vec8=True) == 1
    # Scalar columns: 128 threads cover at most 512 columns per CTA.
    assert twell_mlp._column_splits(131072, 2050, 132, vec8=False) == 5


def test_sparse_launch_takes_the_entry_split_only_where_it_fits():
    SparseLaunch, launch = twell_mlp.SparseLaunch, twell_mlp.sparse_launch
    # Decode-sized calls: clusters share each row's units, one CTA holding every output column.
    assert launch(1, 2048, 132, vec8=True) == SparseLaunch(threads=256, splits=1, cluster=8)
    assert launch(64, 2048, 132, vec8=True) == SparseLaunch(threads=256, splits=1, cluster=2)
    assert launch(1, 8192, 132, vec8=True).entry_split  # 4 groups of 8 columns per thread
    # Too many columns for one CTA (8 per access, or 1 without 16-byte rows): column splits instead.
    assert launch(1, 8200, 132, vec8=True) == SparseLaunch(256, twell_mlp._column_splits(1, 8200, 132, True), 1)
    assert launch(1, 2048, 132, vec8=False) == SparseLaunch(256, 16, 1)
    # Up to 128 rows the same; past them 128 threads, column splits, never a cluster.
    assert launch(128, 2048, 132, vec8=True) == SparseLaunch(threads=256, splits=1, cluster=2)
    assert launch(129, 2048, 132, vec8=True) == SparseLaunch(128, twell_mlp._column_splits(129, 2048, 132, True), 1)
    assert not launch(131072, 2048, 132, vec8=True).entry_split


def test_call_plan_is_cached_per_shape_and_follows_the_settings(monkeypatch):
    """The one-call CUDA path takes its launch choices from a plan cached per shape: the same choices
    the step-by-step path makes, and a fresh plan whenever a setting changes."""
    import types

    from twell_compile.kernels import build

    monkeypatch.setattr(twell_mlp, "_PLANS", {})
    monkeypatch.setattr(twell_mlp, "_num_sms", lambda device: 132)
    monkeypatch.setattr(build, "cuda_extension", lambda: types.SimpleNamespace(MlpPlan=types.SimpleNamespace, sparse_mlp_fits=lambda *args: True))
    device = torch.device("cuda", 0)
    decode = twell_mlp.call_plan(16, 5632, 2048, device)
    assert twell_mlp.call_plan(16, 5632, 2048, device) is decode
    assert decode.thresholds == twell_mlp._dense_thresholds(16, 5632, entry_split=True)
    cuda = decode.cuda
    assert (cuda.decode_gate, cuda.decode_dense, cuda.sparse_threads, cuda.sparse_splits, cuda.sparse_cluster) == (
        True, True, 256, 1, 8)
    assert (cuda.thr_full, cuda.thr_last, cuda.thr_heavy) == decode.thresholds and not cuda.poison
    large = twell_mlp.call_plan(4096, 5632, 2048, device).cuda
    assert (large.decode_gate, large.decode_dense, large.ctas, large.sparse_cluster) == (False, False, 132, 1)
    # Programmatic dependent launches for decode-sized calls only (they lost 1-5% at 1024-16384 rows).
    assert cuda.programmatic is True and large.programmatic is False
    monkeypatch.setattr(twell_mlp.config, "programmatic_launch", False)
    assert twell_mlp.call_plan(16, 5632, 2048, device).cuda.programmatic is False
    monkeypatch.setattr(twell_mlp.config, "programmatic_launch", True)

    monkeypatch.setattr(twell_mlp.config, "decode_dense_gemv", False)
    assert twell_mlp.call_plan(16, 5632, 2048, device).cuda.decode_dense is False
    monkeypatch.setattr(twell_mlp.config, "wgmma_kernels", False)
    assert twell_mlp.call_plan(16, 5632, 2048, device).cuda is None


def test_call_plan_takes_the_chunked_kernel_for_large_calls_that_fit(monkeypatch):
    import types

    from twell_compile.kernels import build

    fits = {}

    def chunked_sparse_fits(k, f, d, element_size, gated):
        fits["asked"] = (f, d)
        return f <= 6000

    ext = types.SimpleNamespace(MlpPlan=types.SimpleNamespace, sparse_mlp_fits=lambda *args: True, chunked_sparse_fits=chunked_sparse_fits)
    monkeypatch.setattr(twell_mlp, "_PLANS", {})
    monkeypatch.setattr(twell_mlp, "_num_sms", lambda device: 132)
    monkeypatch.setattr(build, "cuda_extension", lambda: ext)
    monkeypatch.setattr(twell_mlp.config, "chunked_sparse_rows", 32768)
    device = torch.device("cuda", 0)
    assert twell_mlp.call_plan(131072, 5632, 2048, device).cuda.chunked
    assert fits["asked"] == (5632, 2048)
    assert not twell_mlp.call_plan(32767, 5632, 2048, device).cuda.chunked
    assert twell_mlp.call_plan(32768, 5632, 2048, device).cuda.chunked
    assert not twell_mlp.call_plan(131072, 11008, 4096, device).cuda.chunked  # does not fit
    assert not twell_mlp.call_plan(131072, 5632, 2046, device).cuda.chunked  # D % 8
    monkeypatch.setattr(twell_mlp.config, "chunked_sparse_rows", 0)
    assert not twell_mlp.call_plan(131072, 5632, 2048, device).cuda.chunked


def test_sizes_past_the_kernels_limits_go_to_cublas(monkeypatch):
    """A call the TwELL kernels cannot launch (the sparse kernel's shared memory grows with F's tiles; an
    H200 holds about 3.0-3.6 million units' worth) runs the dense MLP through cuBLAS, not a launch that
    fails. The fit is asked at the narrowest gate tile, so it covers the Triton gate's more numerous tiles
    too, and a TWELL_GATE_PLAN's narrower ones."""
    import types

    from twell_compile.kernels import build

    asked = []

    def sparse_mlp_fits(n_tiles, d):
        asked.append((n_tiles, d))
        return n_tiles <= 50_000

    ext = types.SimpleNamespace(MlpPlan=types.SimpleNamespace, sparse_mlp_fits=sparse_mlp_fits,
                                chunked_sparse_fits=lambda *args: False)
    monkeypatch.setattr(twell_mlp, "_PLANS", {})
    monkeypatch.setattr(twell_mlp, "_num_sms", lambda device: 132)
    monkeypatch.setattr(build, "cuda_extension", lambda: ext)
    device = torch.device("cuda", 0)
    for m in (1, 16, 4096):
        assert not twell_mlp.call_plan(m, 5632, 2048, device).cublas
        assert twell_mlp.call_plan(m, 50_000 * 64 + 1, 2048, device).cublas
        assert twell_mlp.call_plan(m, 50_000 * 64 + 1, 2048, device).cuda is None
        assert not twell_mlp.call_plan(m, 50_000 * 64 + 1, 2048, device).kernels_fit  # (the step-by-step path's check)
        assert twell_mlp.call_plan(m, 5632, 2048, device).kernels_fit
    assert (88, 2048) in asked and (50_001, 2048) in asked  # ceil(F / 64) tiles
    monkeypatch.setattr(twell_mlp, "_GATE_PLAN_OVERRIDE", "64,32,128,8,4,4")  # 32-column tiles
    monkeypatch.setattr(twell_mlp, "_PLANS", {})
    assert twell_mlp.call_plan(16, 30_000 * 64, 2048, device).cublas  # 60,000 tiles of 32
    assert (60_000, 2048) in asked
    monkeypatch.setattr(twell_mlp, "_GATE_PLAN_OVERRIDE", "")
    # The down projection's output columns and the row count have limits of their own.
    assert twell_mlp.call_plan(4, 5632, twell_mlp.MAX_KERNEL_OUT_FEATURES + 1, device).cublas
    assert not twell_mlp.call_plan(4, 5632, twell_mlp.MAX_KERNEL_OUT_FEATURES, device).cublas
    assert twell_mlp.call_plan(twell_mlp.MAX_KERNEL_ROWS + 1, 5632, 2048, device).cublas
    # Past the chunked kernel's int32 entry count, a large call takes the row-by-row kernel instead.
    monkeypatch.setattr(twell_mlp.config, "chunked_sparse_rows", 32768)
    ext.chunked_sparse_fits = lambda *args: True
    assert twell_mlp.call_plan(twell_mlp.MAX_CHUNKED_ROWS, 5632, 2048, device).cuda.chunked
    assert not twell_mlp.call_plan(twell_mlp.MAX_CHUNKED_ROWS + 1, 5632, 2048, device).cuda.chunked


def test_step_by_step_path_refuses_sizes_past_the_kernels_limits_before_any_kernel(monkeypatch):
    """Called directly past the limits (the op itself routes such calls to cuBLAS first), the
    step-by-step path raises a twell error naming the sizes before it asks the extension for anything
    but the size check: the sparse launch would otherwise fail with CUDA's bare "invalid argument"."""
    from twell_compile.kernels import build

    called = []

    class Extension:
        def sparse_mlp_fits(self, n_tiles, d):
            return n_tiles <= 50

        def __getattr__(self, name):
            called.append(name)
            return lambda *args: None

    monkeypatch.setattr(build, "cuda_extension", lambda: Extension())
    monkeypatch.setattr(twell_mlp, "_num_sms", lambda device: 132)
    monkeypatch.setattr(twell_mlp, "_PLANS", {})
    f = 50 * 64 + 1  # 51 tiles of the narrowest gate tile
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    weight, down = torch.zeros(f, 8, dtype=torch.bfloat16), torch.zeros(8, f, dtype=torch.bfloat16)
    for up in (weight, None):
        with pytest.raises(ValueError, match=rf"twell: a call of 3 rows, {f} intermediate and 8 output features "
                                             r"is past the TwELL kernels' limits"):
            twell_mlp._twell_mlp_general(x, weight, None, up, None, down, None)
    assert called == []


def test_chunked_calls_decide_on_the_device_at_their_own_density(monkeypatch):
    """A chunked call's kernel gets the chunked density (1.8%) and the heavy-row limit; what the call
    returns for statistics is the kernel's decision per block (1: dense), which block_dense reads with
    CHUNKED_DECISION_THRESHOLDS."""
    import types

    from twell_compile.kernels import build

    ext = types.SimpleNamespace(MlpPlan=types.SimpleNamespace, sparse_mlp_fits=lambda *args: True, chunked_sparse_fits=lambda *args: True)
    monkeypatch.setattr(twell_mlp, "_PLANS", {})
    monkeypatch.setattr(twell_mlp, "_num_sms", lambda device: 132)
    monkeypatch.setattr(build, "cuda_extension", lambda: ext)
    monkeypatch.setattr(twell_mlp.config, "chunked_sparse_rows", 32768)
    f = 5632
    plan = twell_mlp.call_plan(40000, f, 2048, torch.device("cuda", 0))  # last block: 40000 - 312 * 128 = 64 rows
    assert plan.cuda.chunked
    assert (plan.cuda.thr_full, plan.cuda.thr_last, plan.cuda.thr_heavy) == (
        int(128 * f * 0.018), int(64 * f * 0.018), 16)
    assert plan.thresholds == twell_mlp.CHUNKED_DECISION_THRESHOLDS
    decided = torch.tensor([0, 1, 1, 0, 0, 0], dtype=torch.int32)
    assert twell_mlp.block_dense(decided, plan.thresholds).tolist() == [False, True, True]
    small = twell_mlp.call_plan(4096, f, 2048, torch.device("cuda", 0))
    assert not small.cuda.chunked and small.thresholds == twell_mlp._dense_thresholds(4096, f, entry_split=False)


def test_sliced_weight_layouts():
    """Slice s of the chunked kernel's weights holds 8 columns of every unit: W_up [F, K] ->
    [K / 8, F, 8] with [s, n, i] = W_up[n, 8 s + i]; W_down [D, F] -> [D / 8, F, 8] with
    [s, n, i] = W_down[8 s + i, n] (a column of W_down^T)."""
    from twell_compile.kernels.weight_cache import DOWN_WEIGHT_SLICED, UP_WEIGHT_SLICED

    up = torch.randn(40, 24)
    down = torch.randn(16, 40)
    up_sliced, down_sliced = UP_WEIGHT_SLICED.get(up), DOWN_WEIGHT_SLICED.get(down)
    assert up_sliced.shape == (3, 40, 8) and down_sliced.shape == (2, 40, 8)
    assert up_sliced.is_contiguous() and down_sliced.is_contiguous()
    for s, n, i in [(0, 0, 0), (2, 39, 7), (1, 17, 3)]:
        assert up_sliced[s, n, i] == up[n, 8 * s + i]
    for s, n, i in [(0, 0, 0), (1, 39, 7), (1, 5, 2)]:
        assert down_sliced[s, n, i] == down[8 * s + i, n]
    assert UP_WEIGHT_SLICED.get(up) is up_sliced  # cached per weight version
    up.mul_(2.0)
    assert torch.equal(UP_WEIGHT_SLICED.get(up), up_sliced * 2.0)


def test_inference_tensor_weights_are_not_cached_and_say_so_once(monkeypatch):
    """An inference tensor has no version counter, so an in-place update could not be seen: its re-laid
    copy is rebuilt every call (still correct), and one warning tells the user why and what to do."""
    import warnings

    from twell_compile.kernels import weight_cache

    monkeypatch.setattr(weight_cache, "_warned_inference_weight", False)
    with torch.inference_mode():
        weight = torch.randn(16, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = weight_cache.DOWN_WEIGHT_T.get(weight), weight_cache.DOWN_WEIGHT_T.get(weight)
    assert [str(w.message) for w in caught] == [weight_cache._INFERENCE_WEIGHT_WARNING]
    assert "torch.inference_mode()" in str(caught[0].message)
    assert first is not second and torch.equal(first, weight.t()) and torch.equal(second, weight.t())
    ordinary = torch.randn(16, 8)
    with torch.inference_mode():  # an ordinary weight used inside inference mode is cached as usual
        assert weight_cache.DOWN_WEIGHT_T.get(ordinary) is weight_cache.DOWN_WEIGHT_T.get(ordinary)


def test_weight_cache_hit_on_another_stream_waits_for_the_fill(monkeypatch):
    """A cache entry's user on the filling stream adds nothing; on another stream it waits on the fill's
    event and is recorded with the allocator; during a capture it adds nothing (an event recorded outside
    a capture cannot be waited on inside it). Stand-ins for the CUDA stream API, on the CPU; the GPU test
    is tests/test_cuda_kernels.py::test_call_on_another_stream_waits_for_the_weight_cache_fill."""
    from twell_compile.kernels import weight_cache

    log = []
    current = {"stream": 7, "capturing": False}

    class Stream:
        def __init__(self, handle):
            self.handle = handle

        def wait_event(self, event):
            log.append(("wait", self.handle, event))

    class Event:
        def record(self, stream):
            log.append(("record", stream.handle))

    class Derived:
        device = torch.device("cuda", 0)

        def record_stream(self, stream):
            log.append(("in use by", stream.handle))

    monkeypatch.setattr(weight_cache, "_raw_stream", lambda device: current["stream"])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(current["stream"]))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: current["capturing"])
    fill = weight_cache._Fill(torch.device("cuda", 0))
    assert log == [("record", 7)]
    fill.order_use(Derived())  # the filling stream: ordered already
    assert log == [("record", 7)]
    current["stream"] = 9
    fill.order_use(Derived())
    assert log[1:] == [("wait", 9, fill.event), ("in use by", 9)]
    current.update(stream=11, capturing=True)
    fill.order_use(Derived())
    assert len(log) == 3


def test_step_by_step_path_launches_what_the_one_call_path_launches(monkeypatch):
    """With the one-call path declining (as for unaligned operands), the Python path runs the same
    kernel entries in the same order as csrc/twell_mlp_forward.cpp: the gate (GEMV at decode sizes),
    the sparse kernel, then the dense path (gate times up, or the non-gated rebuild; then the down
    projection). Recorded with a stand-in extension, on CPU tensors."""
    import types

    from twell_compile.kernels import build

    calls = []

    class RecordingExtension:
        MlpPlan = types.SimpleNamespace

        def mlp_forward(self, *args):
            calls.append("mlp_forward")
            return None

        def cublas_mlp(self, x, w_act, *args):
            calls.append("cublas_mlp")
            return x.new_empty(x.shape[0], args[-2].shape[0]), x.new_empty(x.shape[0], w_act.shape[0])

        def end_lease(self, weight):  # no lease was granted through the stand-in
            return -1, 0

        def sparse_mlp_fits(self, n_tiles, d):  # (the plan's size check, not a launch)
            return True

        def __getattr__(self, name):
            return lambda *args: calls.append(name)

    ext = RecordingExtension()
    monkeypatch.setattr(twell_mlp, "_PLANS", {})
    monkeypatch.setattr(twell_mlp, "_num_sms", lambda device: 132)
    monkeypatch.setattr(build, "cuda_extension", lambda: ext)
    monkeypatch.setattr(twell_mlp.config, "cublas_rows", (1, 0))  # M = 300 on the kernels
    expected = {
        (16, True): ["decode_gate_twell", "sparse_mlp_out", "decode_dense_gemv", "decode_dense_gemv"],
        (16, False): ["decode_gate_twell", "sparse_mlp_out", "rebuild_dense_gate", "decode_dense_gemv"],
        (300, True): ["gate_twell_gemm", "sparse_mlp_out", "dense_block_gemm", "dense_block_gemm"],
        (300, False): ["gate_twell_gemm", "sparse_mlp_out", "rebuild_dense_gate", "dense_block_gemm"],
    }
    weight = torch.randn(64, 32, dtype=torch.bfloat16)
    down = torch.randn(32, 64, dtype=torch.bfloat16)
    for (m, gated), kernels in expected.items():
        calls.clear()
        x = torch.randn(m, 32, dtype=torch.bfloat16)
        out = twell_mlp.twell_mlp(x, weight, None, weight if gated else None, None, down, None)
        assert out.shape == (m, 32)
        assert calls == ["mlp_forward", *kernels], (m, gated)
    # With the default cuBLAS rows, M = 300 is one call to the dense MLP through cuBLAS, then the layer's
    # lease for its next calls of that size (kernels/leases.py), and nothing else.
    monkeypatch.setattr(twell_mlp.config, "cublas_rows", twell_mlp.KernelConfig().cublas_rows)
    for gated in (True, False):
        calls.clear()
        out = twell_mlp.twell_mlp(torch.randn(300, 32, dtype=torch.bfloat16), weight, None, weight if gated else None,
                                  None, down, None)
        assert out.shape == (300, 32) and calls == ["cublas_mlp", "grant_lease"], gated


def test_cublas_rows_are_a_host_side_choice_by_row_count(monkeypatch):
    """Calls of 33-512 rows (the default) run the dense MLP through cuBLAS; the setting moves the range
    ("A-B", both ends included) or switches it off ("0"), and a changed setting drops the cached plans."""
    import types

    import pytest

    from twell_compile.kernels import build

    ext = types.SimpleNamespace(MlpPlan=types.SimpleNamespace, sparse_mlp_fits=lambda *args: True, chunked_sparse_fits=lambda *args: True)
    monkeypatch.setattr(twell_mlp, "_PLANS", {})
    monkeypatch.setattr(twell_mlp, "_num_sms", lambda device: 132)
    monkeypatch.setattr(build, "cuda_extension", lambda: ext)
    device = torch.device("cuda", 0)
    assert twell_mlp._row_range("33-512") == (33, 512) == twell_mlp.KernelConfig().cublas_rows
    monkeypatch.setattr(twell_mlp.config, "cublas_rows", (33, 512))
    routed = {m: twell_mlp.call_plan(m, 5632, 2048, device).cublas for m in (1, 32, 33, 64, 300, 512, 513, 131072)}
    assert routed == {1: False, 32: False, 33: True, 64: True, 300: True, 512: True, 513: False, 131072: False}
    monkeypatch.setattr(twell_mlp.config, "cublas_rows", twell_mlp._row_range("64-512"))
    assert not twell_mlp.call_plan(63, 5632, 2048, device).cublas and twell_mlp.call_plan(64, 5632, 2048, device).cublas
    assert twell_mlp.call_plan(300, 5632, 2048, device).cuda is None
    monkeypatch.setattr(twell_mlp.config, "cublas_rows", twell_mlp._row_range("0"))
    assert not twell_mlp.call_plan(300, 5632, 2048, device).cublas
    assert twell_mlp._row_range("") == (1, 0)
    for bad in ("512", "0-10", "100-65", "a-b"):
        with pytest.raises(ValueError, match="row range"):
            twell_mlp._row_range(bad)


def test_gate_runs_ping_pong_in_single_ctas_where_its_waves_waste_less(monkeypatch):
    """By default (``gate_pingpong_rows`` None, "auto") the gate GEMM runs 128-row ping-pong tiles in
    single CTAs where cooperative 256-row tiles would leave a thin last wave: on 132 SMs, 2B shape (44
    tiles across), 769-1152, 1537-1920 and 2305-2688 rows. Every other size keeps ``gate_gemm_tile_m``
    and ``gemm_cluster``, as do the dense path's GEMMs at every size; a range or "0" overrides."""
    import types

    from twell_compile.kernels import build

    ext = types.SimpleNamespace(MlpPlan=types.SimpleNamespace, sparse_mlp_fits=lambda *args: True, chunked_sparse_fits=lambda *args: True)
    monkeypatch.setattr(twell_mlp, "_PLANS", {})
    monkeypatch.setattr(twell_mlp, "_num_sms", lambda device: 132)
    monkeypatch.setattr(build, "cuda_extension", lambda: ext)
    monkeypatch.setattr(twell_mlp.config, "wgmma_kernels", True)
    monkeypatch.setattr(twell_mlp.config, "gate_pingpong_rows", None)
    device = torch.device("cuda", 0)
    assert twell_mlp._auto_or_row_range("auto") is None
    default = (twell_mlp.config.gate_gemm_tile_m, twell_mlp.config.gemm_cluster)

    def gate(m, f=5632):
        cuda = twell_mlp.call_plan(m, f, 2048, device).cuda
        assert cuda.gemm_cluster == twell_mlp.config.gemm_cluster, m  # the dense path's GEMMs
        return cuda.gate_gemm_tile_m, cuda.gate_gemm_cluster

    pingpong = [m for m in range(257, 8193) if twell_mlp.pingpong_gate_fills_waves_better(m, 5632, 132)]
    assert (pingpong[0], pingpong[-1], len(pingpong)) == (769, 2688, 3 * 384)
    assert all(m in pingpong for m in (*range(769, 1153), *range(1537, 1921), *range(2305, 2689)))
    assert {m: gate(m) for m in (768, 769, 1024, 1152, 1153, 1536, 1792, 2048, 2560, 4096, 131072)} == {
        768: default, 769: (128, 1), 1024: (128, 1), 1152: (128, 1), 1153: default, 1536: default,
        1792: (128, 1), 2048: default, 2560: (128, 1), 4096: default, 131072: default}
    # The 8B shape (112 tiles across): 1024 rows make 448 cooperative tiles, 3.4 waves, against 6.8 of ping-pong.
    assert gate(1024, 14336) == (128, 1) and gate(1792, 14336) == default
    # A gate already set to ping-pong keeps its cluster setting.
    monkeypatch.setattr(twell_mlp.config, "gate_gemm_tile_m", 128)
    assert twell_mlp.gate_schedule(1024, 5632, 132) == (128, twell_mlp.config.gemm_cluster)
    monkeypatch.setattr(twell_mlp.config, "gate_gemm_tile_m", 256)
    monkeypatch.setattr(twell_mlp.config, "gate_pingpong_rows", twell_mlp._auto_or_row_range("3000-3100"))
    assert twell_mlp.gate_schedule(1024, 5632, 132) == default and twell_mlp.gate_schedule(3072, 5632, 132) == (128, 1)
    monkeypatch.setattr(twell_mlp.config, "gate_pingpong_rows", twell_mlp._auto_or_row_range("0"))
    monkeypatch.setattr(twell_mlp, "_PLANS", {})
    assert gate(1024) == default


def test_the_cuda_kernel_offers_each_call_to_its_lease_first(monkeypatch):
    """ops.py's CUDA kernels give a call to ``leases.FAST_MLP`` first (the C++ lease table,
    csrc/twell_fast_call.cpp), with the act weight, its bias, up weight and bias, down weight and bias;
    None there (no lease covers it) falls through to the checked Python path, and so does every call
    made while a sparsity recorder is active (the recorder must see it)."""
    from twell_compile import ops, record_sparsity, reference
    from twell_compile.kernels import leases

    offered = []
    served = torch.full((2, 4), 7.0)

    def fast_mlp(*args):
        offered.append(args)
        return served if len(offered) == 1 else None

    monkeypatch.setattr(leases, "FAST_MLP", fast_mlp)
    x, gate, up, down = torch.randn(2, 8), torch.randn(16, 8), torch.randn(16, 8), torch.randn(4, 16)
    assert ops._gated_cuda(x, gate, up, down) is served
    assert offered[0] == (x, gate, None, up, None, down, None)
    torch.testing.assert_close(ops._gated_cuda(x, gate, up, down), reference.gated_relu_mlp(x, gate, up, down))
    torch.testing.assert_close(ops._relu_cuda(x, up, down), reference.relu_mlp(x, up, down))
    assert offered[2] == (x, up, None, None, None, down, None)
    with record_sparsity():
        ops._gated_cuda(x, gate, up, down)
    assert len(offered) == 3
    with pytest.raises(ValueError, match="down_weight"):
        ops._gated_cuda(x, gate, up, torch.randn(4, 15))  # not covered: the Python path's checks run


def test_dtypes_the_kernels_do_not_take_run_the_reference_and_say_so_once(monkeypatch):
    """A float32 (or float64) call of the CUDA kernel runs the dense reference: exact, but with no
    speed-up, so it warns once per dtype, naming the cure. (Called on CPU tensors here: the check comes
    before anything touches a GPU.)"""
    import warnings

    from twell_compile import kernels, reference

    kernels._warn_dtype_once.cache_clear()
    monkeypatch.setattr(kernels.build, "kernels_available", lambda device: pytest.fail("dtype is checked first"))
    x, wg, wu, wd = torch.randn(3, 8), torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)
    with pytest.warns(RuntimeWarning, match=r"torch.float32 inputs run the dense PyTorch reference on CUDA.*bfloat16"):
        out = kernels.cuda_gated_relu_mlp(x, wg, wu, wd, None, None, None)
    torch.testing.assert_close(out, reference.gated_relu_mlp(x, wg, wu, wd))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per dtype
        kernels.cuda_relu_mlp(x, wu, wd, None, None)
    with pytest.warns(RuntimeWarning, match="torch.float64"):
        kernels.cuda_relu_mlp(x.double(), wu.double(), wd.double(), None, None)
    kernels._warn_dtype_once.cache_clear()


def test_a_plan_built_while_the_settings_change_is_not_kept(monkeypatch):
    """Plans are cached per shape and dropped when ``config`` changes; one built from the old settings
    while another thread changes them must not be stored after that drop."""
    monkeypatch.setattr(twell_mlp, "_PLANS", {})
    built = []

    def make_plan(m, f, d, device):
        if not built:  # the settings change while the first plan is built
            monkeypatch.setattr(twell_mlp.config, "route_report_every", twell_mlp.config.route_report_every + 1)
        built.append(m)
        return ("plan", len(built))

    monkeypatch.setattr(twell_mlp, "_make_call_plan", make_plan)
    assert twell_mlp.call_plan(4, 64, 32, torch.device("cpu")) == ("plan", 1)
    assert twell_mlp._PLANS == {}
    assert twell_mlp.call_plan(4, 64, 32, torch.device("cpu")) == ("plan", 2)
    assert twell_mlp.call_plan(4, 64, 32, torch.device("cpu")) == ("plan", 2)  # kept this time
