"""The TwELL path of the twell ops on CUDA: gate GEMM with packing epilogue, then sparse up + down.

Per call, all on PyTorch's current stream, allocations through its caching allocator, no host sync
(calls of ``config.cublas_rows`` rows, 33-512 by default, instead run the dense MLP through cuBLAS,
``csrc/twell_cublas_mlp.cu``: no TwELL path beats it there on every activation):
  1. the gate GEMM (``csrc/twell_gemm.cu``: TMA + wgmma, warp-specialised, on 256 x 128 tiles with a
     staged packing epilogue, 128 x 128 ping-pong tiles where those are too few, in CTA pairs sharing
     x tiles where there are enough tiles; at most 64 rows, the split-K GEMV of
     ``csrc/twell_decode_gemv.cu``; the Triton ``gate_twell_kernel`` for rows TMA cannot load, or with
     the wgmma GEMM switched off): relu(x W^T + b) packed per (row, N-tile),
     overflowing tiles to a dense backup, active counts summed per 128-row block;
  2. a block is dense when its active fraction exceeds ``config.dense_block_density`` or it has many
     overflowing row-tiles (each kernel makes the same integer test, ``csrc/dense_block_test.cuh``);
  3. ``sparse_mlp_out`` (``csrc/twell_sparse_mlp.cu``): sparse blocks' rows of the output. Large calls
     instead run ``chunked_sparse_mlp_out`` (``csrc/twell_sparse_chunked.cu``), which makes step 2's
     decision itself, not counting rows of more than 256 active units, and lists those rows for
     ``heavy_rows_mlp_out`` (``csrc/twell_heavy_rows.cu``), a dense MLP over just them;
  4. dense blocks' rows by dense GEMMs (the wgmma GEMM of ``csrc/twell_gemm.cu``; at most 64 rows, the
     split-K GEMVs of ``csrc/twell_decode_gemv.cu``; Triton kernels where the Triton gate ran or an
     operand is not TMA-able): h = relu(gate) * up in place in the backup
     buffer, the gate read from its TwELL output (non-gated: relu(up) expanded there by
     ``csrc/twell_gate_rebuild.cu``), then out = h W_down^T.
Steps 3 and 4 skip the blocks the other owns, so every output row is written exactly once.

With contiguous operands whose rows are 16-byte aligned (the usual case), all of it is one host call,
``mlp_forward`` (``csrc/twell_mlp_forward.cpp``), with the launch choices taken from a plan cached per
shape (``call_plan``): at decode sizes the host, not the GPU, sets the pace of an eager call, and the
step-by-step path below (``_twell_mlp_general``, which serves every other case) spent most of its time
in Python. The two make the same choices and agree bit for bit (tests/test_cuda_kernels.py). After a
call, ``_grant_lease`` may let its layer's next calls of the same size skip this module altogether
(``leases.py``).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton.language as tl
from torch import Tensor

from .. import stats
from . import build, leases, triton_kernels
from .density_route import ROUTER
from .weight_cache import DOWN_WEIGHT_SLICED, DOWN_WEIGHT_T, UP_WEIGHT_SLICED

DECISION_ROWS = triton_kernels.DECISION_ROWS

_PLANS: dict[tuple, "CallPlan"] = {}  # per (rows, intermediate, output features, device); see call_plan()
_MAX_PLANS = 4096
_settings_generation = 0  # counts config changes: a plan built across one is not cached


def _auto_or_row_range(text: str) -> tuple[int, int] | None:
    """``"auto"`` as None, else as ``_row_range``."""
    return None if text.strip() == "auto" else _row_range(text)


def _row_range(text: str) -> tuple[int, int]:
    """``"A-B"`` as (A, B); ``"0"`` or ``""`` as an empty range."""
    if text.strip() in ("", "0"):
        return (1, 0)
    low, sep, high = text.strip().partition("-")
    if not (sep and low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
        raise ValueError(f"twell: a row range is 'A-B' with 1 <= A <= B, or '0' for none; got {text!r}")
    return (int(low), int(high))


@dataclasses.dataclass
class KernelConfig:
    dense_block_density: float = float(os.environ.get("TWELL_DENSE_BLOCK_DENSITY", "0.011"))
    """A 128-row block whose fraction of active units exceeds this runs the dense GEMM path (1.1%, about
    62 of 5632). Where the forced-sparse and forced-dense paths crossed for the row-by-row sparse kernel
    (H100, 2B shape, CUDA graphs, 2026-11-23, uniform): M = 8192, 901 against 896 us at 64 active units
    per row, sparse ahead at 56 (838 against 896), dense at 80 (901 against 1063); M = 16384, 1760
    against 1756 us at 64; M = 24576, 2622 against 2595 at 64 (examples/results/
    sweep_threshold_h100_2026-11-23_mid.log). The 1.5% used before was measured on an H200 at M = 131072
    and left 80 units per row at 0.80-0.93x dense on the H100 between 4096 and 32768 rows."""
    small_batch_density_factor: float = float(os.environ.get("TWELL_SMALL_BATCH_DENSITY_FACTOR", "0.68"))
    """Calls of 129 to ``SMALL_BATCH_ROWS`` rows scale ``dense_block_density`` by this (1.1% to 0.75%).
    There the sparse kernel runs about one wave of CTAs, so a block's heaviest rows set its time, and
    the near-threshold blocks of skewed activations were much slower sparse than dense (H100, CUDA
    graphs, 2B shape, skewed data with 70-95 active units per row: M = 256, 138.6 against 76.9 us;
    M = 1024, 214.4 against 150.3; M = 4096, 595.9 against 468.2). With uniform activations the
    forced paths crossed between 56 and 80 units per row (1.0-1.4%): at 80, M = 1024 took 191.3 us sparse
    and 150.7 dense; at 56, 155.6 and 150.0 (M = 4096: 432.2 and 465.5). 24-39 units per row are
    untouched (examples/sweep_sparse_launch.py). 0.68 keeps them at 0.75% (0.748%)."""
    chunked_dense_block_density: float = float(os.environ.get("TWELL_CHUNKED_DENSE_BLOCK_DENSITY", "0.018"))
    """dense_block_density for calls that run the chunked sparse kernel (``chunked_sparse_rows``), whose
    cost grows more slowly with the active units: there the forced paths crossed between 96 and 112
    units per row, 1.7-2.0% (H100, 2B shape, M = 131072, uniform, CUDA graphs, 2026-11-23: at 96,
    13.96 ms sparse against 14.78 dense; at 112, 15.44 against 15.12; at 128, 16.88 against 15.28).
    Its rows of more than 256 active units (heavy rows) are not counted in the block's active units:
    they run as a compact dense MLP, each counted as a row at this density."""
    heavy_block_overflow_tiles: int = 16
    """A 128-row block with more (row, tile) pairs past capacity than this also runs the dense path: on
    the sparse path a row with hundreds of active units is one CTA's sequential work (a straggler). In
    calls of the chunked kernel, whose heavy rows run as a compact dense MLP, it is instead the most
    heavy rows a sparse block may have (which bounds that MLP's buffers to an eighth of the rows)."""
    decode_dense_block_density: float = float(os.environ.get("TWELL_DECODE_DENSE_BLOCK_DENSITY", "0.05"))
    """dense_block_density for calls whose sparse kernel splits each row's units over a cluster of CTAs
    (at most 128 rows; up to 64 their dense path runs as split-K GEMVs, decode_dense_gemv). On an H200
    at the 2B shape the forced paths crossed near 10%, 5% and 4.5% density for M = 1, 16 and 64 with
    every row alike (graph replays; dense path 43-45, 47-56 and 68-70 us). At M = 100 and 128 (H100,
    wgmma dense path) they crossed near 4-5%: at 2.1% the sparse path took 71-73 against 88 us, at
    2.8-4.3% both about 89-91 us, at 5.7% the dense path won by 14% (examples/sweep_sparse_launch.py). Rows far heavier than the rest are
    still stragglers (a fifth to an eighth of a 2000-unit row is one CTA's work), so the past-capacity
    rule (heavy_block_overflow_tiles) applies here too: with it off, M = 64 skewed ran at 0.13-0.19x
    dense, against 0.54x on the dense path."""
    wgmma_kernels: bool = os.environ.get("TWELL_WGMMA", "1") != "0"
    """Use the hand-written wgmma GEMMs (gate and dense path, csrc/twell_gemm.cu) where the shapes allow;
    off, the Triton kernels run everything (for comparison)."""
    gemm_cluster: int = int(os.environ.get("TWELL_GEMM_CLUSTER", "2"))
    """2: the wgmma GEMMs run in 2-CTA clusters that share each x (or h) tile by TMA multicast (half the
    L2 traffic for it) where there are enough tile pairs; 1: single CTAs (for comparison)."""
    gate_gemm_tile_m: int = int(os.environ.get("TWELL_GATE_GEMM_TILE_M", "256"))
    """The gate GEMM's schedule. 256 (the default): cooperative 256 x 128 tiles (both consumer warpgroups on
    one tile, a third of the L2 traffic per output off ping-pong's) with a staged epilogue: the
    consumers round the tile into shared memory and a fourth warpgroup packs it while they run the next
    tile's MMAs (csrc/twell_gemm.cu), where its tiles fill the GPU, else ping-pong; 128: ping-pong (128 x 128 tiles,
    each consumer warpgroup's epilogue hidden behind the other's MMAs). H100, 2B shape, M = 131072, with
    a bias, alternating rounds: 4.75-5.02 ms against 5.22-5.84 ms for ping-pong pairs, cuBLAS's dense
    GEMM 4.2-4.35 ms (examples/results/probe_staged_gate_h100_2026-11-23.log; a noisier
    bench_gate_gemm.py run: bench_gate_gemm_h100_2026-11-23_staged.log); run back to back at the
    power limit, 4.81 ms against cuBLAS's 4.59-4.60 and ping-pong's 5.42-5.46
    (ncu_gate_h100_2026-11-25_early_release.log). It is exact in every test
    (bitwise equal to ping-pong); the tile changes hands on mbarriers every thread arrives on, and
    compute-sanitizer's memcheck and racecheck were clean on it (sanitize_h100_2026-11-23_mbarrier.log,
    and again after the early stage release: sanitize_h100_2026-11-25.log)."""
    gate_pingpong_rows: tuple[int, int] | None = _auto_or_row_range(os.environ.get("TWELL_GATE_PINGPONG_ROWS", "auto"))
    """Which calls run the gate GEMM as ping-pong 128-row tiles in single CTAs where ``gate_gemm_tile_m``
    and ``gemm_cluster`` ask for cooperative 256-row tiles in pairs (those still set the dense path's
    GEMMs). ``None`` (``"auto"``, the default): where ping-pong's waves waste less of the GPU
    (``pingpong_gate_fills_waves_better``); ``"A-B"``: calls of A to B rows; ``"0"``: none. Whole calls
    (2B shape, H100, CUDA graphs of 8 calls, no dense block, 2026-11-28,
    examples/results/ab_gate_pingpong_1024_h100_2026-11-28.log and ab_gate_pingpong_rows_h100_2026-11-28.log),
    ping-pong against cooperative in two alternating rounds: 1024 rows 88.4-90.4 against 93.0-95.1 us at
    24 active units per row, 111.3-111.6 against 112.4-114.2 at 40. With ping-pong forced at every size:
    1792 rows 135.0-135.9 against 140.9-142.2 at 24, 163.9-169.4 against 171.0-171.8 at 40; 2560 rows
    189.0-191.4 against 194.2-196.9, 227.0-227.9 against 237.8-238.9; 3328 rows 242.1-243.4 against
    246.9-248.6, 295.3-296.9 against 298.5-298.7 (the wave count promises 2.6% there, so the rule keeps
    it cooperative). The gate alone (bench_gate_gemm.py, same day) was level or slower as ping-pong where
    both schedules fill their waves alike (768, 1280, 1536, 2048, 4608 rows; 8B shape: 512, 768, 1792)."""
    gemm_tile_m: int = int(os.environ.get("TWELL_GEMM_TILE_M", "256"))
    """The gate-times-up GEMM's schedule (dense path). 128: ping-pong (128 x 128 tiles, each consumer
    warpgroup's epilogue hidden behind the other's MMAs); 256: cooperative and staged (256 x 128 tiles,
    both consumers on one tile, less L2 traffic per output; a fourth warpgroup applies the gate to the
    staged tile and writes it out) where its tiles fill the GPU. The staged schedule is the faster one
    (H100, 2026-11-25, torch.profiler, every block dense: 558 against 633-636 us at M = 16384, 4.41-4.55
    against 5.03-5.05 ms per call at M = 131072); the cooperative one with the epilogue in the
    consumers, before it, was slower than ping-pong (H200: 5.5 against 5.0-5.1 ms at the 2B shape)."""
    down_gemm_tile_m: int = int(os.environ.get("TWELL_DOWN_GEMM_TILE_M", "256"))
    """The dense-path down GEMM's schedule (as gemm_tile_m). Its K is the intermediate size, so its
    mainloop is long beside its epilogue and the cooperative tiles pay (H200, 2B shape: 4.0-4.1 against
    4.4-4.5 ms), the more so staged (H100, 2026-11-25: 462-467 against 477 us at M = 16384, 120-123
    against 125-126 us at 4096, with the epilogue in the consumers)."""
    partly_dense_tile_m: int = int(os.environ.get("TWELL_PARTLY_DENSE_TILE_M", "128"))
    """The dense path's two GEMM schedules (``gemm_tile_m`` and ``down_gemm_tile_m``) on the calls that
    routing by density watches (below the chunked kernel's sizes, with ``route_by_density`` on). There a
    layer whose calls go dense beyond a small share runs through cuBLAS, so the dense path serves calls
    with a minority of dense blocks, and a 256-row tile runs half idle wherever a dense block shares it
    with a sparse one. With 128-row ping-pong tiles, whole calls at 4096-16384 rows were 6-7% faster with
    an eighth of the blocks dense and 10-12% with a quarter, 11-16% slower with every block dense, and
    the same bits (H100, CUDA graphs, 2026-11-27, examples/probe_dense_tile_m.py). 0 keeps
    ``gemm_tile_m`` and ``down_gemm_tile_m`` there too, as do calls with routing off (the kernel tests'
    and profiling scripts' setting), chunked calls and decode-sized ones (split-K GEMVs)."""
    gemm_k_splits: int = int(os.environ.get("TWELL_GEMM_K_SPLITS", "0"))
    """K ranges per output tile of the wgmma GEMMs. 0: chosen per GEMM (choose_k_split in
    csrc/twell_entries.h): where the 128 x 128 tiles are fewer than the SMs and K is long (the 2B
    dense path's down projection at M <= 512: 16-64 column tiles, K = 5632), each tile's K is split
    over several CTAs and the partial tiles are summed in a fixed order (deterministic); the gate's
    K = 2048 is not split, which measured slower (csrc/twell_gemm.cu). 1: never; 2-16: that many."""
    decode_gate_rows: int = int(os.environ.get("TWELL_DECODE_GATE_ROWS", "64"))
    """Calls of at most this many rows (64 at most) run the gate as a split-K GEMV over clusters of CTAs
    (csrc/twell_decode_gemv.cu) instead of the wgmma GEMM, which gives each 128-wide column tile to one
    CTA and so leaves most SMs idle at decode; 0 switches it off."""
    decode_dense_gemv: bool = os.environ.get("TWELL_DECODE_DENSE_GEMV", "1") != "0"
    """Calls of at most 64 rows run the dense path's GEMMs as split-K GEMVs over clusters of CTAs
    (csrc/twell_decode_gemv.cu), as the decode gate does; off, the wgmma GEMMs, which put the 2B down
    projection's 16 column tiles on 16 SMs."""
    decode_dense_branch: bool = os.environ.get("TWELL_DECODE_DENSE_BRANCH", "1") != "0"
    """Under CUDA graph capture, calls of at most 64 rows launch the dense path's two GEMVs on a branch
    of the graph forked after the gate and joined at the end of the call (csrc/twell_mlp_forward.cpp),
    so that in a sparse call, where they only read the block test and exit, they do so beside the
    sparse kernel rather than as two more dependent launches after it. Eager calls never fork."""
    decode_gate_parts: bool = os.environ.get("TWELL_DECODE_GATE_PARTS", "1") != "0"
    """Calls of at most 64 rows on the decode GEMVs pass the dense-block test's counts as one pair per
    gate CTA, which the reading kernels sum (csrc/dense_block_test.cuh), instead of totals the gate adds
    to zeroed memory: no memset before the gate."""
    decode_gemv_cluster: int = int(os.environ.get("TWELL_DECODE_GEMV_CLUSTER", "0"))
    """CTAs per cluster of the decode GEMVs, which split each column tile along K: 0 chooses (8, or 16
    where 8 would leave SMs idle and the GPU schedules 16); 1 to 16 forces a size (for measurements)."""
    chunked_sparse_rows: int = int(os.environ.get("TWELL_CHUNKED_SPARSE_ROWS", "32768"))
    """Calls of at least this many rows (0: none) run the sparse blocks' rows through the chunked
    kernel (csrc/twell_sparse_chunked.cu: chunks of ~500 rows stream all of W_up and W_down^T through
    shared memory, so each weight byte read from L2 serves several tokens) where the intermediate size
    fits its shared memory (about 6200 units in 16-bit types). It keeps two more copies of W_up and
    W_down, sliced, in the weight cache (1.75 GB more for the 2B model's 38 layers); set 0 to save that
    memory. H100, 2B shape, CUDA graphs, whole calls, 2026-11-23: at M = 131072 it took 8.01 against
    9.21 ms (row by row) at 24 active units per row, 9.30 against 10.71 at 39 and 12.55 against 16.44
    at 80; at M = 32768, 2.23 against 2.30 and 3.47 against 4.17 ms; at 16384 rows it lost at 24 (1.53
    against 1.17 ms), hence the limit. In the 2B Llama benchmark (activations from a calibrated gate
    bias, 19-34 mean active units per layer, some units far more often active than others, which
    helps the row-by-row kernel's caches) it was 1.3% slower: 1026.7 against 1013.8 ms. Its rows of
    more than 256 active units run as a compact dense MLP (csrc/twell_heavy_rows.cu), whose buffers
    take up to an eighth of the call's rows (about 320 MB at M = 131072, 2B shape) while it runs."""
    cublas_rows: tuple[int, int] = _row_range(os.environ.get("TWELL_CUBLAS_ROWS", "33-512"))
    """Calls whose row count lies in this range (both ends included; ``TWELL_CUBLAS_ROWS="A-B"``, ``"0"``
    for none) run the dense MLP through PyTorch's GEMMs (cuBLAS, ``csrc/twell_cublas_mlp.cu``) instead
    of a TwELL path. There no TwELL path measured faster than cuBLAS on the 2B shape: at 65-256 rows
    our gate GEMM alone takes 19-22 us where cuBLAS's takes 12.5-14, and the sparse kernel runs about
    one wave, paced by its heaviest rows (H100, CUDA graphs, 2026-11-23: M = 128, 48.8 against 43.7 us
    dense at 24 active units per row; M = 256, 62.0 against 51.7; skewed calls 0.35-0.65x dense).
    At 64 rows too: there the TwELL path was 1.03x, 0.95x and 0.72x dense at 24, 39 and 80 active units
    per row and 0.57-0.90x skewed, where the route took 1.04-1.06x uniform and 1.02-1.05x skewed (H100,
    CUDA graphs, 2026-11-25; the decode GEMVs of its dense path are slower than cuBLAS's). And from 33
    rows on: there TwELL won only on uniform activations at 24-39 units (1.11-1.22x against 0.96-1.06x),
    tied or lost on skewed ones at 24 (0.80-1.02x against 0.98-1.06x), and lost up to 1.7x at 80 units
    or skewed 39-80 (0.58-0.89x), where the route stays at 1.02-1.07x: the issue's "low sparsity never
    costs much" decides it (H100, CUDA graphs, 2026-11-25). Up to 32 rows TwELL stays (1.24-1.79x at
    8-24 rows, skewed rows included; at 32 rows 1.26-1.28x uniform at 24 units, but 0.73-0.86x in one
    run on skewed rows). The choice is by row count only, on the host:
    no sync, and the same result whatever the activation. README, "The decode GEMVs, measured" and "The
    cooperative GEMMs' last wave split along K"."""
    route_by_density: bool = os.environ.get("TWELL_ROUTE_BY_DENSITY", "1") != "0"
    """Route a layer's calls below the chunked kernel's sizes to cuBLAS's dense MLP while its earlier calls
    sent enough of their 128-row blocks to the dense path (``density_route.py``: a share that grows with
    the rows, 5% up to 1024 to 75% from 16384; the reports are read back without a host sync). With
    every block dense, the TwELL path took 0.76-0.89x the eager dense MLP at 768-2048 rows and the
    routed calls 1.06-1.07x; sparse calls stayed on TwELL (H100, CUDA graphs, 2026-11-27,
    examples/results/sweep_density_route_h100_2026-11-27.log). Off: the row count alone picks the path,
    and a layer's results never change route."""
    thin_wave_route_density: float = float(os.environ.get("TWELL_THIN_WAVE_ROUTE_DENSITY", "0.0062"))
    """Routing by density (``route_by_density``) also counts a block as going dense from this fraction of
    active units (0.62%, 35 of 5632) where the row-by-row sparse kernel would run a thin last wave
    (``thin_sparse_wave``: two waves, the second at most an eighth full; 1057-1188 rows on 132 SMs at
    the 2B shape). There a call with no dense block at all still lost to the cuBLAS MLP: at 1152 rows,
    40 active units per row, 127.0 against 116.7 us (1.09x its time) and 120.3 against 117.4 at 36,
    while 32 units took 0.97x (H200, CUDA graphs of 8 calls, 2026-11-28,
    examples/results/sweep_route_share_band_h200_2026-11-28.log); on an H100, 1.12x at 40 units. At
    1280 rows (a fifth-full second wave) 40 units were level (0.99x) and 36 ahead (0.95x), and 1024 and
    1408-1536 rows were ahead, so only the thinnest waves count this way. The kernels' own dense-block
    test is unchanged; 0 switches this off."""
    route_report_every: int = int(os.environ.get("TWELL_ROUTE_REPORT_EVERY", "32"))
    """After a layer's first calls of a size class, one call in this many reports its dense-block share
    for ``route_by_density`` (a reduction and a 4-byte copy to pinned memory, read at a later call)."""
    tma: bool = os.environ.get("TWELL_NO_TMA", "") == ""
    """Let the Triton kernels load through TMA descriptors where rows allow (off: pointer loads)."""
    programmatic_launch: bool = os.environ.get("TWELL_PROGRAMMATIC_LAUNCH", "1") != "0"
    """Decode-sized calls (the split-K GEMV gate's, ``decode_gate_rows``) launch their CUDA kernels
    with programmatic dependent launch (Hopper): each may be scheduled while the kernel before it in
    the stream still runs and waits for it on the device before touching memory
    (csrc/cluster_launch.cuh), so most of the launch latency between a call's four short kernels is
    hidden. Under CUDA graphs of 8 calls at the 2B shape and 24 active units, in one process with
    the setting alternated (H200, 2026-11-29, examples/ab_programmatic_launch.py, two runs): 6.5-10%
    less time at 1-16 rows, uniform or skewed, and 3.8-4.7% at 32; bit for bit the same outputs.
    Larger calls are launched plainly: there it measured 1.4-5.3% slower at 1024-16384 rows and level
    at 131072. Off: every launch plain."""
    fast_calls: bool = os.environ.get("TWELL_FAST_CALLS", "1") != "0"
    """After a call has taken the Python path, let its layer's next calls of the same size be served in C++
    from a lease of that call's choices (``leases.py``, ``csrc/twell_fast_call.cpp``): the same kernels and
    bits with less host time, which paces decode-sized calls without CUDA graphs. Off: every call runs
    the Python path."""
    poison_buffers: bool = False
    """Tests: fill the output and work buffers with NaN/garbage instead of leaving them uninitialised,
    so any element a kernel fails to write shows up."""

    def __setattr__(self, name, value):
        global _settings_generation
        super().__setattr__(name, value)
        _settings_generation += 1
        _PLANS.clear()  # plans are derived from the settings, and so are the leases
        leases.revoke_all()


config = KernelConfig()


@dataclasses.dataclass(frozen=True)
class GatePlan:
    block_m: int
    tile_n: int  # the TwELL tile is the gate GEMM's N-tile
    block_k: int
    cap: int  # packed slots per (row, tile)
    num_warps: int
    num_stages: int
    group_m: int = 8


# Tuning knob, read once: "block_m,tile_n,block_k,cap,warps,stages". The defaults were the fastest
# measured on an H200 (README); wider tiles or fewer warps spill registers in the packing epilogue.
_GATE_PLAN_OVERRIDE = os.environ.get("TWELL_GATE_PLAN", "")


def gate_plan(m: int, wgmma_ok: bool) -> GatePlan:
    """128 x 128 tiles, served by the wgmma GEMM where it can run (``wgmma_ok``), by Triton otherwise.
    Decode-sized batches without the wgmma GEMM get narrow Triton tiles, so the weight streams through
    many SMs. (With it, decode stays on the CUDA kernels: at M <= 64 on an H200 that halved the eager
    call, 0.22 to 0.11 ms, the Triton launches being most of the host time, for about the same time
    under CUDA graphs.)"""
    if _GATE_PLAN_OVERRIDE:
        return GatePlan(*map(int, _GATE_PLAN_OVERRIDE.split(",")))
    if m <= 64 and not wgmma_ok:
        return GatePlan(block_m=64, tile_n=64, block_k=128, cap=8, num_warps=4, num_stages=4)
    return GatePlan(block_m=128, tile_n=128, block_k=64, cap=8, num_warps=8, num_stages=4)


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _column_splits(m: int, d: int, sms: int, vec8: bool) -> int:
    """Output-column splits of the sparse kernel: at most 4 column groups per thread of a CTA, and at
    small M enough CTAs to fill the GPU's ``sms`` SMs: two per SM at decode sizes, one past them. Each
    split computes its row's up projections again, and past decode sizes that costs more than the
    extra CTAs gain (H100, whole calls under CUDA graphs at 24 / 39 nnz: M = 256, 62.0 / 67.0 us with
    one split against 65.0 / 74.0 with two). Up to 128 rows the entry split (``sparse_launch``) usually
    runs instead; column splits serve there only outputs too wide for one CTA."""
    per_cta_max = 4 * _sparse_threads(m) * (8 if vec8 else 1)
    splits = -(-d // per_cta_max)
    want = -(-(2 * sms if m <= _DECODE_ROWS else sms) // m)
    return max(splits, min(want, max(d // 128, 1)))


def _vec8_ok(*tensors: Tensor) -> bool:
    return all(t.shape[-1] % 8 == 0 and t.data_ptr() % 16 == 0 for t in tensors)


# Threads per CTA of the sparse kernel. Large batches: 128 (H200, M = 131072 at 24 nnz: 3.3 against 5.8 ms
# for 256). Small ones, where a CTA's latency is the time: 256, more warps for the up projections
# (CUDA-graph replays at M = 1, 16, 64: 12-20 against 14-23 us; M = 128: 54.7 against 60.7 us with
# column splits, H100).
_SPARSE_THREADS = int(os.environ.get("TWELL_SPARSE_THREADS", "128"))
_SPARSE_THREADS_DECODE = int(os.environ.get("TWELL_SPARSE_THREADS_DECODE", "256"))
_DECODE_ROWS = 64
# Small batches: the CTAs of a cluster share each row's active units (csrc/twell_sparse_mlp.cu), so a
# heavy row is not one CTA's sequential work. At most 8 per row, and at most one CTA per SM in all
# (but clusters of at least 2 up to 128 rows): a CTA that shares its SM with another takes about twice
# as long, so a launch with some SMs doubled up is paced by those. H200, 38-layer 2B decode steps under
# CUDA graphs, 24 nnz: batch 32, 3.229 ms with clusters of 4 against 3.353 with 7 (8 that fit as 7)
# and 3.443 with 8; batch 24, 3.027 with 5 against 3.061 with 8. Calls of 33-512 rows go to cuBLAS by
# default, so past 32 rows the rule applies only where config.cublas_rows is changed. Earlier (H200
# graph replays of the sparse kernel at 24 nnz): M = 1 and 16, 9.6-10.2 us with 8 against 17-18 us
# with column splits; M = 64, 12.6 us with 4 against 18.4 with 8 (2, which it takes now, not timed).
# Up to 128 rows: whole calls at M = 128 took 47.9 us with clusters of 2 against 60.7 with column
# splits (24 nnz; 52.4 against 72.2 at 39), but at M = 256 column splits were as fast or faster (61.3
# against 64.9 us at 24 nnz), and from M = 512 on much faster (H100, examples/sweep_sparse_launch.py).
# TWELL_SPARSE_CLUSTER_DECODE=1 switches the clusters off (column splits only), other values cap them
# (at 8, the kernel's most); TWELL_SPARSE_ENTRY_SPLIT_ROWS moves the limit.
_SPARSE_CLUSTER_DECODE = min(8, int(os.environ.get("TWELL_SPARSE_CLUSTER_DECODE", "8")))
_ENTRY_SPLIT_ROWS = int(os.environ.get("TWELL_SPARSE_ENTRY_SPLIT_ROWS", "128"))


def _sparse_cluster(m: int, sms: int) -> int:
    if m > _ENTRY_SPLIT_ROWS:
        return 1
    return max(1, min(_SPARSE_CLUSTER_DECODE, max(2, sms // m)))


def _sparse_threads(m: int) -> int:
    return _SPARSE_THREADS_DECODE if m <= _ENTRY_SPLIT_ROWS else _SPARSE_THREADS


@dataclasses.dataclass(frozen=True)
class SparseLaunch:
    threads: int
    splits: int  # output-column splits (1 with the entry split)
    cluster: int  # > 1: the entry split, each row's units shared by a cluster of this many CTAs

    @property
    def entry_split(self) -> bool:
        return self.cluster > 1


def sparse_launch(m: int, d: int, sms: int, vec8: bool) -> SparseLaunch:
    """How ``sparse_mlp_out`` runs: decided here alone (the kernel rejects an entry split that does
    not fit), since the dense-path thresholds depend on it. The entry split needs 256 threads and one
    CTA holding all ``d`` output columns (4 groups of 8, or of 1 without 16-byte rows, per thread)."""
    threads, cluster = _sparse_threads(m), _sparse_cluster(m, sms)
    if threads == 256 and cluster > 1 and d <= 4 * threads * (8 if vec8 else 1):
        return SparseLaunch(threads, 1, cluster)
    return SparseLaunch(threads, _column_splits(m, d, sms, vec8), 1)


SPARSE_CTAS_PER_SM = 8
"""CTAs of the row-by-row sparse kernel resident per SM past decode sizes: 128 threads, at most two
column groups of 8 per thread (csrc/twell_sparse_mlp.cu, kSparseMinBlocks). Other launches' occupancy
is not fixed by the kernel's bounds."""
THIN_WAVE_FILL = 1 / 8
"""A sparse kernel's last wave at most this full is thin (``thin_sparse_wave``)."""


def thin_sparse_wave(m: int, d: int, sms: int, launch: SparseLaunch) -> bool:
    """Whether the row-by-row sparse kernel, launched as ``launch`` on ``sms`` SMs for ``m`` rows of ``d``
    output columns, runs two waves of CTAs of which the second is at most ``THIN_WAVE_FILL`` full: a
    call of 1152 rows on 132 SMs runs 1056 rows, then 96 on a nearly idle GPU, each CTA paced by its own
    row's entries. Only launches whose residency is fixed (``SPARSE_CTAS_PER_SM``: 16-byte rows, so
    ``d % 8 == 0``, and at most two column groups a thread) are judged."""
    if d % 8 or launch.entry_split or launch.threads != 128 or -(-d // launch.splits) > 2 * 128 * 8:
        return False
    wave = SPARSE_CTAS_PER_SM * sms
    return wave < m * launch.splits <= wave * (1 + THIN_WAVE_FILL)


def _tma_ok(*tensors: Tensor) -> bool:
    """TMA (the wgmma GEMMs always, the Triton kernels when ``config.tma``) needs 16-byte aligned bases
    and row strides."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


SMALL_BATCH_ROWS = 4096  # the largest call config.small_batch_density_factor applies to


def threshold_class(m: int, entry_split: bool, chunked: bool = False) -> str:
    """Which dense-block density a call's thresholds use (``_dense_thresholds``): ``chunked``, ``decode``
    (the entry split), ``small`` (at most ``SMALL_BATCH_ROWS`` rows) or ``large``. Routing by observed
    density keeps a layer's record per class, since the same activation crosses different thresholds."""
    if chunked:
        return "chunked"
    if entry_split:
        return "decode"
    return "small" if m <= SMALL_BATCH_ROWS else "large"


def _dense_thresholds(m: int, f: int, entry_split: bool, chunked: bool = False) -> tuple[int, int, int]:
    """Largest active count a full 128-row block, and the last (maybe partial) block, may have and
    still take the sparse path, and the most row-tiles past capacity a block may have (chunked: heavy
    rows). Plain integers from shapes and the settings: no device data involved. ``entry_split``: the
    sparse kernel splits each row's units over a cluster (calls of at most 128 rows), which moves the
    crossover; so do a call of at most ``SMALL_BATCH_ROWS`` rows (``config.small_batch_density_factor``)
    and one of the chunked kernel (``config.chunked_dense_block_density``)."""
    density = {
        "chunked": config.chunked_dense_block_density,
        "decode": config.decode_dense_block_density,
        "small": config.dense_block_density * config.small_batch_density_factor,
        "large": config.dense_block_density,
    }[threshold_class(m, entry_split, chunked)]

    return _thresholds_at(m, f, density)


def _thresholds_at(m: int, f: int, density: float) -> tuple[int, int, int]:
    """block_dense's thresholds for a call of ``m`` rows and ``f`` units at this dense-block density."""
    def threshold(rows: int) -> int:
        limit = rows * f * density
        return 2**31 - 1 if limit >= 2**31 - 1 else int(limit)

    last_rows = m - DECISION_ROWS * ((m - 1) // DECISION_ROWS)
    return threshold(DECISION_ROWS), threshold(last_rows), min(config.heavy_block_overflow_tiles, 2**31 - 1)


def _route_thresholds(m: int, f: int, d: int, sms: int, launch: SparseLaunch,
                      thresholds: tuple[int, int, int]) -> tuple[int, int, int] | None:
    """The test by which a routed call's reports count a block as dense, where it differs from the
    kernels' ``thresholds``: from ``config.thin_wave_route_density`` where the sparse kernel would run
    a thin last wave (``thin_sparse_wave``). None: the kernels' test."""
    density = config.thin_wave_route_density
    if density <= 0 or not thin_sparse_wave(m, d, sms, launch):
        return None
    lower = _thresholds_at(m, f, density)
    route = (min(thresholds[0], lower[0]), min(thresholds[1], lower[1]), thresholds[2])
    return None if route == thresholds else route


def block_dense(block_stats: Tensor, thresholds: tuple[int, int, int]) -> Tensor:
    """Which blocks took the dense path (for statistics; the kernels make the same test themselves)."""
    nnz, overflow_tiles = block_stats.view(2, -1)
    thr_full, thr_last, thr_heavy = thresholds
    dense = (nnz > thr_full) | (overflow_tiles > thr_heavy)
    if thr_last != thr_full:  # a partial last block
        dense[-1:] = (nnz[-1:] > thr_last) | (overflow_tiles[-1:] > thr_heavy)
    return dense


# Poison for tests (config.poison_buffers): values that turn any read of an element a kernel should
# have written, or should not have read, into NaN in the output rather than a plausible number.
_POISON_WORD = 0x7FC00005  # a slot for column 5 whose value bits are a NaN (bf16 and fp16)
_POISON_COUNT = 1000  # past any capacity: a stray count sends readers to the NaN-filled backup


def _buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, int_poison: int = _POISON_COUNT) -> Tensor:
    if not config.poison_buffers:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.full(shape, float("nan") if dtype.is_floating_point else int_poison, dtype=dtype, device=device)


def _contig(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.contiguous()


def _wgmma_ok(x2: Tensor, weight: Tensor) -> bool:
    """The hand-written wgmma GEMM (csrc/twell_gemm.cu) takes TMA-able operands (16-byte aligned rows,
    so K % 8 == 0); the Triton kernels cover the rest, and everything when it is switched off."""
    return config.wgmma_kernels and _tma_ok(x2, weight)


def _triton_gate(plan: GatePlan, x2: Tensor, act_weight: Tensor, act_bias: Tensor | None, packed: Tensor,
                 counts: Tensor, dense: Tensor, block_nnz: Tensor, n_tiles: int) -> None:
    m, k = x2.shape
    f = act_weight.shape[0]
    grid = (-(-m // plan.block_m) * n_tiles,)
    common = dict(CAP=plan.cap, HAS_BIAS=act_bias is not None, BLOCK_M=plan.block_m, BLOCK_N=plan.tile_n,
                  BLOCK_K=plan.block_k, GROUP_M=plan.group_m, num_warps=plan.num_warps, num_stages=plan.num_stages)
    bias_arg = act_bias if act_bias is not None else x2
    if config.tma and _tma_ok(x2, act_weight, dense):
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_desc = TensorDescriptor.from_tensor(x2, [plan.block_m, plan.block_k])
        w_desc = TensorDescriptor.from_tensor(act_weight, [plan.tile_n, plan.block_k])
        dense_desc = TensorDescriptor.from_tensor(dense, [plan.block_m, plan.tile_n])
        programs = min(grid[0], _num_sms(x2.device))
        grid = (programs,)
        triton_kernels.gate_twell_tma_kernel[grid](
            x_desc, w_desc, bias_arg, packed, counts, dense_desc, block_nnz, m, f, k, n_tiles,
            NUM_PROGRAMS=programs,
            VALUE_DTYPE=tl.bfloat16 if x2.dtype == torch.bfloat16 else tl.float16, **common)
    else:
        triton_kernels.gate_twell_kernel[grid](
            x2, act_weight, bias_arg, packed, counts, dense, block_nnz, m, f, k, x2.stride(0), act_weight.stride(0),
            n_tiles, EVEN_K=k % plan.block_k == 0, **common)


def _triton_dense_path(plan: GatePlan, gated: bool, x2: Tensor, up_weight: Tensor | None, up_bias: Tensor | None,
                       down_weight: Tensor, down_bias: Tensor | None, packed: Tensor, counts: Tensor, dense: Tensor,
                       block_nnz: Tensor, out: Tensor, thresholds: tuple[int, int, int]) -> None:
    m, k = x2.shape
    f, d = dense.shape[1], out.shape[1]
    n_tiles, n_blocks = packed.shape[1], block_nnz.numel() // 2
    thr_full, thr_last, thr_heavy = thresholds
    dense_tma = config.tma and _tma_ok(x2, down_weight, dense, out, *((up_weight,) if gated else ()))
    if dense_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_arg = TensorDescriptor.from_tensor(x2, [DECISION_ROWS, 64])
        up_arg = TensorDescriptor.from_tensor(up_weight, [plan.tile_n, 64]) if gated else x2
        h_arg = TensorDescriptor.from_tensor(dense, [DECISION_ROWS, 64])
        down_arg = TensorDescriptor.from_tensor(down_weight, [128, 64])
        dense_tile = TensorDescriptor.from_tensor(dense, [DECISION_ROWS, plan.tile_n])
        out_tile = TensorDescriptor.from_tensor(out, [DECISION_ROWS, 128])
    else:
        x_arg, up_arg, h_arg, down_arg = x2, up_weight if gated else x2, dense, down_weight
        dense_tile, out_tile = dense, out
    triton_kernels.dense_hidden_kernel[(n_blocks, n_tiles)](
        x_arg, up_arg, up_bias if up_bias is not None else x2, packed, counts, dense, dense_tile, block_nnz,
        m, f, k, x2.stride(0), up_weight.stride(0) if gated else 0, n_tiles, n_blocks, thr_full, thr_last, thr_heavy,
        CAP=plan.cap, GATED=gated, HAS_BIAS=up_bias is not None, BLOCK_N=plan.tile_n, BLOCK_K=64,
        EVEN_K=k % 64 == 0, USE_TMA=dense_tma, num_warps=4, num_stages=4,
    )
    triton_kernels.dense_down_kernel[(n_blocks, -(-d // 128))](
        h_arg, down_arg, down_bias if down_bias is not None else x2, out, out_tile, block_nnz,
        m, d, f, dense.stride(0), down_weight.stride(0), out.stride(0), n_blocks, thr_full, thr_last, thr_heavy,
        HAS_BIAS=down_bias is not None, BLOCK_N=128, BLOCK_K=64, EVEN_K=f % 64 == 0, USE_TMA=dense_tma,
        num_warps=4, num_stages=4,
    )


def _cuda_tiles(plan: GatePlan) -> bool:
    """Whether the CUDA kernels can take a gate of this plan: their TwELL tile is 128 x 128 (other plans
    come from TWELL_GATE_PLAN, or are the Triton decode tiles used without the wgmma GEMM)."""
    return (plan.block_m, plan.tile_n) == (128, 128)


def _decode_gate(m: int) -> bool:
    """Where the gate GEMM ran as a CUDA kernel: whether it is the split-K GEMV (decode sizes)."""
    return m <= min(config.decode_gate_rows, _DECODE_ROWS)


def _decode_dense(m: int) -> bool:
    """Where the dense path runs on the CUDA kernels: whether they are the split-K GEMVs."""
    return m <= _DECODE_ROWS and config.decode_dense_gemv


# block_dense's thresholds for a chunked call's decision array: dense where it holds 1.
CHUNKED_DECISION_THRESHOLDS = (0, 0, 2**31 - 1)


@dataclasses.dataclass(frozen=True)
class CallPlan:
    thresholds: tuple[int, int, int]  # what block_dense applies to the call's third result
    gate: GatePlan  # the gate's tiles and slots (cap per row-tile), as the CUDA path packs them
    cuda: object | None  # the extension's MlpPlan for the one-call path; None where settings rule it out
    cublas: bool = False  # the dense MLP through cuBLAS instead of a TwELL path (config.cublas_rows, _kernels_fit)
    route_class: str | None = None  # the size class for routing by density; None: the call is not routed
    route_thresholds: tuple[int, int, int] | None = None  # its reports' dense-block test, if not `thresholds`
    kernels_fit: bool = True  # within every TwELL kernel's limits (_kernels_fit); if not, `cublas` too

    @property
    def report_thresholds(self) -> tuple[int, int, int]:
        """The dense-block test of a routed call's reports (``thresholds`` unless ``route_thresholds``)."""
        return self.route_thresholds or self.thresholds


def _route_class(m: int, launch: SparseLaunch, chunked: bool) -> str | None:
    """The size class for routing by observed density (``density_route.py``): the call's threshold
    class. Chunked calls are not routed: with every block dense their path was faster than the eager
    dense MLP (1.13x at M = 131072, H100)."""
    size_class = threshold_class(m, launch.entry_split, chunked)
    return None if size_class == "chunked" else size_class


def _dense_path_tiles(route_class: str | None) -> tuple[int, int]:
    """The dense path's GEMM schedules, gate times up and down (``config.partly_dense_tile_m``)."""
    if route_class is not None and config.route_by_density and config.partly_dense_tile_m:
        return config.partly_dense_tile_m, config.partly_dense_tile_m
    return config.gemm_tile_m, config.down_gemm_tile_m


def _make_call_plan(m: int, f: int, d: int, device: torch.device) -> CallPlan:
    """What the one-call path (``mlp_forward``, csrc/twell_mlp_forward.cpp) does for this shape, given
    operands with contiguous 16-byte aligned rows (it checks that per call and declines otherwise):
    the choices the general path below makes, for that case."""
    plan = gate_plan(m, True)
    fits = _kernels_fit(m, f, d)
    if config.cublas_rows[0] <= m <= config.cublas_rows[1] or not fits:
        return CallPlan((0, 0, 0), plan, None, cublas=True, kernels_fit=fits)
    sms = _num_sms(device)
    launch = sparse_launch(m, d, sms, d % 8 == 0)  # aligned rows: 16-byte rows everywhere but maybe out's
    thresholds = _dense_thresholds(m, f, launch.entry_split)
    route_thresholds = _route_thresholds(m, f, d, sms, launch, thresholds)
    if not (config.wgmma_kernels and _cuda_tiles(plan)):
        return CallPlan(thresholds, plan, None, route_class=_route_class(m, launch, False),
                        route_thresholds=route_thresholds)
    chunked = _chunked(m, f, d, launch)
    kernel_thresholds = _dense_thresholds(m, f, launch.entry_split, chunked) if chunked else thresholds
    cuda = build.cuda_extension().MlpPlan()
    cuda.cap, cuda.tile_n = plan.cap, plan.tile_n
    cuda.decode_gate, cuda.decode_dense = _decode_gate(m), _decode_dense(m)
    cuda.gemv_cluster = config.decode_gemv_cluster
    cuda.ctas, cuda.gemm_cluster = sms, config.gemm_cluster
    cuda.gate_gemm_tile_m, cuda.gate_gemm_cluster = gate_schedule(m, f, sms)
    route_class = _route_class(m, launch, chunked)
    cuda.gemm_tile_m, cuda.down_gemm_tile_m = _dense_path_tiles(route_class)
    cuda.gemm_k_splits = config.gemm_k_splits
    cuda.sparse_splits, cuda.sparse_threads, cuda.sparse_cluster = launch.splits, launch.threads, launch.cluster
    cuda.chunked = chunked
    cuda.programmatic = config.programmatic_launch and cuda.decode_gate
    cuda.dense_path_branch = config.decode_dense_branch
    cuda.gate_parts = config.decode_gate_parts
    cuda.thr_full, cuda.thr_last, cuda.thr_heavy = kernel_thresholds
    cuda.poison, cuda.poison_word, cuda.poison_count = config.poison_buffers, _POISON_WORD, _POISON_COUNT
    # A chunked call returns the chunked kernel's decision per block (1: dense) instead of block_nnz.
    return CallPlan(CHUNKED_DECISION_THRESHOLDS if chunked else thresholds, plan, cuda, route_class=route_class,
                    route_thresholds=None if route_class is None else route_thresholds)


PINGPONG_GATE_TILE_COST = 1.08
"""The time of a 128-row ping-pong gate tile over half that of a cooperative 256-row tile, where both
schedules fill their waves alike: ping-pong was 4-8% slower on the whole gate GEMM there (H100,
bench_gate_gemm.py, 2026-11-28: 2B shape at 1280, 1536 and 4608 rows, 8B shape at 512 and 1792)."""
PINGPONG_GATE_MIN_GAIN = 0.03
"""Ping-pong is chosen only where the wave count promises at least this share off the gate: the tile
cost above is good to a few percent, and after many waves the last one hardly matters."""


def gate_schedule(m: int, f: int, ctas: int) -> tuple[int, int]:
    """(tile rows, CTAs per cluster) of the wgmma gate GEMM for a call of ``m`` rows and ``f`` gate
    units on ``ctas`` SMs: ping-pong in single CTAs where ``config.gate_pingpong_rows`` says, else
    ``gate_gemm_tile_m`` and ``gemm_cluster``. The schedules give the same bits."""
    rows = config.gate_pingpong_rows
    pingpong = pingpong_gate_fills_waves_better(m, f, ctas) if rows is None else rows[0] <= m <= rows[1]
    return (128, 1) if pingpong else (config.gate_gemm_tile_m, config.gemm_cluster)


def pingpong_gate_fills_waves_better(m: int, f: int, ctas: int) -> bool:
    """Whether the gate GEMM, set to cooperative 256-row tiles, should run ping-pong 128-row tiles
    instead, by a count of waves: the persistent grid takes its tiles in waves of ``ctas``, the last
    one part full, and a ping-pong tile costs ``PINGPONG_GATE_TILE_COST`` halves of a cooperative one.
    1024 rows of the 2B gate (44 tiles across) make 176 cooperative tiles on 132 SMs, two waves of which
    the second is a third full, against three nearly full waves of 352 ping-pong tiles. Only where the
    cooperative schedule would run (its tiles fill the grid: csrc/twell_entries.h, cooperative_schedule)."""
    tiles_n = -(-f // 128)  # the wgmma GEMMs' N tile (and the TwELL tile)
    cooperative_tiles = -(-m // 256) * tiles_n
    if config.gate_gemm_tile_m != 256 or cooperative_tiles < ctas:
        return False
    cooperative_waves = -(-cooperative_tiles // ctas)
    pingpong_waves = -(-(-(-m // 128) * tiles_n) // ctas)
    return pingpong_waves * PINGPONG_GATE_TILE_COST < (1 - PINGPONG_GATE_MIN_GAIN) * 2 * cooperative_waves


# Sizes past the TwELL kernels' limits, each far beyond any model's, which _kernels_fit sends to cuBLAS.
MAX_KERNEL_ROWS = 2**31 - 256  # the GEMMs' row walks count rows in int32, 256-row steps included
MAX_KERNEL_OUT_FEATURES = 65535 * 128  # the down projection's 128-column tiles in a grid's y (Triton)
# The chunked kernel counts its entries (at most kChunkMaxRowEntries, 256, per row) in int32.
MAX_CHUNKED_ROWS = 2**31 // 256 - 1


def _kernels_fit(m: int, f: int, d: int) -> bool:
    """Whether a call of this size is within every TwELL kernel's limits. The tightest is the row-by-row
    sparse kernel's shared memory, which grows with the tiles of F: it is judged at the narrowest gate
    tile either gate could use (the Triton gate's 64 columns, or a TWELL_GATE_PLAN's), which on an H200
    puts the limit at F of about 3.0-3.6 million, by D. (That also keeps F's tiles under the 65535 of a
    Triton grid's y.) A call past any limit runs the dense MLP through cuBLAS, exact and as fast as dense,
    rather than failing inside a launch."""
    tile = min(gate_plan(m, True).tile_n, gate_plan(m, False).tile_n, 64)
    return (m <= MAX_KERNEL_ROWS and d <= MAX_KERNEL_OUT_FEATURES
            and build.cuda_extension().sparse_mlp_fits(-(-f // tile), d))


def _chunked(m: int, f: int, d: int, launch: SparseLaunch) -> bool:
    """Whether the one-call path runs the chunked sparse kernel (``config.chunked_sparse_rows``). Its
    operands there have 16-byte rows (K % 8 == 0 and D % 8 == 0), so only F decides whether it fits."""
    return (0 < config.chunked_sparse_rows <= m <= MAX_CHUNKED_ROWS and not launch.entry_split and d % 8 == 0
            and build.cuda_extension().chunked_sparse_fits(8, f, d, 2, True))


def _sliced_weights(plan: CallPlan, up_weight: Tensor | None, down_weight: Tensor, k: int, d: int):
    """The sliced weights a chunked plan's call takes, where they can be made (the operands the one-call
    path accepts always can; for others it declines the call before looking at them)."""
    if not plan.cuda.chunked:
        return None, None
    if k % 8 or d % 8 or not down_weight.is_contiguous() or (up_weight is not None and not up_weight.is_contiguous()):
        return None, None
    return (UP_WEIGHT_SLICED.get(up_weight) if up_weight is not None else None), DOWN_WEIGHT_SLICED.get(down_weight)


def call_plan(m: int, f: int, d: int, device: torch.device) -> CallPlan:
    """Cached per shape and device (and dropped whenever ``config`` changes), so a call does no
    launch arithmetic on the host. The input size and gating change no launch choice."""
    key = (m, f, d, device)
    plan = _PLANS.get(key)
    if plan is None:
        generation = _settings_generation
        plan = _make_call_plan(m, f, d, device)
        if len(_PLANS) >= _MAX_PLANS:  # many distinct token counts (dynamic shapes): start over
            _PLANS.clear()
        if generation == _settings_generation:  # (settings changed meanwhile, on another thread: not kept)
            _PLANS[key] = plan
    return plan


def twell_mlp(x: Tensor, act_weight: Tensor, act_bias: Tensor | None, up_weight: Tensor | None,
              up_bias: Tensor | None, down_weight: Tensor, down_bias: Tensor | None) -> Tensor:
    """Gated when ``up_weight`` is given (``act_weight`` is the gate), non-gated otherwise
    (``act_weight`` is the up projection and the ReLU output is the hidden activation)."""
    gated = up_weight is not None
    k = x.shape[-1]
    f = act_weight.shape[0]
    d = down_weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*x.shape[:-1], d))
    if leases.FAST_MLP is not None:
        _end_lease(act_weight)
    plan = call_plan(m, f, d, x2.device)
    if plan.cublas:
        out = _cublas_mlp(x2, act_weight, act_bias, up_weight, up_bias, down_weight, down_bias)
        _grant_lease(plan, x2, act_weight, act_bias, up_weight, up_bias, down_weight, down_bias, None)
        return out.view(*x.shape[:-1], d)
    routed = report = False
    if plan.route_class is not None and config.route_by_density:
        routed, report = ROUTER.decide(act_weight, plan.route_class, config.route_report_every, m)
    if routed:
        out = _cublas_mlp(x2, act_weight, act_bias, up_weight, up_bias, down_weight, down_bias,
                          report=plan if report else None)
        if not report:
            _grant_lease(plan, x2, act_weight, act_bias, up_weight, up_bias, down_weight, down_bias, None)
        return out.view(*x.shape[:-1], d)
    result = None
    if plan.cuda is not None:
        # One host call for everything (the common case: aligned, contiguous operands); None if it
        # declines the operands, before doing anything.
        up_sliced, down_sliced = _sliced_weights(plan, up_weight, down_weight, k, d)
        down_t = DOWN_WEIGHT_T.get(down_weight)
        result = build.cuda_extension().mlp_forward(plan.cuda, x2, act_weight, act_bias, up_weight, up_bias,
                                                    down_weight, down_t, down_bias, up_sliced, down_sliced)
        if result is not None and not report and not plan.cuda.chunked:
            _grant_lease(plan, x2, act_weight, act_bias, up_weight, up_bias, down_weight, down_bias, down_t)
    if result is not None:
        out, counts, block_nnz = result
        thresholds, cap = plan.thresholds, plan.gate.cap
    else:
        out, counts, block_nnz, thresholds, cap = _twell_mlp_general(
            x2, act_weight, act_bias, up_weight, up_bias, down_weight, down_bias)

    recorder = stats.active_recorder()
    if recorder is not None or report:
        dense_blocks = block_dense(block_nnz, thresholds)
        if report:
            route_dense = dense_blocks if plan.route_thresholds is None else block_dense(block_nnz, plan.route_thresholds)
            ROUTER.report(act_weight, plan.route_class, route_dense.sum(dtype=torch.int32), route_dense.numel())
        if recorder is not None:
            recorder.add("gated_relu_mlp" if gated else "relu_mlp", counts.sum(1), f,
                         overflow_rows=(counts > cap).any(1), block_dense=dense_blocks, path="twell")
    return out.view(*x.shape[:-1], d)


def _grant_lease(plan: CallPlan, x2: Tensor, act_weight: Tensor, act_bias: Tensor | None, up_weight: Tensor | None,
                 up_bias: Tensor | None, down_weight: Tensor, down_bias: Tensor | None, down_t: Tensor | None) -> None:
    """After a call that made no density report: lets its layer's next calls of its size take the same
    route in C++ (``leases.py``): the TwELL path of ``plan`` with ``down_t``, or where that is None the
    cuBLAS route. Calls the density router watches get a lease only up to their next report."""
    if not config.fast_calls or stats.active_recorder() is not None:
        return  # (calls made while recording are never served from a lease: ops.py)
    calls = leases.UNLIMITED
    if plan.route_class is not None and config.route_by_density:
        calls = ROUTER.lease_calls(act_weight, plan.route_class, config.route_report_every)
        if calls <= 0:
            return
    leases.grant(x2, act_weight, act_bias, up_weight, up_bias, down_weight, down_bias,
                 None if down_t is None else plan.cuda, down_t, calls, _ROUTE_TAGS.get(plan.route_class, -1))


# Size classes by the tag their leases count served calls under (leases.end).
_ROUTE_CLASSES = ("decode", "small", "large")
_ROUTE_TAGS = {name: tag for tag, name in enumerate(_ROUTE_CLASSES)}


def _end_lease(act_weight: Tensor) -> None:
    """Ends the layer's lease at a call on the Python path and adds the calls it served to the router's
    count, so that reports come when they are due. Any lease, whatever the call's size or route: the
    router counts this call too, and may route the layer otherwise after it, which a lease granted
    before it would not know."""
    tag, served = leases.end(act_weight)
    if served > 0 and tag >= 0 and config.route_by_density:
        ROUTER.count_calls(act_weight, _ROUTE_CLASSES[tag], served)


def _activation_dense_blocks(active: Tensor, thresholds: tuple[int, int, int], cap: int, tile_n: int) -> Tensor:
    """How many 128-row blocks of a dense activation's active units (``stats.active_units``) the TwELL
    path would have sent to the dense path: the test of ``block_dense`` (and of the kernels) on the
    active units of each block and its (row, ``tile_n``-wide tile) pairs past ``cap``. A 0-d tensor,
    computed on the device."""
    m, f = active.shape
    n_tiles, n_blocks = -(-f // tile_n), -(-m // DECISION_ROWS)
    active = active.to(torch.int32)
    per_tile = torch.nn.functional.pad(active, (0, n_tiles * tile_n - f)).view(m, n_tiles, tile_n).sum(-1)
    per_row = torch.stack([per_tile.sum(1), (per_tile > cap).sum(1)])  # active units, row-tiles past cap
    per_block = torch.nn.functional.pad(per_row, (0, n_blocks * DECISION_ROWS - m)).view(2, n_blocks, -1).sum(-1)
    return block_dense(per_block.view(-1), thresholds).sum(dtype=torch.int32)


def _cublas_mlp(x2: Tensor, act_weight: Tensor, act_bias: Tensor | None, up_weight: Tensor | None,
                up_bias: Tensor | None, down_weight: Tensor, down_bias: Tensor | None,
                report: CallPlan | None = None) -> Tensor:
    """The dense MLP through cuBLAS (``config.cublas_rows``, or a layer routed there by its density).
    Under a sparsity recorder the call still reports its activation's active units, with the path
    ``cublas``; every block counts as dense and no row as overflowing. ``report``: the TwELL plan of a
    routed call that reports, for ``density_route``, how many blocks that plan would have sent dense."""
    out, act = build.cuda_extension().cublas_mlp(x2, act_weight, act_bias, up_weight, up_bias, down_weight, down_bias)
    recorder = stats.active_recorder()
    if report is None and recorder is None:
        return out
    active = stats.active_units(act)
    if report is not None:
        dense_blocks = _activation_dense_blocks(active, report.report_thresholds, report.gate.cap, report.gate.tile_n)
        ROUTER.report(act_weight, report.route_class, dense_blocks, -(-act.shape[0] // DECISION_ROWS))
    if recorder is not None:
        m, f = act.shape
        recorder.add("gated_relu_mlp" if up_weight is not None else "relu_mlp", active.sum(1), f,
                     overflow_rows=act.new_zeros(m, dtype=torch.bool),
                     block_dense=act.new_ones(-(-m // DECISION_ROWS), dtype=torch.bool), path="cublas")
    return out


def _twell_mlp_general(x2: Tensor, act_weight: Tensor, act_bias: Tensor | None, up_weight: Tensor | None,
                       up_bias: Tensor | None, down_weight: Tensor, down_bias: Tensor | None):
    """Any operands (unaligned or strided ones, the Triton kernels, the settings that switch the CUDA
    kernels off), one step at a time. Returns (out, counts, block_nnz, thresholds, cap)."""
    gated = up_weight is not None
    x2 = x2.contiguous()
    m, k = x2.shape
    f = act_weight.shape[0]
    d = down_weight.shape[0]
    if not call_plan(m, f, d, x2.device).kernels_fit:  # (the op sends such calls to cuBLAS before this)
        raise ValueError(f"twell: a call of {m} rows, {f} intermediate and {d} output features is past the TwELL "
                         "kernels' limits (on rows, on output features, or on the intermediate size, whose "
                         "tiles the sparse kernel's shared memory holds); twell_mlp runs such calls on cuBLAS")
    out = _buffer((m, d), x2.dtype, x2.device)
    act_weight, act_bias, up_weight, up_bias, down_bias = map(_contig, (act_weight, act_bias, up_weight, up_bias, down_bias))
    # W_down^T is cached for the caller's weight: a contiguous copy made here would be a new weight to
    # the cache at every call (and, under inference_mode, an inference tensor it cannot cache).
    w_down_t = DOWN_WEIGHT_T.get(down_weight)
    down_weight = down_weight.contiguous()

    wgmma_ok = _wgmma_ok(x2, act_weight)
    plan = gate_plan(m, wgmma_ok)
    # A gate CTA's rows must lie in one 128-row decision block (it adds its count to that block).
    assert DECISION_ROWS % plan.block_m == 0, plan
    n_tiles = -(-f // plan.tile_n)
    packed = _buffer((m, n_tiles, plan.cap), torch.int32, x2.device, _POISON_WORD)
    counts = _buffer((m, n_tiles), torch.int32, x2.device)
    dense = _buffer((m, f), x2.dtype, x2.device)
    n_blocks = -(-m // DECISION_ROWS)
    block_nnz = torch.zeros(2 * n_blocks, dtype=torch.int32, device=x2.device)  # active units; overflowed row-tiles

    ext = build.cuda_extension()
    sms = _num_sms(x2.device)
    cuda_gate = wgmma_ok and _cuda_tiles(plan)
    if cuda_gate and _decode_gate(m):
        ext.decode_gate_twell(x2, act_weight, act_bias, packed, counts, dense, block_nnz,
                              config.decode_gemv_cluster)
    elif cuda_gate:
        gate_tile_m, gate_cluster = gate_schedule(m, f, sms)
        ext.gate_twell_gemm(x2, act_weight, act_bias, packed, counts, dense, block_nnz, sms, gate_cluster,
                            gate_tile_m, config.gemm_k_splits)
    else:
        _triton_gate(plan, x2, act_weight, act_bias, packed, counts, dense, block_nnz, n_tiles)

    vec8 = _vec8_ok(w_down_t, out, *((x2, up_weight) if gated else ()))
    launch = sparse_launch(m, d, sms, vec8)
    thresholds = _dense_thresholds(m, f, launch.entry_split)
    ext.sparse_mlp_out(
        x2 if gated else None, packed, counts, dense, block_nnz, up_weight, up_bias, w_down_t, down_bias,
        out, plan.tile_n, launch.splits, launch.threads, *thresholds, launch.cluster,
    )

    # Dense path for the blocks too dense to pay (its kernels skip the others): where the gate ran as a
    # CUDA kernel (128-wide tiles) and every operand has 16-byte aligned rows, by the decode GEMVs for
    # calls of at most 64 rows, else by the wgmma GEMMs; otherwise by the Triton kernels. Gated:
    # h = relu(gate) * up in place in `dense`, the gate read from its TwELL output; non-gated: relu(up)
    # expanded into `dense` from the TwELL output. Then out = h W_down^T.
    operands = (x2, down_weight, dense, out, *((up_weight,) if gated else ()))
    if cuda_gate and _tma_ok(*operands):
        decode = _decode_dense(m)
        gemm_tile_m, down_gemm_tile_m = _dense_path_tiles(_route_class(m, launch, False))
        if gated and decode:
            ext.decode_dense_gemv(x2, up_weight, up_bias, dense, block_nnz, packed, counts, *thresholds,
                                  config.decode_gemv_cluster)
        elif gated:
            ext.dense_block_gemm(x2, up_weight, up_bias, dense, block_nnz, packed, counts, *thresholds, sms,
                                 config.gemm_cluster, gemm_tile_m, config.gemm_k_splits)
        else:
            ext.rebuild_dense_gate(packed, counts, dense, block_nnz, *thresholds)
        if decode:
            ext.decode_dense_gemv(dense, down_weight, down_bias, out, block_nnz, None, None, *thresholds,
                                  config.decode_gemv_cluster)
        else:
            ext.dense_block_gemm(dense, down_weight, down_bias, out, block_nnz, None, None, *thresholds, sms,
                                 config.gemm_cluster, down_gemm_tile_m, config.gemm_k_splits)
    else:
        _triton_dense_path(plan, gated, x2, up_weight, up_bias, down_weight, down_bias, packed, counts, dense,
                           block_nnz, out, thresholds)
    return out, counts, block_nnz, thresholds, plan.cap
