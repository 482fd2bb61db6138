// The LAPACK wrappers on inputs that have broken them: a real gradient on which divide-and-
// conquer SVD (dgesdd) fails to converge with some OpenBLAS kernels must still be decomposed.
#include "kernels/geometry/lapack.h"

#include <cblas.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
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

}  // namespace
}  // namespace geofp8::geometry::lapack
