// Tests of the seeded anisotropic suite: exact spectra for the spectral family, unit norm,
// determinism, and a drifted twin whose dominant subspace moved by a controlled amount.
#include "kernels/geometry/synthetic.h"

#include <gtest/gtest.h>

#include <cmath>

#include "kernels/common/check.h"
#include "kernels/geometry/analysis.h"
#include "kernels/geometry/geometry.h"

namespace geofp8 {
namespace {

TEST(SyntheticTest, SpectralFamilyHasTheRequestedPowerLaw) {
  const SyntheticSpec spec{SyntheticFamily::kSpectral, 48, 80, 1.5, 3, 0.0};
  const std::vector<float> g = MakeSyntheticGradient(spec);
  const SpectralReference ref = ComputeSpectralReference(g, 48, 80);
  double norm2 = 0;
  for (double s : ref.sigma) norm2 += s * s;
  EXPECT_NEAR(norm2, 1.0, 1e-5);
  for (int i = 1; i < 48; ++i) {
    EXPECT_NEAR(ref.sigma[i] / ref.sigma[0], std::pow(i + 1.0, -1.5), 1e-5) << i;
  }
}

TEST(SyntheticTest, EveryFamilyIsDeterministicFiniteAndNormalized) {
  for (SyntheticFamily f :
       {SyntheticFamily::kSpectral, SyntheticFamily::kKronecker, SyntheticFamily::kLowRankNoise}) {
    const SyntheticSpec spec{f, 40, 24, 1.0, 9, 0.0};
    const std::vector<float> a = MakeSyntheticGradient(spec), b = MakeSyntheticGradient(spec);
    EXPECT_EQ(a, b) << SyntheticFamilyName(f);
    double norm2 = 0;
    for (float x : a) {
      ASSERT_TRUE(std::isfinite(x));
      norm2 += double(x) * x;
    }
    EXPECT_NEAR(norm2, 1.0, 1e-4);
    EXPECT_EQ(ParseSyntheticFamily(SyntheticFamilyName(f)), f);
  }
  EXPECT_FALSE(ParseSyntheticFamily("gauss").has_value());
}

TEST(SyntheticTest, DriftedTwinRotatesTheDominantSubspace) {
  SyntheticSpec spec{SyntheticFamily::kSpectral, 128, 96, 2.0, 4, 0.0};
  const std::vector<float> g = MakeSyntheticGradient(spec);
  GeometryOptions o;
  o.rank = 4;
  o.power_iters = 6;
  const Geometry base = EstimateGeometry(g, 128, 96, o, nullptr).geometry;
  double last = 0;
  for (double drift : {0.05, 0.3, 1.0}) {
    spec.drift = drift;
    const Geometry twin =
        EstimateGeometry(MakeSyntheticGradient(spec), 128, 96, o, nullptr).geometry;
    const double d = SubspaceDrift(base, twin);
    EXPECT_GT(d, last) << "drift " << drift;
    last = d;
  }
  EXPECT_LT(last, 1.0 + 1e-9);
}

TEST(SyntheticTest, BadSpecsAreRejected) {
  EXPECT_THROW(MakeSyntheticGradient({SyntheticFamily::kSpectral, 0, 4, 1.0, 1, 0.0}), Error);
  EXPECT_THROW(MakeSyntheticGradient({SyntheticFamily::kSpectral, 4, 4, -1.0, 1, 0.0}), Error);
}

}  // namespace
}  // namespace geofp8
