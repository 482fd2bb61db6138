// LAPACK wrappers for the geometry: Householder and Cholesky QR, divide-and-conquer SVD,
// symmetric eigen (dsyev for the reference; the geometry's small problems by own loops below).
// Each LAPACK call checks its info and throws geofp8::Error naming the routine.
#include "kernels/geometry/lapack.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "kernels/common/check.h"
#include "kernels/common/cpu_features.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define GEOFP8_LAPACK_AVX2 1
#endif

extern "C" {
void dgeqrf_(const int* m, const int* n, double* a, const int* lda, double* tau, double* work,
             const int* lwork, int* info);
void dorgqr_(const int* m, const int* n, const int* k, double* a, const int* lda, const double* tau,
             double* work, const int* lwork, int* info);
void dgesdd_(const char* jobz, const int* m, const int* n, double* a, const int* lda, double* s,
             double* u, const int* ldu, double* vt, const int* ldvt, double* work, const int* lwork,
             int* iwork, int* info);
void dgesvd_(const char* jobu, const char* jobvt, const int* m, const int* n, double* a,
             const int* lda, double* s, double* u, const int* ldu, double* vt, const int* ldvt,
             double* work, const int* lwork, int* info);
void dgesv_(const int* n, const int* nrhs, double* a, const int* lda, int* ipiv, double* b,
            const int* ldb, int* info);
void dpotrf_(const char* uplo, const int* n, double* a, const int* lda, int* info);
void dsyev_(const char* jobz, const char* uplo, const int* n, double* a, const int* lda, double* w,
            double* work, const int* lwork, int* info);
}

namespace geofp8::geometry::lapack {
namespace {

int ToInt(int64_t v, const char* what) {
  GEOFP8_CHECK(v >= 0 && v <= INT32_MAX, what, " out of LAPACK's int range: ", v);
  return static_cast<int>(v);
}

std::atomic<uint64_t> fallbacks{0};

// A (m x n, column-major, leading dimension m) <- A R^-1 for R upper triangular (n x n, leading
// dimension n, nonzero diagonal): forward substitution along each row, x_j = (a_j - sum_{i<j}
// x_i r_ij) / r_jj with the division as a multiplication by 1 / r_jj, as BLAS trsm kernels do.
// Backward stable like dtrsm. Plain loops on the calling thread: OpenBLAS's dtrsm hands even a
// 256 x 20 solve to its thread pool, which in a process whose pool has two threads (a PyTorch
// trainer) cost several times the arithmetic. Same input, same bits, on one machine.
void SolveUpperRightBaseline(double* a, int64_t m, int n, const double* r, const double* inv) {
  for (int64_t row = 0; row < m; ++row) {
    for (int j = 0; j < n; ++j) {
      double acc = a[int64_t(j) * m + row];
      for (int i = 0; i < j; ++i) acc -= a[int64_t(i) * m + row] * r[int64_t(j) * n + i];
      a[int64_t(j) * m + row] = acc * inv[j];
    }
  }
}

#ifdef GEOFP8_LAPACK_AVX2
// Eight rows per step in two registers: the running sums stay in registers across i, and the
// solved x_i are read back from A's columns (contiguous in the rows). Fused multiply-adds.
__attribute__((target("avx2,fma"))) void SolveUpperRightAvx2(double* a, int64_t m, int n,
                                                             const double* r, const double* inv) {
  int64_t row = 0;
  for (; row + 8 <= m; row += 8) {
    for (int j = 0; j < n; ++j) {
      double* aj = a + int64_t(j) * m + row;
      __m256d acc0 = _mm256_loadu_pd(aj), acc1 = _mm256_loadu_pd(aj + 4);
      const double* rj = r + int64_t(j) * n;
      for (int i = 0; i < j; ++i) {
        const double* ai = a + int64_t(i) * m + row;
        const __m256d b = _mm256_broadcast_sd(rj + i);
        acc0 = _mm256_fnmadd_pd(b, _mm256_loadu_pd(ai), acc0);
        acc1 = _mm256_fnmadd_pd(b, _mm256_loadu_pd(ai + 4), acc1);
      }
      const __m256d d = _mm256_broadcast_sd(inv + j);
      _mm256_storeu_pd(aj, _mm256_mul_pd(acc0, d));
      _mm256_storeu_pd(aj + 4, _mm256_mul_pd(acc1, d));
    }
  }
  for (; row < m; ++row) {  // the last m % 8 rows, the same operations one lane at a time
    for (int j = 0; j < n; ++j) {
      double acc = a[int64_t(j) * m + row];
      for (int i = 0; i < j; ++i)
        acc = std::fma(-a[int64_t(i) * m + row], r[int64_t(j) * n + i], acc);
      a[int64_t(j) * m + row] = acc * inv[j];
    }
  }
}
#endif

void SolveUpperRight(double* a, int64_t m, int n, const double* r, std::vector<double>& inv) {
  inv.resize(static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) inv[j] = 1.0 / r[int64_t(j) * n + j];
#ifdef GEOFP8_LAPACK_AVX2
  if (CpuHasAvx2Fma()) return SolveUpperRightAvx2(a, m, n, r, inv.data());
#endif
  SolveUpperRightBaseline(a, m, n, r, inv.data());
}

}  // namespace

uint64_t OrthonormalizeFallbacks() { return fallbacks.load(std::memory_order_relaxed); }

bool OrthonormalizeInPlace(double* a, int64_t rows, int64_t cols, std::vector<double>* r) {
  GEOFP8_CHECK(rows >= cols && cols >= 0, "orthonormalize needs rows >= cols, got ", rows, "x",
               cols);
  if (r) r->assign(static_cast<size_t>(cols * cols), 0.0);
  if (cols == 0) return true;
  const int m = ToInt(rows, "rows"), n = ToInt(cols, "cols");
  struct Scratch {
    std::vector<double> original, gram, r1, d, inv;
  };
  thread_local Scratch sc;
  sc.original.assign(a, a + static_cast<size_t>(rows * cols));
  sc.gram.assign(static_cast<size_t>(n) * n, 0.0);
  sc.r1.assign(static_cast<size_t>(n) * n, 0.0);
  sc.d.resize(static_cast<size_t>(n));
  double* gram = sc.gram.data();
  double* r1 = sc.r1.data();
  int info = 0;
  bool ok = true;
  // Pass 1, equilibrated: K = D^-1 A^T A D^-1 with D = diag(||a_j||), K = Rs^T Rs, R1 = Rs D.
  // Scaling the Gram rather than A changes none of its rounding, which is columnwise relative.
  cblas_dsyrk(CblasColMajor, CblasUpper, CblasTrans, n, m, 1.0, a, m, 0.0, gram, n);
  for (int j = 0; j < n && ok; ++j) {
    sc.d[j] = std::sqrt(gram[static_cast<size_t>(j) * n + j]);
    ok = sc.d[j] > 0.0 && std::isfinite(sc.d[j]);
  }
  if (ok) {
    for (int j = 0; j < n; ++j)
      for (int i = 0; i <= j; ++i) gram[static_cast<size_t>(j) * n + i] /= sc.d[i] * sc.d[j];
    const char uplo = 'U';
    dpotrf_(&uplo, &n, gram, &n, &info);
    ok = info == 0;
  }
  if (ok) {
    for (int j = 0; j < n; ++j)
      for (int i = 0; i <= j; ++i)
        r1[static_cast<size_t>(j) * n + i] = gram[static_cast<size_t>(j) * n + i] * sc.d[j];
    SolveUpperRight(a, m, n, r1, sc.inv);
    // Pass 2 on Q1 = A R1^-1. Its Gram Q1^T Q1 says how far pass 1 got: with ||Q1^T Q1 - I||_2
    // <= 1/2 (checked through the Frobenius norm, <= n max|entry|), kappa(Q1) <= sqrt(3), far
    // inside CholeskyQR's condition kappa <= 1 / (8 sqrt((m n + n (n + 1)) u)) (Yamamoto et al.
    // 2015), so the second pass yields ||Q^T Q - I||_F <= 6 (m n + n (n + 1)) u. Beyond it (a
    // condition number of A near 1 / sqrt(u) or more), Householder.
    cblas_dsyrk(CblasColMajor, CblasUpper, CblasTrans, n, m, 1.0, a, m, 0.0, gram, n);
    double off = 0.0;
    for (int j = 0; j < n; ++j)
      for (int i = 0; i <= j; ++i)
        off = std::max(off, std::abs(gram[static_cast<size_t>(j) * n + i] - (i == j ? 1.0 : 0.0)));
    ok = std::isfinite(off) && off * n <= 0.5;
  }
  if (ok) {
    const char uplo = 'U';
    dpotrf_(&uplo, &n, gram, &n, &info);
    ok = info == 0;
  }
  if (!ok) {
    fallbacks.fetch_add(1, std::memory_order_relaxed);
    std::vector<double> h(sc.original);
    QrInPlace(h, rows, cols, r);
    std::memcpy(a, h.data(), sizeof(double) * h.size());
    return false;
  }
  for (int j = 0; j < n; ++j)  // dpotrf leaves the strict lower triangle as it found it
    for (int i = j + 1; i < n; ++i) gram[static_cast<size_t>(j) * n + i] = 0.0;
  SolveUpperRight(a, m, n, gram, sc.inv);
  if (r) {  // R = R2 R1, both upper triangular
    cblas_dtrmm(CblasColMajor, CblasLeft, CblasUpper, CblasNoTrans, CblasNonUnit, n, n, 1.0, gram,
                n, r1, n);
    r->assign(sc.r1.begin(), sc.r1.end());
  }
  return true;
}

void QrInPlace(std::vector<double>& a, int64_t rows, int64_t cols, std::vector<double>* r) {
  GEOFP8_CHECK(rows >= cols && cols >= 0, "QR needs rows >= cols, got ", rows, "x", cols);
  GEOFP8_CHECK(static_cast<int64_t>(a.size()) == rows * cols, "QR buffer size ", a.size());
  if (r) r->assign(static_cast<size_t>(cols * cols), 0.0);
  if (cols == 0) return;
  const int m = ToInt(rows, "rows"), n = ToInt(cols, "cols"), lda = std::max(1, m);
  std::vector<double> tau(static_cast<size_t>(n));
  int info = 0, lwork = -1;
  double query = 0;
  dgeqrf_(&m, &n, a.data(), &lda, tau.data(), &query, &lwork, &info);
  GEOFP8_CHECK(info == 0, "dgeqrf workspace query failed, info=", info);
  lwork = std::max(1, static_cast<int>(query));
  std::vector<double> work(static_cast<size_t>(lwork));
  dgeqrf_(&m, &n, a.data(), &lda, tau.data(), work.data(), &lwork, &info);
  GEOFP8_CHECK(info == 0, "dgeqrf failed, info=", info);
  if (r) {
    for (int j = 0; j < n; ++j)
      for (int i = 0; i <= j; ++i)
        (*r)[static_cast<size_t>(j) * n + i] = a[static_cast<size_t>(j) * m + i];
  }
  lwork = -1;
  dorgqr_(&m, &n, &n, a.data(), &lda, tau.data(), &query, &lwork, &info);
  GEOFP8_CHECK(info == 0, "dorgqr workspace query failed, info=", info);
  lwork = std::max(1, static_cast<int>(query));
  work.assign(static_cast<size_t>(lwork), 0.0);
  dorgqr_(&m, &n, &n, a.data(), &lda, tau.data(), work.data(), &lwork, &info);
  GEOFP8_CHECK(info == 0, "dorgqr failed, info=", info);
}

namespace {
thread_local bool fail_next_divide_and_conquer = false;
}  // namespace

void FailNextDivideAndConquerForTest() { fail_next_divide_and_conquer = true; }

Svd ThinSvd(std::vector<double>& a, int64_t rows, int64_t cols) {
  GEOFP8_CHECK(static_cast<int64_t>(a.size()) == rows * cols, "SVD buffer size ", a.size());
  Svd out;
  const int64_t p64 = std::min(rows, cols);
  if (p64 == 0) return out;
  const int m = ToInt(rows, "rows"), n = ToInt(cols, "cols"), p = ToInt(p64, "rank");
  out.u.resize(static_cast<size_t>(m) * p);
  out.s.resize(static_cast<size_t>(p));
  out.vt.resize(static_cast<size_t>(p) * n);
  const char jobz = 'S';
  const int lda = m, ldu = m, ldvt = p;
  std::vector<int> iwork(static_cast<size_t>(8) * p);
  int info = 0, lwork = -1;
  double query = 0;
  dgesdd_(&jobz, &m, &n, a.data(), &lda, out.s.data(), out.u.data(), &ldu, out.vt.data(), &ldvt,
          &query, &lwork, iwork.data(), &info);
  GEOFP8_CHECK(info == 0, "dgesdd workspace query failed, info=", info);
  lwork = std::max(1, static_cast<int>(query));
  std::vector<double> work(static_cast<size_t>(lwork));
  // dgesdd destroys A even when it fails; keep a copy for the fallback.
  const std::vector<double> original = a;
  dgesdd_(&jobz, &m, &n, a.data(), &lda, out.s.data(), out.u.data(), &ldu, out.vt.data(), &ldvt,
          work.data(), &lwork, iwork.data(), &info);
  GEOFP8_CHECK(info >= 0, "dgesdd: bad argument ", -info);
  const bool injected = std::exchange(fail_next_divide_and_conquer, false);
  if (info == 0 && !injected) return out;
  // Divide and conquer can fail to converge on matrices QR iteration handles (seen on a real
  // 256 x 256 embedding gradient with OpenBLAS 0.3.21's Haswell kernels, kept as a test
  // fixture): retry with dgesvd, slower but robust.
  a = original;
  const char job = 'S';
  lwork = -1;
  dgesvd_(&job, &job, &m, &n, a.data(), &lda, out.s.data(), out.u.data(), &ldu, out.vt.data(),
          &ldvt, &query, &lwork, &info);
  GEOFP8_CHECK(info == 0, "dgesvd workspace query failed, info=", info);
  lwork = std::max(1, static_cast<int>(query));
  work.assign(static_cast<size_t>(lwork), 0.0);
  dgesvd_(&job, &job, &m, &n, a.data(), &lda, out.s.data(), out.u.data(), &ldu, out.vt.data(),
          &ldvt, work.data(), &lwork, &info);
  GEOFP8_CHECK(info == 0, "SVD failed to converge (dgesdd and dgesvd), info=", info);
  return out;
}

std::vector<double> Inverse(std::vector<double> a, int64_t n64) {
  GEOFP8_CHECK(static_cast<int64_t>(a.size()) == n64 * n64, "inverse buffer size ", a.size());
  std::vector<double> b(a.size(), 0.0);
  if (n64 == 0) return b;
  const int n = ToInt(n64, "n");
  for (int i = 0; i < n; ++i) b[static_cast<size_t>(i) * n + i] = 1.0;
  std::vector<int> ipiv(static_cast<size_t>(n));
  int info = 0;
  dgesv_(&n, &n, a.data(), &n, ipiv.data(), b.data(), &n, &info);
  GEOFP8_CHECK(info == 0, "dgesv: matrix is singular, info=", info);
  return b;
}

namespace {

// The small symmetric eigensolver behind SymmetricEigenInPlace and LargestEigenvalue: Householder
// tridiagonalisation, then implicit-shift QL on the tridiagonal matrix, in plain loops. The
// geometry's eigenproblems are tiny (c x c with c = 2 width + probes, 20 and 28 by default; k x k
// for the drift), and LAPACK's dsyev reduces them through dsymv, which OpenBLAS 0.3.21 hands to
// its thread pool at every size: in a process whose pool has more than one thread (a PyTorch
// trainer sharing libopenblas) the synchronisation cost several times the arithmetic. These loops
// never leave the calling thread, and the same input gives the same bits on one machine.
//
// `a` holds the upper triangle of A (column-major, n x n). The matrix is scaled by a power of two
// (exact) so that its largest entry lies in [1/2, 1): no square below can overflow. On return
// values[0..n) ascend, and when `vectors` a holds the eigenvectors, column j for values[j].
// `work` needs n * n + 3 n doubles.
//
// The body is compiled twice, for AVX2 and for the x86-64 baseline, and picked at run time: the
// loops that vectorise are elementwise (no reassociated sums, and the build contracts no FMAs),
// so both give the same bits; AVX2 only makes them faster.
inline __attribute__((always_inline)) void EigenBody(double* a, int n, double* values, double* work,
                                                     bool vectors) {
  double amax = 0.0;
  for (int j = 0; j < n; ++j)
    for (int i = 0; i <= j; ++i) amax = std::max(amax, std::abs(a[size_t(j) * n + i]));
  GEOFP8_CHECK(std::isfinite(amax), "symmetric eigen: the matrix holds a non-finite entry");
  double* t = work;  // A, both triangles, then the Householder vectors
  double* tau = work + size_t(n) * n;
  double* e = tau + n;  // e[i] couples values[i] and values[i + 1]; e[n - 1] = 0
  double* p = e + n;
  if (amax == 0.0) {
    for (int i = 0; i < n; ++i) values[i] = 0.0;
    if (vectors) {
      for (int j = 0; j < n; ++j)
        for (int i = 0; i < n; ++i) a[size_t(j) * n + i] = i == j ? 1.0 : 0.0;
    }
    return;
  }
  int exponent = 0;
  std::frexp(amax, &exponent);  // amax = f 2^exponent, f in [1/2, 1)
  // Multiplying by a power of two that is itself a normal double rounds exactly as ldexp does
  // (one correctly rounded operation), without a libm call per entry; the scales 2^-exponent and
  // 2^exponent are both normal unless amax is within a factor 4 of the exponent range's ends.
  const bool exact_scales = exponent > -1020 && exponent < 1020;
  const double down = exact_scales ? std::ldexp(1.0, -exponent) : 0.0;
  for (int j = 0; j < n; ++j)
    for (int i = 0; i <= j; ++i) {
      const double x = a[size_t(j) * n + i];
      t[size_t(j) * n + i] = t[size_t(i) * n + j] =
          exact_scales ? x * down : std::ldexp(x, -exponent);
    }

  // Tridiagonalise: step k maps column k below the subdiagonal onto its first entry with
  // H_k = I - tau_k v v^T (v[0] = 1, v acting on rows k+1..n-1), and updates the trailing block
  // B <- H B H = B - v w^T - w v^T, w = q - (tau/2)(q^T v) v, q = tau B v. v's tail is kept in
  // column k under the subdiagonal.
  for (int k = 0; k + 2 < n; ++k) {
    double* col = t + size_t(k) * n;
    const int r = n - k - 1;  // size of the trailing block
    double* v = col + k + 1;
    double tail = 0.0;
    for (int i = 1; i < r; ++i) tail += v[i] * v[i];
    if (tail == 0.0) {  // already tridiagonal in this column: H = I
      tau[k] = 0.0;
      e[k] = v[0];
      continue;
    }
    const double x0 = v[0];
    const double norm = std::sqrt(x0 * x0 + tail);
    const double beta = x0 >= 0.0 ? -norm : norm;  // away from x0: no cancellation in x0 - beta
    tau[k] = (beta - x0) / beta;
    const double scale = 1.0 / (x0 - beta);
    for (int i = 1; i < r; ++i) v[i] *= scale;
    v[0] = 1.0;
    e[k] = beta;
    double* b = t + size_t(k + 1) * n + (k + 1);  // trailing block, leading dimension n
    for (int i = 0; i < r; ++i) p[i] = 0.0;
    for (int j = 0; j < r; ++j) {
      const double vj = tau[k] * v[j];
      const double* __restrict bj = b + size_t(j) * n;
      double* __restrict pp = p;
      for (int i = 0; i < r; ++i) pp[i] += bj[i] * vj;
    }
    double pv = 0.0;
    for (int i = 0; i < r; ++i) pv += p[i] * v[i];
    const double half = 0.5 * tau[k] * pv;
    for (int i = 0; i < r; ++i) p[i] -= half * v[i];
    for (int j = 0; j < r; ++j) {
      double* __restrict bj = b + size_t(j) * n;
      const double* __restrict vv = v;
      const double* __restrict pp = p;
      const double vj = v[j], pj = p[j];
      for (int i = 0; i < r; ++i) bj[i] -= vv[i] * pj + pp[i] * vj;
    }
  }
  for (int i = 0; i < n; ++i) values[i] = t[size_t(i) * n + i];
  if (n >= 2) e[n - 2] = t[size_t(n - 2) * n + (n - 1)];
  e[n - 1] = 0.0;

  if (vectors) {  // Q = H_0 H_1 ... H_{n-3}, accumulated from the last reflector backwards
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < n; ++i) a[size_t(j) * n + i] = i == j ? 1.0 : 0.0;
    for (int k = n - 3; k >= 0; --k) {
      if (tau[k] == 0.0) continue;
      const double* v = t + size_t(k) * n + k + 1;
      const int r = n - k - 1;
      for (int j = k + 1; j < n; ++j) {  // column j of Q, rows k+1..n-1
        double* __restrict qj = a + size_t(j) * n + k + 1;
        double dot = 0.0;
        for (int i = 0; i < r; ++i) dot += v[i] * qj[i];
        dot *= tau[k];
        for (int i = 0; i < r; ++i) qj[i] -= dot * v[i];
      }
    }
  }

  // Implicit QL with Wilkinson-like shifts on (values, e), rotating Q's columns along. An
  // off-diagonal entry counts as zero once it is below eps times its two diagonal neighbours,
  // which keeps the backward error a small multiple of eps ||A||.
  const double eps = std::numeric_limits<double>::epsilon();
  double* d = values;
  for (int l = 0; l < n; ++l) {
    for (int iter = 0;; ++iter) {
      int m = l;
      for (; m + 1 < n; ++m) {
        if (std::abs(e[m]) <= eps * (std::abs(d[m]) + std::abs(d[m + 1]))) break;
      }
      if (m == l) break;
      GEOFP8_CHECK(iter < 60, "symmetric eigen: QL did not converge for eigenvalue ", l, " of ", n);
      double g = (d[l + 1] - d[l]) / (2.0 * e[l]);
      double r = std::sqrt(g * g + 1.0);
      g = d[m] - d[l] + e[l] / (g + (g >= 0.0 ? r : -r));
      double s = 1.0, c = 1.0, shift = 0.0;
      bool split = false;
      for (int i = m - 1; i >= l; --i) {
        const double f = s * e[i], bb = c * e[i];
        r = std::sqrt(f * f + g * g);
        e[i + 1] = r;
        if (r == 0.0) {  // the rotation degenerates: the matrix split at i + 1
          d[i + 1] -= shift;
          e[m] = 0.0;
          split = true;
          break;
        }
        s = f / r;
        c = g / r;
        g = d[i + 1] - shift;
        r = (d[i] - g) * s + 2.0 * c * bb;
        shift = s * r;
        d[i + 1] = g + shift;
        g = c * r - bb;
        if (vectors) {  // distinct columns: __restrict lets the compiler vectorise the loop
          double* __restrict zi = a + size_t(i) * n;
          double* __restrict zn = a + size_t(i + 1) * n;
          for (int row = 0; row < n; ++row) {
            const double x = zi[row], y = zn[row];
            zn[row] = s * x + c * y;
            zi[row] = c * x - s * y;
          }
        }
      }
      if (split) continue;
      d[l] -= shift;
      e[l] = g;
      e[m] = 0.0;
    }
  }

  // Ascending order (selection sort: n is small and every swap moves a whole eigenvector).
  for (int i = 0; i + 1 < n; ++i) {
    int lo = i;
    for (int j = i + 1; j < n; ++j)
      if (d[j] < d[lo]) lo = j;
    if (lo == i) continue;
    std::swap(d[i], d[lo]);
    if (vectors) std::swap_ranges(a + size_t(i) * n, a + size_t(i + 1) * n, a + size_t(lo) * n);
  }
  const double up = exact_scales ? std::ldexp(1.0, exponent) : 0.0;
  for (int i = 0; i < n; ++i) d[i] = exact_scales ? d[i] * up : std::ldexp(d[i], exponent);
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"))) void EigenAvx2(double* a, int n, double* values, double* work,
                                               bool vectors) {
  EigenBody(a, n, values, work, vectors);
}
#endif

void EigenBaseline(double* a, int n, double* values, double* work, bool vectors) {
  EigenBody(a, n, values, work, vectors);
}

void SmallSymmetricEigen(double* a, int n, double* values, double* work, bool vectors) {
#ifdef GEOFP8_LAPACK_AVX2
  if (CpuHasAvx2()) return EigenAvx2(a, n, values, work, vectors);
#endif
  EigenBaseline(a, n, values, work, vectors);
}

}  // namespace

double LargestEigenvalue(std::vector<double>& a, int64_t n64) {
  GEOFP8_CHECK(static_cast<int64_t>(a.size()) == n64 * n64, "eigen buffer size ", a.size());
  if (n64 == 0) return 0.0;
  const int n = ToInt(n64, "n");
  thread_local std::vector<double> work, values;
  work.resize(size_t(n) * n + 3 * size_t(n));
  values.resize(size_t(n));
  SmallSymmetricEigen(a.data(), n, values.data(), work.data(), /*vectors=*/false);
  return values.back();  // ascending order
}

void SymmetricEigenInPlace(double* a, int64_t n64, double* values, std::vector<double>& work) {
  const int n = ToInt(n64, "n");
  if (n == 0) return;
  const size_t need = size_t(n) * n + 3 * size_t(n);
  if (work.size() < need) work.resize(need);
  SmallSymmetricEigen(a, n, values, work.data(), /*vectors=*/true);
}

void SymmetricEigen(std::vector<double> a, int64_t n64, std::vector<double>& values,
                    std::vector<double>& vectors) {
  GEOFP8_CHECK(static_cast<int64_t>(a.size()) == n64 * n64, "eigen buffer size ", a.size());
  const int n = ToInt(n64, "n");
  values.assign(static_cast<size_t>(n), 0.0);
  vectors.clear();
  if (n == 0) return;
  const char jobz = 'V', uplo = 'U';
  int info = 0, lwork = -1;
  double query = 0;
  dsyev_(&jobz, &uplo, &n, a.data(), &n, values.data(), &query, &lwork, &info);
  GEOFP8_CHECK(info == 0, "dsyev workspace query failed, info=", info);
  lwork = std::max(1, static_cast<int>(query));
  std::vector<double> work(static_cast<size_t>(lwork));
  dsyev_(&jobz, &uplo, &n, a.data(), &n, values.data(), work.data(), &lwork, &info);
  GEOFP8_CHECK(info == 0, "dsyev failed to converge, info=", info);
  // LAPACK returns ascending order: reverse to descending, columns with their values.
  std::reverse(values.begin(), values.end());
  vectors.resize(a.size());
  for (int j = 0; j < n; ++j) {
    std::copy(a.begin() + static_cast<int64_t>(n - 1 - j) * n,
              a.begin() + static_cast<int64_t>(n - j) * n, vectors.begin() + int64_t(j) * n);
  }
}

}  // namespace geofp8::geometry::lapack
