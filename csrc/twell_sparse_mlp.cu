// Sparse up + down projections over a TwELL-packed activation.
//
// One CTA per token row (times an optional split of the output columns). For its row the CTA
//   1. turns the per-tile counts into offsets (block scan), so entries have a fixed order and the
//      result is deterministic;
//   2. gathers the row's active units into a shared-memory list, chunk by chunk: packed tiles give
//      (unit, g) straight from their slots (one word each: value bits << 16 | column in tile; a thread
//      per tile), tiles whose count overflowed the capacity are enumerated from the dense backup the
//      gate kernel wrote for them (a warp per tile; so no entry is ever lost);
//   3. gated only: each warp computes up = x . W_up[unit] (+ b_up) and h = g * up for two entries at a
//      time;
//   4. accumulates out[d] += h * W_down^T[unit, d] in fp32 over the list, then writes out (+ b_down).
// Large batches run the chunked kernel (csrc/twell_sparse_chunked.cu) instead.
// Rows of a 128-row block that the dense fallback owns (its active count above the threshold, the same
// integer test the dense-path kernels make, csrc/dense_block_test.cuh) are skipped here.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "backup_tile.cuh"
#include "cluster_launch.cuh"
#include "dense_block_test.cuh"
#include "dtype16.cuh"
#include "hopper_ptx.cuh"
#include "twell_entries.h"

namespace twell {
namespace {

constexpr int kListCap = 1024;  // active units gathered per chunk
constexpr int kMaxEntryCluster = kPortableClusterMax;  // CTAs sharing a row's entries

// VEC consecutive elements loaded as one access (16 bytes for VEC == 8).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ void load_floats(const T* __restrict__ p, float (&out)[VEC]) {
  Pack<T, VEC> pk = *reinterpret_cast<const Pack<T, VEC>*>(p);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = Dtype16<T>::to_float(pk.v[i]);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Exclusive prefix sum of the row's per-tile counts into offsets[0..n_tiles]; returns the total.
template <int kThreads>
__device__ int scan_tile_counts(const int* __restrict__ counts, int n_tiles, int* offsets, int* warp_totals) {
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int carry = 0;
  for (int base = 0; base < n_tiles; base += kThreads) {
    const int t = base + threadIdx.x;
    const int c = t < n_tiles ? counts[t] : 0;
    int incl = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += n;
    }
    if (lane == 31) warp_totals[warp] = incl;
    __syncthreads();
    int warp_prefix = 0, chunk_total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int s = warp_totals[w];
      if (w < warp) warp_prefix += s;
      chunk_total += s;
    }
    if (t < n_tiles) offsets[t] = carry + warp_prefix + incl - c;
    carry += chunk_total;
    __syncthreads();  // warp_totals is reused by the next chunk
  }
  if (threadIdx.x == 0) offsets[n_tiles] = carry;
  __syncthreads();
  return carry;
}

// kEntrySplit (decode-sized batches): a cluster of `cluster` CTAs per row instead of one CTA per row and
// column split. Each CTA of the cluster gathers the whole list but takes only its share of the entries,
// over all output columns; the partial outputs meet in shared memory and each CTA adds up its share of
// the columns over distributed shared memory, in rank order. A CTA's sequential work (its latency, which
// bounds small batches) is then a fraction of the row's entries rather than all of them.
// Past decode sizes (128 threads, a CTA per row) with at most two column groups per thread, 8 CTAs per
// SM instead of the 7 that 72 registers allow: a call of 1024 rows, which then ran in two waves of
// 924 and 100 CTAs on 132 SMs, fits in one (at the cost of a few spilled bytes).
// The entry split's 256-thread CTAs, two per SM (at most 128 registers): a 32-row call's 256 CTAs then
// run in one wave on 132 SMs, with the loads below batched (8 steps of W_up, 8 entries of W_down^T).
template <int kThreads, int NV, bool kEntrySplit>
constexpr int kSparseMinBlocks = (kThreads == 128 && NV <= 2 && !kEntrySplit) ? 8 : kEntrySplit ? 2 : 1;
// Whether a thread batches its loads (below): the entry split only, whose 128 registers hold them. At 8
// CTAs of 128 threads per SM the batch spilled; the 256-thread column splits would drop to one CTA per SM.
template <bool kEntrySplit>
constexpr bool kSparseBatchLoads = kEntrySplit;

template <typename T, int VEC, int NV, bool GATED, int kThreads, bool kEntrySplit>
__global__ void __launch_bounds__(kThreads, (kSparseMinBlocks<kThreads, NV, kEntrySplit>)) sparse_mlp_kernel(
    const T* __restrict__ x,            // [M, K] (gated only)
    const uint32_t* __restrict__ packed,  // [M, n_tiles, cap]: value bits << 16 | column in tile
    const int* __restrict__ counts,     // [M, n_tiles], true count (may exceed cap)
    const T* __restrict__ dense,        // [M, F], written only for overflowing (row, tile)
    const T* __restrict__ w_up,         // [F, K] (gated only)
    const T* __restrict__ b_up,         // [F] or null
    const T* __restrict__ w_down_t,     // [F, D]
    const T* __restrict__ b_down,       // [D] or null
    T* __restrict__ out,                // [M, D]
    int K, int D, int F, int n_tiles, int cap, int tile_n, int cols_per_split, DenseBlockTest dense_test,
    int cluster) {
  ptx::wait_for_predecessor_then_release_successor();
  const int64_t row = kEntrySplit ? blockIdx.x / cluster : blockIdx.x;  // one row per CTA (per cluster)
  const int rank = kEntrySplit ? static_cast<int>(ptx::cluster_ctarank()) : 0;
  // Rows of dense blocks belong to the dense path (the same test as its kernels). The CTAs of a
  // cluster share the row, so they leave together. Where the test sums the decode gate's per-CTA
  // pairs, the first CTA also stores the sums as the call's block totals.
  if (dense_test.cta_test(static_cast<int>(row / kDecisionRows), blockIdx.x == 0 && blockIdx.y == 0)) return;
  constexpr int kWarps = kThreads / 32;

  extern __shared__ int smem[];
  int* offsets = smem;                                   // n_tiles + 1
  int* warp_totals = offsets + n_tiles + 1;              // kWarps
  int* list_unit = warp_totals + kWarps;                 // kListCap
  float* list_h = reinterpret_cast<float*>(list_unit + kListCap);  // kListCap
  float* partial_out = list_h + kListCap;                          // D (kEntrySplit)

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int total = scan_tile_counts<kThreads>(counts + row * n_tiles, n_tiles, offsets, warp_totals);

  const int col0 = blockIdx.y * cols_per_split;
  const int col1 = min(D, col0 + cols_per_split);
  float acc[NV][VEC];
#pragma unroll
  for (int j = 0; j < NV; ++j)
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[j][v] = 0.f;

  const T* x_row = GATED ? x + row * K : nullptr;

  for (int c0 = 0; c0 < total; c0 += kListCap) {
    const int c1 = min(total, c0 + kListCap);
    // 2. gather this chunk's entries. Packed tiles: a thread per tile, its slots loaded together, so the
    // whole row's slots take one round trip to memory (a warp per tile took one per tile and warp).
    for (int t = threadIdx.x; t < n_tiles; t += kThreads) {
      const int o0 = offsets[t], o1 = offsets[t + 1];
      if (o1 - o0 > cap || o1 <= c0 || o0 >= c1) continue;
      const int64_t slot0 = (row * n_tiles + t) * cap;
      const int j_end = min(o1, c1) - o0;
      for (int j0 = max(c0 - o0, 0); j0 < j_end; j0 += 8) {
        uint32_t words[8];
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (j0 + j < j_end) words[j] = packed[slot0 + j0 + j];
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (j0 + j < j_end) {
            list_unit[o0 + j0 + j - c0] = t * tile_n + static_cast<int>(words[j] & 0xffffu);
            list_h[o0 + j0 + j - c0] = Dtype16<T>::value(words[j] >> 16);
          }
      }
    }
    // Tiles past capacity (rare): a warp each enumerates the active units of the dense backup.
    for (int t = warp; t < n_tiles; t += kWarps) {
      const int o0 = offsets[t], o1 = offsets[t + 1];
      if (o1 - o0 <= cap || o1 <= c0 || o0 >= c1) continue;
      const int tile_col0 = t * tile_n;
      for_each_backup_entry(dense + row * F + tile_col0, min(tile_n, F - tile_col0), lane,
                            [&](int k, int col, uint32_t bits) {
                              const int e = o0 + k;
                              if (e >= c0 && e < c1) {
                                list_unit[e - c0] = tile_col0 + col;
                                list_h[e - c0] = Dtype16<T>::value(bits);
                              }
                            });
    }
    __syncthreads();
    const int n = c1 - c0;
    const int lo = kEntrySplit ? n * rank / cluster : 0;  // this CTA's entries of the chunk
    const int hi = kEntrySplit ? n * (rank + 1) / cluster : n;
    // The entry split (decode sizes), gated: step 4's W_down^T rows are known now, but read only after
    // step 3's round trip to memory for W_up. Prefetched to L2 here (a 128-byte line per thread), step 4
    // finds them there or on their way instead of making a second round trip.
    if constexpr (GATED && kSparseBatchLoads<kEntrySplit>) {
      constexpr int kLineElems = 128 / static_cast<int>(sizeof(T));
      const int lines = (col1 - col0 + kLineElems - 1) / kLineElems;
      for (int i = threadIdx.x; i < (hi - lo) * lines; i += kThreads) {
        const int e = lo + i / lines, line = i % lines;
        ptx::prefetch_l2(w_down_t + static_cast<int64_t>(list_unit[e]) * D + col0 + line * kLineElems);
      }
    }

    // 3. gated: h = g * (x . W_up[unit] + b_up[unit]); a warp per two entries, whose loads interleave
    // (twice the loads in flight per lane; the second is a repeat of the first when there is none).
    if constexpr (GATED) {
      for (int e = lo + warp; e < hi; e += 2 * kWarps) {
        const int e2 = e + kWarps < hi ? e + kWarps : e;
        const T* w_row = w_up + static_cast<int64_t>(list_unit[e]) * K;
        const T* w_row2 = w_up + static_cast<int64_t>(list_unit[e2]) * K;
        float s = 0.f, s2 = 0.f;
        // The entry split (decode sizes): 8 steps a batch, the 2B shape's whole K (2048 = 8 x 32 lanes x 8)
        // at once (ptxas issues 12 loads, then the rest as the first arrive) instead of two batches of 12.
        constexpr int kUpUnroll = kSparseBatchLoads<kEntrySplit> ? 8 : 4;
#pragma unroll kUpUnroll
        for (int k = lane * VEC; k < K; k += 32 * VEC) {
          float xv[VEC], wv[VEC], wv2[VEC];
          load_floats<T, VEC>(x_row + k, xv);
          load_floats<T, VEC>(w_row + k, wv);
          load_floats<T, VEC>(w_row2 + k, wv2);
#pragma unroll
          for (int v = 0; v < VEC; ++v) {
            s = fmaf(xv[v], wv[v], s);
            s2 = fmaf(xv[v], wv2[v], s2);
          }
        }
        s = warp_sum(s);
        s2 = warp_sum(s2);
        if (lane == 0) {
          // Eager rounds up(x) to the input dtype before the product; do the same.
          const int unit = list_unit[e], unit2 = list_unit[e2];
          const float up = s + (b_up != nullptr ? Dtype16<T>::to_float(b_up[unit]) : 0.f);
          const float up2 = s2 + (b_up != nullptr ? Dtype16<T>::to_float(b_up[unit2]) : 0.f);
          const float g = list_h[e], g2 = list_h[e2];
          list_h[e] = g * Dtype16<T>::to_float(Dtype16<T>::from_float(up));
          if (e2 != e) list_h[e2] = g2 * Dtype16<T>::to_float(Dtype16<T>::from_float(up2));
        }
      }
      __syncthreads();
    }

    // 4. out[col] += h * W_down^T[unit, col] over the chunk.
    // One column group per thread (small batches, many column splits): twice the loads in flight, since
    // there latency rather than L2 throughput bounds the loop.
    constexpr int kDownUnroll = NV == 1 ? 8 : 4;
    if constexpr (kSparseBatchLoads<kEntrySplit>) {
      // The entry split (decode sizes): kDownUnroll entries at a time, all their loads issued first.
      // Nothing may branch between those loads: with a bounds test per entry and column group (the
      // loop below), ptxas issued one load, waited for it, then issued the next, one round trip to
      // memory per entry. So an entry past the chunk's end loads the chunk's first entry's row
      // again and adds nothing, and a column group past col1 loads column 0 and is never stored. The
      // sums run in the same order as one entry at a time.
      int load_col[NV];
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int col = col0 + (j * kThreads + threadIdx.x) * VEC;
        load_col[j] = col < col1 ? col : 0;
      }
      for (int e0 = lo; e0 < hi; e0 += kDownUnroll) {
        Pack<T, VEC> wv[kDownUnroll][NV];
        float h[kDownUnroll];
#pragma unroll
        for (int u = 0; u < kDownUnroll; ++u) {
          const bool live = e0 + u < hi;
          h[u] = live ? list_h[e0 + u] : 0.f;
          const T* d_row = w_down_t + static_cast<int64_t>(list_unit[live ? e0 + u : lo]) * D;
#pragma unroll
          for (int j = 0; j < NV; ++j) wv[u][j] = *reinterpret_cast<const Pack<T, VEC>*>(d_row + load_col[j]);
        }
#pragma unroll
        for (int u = 0; u < kDownUnroll; ++u) {
          if (e0 + u < hi) {
#pragma unroll
            for (int j = 0; j < NV; ++j)
#pragma unroll
              for (int v = 0; v < VEC; ++v) acc[j][v] = fmaf(h[u], Dtype16<T>::to_float(wv[u][j].v[v]), acc[j][v]);
          }
        }
      }
    } else {
      // Past decode sizes, many CTAs per SM hide the latency (and the batch above would spill or cost
      // occupancy, kSparseBatchLoads).
#pragma unroll kDownUnroll
      for (int e = lo; e < hi; ++e) {
        const float h = list_h[e];
        const T* d_row = w_down_t + static_cast<int64_t>(list_unit[e]) * D;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          const int col = col0 + (j * kThreads + threadIdx.x) * VEC;
          if (col < col1) {
            float wv[VEC];
            load_floats<T, VEC>(d_row + col, wv);
#pragma unroll
            for (int v = 0; v < VEC; ++v) acc[j][v] = fmaf(h, wv[v], acc[j][v]);
          }
        }
      }
    }
    __syncthreads();  // the next chunk overwrites the list
  }

  if constexpr (kEntrySplit) {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int col = (j * kThreads + threadIdx.x) * VEC;
      if (col < D) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) partial_out[col + v] = acc[j][v];
      }
    }
    ptx::cluster_sync();  // every CTA's partial is written and visible to the cluster
    const int per_cta = (D + cluster - 1) / cluster;
    const int end = min(D, (rank + 1) * per_cta);
    for (int col = rank * per_cta + threadIdx.x; col < end; col += kThreads) {
      float parts[kMaxEntryCluster];  // all loads first, then the sum in rank order (the same on every run)
#pragma unroll
      for (int cta = 0; cta < kMaxEntryCluster; ++cta)
        if (cta < cluster) parts[cta] = ptx::ld_shared_cluster_f32(&partial_out[col], static_cast<uint32_t>(cta));
      float sum = 0.f;
#pragma unroll
      for (int cta = 0; cta < kMaxEntryCluster; ++cta)
        if (cta < cluster) sum += parts[cta];
      out[row * D + col] = Dtype16<T>::from_float(sum + (b_down != nullptr ? Dtype16<T>::to_float(b_down[col]) : 0.f));
    }
    ptx::cluster_sync_before_exit();  // no CTA leaves while another may still read its partial
  } else {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int col = col0 + (j * kThreads + threadIdx.x) * VEC;
      if (col < col1) {
        Pack<T, VEC> pk;
#pragma unroll
        for (int v = 0; v < VEC; ++v)
          pk.v[v] = Dtype16<T>::from_float(acc[j][v] + (b_down != nullptr ? Dtype16<T>::to_float(b_down[col + v]) : 0.f));
        *reinterpret_cast<Pack<T, VEC>*>(out + row * D + col) = pk;
      }
    }
  }
}

template <typename T>
const T* ptr_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? reinterpret_cast<const T*>(t->data_ptr()) : nullptr;
}


// Bytes of the opt-in shared memory limit left for the sparse kernel's static shared memory (it uses
// a few hundred).
constexpr size_t kStaticSmemReserve = 1024;

// Dynamic shared memory of a sparse CTA: tile offsets, warp totals, the entry list, and the entry
// split's partial output row (partial_cols floats; 0 without it).
size_t sparse_smem_bytes(int64_t n_tiles, int threads, int64_t partial_cols) {
  return sizeof(int) * (n_tiles + 1 + threads / 32 + kListCap) + sizeof(float) * (kListCap + partial_cols);
}

// The entry split's cluster size for M rows: the largest, from `requested` down to 2, whose M clusters
// are all resident at once. The hardware places a cluster's CTAs within one GPC, so two 256-thread CTAs
// per SM on 132 SMs may hold fewer clusters of 8 than 264 / 8 (a GPC whose slots are not a multiple of
// 8 wastes the rest); the rows past what fits would then run as a second wave. A smaller
// cluster gives each CTA more of its row's entries, which it takes in the same pass (up to 16 entries
// for the up projection's 8 warps, 8 per batch of W_down^T loads), so it costs little. The occupancy
// query is made once per device and shape (KernelLaunch::resident_clusters); where even clusters of 2
// do not all fit, the requested size stays.
template <typename Kernel>
int resident_entry_cluster(Kernel kernel, int64_t rows, int threads, size_t smem, int requested) {
  for (int cluster = requested; cluster >= 2; --cluster) {
    const KernelLaunch probe(kernel, dim3(static_cast<unsigned>(rows * cluster)), threads, smem, cluster);
    if (probe.resident_clusters() >= rows) return cluster;
  }
  return requested;
}

template <typename T, int VEC, int NV, bool GATED, int kThreads, bool kEntrySplit>
void launch(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& counts,
            const at::Tensor& dense, const DenseBlockTest& dense_test, const c10::optional<at::Tensor>& w_up,
            const c10::optional<at::Tensor>& b_up, const at::Tensor& w_down_t,
            const c10::optional<at::Tensor>& b_down, at::Tensor& out, int tile_n, int splits, int cluster) {
  const int64_t M = out.size(0);
  const int D = static_cast<int>(out.size(1));
  const int F = static_cast<int>(w_down_t.size(0));
  const int K = GATED ? static_cast<int>(x.size(1)) : 0;
  const int n_tiles = static_cast<int>(counts.size(1));
  const int cap = static_cast<int>(packed.size(2));
  int cols_per_split = (D + splits - 1) / splits;
  cols_per_split = (cols_per_split + VEC - 1) / VEC * VEC;
  const size_t smem = sparse_smem_bytes(n_tiles, kThreads, kEntrySplit ? D : 0);
  auto kernel = sparse_mlp_kernel<T, VEC, NV, GATED, kThreads, kEntrySplit>;
  if constexpr (kEntrySplit) cluster = resident_entry_cluster(kernel, M, kThreads, smem, cluster);
  const dim3 grid = kEntrySplit ? dim3(static_cast<unsigned>(M * cluster))
                                : dim3(static_cast<unsigned>(M), static_cast<unsigned>(splits));
  const KernelLaunch kernel_launch(kernel, grid, kThreads, smem, kEntrySplit ? cluster : 1);
  kernel_launch.run(
      kernel, GATED ? reinterpret_cast<const T*>(x.data_ptr()) : nullptr,
      reinterpret_cast<const uint32_t*>(packed.data_ptr<int>()), static_cast<const int*>(counts.data_ptr<int>()),
      reinterpret_cast<const T*>(dense.data_ptr()), GATED ? ptr_or_null<T>(w_up) : nullptr, ptr_or_null<T>(b_up),
      reinterpret_cast<const T*>(w_down_t.data_ptr()), ptr_or_null<T>(b_down), reinterpret_cast<T*>(out.data_ptr()),
      K, D, F, n_tiles, cap, tile_n, kEntrySplit ? D : cols_per_split, dense_test, kEntrySplit ? cluster : 1);
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}, std::bool_constant<gated>{}) for the call's 16-bit dtype and gating, so one
// dispatch serves the launch and the cluster query alike.
template <typename F>
decltype(auto) with_dtype_and_gating(bool float16, bool gated, F&& f) {
  if (float16) return gated ? f(TypeTag<__half>{}, std::true_type{}) : f(TypeTag<__half>{}, std::false_type{});
  return gated ? f(TypeTag<__nv_bfloat16>{}, std::true_type{}) : f(TypeTag<__nv_bfloat16>{}, std::false_type{});
}

// Calls f(std::integral_constant<int, NV>{}) for the column groups a thread covers: 1, 2 or 4.
template <typename F>
decltype(auto) with_column_groups(int64_t groups, F&& f) {
  if (groups <= 1) return f(std::integral_constant<int, 1>{});
  if (groups <= 2) return f(std::integral_constant<int, 2>{});
  return f(std::integral_constant<int, 4>{});
}

// Picks the vector width (16-byte accesses when every row is 16-byte aligned) and the number of
// column groups per thread from the columns one CTA covers. cluster > 1 asks for the entry split, which
// the caller (twell_mlp.py, which also sets the dense-path thresholds for it) chooses only where it
// fits: 256 threads, one CTA holding all the columns, no column splits; anything else is an error.
template <typename T, bool GATED, int kThreads>
void dispatch_shape(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& counts,
                    const at::Tensor& dense, const DenseBlockTest& dense_test, const c10::optional<at::Tensor>& w_up,
                    const c10::optional<at::Tensor>& b_up, const at::Tensor& w_down_t,
                    const c10::optional<at::Tensor>& b_down, at::Tensor& out, int tile_n, int splits, int cluster) {
  const int64_t D = out.size(1);
  bool vec8 = D % 8 == 0 && aligned16(w_down_t.data_ptr()) && aligned16(out.data_ptr());
  if (GATED) vec8 = vec8 && x.size(1) % 8 == 0 && aligned16(x.data_ptr()) && aligned16(w_up->data_ptr());
  const int vec = vec8 ? 8 : 1;
  const auto groups_for = [&](int64_t cols) {
    return (cols + static_cast<int64_t>(kThreads) * vec - 1) / (static_cast<int64_t>(kThreads) * vec);
  };
  const bool entry_split = cluster > 1;
  TORCH_CHECK(!entry_split || (kThreads == 256 && groups_for(D) <= 4 && splits == 1),
              "twell: the entry split (cluster > 1) needs 256 threads, no column splits, and at most ",
              4 * kThreads * vec, " output columns at this alignment; got ", D);
  const int64_t cols = entry_split ? D : (D + splits - 1) / splits;
  const int64_t groups = groups_for(cols);
  TORCH_CHECK(groups <= 4, "twell: internal error, too many output columns per CTA; raise splits");
  const auto launch_shape = [&](auto vec, auto groups_c) {
    constexpr int V = decltype(vec)::value, NV = decltype(groups_c)::value;
    if constexpr (kThreads == 256) {
      if (entry_split) {
        launch<T, V, NV, GATED, kThreads, true>(x, packed, counts, dense, dense_test, w_up, b_up, w_down_t, b_down,
                                               out, tile_n, 1, cluster);
        return;
      }
    }
    launch<T, V, NV, GATED, kThreads, false>(x, packed, counts, dense, dense_test, w_up, b_up, w_down_t, b_down, out,
                                            tile_n, splits, 1);
  };
  with_column_groups(groups, [&](auto groups_c) {
    if (vec8) {
      launch_shape(std::integral_constant<int, 8>{}, groups_c);
    } else {
      launch_shape(std::integral_constant<int, 1>{}, groups_c);
    }
  });
}

}  // namespace

// Whether a sparse launch over n_tiles TwELL tiles and D output columns fits the current device's shared
// memory, for its largest variant (256 threads, and the entry split's partial row wherever D allows the
// split: at most 4 groups of 8 columns per thread), with kStaticSmemReserve bytes left for the kernel's
// static shared memory. The tile offsets grow with F: on an H200, at 64-column tiles, this fails from F of
// about 3.0-3.6 million (by D) up, far past any model's, and the host sends such calls to cuBLAS
// (_kernels_fit in twell_mlp.py).
bool sparse_mlp_fits(int64_t n_tiles, int64_t D) {
  if (n_tiles < 1 || D < 1 || n_tiles > (int64_t{1} << 30)) return false;
  const int64_t partial_cols = D <= 4 * 256 * 8 ? D : 0;
  return sparse_smem_bytes(n_tiles, 256, partial_cols) + kStaticSmemReserve <= current_device_optin_smem();
}

// Fills the rows of `out` whose decision block is sparse; see the file comment.
void sparse_mlp_out(const c10::optional<at::Tensor>& x, const at::Tensor& packed, const at::Tensor& counts, const at::Tensor& dense, const at::Tensor& block_nnz,
                    const c10::optional<at::Tensor>& w_up, const c10::optional<at::Tensor>& b_up,
                    const at::Tensor& w_down_t, const c10::optional<at::Tensor>& b_down, at::Tensor& out,
                    int64_t tile_n, int64_t splits, int64_t threads, int64_t thr_full, int64_t thr_last,
                    int64_t thr_heavy, int64_t cluster, const c10::optional<at::Tensor>& gate_parts) {
  const bool gated = w_up.has_value();
  TORCH_CHECK(cluster >= 1 && cluster <= kMaxEntryCluster, "twell: cluster must be in [1, 8]");
  TORCH_CHECK(threads == 128 || threads == 256, "twell: threads must be 128 or 256");
  TORCH_CHECK(!gated || x.has_value(), "twell: the gated kernel needs x");
  TORCH_CHECK(packed.is_cuda() && packed.scalar_type() == at::kInt && packed.is_contiguous() && packed.dim() == 3,
              "twell: packed must be a contiguous int32 CUDA [M, tiles, cap] tensor");
  TORCH_CHECK(counts.scalar_type() == at::kInt && counts.is_contiguous() && counts.size(0) == packed.size(0) &&
              counts.size(1) == packed.size(1), "twell: counts must be int32 [M, tiles]");
  // Given the decode gate's per-CTA pairs, the kernel sums them and writes block_nnz itself.
  const DenseBlockTest dense_test = dense_block_test(block_nnz, packed.size(0), packed.device(), thr_full, thr_last,
                                                     thr_heavy, gate_parts, packed.size(1), /*store_totals=*/true);
  TORCH_CHECK(w_down_t.is_contiguous() && dense.is_contiguous() && out.is_contiguous(), "twell: w_down_t, dense and out must be contiguous");
  TORCH_CHECK(dense.size(1) == w_down_t.size(0) && out.size(1) == w_down_t.size(1), "twell: dense/out/w_down_t shapes disagree");
  TORCH_CHECK(tile_n >= 1 && tile_n <= 256, "twell: tile_n must be in [1, 256]");
  TORCH_CHECK(splits >= 1 && splits <= 65535, "twell: splits out of range");
  TORCH_CHECK(packed.size(0) <= 0x7fffffff, "twell: too many rows");
  if (gated) {
    TORCH_CHECK(x->is_contiguous() && w_up->is_contiguous() && x->size(1) == w_up->size(1), "twell: x / w_up shapes disagree");
  }
  if (out.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const at::Tensor empty;
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf,
              "twell: the CUDA kernels take bfloat16 or float16, got ", out.scalar_type());
  with_dtype_and_gating(out.scalar_type() == at::kHalf, gated, [&](auto dtype, auto gated_c) {
    using T = typename decltype(dtype)::type;
    constexpr bool G = decltype(gated_c)::value;
    const at::Tensor& x_or_empty = G ? *x : empty;
    if (threads == 128) {
      dispatch_shape<T, G, 128>(x_or_empty, packed, counts, dense, dense_test, w_up, b_up, w_down_t, b_down, out,
                                static_cast<int>(tile_n), static_cast<int>(splits), static_cast<int>(cluster));
    } else {
      dispatch_shape<T, G, 256>(x_or_empty, packed, counts, dense, dense_test, w_up, b_up, w_down_t, b_down, out,
                                static_cast<int>(tile_n), static_cast<int>(splits), static_cast<int>(cluster));
    }
  });
}

// The cluster size an entry-split launch of M rows takes on the current device (resident_entry_cluster),
// for 16-byte rows: what the launch above would pick, for tests and probes.
int64_t sparse_entry_cluster(int64_t M, int64_t n_tiles, int64_t D, int64_t requested, bool gated, bool float16) {
  TORCH_CHECK(M >= 1 && M <= 0x7fffffff && n_tiles >= 1 && D >= 8 && D % 8 == 0 && D <= 4 * 256 * 8,
              "twell: sparse_entry_cluster takes M >= 1, n_tiles >= 1 and D a multiple of 8 up to 8192");
  TORCH_CHECK(requested >= 2 && requested <= kMaxEntryCluster, "twell: requested cluster must be in [2, 8]");
  const int groups = static_cast<int>((D + 256 * 8 - 1) / (256 * 8));
  const size_t smem = sparse_smem_bytes(n_tiles, 256, D);
  const int want = static_cast<int>(requested);
  return with_dtype_and_gating(float16, gated, [&](auto dtype, auto gated_c) {
    return with_column_groups(groups, [&](auto groups_c) {
      using T = typename decltype(dtype)::type;
      auto kernel = sparse_mlp_kernel<T, 8, decltype(groups_c)::value, decltype(gated_c)::value, 256, true>;
      return resident_entry_cluster(kernel, M, 256, smem, want);
    });
  });
}

}  // namespace twell
