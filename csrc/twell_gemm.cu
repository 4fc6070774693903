// The wgmma GEMM engine of the TwELL path, hand-written for Hopper (sm_90a): TMA loads, wgmma, warp
// specialisation, persistent CTAs. C = A B^T (+ bias) for A [M, K] and B [N, K], both K-major (as
// activations and nn.Linear weights are stored), fp32 accumulation, with one of three epilogues:
//
// * TwELL pack (the gate GEMM; the up GEMM of a non-gated block): relu(x W^T + b) is never written
//   densely. Per (row, 128-wide N-tile), straight from the accumulator registers:
//     counts[row, tile]        the true number of active units (value > 0, or NaN as eager propagates);
//     packed[row, tile, slot]  for count <= cap: one word per active unit, value bits << 16 | column;
//     dense[row, tile cols]    for count > cap: the tile's row of rounded pre-activations (readers apply
//                              the ReLU), so an overflowing tile is still exact;
//     block_nnz[blk], block_nnz[n_blocks + blk]   per 128-row block, active units and row-tiles past cap
//                              (one atomic per warp), which decide the block's sparse or dense path.
// * Gate times up (dense path, gated): h = g * round(x W_up^T + b), written over `dense`, with g read
//   straight from the gate's TwELL output (slots, or the backup row of a tile past capacity).
// * Store (dense path, down projection): out = round(h W_down^T + b).
// The dense-path epilogues run only the tiles of 128-row blocks the device-side test marks dense; the
// others are skipped without loading anything, so the host never needs to know which blocks they are.
//
// CTA = 3 warpgroups (4 in the staged schedule, below). Warpgroup 0 is the producer: one thread streams
// (A, B) K-slices into a ring of shared-memory stages with TMA. Warpgroups 1 and 2 are consumers, each
// owning 128 output rows by 128 columns (two m64n128k16 wgmma chains), in one of three schedules:
// * ping-pong (tile_m 128): the consumers take alternate 128 x 128 tiles; while one runs its epilogue,
//   the other's MMAs run, so the epilogue hides behind the tensor cores. A consumer starts waiting for
//   its tile's K-slices only once the other has received all of its own ("turn" barriers): the
//   mainloops then run one after the other, and no consumer waits on a ring stage more than one phase
//   ahead (mbarrier parity waits cannot tell phases two apart). The GEMMs use it where there are too
//   few 256-row tiles for the staged schedule.
// * cooperative, staged (tile_m 256, the default of all three GEMMs: TWELL_GATE_GEMM_TILE_M,
//   TWELL_GEMM_TILE_M, TWELL_DOWN_GEMM_TILE_M): both consumers work on one 256 x 128 tile (rows
//   0-127 and 128-255), so the B slice serves twice the rows and the L2 traffic per output falls. The
//   consumers only add the bias and round the tile into shared memory (stage_tile), then go on to the
//   next tile's MMAs, while a fourth warpgroup packs the staged tile (pack_staged) or, on the dense
//   path, writes it out (write_staged): the epilogue does not leave the tensor cores idle. The staged
//   tile (68 KB) leaves room for 3 ring stages. H100, 2B gate at M = 131072 with a bias: 4.75-5.02 ms
//   against 5.22-5.84 ms for ping-pong pairs, cuBLAS 4.2-4.35 ms; with staging and packing skipped the
//   same kernel ran at cuBLAS's pace (4.0-4.4 ms), so they are what is left between them. The packer's
//   first form (a warp per row) could not keep up with the MMAs (5.7-6.0 ms).
//   On the dense path (H100, 2026-11-25, every block dense, torch.profiler): the down projection took
//   462-467 us at M = 16384 against 477 with the epilogue in the consumers; the gate-times-up GEMM 558 us
//   against 633-636 for ping-pong, and 4.41-4.55 against 5.03-5.05 ms per call at M = 131072. Its
//   writer first read the gate with 16 lanes per row, each lane all of the row's slots: 670 us, slower
//   than ping-pong. Now a thread per row loads its gate before the tile arrives (gate_row_in_place).
//   The tile changes hands on two mbarriers (staged_full, staged_free) on which every thread of the
//   writing side arrives: with a named-barrier hand-off (bar.arrive / bar.sync) racecheck reported
//   hazards between the staging writes and the packer's reads; with the mbarriers it reports none
//   (H100, 2026-11-23).
//   On the dense path a 256-row tile runs if either of its blocks is dense; a consumer whose block is
//   sparse (or past the end) only receives and releases the stages, without MMAs, and the writer
//   leaves its rows alone.
// The dense-path kernels read the per-block test once per CTA into a shared bitmap, and a CTA exits at
// once when no block is dense. They walk only the row tiles that hold a dense block (TileWalk).
//
// Where there are enough tiles, CTAs run in clusters of 2 that compute horizontally adjacent tiles (the
// same rows, columns pn and pn + 1) in lockstep: each loads half of the shared A tile, multicast into
// both, and its own B tile, so A's share of the L2 traffic halves. Both CTAs of a pair own the same
// 128-row block, so the dense-path filter keeps or skips their tiles alike. This matters because these
// GEMMs are power-bound on an H200: single CTAs on 128 x 128 tiles moved 46-55 GB through L2 for the 2B
// gate against cuBLAS's 23 GB (Nsight Compute), drew more power and ran at a lower SM clock (1396 against
// 1523 MHz); pairs cut the traffic to 40 GB.
//
// Where the output tiles are fewer than the SMs and K is long (small M: the 2B dense path's down
// projection), each tile's K may be split over several CTAs (sum_split_partials; choose_k_split in
// twell_entries.h): fp32 partial tiles parked in a workspace, summed in a fixed order by the last range.
// The dense-path GEMMs in ping-pong also split K by themselves where their dense tiles are few
// (TileWalk::split_for_idle_ctas, adaptive_split_room): the host cannot know how many are dense, the
// CTAs can. A result's bits then depend on how many of the call's tiles are dense, as they already
// depend on M through choose_k_split; they do not change from run to run.
//
// The epilogues need no shared memory: in the wgmma accumulator layout a row's 128 columns sit in the 4
// lanes of a quad (32 each), so a row's count and each lane's slot offset are a popcount and two shuffles.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "cluster_launch.cuh"
#include "dense_block_test.cuh"
#include "dtype16.cuh"
#include "hopper_ptx.cuh"
#include "twell_entries.h"

namespace twell {
namespace {

constexpr int kBlockM = kDecisionRows;  // one consumer's rows: they lie in exactly one decision block
constexpr int kBlockN = 128;  // = the TwELL tile
constexpr int kBlockK = 64;   // 64 x 2 bytes = one 128-byte swizzle row
static_assert(kBlockM == kGemmTile && kBlockN == kGemmTile && kBlockK == kGemmSliceK, "twell_entries.h's K split");
constexpr int kRingBytes = 192 * 1024;
constexpr int kMaxStages = 6;
constexpr int kBitmapBlocks = 65536;  // dense-block bitmap: 8 KB of shared memory
// Dense-path GEMMs of at most kCompactWalkBlocks blocks (twell_entries.h) walk only their dense row
// tiles: every thread counts them at the start and finds each unit's row tile by scanning the bitmap,
// at most 256 words.
static_assert(kCompactWalkBlocks <= kBitmapBlocks, "the compact walk reads the bitmap");
constexpr int kBarrierBytes = (2 * kMaxStages + 4) * 8;

enum class Epilogue { kTwellPack, kGateTimesUp, kStore };

// The schedules (see the file comment): ping-pong, 128 x 128 tiles that the consumers take in turn;
// cooperative, 256 x 128 tiles that both consumers share (rows 0-127 and 128-255), half the A traffic
// per output. The cooperative schedule is staged: the consumers round the tile into shared memory and
// go on to the next tile's MMAs while a fourth warpgroup packs it (pack_staged) or writes it out
// (write_staged), so the epilogue is not exposed; the ring then has 3 stages, to leave room for the
// staged tile.
template <Epilogue kMode, int kTileM>
struct Schedule {
  static_assert(kTileM == 128 || kTileM == 256, "ping-pong or cooperative");
  static constexpr bool kCoop = kTileM == 256;  // and so staged: a fourth warpgroup, the staged tile
  static constexpr int kThreads = kCoop ? 512 : 384;
  static constexpr int kBlocksPerTile = kTileM / kBlockM;
  static constexpr int kATileBytes = kTileM * kBlockK * 2;
  static constexpr int kBTileBytes = kBlockN * kBlockK * 2;
  static constexpr int kStageBytes = kATileBytes + kBTileBytes;
  static constexpr int kStages = kCoop ? 3 : kRingBytes / kStageBytes;  // 3, or 6 (ping-pong)
  static constexpr int kStageRingBytes = kStages * kStageBytes;
  // A staged row: 128 16-bit values and 16 bytes of padding, so that the 8 rows a consumer warp writes
  // at once fall in different banks.
  static constexpr int kStagedRowBytes = kBlockN * 2 + 16;
  static constexpr int kStagedBytes = kCoop ? kTileM * kStagedRowBytes : 0;
  static constexpr int kReleasingWarps = kCoop ? 8 : 4;            // consumer warps that read each stage
  static constexpr int kSmemBytes =
      kStageRingBytes + kStagedBytes + 1024 /* alignment */ + kBarrierBytes + kBitmapBlocks / 8;
  static_assert(kStages <= kMaxStages && kStageRingBytes <= kRingBytes, "ring");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;  // 2 x 128 x 232 + 128 x 40 <= 64K registers (ping-pong)
// Staged schedule: 128 x (40 + 72 + 2 x 200) = 64K registers (the packer spilled at 56).
constexpr int kStagedPackerRegs = 72;
constexpr int kStagedConsumerRegs = 200;
// The staged schedule's hand-off mbarriers: every thread of the writing side arrives (the consumers'
// 256 on staged_full, the packer's 128 on staged_free), so each thread's own shared-memory accesses are
// released to the waiting side, which acquires them with its parity wait.
constexpr uint32_t kStagedFullArrivals = 2 * 128;
constexpr uint32_t kStagedFreeArrivals = 128;

// Grouped tile order: CTAs running at the same time share x row-blocks and W column-blocks in L2.
__device__ __forceinline__ void tile_coords(int tile, int n_tiles_m, int n_tiles_n, int group_m, int& pm, int& pn) {
  const int in_group = group_m * n_tiles_n;
  const int first_m = (tile / in_group) * group_m;
  const int rows_in_group = min(n_tiles_m - first_m, group_m);
  const int r = tile % in_group;
  pm = first_m + r % rows_in_group;
  pn = r / rows_in_group;
}

// Which row tiles of the dense-path GEMMs hold a dense block: bit t of tile word w is row tile 32 w + t,
// made from the CTA's dense-block bitmap (`block_words` words; kBlocksPerTile blocks per tile).
template <int kBlocksPerTile>
__device__ __forceinline__ uint32_t dense_tile_word(const uint32_t* bits, int block_words, int w) {
  static_assert(kBlocksPerTile == 1 || kBlocksPerTile == 2, "128- or 256-row tiles");
  if constexpr (kBlocksPerTile == 1) {
    return bits[w];
  } else {
    // Tile t holds blocks 2t and 2t + 1: OR each pair of bits, then gather the even bits.
    uint32_t halves[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t x = 2 * w + h < block_words ? bits[2 * w + h] : 0u;
      x = (x | (x >> 1)) & 0x55555555u;
      x = (x | (x >> 1)) & 0x33333333u;
      x = (x | (x >> 2)) & 0x0f0f0f0fu;
      x = (x | (x >> 4)) & 0x00ff00ffu;
      halves[h] = (x | (x >> 8)) & 0x0000ffffu;
    }
    return halves[0] | (halves[1] << 16);
  }
}

// The work a persistent CTA does: units strided over the grid in grouped order. With 2-CTA clusters a
// unit is a pair of horizontally adjacent tiles, one per CTA of the cluster (rank 0 the left). With K
// split in `splits` ranges of `split_steps` K-slices (the last maybe shorter), a unit is one range of
// one tile (pair); the ranges of a tile are adjacent units.
// The dense-path GEMMs walk only the row tiles that hold a dense block (compact_to_dense_tiles), so the
// CTAs share those tiles evenly. Walking every tile and skipping the sparse ones left the busiest CTA
// pair with about twice the mean of the dense tiles where dense blocks recur regularly (every 8th block:
// with 8-tile groups and a stride of 66 pairs, half the pairs got none), 1.2-2.3x with random ones
// (simulated for 4096-16384 rows at the 2B shape).
template <int kCluster>
struct TileWalk {
  int first, stride, n_tiles_m, n_tiles_n, group_m, rank, splits, split_steps, k_steps;
  const uint32_t* dense_bits = nullptr;  // compacted walk: the dense-block bitmap (else every row tile)
  int block_words = 0, tile_words = 0;
  __device__ __forceinline__ TileWalk(int n_tiles_m_, int n_tiles_n_, int group_m_, int splits_, int split_steps_,
                                      int k_steps_)
      : first(static_cast<int>(blockIdx.x) / kCluster),
        stride(static_cast<int>(gridDim.x) / kCluster),
        n_tiles_m(n_tiles_m_),
        n_tiles_n(n_tiles_n_),
        group_m(group_m_),
        rank(kCluster == 1 ? 0 : static_cast<int>(ptx::cluster_ctarank())),
        splits(splits_),
        split_steps(split_steps_),
        k_steps(k_steps_) {}
  // From here on the walk's row tiles are the dense ones, in order (n_tiles_m becomes their count). Every
  // thread of the CTA (and of its cluster: the bitmaps are the same) computes the same walk.
  template <int kBlocksPerTile>
  __device__ __forceinline__ void compact_to_dense_tiles(const uint32_t* bits, int n_blocks) {
    dense_bits = bits;
    block_words = (n_blocks + 31) / 32;
    tile_words = (block_words + kBlocksPerTile - 1) / kBlocksPerTile;
    int dense_tiles = 0;
    for (int w = 0; w < tile_words; ++w) dense_tiles += __popc(dense_tile_word<kBlocksPerTile>(bits, block_words, w));
    n_tiles_m = dense_tiles;
  }
  // Few dense tiles (dense-path GEMMs given room for it, adaptive_split_room): split K the way
  // choose_k_split would for that many tiles, at most `room` partial tiles in all. Every CTA reaches the
  // same choice, as it does the same walk.
  __device__ __forceinline__ void split_for_idle_ctas(int room) {
    const int tiles = n_tiles_m * units_n() * kCluster;  // the CTAs' tiles, a pair's missing one included
    if (tiles == 0) return;
    const int ranges = min(min(kMaxKSplits, k_steps / kMinSplitSteps), min(static_cast<int>(gridDim.x), room) / tiles);
    if (ranges < 2) return;
    split_steps = (k_steps + ranges - 1) / ranges;
    splits = (k_steps + split_steps - 1) / split_steps;
  }
  __device__ __forceinline__ int units_n() const { return (n_tiles_n + kCluster - 1) / kCluster; }
  __device__ __forceinline__ int n_units() const { return n_tiles_m * units_n() * splits; }
  // The unit's output tile among the walk's (row rank, column): a K split's partial-tile and counter
  // index, below n_tiles_m * n_tiles_n (for the compact walk, the dense tiles only) for every real tile.
  // A pair's missing last tile would index the next row's first: callers skip it first (real()).
  __device__ __forceinline__ int split_tile(int unit) const {
    int pm, spn;
    tile_coords(unit / splits, n_tiles_m, units_n(), group_m, pm, spn);
    return pm * n_tiles_n + spn * kCluster + rank;
  }
  template <int kBlocksPerTile = 1>
  __device__ __forceinline__ void coords(int unit, int& pm, int& pn, int& split) const {
    int spn;
    split = unit % splits;
    tile_coords(unit / splits, n_tiles_m, units_n(), group_m, pm, spn);
    pn = spn * kCluster + rank;
    if (dense_bits != nullptr) pm = dense_tile<kBlocksPerTile>(pm);
  }
  // The row tile of the dense ones' rank-th (0-based).
  template <int kBlocksPerTile>
  __device__ __forceinline__ int dense_tile(int rank_) const {
    for (int w = 0; w < tile_words; ++w) {
      const uint32_t word = dense_tile_word<kBlocksPerTile>(dense_bits, block_words, w);
      const int count = __popc(word);
      if (rank_ < count) return 32 * w + static_cast<int>(__fns(word, 0u, rank_ + 1));
      rank_ -= count;
    }
    return 0;  // not reached: rank_ < n_tiles_m
  }
  // The unit's K-slices: [first_step, first_step + steps).
  __device__ __forceinline__ int first_step(int split) const { return split * split_steps; }
  __device__ __forceinline__ int steps(int split) const { return min(split_steps, k_steps - split * split_steps); }
  // The last cluster's last ranks may be past the last column tile: they still load (their peers need
  // their share of A) but store nothing.
  __device__ __forceinline__ bool real(int pn) const { return kCluster == 1 || pn < n_tiles_n; }
};

// Keeps the compiler from moving accumulator registers while wgmma owns them.
__device__ __forceinline__ void fence_operands(float (&acc)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

struct EpilogueArgs {
  const void* bias;  // [N] or null
  void* c;           // [M, N]: the overflow backup (pack), g in / h out (gate times up), out (store)
  uint32_t* packed;  // pack: written; gate times up: the gate read from it
  int* counts;       // likewise
  int* block_nnz;    // written by pack, read by the dense-path epilogues
  // K split: the partial tiles, [tiles, ranges, 32, 128] float4, and per tile the K ranges done so far
  // (zero on entry). Tiles are TileWalk::split_tile's: n_tiles_m * n_tiles_n of them for a split the
  // host chose (k_splits > 1), fewer than split_room for an adaptive one.
  float4* split_partials;
  int* split_arrivals;
  int k_splits, split_steps;  // K ranges per tile (1: no split) and K-slices per range
  // Adaptive K split (k_splits 1; TileWalk::split_for_idle_ctas): the partial tiles split_partials
  // holds and the counters split_arrivals has, indexed by the dense tiles; 0: no such split.
  int split_room;
  int M, N, n_tiles_n, cap;
  bool slots_vec8;            // gate times up: cap >= 8, cap % 4 == 0 and packed 16-byte aligned
  DenseBlockTest dense_test;  // dense-path epilogues only
};

// The dense-path kernels' tile filter: the per-block test, read once per CTA into a shared bitmap so
// the tile loops test a bit rather than load global memory per tile.
struct BlockFilter {
  const uint32_t* bits;  // dense blocks; null when there are more blocks than the bitmap holds
  DenseBlockTest test;
  __device__ __forceinline__ bool dense(int blk) const {
    return bits != nullptr ? (bits[blk >> 5] >> (blk & 31)) & 1u : test(blk);
  }
  // A tile of kBlocks decision blocks (pm-th such run) is computed if any of its blocks is dense.
  template <int kBlocks>
  __device__ __forceinline__ bool any_dense(int pm) const {
    bool any = false;
#pragma unroll
    for (int i = 0; i < kBlocks; ++i) {
      const int blk = pm * kBlocks + i;
      any |= blk < test.n_blocks && dense(blk);
    }
    return any;
  }
};

// All threads of the CTA: fills `bits` from the test and returns nonzero if any block is dense (or the
// bitmap cannot hold them all). A barrier must follow before `bits` is read.
__device__ __forceinline__ int fill_block_bits(const DenseBlockTest& test, uint32_t* bits) {
  if (test.n_blocks > kBitmapBlocks) return 1;
  const int lane = threadIdx.x % 32;
  int any = 0;
  for (int base = static_cast<int>(threadIdx.x / 32) * 32; base < test.n_blocks; base += static_cast<int>(blockDim.x)) {
    const bool dense = base + lane < test.n_blocks && test(base + lane);
    const uint32_t word = __ballot_sync(0xffffffffu, dense);
    if (lane == 0) bits[base / 32] = word;
    any |= word != 0;
  }
  return any;
}

// Packs the 64 rows one accumulator chain holds (rows r0 and r0 + 8 of this thread, see hopper_ptx.cuh).
// Returns this thread's share of the tile's active units and overflowed rows (lanes with lane % 4 == 0
// report their rows).
template <typename T>
__device__ __forceinline__ void pack_rows(const float (&acc)[64], int row0, int tile,
                                          int cols_left, int lane, const EpilogueArgs& args, int& nnz,
                                          int& overflowed) {
  const int lq = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + 8 * half;
    const bool row_ok = row < args.M;
    uint32_t mask = 0;
#pragma unroll
    for (int b = 0; b < 32; ++b) {
      const int col = (b >> 1) * 8 + lq * 2 + (b & 1);
      const float v = Dtype16<T>::value(Dtype16<T>::bits(acc[4 * (b >> 1) + 2 * half + (b & 1)]));
      const bool active = is_active(v) && col < cols_left;
      mask |= static_cast<uint32_t>(active) << b;
    }
    if (!row_ok) mask = 0;
    // Offsets inside the row: lanes of a quad in order, each lane's units in column order.
    const int mine = __popc(mask);
    int incl = mine;
    int up = __shfl_up_sync(0xffffffffu, incl, 1, 4);
    if (lq >= 1) incl += up;
    up = __shfl_up_sync(0xffffffffu, incl, 2, 4);
    if (lq >= 2) incl += up;
    const int total = __shfl_sync(0xffffffffu, incl, 3, 4);
    const int first = incl - mine;
    if (row_ok) {
      const int64_t row_tile = static_cast<int64_t>(row) * args.n_tiles_n + tile;
      if (lq == 0) args.counts[row_tile] = total;
      if (total <= args.cap) {
        uint32_t* slots = args.packed + row_tile * args.cap;
#pragma unroll
        for (int b = 0; b < 32; ++b) {
          if (mask & (1u << b)) {
            const uint32_t bits = Dtype16<T>::bits(acc[4 * (b >> 1) + 2 * half + (b & 1)]);
            const uint32_t col = (b >> 1) * 8 + lq * 2 + (b & 1);
            slots[first + __popc(mask & ((1u << b) - 1u))] = (bits << 16) | col;
          }
        }
      } else {  // rare: the row's whole tile (pre-activation, rounded) goes to the backup
        uint16_t* dense_row = static_cast<uint16_t*>(args.c) + static_cast<int64_t>(row) * args.N +
                              static_cast<int64_t>(tile) * kBlockN;
#pragma unroll
        for (int b = 0; b < 32; ++b) {
          const int col = (b >> 1) * 8 + lq * 2 + (b & 1);
          if (col < cols_left)
            dense_row[col] = static_cast<uint16_t>(Dtype16<T>::bits(acc[4 * (b >> 1) + 2 * half + (b & 1)]));
        }
      }
    }
    if (lq == 0) {
      nnz += total;
      overflowed += total > args.cap;
    }
  }
}

// relu on two packed 16-bit values.
template <typename T>
__device__ __forceinline__ uint32_t relu_pair(uint32_t pair) {
  const uint32_t lo = pair & 0xffffu, hi = pair >> 16;
  return (is_active(Dtype16<T>::value(lo)) ? lo : 0u) | (is_active(Dtype16<T>::value(hi)) ? hi << 16 : 0u);
}

// Gate times up: what one load round trip brings of a (row, TwELL tile)'s gate: its count and, when
// the layout allows (slots_vec8), its first 8 slots, loaded before it is known how many are live (they
// always lie inside the row-tile's cap slots).
struct GateHead {
  int count;
  uint32_t first[8];
};

__device__ __forceinline__ void load_gate_head(int64_t row, int tile, const EpilogueArgs& args, GateHead& head) {
  const int64_t row_tile = row * args.n_tiles_n + tile;
  if (args.slots_vec8) {
    const uint32_t* slots = args.packed + row_tile * args.cap;
    const uint4 lo = *reinterpret_cast<const uint4*>(slots);
    const uint4 hi = *reinterpret_cast<const uint4*>(slots + 4);
    head.first[0] = lo.x, head.first[1] = lo.y, head.first[2] = lo.z, head.first[3] = lo.w;
    head.first[4] = hi.x, head.first[5] = hi.y, head.first[6] = hi.z, head.first[7] = hi.w;
  }
  head.count = args.counts[row_tile];
}

// Gate times up: this thread's 32 gate values of one (row, TwELL tile), as 16 pairs of 16-bit values
// (columns 8 q + 2 lq + {0, 1}), straight from the gate kernel's output: the packed slots, or for a
// tile past capacity the backup row in `c` (pre-activations, relu applied here). No pass expands the
// gate densely first.
template <typename T>
__device__ __forceinline__ void load_gate(int64_t row, int tile, int cols_left, int lq, bool pairs,
                                          const EpilogueArgs& args, const GateHead& head, uint32_t (&g)[16]) {
  const int64_t row_tile = row * args.n_tiles_n + tile;
  const uint32_t* slots = args.packed + row_tile * args.cap;
  const int count = head.count;
  if (count > args.cap) {
    const uint16_t* c_row = static_cast<const uint16_t*>(args.c) + row * args.N + static_cast<int64_t>(tile) * kBlockN;
#pragma unroll
    for (int q = 0; q < 16; ++q) {
      const int col = q * 8 + lq * 2;
      if (pairs && col + 1 < cols_left) {
        g[q] = *reinterpret_cast<const uint32_t*>(c_row + col);
      } else {
        g[q] = (col < cols_left ? c_row[col] : 0u) | (col + 1 < cols_left ? static_cast<uint32_t>(c_row[col + 1]) << 16 : 0u);
      }
    }
#pragma unroll
    for (int q = 0; q < 16; ++q) g[q] = relu_pair<T>(g[q]);
  } else {
#pragma unroll
    for (int q = 0; q < 16; ++q) g[q] = 0u;
    for (int s0 = 0; s0 < count; s0 += 8) {  // 8 slots at a time, loaded together
      uint32_t words[8];  // those past the count are never read (the loop below stops there)
#pragma unroll
      for (int i = 0; i < 8; ++i)
        words[i] = s0 == 0 && args.slots_vec8 ? head.first[i] : (s0 + i < count ? slots[s0 + i] : 0u);
      // Only the live words (most row-tiles hold 0 to 2 at the sparsities TwELL is for): the unrolled
      // scatter below costs about 50 instructions a word.
#pragma unroll
      for (int i = 0; i < 8; ++i) {  // value bits << 16 | column in tile; this lane's columns only
        if (s0 + i >= count) break;
        const int col = static_cast<int>(words[i] & 0xffffu);
        const bool mine = col < kBlockN && ((col >> 1) & 3) == lq;
        const uint32_t v = mine ? (words[i] >> 16) << (16 * (col & 1)) : 0u;
        // Static register indices only (an indexed store would put g in local memory).
#pragma unroll
        for (int q = 0; q < 16; ++q) g[q] |= (q == (col >> 3)) ? v : 0u;
      }
    }
  }
}

// Gate times up: started when a consumer begins a tile's mainloop, so that its epilogue finds the gate
// (count, slots, backup row) in L2 rather than waiting on device memory. One row per consumer thread.
// The count is loaded (not only prefetched): halfway through the mainloop, when it has long arrived,
// the backup row is prefetched only if the tile is past capacity. Prefetching every backup row read
// the whole [M, N] buffer from DRAM for the few tiles that need it (Nsight Compute, H100, 2B shape,
// M = 131072, skewed data on the dense path: 5.59 ms at 2.24 TB/s of DRAM traffic and L2 at 92% of
// its peak, against 4.79 ms, 1.17 TB/s and 85% for the gate GEMM of the same shape). After the change
// it took 5.45 against 5.63 ms (torch.profiler, one run each: within the run-to-run spread).
__device__ __forceinline__ int prefetch_gate(int first_row, int tile, int t, const EpilogueArgs& args) {
  const int row = first_row + t;
  if (row >= args.M) return 0;
  const int64_t row_tile = static_cast<int64_t>(row) * args.n_tiles_n + tile;
  ptx::prefetch_l2(args.packed + row_tile * args.cap);
  return args.counts[row_tile];
}

__device__ __forceinline__ void prefetch_backup(int first_row, int tile, int t, int count, const EpilogueArgs& args) {
  if (count <= args.cap) return;  // (also rows past the end: count 0)
  const uint16_t* c_row = static_cast<const uint16_t*>(args.c) + static_cast<int64_t>(first_row + t) * args.N +
                          static_cast<int64_t>(tile) * kBlockN;
  ptx::prefetch_l2(c_row);
  if (tile * kBlockN + 64 < args.N) ptx::prefetch_l2(c_row + 64);  // the row's second 128-byte line
}

// Dense-path epilogues for the 64 rows one accumulator chain holds: h = g * round(acc) (kGateTimesUp,
// g from load_gate, h written over `c`), or c = round(acc) (kStore). Bias is already folded into acc.
// The gate heads of both rows were loaded before the first store, so the stores (which may alias the
// backup) do not put a round trip to L2 between one row and the next.
template <typename T, Epilogue kMode>
__device__ __forceinline__ void store_rows(const float (&acc)[64], int row0, int tile, int cols_left, int lane,
                                           const EpilogueArgs& args, const GateHead (&heads)[2]) {
  const int lq = lane & 3;
  const bool pairs = (args.N & 1) == 0;  // two adjacent columns as one 4-byte access
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + 8 * half;
    if (row >= args.M) continue;
    uint32_t g[16];
    if constexpr (kMode == Epilogue::kGateTimesUp) load_gate<T>(row, tile, cols_left, lq, pairs, args, heads[half], g);
    uint16_t* c_row = static_cast<uint16_t*>(args.c) + static_cast<int64_t>(row) * args.N +
                      static_cast<int64_t>(tile) * kBlockN;
#pragma unroll
    for (int q = 0; q < 16; ++q) {
      const int col = q * 8 + lq * 2;
      // Packed pairs throughout (one cvt, one multiply per two values): the epilogue's instruction count
      // decides whether it hides behind the other consumer's mainloop.
      uint32_t pair = Dtype16<T>::pair_bits(acc[4 * q + 2 * half], acc[4 * q + 2 * half + 1]);
      if constexpr (kMode == Epilogue::kGateTimesUp) pair = Dtype16<T>::mul_pairs(g[q], pair);
      if (pairs && col + 1 < cols_left) {
        *reinterpret_cast<uint32_t*>(c_row + col) = pair;
      } else {
        if (col < cols_left) c_row[col] = static_cast<uint16_t>(pair);
        if (col + 1 < cols_left) c_row[col + 1] = static_cast<uint16_t>(pair >> 16);
      }
    }
  }
}

// This thread's bias for its tile's columns 8 q + 2 (lane % 4) + {0, 1}, as 16 pairs of 16-bit values
// (lo in the low half; zero past N). The staged schedule loads them when the tile's mainloop starts and
// adds them in stage_tile: loaded in the epilogue, after the tile's last MMAs, the bias cost the staged
// gate 4.0% at the 2B shape, the consumers waiting out an L2 round trip per tile with the tensor cores
// idle (H100, 2026-11-25, M = 131072: 4125 us, against 3966 without a bias and 4011 loaded early).
// Ping-pong loads them in its epilogue (finish_chunk): held through its mainloop, they made its
// consumers spill 8-40 bytes.
__device__ __forceinline__ void load_bias_pairs(const EpilogueArgs& args, int tile, int lane, uint32_t (&pairs)[16]) {
  const int cols_left = args.N - tile * kBlockN, lq = lane & 3;
  const uint16_t* bias = static_cast<const uint16_t*>(args.bias) + tile * kBlockN;
  const bool aligned = (reinterpret_cast<uintptr_t>(args.bias) & 3u) == 0;  // every pair one 4-byte load
#pragma unroll
  for (int q = 0; q < 16; ++q) {
    const int col = q * 8 + lq * 2;
    if (aligned && col + 1 < cols_left) {
      pairs[q] = __ldg(reinterpret_cast<const uint32_t*>(bias + col));
    } else {
      const uint32_t lo = col < cols_left ? bias[col] : 0u, hi = col + 1 < cols_left ? bias[col + 1] : 0u;
      pairs[q] = lo | hi << 16;
    }
  }
}

// The epilogue of one accumulator chain: 64 rows (this thread's row0 and row0 + 8) by one 128-wide
// TwELL tile. Folds the bias in, then packs or stores; returns the pack's counts through nnz/overflowed.
template <typename T, Epilogue kMode>
__device__ __forceinline__ void finish_chunk(float (&acc)[64], int row0, int tile, int lane, const EpilogueArgs& args,
                                             const GateHead (&heads)[2], int& nnz, int& overflowed) {
  const int cols_left = args.N - tile * kBlockN;
  if (args.bias != nullptr) {  // each column's bias serves two accumulators (rows row0 and row0 + 8)
    uint32_t bias_pairs[16];
    load_bias_pairs(args, tile, lane, bias_pairs);
#pragma unroll
    for (int q = 0; q < 16; ++q) {
      const float lo = Dtype16<T>::value(bias_pairs[q] & 0xffffu), hi = Dtype16<T>::value(bias_pairs[q] >> 16);
      acc[4 * q] += lo;
      acc[4 * q + 2] += lo;
      acc[4 * q + 1] += hi;
      acc[4 * q + 3] += hi;
    }
  }
  if constexpr (kMode == Epilogue::kTwellPack) {
    pack_rows<T>(acc, row0, tile, cols_left, lane, args, nnz, overflowed);
  } else {
    store_rows<T, kMode>(acc, row0, tile, cols_left, lane, args, heads);
  }
}

// The pack epilogue's per-block totals: one atomic per warp and counter.
__device__ __forceinline__ void add_block_counts(int nnz, int overflowed, int block, int lane, const EpilogueArgs& args) {
  const int n_blocks = (args.M + kBlockM - 1) / kBlockM;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    nnz += __shfl_xor_sync(0xffffffffu, nnz, o);
    overflowed += __shfl_xor_sync(0xffffffffu, overflowed, o);
  }
  if (lane == 0) {
    if (nnz) atomicAdd(&args.block_nnz[block], nnz);
    if (overflowed) atomicAdd(&args.block_nnz[n_blocks + block], overflowed);
  }
}

// The shared-memory carve-up, the barriers and the tile filter. Returns false (for every thread of the
// CTA) when a dense-path kernel finds no dense block: nothing to do.
struct Smem {
  uint8_t* stages;
  uint64_t* full;   // [kStages] the producer's TMA bytes have landed
  uint64_t* empty;  // [kStages] the consuming warpgroup is done with the stage
  uint64_t* turn;   // [2] turn[c]: the other consumer has received its tile's last K-slice
  uint64_t* staged_full;  // staged schedule: the consumers have staged tile j (phase j)
  uint64_t* staged_free;  // staged schedule: the packer is done reading tile j (phase j)
  uint32_t* bits;         // dense-block bitmap
  uint8_t* staged;        // staged schedule: the tile the packer warpgroup packs, [kTileM][kStagedRowBytes]
};

template <Epilogue kMode, int kCluster, int kTileM>
__device__ __forceinline__ bool setup(uint8_t* smem_raw, const EpilogueArgs& args, Smem& sm, BlockFilter& filter) {
  sm.stages = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  using S = Schedule<kMode, kTileM>;
  sm.staged = sm.stages + S::kStageRingBytes;
  sm.full = reinterpret_cast<uint64_t*>(sm.staged + S::kStagedBytes);
  sm.empty = sm.full + S::kStages;
  sm.turn = sm.empty + S::kStages;
  sm.staged_full = sm.turn + 2;
  sm.staged_free = sm.turn + 3;
  sm.bits = reinterpret_cast<uint32_t*>(sm.turn + 4);
  if (threadIdx.x == 0) {
    for (int s = 0; s < S::kStages; ++s) {
      ptx::mbarrier_init(&sm.full[s], 1);  // the producer's expect_tx arrival (+ the TMA bytes)
      // one arrival per consumer warp that reads the stage, in each CTA it feeds
      ptx::mbarrier_init(&sm.empty[s], S::kReleasingWarps * kCluster);
    }
    for (int c = 0; c < 2; ++c) ptx::mbarrier_init(&sm.turn[c], 4);
    ptx::mbarrier_init(sm.staged_full, kStagedFullArrivals);
    ptx::mbarrier_init(sm.staged_free, kStagedFreeArrivals);
    ptx::fence_barrier_init();
  }
  filter.test = args.dense_test;
  filter.bits = args.dense_test.n_blocks <= kBitmapBlocks ? sm.bits : nullptr;
  bool work = true;
  if constexpr (kMode == Epilogue::kTwellPack) {
    if constexpr (kCluster == 1) __syncthreads();
  } else {  // both CTAs of a pair read the same block test, so they return (or not) together
    work = __syncthreads_or(fill_block_bits(args.dense_test, sm.bits)) != 0;
  }
  if constexpr (kCluster > 1) {
    if (work) ptx::cluster_sync();  // the peer's barriers are initialised before anything arrives on them
  }
  return work;
}

// Producer warpgroup: one thread streams each kept tile's K-slices of A and B. In a cluster, a stage is
// refilled once the consumers of both CTAs have released it (its empty barrier counts both), and this
// CTA's half of the A slice goes to both (the 128-byte swizzle repeats every 8 rows, so a half lands
// exactly where the whole tile's load would put it). TMA zero-fills rows past the end of A or B; a box
// wholly past the end is replaced by rows 0 (those results are never stored).
template <Epilogue kMode, int kCluster, int kTileM>
__device__ __forceinline__ void produce(const CUtensorMap* a_map, const CUtensorMap* b_map, const Smem& sm,
                                        const BlockFilter& filter, int rows, const TileWalk<kCluster>& walk) {
  using S = Schedule<kMode, kTileM>;
  ptx::setmaxnreg_dec<kProducerRegs>();
  if (threadIdx.x != 0) return;
  ptx::prefetch_tensor_map(a_map);
  ptx::prefetch_tensor_map(b_map);
  uint32_t it = 0;
  for (int unit = walk.first; unit < walk.n_units(); unit += walk.stride) {
    int pm, pn, split;
    walk.template coords<S::kBlocksPerTile>(unit, pm, pn, split);
    if (kMode != Epilogue::kTwellPack && !filter.any_dense<S::kBlocksPerTile>(pm)) continue;
    const int k_end = walk.first_step(split) + walk.steps(split);
    for (int ks = walk.first_step(split); ks < k_end; ++ks, ++it) {
      const uint32_t stage = it % S::kStages;
      ptx::mbarrier_wait(&sm.empty[stage], ((it / S::kStages) & 1) ^ 1);
      ptx::mbarrier_arrive_expect_tx(&sm.full[stage], S::kStageBytes);
      uint8_t* dst = sm.stages + stage * S::kStageBytes;
      if constexpr (kCluster == 1) {
        ptx::tma_load_2d(dst, a_map, &sm.full[stage], ks * kBlockK, pm * kTileM);
      } else {
        const int a_row = pm * kTileM + walk.rank * (kTileM / kCluster);
        ptx::tma_load_2d_multicast(dst + walk.rank * (S::kATileBytes / kCluster), a_map, &sm.full[stage],
                                   ks * kBlockK, a_row < rows ? a_row : 0, (1u << kCluster) - 1u);
      }
      ptx::tma_load_2d(dst + S::kATileBytes, b_map, &sm.full[stage], ks * kBlockK, walk.real(pn) ? pn * kBlockN : 0);
    }
  }
}

// A consumer warp is done with a ring stage (in a cluster, the peer's producer also waits for it: it
// multicasts into this CTA's copy of the stage).
template <int kCluster>
__device__ __forceinline__ void release_stage(const Smem& sm, uint32_t stage, int rank) {
  ptx::mbarrier_arrive(&sm.empty[stage]);
  if constexpr (kCluster == 2) ptx::mbarrier_arrive_cluster(&sm.empty[stage], static_cast<uint32_t>(rank ^ 1));
}

// acc += one chain's parked partial (16 float4 per thread, 128 apart), loaded all before the adds.
__device__ __forceinline__ void add_partial(float (&acc)[64], const float4* part) {
  float4 v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = __ldcg(part + i * 128);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    acc[4 * i] += v[i].x, acc[4 * i + 1] += v[i].y, acc[4 * i + 2] += v[i].z, acc[4 * i + 3] += v[i].w;
  }
}

// K split (small M, where the output tiles are too few for the SMs): each K range of a 128-row tile ends
// here with its fp32 partial sums in acc_top / acc_bottom. They are parked in global memory, each thread
// its 128 values as 32 float4 (coalesced across the warpgroup); the range that arrives last at the
// tile's counter then sums every range's partial in range order into acc (the same sum whichever
// arrives last, so results are deterministic) and returns true: it alone runs the epilogue. The counter
// is left at k_splits (the caller zeroes the counters per launch). Fence, barrier, counter, barrier,
// fence: the usual last-block pattern, with the warpgroup's named barrier standing for the CTA's.
__device__ __forceinline__ bool sum_split_partials(float (&acc_top)[64], float (&acc_bottom)[64], int tile, int split,
                                                  int splits, int consumer, int t, const EpilogueArgs& args) {
  __shared__ int finishes[2];  // per consumer warpgroup: whether its range is the tile's last
  constexpr int kVecs = 32;    // float4 per thread
  float4* partials = args.split_partials + static_cast<int64_t>(tile) * splits * kVecs * 128 + t;
  float4* mine = partials + static_cast<int64_t>(split) * kVecs * 128;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    mine[i * 128] = make_float4(acc_top[4 * i], acc_top[4 * i + 1], acc_top[4 * i + 2], acc_top[4 * i + 3]);
    mine[(16 + i) * 128] =
        make_float4(acc_bottom[4 * i], acc_bottom[4 * i + 1], acc_bottom[4 * i + 2], acc_bottom[4 * i + 3]);
  }
  __threadfence();
  ptx::named_barrier_sync(1 + consumer, 128);
  if (t == 0) finishes[consumer] = atomicAdd(&args.split_arrivals[tile], 1) == splits - 1;
  ptx::named_barrier_sync(1 + consumer, 128);
  if (!finishes[consumer]) return false;
  __threadfence();
  // Range 0 first, then the others added in order; L2 reads (__ldcg): other SMs wrote them.
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float4 v = __ldcg(partials + i * 128), w = __ldcg(partials + (16 + i) * 128);
    acc_top[4 * i] = v.x, acc_top[4 * i + 1] = v.y, acc_top[4 * i + 2] = v.z, acc_top[4 * i + 3] = v.w;
    acc_bottom[4 * i] = w.x, acc_bottom[4 * i + 1] = w.y, acc_bottom[4 * i + 2] = w.z, acc_bottom[4 * i + 3] = w.w;
  }
  for (int s = 1; s < splits; ++s) {
    const float4* part = partials + static_cast<int64_t>(s) * kVecs * 128;
    add_partial(acc_top, part);
    add_partial(acc_bottom, part + 16 * 128);
  }
  return true;
}

// Staged schedule, a consumer's side of its j-th tile: waits until the packer has read tile j - 1, then
// rounds its 128 rows (+ bias) to 16 bits into the staged tile, exactly as pack_rows rounds them, unless
// `write` is false (rows past the end, or a pair's column tile past the last: the packer skips those),
// and tells the packer the tile is there. The accumulator's layout is stmatrix's fragment layout: a
// warp's 8 x 8 blocks (rows 8 half + 0..7 of its 16, columns 8 q + 0..7) go out four per instruction.
template <typename T>
__device__ __forceinline__ void stage_tile(const float (&acc_top)[64], const float (&acc_bottom)[64],
                                           const uint32_t (&bias_pairs)[16], bool write, int j, int tile_row0,
                                           int warp, int lane, const EpilogueArgs& args, const Smem& sm) {
  using S = Schedule<Epilogue::kTwellPack, 256>;
  if (j > 0) ptx::mbarrier_wait(sm.staged_free, (j - 1) & 1);
  if (write) {
    // Lane l addresses row l % 8 of matrix l / 8 = (column block q + (l / 16), row half (l / 8) % 2).
    const int matrix = lane / 8;
    const uint32_t base = ptx::smem_addr(sm.staged) +
                          (tile_row0 + warp * 16 + 8 * (matrix % 2) + lane % 8) * S::kStagedRowBytes +
                          16 * (matrix / 2);
#pragma unroll
    for (int chain = 0; chain < 2; ++chain) {
      const float(&acc)[64] = chain == 0 ? acc_top : acc_bottom;
#pragma unroll
      for (int q = 0; q < 16; q += 2) {
        uint32_t pairs[4];  // (q, half 0), (q, half 1), (q + 1, half 0), (q + 1, half 1)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int qi = q + i / 2, half = i % 2;
          float lo = acc[4 * qi + 2 * half], hi = acc[4 * qi + 2 * half + 1];
          if (args.bias != nullptr) {  // this thread's columns' bias serves its four rows
            lo += Dtype16<T>::value(bias_pairs[qi] & 0xffffu);
            hi += Dtype16<T>::value(bias_pairs[qi] >> 16);
          }
          pairs[i] = Dtype16<T>::pair_bits(lo, hi);
        }
        ptx::stmatrix_x4(base + 64 * chain * S::kStagedRowBytes + 16 * q, pairs[0], pairs[1], pairs[2], pairs[3]);
      }
    }
  }
  ptx::mbarrier_arrive(sm.staged_full);
}

// Staged schedule: the fourth warpgroup packs each 256 x 128 tile the consumers staged, a thread per row
// (rows t and 128 + t), while they run the next tile's MMAs: the same counts, slots, backup rows and
// block totals as pack_rows, in pack_rows's slot order (a quad lane's columns 8 q + 2 lq + {0, 1} in
// column order, the quad's lanes in turn), so every schedule writes the same slots. A row's active
// units go into one mask per quad lane lq: bit q for column 8 q + 2 lq, bit 16 + q for the column after
// it; one packed compare tests two columns. (A warp per row, the tile's columns across the lanes,
// issued about ten times the instructions and could not keep up with the MMAs.)
template <typename T, int kCluster>
__device__ __forceinline__ void pack_staged(const EpilogueArgs& args, const Smem& sm, const TileWalk<kCluster>& walk) {
  using S = Schedule<Epilogue::kTwellPack, 256>;
  ptx::setmaxnreg_dec<kStagedPackerRegs>();
  const int t = static_cast<int>(threadIdx.x) - 3 * 128, lane = t % 32;
  const uint32_t staged = ptx::smem_addr(sm.staged);
  // Backup rows as 16-byte copies where every tile row starts 16-byte aligned.
  const bool vec_backup = args.N % 8 == 0 && (reinterpret_cast<uintptr_t>(args.c) & 15u) == 0;
  uint32_t j = 0;  // the tile's index in this CTA's walk, as the consumers count it
  for (int unit = walk.first; unit < walk.n_units(); unit += walk.stride, ++j) {
    int pm, pn, split;
    walk.coords(unit, pm, pn, split);
    ptx::mbarrier_wait(sm.staged_full, j & 1);
    if (walk.real(pn)) {
      const int cols_left = args.N - pn * kBlockN;
      // The mask bits of columns that exist (past N the staged values are not to be trusted: x may hold
      // infinities, and inf * 0 is NaN).
      uint32_t valid[4];
#pragma unroll
      for (int lq = 0; lq < 4; ++lq) {
        valid[lq] = 0xffffffffu;
        if (cols_left < kBlockN) {
          valid[lq] = 0u;
          for (int q = 0; q < 16; ++q) {
            const int col = 8 * q + 2 * lq;
            valid[lq] |= (col < cols_left ? 1u << q : 0u) | (col + 1 < cols_left ? 1u << (16 + q) : 0u);
          }
        }
      }
#pragma unroll 1
      for (int half = 0; half < 2; ++half) {  // the tile's two decision blocks
        const int r = half * kBlockM + t;
        const int row = pm * 256 + r;
        int total = 0;
        if (row < args.M) {
          const uint32_t base = staged + r * S::kStagedRowBytes;
          uint32_t mask[4] = {0u, 0u, 0u, 0u};
#pragma unroll
          for (int q = 0; q < 16; ++q) {  // columns 8 q .. 8 q + 7: one pair per quad lane
            const uint4 v = ptx::ld_shared_v4(base + 16 * q);
            const uint32_t pairs[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int lq = 0; lq < 4; ++lq) mask[lq] += (Dtype16<T>::active_halves(pairs[lq]) & 0x10001u) << q;
          }
#pragma unroll
          for (int lq = 0; lq < 4; ++lq) {
            mask[lq] &= valid[lq];
            total += __popc(mask[lq]);
          }
          const int64_t row_tile = static_cast<int64_t>(row) * args.n_tiles_n + pn;
          args.counts[row_tile] = total;
          if (total <= args.cap) {
            uint32_t* slots = args.packed + row_tile * args.cap;
            int at = 0;
#pragma unroll
            for (int lq = 0; lq < 4; ++lq) {
              uint32_t left = mask[lq];
              while (left != 0u) {  // the lowest column first
                const int q = __ffs((left | (left >> 16)) & 0xffffu) - 1;
                const int odd = ((left >> q) & 1u) ^ 1u;
                left &= ~(1u << (q + 16 * odd));
                const int col = 8 * q + 2 * lq + odd;
                slots[at++] = (ptx::ld_shared_u16(base + 2 * col) << 16) | static_cast<uint32_t>(col);
              }
            }
          } else {  // rare: the row's whole tile (pre-activation, rounded) goes to the backup
            uint16_t* dense_row = static_cast<uint16_t*>(args.c) + static_cast<int64_t>(row) * args.N +
                                  static_cast<int64_t>(pn) * kBlockN;
            const int width = min(cols_left, kBlockN);
            if (vec_backup) {  // (width is a multiple of 8 then)
              for (int c = 0; c < width; c += 8)
                *reinterpret_cast<uint4*>(dense_row + c) = ptx::ld_shared_v4(base + 2 * c);
            } else {
              for (int c = 0; c < width; ++c) dense_row[c] = static_cast<uint16_t>(ptx::ld_shared_u16(base + 2 * c));
            }
          }
        }
        add_block_counts(total, total > args.cap ? 1 : 0, pm * 2 + half, lane, args);
      }
    }
    ptx::mbarrier_arrive(sm.staged_free);  // (the last tile's has no taker)
  }
}

// Gate times up, staged: turns one staged row of round(x W_up^T + b) into h = relu(g) * it in place, g
// the gate's (row, tile) as load_gate reads it (head: its count and first slots, loaded beforehand).
// The products of the active columns first (a slot each), then every other column becomes 0 * up,
// as eager's relu(g) * up makes it (-0 for a negative up, NaN for one not finite): the same bits as
// store_rows's mul_pairs of the gate's pairs. Rows of a tile past capacity take g from the backup row
// in c (pre-activations, relu applied here).
template <typename T>
__device__ __forceinline__ void gate_row_in_place(uint32_t row_addr, int64_t row, int tile, int cols_left,
                                                  const EpilogueArgs& args, const GateHead& head) {
  const int64_t row_tile = row * args.n_tiles_n + tile;
  const int count = head.count;
  if (count > args.cap) {  // rare
    const uint16_t* c_row = static_cast<const uint16_t*>(args.c) + row * args.N + static_cast<int64_t>(tile) * kBlockN;
    const bool vec = args.N % 8 == 0 && (reinterpret_cast<uintptr_t>(args.c) & 15u) == 0;
#pragma unroll 4
    for (int c = 0; c < kBlockN / 8; ++c) {
      const int col = 8 * c, width = min(8, cols_left - col);
      if (width <= 0) break;
      uint32_t g[4] = {0u, 0u, 0u, 0u};
      if (vec && width == 8) {
        const uint4 b = *reinterpret_cast<const uint4*>(c_row + col);
        g[0] = b.x, g[1] = b.y, g[2] = b.z, g[3] = b.w;
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (i < width) g[i / 2] |= static_cast<uint32_t>(c_row[col + i]) << (16 * (i % 2));
      }
      const uint4 v = ptx::ld_shared_v4(row_addr + 16 * c);
      ptx::st_shared_v4(row_addr + 16 * c, make_uint4(Dtype16<T>::mul_pairs(relu_pair<T>(g[0]), v.x),
                                                      Dtype16<T>::mul_pairs(relu_pair<T>(g[1]), v.y),
                                                      Dtype16<T>::mul_pairs(relu_pair<T>(g[2]), v.z),
                                                      Dtype16<T>::mul_pairs(relu_pair<T>(g[3]), v.w)));
    }
    return;
  }
  uint32_t active[4] = {0u, 0u, 0u, 0u};  // a bit per column of the tile
  const auto take = [&](uint32_t word) {   // value bits << 16 | column in tile
    const int col = static_cast<int>(word & 0xffffu);
    const uint32_t addr = row_addr + 2 * col;
    ptx::st_shared_u16(addr, Dtype16<T>::mul_pairs(word >> 16, ptx::ld_shared_u16(addr)));
#pragma unroll
    for (int i = 0; i < 4; ++i) active[i] |= col >> 5 == i ? 1u << (col & 31) : 0u;  // static indices
  };
  const uint32_t* slots = args.packed + row_tile * args.cap;
#pragma unroll
  for (int s = 0; s < 8; ++s)
    if (s < count) take(args.slots_vec8 ? head.first[s] : slots[s]);
  for (int s = 8; s < count; ++s) take(slots[s]);
#pragma unroll
  for (int c = 0; c < kBlockN / 8; ++c) {
    const uint32_t bits = (active[c / 4] >> (8 * (c % 4))) & 0xffu;  // columns 8 c .. 8 c + 7
    if (bits == 0xffu || 8 * c >= cols_left) continue;
    const uint4 v = ptx::ld_shared_v4(row_addr + 16 * c);
    uint32_t pairs[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t zero = Dtype16<T>::mul_pairs(0u, pairs[i]);
      const uint32_t keep = ((bits >> (2 * i)) & 1u ? 0xffffu : 0u) | ((bits >> (2 * i + 1)) & 1u ? 0xffff0000u : 0u);
      pairs[i] = (pairs[i] & keep) | (zero & ~keep);
    }
    ptx::st_shared_v4(row_addr + 16 * c, make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]));
  }
}

// Staged schedule, dense path: the fourth warpgroup writes each 256 x 128 tile the consumers staged,
// c = the staged values (kStore), or h = relu(g) * them over the gate's backup in c (kGateTimesUp:
// first each thread turns its two rows into h in place, gate_row_in_place, their gate loaded before
// the tile arrives). A warp writes two rows per step, 16 lanes a row and 8 columns a lane, so each
// store instruction fills whole 32-byte sectors (store_rows's 4-byte stores from the accumulator
// layout fill half ones). Same bits as store_rows. The tiles and halves written are those the
// consumers computed: the same filter, tile by tile.
template <typename T, Epilogue kMode, int kCluster>
__device__ __forceinline__ void write_staged(const EpilogueArgs& args, const Smem& sm, const BlockFilter& filter,
                                             const TileWalk<kCluster>& walk) {
  using S = Schedule<kMode, 256>;
  constexpr uint32_t kWriterBarrier = 3;  // named barrier of the writer warpgroup (1 and 2: K split's)
  ptx::setmaxnreg_dec<kStagedPackerRegs>();
  const int t = static_cast<int>(threadIdx.x) - 3 * 128, warp = t / 32, lane = t % 32;
  const int chunk = lane % 16;  // columns 8 chunk .. 8 chunk + 7 of the tile
  const uint32_t staged = ptx::smem_addr(sm.staged);
  const bool vec = args.N % 8 == 0 && (reinterpret_cast<uintptr_t>(args.c) & 15u) == 0;
  uint32_t j = 0;  // the kept tile's index in this CTA's walk, as the consumers count it
  for (int unit = walk.first; unit < walk.n_units(); unit += walk.stride) {
    int pm, pn, split;
    walk.template coords<S::kBlocksPerTile>(unit, pm, pn, split);
    if (!filter.any_dense<S::kBlocksPerTile>(pm)) continue;
    const int cols_left = args.N - pn * kBlockN;
    bool computed[2];  // the consumers' halves with MMAs (stage_tile's `write`)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int first_row = pm * 256 + half * kBlockM;
      computed[half] = walk.real(pn) && first_row < args.M && filter.dense(pm * 2 + half);
    }
    if constexpr (kMode == Epilogue::kGateTimesUp) {
      GateHead heads[2];  // rows t and 128 + t
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = pm * 256 + half * kBlockM + t;
        heads[half].count = 0;
        if (computed[half] && row < args.M) load_gate_head(row, pn, args, heads[half]);
      }
      ptx::mbarrier_wait(sm.staged_full, j & 1);
#pragma unroll  // (heads and computed by static index: a dynamic one puts them in local memory)
      for (int half = 0; half < 2; ++half) {
        const int row = pm * 256 + half * kBlockM + t;
        if (computed[half] && row < args.M)
          gate_row_in_place<T>(staged + (half * kBlockM + t) * S::kStagedRowBytes, row, pn, cols_left, args, heads[half]);
      }
      ptx::named_barrier_sync(kWriterBarrier, 128);  // every row is h before any is written out
    } else {
      ptx::mbarrier_wait(sm.staged_full, j & 1);
    }
    const int col = 8 * chunk, width = min(8, cols_left - col);
    if (width > 0) {
#pragma unroll 1
      for (int half = 0; half < 2; ++half) {
        if (!(half == 0 ? computed[0] : computed[1])) continue;
#pragma unroll 4
        for (int step = 0; step < kBlockM / 8; ++step) {  // 4 warps x 2 rows a step
          const int r = half * kBlockM + warp * (kBlockM / 4) + 2 * step + lane / 16;
          const int row = pm * 256 + r;
          if (row >= args.M) continue;
          const uint4 v = ptx::ld_shared_v4(staged + r * S::kStagedRowBytes + 16 * chunk);
          uint16_t* c_row = static_cast<uint16_t*>(args.c) + static_cast<int64_t>(row) * args.N +
                            static_cast<int64_t>(pn) * kBlockN + col;
          if (vec && width == 8) {
            *reinterpret_cast<uint4*>(c_row) = v;
          } else {
            const uint32_t out[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
              if (i < width) c_row[i] = static_cast<uint16_t>(out[i / 2] >> (16 * (i % 2)));
          }
        }
      }
    }
    ptx::mbarrier_arrive(sm.staged_free);  // (the last tile's has no taker)
    ++j;
  }
}

// Consumer warpgroups, mainloop then epilogue per tile (see the file comment). Ping-pong: the consumers
// take alternate kept tiles, all 128 rows each. Cooperative: both take every tile, 128 rows each
// (staged: the epilogue is stage_tile; the fourth warpgroup's pack_staged or write_staged does the rest).
template <typename T, Epilogue kMode, int kCluster, int kTileM>
__device__ __forceinline__ void consume(const EpilogueArgs& args, const Smem& sm, const BlockFilter& filter,
                                        const TileWalk<kCluster>& walk) {
  using S = Schedule<kMode, kTileM>;
  ptx::setmaxnreg_inc<S::kCoop ? kStagedConsumerRegs : kConsumerRegs>();
  const int consumer = static_cast<int>(threadIdx.x) / 128 - 1;
  const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
  // This consumer's rows within a tile, and their offset in the stage's A slice (128 bytes per row).
  const int tile_row0 = S::kCoop ? consumer * kBlockM : 0;
  float acc_top[64], acc_bottom[64];  // rows 0-63 and 64-127 of this consumer's rows
#pragma unroll
  for (int i = 0; i < 64; ++i) acc_top[i] = acc_bottom[i] = 0.f;

  // Every role applies the same filter, so the k-th unit kept is the same for all (ping-pong: consumer
  // k % 2 computes it), and so is its ring position (the K-slices of the units kept before it).
  int kept = 0;
  uint32_t ring = 0;
  for (int unit = walk.first; unit < walk.n_units(); unit += walk.stride) {
    int pm, pn, split;
    walk.template coords<S::kBlocksPerTile>(unit, pm, pn, split);
    if (kMode != Epilogue::kTwellPack && !filter.any_dense<S::kBlocksPerTile>(pm)) continue;
    const int j = kept++;
    const int k_steps = walk.steps(split);
    uint32_t it = ring;
    ring += k_steps;
    if constexpr (!S::kCoop) {
      if (j % 2 != consumer) continue;
      // Tile j waits until the other consumer has all of tile j - 1 (its ((j - 1) / 2)-th turn).
      if (j > 0) ptx::mbarrier_wait(&sm.turn[consumer], ((j - 1) / 2) & 1);
    }
    const int block = pm * S::kBlocksPerTile + (S::kCoop ? consumer : 0);  // this consumer's decision block
    uint32_t bias_pairs[16];  // staged schedule (ping-pong loads its bias in finish_chunk)
    if constexpr (S::kCoop) {
      if (args.bias != nullptr && walk.real(pn)) load_bias_pairs(args, pn, lane, bias_pairs);
    }
    const int first_row = pm * kTileM + tile_row0;
    if constexpr (S::kCoop) {
      // Rows past the end, or on the dense path a block left to the sparse path, need no MMAs (the
      // other consumer then has the tensor cores to itself): the stages are only received and released
      // in step. (A separate loop: a condition around the wgmmas of the main one made the ping-pong
      // gate 1.5x slower.)
      bool compute = first_row < args.M;
      if constexpr (kMode != Epilogue::kTwellPack) compute = compute && filter.dense(block);
      if (!compute) {
        for (int ks = 0; ks < k_steps; ++ks, ++it) {
          const uint32_t stage = it % S::kStages;
          ptx::mbarrier_wait(&sm.full[stage], (it / S::kStages) & 1);
          if (lane == 0) release_stage<kCluster>(sm, stage, walk.rank);
        }
        stage_tile<T>(acc_top, acc_bottom, bias_pairs, false, j, tile_row0, warp, lane, args, sm);
        continue;
      }
    }
    int gate_count = 0;
    if constexpr (kMode == Epilogue::kGateTimesUp) {
      if (walk.real(pn)) gate_count = prefetch_gate(first_row, pn, t, args);
    }
    uint32_t prev_stage = 0;
    for (int ks = 0; ks < k_steps; ++ks, ++it) {
      if constexpr (kMode == Epilogue::kGateTimesUp) {
        if (ks == k_steps / 2) prefetch_backup(first_row, pn, t, gate_count, args);
      }
      const uint32_t stage = it % S::kStages;
      ptx::mbarrier_wait(&sm.full[stage], (it / S::kStages) & 1);
      const uint8_t* a = sm.stages + stage * S::kStageBytes;
      const uint64_t desc_a = ptx::sw128_kmajor_desc(a + tile_row0 * 128);
      const uint64_t desc_b = ptx::sw128_kmajor_desc(a + S::kATileBytes);
      fence_operands(acc_top);
      fence_operands(acc_bottom);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        const int scale_d = (ks | kk) != 0;
        // +32 bytes per 16-element K step; the bottom half starts 64 rows (8 KB) further.
        ptx::wgmma_m64n128k16<Dtype16<T>::kBF16>(acc_top, desc_a + 2 * kk, desc_b + 2 * kk, scale_d);
        ptx::wgmma_m64n128k16<Dtype16<T>::kBF16>(acc_bottom, desc_a + 512 + 2 * kk, desc_b + 2 * kk, scale_d);
      }
      ptx::wgmma_commit();
      if constexpr (!S::kCoop) {
        if (ks == k_steps - 1 && lane == 0) ptx::mbarrier_arrive(&sm.turn[1 - consumer]);
      }
      fence_operands(acc_top);
      fence_operands(acc_bottom);
      if constexpr (S::kCoop) {
        // 3 stages only (the staged tile has the fourth's memory), and the consumers waited on TMA data
        // about a third of the time (README). Each consumer waits for its own MMAs and frees the stage
        // at once (the other consumer's MMAs keep the tensor cores busy meanwhile), so a late stage no
        // longer holds back the refill of the one before it.
        ptx::wgmma_wait<0>();
        if (lane == 0) release_stage<kCluster>(sm, stage, walk.rank);
      } else {
        ptx::wgmma_wait<1>();  // the previous slice's MMAs are done: its stage can be refilled
        if (ks > 0 && lane == 0) release_stage<kCluster>(sm, prev_stage, walk.rank);
        prev_stage = stage;
      }
    }
    ptx::wgmma_wait<0>();
    fence_operands(acc_top);
    fence_operands(acc_bottom);
    if (!S::kCoop && lane == 0) release_stage<kCluster>(sm, prev_stage, walk.rank);
    if constexpr (S::kCoop) {  // the fourth warpgroup does the rest
      stage_tile<T>(acc_top, acc_bottom, bias_pairs, walk.real(pn), j, tile_row0, warp, lane, args, sm);
      continue;
    }
    if (!walk.real(pn)) continue;
    if constexpr (!S::kCoop) {  // (K is split only in ping-pong: dispatch)
      if (walk.splits > 1 &&
          !sum_split_partials(acc_top, acc_bottom, walk.split_tile(unit), split, walk.splits, consumer, t, args)) {
        continue;  // another K range of this tile finishes it
      }
    }

    const int row0 = first_row + warp * 16 + lane / 4;
    int nnz = 0, overflowed = 0;
#pragma unroll
    for (int chain = 0; chain < 2; ++chain) {
      // Gate times up: the gate of both of the chain's rows for this thread in one round trip, before
      // anything is stored.
      GateHead heads[2];
      if constexpr (kMode == Epilogue::kGateTimesUp) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int row = row0 + 64 * chain + 8 * i;
          if (row < args.M) load_gate_head(row, pn, args, heads[i]);
        }
      }
      finish_chunk<T, kMode>(chain == 0 ? acc_top : acc_bottom, row0 + 64 * chain, pn, lane, args, heads, nnz,
                             overflowed);
    }
    if constexpr (kMode == Epilogue::kTwellPack) add_block_counts(nnz, overflowed, block, lane, args);
  }
}

// See the file comment.
template <typename T, Epilogue kMode, int kCluster, int kTileM>
__global__ void __launch_bounds__(Schedule<kMode, kTileM>::kThreads, 1) twell_gemm_kernel(
    const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map, EpilogueArgs args,
    int K, int n_tiles_m, int n_tiles_n, int group_m) {
  static_assert(kCluster == 1 || kCluster == 2, "single CTAs or pairs");
  ptx::wait_for_predecessor_then_release_successor();
  extern __shared__ uint8_t smem_raw[];
  Smem sm;
  BlockFilter filter;
  if (!setup<kMode, kCluster, kTileM>(smem_raw, args, sm, filter)) return;
  const int k_steps = (K + kBlockK - 1) / kBlockK;
  TileWalk<kCluster> walk(n_tiles_m, n_tiles_n, group_m, args.k_splits, args.split_steps, k_steps);
  if constexpr (kMode != Epilogue::kTwellPack) {
    if (filter.bits != nullptr && args.dense_test.n_blocks <= kCompactWalkBlocks) {
      walk.template compact_to_dense_tiles<Schedule<kMode, kTileM>::kBlocksPerTile>(filter.bits, args.dense_test.n_blocks);
      if constexpr (!Schedule<kMode, kTileM>::kCoop) {
        if (args.split_room > 0) walk.split_for_idle_ctas(args.split_room);
      }
    }
  }
  if (threadIdx.x < 128) {
    produce<kMode, kCluster, kTileM>(&a_map, &b_map, sm, filter, args.M, walk);
  } else if (threadIdx.x < 3 * 128) {
    consume<T, kMode, kCluster, kTileM>(args, sm, filter, walk);
  } else {
    if constexpr (Schedule<kMode, kTileM>::kCoop) {
      if constexpr (kMode == Epilogue::kTwellPack) {
        pack_staged<T, kCluster>(args, sm, walk);
      } else {
        write_staged<T, kMode, kCluster>(args, sm, filter, walk);
      }
    }
  }
  // The peer may still multicast into this CTA's stages or arrive on its barriers: leave together.
  if constexpr (kCluster > 1) ptx::cluster_sync();
}

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
                "twell: the CUDA driver does not provide cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// [rows, K] K-major operand, read as box_rows x 64 boxes with the 128-byte swizzle wgmma expects.
CUtensorMap operand_map(const at::Tensor& t, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(t.size(1)), static_cast<cuuint64_t>(t.size(0))};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(t.stride(0)) * t.element_size()};
  const cuuint32_t box[2] = {kBlockK, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = tensor_map_encoder()(
      &map, t.scalar_type() == at::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
      t.data_ptr(), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "twell: cuTensorMapEncodeTiled failed with error ", static_cast<int>(r));
  return map;
}

// Work units of a grid of kCluster-CTA clusters: tile rows times clusters of column tiles.
int64_t cluster_units(int64_t n_tiles_m, int64_t n_tiles_n, int64_t cluster) {
  return n_tiles_m * ((n_tiles_n + cluster - 1) / cluster);
}

template <typename T, Epilogue kMode, int kCluster, int kTileM>
void launch(const at::Tensor& a, const at::Tensor& b, const EpilogueArgs& args, int ctas) {
  auto kernel = twell_gemm_kernel<T, kMode, kCluster, kTileM>;
  const CUtensorMap a_map = operand_map(a, kTileM / kCluster), b_map = operand_map(b, kBlockN);
  const int n_tiles_m = static_cast<int>((a.size(0) + kTileM - 1) / kTileM);
  const int64_t units = cluster_units(n_tiles_m, args.n_tiles_n, kCluster) * args.k_splits;
  constexpr int kGroupM = 8;
  int clusters = std::max(ctas / kCluster, 1);
  using S = Schedule<kMode, kTileM>;
  KernelLaunch kernel_launch(kernel, dim3(static_cast<unsigned>(clusters * kCluster)), S::kThreads, S::kSmemBytes,
                             kCluster);
  if constexpr (kCluster > 1) {
    // A persistent grid larger than what can be resident would leave clusters waiting for others.
    const int resident = kernel_launch.resident_clusters();
    TORCH_CHECK(resident > 0, "twell: no cluster of the wgmma GEMM fits on this GPU");
    clusters = std::min(clusters, resident);
  }
  clusters = static_cast<int>(std::min<int64_t>(clusters, units));
  kernel_launch.set_grid_x(static_cast<unsigned>(clusters * kCluster));
  kernel_launch.run(kernel, a_map, b_map, args, static_cast<int>(a.size(1)), n_tiles_m, args.n_tiles_n, kGroupM);
}

template <Epilogue kMode, int kCluster, int kTileM>
void launch_dtype(const at::Tensor& a, const at::Tensor& b, const EpilogueArgs& args, int64_t ctas) {
  if (a.scalar_type() == at::kBFloat16) {
    launch<__nv_bfloat16, kMode, kCluster, kTileM>(a, b, args, static_cast<int>(ctas));
  } else {
    launch<__half, kMode, kCluster, kTileM>(a, b, args, static_cast<int>(ctas));
  }
}

template <Epilogue kMode, int kTileM>
void launch_cluster(const at::Tensor& a, const at::Tensor& b, const EpilogueArgs& args, int64_t ctas, int64_t cluster) {
  const int64_t n_tiles_m = (a.size(0) + kTileM - 1) / kTileM;
  if (cluster == 2 && cluster_units(n_tiles_m, args.n_tiles_n, 2) >= ctas / 2) {
    launch_dtype<kMode, 2, kTileM>(a, b, args, ctas);
  } else {
    launch_dtype<kMode, 1, kTileM>(a, b, args, ctas);
  }
}

// cluster: 2 runs the GEMM in pairs of CTAs sharing A tiles (see the file comment) when there are enough
// tile pairs to keep every pair busy, else single CTAs; 1 always single CTAs. (Clusters of 4 along N
// were tried: correct, but the 2B gate took 7.7 ms against 4.8 ms for pairs on an H200.)
// tile_m: 256 runs the cooperative schedule when its tiles fill the grid, else ping-pong; 128 always
// ping-pong. k_splits: K ranges per tile (0 automatic, see choose_k_split; 1 none); a split GEMM runs
// ping-pong in single CTAs, and parks its partial tiles in a workspace from PyTorch's allocator. Its per-tile arrival
// counters must start at zero: split_arrivals where the caller zeroes them with other counters,
// else zeroed here (one more kernel). The dense-path GEMMs that choose_k_split leaves whole may split on
// the device where few of their tiles are dense (adaptive_split_room): the same workspace and counters,
// sized for the grid.
template <Epilogue kMode>
void dispatch(const at::Tensor& a, const at::Tensor& b, EpilogueArgs args, int64_t ctas, int64_t cluster,
              int64_t tile_m, int64_t k_splits, const c10::optional<at::Tensor>& split_arrivals) {
  TORCH_CHECK(cluster == 1 || cluster == 2, "twell: cluster must be 1 or 2");
  TORCH_CHECK(tile_m == 128 || tile_m == 256, "twell: tile_m must be 128 or 256");
  TORCH_CHECK(k_splits >= 0 && k_splits <= kMaxKSplits, "twell: k_splits must be 0 (automatic) to 16");
  TORCH_CHECK(ctas >= 1, "twell: ctas must be positive");
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  const KSplit split = choose_k_split(M, N, K, ctas, k_splits);
  args.k_splits = split.splits;
  args.split_steps = split.steps;
  args.split_room = 0;
  const int64_t room = kMode == Epilogue::kTwellPack ? 0 : adaptive_split_room(M, N, K, ctas, tile_m, k_splits);
  // Partial tiles and arrival counters: one per output tile of a split, `room` for an adaptive one.
  const int64_t partial_tiles = split.splits > 1 ? split.tiles * split.splits : room;
  const int64_t counters = split.splits > 1 ? split.tiles : room;
  // Freed once the launch is queued: the caching allocator hands the memory out again only to work
  // queued after it on this stream.
  at::Tensor partials, arrivals;
  if (partial_tiles > 0) {
    partials = at::empty({partial_tiles * kBlockM * kBlockN}, a.options().dtype(at::kFloat));
    if (split_arrivals.has_value()) {  // zeroed by the caller along with other counters (one memset)
      arrivals = *split_arrivals;
      TORCH_CHECK(arrivals.is_contiguous() && arrivals.scalar_type() == at::kInt && arrivals.numel() >= counters &&
                      arrivals.device() == a.device(),
                  "twell: split_arrivals must be int32 with one element per 128 x 128 output tile (the grid's "
                  "CTAs where the dense path may split K by itself: adaptive_split_room)");
    } else {
      arrivals = at::zeros({counters}, a.options().dtype(at::kInt));
    }
    args.split_partials = reinterpret_cast<float4*>(partials.data_ptr<float>());
    args.split_arrivals = arrivals.data_ptr<int>();
  }
  if (split.splits > 1) {
    // Single CTAs: both gate-shaped GEMMs ran slower split in pairs (H100, M = 128: the gate 25.6 us in
    // 3 ranges, against 20.5 us whole).
    return launch_cluster<kMode, 128>(a, b, args, ctas, 1);
  }
  if (cooperative_schedule(M, N, ctas, tile_m)) {
    launch_cluster<kMode, 256>(a, b, args, ctas, cluster);
  } else {
    args.split_room = static_cast<int>(room);
    launch_cluster<kMode, 128>(a, b, args, ctas, cluster);
  }
}

// Shapes and dtypes shared by every entry point: C [M, N] = A [M, K] B [N, K]^T (+ bias [N]).
void check_operands(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias, const at::Tensor& c) {
  TORCH_CHECK(a.is_cuda() && b.device() == a.device() && c.device() == a.device(), "twell: operands must be on one CUDA device");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && c.scalar_type() == a.scalar_type() &&
                  (a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf),
              "twell: the GEMM takes bfloat16 or float16 operands of one dtype");
  TORCH_CHECK(tma_compatible(a) && tma_compatible(b), "twell: the GEMM needs 16-byte aligned rows (K % 8 == 0)");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  TORCH_CHECK(b.size(1) == K && K > 0, "twell: A [M, K] and B [N, K] disagree");
  TORCH_CHECK(M < (int64_t{1} << 31) && N < (int64_t{1} << 31) && K < (int64_t{1} << 31), "twell: sizes past 2^31");
  TORCH_CHECK(((M + kBlockM - 1) / kBlockM) * ((N + kBlockN - 1) / kBlockN) < (int64_t{1} << 31), "twell: too many output tiles");
  TORCH_CHECK(c.sizes() == at::IntArrayRef({M, N}) && c.is_contiguous(), "twell: C must be a contiguous [M, N] tensor");
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == a.scalar_type(),
                "twell: bias must be [N] in the operands' dtype");
  }
}

}  // namespace

// TwELL-pack epilogue (see the file comment). `ctas`: the persistent grid (the number of SMs); `cluster`:
// 2 for pairs of CTAs sharing A tiles where the shape allows, 1 for single CTAs; `tile_m` and `k_splits`:
// see dispatch.
void gate_twell_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                     at::Tensor& packed, at::Tensor& counts, at::Tensor& dense, at::Tensor& block_nnz, int64_t ctas,
                     int64_t cluster, int64_t tile_m, int64_t k_splits,
                     const c10::optional<at::Tensor>& split_arrivals) {
  check_operands(x, w, bias, dense);
  const int64_t M = x.size(0), F = w.size(0);
  const int64_t n_tiles_n = (F + kBlockN - 1) / kBlockN;
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) == M && packed.size(1) == n_tiles_n && packed.is_contiguous() &&
                  packed.scalar_type() == at::kInt && packed.size(2) >= 1,
              "twell: packed must be int32 [M, ceil(F / 128), cap]");
  TORCH_CHECK(counts.sizes() == at::IntArrayRef({M, n_tiles_n}) && counts.is_contiguous() && counts.scalar_type() == at::kInt,
              "twell: counts must be int32 [M, ceil(F / 128)]");
  check_block_nnz(block_nnz, M, x.device());
  if (M == 0) return;
  EpilogueArgs args{};
  args.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  args.c = dense.data_ptr();
  args.packed = reinterpret_cast<uint32_t*>(packed.data_ptr<int>());
  args.counts = counts.data_ptr<int>();
  args.block_nnz = block_nnz.data_ptr<int>();
  args.M = static_cast<int>(M);
  args.N = static_cast<int>(F);
  args.n_tiles_n = static_cast<int>(n_tiles_n);
  args.cap = static_cast<int>(packed.size(2));
  dispatch<Epilogue::kTwellPack>(x, w, args, ctas, cluster, tile_m, k_splits, split_arrivals);
}

// Dense path, rows of dense blocks only: c = a b^T (+ bias); or, given the gate's TwELL output
// (gate_packed, gate_counts, and its overflow backup in c), c = relu(gate) * (a b^T + bias) in place.
// The thresholds are those of the sparse kernel's test.
void dense_block_gemm(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias, at::Tensor& c,
                      const at::Tensor& block_nnz, const c10::optional<at::Tensor>& gate_packed,
                      const c10::optional<at::Tensor>& gate_counts, int64_t thr_full, int64_t thr_last,
                      int64_t thr_heavy, int64_t ctas, int64_t cluster, int64_t tile_m, int64_t k_splits,
                      const c10::optional<at::Tensor>& split_arrivals) {
  check_operands(a, b, bias, c);
  const int64_t M = a.size(0), N = b.size(0);
  const int64_t n_tiles_n = (N + kBlockN - 1) / kBlockN;
  const DenseBlockTest dense_test = dense_block_test(block_nnz, M, a.device(), thr_full, thr_last, thr_heavy);
  const bool gate_times_up = gate_packed.has_value();
  TORCH_CHECK(gate_times_up == gate_counts.has_value(), "twell: gate_packed and gate_counts go together");
  if (gate_times_up) {
    TORCH_CHECK(gate_packed->dim() == 3 && gate_packed->size(0) == M && gate_packed->size(1) == n_tiles_n &&
                    gate_packed->size(2) >= 1 && gate_packed->is_contiguous() && gate_packed->scalar_type() == at::kInt &&
                    gate_packed->device() == a.device(),
                "twell: gate_packed must be int32 [M, ceil(N / 128), cap]");
    TORCH_CHECK(gate_counts->sizes() == at::IntArrayRef({M, n_tiles_n}) && gate_counts->is_contiguous() &&
                    gate_counts->scalar_type() == at::kInt && gate_counts->device() == a.device(),
                "twell: gate_counts must be int32 [M, ceil(N / 128)]");
  }
  if (M == 0) return;
  EpilogueArgs args{};
  args.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  args.c = c.data_ptr();
  args.M = static_cast<int>(M);
  args.N = static_cast<int>(N);
  args.n_tiles_n = static_cast<int>(n_tiles_n);
  args.dense_test = dense_test;
  if (gate_times_up) {
    args.packed = reinterpret_cast<uint32_t*>(gate_packed->data_ptr<int>());
    args.counts = gate_counts->data_ptr<int>();
    args.cap = static_cast<int>(gate_packed->size(2));
    args.slots_vec8 = args.cap >= 8 && args.cap % 4 == 0 && aligned16(args.packed);
    dispatch<Epilogue::kGateTimesUp>(a, b, args, ctas, cluster, tile_m, k_splits, split_arrivals);
  } else {
    dispatch<Epilogue::kStore>(a, b, args, ctas, cluster, tile_m, k_splits, split_arrivals);
  }
}

}  // namespace twell
