// Exchange policy presets and the YAML policy file: per-layer globs, 1-D layers never get a
// geometry, and every bad field is named.

#include "platform/policy/exchange_policy.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

#include "kernels/common/check.h"
#include "platform/common/status_error.h"
#include "platform/policy/policy.h"

namespace geofp8 {
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
  EXPECT_EQ(fp8.algorithm, Algorithm::kAuto);  // allgather at 2 ranks, two_phase from 3
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
  // The geometry presets use the ema estimator, refreshed every step (every rank derives it),
  // and every preset keeps geofp8-train's 1 MiB buckets.
  EXPECT_EQ(geo.refresh.estimator, GeometryEstimator::kFactorEma);
  EXPECT_EQ(nv.refresh.estimator, GeometryEstimator::kFactorEma);
  EXPECT_EQ(fp8.bucket_cap_bytes, size_t{1} << 20);
  EXPECT_EQ(geo.bucket_cap_bytes, size_t{1} << 20);
  const auto schedule = MakeRefreshSchedule(geo, 4);
  ASSERT_EQ(schedule.size(), params.size());
  int matrix = 0;
  for (size_t i = 0; i < schedule.size(); ++i) {
    EXPECT_EQ(schedule[i].interval, 1);
    EXPECT_EQ(schedule[i].offset, 0);
    if (params[i].is_matrix()) {
      EXPECT_EQ(schedule[i].owner, matrix++ % 4) << params[i].name;
    }
  }
  EXPECT_TRUE(MakeRefreshSchedule(fp8, 4).empty());
}

class PolicyFileTest : public ::testing::Test {
 protected:
  std::string Write(const std::string& text) {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    const fs::path p =
        fs::temp_directory_path() / ("geofp8_policy_" + std::to_string(getpid()) + "_" +
                                     info->name() + "_" + std::to_string(n_++) + ".yaml");
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

// The error-feedback presets (the damage map's winning arm): two_phase, every layer's residual
// carried, no geometry; the Euclidean presets keep none.
TEST(ExchangePolicy, ErrorFeedbackPresetsCarryResidualsOnEveryLayer) {
  const auto params = Params();
  for (const auto& [name, format] :
       {std::pair{"fp8-ef", Format::kFp8E4M3}, std::pair{"nvfp4-ef", Format::kNvfp4}}) {
    const ExchangePlan plan = MakeExchangePlan(name, params);
    EXPECT_EQ(plan.algorithm, Algorithm::kTwoPhase) << name;
    EXPECT_FALSE(plan.uses_geometry()) << name;
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(plan.layers[i].format, format) << name << " " << params[i].name;
      EXPECT_TRUE(plan.layers[i].error_feedback) << name << " " << params[i].name;
    }
  }
  for (const char* name : {"fp8", "nvfp4", "geofp8", "geonvfp4"}) {
    for (const auto& l : MakeExchangePlan(name, params).layers) EXPECT_FALSE(l.error_feedback);
  }
}

// Issue #29: a user-facing error is the message alone; the source location that raised it is
// kept apart (Error::where) for debug logs. The Python hook's YAML text has no name, so its
// errors start "policy: line 1:", not "policy: policy: line 1:".
TEST_F(PolicyFileTest, ErrorsCarryNoSourceLocationAndNoDoubledPrefix) {
  try {
    MakeExchangePlanFromText("policy:\n  default: {format: fp9}\n", "", Params(), "");
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("policy: line 2: spec.policy.default.format: unknown value (fp9)", 0), 0u)
        << what;
    EXPECT_EQ(what.find(".cc:"), std::string::npos) << what;
    EXPECT_EQ(e.where().rfind("exchange_policy.cc:", 0), 0u) << e.where();
    EXPECT_GT(std::stoi(e.where().substr(e.where().find(':') + 1)), 0) << e.where();
  }
  try {
    GEOFP8_CHECK(1 + 1 == 3, "arithmetic: ", 2);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "arithmetic: 2");  // the user's message only, no condition text
    EXPECT_EQ(e.where().rfind("exchange_policy_test.cc:", 0), 0u) << e.where();
  }
  try {
    GEOFP8_CHECK(1 + 1 == 3);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "check failed: 1 + 1 == 3");  // no parts: the condition says it
  }
  const std::string file = ErrorOf("policy:\n  default: {format: fp9}\n");
  EXPECT_EQ(file.rfind("policy: /", 0), 0u) << file;  // "policy: <path>: line 2: ..."
  EXPECT_EQ(file.find(".cc:"), std::string::npos) << file;
}

// Each layer's format, geometry and rank, for comparing plans.
std::string Describe(const ExchangePlan& plan) {
  std::string out;
  for (const LayerPolicy& l : plan.layers) {
    out += std::string(FormatNameOf(l.format)) + "/" + std::string(GeometryNameOf(l.geometry)) +
           "/" + std::to_string(l.rank) + " ";
  }
  return out;
}

// geofp8.torch's set_policy names a policy by kind; each kind is the builder it names, and a
// file is read whatever its name (a preset name ending in .yaml is a path too).
TEST_F(PolicyFileTest, KindsNameAPresetAFileOrText) {
  const auto params = Params();
  const std::string text = "policy:\n  default: {format: nvfp4}\n";
  EXPECT_EQ(Describe(MakeExchangePlanOf("preset", "geofp8", params)),
            Describe(MakeExchangePlan("geofp8", params)));
  const ExchangePlan from_text = MakeExchangePlanOf("text", text, params);
  EXPECT_EQ(from_text.layers[0].format, Format::kNvfp4);
  const std::string path = Write(text) + ".txt";
  fs::rename(path.substr(0, path.size() - 4), path);
  paths_.push_back(path);
  EXPECT_EQ(Describe(MakeExchangePlanOf("file", path, params)), Describe(from_text));
  auto error = [&](const std::string& kind, const std::string& spec) {
    try {
      MakeExchangePlanOf(kind, spec, params, "gpt");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(error("url", "x"), "policy kind: unknown value 'url' (accepted: preset, file, text)");
  EXPECT_EQ(error("file", "/nonexistent/p.txt"), "policy: cannot read file /nonexistent/p.txt");
  EXPECT_EQ(error("text", "policy:\n  layers: [{match: \"nope.*\", format: fp32}]\n")
                .rfind("policy: spec.policy.layers[0].match: ", 0),
            0u);
}

// A coordinator version's plan and schedule, as the worker's rank attempt and the Python hook both
// take them: the schedules by layer name, the version's own winning, and a matrix with a geometry
// but no schedule named.
TEST(ExchangePolicy, AVersionPlanTakesItsScheduleByLayerName) {
  const auto params = Params();
  const PolicyFileSpec file =
      ValueOrThrow(ParsePolicyFile("policy:\n  default: {geometry: lowrank, rank: 2}\n"));
  v1::Policy policy = InitialPolicy("job", file.policy, 0);
  policy.set_version(3);
  std::vector<v1::RefreshSchedule> catalog;
  for (const auto& p : params) {
    if (!p.is_matrix()) continue;
    v1::RefreshSchedule& s = catalog.emplace_back();
    s.set_layer(p.name);
    s.set_interval(5);
    s.set_owner(1);
  }
  *policy.add_refresh() = catalog.front();
  policy.mutable_refresh(0)->set_interval(7);  // the version's own wins over the catalog's
  const VersionPlan v = PlanOfVersion(policy, catalog, ExchangeSpec{}, RefreshSpec{}, params);
  EXPECT_EQ(v.version, 3u);
  EXPECT_EQ(v.plan.name, "policy v3");
  EXPECT_TRUE(v.unscheduled.empty()) << v.unscheduled;
  ASSERT_EQ(v.schedule.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].is_matrix()) continue;
    EXPECT_EQ(v.schedule[i].interval, params[i].name == catalog.front().layer() ? 7 : 5);
    EXPECT_EQ(v.schedule[i].owner, 1);
  }
  // The Python hook's form: serialized, with the schedules in force.
  std::vector<std::string> refresh;
  for (const auto& s : catalog) refresh.push_back(s.SerializeAsString());
  const VersionPlan py = PlanOfCoordinatorVersion(policy.SerializeAsString(), refresh, "", params);
  EXPECT_EQ(Describe(py.plan), Describe(v.plan));
  EXPECT_EQ(py.version, 3u);
  // A matrix without a schedule: named by the plan, refused by the Python form.
  const std::string last = catalog.back().layer();
  catalog.pop_back();
  refresh.pop_back();
  policy.clear_refresh();
  EXPECT_EQ(PlanOfVersion(policy, catalog, ExchangeSpec{}, RefreshSpec{}, params).unscheduled,
            last);
  try {
    PlanOfCoordinatorVersion(policy.SerializeAsString(), refresh, "", params);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "policy v3: no geometry refresh schedule from the coordinator for layer " + last);
  }
  try {
    PlanOfCoordinatorVersion("\xff", {}, "", params);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "coordinator policy: not a v1.Policy");
  }
}

TEST_F(PolicyFileTest, GlobsOverrideInOrderAndOneDLayersStayEuclidean) {
  const auto params = Params();
  const ExchangePlan plan = MakeExchangePlan(Write(R"(
exchange: {algorithm: allgather}
geometry_refresh: {estimator: instant, interval: 7, power_iters: 2}
policy:
  default: {format: fp8_e5m2, scaling: tensor}
  layers:
    - {match: "layers.*", geometry: lowrank, rank: 4}
    - {match: "layers.1.mlp.*", format: nvfp4, rank: 2}
    - {match: "*norm*", format: bf16, geometry: lowrank}
)"),
                                             params);
  EXPECT_EQ(plan.algorithm, Algorithm::kAllGather);
  EXPECT_EQ(plan.refresh.interval, 7);
  EXPECT_EQ(plan.refresh.power_iters, 2);
  EXPECT_EQ(plan.bucket_cap_bytes, size_t(25 * 1024 * 1024));  // the job spec's default
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

TEST_F(PolicyFileTest, HadamardIsAGeometryValueComposedWithLowrankAndValidatedPerLayer) {
  const auto params = Params();
  const ExchangePlan plan = MakeExchangePlan(Write(R"(
policy:
  default: {format: fp8_e4m3, block: 128, geometry: lowrank+hadamard, rank: 4}
  layers:
    - {match: "layers.*.mlp.*", geometry: hadamard, hadamard_block: 32}
    - {match: "lm_head", format: nvfp4}
    - {match: "tok_emb", geometry: lowrank}
)"),
                                             params);
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    const LayerPolicy& lp = plan.layers[i];
    if (!p.is_matrix()) {
      EXPECT_FALSE(lp.hadamard) << p.name;  // 1-D: never transformed
      EXPECT_EQ(lp.geometry, GeometryMode::kNone) << p.name;
    } else if (p.name.find(".mlp.") != std::string::npos) {
      EXPECT_TRUE(lp.hadamard) << p.name;
      EXPECT_EQ(lp.geometry, GeometryMode::kNone) << p.name;
      EXPECT_EQ(EffectiveHadamardBlock(lp), 32u) << p.name;
    } else if (p.name == "tok_emb") {
      EXPECT_FALSE(lp.hadamard);  // a geometry value names the whole transform
      EXPECT_EQ(lp.geometry, GeometryMode::kLowRank);
    } else {
      EXPECT_TRUE(lp.hadamard) << p.name;
      EXPECT_EQ(lp.geometry, GeometryMode::kLowRank) << p.name;
      // The rotation block follows the layer's codec: nvfp4's 16, fp8's block of 128.
      EXPECT_EQ(EffectiveHadamardBlock(lp), p.name == "lm_head" ? 16u : 128u) << p.name;
    }
  }
  EXPECT_NE(
      ErrorOf("policy:\n  default: {format: nvfp4, geometry: hadamard, hadamard_block: 32}\n")
          .find("layer 'tok_emb': hadamard_block: must divide the codec's scale block 16 (32)"),
      std::string::npos)
      << ErrorOf("policy:\n  default: {format: nvfp4, geometry: hadamard, hadamard_block: 32}\n");
  EXPECT_NE(ErrorOf("policy:\n  default: {geometry: hadamard, hadamard_block: 24}\n")
                .find("line 2: spec.policy.default.hadamard_block: must be a power of two (24)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("policy:\n  layers:\n    - {match: '*', hadamard_block: 8192}\n")
                .find("spec.policy.layers[0].hadamard_block: must be in [2, 4096] (8192)"),
            std::string::npos);
  const std::string bad = ErrorOf("policy:\n  default: {geometry: hadamard+lowrank}\n");
  EXPECT_NE(bad.find("spec.policy.default.geometry: unknown value (hadamard+lowrank); accepted: "
                     "none, diag, lowrank, hadamard, diag+hadamard, lowrank+hadamard"),
            std::string::npos)
      << bad;
  EXPECT_NE(ErrorOf("policy:\n  default: {geometry: none+hadamard}\n").find("unknown value"),
            std::string::npos);
  // A block of 96 has no power-of-two default rotation block.
  EXPECT_NE(ErrorOf("policy:\n  default: {block: 96, geometry: hadamard}\n")
                .find("hadamard_block: must be a power of two in [2, 4096] (96) (the default"),
            std::string::npos);
}

TEST_F(PolicyFileTest, TheEmaEstimatorAndItsKnobsReachTheExchangeOptions) {
  const ExchangePlan plan = MakeExchangePlan(Write(R"(
geometry_refresh: {interval: 2, estimator: ema, beta: 0.8, width: 12, probes: 2, probe_every: 3, adapt: 0.5}
policy:
  layers:
    - {match: "layers.*", geometry: lowrank, rank: 4}
)"),
                                             Params());
  EXPECT_EQ(plan.refresh.estimator, GeometryEstimator::kFactorEma);
  const ExchangeOptions eo = MakeExchangeOptions(plan);
  EXPECT_EQ(eo.estimator, GeometryEstimator::kFactorEma);
  EXPECT_FLOAT_EQ(eo.sketch.beta, 0.8f);
  EXPECT_EQ(eo.sketch.width, 12);
  EXPECT_EQ(eo.sketch.probes, 2);
  EXPECT_EQ(eo.sketch.probe_every, 3);
  EXPECT_FLOAT_EQ(eo.adapt, 0.5f);
  EXPECT_EQ(eo.bucket_cap_bytes, plan.bucket_cap_bytes);
  EXPECT_EQ(MakeRefreshSchedule(plan, 2)[1].interval, 2);
  EXPECT_NE(ErrorOf("geometry_refresh: {estimator: shampoo}\n")
                .find("spec.geometry_refresh.estimator: unknown value (shampoo); accepted: "
                      "instant, ema"),
            std::string::npos);
  EXPECT_NE(ErrorOf("geometry_refresh: {beta: 1}\n")
                .find("spec.geometry_refresh.beta: must be in [0, 0.999] (1)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("geometry_refresh: {width: 0}\n")
                .find("spec.geometry_refresh.width: must be in [1, 256] (0)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("geometry_refresh: {probes: -1}\n")
                .find("spec.geometry_refresh.probes: must be in [0, 64]"),
            std::string::npos);
  EXPECT_NE(ErrorOf("geometry_refresh: {adapt: 9}\n")
                .find("spec.geometry_refresh.adapt: must be in [0, 4] (9)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("geometry_refresh: {sigma_ema: 0.5}\n")
                .find("spec.geometry_refresh.sigma_ema: applies to estimator instant only"),
            std::string::npos);
}

TEST_F(PolicyFileTest, BadFieldsAreNamedWithTheFileAndLine) {
  const std::string fp9 = ErrorOf("policy:\n  default: {format: fp9}\n");
  EXPECT_NE(fp9.find(".yaml: line 2: spec.policy.default.format: unknown value (fp9); accepted: "
                     "fp32, bf16"),
            std::string::npos)
      << fp9;
  EXPECT_NE(ErrorOf("policy:\n  layers:\n    - {match: 'x.*', rank: 2}\n")
                .find("spec.policy.layers[0].match: matches no layer of the model (x.*)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("policy:\n  layers:\n    - {match: '*', rank: 0}\n")
                .find("spec.policy.layers[0].rank: must be in [1, 4096] (0)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("policy:\n  layers:\n    - {rank: 3}\n")
                .find("spec.policy.layers[0].match: required"),
            std::string::npos);
  EXPECT_NE(ErrorOf("exchange: {algorithm: ring}\n")
                .find("spec.exchange.algorithm: unknown value (ring)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("exchange: {algorithm: native}\n").find("spec.exchange.algorithm: native"),
            std::string::npos);
  EXPECT_NE(ErrorOf("geometry_refresh: {interval: 0}\n")
                .find("spec.geometry_refresh.interval: must be in [1, 1000000] (0)"),
            std::string::npos);
  // Only the three sections a job spec shares with a policy file.
  EXPECT_NE(ErrorOf("model: {preset: llama-tiny}\n")
                .find("spec.model: unknown field (accepted: "
                      "exchange, policy, geometry_refresh)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("policy:\n  default: {block: many}\n")
                .find("spec.policy.default.block: expected a decimal integer (many)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("policy: {default: [1, 2\n").find("malformed YAML"), std::string::npos);
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
    EXPECT_NE(std::string(e.what()).find(
                  "accepted: fp32, bf16, fp8, geofp8, nvfp4, geonvfp4, fp8-ef, nvfp4-ef"),
              std::string::npos);
  }
}

// The geofp8 preset with its sketch fed every other step (examples/policies/ema-every2.yaml,
// docs/benchmarks.md): the stagger must spread the sketch updates so that every step pays the
// same cost, not all of them on even steps. On llama-small's 30 matrices (offset floor(2 i / 30)
// puts tok_emb and blocks 0-1 on one step, blocks 2-3 and lm_head on the other) each step feeds
// 15 matrices with the same shapes, hence the same element count; unstaggered, every matrix
// would be fed on even steps and none on odd ones.
TEST_F(PolicyFileTest, AnEveryOtherStepSketchSpreadsItsCostEvenlyOverTheSteps) {
  const std::string text = R"(exchange: {bucket_mb: 1}
policy:
  default: {format: fp8_e4m3, scaling: block, block: 128}
  layers:
    - {match: "*", geometry: lowrank, rank: 8}
geometry_refresh: {interval: 2, estimator: ema}
)";
  const auto params = model::Model<float>(*model::PresetConfig("llama-small")).params();
  const ExchangePlan plan = MakeExchangePlan(Write(text), params);
  const auto schedule = MakeRefreshSchedule(plan, 4);
  ASSERT_EQ(schedule.size(), params.size());
  int64_t fed[2] = {0, 0}, elements[2] = {0, 0};
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].is_matrix()) continue;
    ASSERT_EQ(schedule[i].interval, 2) << params[i].name;
    for (int step = 0; step < 2; ++step) {
      if ((step + 2 - schedule[i].offset) % 2 != 0) continue;
      ++fed[step];
      elements[step] += params[i].rows * params[i].cols;
    }
  }
  EXPECT_EQ(fed[0] + fed[1], 30);
  EXPECT_EQ(fed[0], fed[1]);
  EXPECT_EQ(elements[0], elements[1]);
}

// Issue 14: the same policy sections given to geofp8-train as a file and submitted in a job spec
// resolve to the same per-layer policies and refresh schedules. The job side runs what the
// daemons run: ParseJobSpec and InitialPolicy (coordinator), ResolveLayers (worker), rank 0's
// catalog and ComputeSchedules (coordinator), then the schedule by layer name as the worker maps
// it onto its parameters.
// Every policy file under examples/policies/ (the trajectory study's and the hook's alternatives
// to the presets, docs/benchmarks.md) resolves on llama-small, and the two that feed the sketch
// every 2nd and 4th step keep the shipped memory in steps: beta per update = 0.9^interval.
TEST(ExamplePolicies, EveryFileResolvesAndTheSparseSketchesKeepTheMemoryInSteps) {
  const std::filesystem::path dir = std::filesystem::path(GEOFP8_EXAMPLES_DIR) / "policies";
  const auto params = model::Model<float>(*model::PresetConfig("llama-small")).params();
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".yaml") continue;
    ++files;
    EXPECT_NO_THROW(MakeExchangePlan(entry.path().string(), params)) << entry.path();
  }
  EXPECT_GE(files, 10);
  for (const auto& [name, interval] :
       {std::pair<std::string, int>{"ema-every2-beta81.yaml", 2}, {"ema-every4-beta66.yaml", 4}}) {
    const ExchangePlan plan = MakeExchangePlan((dir / name).string(), params);
    const ExchangeOptions eo = MakeExchangeOptions(plan);
    EXPECT_EQ(eo.estimator, GeometryEstimator::kFactorEma) << name;
    EXPECT_NEAR(eo.sketch.beta, std::pow(0.9, interval), 1e-6) << name;
    const auto schedule = MakeRefreshSchedule(plan, 2);
    ASSERT_EQ(schedule.size(), params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].is_matrix()) {
        EXPECT_EQ(schedule[i].interval, interval) << params[i].name;
      }
    }
  }
}

TEST_F(PolicyFileTest, AFileAndAJobSpecWithTheSameSectionsResolveIdentically) {
  const std::string sections = R"(exchange: {algorithm: two_phase, bucket_mb: 2}
policy:
  default: {format: fp8_e4m3, scaling: block, block: 64}
  layers:
    - {match: "layers.*", geometry: lowrank, rank: 4}
    - {match: "layers.1.attn.*", format: nvfp4, refresh_interval: 5}
    - {match: "lm_head", geometry: diag}
geometry_refresh: {estimator: instant, interval: 12, power_iters: 2}
)";
  const auto params = Params();
  const int world = 3;
  const ExchangePlan plan = MakeExchangePlan(Write(sections), params);
  const std::vector<RefreshSchedule> train_schedule = MakeRefreshSchedule(plan, world);

  const std::string spec_yaml =
      "name: same\nworld_size: 3\nmodel: {preset: llama-tiny}\n" + sections;
  absl::StatusOr<JobSpec> spec = ParseJobSpec(spec_yaml);
  ASSERT_TRUE(spec.ok()) << spec.status();
  const v1::Policy policy = InitialPolicy("job", *spec, 0);
  absl::StatusOr<std::vector<LayerPolicy>> job_layers = ResolveLayers(policy, params);
  ASSERT_TRUE(job_layers.ok()) << job_layers.status();
  std::vector<v1::LayerInfo> catalog;
  for (const auto& p : params) {  // as JobRunner sends it
    v1::LayerInfo li;
    li.set_name(p.name);
    li.set_rows(p.exchange_rows());
    li.set_cols(p.exchange_cols());
    catalog.push_back(li);
  }
  const auto job_schedule = ComputeSchedules(catalog, policy, world, spec->geometry_refresh);

  EXPECT_EQ(plan.algorithm, spec->exchange.algorithm);
  EXPECT_EQ(plan.bucket_cap_bytes, size_t(2 * 1024 * 1024));
  const ExchangeOptions eo = MakeExchangeOptions(plan);
  EXPECT_EQ(eo.estimator, spec->geometry_refresh.estimator);
  EXPECT_EQ(eo.power_iters, spec->geometry_refresh.power_iters);
  ASSERT_EQ(plan.layers.size(), job_layers->size());
  int with_geometry = 0, patched = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const LayerPolicy& a = plan.layers[i];
    const LayerPolicy& b = (*job_layers)[i];
    EXPECT_TRUE(a.format == b.format && a.scaling == b.scaling && a.block == b.block &&
                a.rounding == b.rounding && a.geometry == b.geometry && a.rank == b.rank &&
                a.alpha == b.alpha && a.error_feedback == b.error_feedback)
        << params[i].name;
    with_geometry += a.geometry != GeometryMode::kNone;
  }
  EXPECT_GT(with_geometry, 4);
  ASSERT_EQ(train_schedule.size(), params.size());
  size_t matched = 0;
  for (const v1::RefreshSchedule& s : job_schedule) {
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].name != s.layer()) continue;
      ++matched;
      EXPECT_EQ(train_schedule[i].owner, s.owner()) << s.layer();
      EXPECT_EQ(train_schedule[i].interval, s.interval()) << s.layer();
      EXPECT_EQ(train_schedule[i].offset, s.offset()) << s.layer();
      patched += s.interval() == 5;
    }
  }
  EXPECT_EQ(matched, job_schedule.size());
  EXPECT_GT(matched, 8u);
  EXPECT_EQ(patched, 4);  // layers.1.attn.{wq,wk,wv,wo}
}

}  // namespace
}  // namespace geofp8

namespace geofp8 {
namespace {

// The presets an error lists are the ones that resolve, each once.
TEST(PolicyPresets, AcceptedListNamesEachResolvablePresetOnce) {
  std::set<std::string> seen;
  const std::string list(AcceptedPolicyPresets());
  size_t start = 0;
  while (start < list.size()) {
    const size_t end = std::min(list.find(", ", start), list.size());
    const std::string name = list.substr(start, end - start);
    EXPECT_TRUE(seen.insert(name).second) << name << " listed twice in: " << list;
    EXPECT_TRUE(PresetPolicyFile(name).has_value()) << name << " does not resolve";
    start = end + 2;
  }
  EXPECT_EQ(seen.size(), 8u) << list;
}

}  // namespace
}  // namespace geofp8
