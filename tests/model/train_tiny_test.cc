// Single-rank training of llama-tiny with AdamW: the loss falls within a few dozen steps, and on
// the Markov source it approaches (but never beats) the chain's entropy rate.

#include <gtest/gtest.h>

#include <cmath>

#include "kernels/model/data.h"
#include "kernels/model/model.h"
#include "kernels/model/ops.h"
#include "kernels/model/optimizer.h"

namespace geofp8::model {
namespace {

double Validation(Model<float>& model, const DataSource& src, int seq) {
  std::vector<int32_t> batch;
  double sum = 0;
  for (int i = 0; i < 16; ++i) {
    src.ValidationBatch(i, 16, seq, &batch);
    sum += model.Loss(batch, 16, seq);
  }
  return sum / 16;
}

TEST(TrainTiny, LossFallsAndApproachesTheEntropyRate) {
  SetBlasThreads(1);
  ModelConfig c = *PresetConfig("llama-tiny");
  Model<float> model(c);
  model.Init(1);
  MarkovSource src(MarkovOptions{.seed = 3, .alphabet = 12, .successors = 3});
  OptimizerOptions o;
  o.lr = 1e-2f, o.min_lr = 1e-3f, o.warmup_steps = 10, o.total_steps = 300;
  AdamW opt(o, model.params());
  const int batch = 8, seq = 32;
  const double initial = Validation(model, src, seq);
  EXPECT_NEAR(initial, std::log(256.0), 0.2);
  std::vector<int32_t> tokens;
  double at40 = 0;
  for (int step = 0; step < o.total_steps; ++step) {
    src.TrainBatch(step, 0, 1, batch, seq, &tokens);
    model.ForwardBackward(tokens, batch, seq);
    ClipGradNorm(model.grads(), o.clip_norm);
    opt.Step(model.weights(), model.grads(), step);
    if (step == 39) at40 = Validation(model, src, seq);
  }
  const double final_loss = Validation(model, src, seq);
  const double H = src.EntropyBound();
  std::printf("initial %.4f after 40 steps %.4f final %.4f entropy rate %.4f\n", initial, at40,
              final_loss, H);
  EXPECT_LT(at40, 0.5 * initial);   // falls within a few dozen steps
  EXPECT_LT(final_loss, H + 0.05);  // approaches the bound
  EXPECT_GT(final_loss, H - 0.04);  // and cannot beat it beyond sampling noise (8192 tokens)
}

}  // namespace
}  // namespace geofp8::model
