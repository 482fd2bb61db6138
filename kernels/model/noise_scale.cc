// The two-batch gradient noise scale estimator and the quantization-to-SGD noise ratio it
// predicts (see noise_scale.h for the formulas).

#include "kernels/model/noise_scale.h"

#include "kernels/common/check.h"

namespace geofp8::model {

NoiseScaleTerms NoiseScaleEstimate(const NoiseScaleSample& s) {
  NoiseScaleTerms t;
  if (!(s.b_small > 0) || !(s.b_big > s.b_small) || !std::isfinite(s.small_sq) ||
      !std::isfinite(s.big_sq)) {
    return t;
  }
  t.grad_sq = (s.b_big * s.big_sq - s.b_small * s.small_sq) / (s.b_big - s.b_small);
  t.trace = (s.small_sq - s.big_sq) / (1.0 / s.b_small - 1.0 / s.b_big);
  return t;
}

GradientNoiseScale::GradientNoiseScale(double beta) : beta_(beta) {
  GEOFP8_CHECK(beta >= 0 && beta < 1, "gns_beta: must be in [0, 1) (", beta, ")");
}

void GradientNoiseScale::Add(const NoiseScaleSample& s) {
  const NoiseScaleTerms t = NoiseScaleEstimate(s);
  if (!std::isfinite(t.grad_sq) || !std::isfinite(t.trace)) return;
  // Started from the first sample rather than from zero: the same as bias correction, which
  // would cancel in the ratio anyway.
  if (samples_ == 0) {
    grad_sq_ = t.grad_sq;
    trace_ = t.trace;
  } else {
    grad_sq_ = beta_ * grad_sq_ + (1 - beta_) * t.grad_sq;
    trace_ = beta_ * trace_ + (1 - beta_) * t.trace;
  }
  ++samples_;
}

void GradientNoiseScale::Restore(double grad_sq, double trace, int64_t samples) {
  GEOFP8_CHECK(samples >= 0, "noise scale: samples must be >= 0 (", samples, ")");
  grad_sq_ = samples ? grad_sq : NAN;
  trace_ = samples ? trace : NAN;
  samples_ = samples;
}

double GradientNoiseScale::value() const {
  if (!(grad_sq_ > 0) || !(trace_ > 0)) return NAN;
  const double b = trace_ / grad_sq_;
  return std::isfinite(b) ? b : NAN;
}

double QuantizationNoiseRatio(double eps, double b, double b_simple, bool stochastic_rounding) {
  if (!std::isfinite(eps) || !(b > 0) || !(b_simple > 0) || !std::isfinite(b_simple)) return NAN;
  const double e2 = eps * eps;
  return stochastic_rounding ? e2 * (1 + b / b_simple) : e2 * b / b_simple;
}

}  // namespace geofp8::model
