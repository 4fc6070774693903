// The per-128-row-block choice between the sparse and the dense path, made on the device from the
// counts the gate GEMM accumulated. Every kernel that owns part of a block's work asks this same
// integer test, so each output row is written by exactly one path and the host never syncs to decide.
#pragma once

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

}  // namespace twell
