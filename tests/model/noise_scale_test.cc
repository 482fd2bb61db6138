// The gradient noise scale estimator on a quadratic toy whose B_simple is known in closed form:
// exact expectations give it back to rounding, sampled gradients within the estimator's spread;
// undefined estimates stay NaN; the quantization-to-SGD noise ratio formulas.

#include "kernels/model/noise_scale.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/common/check.h"

namespace geofp8::model {
namespace {

constexpr double kU = 0x1p-53;  // double's unit roundoff

// The toy: loss(w; x) = |w - x|^2 / 2 with x ~ N(mu, sigma^2 I_d). A per-example gradient is
// w - x: mean g = w - mu, covariance Sigma = sigma^2 I, so B_simple = d sigma^2 / |g|^2, and a
// mean over B examples has E|G_B|^2 = |g|^2 + d sigma^2 / B exactly.
struct Toy {
  int d = 1024;
  double sigma = 1;
  double g_component = 0.125;  // every component of w - mu
  double grad_sq() const { return d * g_component * g_component; }
  double trace() const { return d * sigma * sigma; }
  double b_simple() const { return trace() / grad_sq(); }  // 64
};

TEST(NoiseScale, ExactExpectationsGiveTheClosedFormBack) {
  const Toy toy;
  for (const auto& [b_small, b_big] : {std::pair{8.0, 32.0}, {32.0, 256.0}, {1.0, 2.0}}) {
    NoiseScaleSample s;
    s.b_small = b_small;
    s.b_big = b_big;
    s.small_sq = toy.grad_sq() + toy.trace() / b_small;
    s.big_sq = toy.grad_sq() + toy.trace() / b_big;
    const NoiseScaleTerms t = NoiseScaleEstimate(s);
    // Each term is a difference of two products of O(1)-ulp inputs divided by a difference of
    // batch sizes (exact here, small integers); the error of a difference relative to its
    // result is at most 4u times the ratio of the operands' magnitude to the result.
    const double g_bound = 4 * kU * (b_big * s.big_sq + b_small * s.small_sq) / (b_big - b_small);
    const double t_bound = 4 * kU * (s.small_sq + s.big_sq) / (1 / b_small - 1 / b_big);
    EXPECT_NEAR(t.grad_sq, toy.grad_sq(), g_bound) << b_small << " " << b_big;
    EXPECT_NEAR(t.trace, toy.trace(), t_bound) << b_small << " " << b_big;
    GradientNoiseScale gns(0.9);
    for (int i = 0; i < 5; ++i) gns.Add(s);
    const double rel = g_bound / toy.grad_sq() + t_bound / toy.trace() + 8 * kU;
    EXPECT_NEAR(gns.value(), toy.b_simple(), rel * toy.b_simple());
  }
}

TEST(NoiseScale, SampledGradientsOfTheToyEstimateItsNoiseScale) {
  // ranks of b_small examples each: rank r's gradient is g + n_r with n_r ~ N(0, sigma^2/b_small
  // I) (the mean of b_small examples), the average over ranks is g + mean_r n_r.
  const Toy toy;
  const int ranks = 4, b_small = 8, steps = 2000;
  const double beta = 0.95;
  std::mt19937_64 rng(7);
  std::normal_distribution<double> normal(0.0, toy.sigma / std::sqrt(double(b_small)));
  GradientNoiseScale gns(beta);
  std::vector<double> gs, ts;
  std::vector<double> big(toy.d);
  for (int step = 0; step < steps; ++step) {
    NoiseScaleSample s;
    s.b_small = b_small;
    s.b_big = ranks * b_small;
    std::fill(big.begin(), big.end(), 0.0);
    for (int r = 0; r < ranks; ++r) {
      double sq = 0;
      for (int j = 0; j < toy.d; ++j) {
        const double gj = toy.g_component + normal(rng);
        sq += gj * gj;
        big[j] += gj / ranks;
      }
      s.small_sq += sq / ranks;
    }
    for (double v : big) s.big_sq += v * v;
    const NoiseScaleTerms t = NoiseScaleEstimate(s);
    gs.push_back(t.grad_sq);
    ts.push_back(t.trace);
    gns.Add(s);
  }
  // The per-step estimates are independent and unbiased: their means recover the terms to within
  // 5 standard errors, and the smoothed ratio lies within 5 standard deviations of an EMA of
  // independent draws, sd * sqrt((1 - beta) / (1 + beta)), relative errors of the two terms
  // added (the delta method's bound for a ratio, whatever their correlation).
  auto mean_sd = [](const std::vector<double>& v) {
    double m = 0, q = 0;
    for (double x : v) m += x;
    m /= double(v.size());
    for (double x : v) q += (x - m) * (x - m);
    return std::pair{m, std::sqrt(q / double(v.size() - 1))};
  };
  const auto [g_mean, g_sd] = mean_sd(gs);
  const auto [t_mean, t_sd] = mean_sd(ts);
  EXPECT_NEAR(g_mean, toy.grad_sq(), 5 * g_sd / std::sqrt(double(steps)));
  EXPECT_NEAR(t_mean, toy.trace(), 5 * t_sd / std::sqrt(double(steps)));
  const double ema = std::sqrt((1 - beta) / (1 + beta));
  const double rel = 5 * ema * (g_sd / toy.grad_sq() + t_sd / toy.trace());
  std::printf("B_simple %.3f (closed form %.1f), allowed relative error %.3f\n", gns.value(),
              toy.b_simple(), rel);
  EXPECT_NEAR(gns.value(), toy.b_simple(), rel * toy.b_simple());
  EXPECT_EQ(gns.samples(), steps);
}

TEST(NoiseScale, UndefinedEstimatesAreNaNAndDoNotEnterTheAverage) {
  GradientNoiseScale gns(0.5);
  EXPECT_TRUE(std::isnan(gns.value()));  // no step yet
  // One rank: both batch sizes are the same, nothing can be estimated.
  gns.Add({.small_sq = 2, .big_sq = 2, .b_small = 16, .b_big = 16});
  EXPECT_EQ(gns.samples(), 0);
  EXPECT_TRUE(std::isnan(NoiseScaleEstimate({2, 2, 16, 16}).trace));
  // A non-finite norm (a skipped step) is left out.
  gns.Add({.small_sq = INFINITY, .big_sq = 1, .b_small = 1, .b_big = 2});
  gns.Add({.small_sq = NAN, .big_sq = 1, .b_small = 1, .b_big = 2});
  EXPECT_EQ(gns.samples(), 0);
  // The big batch's norm above the small one's: negative noise, undefined, not a number.
  gns.Add({.small_sq = 1, .big_sq = 3, .b_small = 1, .b_big = 2});
  EXPECT_EQ(gns.samples(), 1);
  EXPECT_LT(gns.trace(), 0);
  EXPECT_TRUE(std::isnan(gns.value()));
  // Noise so large that |g|^2 is estimated negative: undefined as well.
  GradientNoiseScale noisy(0.5);
  noisy.Add({.small_sq = 10, .big_sq = 4, .b_small = 1, .b_big = 2});  // |g|^2 = (8 - 10) / 1
  EXPECT_LT(noisy.grad_sq(), 0);
  EXPECT_TRUE(std::isnan(noisy.value()));
  // The next step's |g|^2 = (2 * 11 - 20) / 1 = 2 averages with the -2 to 0: still undefined.
  noisy.Add({.small_sq = 20, .big_sq = 11, .b_small = 1, .b_big = 2});
  EXPECT_DOUBLE_EQ(noisy.grad_sq(), 0.5 * -2 + 0.5 * 2);
  EXPECT_TRUE(std::isnan(noisy.value()));
  EXPECT_THROW(GradientNoiseScale(1.0), Error);
  EXPECT_THROW(GradientNoiseScale(-0.1), Error);
}

TEST(NoiseScale, QuantizationNoiseRatioFollowsTheRoundingMode) {
  // eps 0.1, b = B_simple: stochastic 0.01 * (1 + 1), nearest 0.01 * 1.
  EXPECT_DOUBLE_EQ(QuantizationNoiseRatio(0.1, 64, 64, true), 0.1 * 0.1 * 2);
  EXPECT_DOUBLE_EQ(QuantizationNoiseRatio(0.1, 64, 64, false), 0.1 * 0.1);
  EXPECT_DOUBLE_EQ(QuantizationNoiseRatio(0.1, 256, 64, false), 0.1 * 0.1 * 4);
  EXPECT_DOUBLE_EQ(QuantizationNoiseRatio(0, 256, 64, true), 0);
  EXPECT_TRUE(std::isnan(QuantizationNoiseRatio(0.1, 256, NAN, true)));
  EXPECT_TRUE(std::isnan(QuantizationNoiseRatio(0.1, 256, -3, false)));
  EXPECT_TRUE(std::isnan(QuantizationNoiseRatio(NAN, 256, 64, false)));
}

}  // namespace
}  // namespace geofp8::model
