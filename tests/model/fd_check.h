// Central finite-difference helper for the model tests: compares an analytic gradient with
// (L(x+h) - L(x-h)) / 2h for every element, in float64.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <vector>

namespace geofp8::model::testing {

inline std::vector<double> RandomVector(size_t n, uint64_t seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = nd(rng);
  return v;
}

// Returns the worst |analytic - numeric| / max(floor, |analytic| + |numeric|) over the elements
// of x, perturbing each in place (x is restored). floor = 1e-4 * max|analytic| keeps float64
// round-off in near-zero entries (about 1e-16 * L / h) from dominating.
inline double MaxRelativeError(std::vector<double>& x, const std::function<double()>& loss,
                               const std::vector<double>& analytic, double h = 1e-5) {
  EXPECT_EQ(x.size(), analytic.size());
  double worst = 0, biggest = 0;
  for (double a : analytic) biggest = std::max(biggest, std::abs(a));
  const double floor = std::max(1e-12, 1e-4 * biggest);
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + h;
    const double lp = loss();
    x[i] = saved - h;
    const double lm = loss();
    x[i] = saved;
    const double numeric = (lp - lm) / (2 * h);
    const double err = std::abs(analytic[i] - numeric) /
                       std::max(floor, std::abs(analytic[i]) + std::abs(numeric));
    worst = std::max(worst, err);
  }
  return worst;
}

inline double Dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace geofp8::model::testing
