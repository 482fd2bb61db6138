// LAPACK wrappers for the geometry: Householder and Cholesky QR, divide-and-conquer SVD,
// symmetric eigen. Each call checks LAPACK's info and throws geofp8::Error naming the routine.
#include "kernels/geometry/lapack.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "kernels/common/check.h"

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

}  // namespace

uint64_t OrthonormalizeFallbacks() { return fallbacks.load(std::memory_order_relaxed); }

bool OrthonormalizeInPlace(double* a, int64_t rows, int64_t cols, std::vector<double>* r) {
  GEOFP8_CHECK(rows >= cols && cols >= 0, "orthonormalize needs rows >= cols, got ", rows, "x",
               cols);
  if (r) r->assign(static_cast<size_t>(cols * cols), 0.0);
  if (cols == 0) return true;
  const int m = ToInt(rows, "rows"), n = ToInt(cols, "cols");
  struct Scratch {
    std::vector<double> original, gram, r1, d;
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
    cblas_dtrsm(CblasColMajor, CblasRight, CblasUpper, CblasNoTrans, CblasNonUnit, m, n, 1.0, r1, n,
                a, m);
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
  cblas_dtrsm(CblasColMajor, CblasRight, CblasUpper, CblasNoTrans, CblasNonUnit, m, n, 1.0, gram, n,
              a, m);
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
  if (info == 0) return out;
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

double LargestEigenvalue(std::vector<double>& a, int64_t n64) {
  GEOFP8_CHECK(static_cast<int64_t>(a.size()) == n64 * n64, "eigen buffer size ", a.size());
  if (n64 == 0) return 0.0;
  const int n = ToInt(n64, "n");
  const char jobz = 'N', uplo = 'U';
  std::vector<double> w(static_cast<size_t>(n));
  int info = 0, lwork = -1;
  double query = 0;
  dsyev_(&jobz, &uplo, &n, a.data(), &n, w.data(), &query, &lwork, &info);
  GEOFP8_CHECK(info == 0, "dsyev workspace query failed, info=", info);
  lwork = std::max(1, static_cast<int>(query));
  std::vector<double> work(static_cast<size_t>(lwork));
  dsyev_(&jobz, &uplo, &n, a.data(), &n, w.data(), work.data(), &lwork, &info);
  GEOFP8_CHECK(info == 0, "dsyev failed to converge, info=", info);
  return w.back();  // ascending order
}

void SymmetricEigenInPlace(double* a, int64_t n64, double* values, std::vector<double>& work) {
  const int n = ToInt(n64, "n");
  if (n == 0) return;
  const char jobz = 'V', uplo = 'U';
  // (nb + 2) n with LAPACK's block size 64 is dsyev's optimal workspace; no query needed.
  int lwork = std::max(1, 66 * n), info = 0;
  if (work.size() < static_cast<size_t>(lwork)) work.resize(static_cast<size_t>(lwork));
  dsyev_(&jobz, &uplo, &n, a, &n, values, work.data(), &lwork, &info);
  GEOFP8_CHECK(info == 0, "dsyev failed to converge, info=", info);
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
