// One host call for the whole CUDA path of a twell MLP call: the buffers, the gate, the sparse kernel
// and the dense path, in the order twell_compile/kernels/twell_mlp.py documents. Doing this in C++
// instead of five Python-level calls takes most of the host time off a decode-sized call (eager
// mode, or torch.compile without CUDA graphs), where the host, not the GPU, sets the pace.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include "cluster_launch.cuh"
#include "dense_block_test.cuh"
#include "twell_entries.h"

namespace twell {
namespace {

bool contiguous_or_absent(const c10::optional<at::Tensor>& t) { return !t.has_value() || t->is_contiguous(); }

// Arrival counters the wgmma GEMM of C [M, N] over a reduction of length K needs: one per output tile
// where it splits K (csrc/twell_gemm.cu makes the same choice); for a dense-path GEMM (`tile_m` its
// schedule) that may split K by itself where few tiles are dense, the room it is given; else none.
int64_t split_counters(const MlpPlan& plan, int64_t M, int64_t N, int64_t K) {
  const KSplit split = choose_k_split(M, N, K, plan.ctas, plan.gemm_k_splits);
  return split.splits > 1 ? split.tiles : 0;
}
int64_t dense_path_counters(const MlpPlan& plan, int64_t M, int64_t N, int64_t K, int64_t tile_m) {
  return split_counters(plan, M, N, K) + adaptive_split_room(M, N, K, plan.ctas, tile_m, plan.gemm_k_splits);
}

// Work queued on `later` after this waits for the work queued on `earlier` so far: a fork or a join.
// (The event may go once recorded: the wait already holds the order.)
void order_after(const c10::cuda::CUDAStream& earlier, const c10::cuda::CUDAStream& later) {
  at::cuda::CUDAEvent event;
  event.record(earlier);
  event.block(later);
}

c10::optional<at::Tensor> counters_at(const at::Tensor& zeroed, int64_t offset, int64_t count) {
  return count > 0 ? c10::optional<at::Tensor>(zeroed.narrow(0, offset, count)) : c10::nullopt;
}

}  // namespace

std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> mlp_forward(
    const MlpPlan& plan, const at::Tensor& x, const at::Tensor& w_act, const c10::optional<at::Tensor>& b_act,
    const c10::optional<at::Tensor>& w_up, const c10::optional<at::Tensor>& b_up, const at::Tensor& w_down,
    const at::Tensor& w_down_t, const c10::optional<at::Tensor>& b_down,
    const c10::optional<at::Tensor>& w_up_sliced, const c10::optional<at::Tensor>& w_down_sliced) {
  const bool gated = w_up.has_value();
  if (!aligned_rows(x) || !aligned_rows(w_act) || !aligned_rows(w_down) || (gated && !aligned_rows(*w_up)) ||
      (w_down.size(0) * w_down.element_size()) % 16 != 0 || !contiguous_or_absent(b_act) ||
      !contiguous_or_absent(b_up) || !contiguous_or_absent(b_down)) {
    // (w_down's aligned rows make F % 8 == 0, so the hidden buffer's rows are aligned; the output's
    // need D % 8 == 0.)
    return std::nullopt;
  }
  TORCH_CHECK(x.is_cuda(), "twell: mlp_forward takes CUDA tensors");
  TORCH_CHECK(plan.chunked == w_down_sliced.has_value() && (!plan.chunked || gated == w_up_sliced.has_value()),
              "twell: mlp_forward takes the sliced weights exactly when the plan is chunked");
  const c10::cuda::CUDAGuard guard(x.device());
  const ProgrammaticLaunchScope programmatic(plan.programmatic);
  const int64_t M = x.size(0), F = w_act.size(0), D = w_down.size(0);
  const int64_t n_tiles = (F + plan.tile_n - 1) / plan.tile_n;
  const int64_t n_blocks = (M + kDecisionRows - 1) / kDecisionRows;
  const auto ints = x.options().dtype(at::kInt);
  // One memset zeroes every counter of the call: the block totals (active units; row-tiles past
  // capacity), then the wgmma GEMMs' K-split arrivals (gate, gate times up, down), then the chunked
  // kernel's counters (heavy rows it lists, blocks it first finds dense).
  const int64_t K = x.size(1);
  const int64_t gate_arrivals = plan.decode_gate ? 0 : split_counters(plan, M, F, K);
  const int64_t up_arrivals = plan.decode_dense || !gated ? 0 : dense_path_counters(plan, M, F, K, plan.gemm_tile_m);
  const int64_t down_arrivals = plan.decode_dense ? 0 : dense_path_counters(plan, M, D, F, plan.down_gemm_tile_m);
  const int64_t heavy_at = 2 * n_blocks + gate_arrivals + up_arrivals + down_arrivals;
  const int64_t n_counters = heavy_at + (plan.chunked ? 2 : 0);
  // Decode calls whose kernels all read the decode gate's per-CTA pairs (dense_block_test.cuh) have
  // nothing else to zero: no memset before the gate, and the sparse kernel writes the block totals.
  // (Such a call has no K-split or chunked counters: its only counters are the block totals.) The
  // pairs follow the counters in the same buffer, which leaves them 8-byte aligned.
  const bool parts_only = plan.decode_gate && plan.decode_dense && plan.gate_parts && !plan.chunked;
  TORCH_INTERNAL_ASSERT(!parts_only || n_counters == 2 * n_blocks);
  const int64_t n_parts = parts_only ? 2 * kGatePartsPerTile * n_tiles : 0;
  // The output, and one allocation carved into every other buffer of the call (the dense backup, the
  // packed activation, its counts, the counters): at decode sizes each allocation is host time.
  at::Tensor out = at::empty({M, D}, x.options());
  const auto padded = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };  // each part 256-byte aligned
  const int64_t dense_bytes = M * F * x.element_size();
  const int64_t packed_at = padded(dense_bytes);
  const int64_t counts_at = packed_at + padded(M * n_tiles * plan.cap * 4);
  const int64_t work_at = counts_at + padded(M * n_tiles * 4);
  const at::Tensor buffer = at::empty({work_at + (n_counters + n_parts) * 4}, x.options().dtype(at::kByte));
  const auto part = [&](int64_t at, int64_t bytes, c10::ScalarType type) { return buffer.narrow(0, at, bytes).view(type); };
  at::Tensor dense = part(0, dense_bytes, x.scalar_type()).view({M, F});
  at::Tensor packed = part(packed_at, M * n_tiles * plan.cap * 4, at::kInt).view({M, n_tiles, plan.cap});
  at::Tensor counts = part(counts_at, M * n_tiles * 4, at::kInt).view({M, n_tiles});
  const at::Tensor work = part(work_at, (n_counters + n_parts) * 4, at::kInt);
  at::Tensor zeroed = work.narrow(0, 0, n_counters);
  c10::optional<at::Tensor> gate_parts;
  if (parts_only) {
    gate_parts = work.narrow(0, n_counters, n_parts);
  } else {
    C10_CUDA_CHECK(cudaMemsetAsync(zeroed.data_ptr(), 0, zeroed.nbytes(), c10::cuda::getCurrentCUDAStream()));
  }
  at::Tensor block_nnz = zeroed.narrow(0, 0, 2 * n_blocks);
  const int64_t up_at = 2 * n_blocks + gate_arrivals, down_at = up_at + up_arrivals;
  if (plan.poison) {
    out.fill_(std::numeric_limits<double>::quiet_NaN());
    dense.fill_(std::numeric_limits<double>::quiet_NaN());
    packed.fill_(plan.poison_word);
    counts.fill_(plan.poison_count);
  }

  if (plan.decode_gate) {
    decode_gate_twell(x, w_act, b_act, packed, counts, dense, block_nnz, plan.gemv_cluster, gate_parts);
  } else {
    gate_twell_gemm(x, w_act, b_act, packed, counts, dense, block_nnz, plan.ctas, plan.gate_gemm_cluster,
                    plan.gate_gemm_tile_m, plan.gemm_k_splits, counters_at(zeroed, 2 * n_blocks, gate_arrivals));
  }
  // Decode-sized calls captured into a CUDA graph run the dense path on a branch of the graph forked
  // here, after the gate, and joined at the end: in a sparse call its two GEMVs only read the block
  // test and exit, and on the branch they do so beside the sparse kernel instead of as two more
  // dependent launches after it. H200, 38-layer 2B decode step: 1.3-1.7 us a layer (of the 2.6-2.8
  // that leaving the two launches out altogether saved). Eagerly the fork's event calls would cost
  // the host more than that, and decode there is host-bound: eager calls never fork.
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
  c10::optional<c10::cuda::CUDAStream> branch;
  if (plan.decode_dense && plan.dense_path_branch &&
      c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::Active) {
    // The pool hands its streams out in turn, and a capture itself runs on one of them: never the same.
    branch = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, x.device().index());
    if (*branch == stream) branch = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, x.device().index());
    order_after(stream, *branch);
  }
  const c10::optional<at::Tensor> x_if_gated = gated ? c10::optional<at::Tensor>(x) : c10::nullopt;
  // Sparse blocks' rows: the chunked kernel, which decides the blocks' paths itself (into `decided`,
  // read below in place of block_nnz) and lists its heavy rows for the compact dense path; or the
  // row-by-row kernel.
  at::Tensor path_nnz = block_nnz;
  int64_t thr_full = plan.thr_full, thr_last = plan.thr_last, thr_heavy = plan.thr_heavy;
  if (plan.chunked) {
    at::Tensor decided = at::empty({2 * n_blocks}, ints);
    at::Tensor heavy_rows = at::empty({chunked_heavy_capacity(M, plan.thr_heavy)}, ints);
    at::Tensor chunk_counters = zeroed.narrow(0, heavy_at, 2);  // heavy rows listed, dense blocks
    chunked_sparse_mlp_out(x_if_gated, packed, counts, dense, w_up_sliced, b_up, *w_down_sliced, b_down, out, decided,
                           heavy_rows, chunk_counters, plan.tile_n, plan.thr_full, plan.thr_last, plan.thr_heavy, plan.ctas);
    heavy_rows_mlp_out(x_if_gated, packed, counts, dense, heavy_rows, chunk_counters.narrow(0, 0, 1), w_up, b_up, w_down, b_down, out,
                       plan.ctas, plan.gemm_cluster, plan.gemm_tile_m, plan.down_gemm_tile_m, plan.gemm_k_splits);
    path_nnz = decided;
    thr_full = thr_last = 0;  // decided: 1 for a dense block, 0 otherwise
    thr_heavy = INT32_MAX;
  } else {
    sparse_mlp_out(x_if_gated, packed, counts, dense, block_nnz, w_up, b_up, w_down_t, b_down, out, plan.tile_n,
                   plan.sparse_splits, plan.sparse_threads, plan.thr_full, plan.thr_last, plan.thr_heavy,
                   plan.sparse_cluster, gate_parts);
  }

  // Dense path for the blocks too dense to pay (its kernels skip the others): h = relu(gate) * up in
  // place in `dense` (non-gated: relu(up) expanded there), then out = h W_down^T.
  // The first launch on a branch follows an event, not a kernel: no programmatic edge to take there.
  const bool first_launch_programmatic = plan.programmatic && !branch.has_value();
  const auto dense_path = [&]() {
    {
      const ProgrammaticLaunchScope first(first_launch_programmatic);
      if (gated && plan.decode_dense) {
        decode_dense_gemv(x, *w_up, b_up, dense, path_nnz, packed, counts, thr_full, thr_last, thr_heavy,
                          plan.gemv_cluster, gate_parts);
      } else if (gated) {
        dense_block_gemm(x, *w_up, b_up, dense, path_nnz, packed, counts, thr_full, thr_last, thr_heavy, plan.ctas,
                         plan.gemm_cluster, plan.gemm_tile_m, plan.gemm_k_splits,
                         counters_at(zeroed, up_at, up_arrivals));
      } else {
        rebuild_dense_gate(packed, counts, dense, path_nnz, thr_full, thr_last, thr_heavy, gate_parts);
      }
    }
    if (plan.decode_dense) {
      decode_dense_gemv(dense, w_down, b_down, out, path_nnz, c10::nullopt, c10::nullopt, thr_full, thr_last, thr_heavy,
                        plan.gemv_cluster, gate_parts);
    } else {
      dense_block_gemm(dense, w_down, b_down, out, path_nnz, c10::nullopt, c10::nullopt, thr_full, thr_last, thr_heavy,
                       plan.ctas, plan.gemm_cluster, plan.down_gemm_tile_m, plan.gemm_k_splits,
                       counters_at(zeroed, down_at, down_arrivals));
    }
  };
  if (branch.has_value()) {
    {
      const c10::cuda::CUDAStreamGuard on_branch(*branch);
      dense_path();
    }
    order_after(*branch, stream);
  } else {
    dense_path();
  }
  return std::make_tuple(out, counts, path_nnz);
}

}  // namespace twell
