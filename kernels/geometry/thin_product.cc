// Y = G X with ||G||^2 in one pass (thin_product.h): AVX2 + FMA kernel, BLAS elsewhere.
#include "kernels/geometry/thin_product.h"

#include <cblas.h>

#include <algorithm>
#include <vector>

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

namespace {

#ifdef GEOFP8_THIN_AVX2
// k = 8 (the default width) on AVX2: the generic loops' operations in the same order (a multiply,
// then an add: no fused multiply-add), so the bits do not depend on the path taken. Four columns
// of the output at a time in eight accumulator registers. The scalars that multiply a whole row
// are broadcast from doubles in memory (a load; converting and broadcasting a float in registers
// takes two shuffles, and the shuffle port was the bound).

// `rows` x 8 floats to doubles, in per-thread scratch.
__attribute__((target("avx2"))) const double* Widened8(const float* a, int64_t rows,
                                                       std::vector<double>& scratch) {
  scratch.resize(static_cast<size_t>(rows) * 8);
  double* out = scratch.data();
  for (int64_t i = 0; i < rows * 8; i += 4)
    _mm256_storeu_pd(out + i, _mm256_cvtps_pd(_mm_loadu_ps(a + i)));
  return out;
}

// out (8 x 8) = A^T B, both given widened to double.
__attribute__((target("avx2"))) void Gram8(const double* ad, const double* bd, int64_t rows,
                                           double* out) {
  for (int h = 0; h < 8; h += 4) {
    __m256d acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_pd();
    for (int64_t r = 0; r < rows; ++r) {
      const __m256d bv = _mm256_loadu_pd(bd + r * 8 + h);
      const double* ar = ad + r * 8;
      for (int i = 0; i < 8; ++i)
        acc[i] = _mm256_add_pd(acc[i], _mm256_mul_pd(_mm256_broadcast_sd(ar + i), bv));
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_pd(out + i * 8 + h, acc[i]);
  }
}

__attribute__((target("avx2"))) void CrossGram8(const float* a, const float* b, int64_t rows,
                                                double* out) {
  thread_local std::vector<double> wide_a, wide_b;
  const double* ad = Widened8(a, rows, wide_a);
  Gram8(ad, b == a ? ad : Widened8(b, rows, wide_b), rows, out);
}

__attribute__((target("avx2"))) void ResidualGram8(const float* a, const float* b, const double* c,
                                                   int64_t rows, double* out) {
  // The residual rows first, into scratch (rows x 8 doubles), then their Gram: accumulating into
  // memory a row at a time made every row wait on the previous row's stores.
  thread_local std::vector<double> wide, scratch;
  const double* ad = Widened8(a, rows, wide);
  scratch.resize(static_cast<size_t>(rows) * 8);
  double* res = scratch.data();
  __m256d c0[8], c1[8];
  for (int i = 0; i < 8; ++i) {
    c0[i] = _mm256_loadu_pd(c + i * 8);
    c1[i] = _mm256_loadu_pd(c + i * 8 + 4);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const double* ar = ad + r * 8;
    __m256d r0 = _mm256_cvtps_pd(_mm_loadu_ps(b + r * 8));
    __m256d r1 = _mm256_cvtps_pd(_mm_loadu_ps(b + r * 8 + 4));
    for (int i = 0; i < 8; ++i) {
      const __m256d ai = _mm256_broadcast_sd(ar + i);
      r0 = _mm256_sub_pd(r0, _mm256_mul_pd(ai, c0[i]));
      r1 = _mm256_sub_pd(r1, _mm256_mul_pd(ai, c1[i]));
    }
    _mm256_storeu_pd(res + r * 8, r0);
    _mm256_storeu_pd(res + r * 8 + 4, r1);
  }
  Gram8(res, res, rows, out);
}
#endif

}  // namespace

void CrossGram(const float* a, const float* b, int64_t rows, int k, double* out) {
#ifdef GEOFP8_THIN_AVX2
  if (k == 8 && CpuHasAvx2()) return CrossGram8(a, b, rows, out);
#endif
  std::fill(out, out + int64_t(k) * k, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* ar = a + r * k;
    const float* br = b + r * k;
    for (int i = 0; i < k; ++i) {
      const double ai = ar[i];
      double* __restrict o = out + int64_t(i) * k;
      for (int j = 0; j < k; ++j) o[j] += ai * double(br[j]);
    }
  }
}

void ResidualGram(const float* a, const float* b, const double* c, int64_t rows, int k,
                  double* out) {
#ifdef GEOFP8_THIN_AVX2
  if (k == 8 && CpuHasAvx2()) return ResidualGram8(a, b, c, rows, out);
#endif
  std::fill(out, out + int64_t(k) * k, 0.0);
  thread_local std::vector<double> res;
  res.resize(static_cast<size_t>(k));
  double* __restrict rr = res.data();
  for (int64_t r = 0; r < rows; ++r) {
    const float* ar = a + r * k;
    const float* br = b + r * k;
    for (int j = 0; j < k; ++j) rr[j] = br[j];
    for (int i = 0; i < k; ++i) {  // rr -= a_r^T C, row by row of C
      const double ai = ar[i];
      const double* __restrict ci = c + int64_t(i) * k;
      for (int j = 0; j < k; ++j) rr[j] -= ai * ci[j];
    }
    for (int i = 0; i < k; ++i) {
      const double ri = rr[i];
      double* __restrict o = out + int64_t(i) * k;
      for (int j = 0; j < k; ++j) o[j] += ri * rr[j];
    }
  }
}

}  // namespace geofp8::geometry
