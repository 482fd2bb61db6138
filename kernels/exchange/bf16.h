// bfloat16 conversions for the bf16 baseline: round to nearest even, NaN stays NaN.
// GEOFP8_HD so a CUDA path can share the exact arithmetic.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/common/hd.h"

namespace geofp8 {

GEOFP8_HD uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

GEOFP8_HD float Bf16ToFloat(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace geofp8
