#pragma once
// A (row, tile) past the packed capacity keeps its rounded pre-activations in the dense backup row
// instead of slots. The sparse kernels list its active units from there, a warp together, in column
// order (the order its slots would have had), so that every kernel lists a row's entries alike.

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

}  // namespace twell
