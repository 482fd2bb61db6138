// Per-element and per-block math of the codec, shared by the CPU paths and the CUDA kernels.
// Every conversion here is bit-exact with the CUDA toolkit's host conversions (see the tests).
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/common/hd.h"

namespace geofp8::element {

GEOFP8_HD uint32_t FloatBits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

GEOFP8_HD float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

GEOFP8_HD bool IsFinite(float x) { return (FloatBits(x) & 0x7FFFFFFFu) < 0x7F800000u; }

// ---------------------------------------------------------------------------------------------
// Counter-based random bits for stochastic rounding. The stream key mixes (seed, step, layer,
// rank); element i of a tensor draws Hash(key, i), so results never depend on threading.
// SplitMix64's finalizer: every input bit affects every output bit.
GEOFP8_HD uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

GEOFP8_HD uint64_t StreamKey(uint64_t seed, uint64_t step, uint32_t layer, uint32_t rank) {
  uint64_t k = Mix64(seed + 0x9E3779B97F4A7C15ull);
  k = Mix64(k ^ (step + 0x632BE59BD9B4E019ull));
  k = Mix64(k ^ ((static_cast<uint64_t>(layer) << 32 | rank) + 0x85157AF5ull));
  return k;
}

// 32 uniform random bits for element `index` of the stream `key`.
GEOFP8_HD uint32_t RandomBits(uint64_t key, uint64_t index) {
  return static_cast<uint32_t>(Mix64(key ^ (index * 0x9E3779B97F4A7C15ull)) >> 32);
}

// ---------------------------------------------------------------------------------------------
// Rounding helper: given an integer `res` (truncated toward zero) and the `shift` low bits `rem`
// that were dropped, round to nearest-even or stochastically with 32 random bits `r`.
// Stochastic: round up with probability rem / 2^shift (exact for shift <= 32).
GEOFP8_HD uint32_t RoundShifted(uint32_t res, uint64_t rem, uint32_t shift, bool stochastic,
                                uint32_t r) {
  if (shift == 0) return res;
  if (!stochastic) {
    const uint64_t half = 1ull << (shift - 1);
    if (rem > half || (rem == half && (res & 1u))) ++res;
    return res;
  }
  const uint64_t threshold = shift <= 32 ? (rem << (32 - shift)) : (rem >> (shift - 32));
  if (static_cast<uint64_t>(r) < threshold) ++res;
  return res;
}

// Float bits of the largest finite value of a small format whose max code is kMaxCode.
template <int M, int B, uint32_t kMaxCode>
GEOFP8_HD constexpr uint32_t kMaxBitsOf() {
  return ((((kMaxCode >> M) & 0xFFu) + 127u - B) << 23) |
         ((kMaxCode & ((1u << M) - 1u)) << (23 - M));
}

// Shared small-float conversion for E4M3, E5M2 and E2M1 (M mantissa bits, exponent bias B).
// Follows the CUDA toolkit's __nv_cvt_double_to_fp8/fp4 exactly for nearest rounding:
//   |x| <= min_subnormal/2 -> signed zero; NaN -> format-specific code; |x| > overflow threshold
//   -> signed max (saturating; this includes inf, so callers flag non-finite inputs first);
//   otherwise round-to-nearest-even in the normal or subnormal range.
// Stochastic rounding (r = 32 random bits) rounds the magnitude up with probability
// (dropped bits) / 2^shift, so E[decode] = x; it has no zero cutoff (tiny values may round up to
// the smallest subnormal) and saturates at |x| >= max.
template <int M, int B, uint32_t kMaxCode, uint32_t kOverflowBits, uint32_t kNanCode,
          int kSignShift>
GEOFP8_HD uint32_t FloatToSmall(float x, bool stochastic, uint32_t r) {
  const uint32_t u = FloatBits(x);
  const uint32_t sign = (u >> 31) << kSignShift;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kNanCode;
  // Smallest normal of the small format: 2^(1-B); its float exponent field is 128-B.
  const uint32_t kMinNormBits = static_cast<uint32_t>(128 - B) << 23;
  // Half the smallest subnormal: 2^(1-B-M-1).
  const uint32_t kHalfMinSubBits = static_cast<uint32_t>(127 + 1 - B - M - 1) << 23;
  if (!stochastic) {
    if (a <= kHalfMinSubBits) return sign;
    if (a > kOverflowBits) return sign | kMaxCode;
  } else {
    if (a == 0) return sign;
    // Max value of the format: saturate at or above it.
    if (a >= kMaxBitsOf<M, B, kMaxCode>()) return sign | kMaxCode;
  }
  uint32_t res;
  if (a >= kMinNormBits) {
    const uint32_t shift = 23 - M;
    res = (a >> shift) - (static_cast<uint32_t>(127 - B) << M);
    res = RoundShifted(res, a & ((1u << shift) - 1u), shift, stochastic, r);
  } else {
    // value = m * 2^(e-150); subnormal unit 2^(1-B-M) -> code = m >> (151 - B - M - e).
    const uint32_t e = a >> 23;
    const uint64_t m = (a & 0x7FFFFFu) | (e ? 0x800000u : 0u);
    uint32_t shift = static_cast<uint32_t>(151 - B - M) - (e ? e : 1u);
    if (shift > 63) shift = 63;
    res = static_cast<uint32_t>(shift >= 32 ? 0 : (m >> shift));
    res = RoundShifted(res, m & ((1ull << shift) - 1ull), shift, stochastic, r);
  }
  return sign | res;
}

// E4M3 "fn": bias 7, max 448 (0x7E), NaN 0x7F. Overflow threshold 464 = max + ulp/2.
GEOFP8_HD uint8_t FloatToE4M3(float x, bool stochastic = false, uint32_t r = 0) {
  return static_cast<uint8_t>(FloatToSmall<3, 7, 0x7Eu, 0x43E80000u, 0x7Fu, 7>(x, stochastic, r));
}
// E5M2: bias 15, max 57344 (0x7B); nearest saturates at |x| >= 61440 (max + ulp/2).
GEOFP8_HD uint8_t FloatToE5M2(float x, bool stochastic = false, uint32_t r = 0) {
  return static_cast<uint8_t>(FloatToSmall<2, 15, 0x7Bu, 0x476FFFFFu, 0x7Fu, 7>(x, stochastic, r));
}
// E2M1: bias 1, max 6 (0x7); |x| > 6 saturates, NaN -> +6 (E2M1 has no NaN).
GEOFP8_HD uint8_t FloatToE2M1(float x, bool stochastic = false, uint32_t r = 0) {
  return static_cast<uint8_t>(FloatToSmall<1, 1, 0x7u, 0x40C00000u, 0x7u, 3>(x, stochastic, r));
}

GEOFP8_HD float E4M3ToFloat(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t mag = c & 0x7Fu;
  if (mag == 0x7Fu) return BitsFloat(sign | 0x7FC00000u);
  if (mag < 8u) return BitsFloat(sign | FloatBits(static_cast<float>(mag) * 0.001953125f));
  return BitsFloat(sign | ((mag << 20) + (120u << 23)));
}

GEOFP8_HD float E5M2ToFloat(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t mag = c & 0x7Fu;
  if (mag > 0x7Cu) return BitsFloat(sign | 0x7FC00000u);
  if (mag == 0x7Cu) return BitsFloat(sign | 0x7F800000u);
  if (mag < 4u) return BitsFloat(sign | FloatBits(static_cast<float>(mag) * 0.0000152587890625f));
  return BitsFloat(sign | ((mag << 21) + (112u << 23)));
}

GEOFP8_HD float E2M1ToFloat(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x8u) << 28;
  const uint32_t mag = c & 0x7u;
  if (mag < 2u) return BitsFloat(sign | FloatBits(static_cast<float>(mag) * 0.5f));
  return BitsFloat(sign | ((mag << 22) + (126u << 23)));
}

// bf16, round-to-nearest-even. NaN stays NaN (quieted); inf stays inf; a finite input saturates
// to the largest finite bf16 instead of rounding to inf (DESIGN.md section 3).
GEOFP8_HD uint16_t FloatToBf16(float x, bool stochastic = false, uint32_t r = 0) {
  const uint32_t u = FloatBits(x);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  if (a == 0x7F800000u) return static_cast<uint16_t>(u >> 16);
  uint32_t res = RoundShifted(a >> 16, a & 0xFFFFu, 16, stochastic, r);
  if (res >= 0x7F80u) res = 0x7F7Fu;
  return static_cast<uint16_t>(((u >> 16) & 0x8000u) | res);
}
GEOFP8_HD float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

// ---------------------------------------------------------------------------------------------
// Scales.

// Encode multiplier fmt_max / amax (DESIGN.md section 3). amax is over finite inputs.
// An all-zero block gets 1. The multiplier is nudged down one ulp if amax * scale would land
// above fmt_max (so the block maximum never counts as saturated), and clamped to FLT_MAX when
// amax is so small that fmt_max / amax overflows. Decode divides by the same fp32 value.
GEOFP8_HD float ScaleFromAmax(float amax, float fmt_max) {
  if (!(amax > 0.f)) return 1.f;
  float s = fmt_max / amax;
  if (!(s <= 3.4028234663852886e38f)) s = 3.4028234663852886e38f;
  if (amax * s > fmt_max) s = BitsFloat(FloatBits(s) - 1u);
  return s;
}

// OCP MX v1.0 shared scale for E4M3 elements: X = 2^(floor(log2(amax)) - 8), as an E8M0 code
// (exponent + 127, clamped to [0, 254]; 0xFF is NaN). All-zero block: X = 1 (code 127).
GEOFP8_HD uint8_t MxScaleCode(float amax) {
  if (!(amax > 0.f)) return 127;
  const uint32_t a = FloatBits(amax);
  int e = static_cast<int>(a >> 23) - 127;
  if ((a >> 23) == 0) {  // subnormal amax: floor(log2) from the leading mantissa bit
    uint32_t m = a & 0x7FFFFFu;
    int lead = 22;
    while (!(m & (1u << lead))) --lead;
    e = -127 - (22 - lead);
  }
  int code = e - 8 + 127;
  if (code < 0) code = 0;
  if (code > 254) code = 254;
  return static_cast<uint8_t>(code);
}
GEOFP8_HD float E8M0ToFloat(uint8_t code) {
  if (code == 0xFFu) return BitsFloat(0x7FC00000u);
  if (code == 0) return BitsFloat(0x00400000u);  // 2^-127 (a float subnormal)
  return BitsFloat(static_cast<uint32_t>(code) << 23);
}
// Encode: element = E4M3(x / X); X is a power of two, so the quotient is exact unless it
// lies far below E4M3's range. Decode: element * X.
// NVFP4 scaling, our exact rule:
//   g   = amax_tensor / (6 * 448)  (fp32 tensor decode scale, stored; 1 if amax_tensor is 0 or
//                                   the quotient underflows to 0)
//   d_b = E4M3_RNE(amax_block / (6 * g))   (block decode scale code; 0x38 = 1.0 if that rounds
//                                           to zero, e.g. an all-zero block)
//   den = E4M3ToFloat(d_b) * g            (fp32)
//   element = E2M1(x / den), decode = E2M1ToFloat(element) * den.
// So the largest block's scale lands at E4M3's max 448, and a block's max at E2M1's max 6
// (up to the E4M3 rounding of d_b: a block rounded down saturates a little, counted).
// A block holding a non-finite input gets d_b = 0x7F (NaN), so it decodes as NaN.
GEOFP8_HD float NvTensorScale(float amax_tensor) {
  if (!(amax_tensor > 0.f)) return 1.f;
  const float g = amax_tensor / 2688.f;
  return g > 0.f ? g : 1.f;
}
GEOFP8_HD uint8_t NvBlockScaleCode(float amax_block, float g) {
  const uint8_t c = FloatToE4M3(amax_block / (6.f * g));
  return (c & 0x7Fu) == 0 ? static_cast<uint8_t>(0x38u) : c;
}
GEOFP8_HD float NvDenominator(uint8_t code, float g) { return E4M3ToFloat(code) * g; }

// ---------------------------------------------------------------------------------------------
// One element under the codec's rules, as both the CPU paths and the CUDA kernels encode it.
// Non-finite inputs are never encoded finite: fp8 NaN -> 0x7F, inf -> E5M2 inf or E4M3 NaN (with
// sign). *saturated is set when the scaled magnitude exceeds the format max.

GEOFP8_HD float AbsF(float x) { return BitsFloat(FloatBits(x) & 0x7FFFFFFFu); }

// fp8 (E4M3, or E5M2 when e5m2) of x * scale.
GEOFP8_HD uint8_t EncodeFp8Scaled(bool e5m2, float x, float scale, bool stochastic, uint32_t r,
                                  bool* saturated) {
  const uint32_t u = FloatBits(x);
  *saturated = false;
  if ((u & 0x7FFFFFFFu) >= 0x7F800000u) {
    const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7F;
    return e5m2 ? static_cast<uint8_t>(sign | 0x7Cu) : static_cast<uint8_t>(sign | 0x7Fu);
  }
  const float y = x * scale;
  *saturated = AbsF(y) > (e5m2 ? 57344.f : 448.f);
  return e5m2 ? FloatToE5M2(y, stochastic, r) : FloatToE4M3(y, stochastic, r);
}

// mxfp8 element: E4M3 of x / X (X = E8M0ToFloat(scale code)).
GEOFP8_HD uint8_t EncodeMxElement(float x, float X, bool stochastic, uint32_t r, bool* saturated) {
  const uint32_t u = FloatBits(x);
  *saturated = false;
  if ((u & 0x7FFFFFFFu) >= 0x7F800000u) {
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint8_t>(0x7F)
                                           : static_cast<uint8_t>((u >> 24) | 0x7Fu);
  }
  const float y = x / X;
  *saturated = AbsF(y) > 448.f;
  return FloatToE4M3(y, stochastic, r);
}

// nvfp4 element (finite x; a block with a non-finite value is poisoned via its scale instead).
GEOFP8_HD uint8_t EncodeNvElement(float x, float den, bool stochastic, uint32_t r,
                                  bool* saturated) {
  const float y = x / den;
  *saturated = AbsF(y) > 6.f;
  return FloatToE2M1(y, stochastic, r);
}

}  // namespace geofp8::element
