// The gradient noise scale B_simple = tr(Sigma) / |g|^2 (McCandlish et al. 2018, appendix A),
// estimated from two batch sizes a data-parallel step already has: each rank's own gradient and
// the average over ranks.
#pragma once

#include <cmath>
#include <cstdint>

namespace geofp8::model {

// One step's two squared norms and the batch sizes (in tokens) they were measured at.
struct NoiseScaleSample {
  double small_sq = 0;  // |G_small|^2: mean over ranks of each rank's own gradient's squared norm
  double big_sq = 0;    // |G_big|^2: the squared norm of the gradient averaged over ranks
  double b_small = 0;   // tokens behind one rank's gradient
  double b_big = 0;     // tokens behind the averaged gradient (ranks * b_small)
};

// The two unbiased estimates of one step, from E|G_B|^2 = |g|^2 + tr(Sigma) / B at the two sizes:
//   |g|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
//   tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)
// Both NaN when the batch sizes coincide (one rank) or a norm is not finite.
struct NoiseScaleTerms {
  double grad_sq = NAN;
  double trace = NAN;
};
NoiseScaleTerms NoiseScaleEstimate(const NoiseScaleSample& s);

// Exponential moving averages of both terms over steps, and their ratio. The ratio of two
// estimates that are each unbiased is not, and one step's |g|^2 estimate is often negative, so
// the terms are smoothed first and divided after (as McCandlish et al. do).
class GradientNoiseScale {
 public:
  // beta in [0, 1): the weight of the past; 0 keeps only the last step.
  explicit GradientNoiseScale(double beta = 0.95);
  // Folds one step in. A step whose estimate is not finite (one rank, a skipped step) is left
  // out, so it neither moves nor poisons the averages.
  void Add(const NoiseScaleSample& s);
  // B_simple in the batch unit of the samples (tokens); NaN ("undefined") before the first
  // usable step, or while either smoothed term is not positive.
  double value() const;
  double grad_sq() const { return grad_sq_; }  // smoothed |g|^2 (NaN before the first step)
  double trace() const { return trace_; }      // smoothed tr(Sigma)
  int64_t samples() const { return samples_; }
  // The state a checkpoint carries (the three above), back: a resumed run continues the averages.
  void Restore(double grad_sq, double trace, int64_t samples);

 private:
  double beta_;
  double grad_sq_ = NAN, trace_ = NAN;
  int64_t samples_ = 0;
};

// The exchange's quantization noise against the SGD noise of a batch of b tokens, predicted from
// the layer's measured relative exchange error eps = |g_hat - G_b| / |G_b| and B_simple. The SGD
// noise is tr(Sigma) / b = |g|^2 B_simple / b, and E|G_b|^2 = |g|^2 (1 + B_simple / b):
//   stochastic rounding (zero-mean error, independent of the batch's noise):
//     eps^2 |G_b|^2 / (tr(Sigma) / b) = eps^2 (1 + b / B_simple)
//   round to nearest (a deterministic error, counted against the mean gradient it distorts):
//     eps^2 |g|^2 / (tr(Sigma) / b) = eps^2 b / B_simple
// NaN when B_simple or eps is NaN, or B_simple is not positive.
double QuantizationNoiseRatio(double eps, double b, double b_simple, bool stochastic_rounding);

}  // namespace geofp8::model
