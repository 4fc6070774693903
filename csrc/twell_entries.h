// Host entry points of the CUDA kernels, shared by the Python binding (twell_ext.cpp) and the one-call
// forward (twell_mlp_forward.cpp). Each checks its operands and launches on PyTorch's current stream.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>

namespace twell {

void sparse_mlp_out(const c10::optional<at::Tensor>& x, const at::Tensor& packed, const at::Tensor& counts,
                    const at::Tensor& dense, const at::Tensor& block_nnz, const c10::optional<at::Tensor>& w_up,
                    const c10::optional<at::Tensor>& b_up, const at::Tensor& w_down_t,
                    const c10::optional<at::Tensor>& b_down, at::Tensor& out, int64_t tile_n, int64_t splits,
                    int64_t threads, int64_t thr_full, int64_t thr_last, int64_t thr_heavy, int64_t cluster,
                    const c10::optional<at::Tensor>& gate_parts = c10::nullopt);
// The cluster an entry-split launch of M rows takes on the current device (16-byte rows).
int64_t sparse_entry_cluster(int64_t M, int64_t n_tiles, int64_t D, int64_t requested, bool gated, bool float16);
// Whether its shared memory fits the current device (the host routes calls that do not to cuBLAS).
bool sparse_mlp_fits(int64_t n_tiles, int64_t D);

// The chunked sparse kernel (csrc/twell_sparse_chunked.cu): weights streamed through shared memory in
// slices of kChunkSliceColumns columns of every unit, [K / 8, F, 8] (W_up) and [D / 8, F, 8]
// (W_down^T). It decides each 128-row block's path itself, from the gate's counts, into `decided`
// (int32 [2 * ceil(M / 128)], read by the dense-path kernels as block_nnz with thresholds 0, 0,
// INT32_MAX): rows with more than kChunkMaxRowEntries active units ("heavy") are not the chunks' work
// but are listed (heavy_rows, int32 [capacity]; their number in counters[0], counters being two
// zeroed int32) for heavy_rows_mlp_out, which runs them as a compact dense MLP. A block takes the
// dense path when its other rows' active units plus thr_full / 128 per heavy row exceed its threshold
// (a heavy row costs about a row at the threshold density: one dense row), or when it has more than
// thr_heavy heavy rows, so the list holds at most ceil(M / 128) * thr_heavy rows
// (chunked_heavy_capacity); and every block does when most blocks would.
constexpr int kChunkSliceColumns = 8;
constexpr int kChunkMaxRowEntries = 256;
size_t chunked_smem_bytes(int64_t F, int64_t element_size);
// Whether a shape fits the kernel on the current device (its two slices of F units in shared memory).
bool chunked_sparse_fits(int64_t K, int64_t F, int64_t D, int64_t element_size, bool gated);
int64_t chunked_heavy_capacity(int64_t M, int64_t thr_heavy);
void chunked_sparse_mlp_out(const c10::optional<at::Tensor>& x, const at::Tensor& packed, const at::Tensor& counts,
                            const at::Tensor& dense, const c10::optional<at::Tensor>& w_up_sliced,
                            const c10::optional<at::Tensor>& b_up, const at::Tensor& w_down_sliced,
                            const c10::optional<at::Tensor>& b_down, at::Tensor& out, at::Tensor& decided,
                            const at::Tensor& heavy_rows, const at::Tensor& counters, int64_t tile_n,
                            int64_t thr_full, int64_t thr_last, int64_t thr_heavy, int64_t ctas);
// The listed heavy rows (csrc/twell_heavy_rows.cu; heavy_count: their number, on the device): gathered
// into a compact batch (x, and the TwELL activation expanded densely), run through the dense path's
// wgmma GEMMs, and scattered into out.
// Gated when w_up is given. The GEMMs' schedule arguments are dense_block_gemm's.
void heavy_rows_mlp_out(const c10::optional<at::Tensor>& x, const at::Tensor& packed, const at::Tensor& counts,
                        const at::Tensor& dense, const at::Tensor& heavy_rows, const at::Tensor& heavy_count,
                        const c10::optional<at::Tensor>& w_up, const c10::optional<at::Tensor>& b_up,
                        const at::Tensor& w_down, const c10::optional<at::Tensor>& b_down, at::Tensor& out,
                        int64_t ctas, int64_t cluster, int64_t tile_m, int64_t down_tile_m, int64_t k_splits);
void gate_twell_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                     at::Tensor& packed, at::Tensor& counts, at::Tensor& dense, at::Tensor& block_nnz, int64_t ctas,
                     int64_t cluster, int64_t tile_m, int64_t k_splits,
                     const c10::optional<at::Tensor>& split_arrivals);
void decode_gate_twell(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                       at::Tensor& packed, at::Tensor& counts, at::Tensor& dense, at::Tensor& block_nnz,
                       int64_t cluster, const c10::optional<at::Tensor>& gate_parts = c10::nullopt);
void decode_dense_gemv(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias, at::Tensor& c,
                       const at::Tensor& block_nnz, const c10::optional<at::Tensor>& gate_packed,
                       const c10::optional<at::Tensor>& gate_counts, int64_t thr_full, int64_t thr_last,
                       int64_t thr_heavy, int64_t cluster, const c10::optional<at::Tensor>& gate_parts = c10::nullopt);
void dense_block_gemm(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias, at::Tensor& c,
                      const at::Tensor& block_nnz, const c10::optional<at::Tensor>& gate_packed,
                      const c10::optional<at::Tensor>& gate_counts, int64_t thr_full, int64_t thr_last,
                      int64_t thr_heavy, int64_t ctas, int64_t cluster, int64_t tile_m, int64_t k_splits,
                      const c10::optional<at::Tensor>& split_arrivals);
void rebuild_dense_gate(const at::Tensor& packed, const at::Tensor& counts, at::Tensor& dense,
                        const at::Tensor& block_nnz, int64_t thr_full, int64_t thr_last, int64_t thr_heavy,
                        const c10::optional<at::Tensor>& gate_parts = c10::nullopt);
// The whole MLP densely through PyTorch's GEMMs (cuBLAS), for calls too small for a TwELL path to pay
// (twell_cublas_mlp.cu): (out, act), act the gate's pre-activation (gated) or relu(up) (non-gated).
std::tuple<at::Tensor, at::Tensor> cublas_mlp(const at::Tensor& x, const at::Tensor& w_act,
                                              const c10::optional<at::Tensor>& b_act,
                                              const c10::optional<at::Tensor>& w_up,
                                              const c10::optional<at::Tensor>& b_up, const at::Tensor& w_down,
                                              const c10::optional<at::Tensor>& b_down);

// Rows that TMA (the wgmma GEMMs) and 16-byte vector loads (the GEMVs) can read: a 2-D tensor with unit
// column stride, its base and row stride 16-byte aligned.
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) % 16) == 0; }
inline bool tma_compatible(const at::Tensor& t) {
  return t.dim() == 2 && t.stride(1) == 1 && aligned16(t.data_ptr()) && (t.stride(0) * t.element_size()) % 16 == 0;
}
// The same, contiguous (the GEMVs, and the kernels that copy whole rows 16 bytes at a time).
inline bool aligned_rows(const at::Tensor& t) { return tma_compatible(t) && t.is_contiguous(); }

constexpr int kMaxKSplits = 16;
// The fewest K-slices an automatic split leaves a range. Below it the split stopped paying (H100, 2B
// shape, dense path, per kernel): the down projection (88 slices, 16 column tiles at M = 128) took
// 32.6 us whole, 22.9 / 20.1 / 19.7 us in 2 / 3 / 4 ranges, 23.9 us in 8; the gate (32 slices, 44 column
// tiles) took 20.5 us whole and 22.2 us in 2 ranges. The dense path's adaptive split (below) was no
// faster with 10 or 6 (one dense block of a 1024-2048-row call, H100, 2026-11-28).
constexpr int kMinSplitSteps = 20;

// The wgmma GEMMs' (csrc/twell_gemm.cu) output tile, the unit of a K split, and their K-slice.
constexpr int kGemmTile = 128;
constexpr int kGemmSliceK = 64;

// The wgmma GEMMs at small M: K split over several CTAs per output tile.
struct KSplit {
  int64_t tiles;      // 128 x 128 output tiles of the product (one arrival counter each when split)
  int k_steps;        // K-slices of the whole reduction
  int splits, steps;  // K ranges per tile, K-slices per range (the last range may have fewer)
};

// K ranges per output tile of C [M, N] = A [M, K] B [N, K]^T. Automatic (requested 0): where the
// tiles are fewer than the CTAs, as many ranges as keep one unit per CTA and kMinSplitSteps slices per
// range, so only a long K splits (the dense path's down projection at small M: 4 ranges at M <= 256 on
// 132 SMs). Any choice is cut back so that no range is empty.
inline KSplit choose_k_split(int64_t M, int64_t N, int64_t K, int64_t ctas, int64_t requested) {
  const int64_t tiles = (M + kGemmTile - 1) / kGemmTile * ((N + kGemmTile - 1) / kGemmTile);
  const int k_steps = static_cast<int>((K + kGemmSliceK - 1) / kGemmSliceK);
  int64_t splits = 1;
  if (requested > 0) {
    splits = std::min<int64_t>(requested, k_steps);
  } else if (tiles < ctas) {
    splits = std::max<int64_t>(1, std::min<int64_t>({kMaxKSplits, k_steps / kMinSplitSteps, ctas / tiles}));
  }
  KSplit split;
  split.tiles = tiles;
  split.k_steps = k_steps;
  split.steps = static_cast<int>((k_steps + splits - 1) / splits);
  split.splits = (k_steps + split.steps - 1) / split.steps;
  return split;
}

// Whether a GEMM of M rows runs the cooperative schedule (256-row tiles, no K split): asked for
// (tile_m 256) and enough of its tiles to fill the grid; else ping-pong.
inline bool cooperative_schedule(int64_t M, int64_t N, int64_t ctas, int64_t tile_m) {
  return tile_m == 256 && (M + 255) / 256 * ((N + kGemmTile - 1) / kGemmTile) >= ctas;
}

// Dense-path GEMMs of at most this many 128-row blocks (1M rows) walk only their dense row tiles.
constexpr int kCompactWalkBlocks = 8192;

// The dense-path GEMMs' K split for few dense tiles. Their output tiles fill the grid, so
// choose_k_split splits nothing, but only the tiles of dense blocks run: one dense block of a 1024-row
// call leaves 16 tiles of the 2B down projection (88 K-slices each) to 16 SMs. Only the device knows
// how many tiles are dense, so each CTA counts them (the compact walk) and splits K itself where they
// leave most CTAs idle, by choose_k_split's rule with the dense tiles for the tiles. The host provides
// room for it: a workspace of this many partial tiles and as many zeroed arrival counters (0: the GEMM
// cannot split this way: K split already, a K too short for two ranges, more blocks than the compact
// walk takes, the cooperative schedule, or a split asked for explicitly). The workspace, 64 KB a
// partial tile (8.4 MB on 132 SMs), comes from PyTorch's caching allocator on every such call, whether
// the GEMM splits or not; a caller that passes no counters gets them zeroed by one more kernel.
inline int64_t adaptive_split_room(int64_t M, int64_t N, int64_t K, int64_t ctas, int64_t tile_m, int64_t requested) {
  const KSplit split = choose_k_split(M, N, K, ctas, requested);
  const bool possible = requested == 0 && split.splits == 1 && split.k_steps / kMinSplitSteps >= 2 &&
                        (M + kGemmTile - 1) / kGemmTile <= kCompactWalkBlocks &&  // 128-row blocks
                        !cooperative_schedule(M, N, ctas, tile_m);
  return possible ? ctas : 0;
}

// Everything about one call that follows from its shapes and the settings, decided in Python
// (twell_compile/kernels/twell_mlp.py, which caches one per shape) so the per-call host work is a
// single C++ call.
struct MlpPlan {
  int64_t cap = 8;                 // packed slots per (row, tile)
  int64_t tile_n = 128;            // the gate's N-tile, the TwELL tile
  bool decode_gate = false;        // the gate as split-K GEMVs (at most 64 rows)
  bool decode_dense = false;       // the dense path as split-K GEMVs (at most 64 rows)
  int64_t gemv_cluster = 0;        // their cluster size (0: chosen per launch)
  int64_t ctas = 0;                // the wgmma GEMMs' persistent grid (the SM count)
  int64_t gemm_cluster = 2;        // and their schedules
  int64_t gate_gemm_tile_m = 256;  // the gate GEMM's schedule
  int64_t gate_gemm_cluster = 2;   // and its own cluster size (single CTAs at some sizes)
  int64_t gemm_tile_m = 128;       // the gate-times-up GEMM's
  int64_t down_gemm_tile_m = 256;
  int64_t gemm_k_splits = 0;       // K ranges per tile (0: chosen per GEMM, 1: none)
  int64_t sparse_splits = 1;       // the sparse kernel's launch
  int64_t sparse_threads = 128;
  int64_t sparse_cluster = 1;
  bool chunked = false;            // the chunked sparse kernel (given the sliced weights)
  bool programmatic = false;       // programmatic dependent launches (csrc/cluster_launch.cuh)
  bool dense_path_branch = false;  // decode_dense under CUDA graph capture: the dense path on a forked branch
  bool gate_parts = false;         // decode: block counts as the decode gate's per-CTA pairs, no memset
  int64_t thr_full = 0;            // the dense-block test (csrc/dense_block_test.cuh)
  int64_t thr_last = 0;
  int64_t thr_heavy = 0;
  bool poison = false;             // tests: fill every buffer first, so unwritten elements show
  int64_t poison_word = 0;
  int64_t poison_count = 0;
};

// The whole CUDA path of one twell MLP call (gate, sparse kernel, dense path), in one host call.
// Gated when w_up is given. Returns (out, counts, blocks), or nothing, before any work, when an
// operand is not a contiguous tensor with 16-byte aligned rows (the Python path handles those).
// blocks is the gate's block_nnz, or for a chunked plan the chunked kernel's decision (1 for a dense
// block, 0 otherwise, then zeros: block_nnz's layout, tested with thresholds 0, 0, INT32_MAX).
// plan.chunked runs the chunked sparse kernel on the sliced weights (w_up_sliced when gated,
// w_down_sliced), which the caller gives exactly then.
std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> mlp_forward(
    const MlpPlan& plan, const at::Tensor& x, const at::Tensor& w_act, const c10::optional<at::Tensor>& b_act,
    const c10::optional<at::Tensor>& w_up, const c10::optional<at::Tensor>& b_up, const at::Tensor& w_down,
    const at::Tensor& w_down_t, const c10::optional<at::Tensor>& b_down,
    const c10::optional<at::Tensor>& w_up_sliced, const c10::optional<at::Tensor>& w_down_sliced);


// Leases (csrc/twell_fast_call.cpp): a layer's repeat calls served from the choices its last Python-path
// call made. grant_lease records them (plan: the TwELL path's, with W_down^T; none: the cuBLAS route)
// for `calls` more calls on the current stream, and returns whether it did (never under capture, for
// inference-tensor weights, or with x's device not current). fast_mlp serves a call from its layer's
// lease and returns its output, or None when the lease does not cover it exactly. end_lease ends the
// layer's lease (each call on the Python path does) and returns its `tag` (the caller's, -1 without a
// lease) and the calls it served.
bool grant_lease(const at::Tensor& x, const at::Tensor& w_act, const c10::optional<at::Tensor>& b_act,
                 const c10::optional<at::Tensor>& w_up, const c10::optional<at::Tensor>& b_up,
                 const at::Tensor& w_down, const c10::optional<at::Tensor>& b_down,
                 const c10::optional<MlpPlan>& plan, const c10::optional<at::Tensor>& w_down_t, int64_t calls,
                 int64_t tag);
std::tuple<int64_t, int64_t> end_lease(const at::Tensor& w_act);
void revoke_lease(const at::Tensor& w_act);
void revoke_all_leases();
int64_t lease_calls_left(const at::Tensor& w_act);  // -1: no lease
c10::optional<at::Tensor> fast_mlp(const at::Tensor& x, const at::Tensor& w_act, const c10::optional<at::Tensor>& b_act,
                                   const c10::optional<at::Tensor>& w_up, const c10::optional<at::Tensor>& b_up,
                                   const at::Tensor& w_down, const c10::optional<at::Tensor>& b_down);

}  // namespace twell
