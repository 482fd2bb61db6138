// Tests of the geometry transform: apply/inverse round trip, exactness of the estimate on
// matrices of known rank, warm vs cold start, determinism, drift, diag mode and edge shapes.
#include "kernels/geometry/geometry.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "kernels/common/check.h"
#include "kernels/geometry/analysis.h"
#include "kernels/geometry/factors.h"
#include "tests/geometry/reference_geometry.h"
#include "tests/geometry/test_matrices.h"

namespace geofp8 {
namespace {

using testing::GeometricSpectrum;
using testing::KnownSvd;
using testing::MakeKnownSvd;
using testing::PowerSpectrum;

double RelDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Distance between span(U) (rows x k float) and the first k columns of a known basis (rows x r),
// through the library's SubspaceDrift with identical V sides.
double DistanceToKnown(const std::vector<float>& u, const std::vector<double>& known, int64_t rows,
                       int64_t r, int k) {
  Geometry a, b;
  a.mode = b.mode = GeometryMode::kLowRank;
  a.version = b.version = 1;
  a.m = b.m = rows;
  a.n = b.n = k;
  a.k = b.k = k;
  a.U = u;
  b.U.resize(static_cast<size_t>(rows * k));
  for (int64_t i = 0; i < rows; ++i)
    for (int j = 0; j < k; ++j) b.U[i * k + j] = static_cast<float>(known[i * r + j]);
  a.V.assign(static_cast<size_t>(k * k), 0.f);
  for (int j = 0; j < k; ++j) a.V[j * k + j] = 1.f;
  b.V = a.V;
  a.sigma = b.sigma = std::vector<float>(static_cast<size_t>(k), 1.f);
  return SubspaceDrift(a, b);
}

double MaxOrthonormalityError(const std::vector<float>& q, int64_t rows, int k) {
  double worst = 0;
  for (int i = 0; i < k; ++i)
    for (int j = 0; j < k; ++j) {
      double dot = 0;
      for (int64_t r = 0; r < rows; ++r) dot += double(q[r * k + i]) * q[r * k + j];
      worst = std::max(worst, std::abs(dot - (i == j ? 1.0 : 0.0)));
    }
  return worst;
}

// Inverse(Apply(G)) is exact up to float round-off times the condition number of P_L P_R: the
// forward map cancels most of G in the top directions and the inverse scales them back by 1/f.
// The basis comes from the library's QR, orthonormal to float precision, so ||P^-1|| is
// 1 / (min f_L min f_R); see testing::RoundTripBound for the accumulation-length factor.
double RoundTripBound(const Geometry& g) {
  const auto fl = geometry::WhitenFactors(g, true), fr = geometry::WhitenFactors(g, false);
  const double kappa = fl.empty() ? 1.0
                                  : 1.0 / (*std::min_element(fl.begin(), fl.end()) *
                                           *std::min_element(fr.begin(), fr.end()));
  return testing::RoundTripBound(kappa, std::max<int64_t>({g.m, g.n, 2 * int64_t(g.k)}));
}

GeometryOptions LowRank(int k, int q = 1, uint64_t seed = 7) {
  GeometryOptions o;
  o.mode = GeometryMode::kLowRank;
  o.rank = k;
  o.power_iters = q;
  o.seed = seed;
  return o;
}

TEST(GeometryModeTest, NamesRoundTrip) {
  for (auto m : {GeometryMode::kNone, GeometryMode::kDiag, GeometryMode::kLowRank}) {
    EXPECT_EQ(ParseGeometryMode(GeometryModeName(m)), m);
  }
  EXPECT_FALSE(ParseGeometryMode("Lowrank").has_value());
  EXPECT_EQ(AcceptedGeometryModes(), "none, diag, lowrank");
}

TEST(GeometryTest, LowRankRoundTripIsFloatRoundOff) {
  for (double p : {0.5, 1.0, 2.0}) {
    KnownSvd ks = MakeKnownSvd(96, 64, PowerSpectrum(64, p), 11);
    const Geometry g = EstimateGeometry(ks.G, 96, 64, LowRank(8, 2), nullptr).geometry;
    std::vector<float> x = ks.G;
    ApplyGeometry(g, x);
    EXPECT_GT(RelDiff(x, ks.G), 0.1) << "transform must change an anisotropic gradient, p=" << p;
    InvertGeometry(g, x);
    EXPECT_LT(RelDiff(x, ks.G), RoundTripBound(g)) << "p=" << p;
    if (p <= 1.0) {
      EXPECT_LT(RelDiff(x, ks.G), 5e-6) << "p=" << p;
    }
  }
}

TEST(GeometryTest, WhitensTopDirectionsToTheBulkLevel) {
  // With an exact basis, T maps sigma_i (i < k) to sigma_i f_L f_R = (delta_L delta_R)^(1/4) at
  // alpha = 1/4, and leaves the rest of the spectrum alone.
  const int64_t m = 80, n = 48;
  const int k = 6;
  KnownSvd ks = MakeKnownSvd(m, n, PowerSpectrum(n, 1.5), 3);
  const Geometry g = EstimateGeometry(ks.G, m, n, LowRank(k, 6), nullptr).geometry;
  std::vector<float> x = ks.G;
  ApplyGeometry(g, x);
  const SpectralReference ref = ComputeSpectralReference(x, m, n);
  const double bulk = std::pow(double(g.delta_L) * g.delta_R, 0.25);
  std::vector<double> expected(ks.s.begin() + k, ks.s.end());
  for (int i = 0; i < k; ++i) expected.push_back(bulk);
  std::sort(expected.rbegin(), expected.rend());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_NEAR(ref.sigma[i], expected[i], 1e-4 * ks.s[0]) << "singular value " << i;
  }
  // No direction is ever amplified: the norm can only shrink.
  EXPECT_LT(RelDiff(x, std::vector<float>(x.size(), 0.f)),
            RelDiff(ks.G, std::vector<float>(x.size(), 0.f)));
}

TEST(GeometryTest, ExactForKAtLeastRank) {
  const int64_t m = 70, n = 50;
  std::vector<double> s = {3.0, 1.0, 0.5, 0.1, 0.05};
  KnownSvd ks = MakeKnownSvd(m, n, s, 5);
  for (int k : {5, 8}) {
    const Geometry g = EstimateGeometry(ks.G, m, n, LowRank(k, 1), nullptr).geometry;
    ASSERT_EQ(g.k, k);
    for (size_t i = 0; i < s.size(); ++i) EXPECT_NEAR(g.sigma[i], s[i], 2e-6 * s[0]) << i;
    for (int i = 5; i < k; ++i) EXPECT_NEAR(g.sigma[i], 0.0, 2e-6 * s[0]) << i;
    if (k == 5) {
      EXPECT_LT(DistanceToKnown(g.U, ks.U, m, 5, 5), 1e-4);
    }
    // The estimated span contains the true one: U U^T u_i = u_i for every true direction.
    for (int p = 0; p < 5; ++p) {
      double resid = 0;
      std::vector<double> coef(k, 0.0);
      for (int64_t r = 0; r < m; ++r)
        for (int j = 0; j < k; ++j) coef[j] += g.U[r * k + j] * ks.U[r * 5 + p];
      for (int64_t r = 0; r < m; ++r) {
        double proj = 0;
        for (int j = 0; j < k; ++j) proj += g.U[r * k + j] * coef[j];
        resid += (proj - ks.U[r * 5 + p]) * (proj - ks.U[r * 5 + p]);
      }
      EXPECT_LT(std::sqrt(resid), 2e-5) << "direction " << p << " k=" << k;
    }
    EXPECT_LT(MaxOrthonormalityError(g.U, m, k), 1e-6);
    EXPECT_LT(MaxOrthonormalityError(g.V, n, k), 1e-6);
    // Nothing left outside the basis.
    EXPECT_LT(g.delta_L, 1e-7 * s[0] * s[0]);
    EXPECT_LT(g.delta_R, 1e-7 * s[0] * s[0]);
  }
}

// delta_L and delta_R are the energy outside the basis per remaining dimension (DESIGN.md
// section 2): (||G||_F^2 - sum sigma_i^2) / (m - k) and / (n - k). The spectrum has a wide gap
// after k, so the estimated subspace is exact to round-off and the residual is the known tail
// energy. Its error: G's float rounding (2u of the total energy) and each sigma's float GEMM
// accumulation over n terms (a few sqrt(n) u, doubled in sigma^2) of the captured energy, u =
// 2^-24.
TEST(GeometryTest, ResidualEnergyPerRemainingDimension) {
  const int64_t m = 64, n = 48;
  const int k = 3;
  std::vector<double> s = {4.0, 3.0, 2.0};
  for (int i = 0; i < 20; ++i) s.push_back(0.5);
  KnownSvd ks = MakeKnownSvd(m, n, s, 31);
  const Geometry g = EstimateGeometry(ks.G, m, n, LowRank(k, 8), nullptr).geometry;
  double total = 0, tail = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    total += s[i] * s[i];
    if (i >= size_t(k)) tail += s[i] * s[i];
  }
  const double u = std::ldexp(1.0, -24);
  const double tol = (2 * u + 8 * std::sqrt(double(n)) * u) * total;
  EXPECT_NEAR(g.delta_L, tail / (m - k), tol / (m - k));
  EXPECT_NEAR(g.delta_R, tail / (n - k), tol / (n - k));
}

TEST(GeometryTest, ClampsRankToMinDimension) {
  KnownSvd ks = MakeKnownSvd(20, 30, PowerSpectrum(20, 1.0), 9);
  const Geometry g = EstimateGeometry(ks.G, 20, 30, LowRank(100), nullptr).geometry;
  EXPECT_EQ(g.k, 20);
  EXPECT_EQ(g.U.size(), 20u * 20);
  EXPECT_EQ(g.V.size(), 30u * 20);
  std::vector<float> x = ks.G;
  ApplyGeometry(g, x);
  InvertGeometry(g, x);
  EXPECT_LT(RelDiff(x, ks.G), RoundTripBound(g));
}

// Smallest q (power iterations) whose estimate is within tol of the true top-k subspace.
int IterationsToConverge(const KnownSvd& ks, int k, double tol, const Geometry* previous) {
  for (int q = 1; q <= 30; ++q) {
    const Geometry g = EstimateGeometry(ks.G, ks.m, ks.n, LowRank(k, q), previous).geometry;
    if (DistanceToKnown(g.U, ks.U, ks.m, static_cast<int64_t>(ks.s.size()), k) < tol) return q;
  }
  return 31;
}

TEST(GeometryTest, WarmStartConvergesInFewerIterationsThanCold) {
  // A constant gap sigma_{i+1}/sigma_i = 0.8: cold subspace iteration needs many iterations.
  const int64_t m = 160, n = 120;
  const int k = 8;
  KnownSvd before = MakeKnownSvd(m, n, GeometricSpectrum(n, 0.8), 21);
  // The next gradient: the same spectrum on slightly rotated bases (a drifted gradient).
  KnownSvd after = before;
  std::mt19937_64 rng(5);
  std::normal_distribution<double> normal;
  std::vector<float> noise(before.G.size());
  const double scale = 1e-5;
  for (size_t i = 0; i < noise.size(); ++i) after.G[i] += static_cast<float>(scale * normal(rng));
  // Reference subspace of `after` from a brute-force SVD.
  const SpectralReference ref = ComputeSpectralReference(after.G, m, n);
  after.U.assign(ref.U.begin(), ref.U.end());
  after.s = ref.sigma;
  const Geometry prev = EstimateGeometry(before.G, m, n, LowRank(k, 40), nullptr).geometry;
  const double tol = 0.02;
  const int cold = IterationsToConverge(after, k, tol, nullptr);
  const int warm = IterationsToConverge(after, k, tol, &prev);
  EXPECT_EQ(warm, 1);
  EXPECT_GE(cold, 4) << "cold start must need several iterations on this spectrum";
  EXPECT_LT(warm, cold) << "warm " << warm << " cold " << cold;
}

TEST(GeometryTest, DeterministicForAFixedSeed) {
  KnownSvd ks = MakeKnownSvd(64, 40, PowerSpectrum(40, 0.8), 1);
  const Geometry a = EstimateGeometry(ks.G, 64, 40, LowRank(8, 1, 42), nullptr).geometry;
  const Geometry b = EstimateGeometry(ks.G, 64, 40, LowRank(8, 1, 42), nullptr).geometry;
  EXPECT_EQ(a.U, b.U);
  EXPECT_EQ(a.V, b.V);
  EXPECT_EQ(a.sigma, b.sigma);
  EXPECT_EQ(a.delta_L, b.delta_L);
  const Geometry c = EstimateGeometry(ks.G, 64, 40, LowRank(8, 1, 43), nullptr).geometry;
  EXPECT_NE(a.U, c.U) << "a different seed must give a different cold start";
  std::vector<float> x(16), y(16);
  geometry::SeededGaussian(42, x);
  geometry::SeededGaussian(42, y);
  EXPECT_EQ(x, y);
}

TEST(GeometryTest, VersionAndDriftAreReportedOnRefresh) {
  KnownSvd ks = MakeKnownSvd(64, 48, GeometricSpectrum(48, 0.5), 2);
  const RefreshResult first = EstimateGeometry(ks.G, 64, 48, LowRank(8, 8), nullptr);
  EXPECT_EQ(first.geometry.version, 1u);
  EXPECT_EQ(first.drift, 0.0);
  EXPECT_GE(first.seconds, 0.0);
  const RefreshResult same = EstimateGeometry(ks.G, 64, 48, LowRank(8, 8), &first.geometry);
  EXPECT_EQ(same.geometry.version, 2u);
  EXPECT_LT(same.drift, 1e-3);
  KnownSvd other = MakeKnownSvd(64, 48, GeometricSpectrum(48, 0.5), 99);
  const RefreshResult moved = EstimateGeometry(other.G, 64, 48, LowRank(8, 8), &same.geometry);
  EXPECT_EQ(moved.geometry.version, 3u);
  EXPECT_GT(moved.drift, 0.5);
  EXPECT_LE(moved.drift, 1.0);
  EXPECT_NEAR(SubspaceDrift(first.geometry, first.geometry), 0.0, 1e-6);
}

TEST(GeometryTest, DriftOfOrthogonalBasesIsOne) {
  Geometry a, b;
  a.mode = b.mode = GeometryMode::kLowRank;
  a.version = b.version = 1;
  a.m = b.m = 4;
  a.n = b.n = 4;
  a.k = b.k = 1;
  a.U = {1, 0, 0, 0};
  b.U = {0, 1, 0, 0};
  a.V = b.V = {0, 0, 1, 0};
  a.sigma = b.sigma = {1};
  EXPECT_NEAR(SubspaceDrift(a, b), 1.0, 1e-12);
  b.U = {std::sqrt(0.5f), std::sqrt(0.5f), 0, 0};
  EXPECT_NEAR(SubspaceDrift(a, b), std::sqrt(0.5), 1e-6);  // 45 degrees
  Geometry none;
  EXPECT_EQ(SubspaceDrift(none, none), 0.0);
  EXPECT_EQ(SubspaceDrift(none, a), 1.0);
}

TEST(GeometryTest, SigmaEmaSmoothsAcrossRefreshes) {
  KnownSvd ks = MakeKnownSvd(40, 30, GeometricSpectrum(30, 0.5), 4);
  const Geometry first = EstimateGeometry(ks.G, 40, 30, LowRank(4, 4), nullptr).geometry;
  std::vector<float> doubled = ks.G;
  for (float& x : doubled) x *= 2;
  GeometryOptions o = LowRank(4, 4);
  o.sigma_ema = 0.5f;
  const Geometry second = EstimateGeometry(doubled, 40, 30, o, &first).geometry;
  for (int i = 0; i < 4; ++i)
    EXPECT_NEAR(second.sigma[i], 1.5 * first.sigma[i], 1e-4 * first.sigma[0]);
}

TEST(GeometryTest, RankDeficientGradientGivesValidGeometry) {
  const int64_t m = 50, n = 40;
  KnownSvd ks = MakeKnownSvd(m, n, {2.0, 1.0, 0.5}, 8);
  const Geometry g = EstimateGeometry(ks.G, m, n, LowRank(16, 1), nullptr).geometry;
  ASSERT_EQ(g.k, 16);
  for (float x : g.U) ASSERT_TRUE(std::isfinite(x));
  for (float x : g.V) ASSERT_TRUE(std::isfinite(x));
  EXPECT_LT(MaxOrthonormalityError(g.U, m, 16), 1e-5);
  EXPECT_LT(MaxOrthonormalityError(g.V, n, 16), 1e-5);
  // Directions without energy are left alone.
  const std::vector<float> fl = geometry::WhitenFactors(g, true);
  for (int i = 3; i < 16; ++i) EXPECT_FLOAT_EQ(fl[i], 1.f) << i;
  for (int i = 0; i < 3; ++i) EXPECT_LT(fl[i], 1.f) << i;
  std::vector<float> x = ks.G;
  ApplyGeometry(g, x);
  for (float v : x) ASSERT_TRUE(std::isfinite(v));
  InvertGeometry(g, x);
  EXPECT_LT(RelDiff(x, ks.G), RoundTripBound(g));
}

TEST(GeometryTest, ZeroGradientGivesIdentity) {
  for (GeometryMode mode : {GeometryMode::kLowRank, GeometryMode::kDiag}) {
    std::vector<float> zeros(30 * 20, 0.f);
    GeometryOptions o = LowRank(8);
    o.mode = mode;
    const Geometry g = EstimateGeometry(zeros, 30, 20, o, nullptr).geometry;
    EXPECT_EQ(g.version, 1u);
    EXPECT_EQ(g.delta_L, 0.f);
    for (float s : g.sigma) EXPECT_EQ(s, 0.f);
    KnownSvd ks = MakeKnownSvd(30, 20, PowerSpectrum(20, 1.0), 6);
    std::vector<float> x = ks.G;
    ApplyGeometry(g, x);
    EXPECT_EQ(x, ks.G) << GeometryModeName(mode) << ": a zero gradient's geometry is the identity";
  }
}

TEST(GeometryTest, EdgeShapes) {
  const double kU = std::ldexp(1.0, -24);
  // 1 x N, N x 1, 1 x 1 and empty: valid, finite and invertible.
  struct Shape {
    int64_t m, n;
  };
  for (Shape s :
       {Shape{1, 37}, Shape{37, 1}, Shape{1, 1}, Shape{0, 5}, Shape{5, 0}, Shape{3, 200}}) {
    std::vector<float> g(static_cast<size_t>(s.m * s.n));
    for (size_t i = 0; i < g.size(); ++i) g[i] = std::sin(0.7f * i) + (i % 5 == 0 ? 4.f : 0.f);
    for (GeometryMode mode : {GeometryMode::kNone, GeometryMode::kDiag, GeometryMode::kLowRank}) {
      GeometryOptions o = LowRank(16);
      o.mode = mode;
      const Geometry geo = EstimateGeometry(g, s.m, s.n, o, nullptr).geometry;
      if (mode == GeometryMode::kLowRank) {
        EXPECT_EQ(geo.k, std::min<int64_t>({16, s.m, s.n}));
      }
      std::vector<float> x = g;
      ApplyGeometry(geo, x);
      for (float v : x) ASSERT_TRUE(std::isfinite(v));
      InvertGeometry(geo, x);
      // Diag multiplies and divides each element by the same float scale, 2 roundings of at most
      // u each; lowrank is bounded like every
      // other round trip, by its condition number (here up to 100: a rank-1 row has no bulk, so
      // the 1e8 energy floor sets f = 1e-2) and its accumulation length.
      const double bound = mode == GeometryMode::kLowRank ? RoundTripBound(geo)
                           : mode == GeometryMode::kDiag  ? 2 * kU + kU * kU
                                                          : 0.0;
      EXPECT_LE(RelDiff(x, g), bound) << s.m << "x" << s.n << " " << GeometryModeName(mode);
    }
  }
}

// The inverse is exact for the float basis the geometry holds, not for an ideal orthonormal one:
// a basis received over the wire or smoothed may be off by more than round-off, and SideCore's
// Woodbury correction (M = Q^T Q) is what keeps Invert(Apply(G)) = G then. Dropping it (core
// 1 - 1/f) leaves an error of about kappa ||Q^T Q - I||, here 0.05, against a bound of 1.6e-3.
TEST(GeometryTest, InverseIsExactForANonOrthonormalBasis) {
  const int64_t m = 64, n = 48;
  KnownSvd ks = MakeKnownSvd(m, n, PowerSpectrum(n, 2.0), 13);
  Geometry g = EstimateGeometry(ks.G, m, n, LowRank(6, 3), nullptr).geometry;
  std::mt19937_64 rng(17);
  std::normal_distribution<double> normal;
  for (float& x : g.U) x += static_cast<float>(3e-3 * normal(rng));
  for (float& x : g.V) x += static_cast<float>(3e-3 * normal(rng));
  ASSERT_GT(MaxOrthonormalityError(g.U, m, g.k), 1e-3)
      << "the basis must be off by more than round-off";

  const testing::ReferenceSide left = testing::MakeReferenceSide(g, true, m);
  const testing::ReferenceSide right = testing::MakeReferenceSide(g, false, n);
  const double kappa = testing::SpectralNorm(left.p_inv, m) * testing::SpectralNorm(right.p_inv, n);
  ASSERT_GT(kappa, 50) << "the test needs strongly whitened top directions";
  const double bound = testing::RoundTripBound(kappa, std::max<int64_t>({m, n, 2 * g.k}));

  // Round trip through the library.
  std::vector<float> x = ks.G;
  ApplyGeometry(g, x);
  const std::vector<float> y = x;
  InvertGeometry(g, x);
  EXPECT_LT(RelDiff(x, ks.G), bound);

  // InvertGeometry against the exact float64 inverse of the same map, on the same input.
  std::vector<double> yd(y.begin(), y.end());
  const std::vector<double> want = testing::Sandwich(left.p_inv, yd, right.p_inv, m, n);
  std::vector<float> want_f(want.begin(), want.end());
  EXPECT_LT(RelDiff(x, want_f), bound);

  // The control: the orthonormal-basis inverse I - Q (I - F^-1) Q^T is far off for this basis,
  // so the bound above does tell the exact inverse apart from it.
  std::vector<double> naive_l(static_cast<size_t>(m * m), 0.0),
      naive_r(static_cast<size_t>(n * n), 0.0);
  auto naive = [&](const std::vector<float>& q, int64_t dim, double delta,
                   std::vector<double>& out) {
    for (int64_t i = 0; i < dim; ++i) out[i * dim + i] = 1.0;
    const double top = double(g.sigma[0]) * g.sigma[0];
    for (int p = 0; p < g.k; ++p) {
      const double f =
          testing::ReferenceFactor(double(g.sigma[p]) * g.sigma[p], delta, top, g.alpha);
      for (int64_t i = 0; i < dim; ++i)
        for (int64_t j = 0; j < dim; ++j)
          out[i * dim + j] -= (1 - 1 / f) * q[i * g.k + p] * q[j * g.k + p];
    }
  };
  naive(g.U, m, g.delta_L, naive_l);
  naive(g.V, n, g.delta_R, naive_r);
  const std::vector<double> off = testing::Sandwich(naive_l, yd, naive_r, m, n);
  EXPECT_GT(RelDiff(std::vector<float>(off.begin(), off.end()), ks.G), 10 * bound);
}

TEST(GeometryTest, NonFiniteInputIsRejectedWithAClearError) {
  std::vector<float> g(6 * 4, 1.f);
  g[9] = std::numeric_limits<float>::quiet_NaN();
  try {
    EstimateGeometry(g, 6, 4, LowRank(2), nullptr);
    FAIL() << "NaN accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("non-finite value (nan) at index 9"));
  }
  g[9] = std::numeric_limits<float>::infinity();
  EXPECT_THROW(EstimateGeometry(g, 6, 4, LowRank(2), nullptr), Error);
}

TEST(GeometryTest, InvalidOptionsAndShapesAreRejected) {
  std::vector<float> g(6 * 4, 1.f);
  GeometryOptions o = LowRank(0);
  EXPECT_THAT([&] { EstimateGeometry(g, 6, 4, o, nullptr); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("GeometryOptions.rank")));
  o = LowRank(2);
  o.alpha = -1.f;
  EXPECT_THAT([&] { EstimateGeometry(g, 6, 4, o, nullptr); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("GeometryOptions.alpha")));
  o = LowRank(2);
  o.power_iters = 0;
  EXPECT_THAT([&] { EstimateGeometry(g, 6, 4, o, nullptr); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("GeometryOptions.power_iters")));
  EXPECT_THROW(EstimateGeometry(g, 5, 4, LowRank(2), nullptr), Error);
  const Geometry geo = EstimateGeometry(g, 6, 4, LowRank(2), nullptr).geometry;
  std::vector<float> wrong(10, 1.f);
  EXPECT_THROW(ApplyGeometry(geo, wrong), Error);
}

TEST(GeometryTest, NoneAndWarmupAreIdentity) {
  KnownSvd ks = MakeKnownSvd(16, 12, PowerSpectrum(12, 2.0), 3);
  GeometryOptions o;
  o.mode = GeometryMode::kNone;
  const Geometry none = EstimateGeometry(ks.G, 16, 12, o, nullptr).geometry;
  std::vector<float> x = ks.G;
  ApplyGeometry(none, x);
  EXPECT_EQ(x, ks.G);
  Geometry warmup = EstimateGeometry(ks.G, 16, 12, LowRank(4), nullptr).geometry;
  warmup.version = 0;
  ApplyGeometry(warmup, x);
  EXPECT_EQ(x, ks.G);
}

TEST(GeometryTest, DiagScalesDominantRowsAndColumnsDown) {
  const int64_t m = 40, n = 30;
  std::vector<float> g(m * n);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      g[i * n + j] = normal(rng) * (i == 3 ? 100.f : 1.f) * (j == 7 ? 10.f : 1.f);
  GeometryOptions o;
  o.mode = GeometryMode::kDiag;
  const Geometry geo = EstimateGeometry(g, m, n, o, nullptr).geometry;
  ASSERT_EQ(geo.row_scale.size(), size_t(m));
  ASSERT_EQ(geo.col_scale.size(), size_t(n));
  for (float s : geo.row_scale) EXPECT_LE(s, 1.f);
  for (float s : geo.col_scale) EXPECT_LE(s, 1.f);
  EXPECT_LT(geo.row_scale[3], 0.2f);  // (1e4)^-1/4 = 0.1 before the column effect
  EXPECT_LT(geo.col_scale[7], 0.6f);
  std::vector<float> x = g;
  ApplyGeometry(geo, x);
  EXPECT_NEAR(x[3 * n + 0], g[3 * n + 0] * geo.row_scale[3] * geo.col_scale[0], 1e-5f);
  InvertGeometry(geo, x);
  EXPECT_LT(RelDiff(x, g), 1e-6);
}

}  // namespace
}  // namespace geofp8
