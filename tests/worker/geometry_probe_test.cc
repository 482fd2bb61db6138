// The auto engine's probe judges a layer's geometry with the basis the layer deploys (the
// exchanger's active one) or, while it uses none, with what its estimator would have deployed
// (a shadow fed the averaged gradients before the probe), never with a basis fitted to the
// probed gradient. Each result is checked against an independent recomputation.
#include "worker/daemon/geometry_probe.h"

#include <gtest/gtest.h>

#include <cmath>

#include "kernels/codec/error_metrics.h"
#include "kernels/geometry/factor_sketch.h"
#include "tests/exchange/rank_threads.h"

namespace geofp8::worker {
namespace {

using geofp8::testing::JoinErrors;
using geofp8::testing::RunRanks;

constexpr int64_t kM = 48, kN = 40;

// Layer 0: a kM x kN matrix; layer 1: a kN vector. A persistent rank-2 part plus a part that
// changes every step, so bases estimated at different steps differ.
std::vector<model::ParamInfo> Params() { return {{"w", 0, kM, kN}, {"b", kM * kN, 1, kN}}; }

std::vector<float> Gradient(uint64_t step) {
  std::vector<float> g(kM * kN + kN);
  for (int64_t i = 0; i < kM; ++i) {
    for (int64_t j = 0; j < kN; ++j) {
      const double a = std::sin(0.3 * i) * std::cos(0.2 * j) * 8.0;
      const double b = std::cos(0.7 * i + 0.9 * step) * std::sin(0.5 * j + 0.3 * step) * 3.0;
      const double c = std::sin(1.7 * i * j + 2.3 * step);  // dense, unstructured
      g[i * kN + j] = static_cast<float>(a + b + 0.5 * c);
    }
  }
  for (int64_t j = 0; j < kN; ++j) g[kM * kN + j] = 0.01f * float(j);
  return g;
}

LayerPolicy Policy(GeometryMode mode) {
  LayerPolicy p;
  p.format = Format::kFp8E4M3;
  p.scaling = Scaling::kBlock;
  p.block = 32;
  p.geometry = mode;
  p.rank = 3;
  return p;
}

ProbeSettings Settings(GeometryEstimator estimator) {
  ProbeSettings s;
  s.probe_every = 10;
  s.rank = 3;
  s.estimator = estimator;
  s.sketch.beta = 0.5f;  // two time constants: 4 steps, the window
  s.sketch.width = 4;
  s.refresh_interval = 8;  // instant: lag 4
  s.seed = 11;
  return s;
}

std::vector<uint8_t> Bytes(const Geometry& g) { return SerializeGeometry(g); }

TEST(GeometryProbe, ShadowWindowIsTheStepsJustBeforeEachProbe) {
  GeometryProbe ema(Params(), Settings(GeometryEstimator::kFactorEma));
  EXPECT_EQ(ema.window(), 4);
  std::vector<int64_t> seen;
  for (int64_t s = 0; s <= 20; ++s) {
    if (ema.Observes(s)) seen.push_back(s);
  }
  EXPECT_EQ(seen, (std::vector<int64_t>{6, 7, 8, 9, 16, 17, 18, 19}));
  EXPECT_FALSE(ema.IsProbeStep(0));
  EXPECT_TRUE(ema.IsProbeStep(10));
  EXPECT_FALSE(ema.IsProbeStep(15));
  GeometryProbe instant(Params(), Settings(GeometryEstimator::kInstant));
  EXPECT_EQ(instant.lag(), 4);
  seen.clear();
  for (int64_t s = 0; s <= 20; ++s) {
    if (instant.Observes(s)) seen.push_back(s);
  }
  EXPECT_EQ(seen, (std::vector<int64_t>{6, 16}));
}

TEST(GeometryProbe, OffLayerIsJudgedWithTheEmaBasisOfTheStepsBeforeTheProbe) {
  const ProbeSettings settings = Settings(GeometryEstimator::kFactorEma);
  GeometryProbe probe(Params(), settings);
  const std::vector<LayerPolicy> off = {Policy(GeometryMode::kNone), Policy(GeometryMode::kNone)};
  // The independent replay: a sketch restarted at the window's first step and fed the same
  // gradients, with the options the probe documents (width raised to k, seed per layer).
  FactorSketch replay;
  FactorSketchOptions so = settings.sketch;
  so.seed = settings.seed ^ 0x9e3779b97f4a7c15ull;
  for (int64_t s = 0; s < 10; ++s) {
    const auto g = Gradient(s);
    if (probe.Observes(s)) {
      probe.Observe(s, g, off);
      UpdateFactorSketch(replay, std::span<const float>(g).first(kM * kN), kM, kN, 3, so);
    }
  }
  EXPECT_EQ(replay.updates, 4u);
  SketchGeometryOptions go;
  go.rank = 3;
  go.alpha = off[0].alpha;
  const Geometry expected = GeometryFromSketch(replay, go, 1);
  ASSERT_FALSE(expected.is_identity());
  EXPECT_EQ(Bytes(probe.ShadowGeometry(0, off[0])), Bytes(expected));

  // The probe at step 10 quantizes step 10's gradient, which the shadow has not seen.
  const auto errors = RunRanks(1, [&](Communicator& comm) {
    Exchanger ex(comm, {{"w", kM, kN, off[0]}, {"b", kN, 1, off[1]}}, ExchangeOptions{});
    const auto g = Gradient(10);
    const auto results = probe.Probe(g, off, ex);
    ASSERT_EQ(results.size(), 1u);  // the vector has no geometry to judge
    const LayerProbe& r = results[0];
    EXPECT_EQ(r.layer, 0u);
    EXPECT_EQ(r.basis, ProbeBasisKind::kShadow);
    const std::span<const float> w = std::span<const float>(g).first(kM * kN);
    EXPECT_EQ(r.error_without, RoundTripError(w, off[0], nullptr, nullptr));
    EXPECT_EQ(r.error_with, RoundTripError(w, off[0], &expected, nullptr));
    EXPECT_GT(r.transform_seconds, 0.0);
  });
  ASSERT_EQ(JoinErrors(errors), "");
}

TEST(GeometryProbe, OffLayerUnderInstantIsJudgedWithTheBasisOfTheLaggedGradient) {
  const ProbeSettings settings = Settings(GeometryEstimator::kInstant);
  GeometryProbe probe(Params(), settings);
  const std::vector<LayerPolicy> off = {Policy(GeometryMode::kNone), Policy(GeometryMode::kNone)};
  for (int64_t s = 0; s < 10; ++s) {
    if (probe.Observes(s)) probe.Observe(s, Gradient(s), off);
  }
  const auto g6 = Gradient(6);
  GeometryOptions go;
  go.mode = GeometryMode::kLowRank;
  go.rank = 3;
  go.alpha = off[0].alpha;
  go.power_iters = settings.power_iters;
  go.seed = settings.seed ^ 0x9e3779b97f4a7c15ull;
  const Geometry expected =
      EstimateGeometry(std::span<const float>(g6).first(kM * kN), kM, kN, go, nullptr).geometry;
  EXPECT_EQ(Bytes(probe.ShadowGeometry(0, off[0])), Bytes(expected));
}

TEST(GeometryProbe, OnLayerIsJudgedWithTheExchangersActiveGeometry) {
  const std::vector<LayerPolicy> on = {Policy(GeometryMode::kLowRank), Policy(GeometryMode::kNone)};
  ExchangeOptions eo;
  eo.estimator = GeometryEstimator::kFactorEma;
  eo.seed = 3;
  const std::vector<RefreshSchedule> every_step = {{0, 1, 0}, {0, 1, 0}};
  const auto errors = RunRanks(1, [&](Communicator& comm) {
    Exchanger ex(comm, {{"w", kM, kN, on[0]}, {"b", kN, 1, on[1]}}, eo, every_step);
    GeometryProbe probe(Params(), Settings(GeometryEstimator::kFactorEma));
    // Before the first refresh is active the layer has nothing deployed: no result.
    EXPECT_TRUE(probe.Probe(Gradient(0), on, ex).empty());
    for (uint64_t s = 0; s < 6; ++s) {
      auto g = Gradient(s);
      std::span<float> all(g);
      ex.Exchange(s, {all.first(kM * kN), all.subspan(kM * kN)});
      // A shadow is kept only for layers without geometry.
      probe.Observe(int64_t(s), g, on);
    }
    EXPECT_TRUE(probe.ShadowGeometry(0, on[0]).is_identity());
    const Geometry& deployed = ex.active_geometry(0);
    ASSERT_FALSE(deployed.is_identity());
    const auto g = Gradient(6);
    const auto results = probe.Probe(g, on, ex);
    ASSERT_EQ(results.size(), 1u);
    EXPECT_EQ(results[0].basis, ProbeBasisKind::kDeployed);
    const std::span<const float> w = std::span<const float>(g).first(kM * kN);
    EXPECT_EQ(results[0].error_with, RoundTripError(w, on[0], &deployed, nullptr));
    EXPECT_EQ(results[0].error_without, RoundTripError(w, on[0], nullptr, nullptr));
  });
  ASSERT_EQ(JoinErrors(errors), "");
}

TEST(GeometryProbe, RoundTripErrorIsTheCodecsOwnErrorWithoutGeometry) {
  const auto g = Gradient(0);
  const std::span<const float> w = std::span<const float>(g).first(kM * kN);
  const LayerPolicy p = Policy(GeometryMode::kNone);
  CodecOptions o;
  o.format = p.format;
  o.scaling = p.scaling;
  o.block = p.block;
  std::vector<float> decoded;
  const CodecReport report = AnalyzeCodec(w, o, &decoded);
  EXPECT_NEAR(RoundTripError(w, p, nullptr, nullptr), report.metrics.rel_fro_error,
              1e-12 * report.metrics.rel_fro_error + 1e-15);
  LayerPolicy fp32 = p;
  fp32.format = Format::kFp32;
  EXPECT_EQ(RoundTripError(w, fp32, nullptr, nullptr), 0.0);
}

}  // namespace
}  // namespace geofp8::worker
