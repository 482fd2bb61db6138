// Whole-model checks: the tiny Llama's full gradient against central finite differences in
// float64, gradient-ready callbacks in reverse layer order, presets and config validation.

#include "kernels/model/model.h"

#include <gtest/gtest.h>

#include <set>

#include "kernels/common/check.h"
#include "tests/model/fd_check.h"

namespace geofp8::model {
namespace {

ModelConfig Micro() {
  ModelConfig c;
  c.name = "micro";
  c.vocab = 11, c.dim = 8, c.layers = 2, c.heads = 2, c.ffn = 12, c.seq = 5;
  c.init_std = 0.3f;  // large enough that every path carries gradient
  return c;
}

std::vector<int32_t> Tokens(int batch, int seq, int vocab, uint64_t seed) {
  std::vector<int32_t> t(size_t(batch) * (seq + 1));
  uint64_t s = seed;
  for (auto& x : t)
    x = int32_t((s = s * 6364136223846793005ULL + 1442695040888963407ULL) >> 33) % vocab;
  return t;
}

TEST(Model, WholeModelGradientMatchesFiniteDifferences) {
  Model<double> model(Micro());
  model.Init(7);
  // Random norm gains too, so their gradients are not at a symmetric point.
  for (const ParamInfo& p : model.params()) {
    if (!p.is_matrix()) {
      auto w = model.weight(&p - model.params().data());
      for (size_t j = 0; j < w.size(); ++j) w[j] = 1.0 + 0.1 * std::sin(double(j + p.offset));
    }
  }
  const int batch = 2, seq = 5;
  const std::vector<int32_t> tokens = Tokens(batch, seq, 11, 3);
  model.ForwardBackward(tokens, batch, seq);
  const std::vector<double> analytic = model.grads();
  auto loss = [&] { return model.Loss(tokens, batch, seq); };
  const double worst = testing::MaxRelativeError(model.weights(), loss, analytic, 1e-5);
  EXPECT_LT(worst, 1e-5);
  double norm = 0;
  for (const ParamInfo& p : model.params()) {
    double s = 0;
    for (int64_t j = 0; j < p.size(); ++j) s += std::abs(analytic[p.offset + j]);
    EXPECT_GT(s, 0.0) << p.name << " got no gradient";
    norm += s;
  }
  EXPECT_GT(norm, 0.0);
}

TEST(Model, LlamaTinyGradientMatchesFiniteDifferencesOnSampledCoordinates) {
  // The real llama-tiny shape (115k parameters): 24 coordinates of every tensor, in float64.
  ModelConfig c = *PresetConfig("llama-tiny");
  c.init_std = 0.1f;
  Model<double> model(c);
  model.Init(11);
  const int batch = 2, seq = 8;
  const std::vector<int32_t> tokens = Tokens(batch, seq, 256, 17);
  model.ForwardBackward(tokens, batch, seq);
  const std::vector<double> analytic = model.grads();
  double worst = 0;
  uint64_t pick = 99;
  for (const ParamInfo& p : model.params()) {
    double biggest = 0;
    for (int64_t j = 0; j < p.size(); ++j)
      biggest = std::max(biggest, std::abs(analytic[p.offset + j]));
    for (int s = 0; s < 24; ++s) {
      pick = pick * 6364136223846793005ULL + 1442695040888963407ULL;
      int64_t j = p.offset + int64_t((pick >> 33) % uint64_t(p.size()));
      if (p.name == "tok_emb" || p.name == "lm_head") {
        // Rows of bytes that occur carry the gradient; sample those.
        const int64_t col = j % p.cols;
        j = p.offset + int64_t(tokens[(pick >> 20) % tokens.size()]) * p.cols + col;
      }
      double& w = model.weights()[j];
      const double saved = w, h = 1e-5;
      w = saved + h;
      const double lp = model.Loss(tokens, batch, seq);
      w = saved - h;
      const double lm = model.Loss(tokens, batch, seq);
      w = saved;
      const double numeric = (lp - lm) / (2 * h);
      const double err =
          std::abs(numeric - analytic[j]) /
          std::max(1e-4 * biggest + 1e-12, std::abs(numeric) + std::abs(analytic[j]));
      EXPECT_LT(err, 1e-5) << p.name << " element " << j - p.offset;
      worst = std::max(worst, err);
    }
  }
  std::printf("llama-tiny sampled FD worst relative error %.3g\n", worst);
}

TEST(Model, GradReadyCallbacksComeInReverseOrderWithFinalGradients) {
  Model<float> model(Micro());
  model.Init(1);
  const std::vector<int32_t> tokens = Tokens(3, 4, 11, 5);
  std::vector<int> order;
  std::vector<std::vector<float>> at_ready(model.params().size());
  model.ForwardBackward(tokens, 3, 4, [&](int i) {
    order.push_back(i);
    auto g = model.grad(i);
    at_ready[i].assign(g.begin(), g.end());
  });
  ASSERT_EQ(order.size(), model.params().size());
  for (size_t j = 0; j < order.size(); ++j) {
    EXPECT_EQ(order[j], int(order.size() - 1 - j)) << "callback " << j;
  }
  for (size_t i = 0; i < order.size(); ++i) {
    auto g = model.grad(int(i));
    EXPECT_EQ(std::vector<float>(g.begin(), g.end()), at_ready[i]) << model.params()[i].name;
  }
}

TEST(Model, FloatGradientAgreesWithDouble) {
  Model<double> md(Micro());
  Model<float> mf(Micro());
  md.Init(9);
  mf.Init(9);
  const std::vector<int32_t> tokens = Tokens(2, 5, 11, 8);
  const double ld = md.ForwardBackward(tokens, 2, 5);
  const double lf = mf.ForwardBackward(tokens, 2, 5);
  EXPECT_NEAR(lf, ld, 1e-5 * ld);
  double num = 0, den = 0;
  for (size_t i = 0; i < md.grads().size(); ++i) {
    const double e = mf.grads()[i] - md.grads()[i];
    num += e * e;
    den += md.grads()[i] * md.grads()[i];
  }
  EXPECT_LT(std::sqrt(num / den), 1e-5);
}

TEST(Model, FloatGradientAgreesWithDoubleOnLlamaTiny) {
  // Widths of 64-256 run the vectorized paths (eight-lane sums, float exp) that Micro's 8-12
  // wide rows barely reach.
  const ModelConfig c = *PresetConfig("llama-tiny");
  Model<double> md(c);
  Model<float> mf(c);
  md.Init(4);
  mf.Init(4);
  const std::vector<int32_t> tokens = Tokens(2, c.seq, c.vocab, 12);
  const double ld = md.ForwardBackward(tokens, 2, c.seq);
  const double lf = mf.ForwardBackward(tokens, 2, c.seq);
  EXPECT_NEAR(lf, ld, 1e-6 * ld);
  for (size_t p = 0; p < md.params().size(); ++p) {
    const auto gd = md.grad(int(p));
    const auto gf = mf.grad(int(p));
    double num = 0, den = 0;
    for (size_t i = 0; i < gd.size(); ++i) {
      num += (gf[i] - gd[i]) * (gf[i] - gd[i]);
      den += gd[i] * gd[i];
    }
    EXPECT_LT(std::sqrt(num / den), 1e-4) << md.params()[p].name;
  }
}

TEST(Model, EveryGradientIsOverwrittenEachPass) {
  // Weight gradients are written by beta = 0 GEMMs, the rest zeroed first: whatever grads()
  // held before must not leak into the next pass.
  Model<float> model(Micro());
  model.Init(3);
  const std::vector<int32_t> tokens = Tokens(3, 5, 11, 21);
  model.ForwardBackward(tokens, 3, 5);
  const std::vector<float> first = model.grads();
  std::fill(model.grads().begin(), model.grads().end(), 7.f);
  model.ForwardBackward(tokens, 3, 5);
  EXPECT_EQ(model.grads(), first);
}

TEST(Model, PresetsHaveTheDocumentedSizes) {
  auto tiny = PresetConfig("llama-tiny");
  ASSERT_TRUE(tiny);
  EXPECT_GT(ParameterCount(*tiny), 80'000);
  EXPECT_LT(ParameterCount(*tiny), 150'000);
  auto small = PresetConfig("llama-small");
  ASSERT_TRUE(small);
  EXPECT_EQ(ParameterCount(*small), 3'344'640);  // stated in worker/train/README.md and docs
  auto m300 = PresetConfig("llama-300m");
  ASSERT_TRUE(m300);
  EXPECT_NEAR(double(ParameterCount(*m300)), 300e6, 30e6);
  auto m600 = PresetConfig("llama-600m");
  ASSERT_TRUE(m600);
  EXPECT_NEAR(double(ParameterCount(*m600)), 600e6, 60e6);
  for (auto* c : {&*tiny, &*small, &*m300, &*m600}) EXPECT_EQ(ValidateModelConfig(*c), "");
  EXPECT_FALSE(PresetConfig("llama-7b"));
  Model<float> model(*tiny);
  EXPECT_EQ(int64_t(model.weights().size()), ParameterCount(*tiny));
}

TEST(Model, BadConfigsAreRejectedNamingTheField) {
  ModelConfig c;
  c.heads = 5;
  EXPECT_EQ(ValidateModelConfig(c), "model.heads: must divide model.dim (64 % 5 != 0)");
  c = ModelConfig{};
  c.dim = 0;
  EXPECT_EQ(ValidateModelConfig(c), "model.dim: must be >= 1 (0)");
  c = ModelConfig{};
  c.heads = 64;  // head_dim 1 is odd
  EXPECT_NE(ValidateModelConfig(c).find("model.heads"), std::string::npos);
  c = ModelConfig{};
  c.norm_eps = -1;
  EXPECT_NE(ValidateModelConfig(c).find("model.norm_eps"), std::string::npos);
  c = ModelConfig{};
  c.seq = -3;
  EXPECT_EQ(ValidateModelConfig(c), "model.seq: must be >= 1 (-3)");
  c.heads = 5;
  try {
    Model<float> m(c);
    FAIL() << "expected an error";
  } catch (const geofp8::Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.seq"), std::string::npos) << e.what();
  }
}

TEST(Model, RejectsBadBatches) {
  Model<float> model(Micro());
  model.Init(1);
  std::vector<int32_t> tokens = Tokens(2, 5, 11, 1);
  EXPECT_THROW(model.Loss(tokens, 2, 6), geofp8::Error);  // seq > config.seq
  EXPECT_THROW(model.Loss(tokens, 3, 5), geofp8::Error);  // wrong token count
  tokens[0] = 11;
  EXPECT_THROW(model.Loss(tokens, 2, 5), geofp8::Error);  // outside vocab
}

}  // namespace
}  // namespace geofp8::model
