// Helpers for the oracle tests: the CUDA toolkit's host conversions and a multi-threaded sweep
// over all 2^32 float bit patterns.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "geofp8/config.h"
#include "kernels/codec/element.h"

#if GEOFP8_HAVE_CUDA_FP8_HEADERS
#include <cuda_bf16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>

namespace geofp8::element {

inline uint8_t OracleE4M3(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); }
inline uint8_t OracleE5M2(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2); }
inline uint8_t OracleE2M1(float x) { return __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest); }
inline uint16_t OracleBf16(float x) {
  const __nv_bfloat16_raw r = __float2bfloat16_rn(x);
  return r.x;
}
// OCP MX shared scale for E4M3 elements, 2^(floor(log2(amax)) - emax_elem) with emax_elem = 8:
// floor(log2) is E8M0 conversion rounding toward zero; the code is clamped to E8M0's finite range.
inline uint8_t OracleMxScaleCode(float amax) {
  if (!(amax > 0.f)) return 127;  // all-zero block: X = 1 (DESIGN.md section 3)
  const int code = __nv_cvt_float_to_e8m0(amax, __NV_SATFINITE, cudaRoundZero) - 8;
  return static_cast<uint8_t>(std::clamp(code, 0, 254));
}

// Runs check(bits) on every bit pattern u in [0, 2^32) with u % stride == 0, split over the
// cores; returns mismatches and records the first one. Each chunk starts at its first multiple
// of stride, so the patterns checked are the same on any core count.
template <typename Fn>
inline uint64_t SweepAllFloats(Fn check, uint64_t stride, uint32_t* first_bad) {
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::atomic<uint64_t> bad{0};
  std::atomic<uint32_t> first{0};
  std::vector<std::thread> pool;
  constexpr uint64_t kTotal = uint64_t{1} << 32;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      const uint64_t chunk_begin = kTotal / threads * t;
      const uint64_t begin = (chunk_begin + stride - 1) / stride * stride;
      const uint64_t end = t + 1 == threads ? kTotal : kTotal / threads * (t + 1);
      uint64_t local = 0;
      for (uint64_t u = begin; u < end; u += stride) {
        if (!check(static_cast<uint32_t>(u))) {
          if (local++ == 0) first.store(static_cast<uint32_t>(u));
        }
      }
      bad += local;
    });
  }
  for (auto& th : pool) th.join();
  *first_bad = first.load();
  return bad.load();
}

inline bool SameE4M3(uint32_t u) { return FloatToE4M3(BitsFloat(u)) == OracleE4M3(BitsFloat(u)); }
inline bool SameE5M2(uint32_t u) { return FloatToE5M2(BitsFloat(u)) == OracleE5M2(BitsFloat(u)); }
inline bool SameE2M1(uint32_t u) { return FloatToE2M1(BitsFloat(u)) == OracleE2M1(BitsFloat(u)); }
// The codec's bf16 saturates finite inputs (DESIGN.md section 3) where the toolkit rounds to inf.
inline bool SameBf16(uint32_t u) {
  const float x = BitsFloat(u);
  const uint16_t want = OracleBf16(x);
  const bool finite = (u & 0x7FFFFFFFu) < 0x7F800000u;
  if (finite && (want & 0x7FFFu) == 0x7F80u) return FloatToBf16(x) == ((want & 0x8000u) | 0x7F7Fu);
  if (!finite && (u & 0x7FFFFFFFu) > 0x7F800000u) return (FloatToBf16(x) & 0x7FFFu) > 0x7F80u;
  return FloatToBf16(x) == want;
}
// MX scales are computed from amax = |x| of finite inputs only.
inline bool SameMxScale(uint32_t u) {
  const float x = BitsFloat(u & 0x7FFFFFFFu);
  return !IsFinite(x) || MxScaleCode(x) == OracleMxScaleCode(x);
}

}  // namespace geofp8::element

#endif
