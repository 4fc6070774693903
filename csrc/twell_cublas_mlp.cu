// The dense MLP through PyTorch's GEMMs (cuBLAS), for the token counts where no TwELL path pays:
// 64 to a few hundred rows on the 2B shape, where our GEMMs leave most SMs idle or wait on their
// pipelines and cuBLAS's small-tile kernels take about two thirds of their time (README, "Calls of
// 65-512 rows" and "The decode GEMVs, measured"). The call plan (twell_compile/kernels/twell_mlp.py)
// picks it by the row count alone, on the host, so no host sync.
//
// Gated: g = x W_gate^T + b, u = x W_up^T + b, then u <- relu(g) * u in one pass (eager's relu and mul
// round alike: relu is exact and the product of two 16-bit values is exact in float, so both give
// the product rounded once), out = u W_down^T + b. Non-gated: a = relu(x W_up^T + b), out = a W_down^T
// + b. Returns (out, act): act is g (gated) or a (non-gated), whose positive or NaN entries are the
// active units, for the sparsity statistics.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "dtype16.cuh"
#include "twell_entries.h"

namespace twell {
namespace {

constexpr int kThreads = 256;

// Both halves of a packed pair: relu(gate) * up, rounded once (Dtype16::mul_pairs).
template <typename T>
__device__ __forceinline__ uint32_t relu_times(uint32_t gate, uint32_t up) {
  return Dtype16<T>::mul_pairs(gate & Dtype16<T>::active_halves(gate), up);
}

// up[i] <- relu(gate[i]) * up[i] over n 16-bit values: 8 a thread per 16-byte access, the last n % 8
// one by one.
template <typename T>
__global__ void __launch_bounds__(kThreads) relu_times_kernel(const uint16_t* __restrict__ gate,
                                                              uint16_t* __restrict__ up, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t vectors = n / 8;
  const uint4* g4 = reinterpret_cast<const uint4*>(gate);
  uint4* u4 = reinterpret_cast<uint4*>(up);
  for (int64_t i = first; i < vectors; i += stride) {
    const uint4 g = g4[i];
    uint4 u = u4[i];
    u.x = relu_times<T>(g.x, u.x);
    u.y = relu_times<T>(g.y, u.y);
    u.z = relu_times<T>(g.z, u.z);
    u.w = relu_times<T>(g.w, u.w);
    u4[i] = u;
  }
  for (int64_t i = vectors * 8 + first; i < n; i += stride) {
    up[i] = static_cast<uint16_t>(relu_times<T>(gate[i], up[i]));  // the low half holds the value
  }
}

void relu_times_inplace(const at::Tensor& gate, at::Tensor& up) {
  const int64_t n = up.numel();
  if (n == 0) return;
  const int64_t blocks = std::min<int64_t>((n / 8 + kThreads - 1) / kThreads + 1, int64_t{4} * 1024);
  auto kernel = up.scalar_type() == at::kBFloat16 ? relu_times_kernel<__nv_bfloat16> : relu_times_kernel<__half>;
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint16_t*>(gate.data_ptr()), reinterpret_cast<uint16_t*>(up.data_ptr()), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> cublas_mlp(const at::Tensor& x, const at::Tensor& w_act,
                                              const c10::optional<at::Tensor>& b_act,
                                              const c10::optional<at::Tensor>& w_up,
                                              const c10::optional<at::Tensor>& b_up, const at::Tensor& w_down,
                                              const c10::optional<at::Tensor>& b_down) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2, "twell: cublas_mlp takes a 2-D CUDA x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "twell: cublas_mlp takes bfloat16 or float16");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor act = at::linear(x, w_act, b_act);
  if (!w_up.has_value()) {
    act.relu_();
    return {at::linear(act, w_down, b_down), act};
  }
  at::Tensor hidden = at::linear(x, *w_up, b_up);
  // at::linear's results are fresh, contiguous and allocator-aligned (16 bytes at least).
  TORCH_CHECK(act.is_contiguous() && hidden.is_contiguous() && act.sizes() == hidden.sizes() &&
                  reinterpret_cast<uintptr_t>(act.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(hidden.data_ptr()) % 16 == 0,
              "twell: cublas_mlp expected contiguous, aligned projections");
  relu_times_inplace(act, hidden);
  return {at::linear(hidden, w_down, b_down), act};
}

}  // namespace twell
