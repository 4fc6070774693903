// The per-128-row-block choice between the sparse and the dense path, made on the device from the
// counts the gate GEMM accumulated. Every kernel that owns part of a block's work asks this same
// integer test, so each output row is written by exactly one path and the host never syncs to decide.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <vector_types.h>

#include <cstdint>

namespace twell {

constexpr int kDecisionRows = 128;
// Decode calls (one decision block) may take the counts from the decode gate's CTAs instead: each writes
// its own (active units, row-tiles past capacity) pair to slot tile * kGatePartsPerTile + its rank in
// the tile's cluster (rank 0 writes zeros to the slots of ranks its cluster does not have), so nothing
// has to be zeroed before the gate, and the readers sum the slots.
constexpr int kGatePartsPerTile = 16;  // the largest cluster of the decode GEMVs

struct DenseBlockTest {
  const int* block_nnz;  // [2, n_blocks]: active units, then row-tiles past the packed capacity
  int n_blocks;
  int thr_full;   // most active units a full block may have and stay sparse
  int thr_last;   // the same for the last, possibly partial, block
  int thr_heavy;  // most row-tiles past capacity a block may have and stay sparse (stragglers)
  const int2* gate_parts = nullptr;  // or, with one block: the decode gate's per-CTA pairs (cta_test only)
  int n_gate_parts = 0;
  int* totals_out = nullptr;  // where cta_test(.., true) stores the summed pairs in block_nnz's layout

  __device__ __forceinline__ bool dense_given(int blk, int nnz, int heavy) const {
    return nnz > (blk == n_blocks - 1 ? thr_last : thr_full) || heavy > thr_heavy;
  }
  // One thread's test, from block_nnz (never given gate_parts: the host checks).
  __device__ __forceinline__ bool operator()(int blk) const {
    return dense_given(blk, block_nnz[blk], block_nnz[n_blocks + blk]);
  }
#ifdef __CUDACC__
  // The same test asked by a whole CTA, which also reads gate_parts: every thread must call it (it
  // synchronizes, once per kernel) and gets the same answer. With store_totals, thread 0 also writes the
  // sums to totals_out, for the op's caller (one CTA of the grid asks that).
  __device__ __forceinline__ bool cta_test(int blk, bool store_totals) const {
    if (n_gate_parts == 0) return (*this)(blk);
    __shared__ int warp_sums[2][32];
    int nnz = 0, heavy = 0;
    for (int i = threadIdx.x; i < n_gate_parts; i += blockDim.x) {
      const int2 part = gate_parts[i];
      nnz += part.x;
      heavy += part.y;
    }
    nnz = __reduce_add_sync(0xffffffffu, nnz);
    heavy = __reduce_add_sync(0xffffffffu, heavy);
    if (threadIdx.x % 32 == 0) {
      warp_sums[0][threadIdx.x / 32] = nnz;
      warp_sums[1][threadIdx.x / 32] = heavy;
    }
    __syncthreads();
    nnz = heavy = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) {
      nnz += warp_sums[0][w];
      heavy += warp_sums[1][w];
    }
    if (store_totals && threadIdx.x == 0 && totals_out != nullptr) {
      totals_out[blk] = nnz;
      totals_out[n_blocks + blk] = heavy;
    }
    return dense_given(blk, nnz, heavy);
  }
#endif
};

// Host side, shared by every entry point that reads or writes the block counts of an M-row call.
inline void check_block_nnz(const at::Tensor& block_nnz, int64_t M, const c10::Device& device) {
  TORCH_CHECK(block_nnz.numel() == 2 * ((M + kDecisionRows - 1) / kDecisionRows) && block_nnz.is_contiguous() &&
                  block_nnz.scalar_type() == at::kInt && block_nnz.device() == device,
              "twell: block_nnz must be int32 [2 * ceil(M / 128)] on the operands' device");
}

// The decode gate's per-CTA pairs for an M-row call of n_tiles column tiles (see kGatePartsPerTile).
inline void check_gate_parts(const at::Tensor& gate_parts, int64_t M, int64_t n_tiles, const c10::Device& device) {
  TORCH_CHECK(M <= kDecisionRows, "twell: gate_parts are for calls of one decision block (at most 128 rows)");
  TORCH_CHECK(gate_parts.numel() == 2 * kGatePartsPerTile * n_tiles && gate_parts.is_contiguous() &&
                  gate_parts.scalar_type() == at::kInt && gate_parts.device() == device,
              "twell: gate_parts must be int32 [", 2 * kGatePartsPerTile, " * ceil(F / 128)] on the operands' device");
}

// Checks block_nnz and the thresholds, and builds the test the kernels make. With gate_parts (decode
// calls, see kGatePartsPerTile; gate_tiles the gate's column tiles) the kernels sum those instead;
// block_nnz need not hold anything then, and with store_totals one CTA of the reading kernel writes the
// sums there.
inline DenseBlockTest dense_block_test(const at::Tensor& block_nnz, int64_t M, const c10::Device& device,
                                       int64_t thr_full, int64_t thr_last, int64_t thr_heavy,
                                       const c10::optional<at::Tensor>& gate_parts = c10::nullopt,
                                       int64_t gate_tiles = 0, bool store_totals = false) {
  check_block_nnz(block_nnz, M, device);
  TORCH_CHECK(thr_full >= 0 && thr_last >= 0 && thr_heavy >= 0 && thr_full <= INT32_MAX && thr_last <= INT32_MAX &&
                  thr_heavy <= INT32_MAX, "twell: bad thresholds");
  DenseBlockTest test{block_nnz.data_ptr<int>(), static_cast<int>(block_nnz.numel() / 2), static_cast<int>(thr_full),
                      static_cast<int>(thr_last), static_cast<int>(thr_heavy)};
  if (gate_parts.has_value()) {
    check_gate_parts(*gate_parts, M, gate_tiles, device);
    test.gate_parts = reinterpret_cast<const int2*>(gate_parts->data_ptr<int>());
    test.n_gate_parts = static_cast<int>(gate_parts->numel() / 2);
    test.totals_out = store_totals ? block_nnz.data_ptr<int>() : nullptr;
  }
  return test;
}

}  // namespace twell
