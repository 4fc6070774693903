// Sparse up + down projections for large batches: the weights streamed through shared memory.
//
// The row-by-row kernel (twell_sparse_mlp.cu) reads a row of W_up and of W_down^T from L2 for every
// active unit of every token: about 8 KB per entry at the 2B shape, some 26 GB at M = 131072 and 24
// active units per row, which L2's bandwidth paces. Under uniform sparsity few tokens share a unit, but
// a chunk of ~500 tokens uses most units several times over. So here a CTA takes a chunk of whole rows
// and streams all of W_up, then all of W_down^T, through shared memory, 8 columns of every unit at a
// time (a slice: F x 16 bytes, one bulk copy, two buffers), and each weight byte it fetches serves every
// entry of the chunk that uses the unit. The weights are kept sliced, [K / 8, F, 8], for this
// (twell_compile/kernels/weight_cache.py).
//
// Work: a row's entries are cut into ceil(len / 40) near-equal pieces, one thread each, the piece's
// units and values held in registers for the whole chunk, in an order planned with the other lanes of
// its quarter warp so that they read different shared-memory banks (schedule_bank_steps).
//   up (gated): per slice, a thread adds x[row, 8 columns] . W_up[unit, same columns] for each of its
//     entries; after the last slice h = g * round(up + b_up), as the row-by-row kernel rounds;
//   down: per slice, a thread sums h * W_down^T[unit, 8 columns] over its entries; a row's first piece
//     then adds the other pieces' partials (the next threads, in order: deterministic) and writes the
//     row's 8 output columns (+ b_down), two slices at a time, so that each 32-byte sector of out is
//     written whole by two back-to-back stores. Stored a slice at a time (16 bytes, half a sector, per
//     row and slice), the stores took a quarter of the kernel's time at 24 active units per row, ~500
//     rows per chunk (H100, 2026-11-25, M = 65536, one wave: 1.38 ms, 1.04 ms with the stores left
//     out, 1.19 ms paired; at M = 131072 2.75, 2.07 and 2.37 ms), and nothing measurable at 39 (~300
//     rows per chunk). Half-written sectors are our reading of why; no profile has confirmed it.
//     Writing each sector with one store instruction (the lanes of a pair swapping halves) gained
//     nothing more (2026-11-27); with nothing else running the stores still take about 330 us at
//     M = 65536 with DRAM and L2 far from busy, and what paces them is not known
//     (examples/results/README.md, "The chunked kernel's time by lesion").
//     Four slices at a time (64 bytes, three held slices shifted along) was slower than two in an A/B
//     of both builds: 2.34 against 2.30 ms at M = 131072 and 24, 1.08 against 1.03 ms at 39.
//     A warp whose rows are all of one piece stores before the slice's barrier (in the down loop).
// Rows that are not the chunks' work, decided per 128-row block from the gate's counts (integer tests,
// on the device):
//   - rows of blocks too dense to pay: the dense path, which reads the decision this kernel writes;
//   - rows with more than kChunkMaxRowEntries entries ("heavy": a tenth of the 2B model's units
//     active or more, so one dense row costs less than their entries): listed here for the compact
//     dense path (csrc/twell_heavy_rows.cu). Under skewed activations such rows are rare but spread
//     over half of all blocks; sending their whole blocks to the dense path cost more than the sparse
//     path saved;
//   - sparse rows with no active unit: written here (b_down, or zeros).
// The steps, one launch each: per-block decision and per-row work (pieces, entries), a prefix sum of it
// (at::cumsum) in the chunks' row order (RowOrder: scattered, so that every chunk samples the whole
// call), the entries flattened into one array in that order, then the chunks (a persistent grid, chunks
// of near-equal piece counts, whole waves).

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <numeric>
#include <tuple>

#include "backup_tile.cuh"
#include "cluster_launch.cuh"
#include "dense_block_test.cuh"
#include "dtype16.cuh"
#include "hopper_ptx.cuh"
#include "twell_entries.h"

namespace twell {
namespace {

constexpr int kChunkThreads = 512;
// Entries per thread, in registers (units packed two to a register). A chunk holds at most
// kChunkThreads pieces and every chunk streams all the weights, so the pieces per row set the time:
// at 24 active units per row about 4% of rows have more than 32 (two pieces at a cap of 32), which
// took M = 131072 from two waves of chunks to three.
// float16 held 32 until 2026-11-27, when 40 had once spilled in its loops; it now compiles as bfloat16
// does (24 bytes spilled, in the chunk's set-up only), and 40 took its chunked kernel from 2624-2637 to
// 2227-2263 us at M = 131072 and 24 units (H100; examples/results/README.md, "float16 pieces of 40").
template <typename T>
constexpr int kPieceEntries = 40;
template <typename T>
constexpr int kMaxRowPieces = (kChunkMaxRowEntries + kPieceEntries<T> - 1) / kPieceEntries<T>;
// Nominal pieces per chunk: cut at row boundaries, a chunk may run up to kMaxRowPieces - 1 over.
template <typename T>
constexpr int kChunkPieces = kChunkThreads - (kMaxRowPieces<T> - 1);
constexpr int kSlice = kChunkSliceColumns;  // columns of each unit per slice: 16 bytes
constexpr int kWorkThreads = 256;        // per-row kernels: a warp per row
static_assert(kPieceEntries<__nv_bfloat16> % 4 == 0 && kPieceEntries<__half> % 4 == 0 &&
                  kPieceEntries<__nv_bfloat16> <= 64 && kPieceEntries<__half> <= 64,
              "whole load groups and unit pairs; at most two words per lane to order");

template <typename T>
__host__ __device__ constexpr int row_pieces(int len) { return (len + kPieceEntries<T> - 1) / kPieceEntries<T>; }

// A row's work, packed so that one prefix sum gives both offsets: entries << 32 | pieces.
__device__ __forceinline__ int64_t pack_work(int entries, int pieces) {
  return (static_cast<int64_t>(entries) << 32) | static_cast<int64_t>(pieces);
}
__device__ __forceinline__ int64_t work_entries(int64_t w) { return w >> 32; }
__device__ __forceinline__ int64_t work_pieces(int64_t w) { return w & 0xffffffffll; }

// The order in which the chunks take rows: groups of kRowOrderGroup consecutive rows, group position q
// holding group q * stride mod G (G whole groups, stride coprime to G and near G / golden ratio; rows
// past the whole groups keep their place), so that a chunk's ~500 consecutive positions are rows from
// all over the call. A chunk's time follows its entries, and each CTA runs as long as its chunks' sum.
// Runs of consecutive rows are alike in a real model (the tokens of one sequence): in the 2B-shape
// model at 64 x 2048 tokens, chunks of consecutive rows gave the busiest CTA 1.1-1.4x the mean
// entries, and the kernel took 3.0-3.3 ms a layer against 2.7-3.0 ms on the same rows shuffled (H100,
// 2026-11-25). Groups keep some locality in x and out: on synthetic rows (alike everywhere), scattering
// single rows cost the whole call 1-15% at 24-38 active units per row in two runs (the kernel alone
// about 3% at 24), groups of 32 about nothing, while on the model's layers single rows were about 1%
// faster than groups of 32.
constexpr int64_t kRowOrderGroup = 32;
struct RowOrder {
  int64_t M, groups, stride, inverse;  // stride * inverse = 1 mod groups; rows past them stay
  __device__ __forceinline__ int64_t row_at(int64_t position) const {
    if (position >= groups * kRowOrderGroup) return position;
    return position / kRowOrderGroup * stride % groups * kRowOrderGroup + position % kRowOrderGroup;
  }
  __device__ __forceinline__ int64_t position_of(int64_t row) const {
    if (row >= groups * kRowOrderGroup) return row;
    return row / kRowOrderGroup * inverse % groups * kRowOrderGroup + row % kRowOrderGroup;
  }
};

RowOrder scattered_row_order(int64_t M) {
  TORCH_CHECK(M >= 1 && M <= 0x7fffffff, "twell: bad row count for the chunks' order");
  const int64_t groups = M / kRowOrderGroup;
  if (groups <= 1) return RowOrder{M, 0, 1, 1};
  int64_t stride = std::max<int64_t>(1, std::llround(static_cast<double>(groups) * 0.6180339887498949));
  while (std::gcd(stride, groups) != 1) ++stride;  // ends by groups + 1 at the latest
  stride %= groups;
  // The inverse mod groups by the extended Euclidean algorithm (products stay below 2^62).
  int64_t r0 = groups, r1 = stride, t0 = 0, t1 = 1;
  while (r1 != 0) {
    const int64_t q = r0 / r1;
    std::tie(r0, r1) = std::make_tuple(r1, r0 - q * r1);
    std::tie(t0, t1) = std::make_tuple(t1, t0 - q * t1);
  }
  return RowOrder{M, groups, stride, ((t0 % groups) + groups) % groups};
}

// Smallest position p in [lo, hi] whose prefix holds at least `pieces` pieces (hi when none does).
__device__ int64_t first_position_with_pieces(const int64_t* __restrict__ prefix, int64_t lo, int64_t hi, int64_t pieces) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (work_pieces(prefix[mid]) >= pieces) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (Dtype16<T>::kBF16) {
      f[2 * i] = __uint_as_float(w[i] << 16);  // a bfloat16 is the top half of its float
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
}

// 1. Per 128-row decision block (a CTA each), in two launches, since the second needs every block's
// first decision.
//   a. Each row's entries (kept in `row_entries` for b) and the block's path: dense when it has more than
//      max_heavy heavy rows (past kChunkMaxRowEntries) or when its other rows' entries plus heavy_cost
//      per heavy row exceed its threshold. Dense blocks are counted in counters[1].
//   b. Where most blocks chose dense, every block goes dense: with the chunks left a minority of the
//      rows, they could not amortize streaming the weights, and the dense GEMMs barely shrink when
//      only some 128-row blocks skip (H100, 2B shape, M = 131072, skewed activations with 117 active
//      units per row on average: 17.5 ms mixed against 15.8 ms all dense). Then each row's work: in a
//      sparse block its entries and pieces (packed for the prefix sum, at the row's position in
//      RowOrder); a heavy row is listed
//      (heavy_rows, counters[0]) for the compact dense path instead; a row with no entry gets its
//      output here. Rows of dense blocks have none.
__global__ void __launch_bounds__(kWorkThreads) decide_blocks_kernel(
    const int* __restrict__ counts, int n_tiles, int64_t M, int thr_full, int thr_last, int max_heavy,
    int64_t heavy_cost, int* __restrict__ decided, int64_t* __restrict__ row_entries, int* __restrict__ counters) {
  __shared__ int totals[kDecisionRows];
  const int blk = static_cast<int>(blockIdx.x), n_blocks = static_cast<int>(gridDim.x);
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int64_t row0 = static_cast<int64_t>(blk) * kDecisionRows;
  const int rows = static_cast<int>(M - row0 < kDecisionRows ? M - row0 : kDecisionRows);
  for (int r = warp; r < rows; r += kWorkThreads / 32) {
    int total = 0;
    for (int t = lane; t < n_tiles; t += 32) total += counts[(row0 + r) * n_tiles + t];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    if (lane == 0) {
      totals[r] = total;
      row_entries[row0 + r] = total;
    }
  }
  __syncthreads();
  if (warp != 0) return;
  int light = 0, heavy = 0;  // at most 128 x 256 entries: no overflow
  for (int r = lane; r < rows; r += 32) {
    const int total = totals[r];
    if (total > kChunkMaxRowEntries) ++heavy;
    else light += total;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    light += __shfl_xor_sync(0xffffffffu, light, o);
    heavy += __shfl_xor_sync(0xffffffffu, heavy, o);
  }
  if (lane == 0) {
    const int thr = blk == n_blocks - 1 ? thr_last : thr_full;
    const bool dense = heavy > max_heavy || light + heavy_cost * heavy > thr;
    decided[blk] = dense ? 1 : 0;
    decided[n_blocks + blk] = 0;
    if (dense) atomicAdd(&counters[1], 1);
  }
}

template <typename T>
__global__ void __launch_bounds__(kWorkThreads) row_work_kernel(
    int64_t M, RowOrder order, int* __restrict__ decided, const int64_t* __restrict__ row_entries,
    int64_t* __restrict__ work, int* __restrict__ heavy_rows, int* __restrict__ counters,
    const T* __restrict__ b_down, T* __restrict__ out, int D) {
  __shared__ int block_dense;
  const int blk = static_cast<int>(blockIdx.x), n_blocks = static_cast<int>(gridDim.x);
  if (threadIdx.x == 0) {
    const bool dense = decided[blk] != 0 || 2 * counters[1] > n_blocks;
    decided[blk] = dense ? 1 : 0;  // only this CTA reads or writes it in this launch
    block_dense = dense;
  }
  __syncthreads();
  const bool dense = block_dense != 0;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int64_t row0 = static_cast<int64_t>(blk) * kDecisionRows;
  const int rows = static_cast<int>(M - row0 < kDecisionRows ? M - row0 : kDecisionRows);
  for (int r = warp; r < rows; r += kWorkThreads / 32) {
    const int64_t row = row0 + r;
    const int total = static_cast<int>(row_entries[row]);
    int64_t w = 0;
    if (!dense) {
      if (total == 0) {
        for (int col = lane; col < D; col += 32)
          out[row * D + col] = b_down != nullptr ? b_down[col] : Dtype16<T>::from_float(0.f);
      } else if (total <= kChunkMaxRowEntries) {
        w = pack_work(total, row_pieces<T>(total));
      } else if (lane == 0) {
        heavy_rows[atomicAdd(&counters[0], 1)] = static_cast<int>(row);
      }
    }
    if (lane == 0) work[order.position_of(row)] = w;
  }
}

// Sorts a piece's entries (at most 64: a warp, entry i held by lane i % 32 as its word i / 32) by
// shared-memory bank group, unit % 8, keeping each group's entries in order. The chunk kernel then
// takes a group's entries in this order when it schedules its loads (schedule_bank_steps).
__device__ void sort_piece_by_bank(uint32_t* __restrict__ piece, int n, int lane) {
  uint32_t word[2];
  int group[2], position[2] = {0, 0};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = h * 32 + lane;
    word[h] = i < n ? piece[i] : 0u;
    group[h] = i < n ? static_cast<int>(word[h] & 7u) : 8;
  }
  // Position = entries of lower groups + entries of the same group before this one.
#pragma unroll
  for (int g = 0; g < 8; ++g) {
    const int in_first = __popc(__ballot_sync(0xffffffffu, group[0] == g));
    const int in_group = in_first + __popc(__ballot_sync(0xffffffffu, group[1] == g));
    if (group[0] > g) position[0] += in_group;
    if (group[1] > g) position[1] += in_group;
    if (group[1] == g) position[1] += in_first;
  }
  const unsigned below = (1u << lane) - 1u;
  position[0] += __popc(__match_any_sync(0xffffffffu, group[0]) & below);
  position[1] += __popc(__match_any_sync(0xffffffffu, group[1]) & below);
  __syncwarp();  // every lane has its words before any is overwritten
#pragma unroll
  for (int h = 0; h < 2; ++h)
    if (h * 32 + lane < n) piece[position[h]] = word[h];
}

// 2. Per row taken (a warp each): its entries, in the row-by-row kernel's order (tile by tile, packed
// slots, or the dense backup of tiles past capacity), into entries[] at the row's offset (the prefix at
// its position in RowOrder), one word each:
// value bits << 16 | unit; then each piece's entries sorted by bank group (above).
// The row is gathered and sorted in shared memory (a flattened row has at most kChunkMaxRowEntries
// entries: row_work_kernel lists longer ones as heavy, with no work) and written out once, and the
// row's prefix and first tile counts load together. Gathering into entries[] and sorting there, the
// kernel took 112 us at M = 131072 and 24 active units, 160 at 80; this way 102 and 152 (H100,
// 2026-11-25, examples/results/ab_flatten_smem_h100_2026-11-25.log).
constexpr int kFlattenWarps = kWorkThreads / 32;
template <typename T>
__global__ void __launch_bounds__(kWorkThreads) flatten_entries_kernel(
    const uint32_t* __restrict__ packed, const int* __restrict__ counts, const T* __restrict__ dense,
    const int64_t* __restrict__ prefix, int64_t M, RowOrder order, int n_tiles, int cap, int tile_n, int F,
    uint32_t* __restrict__ entries) {
  __shared__ uint32_t gathered[kFlattenWarps][kChunkMaxRowEntries];
  const int warp = static_cast<int>(threadIdx.x / 32), lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kFlattenWarps + warp;
  if (row >= M) return;
  const int64_t position = order.position_of(row);
  const int* row_counts = counts + row * n_tiles;
  const int64_t begin_word = prefix[position], end_word = prefix[position + 1];
  const int first_count = lane < n_tiles ? row_counts[lane] : 0;  // issued before the prefix is needed
  const int64_t begin = work_entries(begin_word), end = work_entries(end_word);
  if (end == begin) return;
  uint32_t* buf = gathered[warp];
  int carry = 0;
  for (int t0 = 0; t0 < n_tiles; t0 += 32) {
    const int t = t0 + lane;
    const int c = t0 == 0 ? first_count : (t < n_tiles ? row_counts[t] : 0);
    int incl = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += n;
    }
    const int at = carry + incl - c;
    carry += __shfl_sync(0xffffffffu, incl, 31);
    if (c > 0 && c <= cap) {  // a lane per packed tile, its slots loaded together
      const uint32_t* slots = packed + (row * n_tiles + t) * cap;
      uint32_t words[8];
      for (int j0 = 0; j0 < c; j0 += 8) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (j0 + j < c) words[j] = slots[j0 + j];
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (j0 + j < c) buf[at + j0 + j] = (words[j] & 0xffff0000u) | static_cast<uint32_t>(t * tile_n + (words[j] & 0xffffu));
      }
    }
    // Tiles past capacity: the warp enumerates each one's active units from the dense backup.
    unsigned over = __ballot_sync(0xffffffffu, c > cap);
    while (over != 0u) {
      const int src = __ffs(over) - 1;
      over &= over - 1u;
      const int tile = t0 + src, tile_at = __shfl_sync(0xffffffffu, at, src), tile_count = __shfl_sync(0xffffffffu, c, src);
      const int col0 = tile * tile_n;
      for_each_backup_entry(dense + row * F + col0, min(tile_n, F - col0), lane, [&](int k, int col, uint32_t bits) {
        if (k < tile_count) buf[tile_at + k] = (bits << 16) | static_cast<uint32_t>(col0 + col);
      });
    }
  }
  __syncwarp();  // the row's entries are gathered (and visible to the warp)
  const int len = static_cast<int>(end - begin);
  const int parts = static_cast<int>(work_pieces(end_word) - work_pieces(begin_word));
  for (int part = 0; part < parts; ++part)
    sort_piece_by_bank(buf + len * part / parts, len * (part + 1) / parts - len * part / parts, lane);
  __syncwarp();
  uint32_t* dst = entries + begin;
  for (int i = lane; i < len; i += 32) dst[i] = buf[i];
}

// 3. The chunks; see the file comment. Shared memory: two slice buffers (F x 16 bytes each, then
// kZeroUnits zero units that padding positions read), two sets of piece partials (8 floats per piece),
// two barriers, the chunk's row range. At a chunk's start the partials' space holds the pieces' order,
// then each thread's load plan (below) until the up projection is done.
//
// Thread order. A warp steps through its lanes' entries together, so it runs as long as its longest
// piece, and all warps meet at every slice. So each chunk's pieces are sorted by entry count, longest
// first, within each class of piece index mod 8 (ties in piece order, so the order is deterministic).
// The sorted warps are dealt to the SM's four schedulers (warp % 4) in a snake, ranks 0-3, 7-4, 8-11,
// 15-12, so that each scheduler's warps sum to about the same work: dealt in order, the scheduler of
// the longest warp got the longest of every four, some 12% more issue than the average at 24 active
// units per row (estimated from Poisson piece lengths). A piece's up projections do not depend on where it runs; its down partials sum its
// entries in its plan's order, which depends on the 8 pieces of its quarter warp, fixed by the sort
// (the snake moves whole warps). A row's pieces add their partials in piece order.
struct PieceOrder {
  int row, first_entry;
  int count_and_parts;  // entries | (the row's piece count if this is its first piece, else 0) << 8
  int local;            // the piece's index in the chunk: where its partials go
};
// The thread that runs the chunk's rank-th piece in the sorted order: warps of ranks 4i .. 4i + 3 go to
// schedulers 0-3 for even i and 3-0 for odd i (see Thread order); lanes stay.
__device__ __forceinline__ int snake_thread(int rank) {
  const int warp = rank / 32, group = warp / 4, turn = warp % 4;
  return 32 * (4 * group + (group % 2 == 0 ? turn : 3 - turn)) + rank % 32;
}
template <typename T>
constexpr int kCountBuckets = kPieceEntries<T> + 1;  // entry counts 0 (idle thread) .. kPieceEntries
constexpr int kLoadGroup = 2;  // slice loads per thread per step; the next step's are in flight too
constexpr int kZeroUnits = 8;  // one per bank group
// A thread's plan: its group starts (one byte per group), then a byte per load position.
template <typename T>
constexpr int kPlanBytes = 8 + kPieceEntries<T>;
constexpr uint8_t kPadPosition = 8;  // plan code: read the zero unit of the group in the low bits

// The zero unit of bank group g: units F .. F + 7 after each slice.
__device__ __forceinline__ uint32_t zero_unit(int F, int g) { return static_cast<uint32_t>(F + ((g - F) & 7)); }

// A lane's entries left per bank group, as sortable keys: group g's key is (entries << 3) | (7 - g), in the
// 16-bit half g % 2 of word g / 2, so that the largest key is the group with the most entries, the
// lowest such group on a tie, and a key below 8 means an empty group. Hopper's DPX instructions take
// the largest of the 8 halves in two steps, where a loop over the groups' bytes took about 6
// instructions a group. The plans are the same; the planning took about 105,000 cycles of a
// 2.2-million-cycle chunk against 125,000 with the loop (24 active units per row; 108,000 against
// 140,000 at 80; H100, clock64 probes). Most of what is left is the lanes' turns: 8 dependent
// shuffles per load step.
struct GroupKeys {
  uint32_t w[4];
  __device__ __forceinline__ explicit GroupKeys(uint64_t per_group) {
#pragma unroll
    for (int g = 0; g < 8; ++g) {
      const uint32_t key = static_cast<uint32_t>(((per_group >> (8 * g)) & 0xffu) << 3 | (7 - g));
      if (g % 2 == 0) w[g / 2] = key;
      else w[g / 2] |= key << 16;
    }
  }
  // The group with the most entries among those whose halves `allowed` keeps (0xffff each), -1 when none
  // has any.
  __device__ __forceinline__ int fullest(const uint32_t (&allowed)[4]) const {
    const uint32_t a = __vimax3_u16x2(w[0] & allowed[0], w[1] & allowed[1], w[2] & allowed[2]);
    const uint32_t b = __vimax3_u16x2(a, w[3] & allowed[3], 0u);
    const uint32_t key = max(b & 0xffffu, b >> 16);
    return key < 8u ? -1 : 7 - static_cast<int>(key & 7u);
  }
  __device__ __forceinline__ void take(int g) {  // one entry of group g (selects: no indexed array)
    const uint32_t one = 8u << (16 * (g & 1));
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] -= g / 2 == i ? one : 0u;
  }
};

// The order of a thread's shared-memory loads, planned with the other 7 lanes of its quarter warp. A
// warp's 16-byte loads are served a quarter warp at a time, one wavefront per lane whose bank group
// (unit % 8) another lane already hit, so a step costs as many wavefronts as its busiest group has
// lanes. Pieces ordering their entries alone took 7.0 wavefronts per warp load instead of 4 (Nsight
// Compute, H100, 24 active units per row). Here the lanes choose each step's groups in turn (the
// first rotating with the step): a group no lane has taken at this step, the one where the lane has
// most entries left; when all its groups are taken, it waits for a later step if it has positions to
// spare, else takes its fullest group anyway (a conflict). Lanes without an entry at a step read the
// zero unit of a group left free. A simulation of random units puts this at about 1.2 wavefronts per
// step at 24 to 80 active units per row, against 1.8 for the per-piece order.
// per_group: the piece's entries per group, a byte each; steps: the warp's load positions (every
// piece's count fits); plan[j]: position j's group, or kPadPosition | a free group.
__device__ void schedule_bank_steps(uint64_t per_group, int left, int steps, int lane, uint8_t* __restrict__ plan) {
  const int q = lane & 7, quarter = lane & ~7;
  GroupKeys keys(per_group);
  const uint32_t all[4] = {~0u, ~0u, ~0u, ~0u};
  for (int j = 0; j < steps; ++j) {
    uint32_t taken = 0;                         // groups the quarter's lanes read at this step
    uint32_t untaken[4] = {~0u, ~0u, ~0u, ~0u};  // the same, as masks with taken halves cleared
    int mine = -1;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int actor = (k + j) & 7;
      int want = -1;
      if (q == actor) {
        want = keys.fullest(untaken);
        if (want < 0 && left >= steps - j) want = keys.fullest(all);  // no position to spare
      }
      want = __shfl_sync(0xffffffffu, want, quarter | actor);
      if (want >= 0) {
        taken |= 1u << want;
        const uint32_t keep = ~(0xffffu << (16 * (want & 1)));
#pragma unroll
        for (int i = 0; i < 4; ++i) untaken[i] &= want / 2 == i ? keep : ~0u;
      }
      if (q == actor) mine = want;
    }
    const uint32_t pads = (__ballot_sync(0xffffffffu, mine < 0) >> quarter) & 0xffu;
    uint8_t code;
    if (mine >= 0) {
      keys.take(mine);
      --left;
      code = static_cast<uint8_t>(mine);
    } else {  // the r-th pad lane takes the r-th free group; if too few are free, they share the first
      const uint32_t free_groups = ~taken & 0xffu;
      int g = free_groups != 0u ? __ffs(free_groups) - 1 : 0;
      int r = __popc(pads & ((1u << q) - 1u));
      for (uint32_t f = free_groups; f != 0u; f &= f - 1u, --r) {
        if (r == 0) {
          g = __ffs(f) - 1;
          break;
        }
      }
      code = static_cast<uint8_t>(kPadPosition | g);
    }
    plan[j] = code;
  }
}

template <typename T, bool GATED>
__global__ void __launch_bounds__(kChunkThreads, 1) chunked_mlp_kernel(
    const T* __restrict__ x,              // [M, K] (gated)
    const T* __restrict__ w_up_sliced,    // [K / 8, F, 8] (gated)
    const T* __restrict__ b_up,           // [F] or null
    const T* __restrict__ w_down_sliced,  // [D / 8, F, 8]: W_down^T's columns, sliced
    const T* __restrict__ b_down,         // [D] or null
    T* __restrict__ out,                  // [M, D]
    const uint32_t* __restrict__ entries, const int64_t* __restrict__ prefix, RowOrder row_order, int K, int D, int F) {
  ptx::wait_for_predecessor_then_release_successor();
  const int64_t M = row_order.M;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t slice_bytes = static_cast<uint32_t>(F) * kSlice * sizeof(T);
  const uint32_t buffer_bytes = slice_bytes + kZeroUnits * kSlice * sizeof(T);  // the slice, then the zero units
  unsigned char* slices = smem;
  const uint32_t slices_addr = ptx::smem_addr(slices);
  float4* partials = reinterpret_cast<float4*>(smem + 2 * buffer_bytes);  // [2][kChunkThreads][2]
  uint64_t* full = reinterpret_cast<uint64_t*>(partials + 2 * kChunkThreads * 2);  // [2]: a slice landed
  int64_t* chunk_positions = reinterpret_cast<int64_t*>(full + 2);  // the chunk's range in RowOrder
  // At a chunk's start, in the partials' space: per class and entry count, which of the class's 64
  // threads hold such a piece (a bit each) and where the count's pieces start; then the order.
  unsigned long long* bucket_threads = reinterpret_cast<unsigned long long*>(partials);  // [8][kCountBuckets]
  int* bucket_start = reinterpret_cast<int*>(bucket_threads + 8 * kCountBuckets<T>);   // [8][kCountBuckets]
  PieceOrder* order = reinterpret_cast<PieceOrder*>(bucket_start + 8 * kCountBuckets<T>);  // [kChunkThreads]

  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t total_pieces = work_pieces(prefix[M]);
  if (total_pieces == 0) return;
  // Chunks of near-equal piece counts, in whole waves of the persistent grid when there are more
  // than one wave's worth (so no CTA runs one more chunk than the rest), else one per CTA (smaller
  // chunks, but every SM streams and gathers).
  const int64_t grid = gridDim.x;
  int64_t n_chunks = (total_pieces + kChunkPieces<T> - 1) / kChunkPieces<T>;
  if (n_chunks > grid) n_chunks = (n_chunks + grid - 1) / grid * grid;
  else n_chunks = grid < total_pieces ? grid : total_pieces;
  const int64_t chunk_size = (total_pieces + n_chunks - 1) / n_chunks;
  if (blockIdx.x >= n_chunks) return;
  const int my_chunks = static_cast<int>((n_chunks - 1 - blockIdx.x) / grid + 1);
  const int up_slices = GATED ? K / kSlice : 0, down_slices = D / kSlice;
  const int per_chunk = up_slices + down_slices;
  const int n_stages = my_chunks * per_chunk;
  const auto issue = [&](int stage) {  // one thread: the slice of stage `stage` into buffer stage % 2
    const int s = stage % per_chunk;
    const T* src = s < up_slices ? w_up_sliced + static_cast<int64_t>(s) * F * kSlice
                                 : w_down_sliced + static_cast<int64_t>(s - up_slices) * F * kSlice;
    ptx::mbarrier_arrive_expect_tx(&full[stage & 1], slice_bytes);
    ptx::bulk_load(slices + (stage & 1) * buffer_bytes, src, slice_bytes, &full[stage & 1]);
  };
  if (tid == 0) {
    ptx::mbarrier_init(&full[0], 1);
    ptx::mbarrier_init(&full[1], 1);
    ptx::fence_barrier_init();
  }
  if (tid < 2 * kZeroUnits)
    *reinterpret_cast<uint4*>(slices + (tid / kZeroUnits) * buffer_bytes + slice_bytes +
                              (tid % kZeroUnits) * kSlice * sizeof(T)) = make_uint4(0u, 0u, 0u, 0u);
  __syncthreads();
  if (tid == 0) {
    issue(0);
    if (n_stages > 1) issue(1);
  }

  int stage = 0;
  for (int i = 0; i < my_chunks; ++i) {
    const int64_t chunk = blockIdx.x + static_cast<int64_t>(i) * grid;
    __syncthreads();  // everyone is done with the previous chunk (its row range, its partials)
    if (tid < 2) chunk_positions[tid] = first_position_with_pieces(prefix, 0, M, (chunk + tid) * chunk_size);
    for (int b = tid; b < 8 * kCountBuckets<T>; b += kChunkThreads) bucket_threads[b] = 0ull;
    __syncthreads();
    const int64_t begin = chunk_positions[0], end = chunk_positions[1];
    const int64_t piece = work_pieces(prefix[begin]) + tid;

    // This thread's natural piece (the chunk's tid-th): its row and entries.
    PieceOrder mine{0, 0, 0, tid};
    int natural_count = 0;
    if (piece < work_pieces(prefix[end])) {
      const int64_t position = first_position_with_pieces(prefix, begin, end, piece + 1) - 1;
      const int64_t here = prefix[position], next = prefix[position + 1];
      const int len = static_cast<int>(work_entries(next) - work_entries(here));
      const int parts = static_cast<int>(work_pieces(next) - work_pieces(here));
      const int part = static_cast<int>(piece - work_pieces(here));
      const int a = len * part / parts, b = len * (part + 1) / parts;
      natural_count = b - a;
      mine.row = static_cast<int>(row_order.row_at(position));
      mine.first_entry = static_cast<int>(work_entries(here) + a);
      mine.count_and_parts = natural_count | (part == 0 ? parts : 0) << 8;
    }
    // Class cls holds the threads tid = c + 8 m (m = 0 .. 63) for one c, so tid / 8 ranks them.
    const int cls = static_cast<int>(piece & 7);
    const int bucket = kPieceEntries<T> - natural_count;  // longest first
    atomicOr(&bucket_threads[cls * kCountBuckets<T> + bucket], 1ull << (tid / 8));
    __syncthreads();
    if (tid < 8) {  // where each count's pieces start in the class
      int sum = 0;
      for (int b = 0; b < kCountBuckets<T>; ++b) {
        bucket_start[tid * kCountBuckets<T> + b] = sum;
        sum += __popcll(bucket_threads[tid * kCountBuckets<T> + b]);
      }
    }
    __syncthreads();
    const int slot = bucket_start[cls * kCountBuckets<T> + bucket] +
                     __popcll(bucket_threads[cls * kCountBuckets<T> + bucket] & ((1ull << (tid / 8)) - 1ull));
    order[snake_thread(8 * slot + cls)] = mine;  // each class has 64 threads
    __syncthreads();
    const PieceOrder job = order[tid];
    const int count = job.count_and_parts & 0xff;
    // A row's first piece adds the partials of its other pieces, the next ones in the chunk.
    const int job_parts = job.count_and_parts >> 8;
    const int groups = (__reduce_max_sync(0xffffffffu, static_cast<unsigned>(count)) + kLoadGroup - 1) / kLoadGroup;
    const int steps = groups * kLoadGroup;

    // The load plan (flatten sorted the piece's entries by bank group).
    uint64_t per_group = 0;  // entries per group, a byte each
#pragma unroll
    for (int j = 0; j < kPieceEntries<T>; ++j)
      if (j < count) per_group += uint64_t{1} << (8 * (entries[job.first_entry + j] & 7u));
    __syncthreads();  // the order is read: the plans take its place
    uint8_t* plan = reinterpret_cast<uint8_t*>(partials) + tid * kPlanBytes<T>;
    // Group starts in the piece: the bytes' exclusive prefix sums (at most kPieceEntries each).
    *reinterpret_cast<uint64_t*>(plan) = (per_group * 0x0101010101010101ull) << 8;
    schedule_bank_steps(per_group, count, steps, lane, plan + 8);

    // Walks the plan's positions: at(j, entry) with the entry's word, or pad(j, unit) for a zero unit.
    const auto walk_plan = [&](auto&& at, auto&& pad) {
      const uint64_t start = *reinterpret_cast<const uint64_t*>(plan);
      uint64_t taken = 0;  // entries used per group
#pragma unroll
      for (int j = 0; j < kPieceEntries<T>; ++j) {
        if (j < steps) {
          const int code = plan[8 + j], g = code & 7;
          if ((code & kPadPosition) != 0) {
            pad(j, zero_unit(F, g));
          } else {
            const int k = static_cast<int>(((start >> (8 * g)) & 0xffu) + ((taken >> (8 * g)) & 0xffu));
            taken += uint64_t{1} << (8 * g);
            at(j, entries[job.first_entry + k]);
          }
        }
      }
    };
    // Position j's unit, two to a register, scaled so that its byte offset in a slice (unit * 16) takes
    // one shift at odd positions (the high half holds unit * 8, and the low half's top bit is clear:
    // word >> 15) and a mask and a shift at even ones (the low half holds unit * 4). Both fit 16 bits
    // since F + kZeroUnits <= 8192 (chunked_sparse_fits). Saves the per-entry extraction and the
    // buffer's offset in the address sums of the hot loops (the buffer's address is warp-uniform).
    uint32_t units[kPieceEntries<T> / 2];
    float acc[kPieceEntries<T>];           // up projections, then h (padding: 0)
#pragma unroll
    for (int j = 0; j < kPieceEntries<T>; ++j) {
      if (j % 2 == 0) units[j / 2] = 0u;
      acc[j] = 0.f;
    }
    const auto set_unit = [&](int j, uint32_t unit) { units[j / 2] |= j % 2 == 0 ? unit * 4u : unit * 8u << 16; };
    walk_plan(
        [&](int j, uint32_t word) {
          set_unit(j, word & 0xffffu);
          if constexpr (!GATED) acc[j] = Dtype16<T>::value(word >> 16);
        },
        [&](int j, uint32_t unit) { set_unit(j, unit); });
    // use(j, w) for each position j of the plan (warp-uniformly, whole groups of kLoadGroup) with w its
    // unit's 8 columns in `slice`. The next group's rows are loaded before this group's are used, so
    // 2 * kLoadGroup loads are in flight without holding more rows in registers than groups of 4 did
    // (small groups also pad less: a warp runs its longest piece rounded up to a whole group). Past
    // the plan's last position the units are 0: the prefetch reads unit 0's row there and leaves it.
    const auto for_each_entry = [&](uint32_t slice, auto&& use) {  // slice: a buffer's shared address
      const auto load = [&](int g, uint4 (&rows)[kLoadGroup]) {
#pragma unroll
        for (int l = 0; l < kLoadGroup; ++l) {
          const int j = g * kLoadGroup + l;
          const uint32_t offset = j % 2 == 0 ? (units[j / 2] & 0xffffu) << 2 : units[j / 2] >> 15;
          rows[l] = ptx::ld_shared_v4(slice + offset);
        }
      };
      uint4 rows[2][kLoadGroup];  // by group parity (static indices once unrolled: no copies)
      load(0, rows[0]);
#pragma unroll
      for (int g = 0; g < kPieceEntries<T> / kLoadGroup; ++g) {
        if (g < groups) {
          if (g + 1 < kPieceEntries<T> / kLoadGroup) load(g + 1, rows[(g + 1) % 2]);
#pragma unroll
          for (int l = 0; l < kLoadGroup; ++l) {
            float w[8];
            unpack8<T>(rows[g % 2][l], w);
            use(g * kLoadGroup + l, w);
          }
        }
      }
    };

    if constexpr (GATED) {
      const T* x_row = x + static_cast<int64_t>(job.row) * K;
      uint4 x_next = count > 0 ? *reinterpret_cast<const uint4*>(x_row) : make_uint4(0, 0, 0, 0);
      for (int s = 0; s < up_slices; ++s, ++stage) {
        float xf[8];
        unpack8<T>(x_next, xf);
        if (count > 0 && s + 1 < up_slices) x_next = *reinterpret_cast<const uint4*>(x_row + (s + 1) * kSlice);
        ptx::mbarrier_wait(&full[stage & 1], (stage >> 1) & 1);
        const uint32_t slice = slices_addr + (stage & 1) * buffer_bytes;
        for_each_entry(slice, [&](int j, const float (&w)[8]) {
          float a = acc[j];
#pragma unroll
          for (int v = 0; v < 8; ++v) a = fmaf(xf[v], w[v], a);
          acc[j] = a;
        });
        // A CTA barrier, not per-warp release: with each warp counting itself done and the last
        // refilling the buffer, warps ran up to a slice apart, took issue slots from the slowest warp
        // (whose finish the next copy waits for), and the kernel was 2-7% slower (H100, 2026-11-27).
        // Lesions that day found no single resource pacing this loop: without the bf16 conversions
        // 1-4% faster; without bank conflicts, or with one shared address for all lanes, no faster at
        // 24-39 units per row (6-9% at 80); two chains of 4 products per entry, 0-5% slower
        // (examples/results/README.md, "What does not pace the chunked kernel").
        __syncthreads();  // every thread is done with this buffer
        if (tid == 0 && stage + 2 < n_stages) issue(stage + 2);
      }
      // h = g * round(up + b_up), as eager rounds up(x) to the input dtype before the product; padding
      // positions (whose sums are NaN where x is not finite) get 0.
      walk_plan(
          [&](int j, uint32_t word) {
            const float up = acc[j] + (b_up != nullptr ? Dtype16<T>::to_float(b_up[word & 0xffffu]) : 0.f);
            acc[j] = Dtype16<T>::value(word >> 16) * Dtype16<T>::to_float(Dtype16<T>::from_float(up));
          },
          [&](int j, uint32_t) { acc[j] = 0.f; });
    }
    __syncthreads();  // every plan is read before the down projection's partials overwrite them

    T* out_row = out + static_cast<int64_t>(job.row) * D;
    for (int s = 0; s < down_slices; ++s, ++stage) {
      ptx::mbarrier_wait(&full[stage & 1], (stage >> 1) & 1);
      const uint32_t slice = slices_addr + (stage & 1) * buffer_bytes;
      float o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for_each_entry(slice, [&](int j, const float (&w)[8]) {
#pragma unroll
        for (int v = 0; v < 8; ++v) o[v] = fmaf(acc[j], w[v], o[v]);
      });
      float4* held = partials + ((s & 1) * kChunkThreads + job.local) * 2;
      if (count > 0 && job_parts == 0) {  // a later piece of its row: the owner adds it
        held[0] = make_float4(o[0], o[1], o[2], o[3]);
        held[1] = make_float4(o[4], o[5], o[6], o[7]);
      }
      // A row's output slice: the owner adds the other pieces' partials (b_down), rounds, and stores.
      const auto finish_row = [&]() {
        for (int p = 1; p < job_parts; ++p) {
          const float4 lo = held[2 * p], hi = held[2 * p + 1];
          o[0] += lo.x; o[1] += lo.y; o[2] += lo.z; o[3] += lo.w;
          o[4] += hi.x; o[5] += hi.y; o[6] += hi.z; o[7] += hi.w;
        }
        const int col = s * kSlice;
        if (b_down != nullptr) {
          const uint4 b = *reinterpret_cast<const uint4*>(b_down + col);
          float bf[8];
          unpack8<T>(b, bf);
#pragma unroll
          for (int v = 0; v < 8; ++v) o[v] += bf[v];
        }
        uint4 packed_out;
        packed_out.x = Dtype16<T>::pair_bits(o[0], o[1]);
        packed_out.y = Dtype16<T>::pair_bits(o[2], o[3]);
        packed_out.z = Dtype16<T>::pair_bits(o[4], o[5]);
        packed_out.w = Dtype16<T>::pair_bits(o[6], o[7]);
        // Slices go out in pairs, so that each 32-byte sector of the row is written whole (file comment).
        // The even slice waits in the owner's own slot of the even partials buffer, which no other
        // piece writes (registers are full: kept in one, it added spills to the bf16 gated build).
        uint4* held_out = reinterpret_cast<uint4*>(partials + job.local * 2);
        if (s % 2 == 0 && s + 1 < down_slices) {
          *held_out = packed_out;
        } else {
          if (s % 2 == 1) *reinterpret_cast<uint4*>(out_row + col - kSlice) = *held_out;
          *reinterpret_cast<uint4*>(out_row + col) = packed_out;
        }
      };
      // A warp whose rows are all of one piece finishes them before the slice's barrier, so that their
      // stores overlap the slower warps' entries; a row of several pieces needs their partials, after
      // it. Decided per warp: a warp mixing both would run the finishing code on both sides. At 24
      // active units per row nearly all warps finish early (4.5% off the kernel at M = 131072; 9%
      // non-gated); at 80 nearly none, and it measured 1-2% slower there, cause not found; level at 39
      // and in float16 (H100, 2026-11-27; examples/results/README.md, "Early stores"). The gated
      // builds spill 20-24 bytes with it, in each chunk's set-up only (SASS: no local memory access in
      // the slice loops).
      // Voted each slice, as timed: the inputs do not change over the loop, but hoisting the vote or
      // naming the owner test changed the register allocation, and that build has not been timed.
      const bool finish_early = __all_sync(0xffffffffu, !(count > 0 && job_parts > 1));
      if (finish_early && count > 0 && job_parts > 0) finish_row();
      __syncthreads();  // this buffer is free, and the partials are visible
      if (tid == 0 && stage + 2 < n_stages) issue(stage + 2);
      if (!finish_early && count > 0 && job_parts > 0) finish_row();
    }
  }
}

template <typename T>
const T* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? reinterpret_cast<const T*>(t->data_ptr()) : nullptr;
}


template <typename T>
void run_chunked(const c10::optional<at::Tensor>& x, const at::Tensor& packed, const at::Tensor& counts,
                 const at::Tensor& dense, const c10::optional<at::Tensor>& w_up_sliced,
                 const c10::optional<at::Tensor>& b_up, const at::Tensor& w_down_sliced,
                 const c10::optional<at::Tensor>& b_down, at::Tensor& out, at::Tensor& decided,
                 const at::Tensor& heavy_rows, const at::Tensor& counters, int64_t tile_n, int thr_full,
                 int thr_last, int max_heavy, int64_t ctas, int64_t max_entries) {
  const bool gated = w_up_sliced.has_value();
  const int64_t M = out.size(0);
  const int D = static_cast<int>(out.size(1));
  const int F = static_cast<int>(w_down_sliced.size(1));
  const int K = gated ? static_cast<int>(x->size(1)) : 0;
  const int n_tiles = static_cast<int>(counts.size(1));
  const int cap = static_cast<int>(packed.size(2));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto longs = out.options().dtype(at::kLong);
  at::Tensor row_entries = at::empty({M}, longs);  // by row
  at::Tensor work = at::empty({M}, longs);         // by position in RowOrder, as prefix
  at::Tensor prefix = at::empty({M + 1}, longs);
  at::Tensor entries = at::empty({max_entries}, out.options().dtype(at::kInt));
  C10_CUDA_CHECK(cudaMemsetAsync(prefix.data_ptr(), 0, sizeof(int64_t), stream));
  const unsigned n_blocks = static_cast<unsigned>((M + kDecisionRows - 1) / kDecisionRows);
  const int64_t heavy_cost = std::max<int64_t>(1, thr_full / kDecisionRows);  // a row at the threshold density
  decide_blocks_kernel<<<n_blocks, kWorkThreads, 0, stream>>>(counts.data_ptr<int>(), n_tiles, M, thr_full, thr_last,
                                                              max_heavy, heavy_cost, decided.data_ptr<int>(),
                                                              row_entries.data_ptr<int64_t>(), counters.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const RowOrder order = scattered_row_order(M);
  row_work_kernel<T><<<n_blocks, kWorkThreads, 0, stream>>>(
      M, order, decided.data_ptr<int>(), row_entries.data_ptr<int64_t>(), work.data_ptr<int64_t>(),
      heavy_rows.data_ptr<int>(), counters.data_ptr<int>(), data_or_null<T>(b_down), reinterpret_cast<T*>(out.data_ptr()), D);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor prefix_tail = prefix.narrow(0, 1, M);
  at::cumsum_out(prefix_tail, work, 0);
  const unsigned row_blocks = static_cast<unsigned>((M + kFlattenWarps - 1) / kFlattenWarps);
  flatten_entries_kernel<T><<<row_blocks, kWorkThreads, 0, stream>>>(
      reinterpret_cast<const uint32_t*>(packed.data_ptr<int>()), counts.data_ptr<int>(),
      reinterpret_cast<const T*>(dense.data_ptr()), prefix.data_ptr<int64_t>(), M, order, n_tiles, cap,
      static_cast<int>(tile_n), F, reinterpret_cast<uint32_t*>(entries.data_ptr<int>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const size_t smem = chunked_smem_bytes(F, sizeof(T));
  const auto launch = [&](auto kernel) {
    const KernelLaunch chunk_launch(kernel, dim3(static_cast<unsigned>(ctas)), kChunkThreads, smem, 1);
    chunk_launch.run(kernel, gated ? reinterpret_cast<const T*>(x->data_ptr()) : nullptr, data_or_null<T>(w_up_sliced),
                     data_or_null<T>(b_up), reinterpret_cast<const T*>(w_down_sliced.data_ptr()), data_or_null<T>(b_down),
                     reinterpret_cast<T*>(out.data_ptr()), reinterpret_cast<const uint32_t*>(entries.data_ptr<int>()),
                     static_cast<const int64_t*>(prefix.data_ptr<int64_t>()), order, K, D, F);
  };
  if (gated) launch(chunked_mlp_kernel<T, true>);
  else launch(chunked_mlp_kernel<T, false>);
}

}  // namespace

size_t chunked_smem_bytes(int64_t F, int64_t element_size) {
  static_assert(8 * kCountBuckets<__nv_bfloat16> * (sizeof(unsigned long long) + sizeof(int)) +
                        kChunkThreads * sizeof(PieceOrder) <= 2 * kChunkThreads * 2 * sizeof(float4) &&
                    kChunkThreads * kPlanBytes<__nv_bfloat16> <= 2 * kChunkThreads * 2 * sizeof(float4),
                "a chunk's order, and then its plans, fit in the partials' space");
  return static_cast<size_t>(2 * (F + kZeroUnits) * kSlice * element_size) + 2 * kChunkThreads * 2 * sizeof(float4) +
         2 * sizeof(uint64_t) + 2 * sizeof(int64_t);
}

bool chunked_sparse_fits(int64_t K, int64_t F, int64_t D, int64_t element_size, bool gated) {
  return F >= 1 && (F + kZeroUnits) * 8 <= 0x10000 && D % kSlice == 0 && (!gated || K % kSlice == 0) &&
         chunked_smem_bytes(F, element_size) <= current_device_optin_smem();
}

int64_t chunked_heavy_capacity(int64_t M, int64_t thr_heavy) {
  TORCH_CHECK(M >= 0 && thr_heavy >= 0, "twell: bad heavy-row capacity arguments");
  const int64_t n_blocks = (M + kDecisionRows - 1) / kDecisionRows;
  return thr_heavy >= kDecisionRows ? M : std::min(M, n_blocks * thr_heavy);
}

void chunked_sparse_mlp_out(const c10::optional<at::Tensor>& x, const at::Tensor& packed, const at::Tensor& counts,
                            const at::Tensor& dense, const c10::optional<at::Tensor>& w_up_sliced,
                            const c10::optional<at::Tensor>& b_up, const at::Tensor& w_down_sliced,
                            const c10::optional<at::Tensor>& b_down, at::Tensor& out, at::Tensor& decided,
                            const at::Tensor& heavy_rows, const at::Tensor& counters, int64_t tile_n,
                            int64_t thr_full, int64_t thr_last, int64_t thr_heavy, int64_t ctas) {
  const bool gated = w_up_sliced.has_value();
  TORCH_CHECK(ctas >= 1, "twell: ctas must be positive");
  const int64_t M = out.size(0), D = out.size(1);
  TORCH_CHECK(!gated || x.has_value(), "twell: the gated chunked kernel needs x");
  TORCH_CHECK(out.is_cuda() && out.is_contiguous() && out.dim() == 2, "twell: out must be a contiguous CUDA matrix");
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.is_contiguous() && packed.dim() == 3 && packed.size(0) == M,
              "twell: packed must be a contiguous int32 [M, tiles, cap] tensor");
  TORCH_CHECK(counts.scalar_type() == at::kInt && counts.is_contiguous() && counts.size(0) == M &&
                  counts.size(1) == packed.size(1), "twell: counts must be int32 [M, tiles]");
  TORCH_CHECK(w_down_sliced.dim() == 3 && w_down_sliced.is_contiguous() && w_down_sliced.size(2) == kSlice &&
                  w_down_sliced.size(0) * kSlice == D && w_down_sliced.scalar_type() == out.scalar_type(),
              "twell: w_down_sliced must be [D / 8, F, 8] in out's dtype");
  const int64_t F = w_down_sliced.size(1);
  TORCH_CHECK(dense.is_contiguous() && dense.size(0) == M && dense.size(1) == F, "twell: dense must be [M, F]");
  TORCH_CHECK(tile_n >= 1 && tile_n <= 256 && packed.size(1) == (F + tile_n - 1) / tile_n, "twell: bad tile_n");
  TORCH_CHECK(M <= 0x7fffffff, "twell: too many rows");
  TORCH_CHECK(thr_full >= 0 && thr_last >= 0 && thr_heavy >= 0 && thr_full <= INT32_MAX && thr_last <= INT32_MAX &&
                  thr_heavy <= INT32_MAX, "twell: bad thresholds");
  // Writes the decision in block_nnz's layout, so check it as one.
  check_block_nnz(decided, M, out.device());
  TORCH_CHECK(heavy_rows.scalar_type() == at::kInt && heavy_rows.device() == out.device() &&
                  heavy_rows.numel() >= chunked_heavy_capacity(M, thr_heavy) && counters.scalar_type() == at::kInt &&
                  counters.device() == out.device() && counters.is_contiguous() && counters.numel() == 2,
              "twell: heavy_rows must be int32 [chunked_heavy_capacity(M, thr_heavy)] and counters int32 [2]");
  if (gated) {
    TORCH_CHECK(x->is_contiguous() && x->size(0) == M && aligned16(x->data_ptr()) && x->scalar_type() == out.scalar_type(),
                "twell: x must be contiguous, 16-byte aligned, in out's dtype");
    TORCH_CHECK(w_up_sliced->dim() == 3 && w_up_sliced->is_contiguous() && w_up_sliced->size(0) * kSlice == x->size(1) &&
                    w_up_sliced->size(1) == F && w_up_sliced->size(2) == kSlice,
                "twell: w_up_sliced must be [K / 8, F, 8]");
  }
  TORCH_CHECK(aligned16(out.data_ptr()) && aligned16(w_down_sliced.data_ptr()) && (!gated || aligned16(w_up_sliced->data_ptr())) &&
                  (!b_down.has_value() || (b_down->is_contiguous() && aligned16(b_down->data_ptr()))),
              "twell: the chunked kernel's operands must be 16-byte aligned");
  TORCH_CHECK(chunked_sparse_fits(gated ? x->size(1) : 0, F, D, out.element_size(), gated),
              "twell: this shape does not fit the chunked sparse kernel (F = ", F, ")");
  if (M == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  // Entries the chunks can hold: rows of at most kChunkMaxRowEntries, in sparse blocks (each at most
  // its threshold's active units).
  const int64_t n_blocks = (M + kDecisionRows - 1) / kDecisionRows;
  const int64_t max_entries =
      std::max<int64_t>(1, std::min<int64_t>(M * kChunkMaxRowEntries, (n_blocks - 1) * thr_full + thr_last));
  TORCH_CHECK(max_entries < (int64_t{1} << 31), "twell: too many entries for the chunked kernel");
  const int max_heavy = static_cast<int>(std::min<int64_t>(thr_heavy, kDecisionRows));
  if (out.scalar_type() == at::kBFloat16) {
    run_chunked<__nv_bfloat16>(x, packed, counts, dense, w_up_sliced, b_up, w_down_sliced, b_down, out, decided,
                               heavy_rows, counters, tile_n, static_cast<int>(thr_full), static_cast<int>(thr_last),
                               max_heavy, ctas, max_entries);
  } else if (out.scalar_type() == at::kHalf) {
    run_chunked<__half>(x, packed, counts, dense, w_up_sliced, b_up, w_down_sliced, b_down, out, decided, heavy_rows,
                        counters, tile_n, static_cast<int>(thr_full), static_cast<int>(thr_last), max_heavy, ctas,
                        max_entries);
  } else {
    TORCH_CHECK(false, "twell: the CUDA kernels take bfloat16 or float16, got ", out.scalar_type());
  }
}

}  // namespace twell
