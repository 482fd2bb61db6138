// Geometry inside the exchange: the owner rank refreshes a layer's basis from the averaged
// gradient on its schedule, every rank activates it at the announced step, and the exchanged
// result equals the reference (Apply, two_phase quantization, Invert) bit for bit on every rank.
#include <gtest/gtest.h>

#include <cmath>

#include "tests/exchange/exchange_harness.h"

namespace geofp8 {
namespace {

using namespace geofp8::testing;

// A gradient with a few dominant directions, different on every rank and step.
std::vector<float> LowRankish(int rank, uint64_t step, int64_t m, int64_t n) {
  std::vector<float> g(m * n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double a = std::sin(0.3 * i + 0.1 * step) * std::cos(0.2 * j) * 8.0;
      const double b = std::cos(0.7 * i) * std::sin(0.5 * j + rank) * 2.0;
      g[i * n + j] = static_cast<float>(a + b + 0.05 * InputValue(rank, 0, i * n + j, step));
    }
  }
  return g;
}

class GeometryAlgorithms : public ::testing::TestWithParam<Algorithm> {};

TEST_P(GeometryAlgorithms, OwnerRefreshActivatesEverywhereAndMatchesReference) {
  const int N = 3;
  const int64_t m = 64, n = 48;
  LayerPolicy lowrank;
  lowrank.geometry = GeometryMode::kLowRank;
  lowrank.rank = 4;
  LayerPolicy bias_policy = lowrank;  // 1-D: geometry must be ignored
  const std::vector<LayerSpec> layers = {{"w", m, n, lowrank}, {"b", 48, 1, bias_policy}};
  const std::vector<RefreshSchedule> schedule = {{1, 2, 0}, {0, 1, 0}};
  ExchangeOptions options;
  options.seed = 99;
  options.algorithm = GetParam();

  std::vector<std::vector<StepResult>> results(N);
  std::vector<std::vector<std::vector<uint8_t>>> active(N);  // [rank][step] serialized geometry
  std::vector<std::vector<std::vector<float>>> outputs(N);   // [rank][step] layer w
  const int steps = 4;
  const auto errors = RunRanks(N, [&](Communicator& comm) {
    const int r = comm.rank();
    Exchanger ex(comm, layers, options, schedule);
    for (int s = 0; s < steps; ++s) {
      auto w = LowRankish(r, s, m, n);
      std::vector<float> b(48, 0.5f * r);
      results[r].push_back(ex.Exchange(s, {std::span<float>(w), std::span<float>(b)}));
      active[r].push_back(SerializeGeometry(ex.active_geometry(0)));
      outputs[r].push_back(w);
      EXPECT_EQ(ex.active_geometry(1).version, 0u);  // 1-D layer never gets a geometry
    }
  });
  ASSERT_EQ(JoinErrors(errors), "");

  for (int s = 0; s < steps; ++s) {
    // Refreshes at steps 0 and 2 (interval 2), each active from the next step, on every rank.
    for (int r = 0; r < N; ++r) {
      const auto& refreshes = results[r][s].refreshes;
      if (s % 2 == 0) {
        ASSERT_EQ(refreshes.size(), 1u) << "rank " << r << " step " << s;
        EXPECT_EQ(refreshes[0].layer, 0u);
        EXPECT_EQ(refreshes[0].version, static_cast<uint64_t>(s / 2 + 1));
        EXPECT_EQ(refreshes[0].active_from, static_cast<uint64_t>(s + 1));
        EXPECT_EQ(refreshes[0].drift, results[0][s].refreshes[0].drift);  // owner's, broadcast
        if (s > 0) {
          EXPECT_GE(refreshes[0].drift, 0.0);
          EXPECT_LE(refreshes[0].drift, 1.0);
        }
      } else {
        EXPECT_TRUE(refreshes.empty());
      }
      EXPECT_EQ(active[r][s], active[0][s]) << "rank " << r << " step " << s;
      ASSERT_TRUE(SameBytes(outputs[r][s], outputs[0][s])) << "rank " << r << " step " << s;
    }
    const Geometry g = DeserializeGeometry(active[0][s]);
    EXPECT_EQ(g.version, static_cast<uint64_t>(s == 0 ? 0 : (s + 1) / 2)) << "step " << s;

    // Reference: divide by N, Apply, two_phase quantization math, Invert.
    std::vector<std::vector<float>> transformed(N);
    std::vector<double> exact(m * n, 0.0);
    for (int r = 0; r < N; ++r) {
      transformed[r] = LowRankish(r, s, m, n);
      for (size_t i = 0; i < exact.size(); ++i) {
        exact[i] += static_cast<double>(transformed[r][i]) / N;
        transformed[r][i] /= static_cast<float>(N);
      }
      ApplyGeometry(g, transformed[r]);
    }
    auto ref = options.algorithm == Algorithm::kTwoPhase
                   ? ReferenceTwoPhase(transformed, lowrank, options.seed, s, 0)
                   : ReferenceAllGather(transformed, lowrank, options.seed, s, 0);
    InvertGeometry(g, ref);
    ASSERT_TRUE(SameBytes(outputs[0][s], ref))
        << "step " << s << " first difference at " << FirstBitDifference(outputs[0][s], ref);
    double err = 0, norm = 0;
    for (size_t i = 0; i < exact.size(); ++i) {
      err += (outputs[0][s][i] - exact[i]) * (outputs[0][s][i] - exact[i]);
      norm += exact[i] * exact[i];
    }
    EXPECT_LT(std::sqrt(err / norm), 0.1) << "step " << s;
  }
}

INSTANTIATE_TEST_SUITE_P(ExchangeGeometry, GeometryAlgorithms,
                         ::testing::Values(Algorithm::kTwoPhase, Algorithm::kAllGather));

TEST(ExchangeGeometry, GeometryVersionIsPartOfTheFingerprint) {
  // Rank 1 refreshes on a different schedule, so at step 1 its active version differs.
  const int64_t m = 32, n = 16;
  LayerPolicy lowrank;
  lowrank.geometry = GeometryMode::kLowRank;
  lowrank.rank = 2;
  const std::vector<LayerSpec> layers = {{"w", m, n, lowrank}};
  std::vector<std::string> step1_errors(2);
  const auto errors = RunRanks(2, [&](Communicator& comm) {
    // Both ranks agree on the owner (0) and on step 0's refresh; only rank 1 believes the
    // geometry activates later (activation_delay 2), so at step 1 the versions differ.
    ExchangeOptions options;
    options.activation_delay = comm.rank() == 1 ? 2 : 1;
    Exchanger ex(comm, layers, options, {{0, 10, 0}});
    for (int s = 0; s < 2; ++s) {
      auto w = LowRankish(comm.rank(), s, m, n);
      try {
        ex.Exchange(s, {std::span<float>(w)});
      } catch (const Error& e) {
        step1_errors[comm.rank()] = std::to_string(s) + ": " + e.what();
        return;
      }
    }
  });
  ASSERT_EQ(JoinErrors(errors), "");
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(step1_errors[r].find("1: "), std::string::npos) << step1_errors[r];
    EXPECT_NE(step1_errors[r].find("layer 0 'w' has geometry version"), std::string::npos)
        << step1_errors[r];
  }
}

}  // namespace
}  // namespace geofp8
