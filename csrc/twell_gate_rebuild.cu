// Dense path of a non-gated block, first step: for the rows of 128-row blocks the device-side test
// marks dense, expands the TwELL activation (packed slots, or the backup row of an overflowing tile)
// into relu(up) in `dense`, which the down GEMM (csrc/twell_gemm.cu) then reads. Tiles of sparse
// blocks exit at once. (A gated block needs no such pass: its gate-times-up GEMM epilogue reads the
// TwELL gate itself.)

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <cstdint>

#include "backup_tile.cuh"
#include "dense_block_test.cuh"
#include "dtype16.cuh"
#include "twell_entries.h"

namespace twell {
namespace {

constexpr int kTileN = 128;  // the TwELL tile of the CUDA gate GEMM
constexpr int kThreads = 256;

// One CTA per (128-row block, tile). A warp expands one row's tile at a time, each lane 4 columns.
template <typename T>
__global__ void __launch_bounds__(kThreads) rebuild_dense_gate_kernel(const uint32_t* __restrict__ packed,
                                                                      const int* __restrict__ counts,
                                                                      uint16_t* __restrict__ dense, DenseBlockTest test,
                                                                      int M, int F, int n_tiles, int cap) {
  const int blk = blockIdx.x, tile = blockIdx.y;
  if (!test.cta_test(blk, false)) return;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int col0 = tile * kTileN + lane * 4;  // this lane's first column
  const bool vec = (F % 4) == 0 && col0 + 4 <= F;
  const int row_end = min(M, (blk + 1) * kDecisionRows);
#pragma unroll 4
  for (int64_t row = static_cast<int64_t>(blk) * kDecisionRows + warp; row < row_end; row += kThreads / 32) {
    const int64_t row_tile = row * n_tiles + tile;
    uint16_t* p = dense + row * F + col0;
    uint16_t v[4];
    tile_quad_activation<T>(packed + row_tile * cap, counts[row_tile], cap, p, min(4, F - col0), vec, lane, v);
    if (vec) {
      *reinterpret_cast<uint2*>(p) = make_uint2(v[0] | (static_cast<uint32_t>(v[1]) << 16), v[2] | (static_cast<uint32_t>(v[3]) << 16));
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (col0 + e < F) p[e] = v[e];
    }
  }
}

}  // namespace

void rebuild_dense_gate(const at::Tensor& packed, const at::Tensor& counts, at::Tensor& dense,
                        const at::Tensor& block_nnz, int64_t thr_full, int64_t thr_last, int64_t thr_heavy,
                        const c10::optional<at::Tensor>& gate_parts) {
  TORCH_CHECK(packed.is_cuda() && packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kInt,
              "twell: packed must be a contiguous int32 CUDA [M, tiles, cap] tensor");
  const int64_t M = packed.size(0), n_tiles = packed.size(1);
  TORCH_CHECK(counts.sizes() == at::IntArrayRef({M, n_tiles}) && counts.is_contiguous() && counts.scalar_type() == at::kInt,
              "twell: counts must be int32 [M, tiles]");
  TORCH_CHECK(dense.dim() == 2 && dense.size(0) == M && dense.is_contiguous() &&
                  (dense.size(1) + kTileN - 1) / kTileN == n_tiles &&
                  (dense.scalar_type() == at::kBFloat16 || dense.scalar_type() == at::kHalf),
              "twell: dense must be a contiguous bfloat16/float16 [M, F] tensor with ceil(F / 128) tiles");
  const DenseBlockTest test =
      dense_block_test(block_nnz, M, dense.device(), thr_full, thr_last, thr_heavy, gate_parts, n_tiles);
  TORCH_CHECK(packed.size(2) <= 32, "twell: the gate rebuild reads at most 32 slots per tile");
  TORCH_CHECK(M < (int64_t{1} << 31) && n_tiles <= 65535, "twell: sizes out of range");
  if (M == 0) return;
  const c10::cuda::CUDAGuard guard(dense.device());
  const dim3 grid(static_cast<unsigned>(test.n_blocks), static_cast<unsigned>(n_tiles));
  auto kernel = dense.scalar_type() == at::kBFloat16 ? rebuild_dense_gate_kernel<__nv_bfloat16>
                                                     : rebuild_dense_gate_kernel<__half>;
  kernel<<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint32_t*>(packed.data_ptr<int>()), counts.data_ptr<int>(),
      reinterpret_cast<uint16_t*>(dense.data_ptr()), test, static_cast<int>(M), static_cast<int>(dense.size(1)),
      static_cast<int>(n_tiles), static_cast<int>(packed.size(2)));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace twell
