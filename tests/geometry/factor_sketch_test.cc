// The streaming Kronecker-factor sketch: its eigensolver against a known spectrum, the sketch
// against the dense EMA factors it approximates, repeatability, the fit measure and the wire form.
#include "kernels/geometry/factor_sketch.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/common/check.h"
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
