// AdamW with a linear-warmup + cosine-decay learning-rate schedule, and global-norm clipping of
// the (already averaged) gradient. Pure float32 math over the model's flat buffers.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kernels/model/model.h"

namespace geofp8::model {

// Plain struct with defaults; validated by ValidateOptimizerOptions.
struct OptimizerOptions {
  float lr = 3e-3f;        // peak learning rate
  float min_lr = 3e-4f;    // floor reached at the end of the cosine
  int warmup_steps = 20;   // linear ramp from lr/warmup to lr over these steps
  int total_steps = 1000;  // cosine decays from warmup_steps to total_steps
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;  // decoupled; applied to 2-D weights only (not norms)
  float clip_norm = 1.0f;     // global L2 norm cap on the averaged gradient; 0 disables
};

// "" when usable, else one line naming the field: "optimizer.lr: must be > 0 (-1)".
std::string ValidateOptimizerOptions(const OptimizerOptions& options);

// Learning rate for 0-based step `step`.
float LearningRate(const OptimizerOptions& options, int64_t step);

// Scales grad in place so its global L2 norm is at most max_norm (0: no clipping).
// Returns the norm before clipping (accumulated in double).
double ClipGradNorm(std::span<float> grad, float max_norm);

class AdamW {
 public:
  AdamW(const OptimizerOptions& options, const std::vector<ParamInfo>& params);

  // One update of weights from grad at 0-based step `step` (uses LearningRate(step)).
  void Step(std::span<float> weights, std::span<const float> grad, int64_t step);

  // The update Step(weights, grad, step) would subtract from parameter p, written to out
  // (p.size() values), computed from the current moments without changing them: the update two
  // gradients would cause on the same optimizer state can be compared. grad and weights are the
  // full flat buffers.
  void PreviewUpdate(std::span<const float> weights, std::span<const float> grad, int64_t step,
                     const ParamInfo& p, std::span<float> out) const;

  const OptimizerOptions& options() const { return options_; }
  // Moments, for checkpoints.
  std::vector<float>& m() { return m_; }
  std::vector<float>& v() { return v_; }

 private:
  OptimizerOptions options_;
  std::vector<ParamInfo> params_;
  std::vector<float> m_, v_;
};

}  // namespace geofp8::model
