// Warp-level helpers shared by the codec's kernels and the geometry's fused encode kernel
// (device code only; include from .cu files).
#pragma once

#include "kernels/codec/element.h"

namespace geofp8::cuda {

inline constexpr unsigned kFullWarp = 0xFFFFFFFFu;

// Finite |x| as bits (0 for non-finite), so an unsigned max gives the finite amax.
__device__ inline unsigned FiniteAbsBits(float x) {
  const unsigned a = element::FloatBits(x) & 0x7FFFFFFFu;
  return a < 0x7F800000u ? a : 0u;
}

__device__ inline unsigned WarpMax(unsigned v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(kFullWarp, v, o));
  return v;
}

// Lane 0 adds the warp's count of `flag` to *counter.
__device__ inline void WarpCount(bool flag, unsigned long long* counter) {
  const unsigned ballot = __ballot_sync(kFullWarp, flag);
  if ((threadIdx.x & 31) == 0 && ballot) atomicAdd(counter, (unsigned long long)__popc(ballot));
}

}  // namespace geofp8::cuda
