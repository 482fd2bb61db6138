// bench/summed_error.h, the trajectory bench's summed-error metrics, on errors whose sums are known
// in closed form.
#include "bench/summed_error.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/common/check.h"

namespace geofp8::bench {
namespace {

// The error e (length 4) added to a fixed exact gradient g.
std::vector<float> Plus(const std::vector<float>& g, const std::vector<float>& e) {
  std::vector<float> out(g.size());
  for (size_t i = 0; i < g.size(); ++i) out[i] = g[i] + e[i];
  return out;
}

// Every input below is a small dyadic rational, so each float sum is exact and the sums' norms
// carry only the last division's and square root's rounding.
constexpr double kEps = 4 * std::numeric_limits<double>::epsilon();

TEST(SummedError, OrthogonalErrorsHaveCoherenceOneAndRepeatedOnesT) {
  const std::vector<float> g = {1, 2, 3, 4};
  SummedError orthogonal, repeated, cancelling;
  for (int t = 0; t < 4; ++t) {
    std::vector<float> e(4, 0.0f);
    e[t] = 0.25f;  // the four unit directions in turn
    orthogonal.Add(Plus(g, e), g);
    repeated.Add(Plus(g, {0.25f, -0.5f, 0, 0.125f}), g);
    cancelling.Add(Plus(g, {t % 2 ? -0.5f : 0.5f, 0, 0, 0}), g);
  }
  EXPECT_EQ(orthogonal.steps(), 4);
  EXPECT_NEAR(orthogonal.Coherence(), 1.0, kEps);
  EXPECT_NEAR(repeated.Coherence(), 4.0, 4 * kEps);
  EXPECT_EQ(cancelling.Coherence(), 0.0);
  // ||sum e|| / ||sum g||: sum g = 4 g with ||g||^2 = 30. Orthogonal: sum e = 0.25 (1,1,1,1).
  EXPECT_NEAR(orthogonal.RelFro(), std::sqrt(0.25) / std::sqrt(16.0 * 30.0), kEps);
  EXPECT_NEAR(repeated.RelFro(), std::sqrt(16 * (0.0625 + 0.25 + 0.015625)) / std::sqrt(480.0),
              kEps);
  EXPECT_EQ(cancelling.RelFro(), 0.0);
}

TEST(SummedError, AlongIsTheErrorsShareOfTheSummedGradient) {
  const std::vector<float> g = {1, -2, 0.5f, 4};
  SummedError shrink, orthogonal;
  for (int t = 0; t < 3; ++t) {
    std::vector<float> shrunk(g.size());
    for (size_t i = 0; i < g.size(); ++i) shrunk[i] = 0.75f * g[i];  // e = -g / 4
    shrink.Add(shrunk, g);
    orthogonal.Add(Plus(g, {2, 1, 0, 0}), g);  // <e, g> = 2 - 2 = 0
  }
  EXPECT_NEAR(shrink.Along(), -0.25, kEps);
  EXPECT_NEAR(shrink.RelFro(), 0.25, kEps);
  EXPECT_EQ(orthogonal.Along(), 0.0);
}

TEST(SummedError, EmptyIsNaNAndAShapeChangeIsAnError) {
  SummedError s;
  EXPECT_TRUE(std::isnan(s.RelFro()));
  EXPECT_TRUE(std::isnan(s.Coherence()));
  const std::vector<float> a = {1, 2}, b = {1, 2, 3};
  EXPECT_THROW(s.Add(a, b), Error);
  s.Add(a, a);
  EXPECT_TRUE(std::isnan(s.Coherence()));  // no error at all: 0 / 0
  EXPECT_EQ(s.RelFro(), 0.0);
  EXPECT_THROW(s.Add(b, b), Error);
}

}  // namespace
}  // namespace geofp8::bench
