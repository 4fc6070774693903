// The per-128-row-block choice between the sparse and the dense path, made on the device from the
// counts the gate GEMM accumulated. Every kernel that owns part of a block's work asks this same
// integer test, so each output row is written by exactly one path and the host never syncs to decide.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace twell {

constexpr int kDecisionRows = 128;

struct DenseBlockTest {
  const int* block_nnz;  // [2, n_blocks]: active units, then row-tiles past the packed capacity
  int n_blocks;
  int thr_full;   // most active units a full block may have and stay sparse
  int thr_last;   // the same for the last, possibly partial, block
  int thr_heavy;  // most row-tiles past capacity a block may have and stay sparse (stragglers)

  __device__ __forceinline__ bool operator()(int blk) const {
    return block_nnz[blk] > (blk == n_blocks - 1 ? thr_last : thr_full) || block_nnz[n_blocks + blk] > thr_heavy;
  }
};

// Host side, shared by every entry point that reads or writes the block counts of an M-row call.
inline void check_block_nnz(const at::Tensor& block_nnz, int64_t M, const c10::Device& device) {
  TORCH_CHECK(block_nnz.numel() == 2 * ((M + kDecisionRows - 1) / kDecisionRows) && block_nnz.is_contiguous() &&
                  block_nnz.scalar_type() == at::kInt && block_nnz.device() == device,
              "twell: block_nnz must be int32 [2 * ceil(M / 128)] on the operands' device");
}

// Checks block_nnz and the thresholds, and builds the test the kernels make.
inline DenseBlockTest dense_block_test(const at::Tensor& block_nnz, int64_t M, const c10::Device& device,
                                       int64_t thr_full, int64_t thr_last, int64_t thr_heavy) {
  check_block_nnz(block_nnz, M, device);
  TORCH_CHECK(thr_full >= 0 && thr_last >= 0 && thr_heavy >= 0 && thr_full <= INT32_MAX && thr_last <= INT32_MAX &&
                  thr_heavy <= INT32_MAX, "twell: bad thresholds");
  return DenseBlockTest{block_nnz.data_ptr<int>(), static_cast<int>(block_nnz.numel() / 2), static_cast<int>(thr_full),
                        static_cast<int>(thr_last), static_cast<int>(thr_heavy)};
}

}  // namespace twell
