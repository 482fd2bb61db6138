// Tests of the band-error analysis against a brute-force (one-sided Jacobi) SVD on small
// matrices, and of the residual-subspace error against explicit projection matrices.
#include "kernels/geometry/analysis.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kernels/common/check.h"
#include "tests/geometry/test_matrices.h"

namespace geofp8 {
namespace {

std::vector<float> Perturbed(const std::vector<float>& g, double scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<float> out = g;
  for (auto& x : out) x += static_cast<float>(scale * normal(rng) * (1.0 + std::abs(x)));
  return out;
}

// Band errors computed from scratch in double: U_b^T E V_b with the Jacobi SVD of G.
std::vector<double> BruteForceBandErrors(const std::vector<float>& g, const std::vector<float>& gh,
                                         int64_t m, int64_t n, const std::vector<int64_t>& edges) {
  std::vector<double> gd(g.begin(), g.end());
  const testing::JacobiSvd svd = testing::BruteForceSvd(gd, m, n);
  const int64_t r = std::min(m, n);
  std::vector<double> out;
  for (size_t b = 0; b + 1 < edges.size(); ++b) {
    double num = 0, den = 0;
    for (int64_t i = edges[b]; i < edges[b + 1]; ++i) {
      den += svd.s[i] * svd.s[i];
      for (int64_t j = edges[b]; j < edges[b + 1]; ++j) {
        double p = 0;
        for (int64_t x = 0; x < m; ++x)
          for (int64_t y = 0; y < n; ++y)
            p += svd.U[x * r + i] * (double(gh[x * n + y]) - g[x * n + y]) * svd.V[y * r + j];
        num += p * p;
      }
    }
    out.push_back(den > 0 ? std::sqrt(num / den) : -1.0);
  }
  return out;
}

TEST(BandEdgesTest, DesignBandsWhenRankIsLarge) {
  EXPECT_EQ(BandEdges(512, 16), (std::vector<int64_t>{0, 16, 64, 256, 512}));
  EXPECT_EQ(BandEdges(64, 16), (std::vector<int64_t>{0, 16, 32, 32, 64}));
  EXPECT_EQ(BandEdges(1, 16), (std::vector<int64_t>{0, 0, 0, 0, 1}));
  EXPECT_EQ(BandEdges(0, 4), (std::vector<int64_t>{0, 0, 0, 0, 0}));
}

TEST(BandErrorTest, MatchesBruteForceSvdOnSmallMatrices) {
  struct Case {
    int64_t m, n, k;
    double p;
  };
  for (Case c :
       {Case{24, 18, 2, 1.0}, Case{17, 29, 1, 1.5}, Case{32, 32, 3, 0.5}, Case{40, 12, 1, 2.0}}) {
    const int64_t r = std::min(c.m, c.n);
    auto ks = testing::MakeKnownSvd(c.m, c.n, testing::PowerSpectrum(r, c.p), c.m * 7 + c.n);
    const std::vector<float> gh = Perturbed(ks.G, 1e-3, 5);
    const SpectralReference ref = ComputeSpectralReference(ks.G, c.m, c.n);
    ASSERT_EQ(ref.r, r);
    const BandErrors got = ComputeBandErrors(ref, ks.G, gh, c.k);
    const std::vector<int64_t> edges = BandEdges(r, c.k);
    const std::vector<double> want = BruteForceBandErrors(ks.G, gh, c.m, c.n, edges);
    ASSERT_EQ(got.bands.size(), 4u);
    double worst = 0;
    for (int b = 0; b < 4; ++b) {
      EXPECT_EQ(got.bands[b].begin, edges[b]);
      EXPECT_EQ(got.bands[b].end, edges[b + 1]);
      EXPECT_EQ(got.bands[b].defined, want[b] >= 0) << b;
      if (want[b] >= 0) {
        EXPECT_NEAR(got.bands[b].error, want[b], 1e-3 * want[b] + 1e-7)
            << c.m << "x" << c.n << " band " << b;
        worst = std::max(worst, want[b]);
      }
    }
    EXPECT_NEAR(got.worst_band_error, worst, 1e-3 * worst);
    EXPECT_GT(worst, 0.0);
  }
}

TEST(BandErrorTest, ErrorInOneDirectionLandsInItsBand) {
  const int64_t m = 30, n = 20;
  auto ks = testing::MakeKnownSvd(m, n, testing::PowerSpectrum(n, 1.0), 12);
  // E = 0.01 * sigma_12 * u_12 v_12^T: band [4k, r/2) = [8, 10) for k = 2 excludes 12; the last
  // band [10, 20) holds it with relative error 0.01 sigma_12 / ||sigma_[10,20)||.
  const int64_t d = 12;
  std::vector<float> gh = ks.G;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      gh[i * n + j] += float(0.01 * ks.s[d] * ks.U[i * n + d] * ks.V[j * n + d]);
  const SpectralReference ref = ComputeSpectralReference(ks.G, m, n);
  const BandErrors be = ComputeBandErrors(ref, ks.G, gh, 2);
  double band_energy = 0;
  for (int64_t i = 10; i < 20; ++i) band_energy += ks.s[i] * ks.s[i];
  EXPECT_NEAR(be.bands[3].error, 0.01 * ks.s[d] / std::sqrt(band_energy), 2e-4);
  for (int b = 0; b < 3; ++b) EXPECT_LT(be.bands[b].error, 1e-4) << b;
}

TEST(BandErrorTest, BandsWithoutEnergyAreUndefinedNotNaN) {
  auto ks = testing::MakeKnownSvd(20, 16, {1.0, 0.5}, 4);  // rank 2
  const std::vector<float> gh = Perturbed(ks.G, 1e-3, 9);
  const BandErrors be = ComputeBandErrors(ComputeSpectralReference(ks.G, 20, 16), ks.G, gh, 2);
  EXPECT_TRUE(be.bands[0].defined);
  EXPECT_FALSE(be.bands[3].defined);
  EXPECT_TRUE(std::isfinite(be.worst_band_error));
  std::vector<float> zeros(20 * 16, 0.f);
  const BandErrors z = ComputeBandErrors(ComputeSpectralReference(zeros, 20, 16), zeros, gh, 2);
  for (const auto& b : z.bands) EXPECT_FALSE(b.defined);
  EXPECT_EQ(z.worst_band_error, 0.0);
}

TEST(ResidualSubspaceErrorTest, MatchesExplicitProjections) {
  const int64_t m = 14, n = 10;
  const int k = 3;
  auto ks = testing::MakeKnownSvd(m, n, testing::PowerSpectrum(n, 1.0), 2);
  const std::vector<float> gh = Perturbed(ks.G, 1e-2, 3);
  // A basis that is not the singular basis, to exercise the projection generally.
  const std::vector<double> ud = testing::RandomOrthonormal(m, k, 77),
                            vd = testing::RandomOrthonormal(n, k, 78);
  std::vector<float> u(ud.begin(), ud.end()), v(vd.begin(), vd.end());
  auto project = [&](const std::vector<double>& x) {
    // (I - U U^T) X (I - V V^T) with dense projectors in double.
    std::vector<double> pl(m * m), pr(n * n), t(m * n, 0.0), out(m * n, 0.0);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j) {
        double s = (i == j);
        for (int p = 0; p < k; ++p) s -= double(u[i * k + p]) * u[j * k + p];
        pl[i * m + j] = s;
      }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = (i == j);
        for (int p = 0; p < k; ++p) s -= double(v[i * k + p]) * v[j * k + p];
        pr[i * n + j] = s;
      }
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j)
        for (int64_t p = 0; p < m; ++p) t[i * n + j] += pl[i * m + p] * x[p * n + j];
    double ss = 0;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t p = 0; p < n; ++p) out[i * n + j] += t[i * n + p] * pr[p * n + j];
        ss += out[i * n + j] * out[i * n + j];
      }
    return std::sqrt(ss);
  };
  std::vector<double> e(m * n), gd(m * n);
  for (int64_t i = 0; i < m * n; ++i) {
    e[i] = double(gh[i]) - ks.G[i];
    gd[i] = ks.G[i];
  }
  const double want = project(e) / project(gd);
  const auto got = ResidualSubspaceError(ks.G, gh, m, n, u, v, k);
  ASSERT_TRUE(got.has_value());
  EXPECT_NEAR(*got, want, 1e-4 * want);
  // No projection: plain relative Frobenius error.
  const auto plain = ResidualSubspaceError(ks.G, gh, m, n, {}, {}, 0);
  EXPECT_NEAR(*plain, RelFroError(ks.G, gh), 1e-6);
  // All energy inside the basis: undefined, which the code defines as nullopt when the projected
  // denominator is exactly 0. Axis-aligned bases make the projection exact in float, so the
  // denominator is 0 and not round-off; an error inside the basis does not make it defined.
  std::vector<float> ua(m, 0.f), va(n, 0.f), inside(m * n, 0.f);
  ua[2] = 1.f;
  va[3] = 1.f;
  inside[2 * n + 3] = 5.f;
  EXPECT_EQ(ResidualSubspaceError(inside, inside, m, n, ua, va, 1), std::nullopt);
  std::vector<float> off = inside;
  off[2 * n + 3] = 4.f;
  EXPECT_EQ(ResidualSubspaceError(inside, off, m, n, ua, va, 1), std::nullopt);
  // One element outside the basis makes it defined again: relative error 1 against that element.
  inside[0] = 1.f;
  EXPECT_EQ(ResidualSubspaceError(inside, off, m, n, ua, va, 1), std::optional<double>(1.0));
}

TEST(AnalysisTest, NonFiniteReferenceIsRejected) {
  std::vector<float> g(12, 1.f);
  g[5] = NAN;
  EXPECT_THROW(ComputeSpectralReference(g, 3, 4), Error);
}

}  // namespace
}  // namespace geofp8
