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
#include <cuda_fp4.h>
#include <cuda_fp8.h>

namespace geofp8::element {

inline uint8_t OracleE4M3(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); }
inline uint8_t OracleE5M2(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2); }
inline uint8_t OracleE2M1(float x) { return __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest); }

// Runs check(bits) over [0, 2^32) in strided chunks on every core; returns mismatches and
// records the first one.
template <typename Fn>
inline uint64_t SweepAllFloats(Fn check, uint64_t stride, uint32_t* first_bad) {
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::atomic<uint64_t> bad{0};
  std::atomic<uint32_t> first{0};
  std::vector<std::thread> pool;
  constexpr uint64_t kTotal = uint64_t{1} << 32;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      const uint64_t begin = kTotal / threads * t;
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

}  // namespace geofp8::element

#endif
