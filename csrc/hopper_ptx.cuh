// Thin wrappers over the Hopper (sm_90a) PTX the kernels need: mbarriers, TMA tensor loads (also
// multicast to a cluster) and bulk copies, distributed shared memory, warpgroup MMA (wgmma) and its shared-memory matrix
// descriptors, warp-level MMA (mma.sync, the decode GEMV), register reallocation.
// Semantics are the PTX ISA's; names follow the instructions so the kernel reads like the ISA guide.
#pragma once

#include <cstdint>

namespace twell {
namespace ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier -------------------------------------------------------------------------------------
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}

// Makes the initialised barriers visible to the async proxy (TMA) before first use.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}" ::"r"(smem_addr(bar)) : "memory");
}

// Arrives and announces `bytes` of transactions (the TMA loads that complete this phase).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}"
               ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// Arrives on the barrier at the same shared-memory offset in CTA `cta` of the cluster (the consumer's
// release of a stage its peer multicasts into). Default .release.cta semantics, as CUTLASS's cluster
// barrier: the stage was read by wgmma, which has completed, so there are no pending writes to order.
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(smem_addr(bar)), "r"(cta)
      : "memory");
}

// Spins until the phase with the given parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}

// ---- shared memory by 32-bit address ----------------------------------------------------------------
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

__device__ __forceinline__ uint32_t ld_shared_u16(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void st_shared_u16(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(static_cast<uint16_t>(v)) : "memory");
}

// ---- TMA ------------------------------------------------------------------------------------------
// 2-D tile load; coordinates are (innermost, outer) in elements. Out-of-bounds elements are zero-filled.
__device__ __forceinline__ void tma_load_2d(void* dst, const void* tensor_map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem_addr(dst)), "l"(tensor_map), "r"(smem_addr(bar)), "r"(c0), "r"(c1) : "memory");
}

// The same, multicast: the tile lands at the same shared-memory offset, and completes the barrier at the
// same offset, in every CTA of the cluster named in cta_mask.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const void* tensor_map, uint64_t* bar, int c0, int c1,
                                                      uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;"
      ::"r"(smem_addr(dst)), "l"(tensor_map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "h"(cta_mask) : "memory");
}

// 1-D bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared
// memory, completing `bytes` of the barrier's transactions.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

// Stores four 8 x 8 matrices of 16-bit values from the mma fragment layout (thread l holds row l / 4,
// columns 2 (l % 4) and the next, of each matrix) to shared memory: lanes 8 i .. 8 i + 7 give the
// addresses of matrix i's rows. A quarter of the instructions of per-pair 32-bit stores.
__device__ __forceinline__ void stmatrix_x4(uint32_t row_addr, uint32_t m0, uint32_t m1, uint32_t m2, uint32_t m3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(row_addr), "r"(m0), "r"(m1),
               "r"(m2), "r"(m3)
               : "memory");
}

// ---- named barriers -------------------------------------------------------------------------------
// Barrier `id` (1-15; 0 is __syncthreads) over `threads` threads (a multiple of 32): one warpgroup can
// synchronise without the rest of the CTA.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- clusters -------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// Every thread of every CTA of the cluster.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The two halves of a cluster barrier, apart, so that work goes on between them. The arrival orders
// nothing before it (relaxed): it says only that this CTA has started, so that peers may write into its
// shared memory once their wait returns.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }

// The last barrier of a kernel whose CTAs read each other's shared memory with loads (ld.shared::cluster),
// so that none exits while a peer may still read it; every thread of every CTA of the cluster. A thread
// has used the values of its remote loads before it gets here (its stores of their sums come first), so
// its arrival orders nothing and needs no release: the release form compiles to a MEMBAR.ALL.GPU that makes
// each thread wait for its global stores to complete before it arrives. Not for clusters whose CTAs
// write to each other (TMA multicast, remote mbarrier arrivals): those need cluster_sync.
__device__ __forceinline__ void cluster_sync_before_exit() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;" ::: "memory");
}

// Reads the float at the same shared-memory offset in CTA `cta` of the cluster (distributed shared memory).
__device__ __forceinline__ float ld_shared_cluster_f32(const void* local, uint32_t cta) {
  float v;
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %1, %2;\n"
      "ld.shared::cluster.f32 %0, [remote];\n}"
      : "=f"(v) : "r"(smem_addr(local)), "r"(cta) : "memory");
  return v;
}

// Reads 4 floats at the same shared-memory offset in CTA `cta` of the cluster (distributed shared memory).
__device__ __forceinline__ float4 ld_shared_cluster_v4(const void* local, uint32_t cta) {
  float4 v;
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %4, %5;\n"
      "ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [remote];\n}"
      : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(smem_addr(local)), "r"(cta) : "memory");
  return v;
}

// Writes 4 floats (16-byte aligned) at the same shared-memory offset in CTA `cta` of the cluster
// (distributed shared memory). A posted store: the thread goes on at once, and a later release
// (cluster_sync) publishes it.
__device__ __forceinline__ void st_shared_cluster_v4(const void* local, uint32_t cta, float4 v) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "st.shared::cluster.v4.f32 [remote], {%2, %3, %4, %5};\n}"
      ::"r"(smem_addr(local)), "r"(cta), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}

__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(tensor_map) : "memory");
}

// ---- programmatic dependent launch ----------------------------------------------------------------
// Every kernel launched by KernelLaunch (csrc/cluster_launch.cuh) starts with this, before it touches
// global memory. With programmatic launches on, the kernel may be scheduled while the one before it in
// the stream still runs; `griddepcontrol.wait` holds it until that grid has completed and its writes
// are visible, so what it reads (and overwrites) is as if launched normally. Because every such kernel
// waits before it can finish, a grid's completion still implies its predecessors' (the next normal
// launch relies on that). Then it lets its own successor start launching, so that launch's latency
// overlaps this kernel's run. Both are no-ops in a normal launch.
__device__ __forceinline__ void wait_for_predecessor_then_release_successor() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// ---- L2 prefetch ------------------------------------------------------------------------------------
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// ---- register reallocation between warpgroups --------------------------------------------------------
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs)); }
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs)); }

// ---- mma.sync (warp-level tensor-core MMA) ---------------------------------------------------------
// d[16x8] += A[16x16] . B[16x8], fp32 accumulators. Lane l (g = l / 4, q = l % 4) holds
// a = {A[g][2q..], A[g+8][2q..], A[g][2q+8..], A[g+8][2q+8..]}, b = {B[2q..][g], B[2q+8..][g]} (pairs of
// 16-bit values) and d = {D[g][2q], D[g][2q+1], D[g+8][2q], D[g+8][2q+1]}.
template <bool kBF16>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

#define TWELL_MMA_M16N8K16_ASM(AB)                                                                              \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." AB "." AB ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, " \
               "{%8, %9}, {%0, %1, %2, %3};"                                                                     \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                   \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

template <>
__device__ __forceinline__ void mma_m16n8k16<true>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  TWELL_MMA_M16N8K16_ASM("bf16");
}

template <>
__device__ __forceinline__ void mma_m16n8k16<false>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  TWELL_MMA_M16N8K16_ASM("f16");
}

#undef TWELL_MMA_M16N8K16_ASM

// ---- wgmma ----------------------------------------------------------------------------------------
// Descriptor of a K-major tile stored as TMA's 128-byte swizzle writes it: rows of 128 bytes, 8-row
// core-matrix groups 1024 bytes apart. The tile base must be 1024-byte aligned; stepping along K
// inside the 128-byte row is done by adding the byte offset to the start address.
__device__ __forceinline__ uint64_t sw128_kmajor_desc(const void* tile) {
  const uint64_t start = (smem_addr(tile) & 0x3FFFF) >> 4;
  constexpr uint64_t kLeadingByteOffset = 1;        // unused for swizzled K-major, must be non-zero
  constexpr uint64_t kStrideByteOffset = 1024 >> 4;  // 8 rows x 128 bytes
  constexpr uint64_t kSwizzle128B = 1;
  return start | (kLeadingByteOffset << 16) | (kStrideByteOffset << 32) | (kSwizzle128B << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// d[64x128] (+)= A[64x16] . B[128x16]^T, both K-major in shared memory; fp32 accumulators. Thread t
// of the warpgroup holds rows 16 (t / 32) + (t % 32) / 4 + {0, 8} and columns 8 q + 2 (t % 4) + {0, 1}
// for q < 16, as d[4 q + 2 (row half) + column parity]. scale_d == 0 overwrites d instead of adding.
// One macro writes the bf16 and fp16 forms.
template <bool kBF16>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d);

#define TWELL_WGMMA_N128_ASM(AB) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." AB "." AB " " \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d))

template <>
__device__ __forceinline__ void wgmma_m64n128k16<true>(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  TWELL_WGMMA_N128_ASM("bf16");
}

template <>
__device__ __forceinline__ void wgmma_m64n128k16<false>(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  TWELL_WGMMA_N128_ASM("f16");
}

#undef TWELL_WGMMA_N128_ASM

}  // namespace ptx
}  // namespace twell
