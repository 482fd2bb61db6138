// Exchange policy presets and the YAML policy file: per-layer globs, 1-D layers never get a
// geometry, and every bad field is named.

#include "worker/train/exchange_policy.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "kernels/common/check.h"

namespace geofp8::train {
namespace {

namespace fs = std::filesystem;

std::vector<model::ParamInfo> Params() {
  return model::Model<float>(*model::PresetConfig("llama-tiny")).params();
}

TEST(ExchangePolicy, PresetsSetFormatsAndGeometry) {
  const auto params = Params();
  const ExchangePlan fp32 = MakeExchangePlan("fp32", params);
  EXPECT_EQ(fp32.algorithm, Algorithm::kFp32);
  EXPECT_FALSE(fp32.uses_geometry());
  EXPECT_EQ(MakeExchangePlan("bf16", params).algorithm, Algorithm::kBf16);
  const ExchangePlan fp8 = MakeExchangePlan("fp8", params);
  const ExchangePlan geo = MakeExchangePlan("geofp8", params);
  const ExchangePlan nv = MakeExchangePlan("geonvfp4", params);
  EXPECT_EQ(fp8.algorithm, Algorithm::kTwoPhase);
  EXPECT_FALSE(fp8.uses_geometry());
  EXPECT_TRUE(geo.uses_geometry());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(fp8.layers[i].format, Format::kFp8E4M3);
    EXPECT_EQ(geo.layers[i].format, Format::kFp8E4M3);
    EXPECT_EQ(nv.layers[i].format, Format::kNvfp4);
    const GeometryMode want = params[i].is_matrix() ? GeometryMode::kLowRank : GeometryMode::kNone;
    EXPECT_EQ(geo.layers[i].geometry, want) << params[i].name;
    EXPECT_EQ(nv.layers[i].geometry, want) << params[i].name;
  }
  // The geometry presets use the ema estimator, refreshed every step (every rank derives it).
  EXPECT_EQ(geo.estimator, GeometryEstimator::kFactorEma);
  EXPECT_EQ(nv.estimator, GeometryEstimator::kFactorEma);
  EXPECT_EQ(fp8.estimator, GeometryEstimator::kInstant);
  const auto schedule = MakeRefreshSchedule(geo, 4);
  ASSERT_EQ(schedule.size(), params.size());
  for (size_t i = 0; i < schedule.size(); ++i) {
    EXPECT_EQ(schedule[i].owner, int(i % 4));
    EXPECT_EQ(schedule[i].interval, 1);
    EXPECT_EQ(schedule[i].offset, 0);
  }
  EXPECT_TRUE(MakeRefreshSchedule(fp8, 4).empty());
}

class PolicyFileTest : public ::testing::Test {
 protected:
  std::string Write(const std::string& text) {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    const fs::path p = fs::temp_directory_path() /
                       ("geofp8_policy_" + std::to_string(getpid()) + "_" + info->name() + "_" +
                        std::to_string(n_++) + ".yaml");
    std::ofstream(p) << text;
    paths_.push_back(p);
    return p.string();
  }
  void TearDown() override {
    for (auto& p : paths_) fs::remove(p);
  }
  std::string ErrorOf(const std::string& text) {
    try {
      MakeExchangePlan(Write(text), Params());
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
  int n_ = 0;
  std::vector<fs::path> paths_;
};

TEST_F(PolicyFileTest, GlobsOverrideInOrderAndOneDLayersStayEuclidean) {
  const auto params = Params();
  const ExchangePlan plan = MakeExchangePlan(Write(R"(
algorithm: allgather
refresh: {interval: 7, power_iters: 2}
default: {format: fp8_e5m2, scaling: tensor}
layers:
  - {match: "layers.*", geometry: lowrank, rank: 4}
  - {match: "layers.1.mlp.*", format: nvfp4, rank: 2}
  - {match: "*norm*", format: bf16, geometry: lowrank}
)"), params);
  EXPECT_EQ(plan.algorithm, Algorithm::kAllGather);
  EXPECT_EQ(plan.refresh_interval, 7);
  EXPECT_EQ(plan.power_iters, 2);
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    const LayerPolicy& lp = plan.layers[i];
    if (p.name.find("norm") != std::string::npos) {
      EXPECT_EQ(lp.format, Format::kBf16) << p.name;
      EXPECT_EQ(lp.geometry, GeometryMode::kNone) << p.name;  // 1-D: never a geometry
    } else if (p.name.starts_with("layers.1.mlp.")) {
      EXPECT_EQ(lp.format, Format::kNvfp4);
      EXPECT_EQ(lp.rank, 2);
      EXPECT_EQ(lp.geometry, GeometryMode::kLowRank);
    } else if (p.name.starts_with("layers.")) {
      EXPECT_EQ(lp.format, Format::kFp8E5M2);
      EXPECT_EQ(lp.scaling, Scaling::kTensor);
      EXPECT_EQ(lp.rank, 4);
      EXPECT_EQ(lp.geometry, GeometryMode::kLowRank) << p.name;
    } else {
      EXPECT_EQ(lp.format, Format::kFp8E5M2) << p.name;
      EXPECT_EQ(lp.geometry, GeometryMode::kNone) << p.name;
    }
  }
}

TEST_F(PolicyFileTest, TheEmaEstimatorAndItsKnobsReachTheExchangeOptions) {
  const ExchangePlan plan = MakeExchangePlan(Write(R"(
refresh: {interval: 2, estimator: ema, beta: 0.8, width: 12, probes: 2, adapt: 0.5}
layers:
  - {match: "layers.*", geometry: lowrank, rank: 4}
)"), Params());
  EXPECT_EQ(plan.estimator, GeometryEstimator::kFactorEma);
  const ExchangeOptions eo = MakeExchangeOptions(plan);
  EXPECT_EQ(eo.estimator, GeometryEstimator::kFactorEma);
  EXPECT_FLOAT_EQ(eo.sketch.beta, 0.8f);
  EXPECT_EQ(eo.sketch.width, 12);
  EXPECT_EQ(eo.sketch.probes, 2);
  EXPECT_FLOAT_EQ(eo.adapt, 0.5f);
  EXPECT_EQ(eo.bucket_cap_bytes, plan.bucket_cap_bytes);
  EXPECT_EQ(MakeRefreshSchedule(plan, 2)[1].interval, 2);
  EXPECT_NE(ErrorOf("refresh: {estimator: shampoo}\n")
                .find("policy.refresh.estimator: unknown value 'shampoo' (accepted: instant, ema)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("refresh: {beta: 1}\n").find("policy.refresh.beta: must be in [0, 1) (1)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("refresh: {width: 0}\n").find("policy.refresh.width: must be in [1, 256] (0)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("refresh: {probes: -1}\n").find("policy.refresh.probes: must be in [0, 64]"),
            std::string::npos);
  EXPECT_NE(ErrorOf("refresh: {adapt: 9}\n").find("policy.refresh.adapt: must be in [0, 4] (9)"),
            std::string::npos);
}

TEST_F(PolicyFileTest, BadFieldsAreNamed) {
  EXPECT_NE(ErrorOf("default: {format: fp9}\n")
                .find("policy.default.format: unknown value 'fp9' (accepted: fp32, bf16"),
            std::string::npos);
  EXPECT_NE(ErrorOf("layers:\n  - {match: 'x.*', rank: 2}\n")
                .find("policy.layers[0].match: matches no layer ('x.*')"),
            std::string::npos);
  EXPECT_NE(ErrorOf("layers:\n  - {match: '*', rank: 0}\n").find("policy.layers[0].rank: must be >= 1 (0)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("layers:\n  - {rank: 3}\n").find("policy.layers[0].match: missing"),
            std::string::npos);
  EXPECT_NE(ErrorOf("algorithm: ring\n").find("policy.algorithm: unknown value 'ring'"),
            std::string::npos);
  EXPECT_NE(ErrorOf("algorithm: native\n").find("policy.algorithm"), std::string::npos);
  EXPECT_NE(ErrorOf("refresh: {interval: 0}\n").find("policy.refresh.interval: must be >= 1 (0)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("colour: red\n").find("policy.colour: unknown key"), std::string::npos);
  EXPECT_NE(ErrorOf("default: {block: many}\n").find("policy.default.block: cannot parse 'many'"),
            std::string::npos);
  EXPECT_NE(ErrorOf("default: [1, 2\n").find("YAML error at line"), std::string::npos);
  try {
    MakeExchangePlan("/nonexistent/p.yaml", Params());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("policy: cannot read file /nonexistent/p.yaml"),
              std::string::npos);
  }
  try {
    MakeExchangePlan("fp7", Params());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("accepted: fp32, bf16, fp8, geofp8, nvfp4, geonvfp4"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace geofp8::train
