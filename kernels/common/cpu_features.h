// Run-time CPU feature checks for kernels that carry an AVX2 path (functions compiled with
// __attribute__((target(...)))) next to a baseline one; each answered once per process.
#pragma once

namespace geofp8 {

// True on an x86-64 CPU with AVX2 (GCC or Clang builds); false elsewhere.
inline bool CpuHasAvx2() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
#else
  return false;
#endif
}

// True on an x86-64 CPU with AVX2 and FMA (GCC or Clang builds); false elsewhere.
inline bool CpuHasAvx2Fma() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}

// True on an x86-64 CPU with AVX-512 F, BW, DQ and VL, and FMA, whose OS saves the 512-bit
// state (GCC's check reads XGETBV); false elsewhere.
inline bool CpuHasAvx512() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}

}  // namespace geofp8
