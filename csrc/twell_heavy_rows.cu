// Heavy rows of sparse blocks as a compact dense MLP. The chunked sparse kernel (twell_sparse_chunked.cu)
// leaves the rows with more than kChunkMaxRowEntries active units to this path and lists them. Such a
// row is a tenth dense or more: as entries it would cost one chunk thread per 40 of them, and under
// skewed activations (0.5% of tokens with thousands of active units) one such row in a block used to
// send the block's other 127 rows to the dense path too. Here they are run as a dense MLP of their own:
//   1. gather: row i of the list gets x in x_h[i] (gated) and its TwELL activation (packed slots, or the
//      backup of tiles past capacity), relu applied, expanded into act_h[i];
//   2. gated: act_h = act_h * (x_h W_up^T + b_up) in place (the dense path's gate-times-up GEMM, reading
//      every tile of the gate from act_h); then out_h = act_h W_down^T + b_down (csrc/twell_gemm.cu);
//   3. scatter: out[list[i]] = out_h[i].
// The list's length is known only on the device, so the buffers hold the list's capacity (the chunked
// kernel's bound) and the GEMMs compute only the 128-row blocks of it that hold listed rows (a decision
// array written by the gather, in block_nnz's layout), rounding as the dense path does.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "backup_tile.cuh"
#include "dense_block_test.cuh"
#include "dtype16.cuh"
#include "twell_entries.h"

namespace twell {
namespace {

constexpr int kThreads = 256;
constexpr int kTileN = 128;  // the TwELL tile of the CUDA gate GEMM
// The compact gate's count for every tile: past any capacity, so the gate-times-up epilogue reads the
// tile from act_h (and never its slots).
constexpr int kFromBackup = 1 << 30;

__device__ __forceinline__ void copy_row16(const uint4* __restrict__ src, uint4* __restrict__ dst, int n16) {
  for (int j = threadIdx.x; j < n16; j += kThreads) dst[j] = src[j];
}

// A CTA per listed row at a time. Rows past the list, up to its last 128-row block, get only their
// gate counts (their x_h and act_h rows are computed on but never scattered).
template <typename T>
__global__ void __launch_bounds__(kThreads) gather_heavy_rows_kernel(
    const int* __restrict__ heavy_rows, const int* __restrict__ heavy_count, int capacity,
    const T* __restrict__ x, int K, const uint32_t* __restrict__ packed, const int* __restrict__ counts,
    const uint16_t* __restrict__ backup, int F, int n_tiles, int cap, T* __restrict__ x_h,
    uint16_t* __restrict__ act_h, int* __restrict__ counts_h, int* __restrict__ compact_blocks,
    int n_compact_blocks) {
  const int listed = *heavy_count;
  if (blockIdx.x == 0) {
    for (int b = threadIdx.x; b < n_compact_blocks; b += kThreads) {
      compact_blocks[b] = static_cast<int64_t>(b) * kDecisionRows < listed ? 1 : 0;
      compact_blocks[n_compact_blocks + b] = 0;
    }
  }
  const int padded = min(capacity, (listed + kDecisionRows - 1) / kDecisionRows * kDecisionRows);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int i = blockIdx.x; i < padded; i += gridDim.x) {
    if (counts_h != nullptr)
      for (int t = threadIdx.x; t < n_tiles; t += kThreads) counts_h[static_cast<int64_t>(i) * n_tiles + t] = kFromBackup;
    if (i >= listed) continue;
    const int64_t row = heavy_rows[i];
    if (x != nullptr)
      copy_row16(reinterpret_cast<const uint4*>(x + row * K), reinterpret_cast<uint4*>(x_h + static_cast<int64_t>(i) * K),
                 K / 8);
    for (int tile = warp; tile < n_tiles; tile += kThreads / 32) {
      const int col0 = tile * kTileN + lane * 4;
      const int64_t row_tile = row * n_tiles + tile;
      uint16_t v[4];
      tile_quad_activation<T>(packed + row_tile * cap, counts[row_tile], cap, backup + row * F + col0,
                              min(4, F - col0), col0 + 4 <= F, lane, v);
      if (col0 + 4 <= F)  // F % 8 == 0: a lane's 4 columns are all in or all out
        *reinterpret_cast<uint2*>(act_h + static_cast<int64_t>(i) * F + col0) =
            make_uint2(v[0] | (static_cast<uint32_t>(v[1]) << 16), v[2] | (static_cast<uint32_t>(v[3]) << 16));
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) scatter_heavy_rows_kernel(const int* __restrict__ heavy_rows,
                                                                      const int* __restrict__ heavy_count,
                                                                      const T* __restrict__ out_h, int D,
                                                                      T* __restrict__ out) {
  const int listed = *heavy_count;
  for (int i = blockIdx.x; i < listed; i += gridDim.x)
    copy_row16(reinterpret_cast<const uint4*>(out_h + static_cast<int64_t>(i) * D),
               reinterpret_cast<uint4*>(out + static_cast<int64_t>(heavy_rows[i]) * D), D / 8);
}

}  // namespace

void heavy_rows_mlp_out(const c10::optional<at::Tensor>& x, const at::Tensor& packed, const at::Tensor& counts,
                        const at::Tensor& dense, const at::Tensor& heavy_rows, const at::Tensor& heavy_count,
                        const c10::optional<at::Tensor>& w_up, const c10::optional<at::Tensor>& b_up,
                        const at::Tensor& w_down, const c10::optional<at::Tensor>& b_down, at::Tensor& out,
                        int64_t ctas, int64_t cluster, int64_t tile_m, int64_t down_tile_m, int64_t k_splits) {
  const bool gated = w_up.has_value();
  TORCH_CHECK(!gated || x.has_value(), "twell: the gated heavy-row path needs x");
  TORCH_CHECK(ctas >= 1, "twell: ctas must be positive");
  const int64_t M = out.size(0), D = out.size(1), F = dense.size(1);
  TORCH_CHECK(out.is_cuda() && aligned_rows(out) && aligned_rows(dense) && dense.size(0) == M &&
                  dense.scalar_type() == out.scalar_type() &&
                  (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf),
              "twell: out [M, D] and dense [M, F] must be contiguous bfloat16/float16 matrices with 16-byte rows");
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.is_contiguous() && packed.dim() == 3 && packed.size(0) == M &&
                  packed.size(1) == (F + kTileN - 1) / kTileN && packed.size(2) >= 1 && packed.size(2) <= 32,
              "twell: packed must be int32 [M, ceil(F / 128), cap] with cap <= 32");
  TORCH_CHECK(counts.sizes() == at::IntArrayRef({M, packed.size(1)}) && counts.is_contiguous() &&
                  counts.scalar_type() == at::kInt, "twell: counts must be int32 [M, ceil(F / 128)]");
  TORCH_CHECK(heavy_rows.scalar_type() == at::kInt && heavy_rows.is_contiguous() && heavy_rows.dim() == 1 &&
                  heavy_rows.numel() <= M && heavy_count.scalar_type() == at::kInt && heavy_count.numel() >= 1 &&
                  heavy_rows.device() == out.device() && heavy_count.device() == out.device(),
              "twell: heavy_rows must be int32 [capacity <= M] and heavy_count int32 [1] on out's device");
  TORCH_CHECK(w_down.size(0) == D && w_down.size(1) == F, "twell: w_down must be [D, F]");
  if (gated) {
    TORCH_CHECK(aligned_rows(*x) && x->size(0) == M && x->scalar_type() == out.scalar_type() && w_up->size(0) == F &&
                    w_up->size(1) == x->size(1),
                "twell: x [M, K] (contiguous, 16-byte rows, out's dtype) and w_up [F, K] must agree");
  }
  const int64_t capacity = heavy_rows.numel();
  if (capacity == 0) return;
  TORCH_CHECK(capacity < (int64_t{1} << 31) && F < (int64_t{1} << 31) && D < (int64_t{1} << 31), "twell: sizes past 2^31");
  const c10::cuda::CUDAGuard guard(out.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t n_tiles = packed.size(1);
  const int64_t n_compact_blocks = (capacity + kDecisionRows - 1) / kDecisionRows;
  const auto ints = out.options().dtype(at::kInt);
  at::Tensor act_h = at::empty({capacity, F}, out.options());
  at::Tensor out_h = at::empty({capacity, D}, out.options());
  at::Tensor compact_blocks = at::empty({2 * n_compact_blocks}, ints);
  at::Tensor x_h, counts_h, packed_h;
  if (gated) {
    x_h = at::empty({capacity, x->size(1)}, out.options());
    counts_h = at::empty({capacity, n_tiles}, ints);
    packed_h = at::empty({capacity, n_tiles, 1}, ints);  // never read: every count says "past capacity"
  }
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(capacity, 2 * ctas));
  const auto run = [&](auto type_tag) {
    using T = decltype(type_tag);
    gather_heavy_rows_kernel<T><<<grid, kThreads, 0, stream>>>(
        heavy_rows.data_ptr<int>(), heavy_count.data_ptr<int>(), static_cast<int>(capacity),
        gated ? reinterpret_cast<const T*>(x->data_ptr()) : nullptr, gated ? static_cast<int>(x->size(1)) : 0,
        reinterpret_cast<const uint32_t*>(packed.data_ptr<int>()), counts.data_ptr<int>(),
        reinterpret_cast<const uint16_t*>(dense.data_ptr()), static_cast<int>(F), static_cast<int>(n_tiles),
        static_cast<int>(packed.size(2)), gated ? reinterpret_cast<T*>(x_h.data_ptr()) : nullptr,
        reinterpret_cast<uint16_t*>(act_h.data_ptr()), gated ? counts_h.data_ptr<int>() : nullptr,
        compact_blocks.data_ptr<int>(), static_cast<int>(n_compact_blocks));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    // Every listed block dense: compact_blocks[b] = 1 > 0; none past capacity: 0 <= INT32_MAX.
    if (gated) {
      dense_block_gemm(x_h, *w_up, b_up, act_h, compact_blocks, packed_h, counts_h, 0, 0, INT32_MAX, ctas, cluster,
                       tile_m, k_splits, c10::nullopt);
    }
    dense_block_gemm(act_h, w_down, b_down, out_h, compact_blocks, c10::nullopt, c10::nullopt, 0, 0, INT32_MAX, ctas,
                     cluster, down_tile_m, k_splits, c10::nullopt);
    scatter_heavy_rows_kernel<T><<<grid, kThreads, 0, stream>>>(heavy_rows.data_ptr<int>(), heavy_count.data_ptr<int>(),
                                                                reinterpret_cast<const T*>(out_h.data_ptr()),
                                                                static_cast<int>(D), reinterpret_cast<T*>(out.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (out.scalar_type() == at::kBFloat16) run(__nv_bfloat16{});
  else run(__half{});
}

}  // namespace twell
