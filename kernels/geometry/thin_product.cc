// Y = G X with ||G||^2 in one pass (thin_product.h): AVX2 + FMA kernel, BLAS elsewhere.
#include "kernels/geometry/thin_product.h"

#include <cblas.h>

#include <algorithm>

#include "kernels/common/check.h"
#include "kernels/common/cpu_features.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define GEOFP8_THIN_AVX2 1
#endif

namespace geofp8::geometry {
namespace {

#ifdef GEOFP8_THIN_AVX2
// Sum of squares of row (n floats) added to two double accumulators.
__attribute__((target("avx2,fma"))) inline void AddSquares(const float* row, int64_t n, __m256d& s0,
                                                           __m256d& s1) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256d a = _mm256_cvtps_pd(_mm_loadu_ps(row + j));
    const __m256d b = _mm256_cvtps_pd(_mm_loadu_ps(row + j + 4));
    s0 = _mm256_fmadd_pd(a, a, s0);
    s1 = _mm256_fmadd_pd(b, b, s1);
  }
  for (; j < n; ++j) {  // tail into lane 0 of s0, in order
    const __m256d a = _mm256_set_pd(0.0, 0.0, 0.0, double(row[j]));
    s0 = _mm256_fmadd_pd(a, a, s0);
  }
}

// Rows [r, r + R) of Y, columns [c, c + 8 W): R x W accumulators of 8 floats, one broadcast of
// G per row and one load of X per column block for each j.
template <int R, int W>
__attribute__((target("avx2,fma"))) inline void Block(const float* g, int64_t n, const float* x,
                                                      int ldx, float* y, int64_t r, int c) {
  __m256 acc[R][W];
  for (int i = 0; i < R; ++i)
    for (int w = 0; w < W; ++w) acc[i][w] = _mm256_setzero_ps();
  const float* rows = g + r * n;
  for (int64_t j = 0; j < n; ++j) {
    __m256 xv[W];
    for (int w = 0; w < W; ++w) xv[w] = _mm256_loadu_ps(x + j * ldx + c + 8 * w);
    for (int i = 0; i < R; ++i) {
      const __m256 b = _mm256_broadcast_ss(rows + i * n + j);
      for (int w = 0; w < W; ++w) acc[i][w] = _mm256_fmadd_ps(b, xv[w], acc[i][w]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(y + (r + i) * ldx + c + 8 * w, acc[i][w]);
}

template <int R>
__attribute__((target("avx2,fma"))) inline void Rows(const float* g, int64_t n, const float* x,
                                                     int ldx, float* y, int64_t r) {
  int c = 0;
  for (; c + 16 <= ldx; c += 16) Block<R, 2>(g, n, x, ldx, y, r, c);
  if (c < ldx) Block<R, 1>(g, n, x, ldx, y, r, c);
}

__attribute__((target("avx2,fma"))) double ThinAvx2(const float* g, int64_t m, int64_t n,
                                                    const float* x, int ldx, float* y) {
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  int64_t r = 0;
  for (; r + 6 <= m; r += 6) {
    Rows<6>(g, n, x, ldx, y, r);
    for (int i = 0; i < 6; ++i) AddSquares(g + (r + i) * n, n, s0, s1);  // rows still in cache
  }
  for (; r < m; ++r) {
    Rows<1>(g, n, x, ldx, y, r);
    AddSquares(g + r * n, n, s0, s1);
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(s0, s1));
  return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

// Rows [r, r + R) of G against both sides, width 8: x's R rows accumulate in registers over j; for
// each j, W^T's row j gathers the R rows' contributions (in row order) on top of what it held.
template <int R, bool kX, bool kW>
__attribute__((target("avx2,fma"))) inline void BothRows(const float* g, int64_t n, const float* u,
                                                         const float* v, float* x, float* wt,
                                                         int64_t r) {
  __m256 acc[R], ur[R];
  for (int i = 0; i < R; ++i) {
    acc[i] = _mm256_setzero_ps();
    if constexpr (kW) ur[i] = _mm256_loadu_ps(u + (r + i) * 8);
  }
  const float* rows = g + r * n;
  for (int64_t j = 0; j < n; ++j) {
    __m256 vj = _mm256_setzero_ps(), wj = _mm256_setzero_ps();
    if constexpr (kX) vj = _mm256_loadu_ps(v + j * 8);
    if constexpr (kW) wj = _mm256_loadu_ps(wt + j * 8);
    for (int i = 0; i < R; ++i) {
      const __m256 b = _mm256_broadcast_ss(rows + i * n + j);
      if constexpr (kX) acc[i] = _mm256_fmadd_ps(b, vj, acc[i]);
      if constexpr (kW) wj = _mm256_fmadd_ps(b, ur[i], wj);
    }
    if constexpr (kW) _mm256_storeu_ps(wt + j * 8, wj);
  }
  if constexpr (kX)
    for (int i = 0; i < R; ++i) _mm256_storeu_ps(x + (r + i) * 8, acc[i]);
}

template <bool kX, bool kW>
__attribute__((target("avx2,fma"))) void BothAvx2(const float* g, int64_t m, int64_t n,
                                                  const float* u, const float* v, float* x,
                                                  float* wt) {
  int64_t r = 0;
  for (; r + 6 <= m; r += 6) BothRows<6, kX, kW>(g, n, u, v, x, wt, r);
  for (; r < m; ++r) BothRows<1, kX, kW>(g, n, u, v, x, wt, r);
}
#endif

}  // namespace

double ThinProductAndNorm(const float* g, int64_t m, int64_t n, const float* x, int ldx, float* y) {
  GEOFP8_CHECK(m >= 1 && n >= 1 && ldx >= 0 && ldx % 8 == 0, "ThinProductAndNorm: shape ", m, "x",
               n, ", ldx ", ldx, " (need m, n >= 1 and ldx a multiple of 8)");
#ifdef GEOFP8_THIN_AVX2
  if (CpuHasAvx2Fma()) return ThinAvx2(g, m, n, x, ldx, y);
#endif
  if (ldx > 0) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), ldx,
                static_cast<int>(n), 1.f, g, static_cast<int>(n), x, ldx, 0.f, y, ldx);
  }
  return cblas_dsdot(static_cast<int>(m * n), g, 1, g, 1);
}

bool ThinBothSides(const float* g, int64_t m, int64_t n, const float* u, const float* v, int width,
                   float* x, float* wt, bool accumulate) {
  GEOFP8_CHECK(m >= 1 && n >= 1, "ThinBothSides: shape ", m, "x", n);
#ifdef GEOFP8_THIN_AVX2
  if (width != 8 || !CpuHasAvx2Fma()) return false;
  if (wt && !accumulate) std::fill(wt, wt + n * 8, 0.f);
  if (x && wt) {
    BothAvx2<true, true>(g, m, n, u, v, x, wt);
  } else if (x) {
    BothAvx2<true, false>(g, m, n, u, v, x, wt);
  } else if (wt) {
    BothAvx2<false, true>(g, m, n, u, v, x, wt);
  }
  return true;
#else
  (void)g, (void)u, (void)v, (void)width, (void)x, (void)wt, (void)accumulate;
  return false;
#endif
}

}  // namespace geofp8::geometry
