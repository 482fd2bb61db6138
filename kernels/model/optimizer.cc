// AdamW, the warmup+cosine schedule and gradient clipping of kernels/model/optimizer.h.

#include "kernels/model/optimizer.h"

#include <cmath>
#include <sstream>

#include "kernels/common/check.h"

namespace geofp8::model {

std::string ValidateOptimizerOptions(const OptimizerOptions& o) {
  std::ostringstream os;
  auto finite = [](float v) { return std::isfinite(v); };
  if (!(o.lr > 0) || !finite(o.lr)) {
    os << "optimizer.lr: must be a finite value > 0 (" << o.lr << ")";
  } else if (!(o.min_lr >= 0) || o.min_lr > o.lr) {
    os << "optimizer.min_lr: must be in [0, lr] (" << o.min_lr << ")";
  } else if (o.warmup_steps < 0) {
    os << "optimizer.warmup_steps: must be >= 0 (" << o.warmup_steps << ")";
  } else if (o.total_steps < 1) {
    os << "optimizer.total_steps: must be >= 1 (" << o.total_steps << ")";
  } else if (!(o.beta1 >= 0 && o.beta1 < 1)) {
    os << "optimizer.beta1: must be in [0, 1) (" << o.beta1 << ")";
  } else if (!(o.beta2 >= 0 && o.beta2 < 1)) {
    os << "optimizer.beta2: must be in [0, 1) (" << o.beta2 << ")";
  } else if (!(o.eps > 0) || !finite(o.eps)) {
    os << "optimizer.eps: must be a finite value > 0 (" << o.eps << ")";
  } else if (!(o.weight_decay >= 0) || !finite(o.weight_decay)) {
    os << "optimizer.weight_decay: must be a finite value >= 0 (" << o.weight_decay << ")";
  } else if (!(o.clip_norm >= 0) || !finite(o.clip_norm)) {
    os << "optimizer.clip_norm: must be a finite value >= 0 (" << o.clip_norm << ")";
  }
  return os.str();
}

float LearningRate(const OptimizerOptions& o, int64_t step) {
  if (step < o.warmup_steps) {
    return static_cast<float>(o.lr * double(step + 1) / double(o.warmup_steps));
  }
  const int64_t span = o.total_steps - o.warmup_steps;
  if (span <= 0) return o.lr;
  double progress = double(step - o.warmup_steps) / double(span);
  if (progress > 1) progress = 1;
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return static_cast<float>(o.min_lr + (o.lr - o.min_lr) * cosine);
}

double ClipGradNorm(std::span<float> grad, float max_norm) {
  // Eight partial sums in a fixed order: vectorizes, and every rank gets the same bits.
  const float* g = grad.data();
  const size_t n = grad.size();
  double acc[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) acc[k] += double(g[i + k]) * double(g[i + k]);
  }
  double ss = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) ss += double(g[i]) * double(g[i]);
  const double norm = std::sqrt(ss);
  if (max_norm > 0 && norm > max_norm) {
    const float scale = static_cast<float>(max_norm / (norm + 1e-6));
    for (float& g : grad) g *= scale;
  }
  return norm;
}

AdamW::AdamW(const OptimizerOptions& options, const std::vector<ParamInfo>& params)
    : options_(options), params_(params) {
  const std::string err = ValidateOptimizerOptions(options);
  GEOFP8_CHECK(err.empty(), err);
  const size_t total = params.empty() ? 0 : params.back().offset + params.back().size();
  m_.assign(total, 0.f);
  v_.assign(total, 0.f);
}

namespace {

// What one step's update needs besides the element: the learning rate and AdamW's constants.
struct StepScalars {
  float lr, bc1, bc2, b1, b2, c1, c2, eps;
};

StepScalars ScalarsAt(const OptimizerOptions& o, int64_t step) {
  const double t = double(step + 1);
  return {LearningRate(o, step),
          static_cast<float>(1.0 - std::pow(double(o.beta1), t)),
          static_cast<float>(1.0 - std::pow(double(o.beta2), t)),
          o.beta1,
          o.beta2,
          1.f - o.beta1,
          1.f - o.beta2,
          o.eps};
}

// One element of AdamW: updates the moments and returns what is subtracted from the weight. The
// one place its arithmetic is written, so PreviewUpdate is exactly what Step subtracts.
inline float UpdateElement(float g, float w, float decay, const StepScalars& c, float& m,
                           float& v) {
  m = c.b1 * m + c.c1 * g;
  v = c.b2 * v + c.c2 * g * g;
  const float mhat = m / c.bc1, vhat = v / c.bc2;
  return c.lr * (mhat / (std::sqrt(vhat) + c.eps)) + decay * w;
}

}  // namespace

void AdamW::Step(std::span<float> weights, std::span<const float> grad, int64_t step) {
  GEOFP8_CHECK(weights.size() == m_.size() && grad.size() == m_.size(),
               "optimizer buffer size mismatch: ", weights.size(), " ", grad.size(), " ",
               m_.size());
  // Loop-invariant scalars in locals and restrict pointers, so the loop vectorizes (sqrt is
  // inlined: the library builds with -fno-math-errno). Plain SSE2 arithmetic without FMA
  // contraction: the same bits on every x86-64 machine, as the ranks' checksums require.
  const StepScalars c = ScalarsAt(options_, step);
  for (const ParamInfo& p : params_) {
    const float decay = p.is_matrix() ? c.lr * options_.weight_decay : 0.f;
    float* __restrict w = weights.data() + p.offset;
    float* __restrict m = m_.data() + p.offset;
    float* __restrict v = v_.data() + p.offset;
    const float* __restrict gr = grad.data() + p.offset;
    const int64_t n = p.size();
    for (int64_t i = 0; i < n; ++i) w[i] -= UpdateElement(gr[i], w[i], decay, c, m[i], v[i]);
  }
}

void AdamW::PreviewUpdate(std::span<const float> weights, std::span<const float> grad, int64_t step,
                          const ParamInfo& p, std::span<float> out) const {
  GEOFP8_CHECK(weights.size() == m_.size() && grad.size() == m_.size() && p.offset >= 0 &&
                   p.offset + p.size() <= int64_t(m_.size()) && int64_t(out.size()) == p.size(),
               "PreviewUpdate: buffer sizes do not match parameter ", p.name);
  const StepScalars c = ScalarsAt(options_, step);
  const float decay = p.is_matrix() ? c.lr * options_.weight_decay : 0.f;
  for (int64_t i = 0; i < p.size(); ++i) {  // Step's arithmetic, on copies of the moments
    float m = m_[p.offset + i], v = v_[p.offset + i];
    out[i] = UpdateElement(grad[p.offset + i], weights[p.offset + i], decay, c, m, v);
  }
}

}  // namespace geofp8::model
