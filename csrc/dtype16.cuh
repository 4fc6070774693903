// The two 16-bit dtypes the kernels take (bfloat16, float16), seen as values and as bit patterns, and
// the ReLU's notion of an active value. One definition for every kernel, so they round and test alike.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace twell {

template <typename T>
struct Dtype16;

template <>
struct Dtype16<__nv_bfloat16> {
  static constexpr bool kBF16 = true;
  __device__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static uint32_t bits(float v) { return __bfloat16_as_ushort(from_float(v)); }  // rounded, as bits
  __device__ static float value(uint32_t bits) { return __uint_as_float(bits << 16); }       // low 16 bits
  // Two floats rounded as bits() does, packed (lo in the low half): one cvt instruction.
  __device__ static uint32_t pair_bits(float lo, float hi) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&p);
  }
  // Elementwise product of two packed pairs, rounded once: the same bits as bits(value(a) * value(b)),
  // since the product of two bfloat16 values is exact in float.
  __device__ static uint32_t mul_pairs(uint32_t a, uint32_t b) {
    const __nv_bfloat162 p = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<const uint32_t*>(&p);
  }
  // is_active of both values of a packed pair in one compare: 0xffff in each half that is (> 0 or NaN).
  __device__ static uint32_t active_halves(uint32_t pair) {
    return __hgtu2_mask(*reinterpret_cast<const __nv_bfloat162*>(&pair), __float2bfloat162_rn(0.f));
  }
};

template <>
struct Dtype16<__half> {
  static constexpr bool kBF16 = false;
  __device__ static __half from_float(float v) { return __float2half_rn(v); }
  __device__ static float to_float(__half v) { return __half2float(v); }
  __device__ static uint32_t bits(float v) { return __half_as_ushort(from_float(v)); }
  __device__ static float value(uint32_t bits) { return __half2float(__ushort_as_half(static_cast<unsigned short>(bits))); }
  __device__ static uint32_t pair_bits(float lo, float hi) {
    const __half2 p = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&p);
  }
  // Exact in float too (11-bit significands), so rounded once as bits(value(a) * value(b)).
  __device__ static uint32_t mul_pairs(uint32_t a, uint32_t b) {
    const __half2 p = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
    return *reinterpret_cast<const uint32_t*>(&p);
  }
  __device__ static uint32_t active_halves(uint32_t pair) {
    return __hgtu2_mask(*reinterpret_cast<const __half2*>(&pair), __float2half2_rn(0.f));
  }
};

// relu keeps v > 0, and NaN, which eager's relu propagates.
__device__ __forceinline__ bool is_active(float v) { return v > 0.f || v != v; }

}  // namespace twell
