// The gate GEMV of decode-sized batches (M <= 64), writing the same TwELL format as the wgmma gate GEMM
// (csrc/twell_gemm.cu; see its file comment for the format), so everything downstream is unchanged.
//
// Why a kernel of its own: the wgmma GEMM gives each 128 x 128 output tile to one CTA with a K-deep
// mainloop, so at decode the 2B gate (44 column tiles) runs on 44 SMs: 16-20 us on an H200 at M <= 64,
// where cuBLAS's GEMV streams the weight in a few. Here each 128-wide TwELL tile is split along K over a
// cluster of up to 8 CTAs, so hundreds of CTAs stream W:
//   1. each CTA computes its K range of the tile, x W^T for all M rows (padded to 16-row MMA tiles), with
//      mma.sync m16n8k16 and fp32 accumulators; a warp owns 32 of the tile's 128 columns, and every
//      lane loads 16-byte runs of x and W (the MMA's k order is permuted alike for both operands, which
//      leaves the dot products unchanged);
//   2. it parks its fp32 partial tile in shared memory; after a cluster barrier, each warp of the
//      cluster takes rows, adds the partials of every CTA over distributed shared memory in rank order
//      (so the result is deterministic), adds the bias, rounds, and packs the row: count, slots, or the
//      backup row when the count exceeds the capacity; the block totals are added once per CTA.
// A second cluster barrier keeps every CTA's shared memory alive until the others have read it.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "dense_block_test.cuh"
#include "dtype16.cuh"
#include "hopper_ptx.cuh"

namespace twell {
namespace {

constexpr int kTileN = 128;          // the TwELL tile, as in the wgmma GEMM
constexpr int kWarps = 4;            // each owns 32 of the tile's columns: four n8 MMA blocks
constexpr int kThreads = kWarps * 32;
constexpr int kChunkK = 32;          // K per step: one 16-byte run per lane and row (two k16 MMAs)
constexpr int kMaxCluster = 8;       // the portable cluster size
constexpr int kPartialStride = kTileN + 4;  // floats per partial row; the pad spreads the rows over banks
constexpr int kMaxRows = 64;      // four 16-row MMA tiles (and one 128-row decision block)

struct DecodeGateArgs {
  const void* x;     // [M, K]
  const void* w;     // [N, K]
  const void* bias;  // [N] or null
  uint32_t* packed;  // [M, n_tiles, cap]
  int* counts;       // [M, n_tiles]
  void* dense;       // [M, N]: the backup of rows past capacity
  int* block_nnz;    // [2]: M <= 128 rows make one decision block
  int M, N, K, n_tiles, cap, chunks_per_cta;
};

__device__ __forceinline__ uint4 load16(const void* base, int64_t elem_offset, bool ok) {
  return ok ? __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + elem_offset))
            : make_uint4(0u, 0u, 0u, 0u);
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// kMTiles 16-row MMA tiles cover the M rows. kUnroll K chunks are loaded before their MMAs run, so a
// lane has kUnroll x 4 loads of W in flight.
template <typename T, int kMTiles, int kUnroll>
__global__ void __launch_bounds__(kThreads) decode_gate_kernel(const DecodeGateArgs args, const int cluster) {
  extern __shared__ float partial[];  // [kMTiles * 16][kPartialStride]: this CTA's K range of the tile
  const int rank = static_cast<int>(ptx::cluster_ctarank());
  const int tile = static_cast<int>(blockIdx.x) / cluster;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;

  // 1. Partial product over this CTA's K chunks. Lane (g, q) loads the 16-byte run k0 + 8q .. k0 + 8q + 7
  // of x rows g, g + 8 (per MMA tile) and of W rows n0 + g (per n8 block). Two k16 MMAs consume it:
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
    uint4 wv[kUnroll][4], xv[kUnroll][kMTiles][2];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = (c0 + u) * kChunkK + 8 * q;
      const bool k_ok = c0 + u < c_end && k < args.K;  // K % 8 == 0: a run is wholly in or out
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int n = col_base + 8 * j + g;
        wv[u][j] = load16(args.w, static_cast<int64_t>(n) * args.K + k, k_ok && n < args.N);
      }
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = mt * 16 + 8 * h + g;
          xv[u][mt][h] = load16(args.x, static_cast<int64_t>(row) * args.K + k, k_ok && row < args.M);
        }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          const uint32_t a[4] = {word(xv[u][mt][0], 2 * s), word(xv[u][mt][1], 2 * s), word(xv[u][mt][0], 2 * s + 1),
                                 word(xv[u][mt][1], 2 * s + 1)};
#pragma unroll
          for (int j = 0; j < 4; ++j)
            ptx::mma_m16n8k16<Dtype16<T>::kBF16>(acc[mt][j], a, word(wv[u][j], 2 * s), word(wv[u][j], 2 * s + 1));
        }
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = mt * 16 + 8 * h + g, col = warp * 32 + 8 * j + 2 * q;
        *reinterpret_cast<float2*>(&partial[row * kPartialStride + col]) = make_float2(acc[mt][j][2 * h], acc[mt][j][2 * h + 1]);
      }
  ptx::cluster_sync();  // every CTA's partial is written (release) and visible to the cluster (acquire)

  // 2. Rows, one warp each over the cluster: lane l owns the tile's columns 4l .. 4l + 3.
  __shared__ int cta_nnz, cta_overflowed;
  if (threadIdx.x == 0) cta_nnz = cta_overflowed = 0;
  __syncthreads();
  const int cols_left = args.N - tile * kTileN;
  int nnz = 0, overflowed = 0;  // lane 0's running totals for this warp's rows
  for (int row = rank * kWarps + warp; row < args.M; row += cluster * kWarps) {
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    float4 parts[kMaxCluster];  // all loads first, then the sum in rank order (the same on every run)
#pragma unroll
    for (int cta = 0; cta < kMaxCluster; ++cta)
      if (cta < cluster)
        parts[cta] = ptx::ld_shared_cluster_v4(&partial[row * kPartialStride + 4 * lane], static_cast<uint32_t>(cta));
#pragma unroll
    for (int cta = 0; cta < kMaxCluster; ++cta)
      if (cta < cluster) {
        v[0] += parts[cta].x;
        v[1] += parts[cta].y;
        v[2] += parts[cta].z;
        v[3] += parts[cta].w;
      }
    uint32_t bits[4];
    uint32_t mask = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int col = 4 * lane + i;
      if (args.bias != nullptr && col < cols_left)
        v[i] += Dtype16<T>::to_float(static_cast<const T*>(args.bias)[tile * kTileN + col]);
      bits[i] = Dtype16<T>::bits(v[i]);
      mask |= static_cast<uint32_t>(col < cols_left && is_active(Dtype16<T>::value(bits[i]))) << i;
    }
    const int mine = __popc(mask);
    int incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += up;
    }
    const int total = __shfl_sync(0xffffffffu, incl, 31);
    const int64_t row_tile = static_cast<int64_t>(row) * args.n_tiles + tile;
    if (lane == 0) args.counts[row_tile] = total;
    if (total <= args.cap) {
      uint32_t* slots = args.packed + row_tile * args.cap;
      int at = incl - mine;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (mask & (1u << i)) slots[at++] = (bits[i] << 16) | static_cast<uint32_t>(4 * lane + i);
    } else {  // rare: the row's whole tile (pre-activation, rounded) goes to the backup
      uint16_t* dense_row = static_cast<uint16_t*>(args.dense) + static_cast<int64_t>(row) * args.N + tile * kTileN;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (4 * lane + i < cols_left) dense_row[4 * lane + i] = static_cast<uint16_t>(bits[i]);
    }
    nnz += total;
    overflowed += total > args.cap;
  }
  if (lane == 0 && (nnz | overflowed)) {
    atomicAdd(&cta_nnz, nnz);
    atomicAdd(&cta_overflowed, overflowed);
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // M <= 128: block 0 holds every row
    if (cta_nnz) atomicAdd(&args.block_nnz[0], cta_nnz);
    if (cta_overflowed) atomicAdd(&args.block_nnz[1], cta_overflowed);
  }
  ptx::cluster_sync();  // no CTA leaves while another may still read its partial
}

template <typename T, int kMTiles, int kUnroll>
void launch(const DecodeGateArgs& args, int cluster, const c10::Device& device) {
  auto kernel = decode_gate_kernel<T, kMTiles, kUnroll>;
  const int smem = kMTiles * 16 * kPartialStride * static_cast<int>(sizeof(float));
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = cluster;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(args.n_tiles * cluster));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = c10::cuda::getCurrentCUDAStream(device.index());
  config.attrs = attribute;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args, cluster));
}

template <typename T>
void dispatch_rows(const DecodeGateArgs& args, int cluster, const c10::Device& device) {
  // The unroll keeps 16-24 loads of 16 bytes in flight per lane, within 255 registers.
  switch ((args.M + 15) / 16) {
    case 1: launch<T, 1, 4>(args, cluster, device); break;
    case 2: launch<T, 2, 4>(args, cluster, device); break;
    case 3: launch<T, 3, 2>(args, cluster, device); break;
    default: launch<T, 4, 2>(args, cluster, device); break;
  }
}

}  // namespace

// relu(x W^T + bias) in the TwELL format for M <= 64 rows (see the file comment). `block_nnz` must be
// zero on entry, as for the wgmma gate GEMM.
void decode_gate_twell(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                       at::Tensor& packed, at::Tensor& counts, at::Tensor& dense, at::Tensor& block_nnz) {
  TORCH_CHECK(x.is_cuda() && w.device() == x.device() && dense.device() == x.device() && packed.device() == x.device() &&
                  counts.device() == x.device(), "twell: operands must be on one CUDA device");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && dense.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
              "twell: the decode gate takes bfloat16 or float16 operands of one dtype");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.is_contiguous() && w.is_contiguous(), "twell: x and w must be contiguous 2-D");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && K > 0, "twell: x [M, K] and w [N, K] disagree");
  TORCH_CHECK(M <= kMaxRows, "twell: the decode gate takes at most 64 rows");
  TORCH_CHECK(K % 8 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
              "twell: the decode gate needs 16-byte aligned rows (K % 8 == 0)");
  TORCH_CHECK(N < (int64_t{1} << 31) && K < (int64_t{1} << 31) && N * K < (int64_t{1} << 62), "twell: sizes past 2^31");
  const int64_t n_tiles = (N + kTileN - 1) / kTileN;
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) == M && packed.size(1) == n_tiles && packed.is_contiguous() &&
                  packed.scalar_type() == at::kInt && packed.size(2) >= 1,
              "twell: packed must be int32 [M, ceil(F / 128), cap]");
  TORCH_CHECK(counts.sizes() == at::IntArrayRef({M, n_tiles}) && counts.is_contiguous() && counts.scalar_type() == at::kInt,
              "twell: counts must be int32 [M, ceil(F / 128)]");
  TORCH_CHECK(dense.sizes() == at::IntArrayRef({M, N}) && dense.is_contiguous(), "twell: dense must be a contiguous [M, F] tensor");
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == x.scalar_type() &&
                    bias->device() == x.device(), "twell: bias must be [F] in the operands' dtype");
  }
  check_block_nnz(block_nnz, M, x.device());
  if (M == 0 || N == 0) return;
  const int64_t n_chunks = (K + kChunkK - 1) / kChunkK;
  const int cluster = static_cast<int>(std::min<int64_t>(kMaxCluster, n_chunks));
  DecodeGateArgs args{};
  args.x = x.data_ptr();
  args.w = w.data_ptr();
  args.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  args.packed = reinterpret_cast<uint32_t*>(packed.data_ptr<int>());
  args.counts = counts.data_ptr<int>();
  args.dense = dense.data_ptr();
  args.block_nnz = block_nnz.data_ptr<int>();
  args.M = static_cast<int>(M);
  args.N = static_cast<int>(N);
  args.K = static_cast<int>(K);
  args.n_tiles = static_cast<int>(n_tiles);
  args.cap = static_cast<int>(packed.size(2));
  args.chunks_per_cta = static_cast<int>((n_chunks + cluster - 1) / cluster);
  const c10::cuda::CUDAGuard guard(x.device());
  if (x.scalar_type() == at::kBFloat16) {
    dispatch_rows<__nv_bfloat16>(args, cluster, x.device());
  } else {
    dispatch_rows<__half>(args, cluster, x.device());
  }
}

}  // namespace twell
