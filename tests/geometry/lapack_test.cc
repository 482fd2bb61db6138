// The LAPACK wrappers on inputs that have broken them: a real gradient on which divide-and-
// conquer SVD (dgesdd) fails to converge with some OpenBLAS kernels must still be decomposed.
#include "kernels/geometry/lapack.h"

#include <cblas.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <vector>

namespace geofp8::geometry::lapack {
namespace {

// tok_emb's averaged gradient at step 48 of llama-small, 4 ranks, batch 32 (geofp8-train
// --dump-grads): dgesdd returns info = 1 on it with OpenBLAS 0.3.21's Haswell kernels on one
// thread (as every rank runs), and converges with two.
std::vector<double> Fixture(int64_t rows, int64_t cols) {
  std::ifstream is(GEOFP8_TEST_DATA "/tok_emb_256x256_dgesdd_fails.f32", std::ios::binary);
  std::vector<float> g(static_cast<size_t>(rows * cols));
  is.read(reinterpret_cast<char*>(g.data()), static_cast<std::streamsize>(g.size() * 4));
  EXPECT_TRUE(is.good()) << "fixture missing or short";
  std::vector<double> a(g.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) a[j * rows + i] = g[i * cols + j];  // column-major
  return a;
}

// The fallback itself, on every kernel: with divide and conquer made to fail, ThinSvd's
// QR-iteration path must give the same decomposition (singular values to LAPACK's backward-error
// bound, p(m, n) eps ||A|| with p = m n generous at this size).
TEST(LapackTest, ThinSvdFallsBackToQrIterationWhenDivideAndConquerFails) {
  const int64_t m = 40, n = 30;
  std::vector<double> a(size_t(m * n));
  uint64_t x = 12345;
  for (double& v : a) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    v = double(int64_t(x >> 11) % 2001 - 1000) / 1000.0;
  }
  std::vector<double> work = a;
  const Svd plain = ThinSvd(work, m, n);
  work = a;
  FailNextDivideAndConquerForTest();
  const Svd fallback = ThinSvd(work, m, n);
  ASSERT_EQ(fallback.s.size(), size_t(n));
  const double tol = double(m) * n * 2.2e-16 * plain.s[0];
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(fallback.s[i], plain.s[i], tol) << i;
  double num = 0, den = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double r = 0;
      for (int64_t p = 0; p < n; ++p)
        r += fallback.u[p * m + i] * fallback.s[p] * fallback.vt[j * n + p];
      num += (r - a[j * m + i]) * (r - a[j * m + i]);
      den += a[j * m + i] * a[j * m + i];
    }
  EXPECT_LT(std::sqrt(num / den), double(m) * n * 2.2e-16);
  // The injection is one-shot: the next call is divide and conquer again, with its own bits.
  work = a;
  const Svd again = ThinSvd(work, m, n);
  EXPECT_EQ(again.s, plain.s);
}

TEST(LapackTest, ThinSvdDecomposesAMatrixDivideAndConquerCannot) {
  openblas_set_num_threads(1);
  const int64_t n = 256;
  const std::vector<double> a = Fixture(n, n);
  std::vector<double> work = a;
  const Svd svd = ThinSvd(work, n, n);
  ASSERT_EQ(svd.s.size(), size_t(n));
  for (int64_t i = 1; i < n; ++i) EXPECT_GE(svd.s[i - 1], svd.s[i]) << i;
  EXPECT_GE(svd.s[n - 1], 0.0);
  // LAPACK bounds the backward error by p(m, n) eps ||A|| with p "a modestly growing function";
  // p = n^3 is generous for any kernel and still eight orders below a wrong decomposition.
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double r = 0;
      for (int64_t p = 0; p < n; ++p) r += svd.u[p * n + i] * svd.s[p] * svd.vt[j * n + p];
      num += (r - a[j * n + i]) * (r - a[j * n + i]);
      den += a[j * n + i] * a[j * n + i];
    }
  ASSERT_GT(den, 0);
  EXPECT_LT(std::sqrt(num / den), double(n) * n * n * 2.2e-16);
  for (int64_t p = 0; p < 4; ++p) {  // leading singular vectors orthonormal
    for (int64_t q = 0; q <= p; ++q) {
      double d = 0;
      for (int64_t i = 0; i < n; ++i) d += svd.u[p * n + i] * svd.u[q * n + i];
      EXPECT_NEAR(d, p == q ? 1.0 : 0.0, double(n) * n * n * 2.2e-16) << p << "," << q;
    }
  }
}

// --- OrthonormalizeInPlace (Cholesky QR2 with a Householder fallback) ---

constexpr double kU = 0x1.0p-53;  // unit round-off of double

// Column-major rows x cols with N(0, 1) entries, column j scaled by scale[j] when given.
std::vector<double> Random(int64_t rows, int64_t cols, uint64_t seed,
                           const std::vector<double>& scale = {}) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> normal;
  std::vector<double> a(static_cast<size_t>(rows * cols));
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t i = 0; i < rows; ++i)
      a[j * rows + i] = normal(gen) * (scale.empty() ? 1 : scale[j]);
  return a;
}

// ||Q^T Q - I||_F, accumulated in long double so that the check adds no error of its own.
double OrthonormalityError(const std::vector<double>& q, int64_t rows, int64_t cols) {
  long double sum = 0;
  for (int64_t i = 0; i < cols; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      long double d = 0;
      for (int64_t r = 0; r < rows; ++r) d += (long double)q[i * rows + r] * q[j * rows + r];
      d -= i == j ? 1 : 0;
      sum += d * d;
    }
  return std::sqrt(double(sum));
}

// Largest over columns of ||(Q R - A) e_j|| / ||a_j|| (columns of A that are exactly zero: the
// absolute ||(Q R) e_j||), in long double.
double ColumnResidual(const std::vector<double>& a, const std::vector<double>& q,
                      const std::vector<double>& r, int64_t rows, int64_t cols) {
  double worst = 0;
  for (int64_t j = 0; j < cols; ++j) {
    long double num = 0, den = 0;
    for (int64_t i = 0; i < rows; ++i) {
      long double x = 0;
      for (int64_t p = 0; p <= j; ++p) x += (long double)q[p * rows + i] * r[j * cols + p];
      num += (x - a[j * rows + i]) * (x - a[j * rows + i]);
      den += (long double)a[j * rows + i] * a[j * rows + i];
    }
    worst = std::max(worst, double(std::sqrt(den > 0 ? num / den : num)));
  }
  return worst;
}

void ExpectUpperTriangular(const std::vector<double>& r, int64_t cols) {
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t i = j + 1; i < cols; ++i) EXPECT_EQ(r[j * cols + i], 0.0) << i << "," << j;
}

// CholeskyQR2's bounds (Yamamoto, Nakatsukasa, Yanagisawa, Fukaya 2015, theorems 3.3 and 3.5),
// for an input whose first-pass Q1 satisfies their condition (the code checks ||Q1^T Q1 - I||_2
// <= 1/2): ||Q^T Q - I||_F <= 6 (m n + n (n + 1)) u, ||Q R - X||_F <= 5 n^2 sqrt(n) u ||X||_2.
// Applied to the column-equilibrated X = A D (unit columns, ||X||_2 <= sqrt(n)), the residual
// bound holds per column relative to that column's norm with the factor 5 n^3 u.
double OrthoBound(int64_t m, int64_t n) { return 6.0 * double(m * n + n * (n + 1)) * kU; }
double ResidualBound(int64_t n) { return 5.0 * double(n * n * n) * kU; }

// Householder QR (Higham, Accuracy and Stability, theorem 19.4): ||Q - Q_exact||_F <= sqrt(n)
// gamma~_{mn} and ||A - Q R|| per column <= gamma~_{mn} ||a_j||, gamma~_k = c k u / (1 - c k u)
// with c a small integer constant; c = 8 and a factor 2 for Q^T Q - I from Q - Q_exact.
double HouseholderOrthoBound(int64_t m, int64_t n) {
  return 2.0 * std::sqrt(double(n)) * 8.0 * double(m * n) * kU;
}
double HouseholderResidualBound(int64_t m, int64_t n) { return 8.0 * double(m * n) * kU; }

TEST(Orthonormalize, CholeskyQr2OnAWellConditionedMatrixMeetsItsBounds) {
  const int64_t m = 704, n = 28;
  const std::vector<double> a = Random(m, n, 1);
  std::vector<double> q = a, r;
  const uint64_t before = OrthonormalizeFallbacks();
  EXPECT_TRUE(OrthonormalizeInPlace(q.data(), m, n, &r));
  EXPECT_EQ(OrthonormalizeFallbacks(), before);
  EXPECT_LE(OrthonormalityError(q, m, n), OrthoBound(m, n));
  EXPECT_LE(ColumnResidual(a, q, r, m, n), ResidualBound(n));
  ExpectUpperTriangular(r, n);
  for (int64_t j = 0; j < n; ++j) EXPECT_GT(r[j * n + j], 0.0) << j;
}

TEST(Orthonormalize, EquilibrationTakesColumnsOfVeryDifferentNorms) {
  // Column norms from 1e-8 to 1e8 (condition number 1e16 unscaled, about 2 after scaling): the
  // Cholesky path must still take it and meet the bounds column by column.
  const int64_t m = 256, n = 20;
  std::vector<double> scale(n);
  for (int64_t j = 0; j < n; ++j) scale[j] = std::pow(10.0, -8.0 + 16.0 * double(j) / (n - 1));
  const std::vector<double> a = Random(m, n, 2, scale);
  std::vector<double> q = a, r;
  EXPECT_TRUE(OrthonormalizeInPlace(q.data(), m, n, &r));
  EXPECT_LE(OrthonormalityError(q, m, n), OrthoBound(m, n));
  EXPECT_LE(ColumnResidual(a, q, r, m, n), ResidualBound(n));
}

TEST(Orthonormalize, ModeratelyIllConditionedStaysOnTheCholeskyPath) {
  // [B, B T + 1e-4 N]: condition number about 1e4 after equilibration. The first pass loses
  // about kappa^2 u = 1e-8 of orthogonality, which the second pass repairs to the u-level bound.
  const int64_t m = 512, n = 24, h = n / 2;
  std::vector<double> a = Random(m, n, 3);
  const std::vector<double> t = Random(h, h, 4), noise = Random(m, h, 5);
  for (int64_t j = 0; j < h; ++j)
    for (int64_t i = 0; i < m; ++i) {
      double x = 1e-4 * noise[j * m + i];
      for (int64_t p = 0; p < h; ++p) x += a[p * m + i] * t[j * h + p];
      a[(h + j) * m + i] = x;
    }
  std::vector<double> q = a, r;
  EXPECT_TRUE(OrthonormalizeInPlace(q.data(), m, n, &r));
  EXPECT_LE(OrthonormalityError(q, m, n), OrthoBound(m, n));
  EXPECT_LE(ColumnResidual(a, q, r, m, n), ResidualBound(n));
}

TEST(Orthonormalize, IllConditionedAndRankDeficientFallBackToHouseholder) {
  const int64_t m = 300, n = 16;
  struct Case {
    const char* name;
    std::vector<double> a;
  };
  std::vector<Case> cases;
  {  // nearly dependent: column n-1 = column 0 + 1e-12 noise (condition number about 1e12)
    std::vector<double> a = Random(m, n, 6);
    const std::vector<double> noise = Random(m, 1, 7);
    for (int64_t i = 0; i < m; ++i) a[(n - 1) * m + i] = a[i] + 1e-12 * noise[i];
    cases.push_back({"nearly dependent", a});
  }
  {  // beyond CholeskyQR2's guarantee: column n-1 = column 0 + 3e-8 noise, condition number
     // about 5e7 after equilibration, so the first pass loses about kappa^2 u = 0.3 of
     // orthogonality per entry, far past the 1 / (2 n) the code accepts. CholeskyQR2 often still
     // succeeds there, but nothing bounds its result, so the code must not keep it.
    std::vector<double> a = Random(m, n, 6);
    const std::vector<double> noise = Random(m, 1, 7);
    for (int64_t i = 0; i < m; ++i) a[(n - 1) * m + i] = a[i] + 3e-8 * noise[i];
    cases.push_back({"beyond the guarantee", a});
  }
  {  // exactly rank deficient: a zero column and a repeated one
    std::vector<double> a = Random(m, n, 8);
    for (int64_t i = 0; i < m; ++i) a[3 * m + i] = 0.0;
    for (int64_t i = 0; i < m; ++i) a[9 * m + i] = a[2 * m + i];
    cases.push_back({"rank deficient", a});
  }
  for (const Case& c : cases) {
    std::vector<double> q = c.a, r;
    const uint64_t before = OrthonormalizeFallbacks();
    EXPECT_FALSE(OrthonormalizeInPlace(q.data(), m, n, &r)) << c.name;
    EXPECT_EQ(OrthonormalizeFallbacks(), before + 1) << c.name;
    // Householder's Q is orthonormal whatever A's rank, and Q R reproduces A.
    EXPECT_LE(OrthonormalityError(q, m, n), HouseholderOrthoBound(m, n)) << c.name;
    EXPECT_LE(ColumnResidual(c.a, q, r, m, n), HouseholderResidualBound(m, n)) << c.name;
    ExpectUpperTriangular(r, n);
  }
}

TEST(Orthonormalize, SameInputSameBitsOnBothPaths) {
  const int64_t m = 200, n = 12;
  std::vector<double> good = Random(m, n, 9), bad = good;
  for (int64_t i = 0; i < m; ++i) bad[5 * m + i] = bad[4 * m + i];
  for (const std::vector<double>* a : {&good, &bad}) {
    std::vector<double> q1 = *a, q2 = *a, r1, r2;
    EXPECT_EQ(OrthonormalizeInPlace(q1.data(), m, n, &r1),
              OrthonormalizeInPlace(q2.data(), m, n, &r2));
    EXPECT_EQ(0, std::memcmp(q1.data(), q2.data(), q1.size() * sizeof(double)));
    EXPECT_EQ(0, std::memcmp(r1.data(), r2.data(), r1.size() * sizeof(double)));
  }
}

// --- SymmetricEigenInPlace (Householder tridiagonalisation + implicit QL, no BLAS) ---

constexpr double kEps = 0x1.0p-52;  // machine epsilon of double

// Upper triangle of S (n x n, column-major) with the strict lower triangle poisoned: the solver
// must read only the upper one.
std::vector<double> Poisoned(const std::vector<double>& s, int64_t n) {
  std::vector<double> a = s;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = j + 1; i < n; ++i) a[j * n + i] = std::nan("");
  return a;
}

// S = W diag(lambda) W^T with W orthonormal (Householder Q of a random matrix).
std::vector<double> WithSpectrum(const std::vector<double>& lambda, uint64_t seed) {
  const int64_t n = static_cast<int64_t>(lambda.size());
  std::vector<double> w = Random(n, n, seed);
  QrInPlace(w, n, n, nullptr);
  std::vector<double> s(size_t(n * n), 0.0);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t p = 0; p < n; ++p) s[j * n + i] += w[p * n + i] * lambda[p] * w[p * n + j];
  for (int64_t j = 0; j < n; ++j)  // exactly symmetric
    for (int64_t i = 0; i < j; ++i) s[i * n + j] = s[j * n + i];
  return s;
}

double FrobeniusNorm(const std::vector<double>& s) {
  long double sum = 0;
  for (double x : s) sum += (long double)x * x;
  return std::sqrt(double(sum));
}

// Householder tridiagonalisation and QL with orthogonal transformations are backward stable:
// the computed pairs are exact for A + E with ||E||_F <= p(n) eps ||A||_F, p a low-degree
// polynomial (Golub & Van Loan, sections 8.3.1 and 8.3.3; Wilkinson). p(n) = 10 n is ample for
// these sizes and still orders of magnitude below a wrong result. The residual max_j
// ||S v_j - lambda_j v_j|| and ||V^T V - I||_F are then bounded by that too.
double Backward(int64_t n) { return 10.0 * double(n) * kEps; }

// Checks (values, vectors) against S: ascending, residual and orthonormality within Backward.
void ExpectEigenpairs(const std::vector<double>& s, int64_t n, const std::vector<double>& values,
                      const std::vector<double>& vectors, const char* what) {
  const double norm = FrobeniusNorm(s);
  for (int64_t i = 1; i < n; ++i) EXPECT_LE(values[i - 1], values[i]) << what << " " << i;
  for (int64_t j = 0; j < n; ++j) {
    long double res = 0;
    for (int64_t i = 0; i < n; ++i) {
      long double x = 0;
      for (int64_t p = 0; p < n; ++p) x += (long double)s[p * n + i] * vectors[j * n + p];
      x -= (long double)values[j] * vectors[j * n + i];
      res += x * x;
    }
    EXPECT_LE(std::sqrt(double(res)), Backward(n) * norm) << what << " pair " << j;
  }
  EXPECT_LE(OrthonormalityError(vectors, n, n), Backward(n)) << what;
}

TEST(SymmetricEigenInPlace, AgreesWithDsyevAndReadsOnlyTheUpperTriangle) {
  for (const int64_t n : {1, 2, 3, 20, 28, 64}) {
    const std::vector<double> x = Random(n, n, 10 + n);
    std::vector<double> s(size_t(n * n), 0.0);
    cblas_dgemm(CblasColMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0, x.data(), n, x.data(), n,
                0.0, s.data(), n);
    for (int64_t j = 0; j < n; ++j)  // exactly symmetric
      for (int64_t i = 0; i < j; ++i) s[i * n + j] = s[j * n + i];
    std::vector<double> ref_values, ref_vectors;
    SymmetricEigen(s, n, ref_values, ref_vectors);  // dsyev, descending
    std::vector<double> a = Poisoned(s, n), w(n), work;
    SymmetricEigenInPlace(a.data(), n, w.data(), work);
    ExpectEigenpairs(s, n, w, a, "x x^T");
    // Both solvers are backward stable, so by Weyl's inequality each eigenvalue is within the
    // sum of their backward errors of the exact one and of the other's.
    const double norm = FrobeniusNorm(s);
    for (int64_t i = 0; i < n; ++i)
      EXPECT_NEAR(w[i], ref_values[n - 1 - i], 2 * Backward(n) * norm) << n << " " << i;
    // Eigenvectors of a simple eigenvalue agree up to sign within 2 Backward ||S|| / gap
    // (Davis-Kahan), gap the distance to the nearest other eigenvalue.
    for (int64_t i = 0; i < n; ++i) {
      double gap = INFINITY;
      if (i > 0) gap = std::min(gap, w[i] - w[i - 1]);
      if (i + 1 < n) gap = std::min(gap, w[i + 1] - w[i]);
      long double dot = 0;
      for (int64_t r = 0; r < n; ++r)
        dot += (long double)a[i * n + r] * ref_vectors[(n - 1 - i) * n + r];
      const double sign = dot >= 0 ? 1.0 : -1.0;
      long double dist = 0;  // ||v - sign u|| = 2 sin(theta / 2) for unit vectors
      for (int64_t r = 0; r < n; ++r) {
        const long double x = a[i * n + r] - sign * ref_vectors[(n - 1 - i) * n + r];
        dist += x * x;
      }
      // Plus both vectors' departure from unit norm.
      EXPECT_LE(std::sqrt(double(dist)), 2 * Backward(n) * norm / gap + 2 * Backward(n))
          << n << " vector " << i;
    }
  }
}

TEST(SymmetricEigenInPlace, KnownSpectraWithRepeatedAndClusteredValues) {
  struct Case {
    const char* name;
    std::vector<double> lambda;
  };
  std::vector<double> spread(28), cluster(20), repeated(28), signs(12);
  for (int i = 0; i < 28; ++i) spread[i] = std::ldexp(1.0, -i);  // 1 .. 2^-27, graded
  for (int i = 0; i < 20; ++i) cluster[i] = i < 10 ? 1.0 + 1e-12 * i : 1e-3 * i;
  for (int i = 0; i < 28; ++i) repeated[i] = i < 8 ? 5.0 : (i < 16 ? 2.0 : 0.0);
  for (int i = 0; i < 12; ++i) signs[i] = (i % 2 ? -1.0 : 1.0) * (i + 1);
  const std::vector<Case> cases = {
      {"graded", spread}, {"clustered", cluster}, {"repeated", repeated}, {"indefinite", signs}};
  for (const Case& c : cases) {
    const int64_t n = static_cast<int64_t>(c.lambda.size());
    const std::vector<double> s = WithSpectrum(c.lambda, 20 + n);
    std::vector<double> a = Poisoned(s, n), w(n), work;
    SymmetricEigenInPlace(a.data(), n, w.data(), work);
    ExpectEigenpairs(s, n, w, a, c.name);
    std::vector<double> sorted = c.lambda;
    std::sort(sorted.begin(), sorted.end());
    // S itself was formed with rounding: each entry within n eps max|lambda| of W L W^T, so
    // its eigenvalues are within n^2 eps max|lambda| (||E||_F <= n max|e_ij|) of lambda; plus
    // the solver's backward error.
    const double scale = std::max(std::abs(sorted.front()), std::abs(sorted.back()));
    const double tol = double(n * n) * kEps * scale + Backward(n) * FrobeniusNorm(s);
    for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(w[i], sorted[i], tol) << c.name << " " << i;
  }
}

TEST(SymmetricEigenInPlace, ZeroDiagonalAndTinyMatrices) {
  const int64_t n = 16;
  std::vector<double> a(size_t(n * n), 0.0), w(n, -1.0), work;
  SymmetricEigenInPlace(a.data(), n, w.data(), work);  // zero: values 0, vectors the identity
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(w[i], 0.0);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(a[j * n + i], i == j ? 1.0 : 0.0);
  // Diagonal input is already tridiagonal with zero off-diagonal: the values come back exactly,
  // sorted, with unit vectors.
  std::vector<double> d(size_t(n * n), 0.0);
  for (int64_t i = 0; i < n; ++i) d[i * n + i] = double((7 * i) % n) - 3.0;
  a = d;
  SymmetricEigenInPlace(a.data(), n, w.data(), work);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(w[i], double(i) - 3.0) << i;
    for (int64_t r = 0; r < n; ++r) {
      // The unit vector of value i - 3 sits at the row whose diagonal holds it.
      const bool hit = double((7 * r) % n) - 3.0 == w[i];
      EXPECT_EQ(std::abs(a[i * n + r]), hit ? 1.0 : 0.0) << i << "," << r;
    }
  }
  // Huge and tiny scales: the power-of-two scaling inside keeps squares finite and exact.
  for (const double scale : {1e150, 1e-150}) {
    std::vector<double> s = WithSpectrum({3, 2, 1}, 30);
    for (double& x : s) x *= scale;
    a = s;
    std::vector<double> w3(3);
    SymmetricEigenInPlace(a.data(), 3, w3.data(), work);
    for (int i = 0; i < 3; ++i) EXPECT_NEAR(w3[i] / scale, i + 1.0, 1e-13) << scale;
  }
  std::vector<double> bad = {1.0, 0.0, INFINITY, 1.0};  // (0, 1): upper triangle
  EXPECT_THROW(SymmetricEigenInPlace(bad.data(), 2, w.data(), work), std::exception);
}

TEST(SymmetricEigenInPlace, SameInputSameBitsAndLargestEigenvalueAgrees) {
  const int64_t n = 28;
  const std::vector<double> s = WithSpectrum(Random(n, 1, 40), 41);
  std::vector<double> a1 = s, a2 = s, w1(n), w2(n), work1, work2(1000, 7.0);
  SymmetricEigenInPlace(a1.data(), n, w1.data(), work1);
  SymmetricEigenInPlace(a2.data(), n, w2.data(), work2);  // dirty, larger scratch
  EXPECT_EQ(0, std::memcmp(a1.data(), a2.data(), a1.size() * sizeof(double)));
  EXPECT_EQ(0, std::memcmp(w1.data(), w2.data(), w1.size() * sizeof(double)));
  std::vector<double> b = s;
  EXPECT_EQ(LargestEigenvalue(b, n), w1[n - 1]);  // same solver, no vectors: same values
  EXPECT_EQ(0, std::memcmp(b.data(), s.data(), b.size() * sizeof(double)));  // left as it was
}

}  // namespace
}  // namespace geofp8::geometry::lapack
