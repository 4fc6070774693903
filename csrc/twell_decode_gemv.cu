// The GEMVs of decode-sized batches (M <= 64): C = A B^T (+ bias) for A [M, K] and B [N, K], with the
// three epilogues of the wgmma GEMM (csrc/twell_gemm.cu, whose file comment defines the TwELL format):
// * TwELL pack: the gate, relu(x W_gate^T + b) in the TwELL format, so everything downstream is unchanged;
// * gate times up (dense path, gated): h = g * round(x W_up^T + b) over `c`, g read from the gate's
//   TwELL output (slots, or the backup row of a tile past capacity);
// * store (dense path, down projection): out = round(h W_down^T + b).
// The dense-path epilogues run only when the call's decision block (one: M <= 128 rows) is dense, by the
// device-side test every path makes (csrc/dense_block_test.cuh); otherwise the whole grid exits at once.
//
// Why kernels of their own: the wgmma GEMM gives each 128 x 128 output tile to one CTA with a K-deep
// mainloop, so at decode the 2B gate (44 column tiles) ran on 44 SMs (16-20 us on an H200 at M <= 64)
// and the dense path's down projection (16 column tiles, K = 5632) on 16, where a GEMV streams the
// weight through every SM. Here each 128-wide column tile is split along K over a cluster of CTAs (8,
// or 16 where the tiles are too few to fill the GPU), so hundreds of CTAs stream the weight:
//   1. each CTA computes its K range of the tile, A B^T for all M rows (padded to 16-row MMA tiles), with
//      mma.sync m16n8k16 and fp32 accumulators; a warp owns 32 of the tile's 128 columns, and every
//      lane loads 16-byte runs of A and B (the MMA's k order is permuted alike for both operands, which
//      leaves the dot products unchanged);
//   2. the tile's rows are dealt out to the cluster's warps; each warp adds its row's fp32 partials of
//      every CTA in rank order (so the result is deterministic), adds the bias, rounds, and runs the
//      epilogue on the row's tile (lane l owns its columns 4l .. 4l + 3). The partials travel over
//      distributed shared memory one of two ways (kPushPartials):
//      * push (1-16 rows): each CTA stores its partial of a row into the shared memory of the CTA that
//        reduces it (posted stores), one cluster barrier waits for all of them, and the reduction reads
//        its own shared memory. No CTA touches another's shared memory after that barrier, so none
//        waits for the others at its exit.
//      * pull (17-64 rows): each CTA parks its partial tile in its own shared memory, and after a
//        cluster barrier the reducing warps load it from there; a second barrier keeps every CTA's
//        shared memory alive until the others have read it.
//      ptxas puts each remote load right before the adds that use it, so pulling takes a row's 8
//      partials in 8 round trips one after another (five rewrites of the loads compiled alike); pushing
//      takes one. A push is a 16-byte store (neighbouring lanes swap column pairs first), as many remote
//      accesses as the pulls. Yet pushing lost at 32 rows with either store width. H200, 38-layer 2B
//      decode step under CUDA graphs, pushing (8-byte stores) at every row count against pulling, in one
//      call: batch 1 2.307 against 2.348 ms, batch 8 2.423 against 2.442, batch 32 3.257 against 3.234.
//      The 16-byte stores ran the same as the 8-byte ones at batch 1 and 8 (2.316, 2.427 ms) and lost at
//      32 rows too (3.246 against pulling's 3.224, in separate calls).

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "cluster_launch.cuh"
#include "dense_block_test.cuh"
#include "dtype16.cuh"
#include "hopper_ptx.cuh"
#include "twell_entries.h"

namespace twell {
namespace {

constexpr int kTileN = 128;          // the TwELL tile, as in the wgmma GEMM
constexpr int kWarps = 4;            // each owns 32 of the tile's columns: four n8 MMA blocks
constexpr int kThreads = kWarps * 32;
constexpr int kChunkK = 32;          // K per step: one 16-byte run per lane and row (two k16 MMAs)
constexpr int kPartialStride = kTileN + 4;  // floats per partial row; the pad spreads the rows over banks
constexpr int kMaxRows = 64;      // four 16-row MMA tiles (and one 128-row decision block)

enum class Epilogue { kTwellPack, kGateTimesUp, kStore };

struct DecodeGemvArgs {
  const void* a;     // [M, K]: x, or h (store)
  const void* b;     // [N, K]: a weight
  const void* bias;  // [N] or null
  void* c;           // [M, N]: the overflow backup (pack), g in / h out (gate times up), out (store)
  uint32_t* packed;  // [M, n_tiles, cap]: pack writes it, gate times up reads the gate from it
  int* counts;       // [M, n_tiles]: likewise
  int* block_nnz;    // [2]: pack adds the call's totals (M <= 128 rows make one decision block)
  int2* gate_parts;  // or, if not null, pack writes each CTA's pair there (dense_block_test.cuh)
  DenseBlockTest dense_test;  // dense-path epilogues: run only if block 0 is dense
  int M, N, K, n_tiles, cap, chunks_per_cta;
  bool c_vec4;       // c's rows hold 4-column runs at 8-byte alignment (N % 4 == 0, base 8-aligned)
};

__device__ __forceinline__ uint4 load16(const void* base, int64_t elem_offset, bool ok) {
  return ok ? __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + elem_offset))
            : make_uint4(0u, 0u, 0u, 0u);
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// The 4 columns lane `lane` owns of a row's tile in c, as two packed pairs (unread columns: 0).
__device__ __forceinline__ void load_c4(const uint16_t* c_row, int lane, int cols_left, bool vec4, uint32_t (&pairs)[2]) {
  const int col = 4 * lane;
  if (vec4 && col + 4 <= cols_left) {
    const uint2 v = *reinterpret_cast<const uint2*>(c_row + col);
    pairs[0] = v.x, pairs[1] = v.y;
    return;
  }
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    const int c0 = col + 2 * p;
    pairs[p] = (c0 < cols_left ? c_row[c0] : 0u) | (c0 + 1 < cols_left ? static_cast<uint32_t>(c_row[c0 + 1]) << 16 : 0u);
  }
}

__device__ __forceinline__ void store_c4(uint16_t* c_row, int lane, int cols_left, bool vec4, const uint32_t (&pairs)[2]) {
  const int col = 4 * lane;
  if (vec4 && col + 4 <= cols_left) {
    *reinterpret_cast<uint2*>(c_row + col) = make_uint2(pairs[0], pairs[1]);
    return;
  }
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    const int c0 = col + 2 * p;
    if (c0 < cols_left) c_row[c0] = static_cast<uint16_t>(pairs[p]);
    if (c0 + 1 < cols_left) c_row[c0 + 1] = static_cast<uint16_t>(pairs[p] >> 16);
  }
}

// Gate times up: relu(gate) on this lane's 4 columns of the (row, tile), as two packed pairs, from the
// gate's TwELL output. A tile past capacity has its row of pre-activations in the backup (c, which this
// lane then overwrites with h: it reads before it writes, and no other thread touches these columns).
template <typename T>
__device__ __forceinline__ void load_gate4(const DecodeGemvArgs& args, int64_t row_tile, const uint16_t* c_row, int lane,
                                           int cols_left, uint32_t (&g)[2]) {
  const int count = args.counts[row_tile];
  g[0] = g[1] = 0u;
  if (count > args.cap) {
    load_c4(c_row, lane, cols_left, args.c_vec4, g);
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const uint32_t lo = g[p] & 0xffffu, hi = g[p] >> 16;
      g[p] = (is_active(Dtype16<T>::value(lo)) ? lo : 0u) | (is_active(Dtype16<T>::value(hi)) ? hi << 16 : 0u);
    }
    return;
  }
  const uint32_t* slots = args.packed + row_tile * args.cap;
  for (int s0 = 0; s0 < count; s0 += 32) {  // 32 slots a round: one round for any cap up to 32
    const uint32_t mine = s0 + lane < count ? slots[s0 + lane] : 0u;
    const int live = min(32, count - s0);
    for (int s = 0; s < live; ++s) {
      const uint32_t w = __shfl_sync(0xffffffffu, mine, s);
      const int col = static_cast<int>(w & 0xffffu);  // value bits << 16 | column in tile
      if ((col >> 2) == lane) {
        const uint32_t v = (w >> 16) << (16 * (col & 1));
        // Static register indices only (an indexed write would put g in local memory).
        if (col & 2) g[1] |= v; else g[0] |= v;
      }
    }
  }
}

// Step 2 deals the rows out a warp each, in turn over the cluster's CTAs: row r goes to warp r % kWarps of
// CTA (r / kWarps) % cluster, as that CTA's reduced row (r / (kWarps * cluster)) * kWarps + r % kWarps.
__host__ __device__ __forceinline__ int reduced_rows(int M, int cluster) {
  const int warp_rounds = (M + kWarps - 1) / kWarps;
  return (warp_rounds + cluster - 1) / cluster * kWarps;
}

// Step 2's way of moving the partials, by MMA row tiles (see the file comment).
template <int kMTiles>
constexpr bool kPushPartials = kMTiles == 1;

// The dynamic shared memory of a launch: each CTA's partial of the rows this CTA reduces (push), or this
// CTA's partial of every row (pull).
template <int kMTiles>
size_t partials_smem(int M, int cluster) {
  const int rows = kPushPartials<kMTiles> ? cluster * reduced_rows(M, cluster) : kMTiles * 16;
  return static_cast<size_t>(rows) * kPartialStride * sizeof(float);
}

// kMTiles 16-row MMA tiles cover the M rows. kUnroll K chunks are loaded before their MMAs run, so a
// lane has kUnroll x 4 loads of B in flight. The launch bound's 3 CTAs per SM (at most 170 registers)
// is what the 2B gate's 352 CTAs need for one wave on 132 SMs; it also makes ptxas issue a step's
// loads together (24 at one row), where without it ptxas interleaved them with the previous chunk's
// MMAs, about 5 in flight.
template <typename T, Epilogue kMode, int kMTiles, int kUnroll>
__global__ void __launch_bounds__(kThreads, 3) decode_gemv_kernel(const DecodeGemvArgs args, const int cluster) {
  ptx::wait_for_predecessor_then_release_successor();
  // Dense-path epilogues: the whole grid reads the same test, so either every CTA of a cluster leaves
  // here or none does (none then waits at a cluster barrier for one that left).
  if constexpr (kMode != Epilogue::kTwellPack) {
    if (!args.dense_test.cta_test(0, false)) return;
  }
  constexpr bool kPush = kPushPartials<kMTiles>;
  // Push: peers store into this CTA's shared memory in step 2, which they may do only once it has
  // started. This arrival says so, and the wait for the others' comes after the mainloop, so nothing
  // waits on it.
  if constexpr (kPush) ptx::cluster_arrive_relaxed();
  // Push: [cluster][rows_per_cta][kPartialStride], each CTA's (by rank) partial of the rows this CTA
  // reduces. Pull: [kMTiles * 16][kPartialStride], this CTA's partial of every row.
  extern __shared__ float partials[];
  const int rank = static_cast<int>(ptx::cluster_ctarank());
  const int tile = static_cast<int>(blockIdx.x) / cluster;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;

  // 1. Partial product over this CTA's K chunks. Lane (g, q) loads the 16-byte run k0 + 8q .. k0 + 8q + 7
  // of A rows g, g + 8 (per MMA tile) and of B rows n0 + g (per n8 block). Two k16 MMAs consume it:
  // step s takes the words 2s and 2s + 1, which the MMA reads as k = 2q, 2q + 1 and 2q + 8, 2q + 9.
  // Both operands are permuted alike, so each dot product is still over all of K.
  const int col_base = tile * kTileN + warp * 32;
  float acc[kMTiles][4][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][j][i] = 0.f;

  const int n_chunks = (args.K + kChunkK - 1) / kChunkK;
  const int c_begin = rank * args.chunks_per_cta;
  const int c_end = min(n_chunks, c_begin + args.chunks_per_cta);
  for (int c0 = c_begin; c0 < c_end; c0 += kUnroll) {
    uint4 bv[kUnroll][4], av[kUnroll][kMTiles][2];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = (c0 + u) * kChunkK + 8 * q;
      const bool k_ok = c0 + u < c_end && k < args.K;  // K % 8 == 0: a run is wholly in or out
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int n = col_base + 8 * j + g;
        bv[u][j] = load16(args.b, static_cast<int64_t>(n) * args.K + k, k_ok && n < args.N);
      }
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = mt * 16 + 8 * h + g;
          av[u][mt][h] = load16(args.a, static_cast<int64_t>(row) * args.K + k, k_ok && row < args.M);
        }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          const uint32_t a[4] = {word(av[u][mt][0], 2 * s), word(av[u][mt][1], 2 * s), word(av[u][mt][0], 2 * s + 1),
                                 word(av[u][mt][1], 2 * s + 1)};
#pragma unroll
          for (int j = 0; j < 4; ++j)
            ptx::mma_m16n8k16<Dtype16<T>::kBF16>(acc[mt][j], a, word(bv[u][j], 2 * s), word(bv[u][j], 2 * s + 1));
        }
  }
  // Push: rows a CTA reduces at most; its shared memory holds each peer's partial of them.
  const int rows_per_cta = kPush ? reduced_rows(args.M, cluster) : 0;
  if constexpr (kPush) {
    ptx::cluster_wait();  // every peer has started
    // Lanes q and q ^ 1 hold rows g and g + 8 at columns 8j + 2q, 8j + 2q + 1 (the MMA's layout); one
    // swap of a pair per n8 block gives the even lane 4 adjacent columns of row g and the odd lane the
    // same columns of row g + 8, so each remote store carries 16 bytes (half as many stores as pairs).
    const int h = q & 1;
    const int col = warp * 32 + 4 * (q >> 1);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      float4 run[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float give0 = h ? acc[mt][j][0] : acc[mt][j][2], give1 = h ? acc[mt][j][1] : acc[mt][j][3];
        const float got0 = __shfl_xor_sync(0xffffffffu, give0, 1), got1 = __shfl_xor_sync(0xffffffffu, give1, 1);
        run[j] = h ? make_float4(got0, got1, acc[mt][j][2], acc[mt][j][3])
                   : make_float4(acc[mt][j][0], acc[mt][j][1], got0, got1);
      }
      const int row = mt * 16 + 8 * h + g;
      if (row >= args.M) continue;
      const int warp_round = row / kWarps;
      const int owner = warp_round % cluster;
      const int reduced = warp_round / cluster * kWarps + row % kWarps;
      float* dst = &partials[(rank * rows_per_cta + reduced) * kPartialStride + col];
#pragma unroll
      for (int j = 0; j < 4; ++j) ptx::st_shared_cluster_v4(dst + 8 * j, static_cast<uint32_t>(owner), run[j]);
    }
  } else {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = mt * 16 + 8 * h + g;
        const int col = warp * 32 + 2 * q;
#pragma unroll
        for (int j = 0; j < 4; ++j)
          *reinterpret_cast<float2*>(&partials[row * kPartialStride + col + 8 * j]) =
              make_float2(acc[mt][j][2 * h], acc[mt][j][2 * h + 1]);
      }
  }
  ptx::cluster_sync();  // every partial is written (release) and visible to its reader (acquire)

  // 2. Rows, one warp each over the cluster: lane l owns the tile's columns 4l .. 4l + 3.
  __shared__ int cta_nnz, cta_overflowed;
  if constexpr (kMode == Epilogue::kTwellPack) {
    if (threadIdx.x == 0) cta_nnz = cta_overflowed = 0;
    __syncthreads();
  }
  const int cols_left = args.N - tile * kTileN;
  int nnz = 0, overflowed = 0;  // pack: lane 0's running totals for this warp's rows
  int reduced = warp;
  for (int row = rank * kWarps + warp; row < args.M; row += cluster * kWarps, reduced += kWarps) {
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if constexpr (kPush) {
      const float* part = &partials[reduced * kPartialStride + 4 * lane];
#pragma unroll 4
      for (int cta = 0; cta < cluster; ++cta) {  // rank order: the same sum on every run
        const float4 p = *reinterpret_cast<const float4*>(part + cta * rows_per_cta * kPartialStride);
        v[0] += p.x;
        v[1] += p.y;
        v[2] += p.z;
        v[3] += p.w;
      }
    } else {
      // All loads first, then the sum in rank order, in groups of 8 CTAs.
      for (int cta0 = 0; cta0 < cluster; cta0 += kPortableClusterMax) {
        float4 parts[kPortableClusterMax];
#pragma unroll
        for (int i = 0; i < kPortableClusterMax; ++i)
          if (cta0 + i < cluster)
            parts[i] = ptx::ld_shared_cluster_v4(&partials[row * kPartialStride + 4 * lane], static_cast<uint32_t>(cta0 + i));
#pragma unroll
        for (int i = 0; i < kPortableClusterMax; ++i)
          if (cta0 + i < cluster) {
            v[0] += parts[i].x;
            v[1] += parts[i].y;
            v[2] += parts[i].z;
            v[3] += parts[i].w;
          }
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int col = 4 * lane + i;
      if (args.bias != nullptr && col < cols_left)
        v[i] += Dtype16<T>::to_float(static_cast<const T*>(args.bias)[tile * kTileN + col]);
    }
    const int64_t row_tile = static_cast<int64_t>(row) * args.n_tiles + tile;
    uint16_t* c_row = static_cast<uint16_t*>(args.c) + static_cast<int64_t>(row) * args.N + tile * kTileN;
    if constexpr (kMode == Epilogue::kTwellPack) {
      uint32_t bits[4];
      uint32_t mask = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        bits[i] = Dtype16<T>::bits(v[i]);
        mask |= static_cast<uint32_t>(4 * lane + i < cols_left && is_active(Dtype16<T>::value(bits[i]))) << i;
      }
      const int mine = __popc(mask);
      int incl = mine;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int up = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += up;
      }
      const int total = __shfl_sync(0xffffffffu, incl, 31);
      if (lane == 0) args.counts[row_tile] = total;
      if (total <= args.cap) {
        uint32_t* slots = args.packed + row_tile * args.cap;
        int at = incl - mine;
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (mask & (1u << i)) slots[at++] = (bits[i] << 16) | static_cast<uint32_t>(4 * lane + i);
      } else {  // rare: the row's whole tile (pre-activation, rounded) goes to the backup
        const uint32_t pairs[2] = {bits[0] | bits[1] << 16, bits[2] | bits[3] << 16};
        store_c4(c_row, lane, cols_left, args.c_vec4, pairs);
      }
      nnz += total;
      overflowed += total > args.cap;
    } else {
      // Packed pairs rounded once, and for h one packed multiply: the same bits as the wgmma epilogue's.
      uint32_t pairs[2] = {Dtype16<T>::pair_bits(v[0], v[1]), Dtype16<T>::pair_bits(v[2], v[3])};
      if constexpr (kMode == Epilogue::kGateTimesUp) {
        uint32_t gate[2];
        load_gate4<T>(args, row_tile, c_row, lane, cols_left, gate);
        pairs[0] = Dtype16<T>::mul_pairs(gate[0], pairs[0]);
        pairs[1] = Dtype16<T>::mul_pairs(gate[1], pairs[1]);
      }
      store_c4(c_row, lane, cols_left, args.c_vec4, pairs);
    }
  }
  if constexpr (kMode == Epilogue::kTwellPack) {
    if (lane == 0 && (nnz | overflowed)) {
      atomicAdd(&cta_nnz, nnz);
      atomicAdd(&cta_overflowed, overflowed);
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // M <= 128: block 0 holds every row
      if (args.gate_parts != nullptr) {
        int2* parts = args.gate_parts + tile * kGatePartsPerTile;
        parts[rank] = make_int2(cta_nnz, cta_overflowed);
        if (rank == 0)
          for (int r = cluster; r < kGatePartsPerTile; ++r) parts[r] = make_int2(0, 0);
      } else {
        if (cta_nnz) atomicAdd(&args.block_nnz[0], cta_nnz);
        if (cta_overflowed) atomicAdd(&args.block_nnz[1], cta_overflowed);
      }
    }
  }
  if constexpr (!kPush) ptx::cluster_sync_before_exit();  // no CTA leaves while another may still read its partial
}

// The current device's SM count, asked of the runtime once per device rather than per launch.
int current_sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices] = {};
  const int device = c10::cuda::current_device();
  int sms = device < kMaxDevices ? known[device].load(std::memory_order_relaxed) : 0;
  if (sms == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    if (device < kMaxDevices) known[device].store(sms, std::memory_order_relaxed);
  }
  return sms;
}

// Clusters of 8 CTAs along K by default; of 16 (non-portable, where the GPU schedules them) when 8 per
// column tile would leave SMs idle (the 2B down projection: 16 tiles, 128 CTAs on 132 SMs; H200, M = 1:
// 14 against 22 us). `requested` (1 to 16) overrides the choice, for measurements; either way at most
// one CTA per K chunk.
bool wants_wide_cluster(const DecodeGemvArgs& args, int n_chunks, int requested) {
  if (requested > 0) return requested > kPortableClusterMax;
  const int sms = current_sm_count();
  return args.n_tiles * kPortableClusterMax < sms && n_chunks >= kNonPortableClusterMax;
}

template <typename T, Epilogue kMode, int kMTiles, int kUnroll>
void launch(DecodeGemvArgs args, int n_chunks, int requested) {
  auto kernel = decode_gemv_kernel<T, kMode, kMTiles, kUnroll>;
  const auto smem = [&](int cluster) { return partials_smem<kMTiles>(args.M, cluster); };
  const auto grid = [&](int cluster) { return dim3(static_cast<unsigned>(args.n_tiles * cluster)); };
  const auto run = [&](const KernelLaunch& kernel_launch, int cluster) {
    args.chunks_per_cta = (n_chunks + cluster - 1) / cluster;
    kernel_launch.run(kernel, args, cluster);
  };
  if (wants_wide_cluster(args, n_chunks, requested)) {
    const int wide = std::min(requested > 0 ? requested : kNonPortableClusterMax, n_chunks);
    const KernelLaunch wide_launch(kernel, grid(wide), kThreads, smem(wide), wide);
    if (wide_launch.resident_clusters() > 0) return run(wide_launch, wide);
  }
  const int cluster = std::min({kPortableClusterMax, n_chunks, requested > 0 ? requested : kPortableClusterMax});
  run(KernelLaunch(kernel, grid(cluster), kThreads, smem(cluster), cluster), cluster);
}

template <typename T, Epilogue kMode>
void dispatch_rows(const DecodeGemvArgs& args, int n_chunks, int requested_cluster) {
  // The unroll keeps 16-24 loads of 16 bytes in flight per lane, within 255 registers.
  switch ((args.M + 15) / 16) {
    case 1: launch<T, kMode, 1, 4>(args, n_chunks, requested_cluster); break;
    case 2: launch<T, kMode, 2, 3>(args, n_chunks, requested_cluster); break;  // 24 loads, all before the MMAs
    case 3: launch<T, kMode, 3, 2>(args, n_chunks, requested_cluster); break;
    default: launch<T, kMode, 4, 2>(args, n_chunks, requested_cluster); break;
  }
}

template <Epilogue kMode>
void dispatch(const at::Tensor& a, const DecodeGemvArgs& args, int64_t cluster) {
  TORCH_CHECK(cluster >= 0 && cluster <= kNonPortableClusterMax, "twell: cluster must be 0 (automatic) to 16");
  const int n_chunks = (args.K + kChunkK - 1) / kChunkK;
  const c10::cuda::CUDAGuard guard(a.device());
  if (a.scalar_type() == at::kBFloat16) {
    dispatch_rows<__nv_bfloat16, kMode>(args, n_chunks, static_cast<int>(cluster));
  } else {
    dispatch_rows<__half, kMode>(args, n_chunks, static_cast<int>(cluster));
  }
}

// Shapes and dtypes shared by the entry points: C [M, N] = A [M, K] B [N, K]^T (+ bias [N]), M <= 64.
DecodeGemvArgs check_operands(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias,
                              const at::Tensor& c) {
  TORCH_CHECK(a.is_cuda() && b.device() == a.device() && c.device() == a.device(), "twell: operands must be on one CUDA device");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && c.scalar_type() == a.scalar_type() &&
                  (a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf),
              "twell: the decode GEMV takes bfloat16 or float16 operands of one dtype");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.is_contiguous() && b.is_contiguous(), "twell: A and B must be contiguous 2-D");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  TORCH_CHECK(b.size(1) == K && K > 0, "twell: A [M, K] and B [N, K] disagree");
  TORCH_CHECK(M <= kMaxRows, "twell: the decode GEMV takes at most 64 rows");
  TORCH_CHECK(K % 8 == 0 && aligned16(a.data_ptr()) && aligned16(b.data_ptr()),
              "twell: the decode GEMV needs 16-byte aligned rows (K % 8 == 0)");
  TORCH_CHECK(N < (int64_t{1} << 31) && K < (int64_t{1} << 31) && N * K < (int64_t{1} << 62), "twell: sizes past 2^31");
  TORCH_CHECK(c.sizes() == at::IntArrayRef({M, N}) && c.is_contiguous(), "twell: C must be a contiguous [M, N] tensor");
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == a.scalar_type() &&
                    bias->device() == a.device(), "twell: bias must be [N] in the operands' dtype");
  }
  DecodeGemvArgs args{};
  args.a = a.data_ptr();
  args.b = b.data_ptr();
  args.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  args.c = c.data_ptr();
  args.M = static_cast<int>(M);
  args.N = static_cast<int>(N);
  args.K = static_cast<int>(K);
  args.n_tiles = static_cast<int>((N + kTileN - 1) / kTileN);
  args.c_vec4 = N % 4 == 0 && reinterpret_cast<uintptr_t>(c.data_ptr()) % 8 == 0;
  return args;
}

void check_twell(const at::Tensor& packed, const at::Tensor& counts, const DecodeGemvArgs& args, const c10::Device& device) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) == args.M && packed.size(1) == args.n_tiles && packed.is_contiguous() &&
                  packed.scalar_type() == at::kInt && packed.size(2) >= 1 && packed.device() == device,
              "twell: packed must be int32 [M, ceil(F / 128), cap]");
  TORCH_CHECK(counts.sizes() == at::IntArrayRef({args.M, args.n_tiles}) && counts.is_contiguous() &&
                  counts.scalar_type() == at::kInt && counts.device() == device,
              "twell: counts must be int32 [M, ceil(F / 128)]");
}

}  // namespace

// relu(x W^T + bias) in the TwELL format for M <= 64 rows (see the file comment). `block_nnz` must be
// zero on entry, as for the wgmma gate GEMM; or, given gate_parts, the CTAs write their pairs there
// instead and block_nnz is left alone (dense_block_test.cuh).
void decode_gate_twell(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                       at::Tensor& packed, at::Tensor& counts, at::Tensor& dense, at::Tensor& block_nnz,
                       int64_t cluster, const c10::optional<at::Tensor>& gate_parts) {
  static_assert(kNonPortableClusterMax <= kGatePartsPerTile, "a slot per CTA of a tile's cluster");
  DecodeGemvArgs args = check_operands(x, w, bias, dense);
  check_twell(packed, counts, args, x.device());
  check_block_nnz(block_nnz, args.M, x.device());
  if (gate_parts.has_value()) {
    check_gate_parts(*gate_parts, args.M, args.n_tiles, x.device());
    args.gate_parts = reinterpret_cast<int2*>(gate_parts->data_ptr<int>());
  }
  if (args.M == 0 || args.N == 0) return;
  args.packed = reinterpret_cast<uint32_t*>(packed.data_ptr<int>());
  args.counts = counts.data_ptr<int>();
  args.block_nnz = block_nnz.data_ptr<int>();
  args.cap = static_cast<int>(packed.size(2));
  dispatch<Epilogue::kTwellPack>(x, args, cluster);
}

// The dense path of decode-sized calls (M <= 64), run only when the call's block is dense: c = a b^T
// (+ bias); or, given the gate's TwELL output (gate_packed, gate_counts, and its overflow backup in c),
// c = relu(gate) * (a b^T + bias) in place. The thresholds are those of the sparse kernel's test, which
// reads gate_parts instead of block_nnz where given (the decode gate's per-CTA pairs).
void decode_dense_gemv(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias, at::Tensor& c,
                       const at::Tensor& block_nnz, const c10::optional<at::Tensor>& gate_packed,
                       const c10::optional<at::Tensor>& gate_counts, int64_t thr_full, int64_t thr_last,
                       int64_t thr_heavy, int64_t cluster, const c10::optional<at::Tensor>& gate_parts) {
  DecodeGemvArgs args = check_operands(a, b, bias, c);
  const bool gate_times_up = gate_packed.has_value();
  // The hidden units (the gate's columns) are c's columns for the up GEMV and a's for the down GEMV.
  const int64_t gate_tiles = gate_times_up ? args.n_tiles : (args.K + kTileN - 1) / kTileN;
  args.dense_test =
      dense_block_test(block_nnz, args.M, a.device(), thr_full, thr_last, thr_heavy, gate_parts, gate_tiles);
  TORCH_CHECK(gate_times_up == gate_counts.has_value(), "twell: gate_packed and gate_counts go together");
  if (gate_times_up) check_twell(*gate_packed, *gate_counts, args, a.device());
  if (args.M == 0 || args.N == 0) return;
  if (gate_times_up) {
    args.packed = reinterpret_cast<uint32_t*>(gate_packed->data_ptr<int>());
    args.counts = gate_counts->data_ptr<int>();
    args.cap = static_cast<int>(gate_packed->size(2));
    dispatch<Epilogue::kGateTimesUp>(a, args, cluster);
  } else {
    dispatch<Epilogue::kStore>(a, args, cluster);
  }
}

}  // namespace twell
