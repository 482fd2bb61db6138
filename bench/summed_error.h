// The exchange error summed over the steps of a trajectory, as momentum and the weights integrate
// it (geofp8-bench trajectory). One step's rel_fro says how large one error is; over T steps what
// reaches the weights is sum_t e_t, which grows like sqrt(T) when the steps' errors are
// independent and like T when a step repeats the last one's error (a stale basis rounding a
// persistent gradient the same way every step would). A bias along the gradient is a learning-rate
// change that rel_fro does not show either.
#pragma once

#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

#include "kernels/common/check.h"

namespace geofp8::bench {

class SummedError {
 public:
  // Adds one step: the exchanged gradient and the exact fp32 average it approximates.
  void Add(std::span<const float> exchanged, std::span<const float> exact) {
    GEOFP8_CHECK(exchanged.size() == exact.size(), "summed error: ", exchanged.size(), " vs ",
                 exact.size(), " elements");
    if (steps_ == 0) {
      error_.assign(exact.size(), 0.0);
      exact_.assign(exact.size(), 0.0);
    }
    GEOFP8_CHECK(exact.size() == exact_.size(), "summed error: a step of ", exact.size(),
                 " elements after steps of ", exact_.size());
    double sq = 0;
    for (size_t i = 0; i < exact.size(); ++i) {
      const double e = double(exchanged[i]) - double(exact[i]);
      error_[i] += e;
      exact_[i] += exact[i];
      sq += e * e;
    }
    error_sq_ += sq;
    ++steps_;
  }

  int steps() const { return steps_; }

  // ||sum e|| / ||sum g||: the summed exchange's relative error, as rel_fro is one step's.
  double RelFro() const {
    const double g = Norm2(exact_);
    return g > 0 ? std::sqrt(Norm2(error_) / g) : NAN;
  }

  // ||sum e||^2 / sum ||e||^2: 1 when the steps' errors are mutually orthogonal (independent
  // rounding, in expectation), T when every step repeats one error, below 1 when they cancel.
  double Coherence() const { return error_sq_ > 0 ? Norm2(error_) / error_sq_ : NAN; }

  // <sum e, sum g> / ||sum g||^2: how much the error lengthens (> 0) or shortens (< 0) the summed
  // gradient along itself.
  double Along() const {
    const double g = Norm2(exact_);
    double dot = 0;
    for (size_t i = 0; i < error_.size(); ++i) dot += error_[i] * exact_[i];
    return g > 0 ? dot / g : NAN;
  }

 private:
  static double Norm2(const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x * x;
    return s;
  }

  std::vector<double> error_, exact_;
  double error_sq_ = 0;  // sum over steps of ||e_t||^2
  int steps_ = 0;
};

}  // namespace geofp8::bench
