#pragma once
// A (row, tile) past the packed capacity keeps its rounded pre-activations in the dense backup row
// instead of slots. The sparse kernels list its active units from there, a warp together, in column
// order (the order its slots would have had), so that every kernel lists a row's entries alike; the
// dense paths expand a (row, tile) from its slots or its backup alike.

#include <cstdint>

#include "dtype16.cuh"

namespace twell {

// emit(k, column, bits) for the tile's k-th active unit: its column within the tile and its 16-bit
// value. All 32 lanes of the warp must call this together.
template <typename T, typename Emit>
__device__ __forceinline__ void for_each_backup_entry(const T* __restrict__ tile, int width, int lane, Emit&& emit) {
  const uint16_t* tile_bits = reinterpret_cast<const uint16_t*>(tile);
  int seen = 0;
  for (int c = 0; c < width; c += 32) {
    const int col = c + lane;
    const uint32_t bits = col < width ? tile_bits[col] : 0u;
    const bool active = col < width && is_active(Dtype16<T>::value(bits));
    const unsigned mask = __ballot_sync(0xffffffffu, active);
    if (active) emit(seen + __popc(mask & ((1u << lane) - 1u)), col, bits);
    seen += __popc(mask);
  }
}

// A lane's 4 columns (lane * 4 on) of a (row, tile)'s activation, relu applied, as 16-bit bits: from
// the tile's packed slots (count <= cap; cap <= 32) or its backup (count > cap). `backup_quad` points
// at the lane's first column in the backup row, of which `cols` (0 to 4) are in the matrix; `vec`: the
// four are one aligned 8-byte load. The count, the slots and the backup load independently (no
// dependent chain) before the choice. All 32 lanes of the warp call this together.
template <typename T>
__device__ __forceinline__ void tile_quad_activation(const uint32_t* __restrict__ slots, int count, int cap,
                                                     const uint16_t* __restrict__ backup_quad, int cols, bool vec,
                                                     int lane, uint16_t (&v)[4]) {
  const int live = count > cap ? 0 : count;  // an overflowing tile wrote its backup and no slots
  const uint32_t word = lane < live ? slots[lane] : 0u;
  if (count > cap) {  // the backup holds the pre-activation
    if (vec) {
      const uint2 raw = *reinterpret_cast<const uint2*>(backup_quad);
      v[0] = raw.x & 0xffffu; v[1] = raw.x >> 16; v[2] = raw.y & 0xffffu; v[3] = raw.y >> 16;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = e < cols ? backup_quad[e] : 0;
    }
  } else {
    v[0] = v[1] = v[2] = v[3] = 0;
  }
  for (int s = 0; s < live; ++s) {  // a slot lands in the lane that owns its column
    const uint32_t w = __shfl_sync(0xffffffffu, word, s);
    const int local = static_cast<int>(w & 0xffffu) - lane * 4;
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (local == e) v[e] = static_cast<uint16_t>(w >> 16);
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) v[e] = is_active(Dtype16<T>::value(v[e])) ? v[e] : 0;
}

}  // namespace twell
