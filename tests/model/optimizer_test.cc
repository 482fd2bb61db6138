// AdamW against a hand-written float64 reference, the warmup+cosine schedule, clipping, and
// option validation.

#include "kernels/model/optimizer.h"

#include <gtest/gtest.h>

#include <cmath>

#include "kernels/common/check.h"

namespace geofp8::model {
namespace {

TEST(Optimizer, ScheduleWarmsUpThenFollowsTheCosine) {
  OptimizerOptions o;
  o.lr = 1.0f, o.min_lr = 0.1f, o.warmup_steps = 4, o.total_steps = 104;
  EXPECT_FLOAT_EQ(LearningRate(o, 0), 0.25f);
  EXPECT_FLOAT_EQ(LearningRate(o, 3), 1.0f);
  EXPECT_FLOAT_EQ(LearningRate(o, 4), 1.0f);
  EXPECT_NEAR(LearningRate(o, 54), 0.55f, 1e-6);  // half way: (1 + 0.1) / 2
  EXPECT_FLOAT_EQ(LearningRate(o, 104), 0.1f);
  EXPECT_FLOAT_EQ(LearningRate(o, 500), 0.1f);
  for (int s = 5; s < 104; ++s) EXPECT_LE(LearningRate(o, s), LearningRate(o, s - 1));
}

TEST(Optimizer, ClipScalesToTheNormOnlyWhenAbove) {
  std::vector<float> g = {3.f, 4.f};
  EXPECT_DOUBLE_EQ(ClipGradNorm(g, 10.f), 5.0);
  EXPECT_EQ(g, (std::vector<float>{3.f, 4.f}));
  EXPECT_DOUBLE_EQ(ClipGradNorm(g, 1.f), 5.0);
  EXPECT_NEAR(std::hypot(g[0], g[1]), 1.0, 1e-6);
  EXPECT_NEAR(g[0] / g[1], 0.75, 1e-6);
  std::vector<float> z = {0.f, 0.f};
  EXPECT_EQ(ClipGradNorm(z, 1.f), 0.0);
  EXPECT_EQ(z, (std::vector<float>{0.f, 0.f}));
}

TEST(Optimizer, AdamWMatchesAFloat64Reference) {
  std::vector<ParamInfo> params(2);
  params[0].name = "w", params[0].rows = 2, params[0].cols = 3, params[0].offset = 0;
  params[1].name = "gain", params[1].rows = 1, params[1].cols = 2, params[1].offset = 6;
  OptimizerOptions o;
  o.lr = 0.01f, o.min_lr = 0.001f, o.warmup_steps = 2, o.total_steps = 10, o.weight_decay = 0.1f;
  AdamW opt(o, params);
  std::vector<float> w = {0.5f, -0.2f, 0.1f, 0.0f, 1.0f, -1.0f, 1.0f, 1.0f};
  std::vector<double> rw(w.begin(), w.end()), m(8, 0), v(8, 0);
  for (int step = 0; step < 6; ++step) {
    std::vector<float> g(8);
    for (int i = 0; i < 8; ++i) g[i] = std::sin(1.0 + i * 0.7 + step * 1.3);
    opt.Step(w, g, step);
    const double lr = LearningRate(o, step);
    for (int i = 0; i < 8; ++i) {
      m[i] = 0.9 * m[i] + 0.1 * g[i];
      v[i] = 0.95 * v[i] + 0.05 * double(g[i]) * g[i];
      const double mh = m[i] / (1 - std::pow(0.9, step + 1));
      const double vh = v[i] / (1 - std::pow(0.95, step + 1));
      const double decay = i < 6 ? lr * 0.1 : 0.0;
      rw[i] -= lr * mh / (std::sqrt(vh) + 1e-8) + decay * rw[i];
    }
    for (int i = 0; i < 8; ++i) EXPECT_NEAR(w[i], rw[i], 1e-6) << "step " << step << " i " << i;
  }
}

TEST(Optimizer, PreviewUpdateIsWhatStepSubtractsAndChangesNothing) {
  // Two parameters: a 2 x 3 matrix (decayed) and a 1-D gain (not decayed).
  const std::vector<ParamInfo> params = {{"w", 0, 2, 3}, {"g", 6, 1, 3}};
  OptimizerOptions o;
  o.weight_decay = 0.1f;
  AdamW adam(o, params);
  std::vector<float> w = {0.5f, -1.f, 2.f, 0.25f, -0.75f, 1.5f, 1.f, 1.f, 1.f};
  std::vector<float> g1 = {0.1f, -0.2f, 0.3f, 0.05f, 0.f, -1.f, 0.01f, 0.02f, -0.03f};
  adam.Step(w, g1, 0);  // non-zero moments for the preview to start from
  const std::vector<float> m = adam.m(), v = adam.v(), w_before = w;
  std::vector<float> g2 = {-0.3f, 0.1f, 0.2f, 0.4f, -0.1f, 0.5f, 0.2f, -0.2f, 0.1f};
  std::vector<std::vector<float>> preview;
  for (const ParamInfo& p : params) {
    preview.emplace_back(size_t(p.size()));
    adam.PreviewUpdate(w, g2, 1, p, preview.back());
  }
  EXPECT_EQ(adam.m(), m);  // state untouched
  EXPECT_EQ(adam.v(), v);
  EXPECT_EQ(w, w_before);
  adam.Step(w, g2, 1);
  // Step computes w -= update with the same float operations: the previewed update reproduces
  // its result bit for bit.
  for (size_t p = 0; p < params.size(); ++p)
    for (int64_t i = 0; i < params[p].size(); ++i) {
      const size_t at = size_t(params[p].offset + i);
      EXPECT_EQ(w_before[at] - preview[p][size_t(i)], w[at]) << params[p].name << " " << i;
    }
  std::vector<float> wrong(2);
  EXPECT_THROW(adam.PreviewUpdate(w, g2, 1, params[0], wrong), Error);
}

TEST(Optimizer, BadOptionsAreRejectedNamingTheField) {
  OptimizerOptions o;
  o.lr = -1;
  EXPECT_EQ(ValidateOptimizerOptions(o), "optimizer.lr: must be a finite value > 0 (-1)");
  o = OptimizerOptions{};
  o.beta2 = 1.0f;
  EXPECT_EQ(ValidateOptimizerOptions(o), "optimizer.beta2: must be in [0, 1) (1)");
  o = OptimizerOptions{};
  o.total_steps = 0;
  EXPECT_EQ(ValidateOptimizerOptions(o), "optimizer.total_steps: must be >= 1 (0)");
  o = OptimizerOptions{};
  o.min_lr = 1.0f;
  EXPECT_NE(ValidateOptimizerOptions(o).find("optimizer.min_lr"), std::string::npos);
  EXPECT_EQ(ValidateOptimizerOptions(OptimizerOptions{}), "");
}

}  // namespace
}  // namespace geofp8::model
