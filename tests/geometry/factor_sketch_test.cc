// The streaming Kronecker-factor sketch: its eigensolver against a known spectrum, the sketch
// against the dense EMA factors it approximates, repeatability, the fit measure and the wire form.
#include "kernels/geometry/factor_sketch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/common/check.h"
#include "kernels/common/cpu_features.h"
#include "kernels/geometry/factors.h"
#include "kernels/geometry/lapack.h"
#include "kernels/geometry/thin_product.h"

namespace geofp8 {
namespace {

std::vector<float> Gaussian(size_t count, uint64_t seed) {
  std::vector<float> out(count);
  geometry::SeededGaussian(seed, out);
  return out;
}

// Orthonormal rows x k basis (row-major float) from seeded Gaussians.
std::vector<float> Basis(int64_t rows, int k, uint64_t seed) {
  std::vector<float> g = Gaussian(size_t(rows * k), seed);
  std::vector<double> a(size_t(rows * k));
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < k; ++j) a[j * rows + r] = g[r * k + j];
  geometry::lapack::QrInPlace(a, rows, k, nullptr);
  std::vector<float> out(size_t(rows * k));
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < k; ++j) out[r * k + j] = float(a[j * rows + r]);
  return out;
}

// G = U diag(s) V^T + noise * N(0, 1): a persistent low-rank part plus isotropic noise.
std::vector<float> LowRankPlusNoise(const std::vector<float>& U, const std::vector<float>& V,
                                    const std::vector<double>& s, int64_t m, int64_t n,
                                    double noise, uint64_t seed) {
  const int k = int(s.size());
  std::vector<float> g = Gaussian(size_t(m * n), seed);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double x = noise * g[i * n + j];
      for (int p = 0; p < k; ++p) x += U[i * k + p] * s[p] * V[j * k + p];
      g[i * n + j] = float(x);
    }
  return g;
}

// Top-k eigenvectors (rows x k, row-major) and values of a dense symmetric matrix, by LAPACK's
// SVD (for a positive semidefinite matrix the singular pairs are the eigenpairs).
void DenseTop(std::vector<double> a, int64_t dim, int k, std::vector<float>& vecs,
              std::vector<double>& vals) {
  geometry::lapack::Svd svd = geometry::lapack::ThinSvd(a, dim, dim);
  vecs.resize(size_t(dim * k));
  for (int64_t r = 0; r < dim; ++r)
    for (int j = 0; j < k; ++j) vecs[r * k + j] = float(svd.u[j * dim + r]);
  vals.assign(svd.s.begin(), svd.s.begin() + k);
}

// ||sin Theta|| between two orthonormal bases (rows x k, row-major), via a lowrank Geometry.
double Distance(const std::vector<float>& a, const std::vector<float>& b, int64_t rows, int k) {
  Geometry ga, gb;
  for (Geometry* g : {&ga, &gb}) {
    g->mode = GeometryMode::kLowRank;
    g->version = 1;
    g->m = rows;
    g->n = rows;
    g->k = k;
  }
  ga.U = ga.V = a;
  gb.U = gb.V = b;
  return SubspaceDrift(ga, gb);
}

// Y = G X and ||G||^2 in one pass, on shapes that leave remainders in every blocking (rows not
// a multiple of the kernel's 6, columns not of 8, X's width 0 to 3 registers).
TEST(ThinProduct, MatchesALongDoubleReferenceAndGivesTheSameBitsTwice) {
  const int64_t m = 37, n = 29;
  std::mt19937 gen(3);
  std::normal_distribution<float> normal;
  std::vector<float> g(size_t(m * n));
  for (float& v : g) v = normal(gen);
  long double norm_ref = 0;
  for (float v : g) norm_ref += (long double)v * v;
  for (const int cols : {0, 5, 8, 12, 20}) {
    const int ldx = (cols + 7) / 8 * 8;
    std::vector<float> x(size_t(n * ldx), 0.f), y(size_t(m * ldx), NAN), y2(y.size(), NAN);
    for (int64_t j = 0; j < n; ++j)
      for (int c = 0; c < cols; ++c) x[j * ldx + c] = normal(gen);
    const double norm = geometry::ThinProductAndNorm(g.data(), m, n, x.data(), ldx, y.data());
    // A double sum of m n non-negative terms: relative error at most m n u_double.
    EXPECT_NEAR(norm, double(norm_ref), double(m * n) * 0x1.0p-53 * double(norm_ref)) << cols;
    for (int64_t r = 0; r < m; ++r)
      for (int c = 0; c < ldx; ++c) {
        long double ref = 0, mag = 0;
        for (int64_t j = 0; j < n; ++j) {
          ref += (long double)g[r * n + j] * x[j * ldx + c];
          mag += std::abs((long double)g[r * n + j] * x[j * ldx + c]);
        }
        // A float dot product of length n (fused or not): |error| <= gamma_n sum |g x|,
        // gamma_n = n u / (1 - n u), u = 2^-24 (Higham, Accuracy and Stability, 3.1).
        const double u = 0x1.0p-24, gamma = n * u / (1 - n * u);
        EXPECT_NEAR(y[r * ldx + c], double(ref), gamma * double(mag)) << r << "," << c;
        if (c >= cols) {
          EXPECT_EQ(y[r * ldx + c], 0.f) << "padding column " << c;
        }
      }
    EXPECT_EQ(norm, geometry::ThinProductAndNorm(g.data(), m, n, x.data(), ldx, y2.data()));
    EXPECT_EQ(0, std::memcmp(y.data(), y2.data(), y.size() * sizeof(float))) << cols;
  }
  std::vector<float> bad = g, x(size_t(n * 8), 1.f), y(size_t(m * 8));
  bad[m * n - 1] = INFINITY;
  EXPECT_FALSE(
      std::isfinite(geometry::ThinProductAndNorm(bad.data(), m, n, x.data(), 8, y.data())));
  bad[m * n - 1] = NAN;
  EXPECT_TRUE(std::isnan(geometry::ThinProductAndNorm(bad.data(), m, n, x.data(), 8, y.data())));
  EXPECT_THROW(geometry::ThinProductAndNorm(g.data(), m, n, x.data(), 5, y.data()), Error);
}

// Both reductions of the lowrank transform in one read: X = G V and W^T = G^T U (or +=), each
// output within gamma of a long double reference, for rows not a multiple of the kernel's 6, with
// each side alone, and the same bits twice. Where the CPU lacks AVX2 it declines, and the
// transform's own tests cover the BLAS path it then takes.
TEST(ThinProduct, BothSidesMatchALongDoubleReference) {
  const int64_t m = 37, n = 29;
  std::mt19937 gen(4);
  std::normal_distribution<float> normal;
  std::vector<float> g(size_t(m * n)), u(size_t(m * 8)), v(size_t(n * 8)), w0(size_t(n * 8));
  for (std::vector<float>* a : {&g, &u, &v, &w0})
    for (float& e : *a) e = normal(gen);
  std::vector<float> x(size_t(m * 8), NAN), wt = w0;
  if (!geometry::ThinBothSides(g.data(), m, n, u.data(), v.data(), 8, x.data(), wt.data(), true)) {
    EXPECT_FALSE(CpuHasAvx2Fma());
    GTEST_SKIP() << "no AVX2 and FMA: the transform takes its BLAS path";
  }
  EXPECT_FALSE(geometry::ThinBothSides(g.data(), m, n, u.data(), v.data(), 4, x.data(), wt.data(),
                                       true));  // width 8 only
  // A float dot product of length L with one extra addend: |error| <= gamma_{L+1} sum |terms|.
  const double unit = 0x1.0p-24;
  auto gamma = [&](int64_t len) { return (len + 1) * unit / (1 - (len + 1) * unit); };
  for (int64_t r = 0; r < m; ++r)
    for (int c = 0; c < 8; ++c) {
      long double ref = 0, mag = 0;
      for (int64_t j = 0; j < n; ++j) {
        ref += (long double)g[r * n + j] * v[j * 8 + c];
        mag += std::abs((long double)g[r * n + j] * v[j * 8 + c]);
      }
      EXPECT_NEAR(x[r * 8 + c], double(ref), gamma(n) * double(mag)) << r << "," << c;
    }
  for (int64_t j = 0; j < n; ++j)
    for (int c = 0; c < 8; ++c) {
      long double ref = w0[j * 8 + c], mag = std::abs(w0[j * 8 + c]);
      for (int64_t r = 0; r < m; ++r) {
        ref += (long double)g[r * n + j] * u[r * 8 + c];
        mag += std::abs((long double)g[r * n + j] * u[r * 8 + c]);
      }
      EXPECT_NEAR(wt[j * 8 + c], double(ref), gamma(m) * double(mag)) << j << "," << c;
    }
  // Overwrite instead of accumulate, one side at a time: the same bits as both at once.
  std::vector<float> x2(x.size(), NAN), wt2(wt.size(), NAN), wt3(wt.size(), NAN);
  ASSERT_TRUE(
      geometry::ThinBothSides(g.data(), m, n, u.data(), v.data(), 8, x2.data(), wt2.data(), false));
  ASSERT_TRUE(
      geometry::ThinBothSides(g.data(), m, n, u.data(), nullptr, 8, nullptr, wt3.data(), false));
  EXPECT_EQ(x2, x);
  EXPECT_EQ(wt3, wt2);
  for (int64_t j = 0; j < n; ++j)
    for (int c = 0; c < 8; ++c) {
      double ref = 0, mag = 0;
      for (int64_t r = 0; r < m; ++r) {
        ref += double(g[r * n + j]) * u[r * 8 + c];
        mag += std::abs(double(g[r * n + j]) * u[r * 8 + c]);
      }
      EXPECT_NEAR(wt2[j * 8 + c], ref, gamma(m) * mag) << j << "," << c;
    }
  std::vector<float> x3(x.size(), NAN);
  ASSERT_TRUE(
      geometry::ThinBothSides(g.data(), m, n, nullptr, v.data(), 8, x3.data(), nullptr, false));
  EXPECT_EQ(x3, x);
}

// The drift's and the inverse core's k x k Grams in double: C = A^T B and R^T R for R = B - A C.
// Every product of two floats is exact in double and each entry is one sum over the rows in
// order, so the result is the same bits as the plain double loops below, whichever path ran (the
// AVX2 kernel at k = 8 multiplies and adds separately, in the same order). And for B = A
// orthonormal the residual is round-off: its Gram is below rows k (2 eps_float)^2.
TEST(ThinProduct, CrossAndResidualGramsAreThePlainDoubleSums) {
  for (const int k : {3, 8}) {
    for (const int64_t rows : {int64_t{1}, int64_t{37}, int64_t{300}}) {
      std::vector<float> a = Gaussian(size_t(rows * k), 11), b = Gaussian(size_t(rows * k), 12);
      std::vector<double> c(size_t(k * k), NAN), gram(size_t(k * k), NAN);
      geometry::CrossGram(a.data(), b.data(), rows, k, c.data());
      geometry::ResidualGram(a.data(), b.data(), c.data(), rows, k, gram.data());
      std::vector<double> c_ref(size_t(k * k), 0.0), g_ref(size_t(k * k), 0.0);
      std::vector<double> res(static_cast<size_t>(k));
      for (int64_t r = 0; r < rows; ++r)
        for (int i = 0; i < k; ++i)
          for (int j = 0; j < k; ++j)
            c_ref[i * k + j] += double(a[r * k + i]) * double(b[r * k + j]);
      for (int64_t r = 0; r < rows; ++r) {
        for (int j = 0; j < k; ++j) res[j] = b[r * k + j];
        for (int i = 0; i < k; ++i)
          for (int j = 0; j < k; ++j) res[j] -= double(a[r * k + i]) * c_ref[i * k + j];
        for (int i = 0; i < k; ++i)
          for (int j = 0; j < k; ++j) g_ref[i * k + j] += res[i] * res[j];
      }
      EXPECT_EQ(c, c_ref) << "k " << k << ", rows " << rows;
      EXPECT_EQ(gram, g_ref) << "k " << k << ", rows " << rows;
    }
    const int64_t rows = 200;
    const std::vector<float> q = Basis(rows, k, 13);
    std::vector<double> c(size_t(k * k)), gram(size_t(k * k));
    geometry::CrossGram(q.data(), q.data(), rows, k, c.data());
    geometry::ResidualGram(q.data(), q.data(), c.data(), rows, k, gram.data());
    for (int i = 0; i < k; ++i) {
      EXPECT_NEAR(c[i * k + i], 1.0, 4 * rows * 0x1.0p-24) << i;  // float-rounded orthonormal
      EXPECT_LE(gram[i * k + i], double(rows * k) * 0x1.0p-46) << i;
    }
  }
}

TEST(FactorSketchBlocks, SymmetricEigenMatchesAKnownSpectrumAndReconstructs) {
  const int c = 9;
  // S = W diag(lambda) W^T with a known orthonormal W and distinct lambdas.
  const std::vector<float> w = Basis(c, c, 5);
  const std::vector<double> lambda = {9, 7.5, 6, 4, 3, 2, 1, 0.5, 0};
  std::vector<double> s(size_t(c * c), 0.0);
  for (int i = 0; i < c; ++i)
    for (int j = 0; j < c; ++j)
      for (int p = 0; p < c; ++p) s[j * c + i] += double(w[i * c + p]) * lambda[p] * w[j * c + p];
  std::vector<double> values, vectors;
  geometry::lapack::SymmetricEigen(s, c, values, vectors);
  // Eigenvalues of a symmetric matrix are perturbed by at most ||dS||_2: here the float basis
  // (non-orthonormal by ~1e-7) and double round-off, bounded by 1e-5 * lambda_max.
  for (int i = 0; i < c; ++i) EXPECT_NEAR(values[i], lambda[i], 1e-5 * 9) << i;
  for (int i = 0; i < c; ++i)
    for (int j = 0; j < c; ++j) {
      double r = 0;
      for (int p = 0; p < c; ++p) r += vectors[p * c + i] * values[p] * vectors[p * c + j];
      EXPECT_NEAR(r, s[j * c + i], 1e-12 * 9 * c) << i << "," << j;
    }
}

TEST(FactorSketch, OneUpdateWithBetaZeroIsTheTopSubspaceOfGGt) {
  const int64_t m = 96, n = 64;
  const int k = 4;
  const std::vector<float> U = Basis(m, k, 10), V = Basis(n, k, 11);
  const std::vector<float> G = LowRankPlusNoise(U, V, {100, 50, 25, 12}, m, n, 0.0, 12);
  FactorSketch s;
  FactorSketchOptions o;
  o.width = 6;
  o.beta = 0.9f;  // the first update takes the gradient whole whatever beta is
  UpdateFactorSketch(s, G, m, n, k, o);
  ASSERT_EQ(s.updates, 1u);
  ASSERT_EQ(s.width, 6);
  // G is exactly rank 4: the range finder sees all of it, so the sketch's top 4 eigenpairs are
  // G's singular pairs squared, up to float products over n = 64 terms.
  std::vector<float> left_k(size_t(m * k)), right_k(size_t(n * k));
  for (int64_t r = 0; r < m; ++r)
    for (int j = 0; j < k; ++j) left_k[r * k + j] = s.left[r * 6 + j];
  for (int64_t r = 0; r < n; ++r)
    for (int j = 0; j < k; ++j) right_k[r * k + j] = s.right[r * 6 + j];
  EXPECT_LT(Distance(left_k, U, m, k), 1e-4);
  EXPECT_LT(Distance(right_k, V, n, k), 1e-4);
  const double expect[] = {1e4, 2500, 625, 144};
  for (int i = 0; i < k; ++i) {
    EXPECT_NEAR(s.left_energy[i], expect[i], 1e-4 * 1e4) << i;
    EXPECT_NEAR(s.right_energy[i], expect[i], 1e-4 * 1e4) << i;
  }
  EXPECT_NEAR(s.energy, 1e4 + 2500 + 625 + 144, 1e-5 * 1.3e4);
}

// The right basis comes from the Gram of [V sqrt(beta R), sqrt(1-beta) B^T] when its top `width`
// eigenvalues stay above 1e-6 of the first, else by orthonormalizing [V, B^T]: both must hand
// back orthonormal columns and the same subspace. Rank 3 under width 6 takes the second path
// (three zero eigenvalues); the same part plus noise the first.
TEST(FactorSketch, RightBasisIsOrthonormalOnTheGramAndTheBasisPath) {
  const int64_t m = 80, n = 72;
  const int k = 3;
  const std::vector<float> U = Basis(m, k, 20), V = Basis(n, k, 21);
  for (const double noise : {0.0, 0.05}) {
    FactorSketch s;
    FactorSketchOptions o;
    o.width = 6;
    for (int step = 0; step < 4; ++step) {
      const std::vector<float> G = LowRankPlusNoise(U, V, {40, 20, 10}, m, n, noise, 30 + step);
      UpdateFactorSketch(s, G, m, n, k, o);
    }
    ASSERT_EQ(s.width, 6);
    // Columns computed in double and rounded to float once: each entry is off by at most
    // 2^-24 of itself, so V^T V is off the identity by at most about 2 n 2^-24 entrywise.
    const double bound = 2.0 * double(n) * std::ldexp(1.0, -24);
    for (int a = 0; a < 6; ++a)
      for (int b = 0; b < 6; ++b) {
        double dot = 0.0;
        for (int64_t r = 0; r < n; ++r) dot += double(s.right[r * 6 + a]) * s.right[r * 6 + b];
        EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, bound) << "noise " << noise << " " << a << "," << b;
      }
    std::vector<float> right_k(size_t(n * k));
    for (int64_t r = 0; r < n; ++r)
      for (int j = 0; j < k; ++j) right_k[r * k + j] = s.right[r * 6 + j];
    // The persistent part dominates the noise (singular values 40-10 against noise 0.05 sqrt(m)
    // = 0.45), so the top 3 directions are V's up to a sin-theta of noise / gap, about 0.05.
    EXPECT_LT(Distance(right_k, V, n, k), noise == 0.0 ? 1e-4 : 0.1) << "noise " << noise;
    for (int i = 0; i + 1 < 6; ++i) EXPECT_GE(s.right_energy[i], s.right_energy[i + 1]);
  }
}

// probe_every: the first update and every probe_every-th one take the probes, the others none,
// bit for bit as if the probes had been switched off for those updates.
TEST(FactorSketch, ProbesJoinEveryProbeEveryThUpdate) {
  const int64_t m = 48, n = 40;
  const std::vector<float> U = Basis(m, 3, 50), V = Basis(n, 3, 51);
  FactorSketch a, b;
  FactorSketchOptions every3;
  every3.width = 4;
  every3.probes = 3;
  every3.probe_every = 3;
  FactorSketchOptions always = every3, never = every3;
  always.probe_every = 1;
  never.probes = 0;
  for (int u = 0; u < 7; ++u) {
    const std::vector<float> G = LowRankPlusNoise(U, V, {9, 4, 2}, m, n, 0.3, 60 + u);
    UpdateFactorSketch(a, G, m, n, 3, every3);
    UpdateFactorSketch(b, G, m, n, 3, u % 3 == 0 ? always : never);
    ASSERT_EQ(a.left, b.left) << "update " << u;
    ASSERT_EQ(a.right, b.right) << "update " << u;
    ASSERT_EQ(a.left_energy, b.left_energy) << "update " << u;
  }
  // And the probes do change the update they join (the comparison above is not vacuous).
  FactorSketch c = a, d = a;
  const std::vector<float> G = LowRankPlusNoise(U, V, {9, 4, 2}, m, n, 0.3, 99);
  UpdateFactorSketch(c, G, m, n, 3, always);
  UpdateFactorSketch(d, G, m, n, 3, never);
  EXPECT_NE(c.left, d.left);
  FactorSketchOptions bad = every3;
  bad.probe_every = 0;
  EXPECT_THROW(UpdateFactorSketch(c, G, m, n, 3, bad), Error);
}

// The round trip the exchange makes: T(G) on the way out, T^-1 on the way back, with the products
// of the inverse taken as it runs. Returns the inverse's result; `amp` gets 1 / (min f_L min f_R),
// the factor by which T^-1 can enlarge a round-off of its input.
std::vector<float> RoundTrip(const Geometry& g, const std::vector<float>& G, InverseProducts* p,
                             double* amp) {
  std::vector<float> x = G;
  ApplyGeometry(g, x);
  InvertGeometry(g, x, p);
  const std::vector<float> fl = geometry::WhitenFactors(g, true),
                           fr = geometry::WhitenFactors(g, false);
  *amp = 1.0 / (*std::min_element(fl.begin(), fl.end()) * *std::min_element(fr.begin(), fr.end()));
  return x;
}

// What the inverse transform learns on the way is G V, U^T G and ||G||^2 of its own result, for
// its own basis: against the same projections of the result array computed in double.
TEST(InverseProducts, AreTheProjectionsAndNormOfTheResult) {
  const int64_t m = 70, n = 52;
  const int k = 4;
  const std::vector<float> U = Basis(m, k, 70), V = Basis(n, k, 71);
  FactorSketch s;
  FactorSketchOptions so;
  so.width = k;
  for (int u = 0; u < 3; ++u)
    UpdateFactorSketch(s, LowRankPlusNoise(U, V, {40, 20, 10, 5}, m, n, 0.2, 80 + u), m, n, k, so);
  SketchGeometryOptions go;
  go.rank = k;
  const Geometry g = GeometryFromSketch(s, go, 3);
  const std::vector<float> G = LowRankPlusNoise(U, V, {40, 20, 10, 5}, m, n, 0.2, 90);
  InverseProducts p;
  double amp = 0;
  const std::vector<float> out = RoundTrip(g, G, &p, &amp);
  ASSERT_TRUE(p.valid);
  ASSERT_GT(amp, 2.0);  // the whitening is real, so the inverse's update is not trivial
  EXPECT_EQ(p.data, out.data());
  EXPECT_EQ(p.k, k);
  EXPECT_EQ(p.U, g.U);
  EXPECT_EQ(p.V, g.V);
  double norm2 = 0, gv_err = 0, ug_err = 0;
  for (int64_t i = 0; i < m * n; ++i) norm2 += double(out[i]) * out[i];
  for (int64_t r = 0; r < m; ++r)
    for (int j = 0; j < k; ++j) {
      double e = 0;
      for (int64_t c = 0; c < n; ++c) e += double(out[r * n + c]) * g.V[c * k + j];
      gv_err = std::max(gv_err, std::abs(e - p.gv[r * k + j]));
    }
  for (int j = 0; j < k; ++j)
    for (int64_t c = 0; c < n; ++c) {
      double e = 0;
      for (int64_t r = 0; r < m; ++r) e += double(g.U[r * k + j]) * out[r * n + c];
      ug_err = std::max(ug_err, std::abs(e - p.ug[j * n + c]));
    }
  // The same float array summed in double in another order: double round-off only.
  EXPECT_NEAR(p.norm2, norm2, 1e-12 * norm2);
  // Each projection is a sum of n (or m) products with T^-1's input D, of norm <= ||G||, plus
  // the rank-2k correction, of norm <= amp ||G||; float round-off per term is eps, so both
  // routes are within (n + m + 2k) eps amp ||G||_F of the exact projection (Higham's gamma_n).
  const double tol = double(n + m + 2 * k) * 6e-8 * amp * std::sqrt(norm2);
  EXPECT_LT(gv_err, tol);
  EXPECT_LT(ug_err, tol);
  // Identity geometries and the forward map leave nothing behind.
  InverseProducts none;
  none.valid = true;
  std::vector<float> x = G;
  InvertGeometry(Geometry{}, x, &none);
  EXPECT_FALSE(none.valid);
}

// The sketch update that takes G V, U^T G and ||G||^2 from the inverse reads G for the probes and
// the new directions only, and lands where the update that reads everything lands, to float
// round-off over the eigengaps, on updates with and without probes.
TEST(FactorSketch, KnownProjectionsGiveTheSameUpdateWithFewerReads) {
  const int64_t m = 70, n = 52;
  const int k = 4;
  const std::vector<float> U = Basis(m, k, 72), V = Basis(n, k, 73);
  const std::vector<double> spectrum = {40, 20, 10, 5};
  FactorSketchOptions so;
  so.width = k;
  so.probes = 3;
  so.probe_every = 2;
  SketchGeometryOptions go;
  go.rank = k;
  FactorSketch s;
  UpdateFactorSketch(s, LowRankPlusNoise(U, V, spectrum, m, n, 0.2, 100), m, n, k, so);
  for (int u = 1; u < 6; ++u) {  // updates 1, 3, 5 without probes, 2 and 4 with
    const Geometry g = GeometryFromSketch(s, go, uint64_t(u));
    InverseProducts p;
    double amp = 0;
    const std::vector<float> G =
        RoundTrip(g, LowRankPlusNoise(U, V, spectrum, m, n, 0.2, 100 + u), &p, &amp);
    FactorSketch read = s;
    EXPECT_FALSE(UpdateFactorSketch(read, G, m, n, k, so));
    ASSERT_TRUE(UpdateFactorSketch(s, G, m, n, k, so, &p)) << "update " << u;
    // The inputs agree to (n + m + 2k) eps amp ||G|| (InverseProducts test); Davis-Kahan turns
    // that into a subspace angle over the relative eigengap, >= 1/3 for this spectrum (5 over
    // the noise bulk's 0.2 sqrt(max(m, n)) = 1.4 is the smallest gap), and the energies move by
    // the same relative amount.
    const double tol = 3.0 * double(n + m + 2 * k) * 6e-8 * amp;
    EXPECT_LT(Distance(s.left, read.left, m, k), tol) << "update " << u;
    EXPECT_LT(Distance(s.right, read.right, n, k), tol) << "update " << u;
    for (int i = 0; i < k; ++i) {
      EXPECT_NEAR(s.left_energy[i], read.left_energy[i], tol * read.left_energy[0])
          << u << " " << i;
      EXPECT_NEAR(s.right_energy[i], read.right_energy[i], tol * read.right_energy[0])
          << u << " " << i;
    }
    EXPECT_NEAR(s.energy, read.energy, 1e-12 * read.energy);
    EXPECT_NEAR(s.fit, read.fit, tol) << "update " << u;
    EXPECT_EQ(s.updates, read.updates);
  }
}

// Products that do not describe this G on this sketch's basis are never taken: another basis
// (the geometry of an older update), another tensor, or a narrower k than the sketch holds. The
// update is then the one that reads G, bit for bit.
TEST(FactorSketch, KnownProjectionsOfAnotherBasisOrTensorAreNotUsed) {
  const int64_t m = 40, n = 30;
  const int k = 3;
  const std::vector<float> U = Basis(m, k, 74), V = Basis(n, k, 75);
  FactorSketchOptions so;
  so.width = k;
  SketchGeometryOptions go;
  go.rank = k;
  FactorSketch s;
  UpdateFactorSketch(s, LowRankPlusNoise(U, V, {9, 4, 2}, m, n, 0.3, 110), m, n, k, so);
  const Geometry old = GeometryFromSketch(s, go, 1);
  UpdateFactorSketch(s, LowRankPlusNoise(U, V, {9, 4, 2}, m, n, 0.3, 111), m, n, k, so);
  const Geometry now = GeometryFromSketch(s, go, 2);
  go.rank = k - 1;
  const Geometry narrow = GeometryFromSketch(s, go, 2);
  const std::vector<float> G0 = LowRankPlusNoise(U, V, {9, 4, 2}, m, n, 0.3, 112);
  double amp = 0;
  for (const Geometry* g : {&old, &narrow, &now}) {
    InverseProducts p;
    const std::vector<float> G = RoundTrip(*g, G0, &p, &amp);
    ASSERT_TRUE(p.valid);
    FactorSketch a = s, b = s;
    const std::vector<float> copy = G;  // the same numbers at another address
    const bool used = UpdateFactorSketch(a, g == &now ? copy : G, m, n, k, so, &p);
    EXPECT_FALSE(used);
    UpdateFactorSketch(b, G, m, n, k, so);
    EXPECT_EQ(a.left, b.left);
    EXPECT_EQ(a.right, b.right);
    EXPECT_EQ(a.left_energy, b.left_energy);
  }
  // The control: the current basis on the tensor itself is taken.
  InverseProducts p;
  const std::vector<float> G = RoundTrip(now, G0, &p, &amp);
  FactorSketch c = s;
  EXPECT_TRUE(UpdateFactorSketch(c, G, m, n, k, so, &p));
  // A non-finite result is still found and named, through the known norm.
  std::vector<float> bad = G0;
  bad[17] = std::nanf("");
  InverseProducts q;
  const std::vector<float> B = RoundTrip(now, bad, &q, &amp);
  ASSERT_TRUE(q.valid);
  EXPECT_FALSE(std::isfinite(q.norm2));
  FactorSketch d = s;
  try {
    UpdateFactorSketch(d, B, m, n, k, so, &q);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("non-finite"), std::string::npos) << e.what();
  }
  EXPECT_EQ(d.left, s.left);  // unchanged
}

TEST(FactorSketch, TracksTheDenseEmaFactorsOverATrajectory) {
  // A persistent rank-4 part with slowly rotating weights under strong per-step noise: the
  // sketch's top-4 subspaces must match those of the exactly accumulated dense EMA factors.
  const int64_t m = 80, n = 120;
  const int k = 4;
  const std::vector<float> U = Basis(m, k, 20), V = Basis(n, k, 21);
  FactorSketch s;
  FactorSketchOptions o;
  o.width = 12;
  o.beta = 0.8f;
  std::vector<double> L(size_t(m * m), 0.0), R(size_t(n * n), 0.0);
  bool first = true;
  for (int step = 0; step < 30; ++step) {
    const std::vector<float> G =
        LowRankPlusNoise(U, V, {40, 32, 26.0 + step % 3, 22}, m, n, 1.0, 100 + step);
    UpdateFactorSketch(s, G, m, n, k, o);
    const double beta = first ? 0.0 : 0.8;
    first = false;
    for (auto& x : L) x *= beta;
    for (auto& x : R) x *= beta;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j) {
        double d = 0;
        for (int64_t h = 0; h < n; ++h) d += double(G[i * n + h]) * G[j * n + h];
        L[j * m + i] += (1 - beta) * d;
      }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double d = 0;
        for (int64_t h = 0; h < m; ++h) d += double(G[h * n + i]) * G[h * n + j];
        R[j * n + i] += (1 - beta) * d;
      }
  }
  std::vector<float> lu, ru;
  std::vector<double> lv, rv;
  DenseTop(L, m, k, lu, lv);
  DenseTop(R, n, k, ru, rv);
  std::vector<float> left_k(size_t(m * k)), right_k(size_t(n * k));
  for (int64_t r = 0; r < m; ++r)
    for (int j = 0; j < k; ++j) left_k[r * k + j] = s.left[r * s.width + j];
  for (int64_t r = 0; r < n; ++r)
    for (int j = 0; j < k; ++j) right_k[r * k + j] = s.right[r * s.width + j];
  // The persistent part's energies (>= 484 per step) stand well above the noise bulk (~ n or m
  // per direction), so both subspaces are well separated and the sketch must find them closely.
  EXPECT_LT(Distance(left_k, lu, m, k), 0.1);
  EXPECT_LT(Distance(right_k, ru, n, k), 0.1);
  for (int i = 0; i < k; ++i) {
    EXPECT_NEAR(s.left_energy[i], lv[i], 0.1 * lv[i]) << i;
    EXPECT_NEAR(s.right_energy[i], rv[i], 0.1 * rv[i]) << i;
  }
  // The gradients follow the persistent part, so the basis fits them about as predicted.
  EXPECT_EQ(s.fit_k, k);
  EXPECT_GT(s.fit, 0.7);
  EXPECT_LT(s.fit, 1.3);
}

TEST(FactorSketch, FitFallsWhenTheGradientLeavesTheBasis) {
  const int64_t m = 64, n = 64;
  const int k = 4;
  const std::vector<float> U = Basis(m, k, 30), V = Basis(n, k, 31);
  const std::vector<float> U2 = Basis(m, k, 32), V2 = Basis(n, k, 33);
  FactorSketch s;
  FactorSketchOptions o;
  for (int step = 0; step < 10; ++step) {
    UpdateFactorSketch(s, LowRankPlusNoise(U, V, {40, 30, 20, 15}, m, n, 0.3, step), m, n, k, o);
  }
  EXPECT_GT(s.fit, 0.8);
  // A gradient whose energy sits in other directions: the old basis holds little of it.
  UpdateFactorSketch(s, LowRankPlusNoise(U2, V2, {40, 30, 20, 15}, m, n, 0.3, 99), m, n, k, o);
  EXPECT_LT(s.fit, 0.3);
  SketchGeometryOptions go;
  go.rank = k;
  go.adapt = 1.f;
  const Geometry weak = GeometryFromSketch(s, go, 7);
  go.adapt = 0.f;
  const Geometry full = GeometryFromSketch(s, go, 7);
  EXPECT_EQ(weak.alpha, 0.25f);  // the strength rides in the energies, alpha stays the policy's
  // Each direction's factor is (e / delta)^(-alpha t) with t = fit: the whitening weakens.
  const std::vector<float> fw = geometry::WhitenFactors(weak, true);
  const std::vector<float> ff = geometry::WhitenFactors(full, true);
  for (int i = 0; i < k; ++i) {
    const double e = s.left_energy[i], d = full.delta_L;
    ASSERT_GT(e, d);
    EXPECT_NEAR(ff[i], std::pow(e / d, -0.25), 1e-5) << i;
    EXPECT_NEAR(fw[i], std::pow(e / d, -0.25 * s.fit), 1e-5) << i;
    EXPECT_GT(fw[i], ff[i]) << i;
  }
}

TEST(FactorSketch, GeometryFromSketch) {
  FactorSketch empty;
  EXPECT_TRUE(GeometryFromSketch(empty, {}, 3).is_identity());
  const int64_t m = 48, n = 40;
  const std::vector<float> U = Basis(m, 3, 40), V = Basis(n, 3, 41);
  FactorSketch s;
  UpdateFactorSketch(s, LowRankPlusNoise(U, V, {30, 20, 10}, m, n, 0.1, 1), m, n, 3, {});
  SketchGeometryOptions go;
  go.rank = 3;
  const Geometry g = GeometryFromSketch(s, go, 5);
  ASSERT_FALSE(g.is_identity());
  EXPECT_EQ(g.version, 5u);
  EXPECT_EQ(g.k, 3);
  ASSERT_EQ(g.sigma.size(), 3u);
  ASSERT_EQ(g.sigma_right.size(), 3u);
  go.adapt = 0.f;  // energies unshaped
  const Geometry plain = GeometryFromSketch(s, go, 5);
  for (int i = 0; i < 3; ++i) {
    EXPECT_FLOAT_EQ(plain.sigma[i], float(std::sqrt(s.left_energy[i])));
    EXPECT_FLOAT_EQ(plain.sigma_right[i], float(std::sqrt(s.right_energy[i])));
  }
  double in_left = 0;
  for (int i = 0; i < 3; ++i) in_left += s.left_energy[i];
  EXPECT_FLOAT_EQ(g.delta_L, float((s.energy - in_left) / (m - 3)));
  // The geometry round-trips through the wire form with its per-side values, and transforms.
  const Geometry back = DeserializeGeometry(SerializeGeometry(g));
  EXPECT_EQ(back.sigma_right, g.sigma_right);
  EXPECT_EQ(GeometryDigest(back), GeometryDigest(g));
  Geometry other = g;
  other.sigma_right[2] *= 1.0001f;
  EXPECT_NE(GeometryDigest(other), GeometryDigest(g));
}

// The digest the exchange fingerprint compares: every single-bit change of any number in U, V,
// sigma or the header gives another digest (each word step is a bijection of the state, so one
// differing word cannot be absorbed), and it is a pure function of the geometry.
TEST(FactorSketch, GeometryDigestChangesWithEveryBitOfTheGeometry) {
  Geometry g;
  g.mode = GeometryMode::kLowRank;
  g.version = 7;
  g.m = 5;
  g.n = 3;
  g.k = 2;
  g.alpha = 0.25f;
  g.U = Gaussian(10, 40);
  g.V = Gaussian(6, 41);
  g.sigma = {3.f, 1.f};
  g.sigma_right = {2.f, 1.f};
  g.delta_L = 0.5f;
  g.delta_R = 0.25f;
  const uint64_t base = GeometryDigest(g);
  EXPECT_EQ(GeometryDigest(g), base);
  int changed = 0, tried = 0;
  auto flip_each_bit = [&](std::vector<float>& v) {
    for (float& x : v)
      for (int bit = 0; bit < 32; ++bit) {
        const float keep = x;
        uint32_t u;
        std::memcpy(&u, &x, 4);
        u ^= 1u << bit;
        std::memcpy(&x, &u, 4);
        ++tried;
        changed += GeometryDigest(g) != base;
        x = keep;
      }
  };
  flip_each_bit(g.U);
  flip_each_bit(g.V);
  flip_each_bit(g.sigma);
  flip_each_bit(g.sigma_right);
  EXPECT_EQ(changed, tried);
  Geometry other = g;
  other.version = 8;
  EXPECT_NE(GeometryDigest(other), base);
  other = g;
  other.alpha = 0.5f;
  EXPECT_NE(GeometryDigest(other), base);
}

TEST(FactorSketch, EachSideKeepsAndWhitensWithItsOwnEnergies) {
  // Two gradients that share their left direction but not their right one: E[G G^T] has one
  // strong eigenvalue (both gradients' energy), E[G^T G] two of half the size.
  const int64_t m = 40, n = 36;
  const std::vector<float> U = Basis(m, 1, 60), V = Basis(n, 2, 61);
  std::vector<float> v1(static_cast<size_t>(n)), v2(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) v1[r] = V[r * 2], v2[r] = V[r * 2 + 1];
  FactorSketch s;
  FactorSketchOptions o;
  o.beta = 0.5f;
  UpdateFactorSketch(s, LowRankPlusNoise(U, v1, {10}, m, n, 0.01, 62), m, n, 2, o);
  UpdateFactorSketch(s, LowRankPlusNoise(U, v2, {10}, m, n, 0.01, 63), m, n, 2, o);
  // beta 0.5 from the second update on: left 0.5 * 100 + 0.5 * 100, right 50 and 50; the noise
  // (0.01 per element, ~0.004 per direction) is far below the 5% allowed.
  EXPECT_NEAR(s.left_energy[0], 100.0, 5.0);
  EXPECT_LT(s.left_energy[1], 1.0);
  EXPECT_NEAR(s.right_energy[0], 50.0, 2.5);
  EXPECT_NEAR(s.right_energy[1], 50.0, 2.5);
  SketchGeometryOptions go;
  go.rank = 2;
  const Geometry g = GeometryFromSketch(s, go, 1);
  for (int i = 0; i < 2; ++i) {
    EXPECT_FLOAT_EQ(g.sigma[i], float(std::sqrt(s.left_energy[i])));
    EXPECT_FLOAT_EQ(g.sigma_right[i], float(std::sqrt(s.right_energy[i])));
  }
  // The right side is whitened by its own energies: (e_R / delta_R)^-alpha, not the left's.
  const std::vector<float> fr = geometry::WhitenFactors(g, /*left=*/false);
  const double e0 = double(g.sigma_right[0]) * g.sigma_right[0];
  EXPECT_NEAR(fr[0], std::pow(e0 / g.delta_R, -0.25), 1e-5);
  const double wrong = double(g.sigma[0]) * g.sigma[0];
  EXPECT_GT(std::fabs(fr[0] - std::pow(wrong / g.delta_R, -0.25)), 0.01);
}

TEST(FactorSketch, SameInputsGiveTheSameBitsAndTheWireFormRoundTrips) {
  const int64_t m = 70, n = 33;
  FactorSketch a, b;
  FactorSketchOptions o;
  o.seed = 9;
  for (int step = 0; step < 4; ++step) {
    const std::vector<float> G = Gaussian(size_t(m * n), 50 + step);
    UpdateFactorSketch(a, G, m, n, 8, o);
    UpdateFactorSketch(b, G, m, n, 8, o);
  }
  const std::vector<uint8_t> wa = SerializeFactorSketch(a);
  EXPECT_EQ(wa, SerializeFactorSketch(b));
  const FactorSketch c = DeserializeFactorSketch(wa);
  EXPECT_EQ(SerializeFactorSketch(c), wa);
  std::vector<uint8_t> bad = wa;
  bad[40] ^= 1;
  EXPECT_THROW(DeserializeFactorSketch(bad), Error);
  EXPECT_THROW(DeserializeFactorSketch(std::span<const uint8_t>(wa).first(20)), Error);
}

TEST(FactorSketch, RejectsBadInput) {
  FactorSketch s;
  std::vector<float> G(12, 1.f);
  EXPECT_THROW(UpdateFactorSketch(s, G, 3, 5, 2, {}), Error);
  G[5] = NAN;
  EXPECT_THROW(UpdateFactorSketch(s, G, 3, 4, 2, {}), Error);
  FactorSketchOptions o;
  o.beta = 1.f;
  G[5] = 0.f;
  EXPECT_THROW(UpdateFactorSketch(s, G, 3, 4, 2, o), Error);
}

}  // namespace
}  // namespace geofp8
