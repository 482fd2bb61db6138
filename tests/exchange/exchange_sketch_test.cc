// The ema geometry estimator inside the exchange: every rank folds the exchanged average into its
// own Kronecker-factor sketch and derives the same transform bit for bit, with no broadcast; the
// state survives export/import exactly; a rank that derived differently is named by the
// fingerprint instead of being used.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "kernels/geometry/factor_sketch.h"
#include "kernels/geometry/factors.h"
#include "tests/exchange/exchange_harness.h"

namespace geofp8 {
namespace {

using namespace geofp8::testing;

// A persistent rank-2 part (which the sketch should find) plus a per-rank, per-step part.
std::vector<float> Persistent(int rank, uint64_t step, int64_t m, int64_t n) {
  std::vector<float> g(m * n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double a = std::sin(0.3 * i) * std::cos(0.2 * j) * 8.0;
      const double b = std::cos(0.7 * i + 0.05 * step) * std::sin(0.5 * j) * 3.0;
      g[i * n + j] = static_cast<float>(a + b + 0.3 * InputValue(rank, 0, i * n + j, step));
    }
  }
  return g;
}

struct EmaCase {
  std::vector<LayerSpec> layers;
  std::vector<RefreshSchedule> schedule;
  ExchangeOptions options;
};

EmaCase EmaSetup(int64_t m, int64_t n) {
  EmaCase s;
  LayerPolicy lowrank;
  lowrank.geometry = GeometryMode::kLowRank;
  lowrank.rank = 3;
  s.layers = {{"w", m, n, lowrank}, {"b", n, 1, lowrank}};
  s.schedule = {{0, 1, 0}, {0, 1, 0}};  // every step; owner unused by ema
  s.options.seed = 5;
  s.options.estimator = GeometryEstimator::kFactorEma;
  s.options.sketch.width = 6;
  s.options.sketch.beta = 0.8f;
  return s;
}

// Every rank's exchanged layer w, active geometry and step results over `steps` steps of a run
// with `setup`, with a checked 1-D layer beside it. Indexed [rank][step].
struct EmaRun {
  std::vector<std::vector<std::vector<uint8_t>>> active;
  std::vector<std::vector<std::vector<float>>> outputs;
  std::vector<std::vector<StepResult>> results;
};

EmaRun RunEma(int N, const EmaCase& setup, int64_t m, int64_t n, int steps) {
  EmaRun run;
  run.active.resize(N);
  run.outputs.resize(N);
  run.results.resize(N);
  const auto errors = RunRanks(N, [&](Communicator& comm) {
    const int r = comm.rank();
    Exchanger ex(comm, setup.layers, setup.options, setup.schedule);
    for (int s = 0; s < steps; ++s) {
      auto w = Persistent(r, s, m, n);
      std::vector<float> b(n, 0.5f * r);
      run.results[r].push_back(ex.Exchange(s, {std::span<float>(w), std::span<float>(b)}));
      run.active[r].push_back(SerializeGeometry(ex.active_geometry(0)));
      run.outputs[r].push_back(w);
      EXPECT_TRUE(ex.active_geometry(1).is_identity());  // 1-D layer keeps no sketch
    }
  });
  EXPECT_EQ(JoinErrors(errors), "");
  return run;
}

// The sketch options the exchanger derives for layer 0 (width raised to k, which EmaSetup's
// width already is at least; the seed from the run seed and the layer index).
FactorSketchOptions ReplayOptions(const EmaCase& setup) {
  FactorSketchOptions so = setup.options.sketch;
  so.seed = setup.options.seed ^ 0x5851f42d4c957f2dull;
  return so;
}

TEST(ExchangeSketch, EveryRankDerivesTheSameGeometryFromTheExchangedAverage) {
  const int N = 3;
  const int64_t m = 48, n = 40;
  const EmaCase setup = EmaSetup(m, n);
  const int steps = 5;
  const EmaRun run = RunEma(N, setup, m, n, steps);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const auto& active = run.active;
  const auto& outputs = run.outputs;
  const auto& results = run.results;
  // The independent replay: a sketch fed rank 0's exchanged averages, step by step, with the
  // options the exchanger derives.
  FactorSketch replay;
  const FactorSketchOptions so = ReplayOptions(setup);
  SketchGeometryOptions go;
  go.rank = 3;
  for (int s = 0; s < steps; ++s) {
    for (int r = 1; r < N; ++r) {
      EXPECT_EQ(active[r][s], active[0][s]) << "rank " << r << " step " << s;
      EXPECT_TRUE(SameBytes(outputs[r][s], outputs[0][s])) << "rank " << r << " step " << s;
    }
    // Refreshed after every step's exchange, no broadcast: one record per step for layer w.
    ASSERT_EQ(results[0][s].refreshes.size(), 1u) << "step " << s;
    EXPECT_EQ(results[0][s].refreshes[0].version, uint64_t(s) + 1);
    EXPECT_EQ(results[0][s].refreshes[0].active_from, uint64_t(s) + 1);
    // The geometry in force at step s was derived from the averages of steps 0 .. s-1.
    if (s == 0) {
      EXPECT_TRUE(DeserializeGeometry(active[0][0]).is_identity());
    } else {
      const Geometry expect = GeometryFromSketch(replay, go, uint64_t(s));
      EXPECT_EQ(active[0][s], SerializeGeometry(expect)) << "step " << s;
    }
    UpdateFactorSketch(replay, outputs[0][s], m, n, 3, so);
  }
  // It is a real transform: the dominant direction is whitened.
  const Geometry last = DeserializeGeometry(active[0][steps - 1]);
  EXPECT_LT(geometry::WhitenFactors(last, true)[0], 0.5f);
}

// With the sketch as wide as k (the default), the geometry in force is exactly the basis the
// sketch holds, so every refresh after the first takes G V, U^T G and ||G||^2 from the step's
// inverse transform instead of reading the average for them: on every rank, for both algorithms,
// with every rank still deriving the same bits, and close to a replay that reads every average.
TEST(ExchangeSketch, RefreshesTakeTheirProjectionsFromTheInverse) {
  for (const Algorithm algorithm : {Algorithm::kTwoPhase, Algorithm::kAllGather}) {
    const int N = 3;
    const int64_t m = 48, n = 40;
    EmaCase setup = EmaSetup(m, n);
    setup.options.sketch.width = 3;  // = k
    setup.options.algorithm = algorithm;
    const int steps = 5;
    const EmaRun run = RunEma(N, setup, m, n, steps);
    ASSERT_FALSE(::testing::Test::HasFailure());
    const auto& active = run.active;
    const auto& outputs = run.outputs;
    const auto& results = run.results;
    FactorSketch replay;
    const FactorSketchOptions so = ReplayOptions(setup);
    SketchGeometryOptions go;
    go.rank = 3;
    for (int s = 0; s < steps; ++s) {
      for (int r = 0; r < N; ++r) {
        ASSERT_EQ(results[r][s].refreshes.size(), 1u);
        // Step 0 runs under the identity: there is no inverse to learn from.
        EXPECT_EQ(results[r][s].refreshes[0].from_inverse, s > 0)
            << AlgorithmName(algorithm) << " rank " << r << " step " << s;
        EXPECT_EQ(active[r][s], active[0][s]) << "rank " << r << " step " << s;
      }
      if (s > 0) {
        const Geometry got = DeserializeGeometry(active[0][s]);
        const Geometry want = GeometryFromSketch(replay, go, uint64_t(s));
        // Each update's inputs differ by (m + n + 2k) eps amp ||G|| (the inverse can enlarge
        // round-off by amp = 1 / (min f_L min f_R)), moved into the basis over relative
        // eigengaps >= 1/3 here, and the EMA carries at most s updates' worth of it.
        const std::vector<float> fl = geometry::WhitenFactors(got, true);
        const std::vector<float> fr = geometry::WhitenFactors(got, false);
        const double amp = 1.0 / (*std::min_element(fl.begin(), fl.end()) *
                                  *std::min_element(fr.begin(), fr.end()));
        const double tol = 3.0 * s * double(m + n + 6) * 6e-8 * amp;
        EXPECT_LT(SubspaceDrift(got, want), tol) << AlgorithmName(algorithm) << " step " << s;
        for (int i = 0; i < 3; ++i)
          EXPECT_NEAR(got.sigma[i], want.sigma[i], tol * want.sigma[0]) << "step " << s;
      }
      UpdateFactorSketch(replay, outputs[0][s], m, n, 3, so);
    }
  }
}

// Drift is a measurement only: without it every rank's geometry and output are the same bits,
// and each record's drift is 0 where it was otherwise positive from the second refresh on.
TEST(ExchangeSketch, DriftOffChangesOnlyTheDrift) {
  const int N = 2;
  const int64_t m = 48, n = 40;
  const EmaCase with = EmaSetup(m, n);
  EmaCase without = with;
  without.options.measure_drift = false;
  const int steps = 4;
  const EmaRun a = RunEma(N, with, m, n, steps), b = RunEma(N, without, m, n, steps);
  ASSERT_FALSE(::testing::Test::HasFailure());
  for (int r = 0; r < N; ++r)
    for (int s = 0; s < steps; ++s) {
      EXPECT_EQ(b.active[r][s], a.active[r][s]) << "rank " << r << " step " << s;
      EXPECT_TRUE(SameBytes(b.outputs[r][s], a.outputs[r][s])) << "rank " << r << " step " << s;
      ASSERT_EQ(a.results[r][s].refreshes.size(), 1u);
      ASSERT_EQ(b.results[r][s].refreshes.size(), 1u);
      if (s > 0) EXPECT_GT(a.results[r][s].refreshes[0].drift, 0.0) << "step " << s;
      EXPECT_EQ(b.results[r][s].refreshes[0].drift, 0.0) << "step " << s;
      EXPECT_EQ(b.results[r][s].refreshes[0].version, a.results[r][s].refreshes[0].version);
    }
}

// defer_refreshes: the refreshes of a step run later (explicitly after odd steps, at the start
// of the next exchange after even ones) from a copy of the average, and the inverse's products
// follow the copy, so every step's geometry and output are the bits of the immediate run, on
// every rank, with the same records where they are returned.
TEST(ExchangeSketch, DeferredRefreshesGiveTheSameBits) {
  const int N = 3;
  const int64_t m = 48, n = 40;
  EmaCase setup = EmaSetup(m, n);
  setup.options.sketch.width = 3;  // = k: refreshes take the inverse's products
  const int steps = 6;
  const EmaRun now = RunEma(N, setup, m, n, steps);
  EmaRun later;
  later.active.resize(N);
  later.outputs.resize(N);
  later.results.resize(N);
  std::vector<std::string> export_errors(N);
  const EmaCase& deferred = setup;
  const auto errors = RunRanks(N, [&](Communicator& comm) {
    const int r = comm.rank();
    Exchanger ex(comm, deferred.layers, deferred.options, deferred.schedule);
    for (int s = 0; s < steps; ++s) {
      auto w = Persistent(r, s, m, n);
      std::vector<float> b(n, 0.5f * r);
      StepResult res =
          ex.Exchange(s, {std::span<float>(w), std::span<float>(b)}, Refreshes::kDeferred);
      EXPECT_TRUE(res.refreshes.empty()) << "step " << s;
      EXPECT_TRUE(ex.has_pending_refreshes()) << "step " << s;
      if (s == 2) {
        try {
          ex.ExportGeometry();
        } catch (const Error& e) {
          export_errors[r] = e.what();
        }
      }
      if (s % 2 == 1) res.refreshes = ex.RunPendingRefreshes();
      later.results[r].push_back(res);
      later.active[r].push_back(SerializeGeometry(ex.active_geometry(0)));
      later.outputs[r].push_back(w);
    }
  });
  ASSERT_EQ(JoinErrors(errors), "");
  for (int r = 0; r < N; ++r) {
    EXPECT_NE(export_errors[r].find("the refreshes of step 2 are deferred"), std::string::npos)
        << export_errors[r];
    for (int s = 0; s < steps; ++s) {
      EXPECT_EQ(later.active[r][s], now.active[r][s]) << "rank " << r << " step " << s;
      EXPECT_TRUE(SameBytes(later.outputs[r][s], now.outputs[r][s]))
          << "rank " << r << " step " << s;
      if (s % 2 == 0) continue;
      ASSERT_EQ(later.results[r][s].refreshes.size(), 1u) << "rank " << r << " step " << s;
      const RefreshRecord& a = now.results[r][s].refreshes[0];
      const RefreshRecord& d = later.results[r][s].refreshes[0];
      EXPECT_EQ(d.version, a.version);
      EXPECT_EQ(d.active_from, a.active_from);
      EXPECT_EQ(d.drift, a.drift);
      EXPECT_TRUE(d.from_inverse) << "rank " << r << " step " << s;
    }
  }
  // The instant estimator's owner broadcasts: it cannot defer.
  EmaCase instant = deferred;
  instant.options.estimator = GeometryEstimator::kInstant;
  const auto refused = RunRanks(1, [&](Communicator& comm) {
    Exchanger ex(comm, instant.layers, instant.options, instant.schedule);
    auto w = Persistent(0, 0, m, n);
    std::vector<float> b(n, 0.f);
    ex.Exchange(0, {std::span<float>(w), std::span<float>(b)}, Refreshes::kDeferred);
  });
  EXPECT_NE(refused[0].find("deferred refreshes need estimator ema"), std::string::npos)
      << refused[0];
}

TEST(ExchangeSketch, ExportImportContinuesExactly) {
  const int N = 2;
  const int64_t m = 40, n = 24;
  const EmaCase setup = EmaSetup(m, n);
  const int cut = 3, steps = 6;
  std::vector<std::vector<std::vector<float>>> straight(N), resumed(N), cold(N);
  std::vector<std::vector<LayerGeometryState>> saved(N);
  const auto errors = RunRanks(N, [&](Communicator& comm) {
    const int r = comm.rank();
    auto run = [&](Exchanger& ex, int from, int to, std::vector<std::vector<float>>& out) {
      for (int s = from; s < to; ++s) {
        auto w = Persistent(r, s, m, n);
        std::vector<float> b(n, 0.25f * (r + s));
        ex.Exchange(s, {std::span<float>(w), std::span<float>(b)});
        out.push_back(w);
      }
    };
    {
      Exchanger ex(comm, setup.layers, setup.options, setup.schedule);
      run(ex, 0, steps, straight[r]);
    }
    {
      Exchanger ex(comm, setup.layers, setup.options, setup.schedule);
      std::vector<std::vector<float>> unused;
      run(ex, 0, cut, unused);
      saved[r] = ex.ExportGeometry();
    }
    {
      Exchanger ex(comm, setup.layers, setup.options, setup.schedule);
      EXPECT_TRUE(ex.ImportGeometry(saved[r]).empty());
      run(ex, cut, steps, resumed[r]);
    }
    {  // the control: geometry without the sketch diverges from the straight run
      Exchanger ex(comm, setup.layers, setup.options, setup.schedule);
      std::vector<LayerGeometryState> partial = saved[r];
      for (auto& l : partial) l.sketch.clear();
      EXPECT_TRUE(ex.ImportGeometry(partial).empty());
      run(ex, cut, steps, cold[r]);
    }
  });
  ASSERT_EQ(JoinErrors(errors), "");
  for (int r = 0; r < N; ++r) {
    ASSERT_FALSE(saved[r][0].sketch.empty());
    EXPECT_TRUE(saved[r][1].sketch.empty());  // 1-D layer
    EXPECT_EQ(saved[r][0].sketch, saved[0][0].sketch) << "rank " << r;
    for (int s = 0; s < steps - cut; ++s) {
      EXPECT_TRUE(SameBytes(resumed[r][s], straight[r][cut + s]))
          << "rank " << r << " step " << cut + s << " first difference at "
          << FirstBitDifference(resumed[r][s], straight[r][cut + s]);
    }
    EXPECT_FALSE(SameBytes(cold[r][1], straight[r][cut + 1])) << "rank " << r;
  }
}

TEST(ExchangeSketch, ARankWithADifferentSketchIsNamedNotUsed) {
  const int N = 3;
  const int64_t m = 32, n = 24;
  const EmaCase setup = EmaSetup(m, n);
  std::vector<std::string> messages(N);
  const auto errors = RunRanks(N, [&](Communicator& comm) {
    const int r = comm.rank();
    Exchanger ex(comm, setup.layers, setup.options, setup.schedule);
    for (int s = 0; s < 2; ++s) {
      auto w = Persistent(r, s, m, n);
      std::vector<float> b(n, 1.f);
      ex.Exchange(s, {std::span<float>(w), std::span<float>(b)});
    }
    std::vector<LayerGeometryState> state = ex.ExportGeometry();
    if (r == 2) {  // one rank's pending geometry (same version) differs in one value
      Geometry g = DeserializeGeometry(state[0].pending);
      g.sigma_right[0] *= 1.001f;
      state[0].pending = SerializeGeometry(g);
    }
    ASSERT_TRUE(ex.ImportGeometry(state).empty());
    auto w = Persistent(r, 2, m, n);
    std::vector<float> b(n, 1.f);
    try {
      ex.Exchange(2, {std::span<float>(w), std::span<float>(b)});
    } catch (const std::exception& e) {
      messages[r] = e.what();
    }
  });
  ASSERT_EQ(JoinErrors(errors), "");
  for (int r = 0; r < N; ++r) {
    EXPECT_NE(messages[r].find("rank 2"), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("'w'"), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("geometry digest"), std::string::npos) << messages[r];
  }
}

TEST(ExchangeSketch, ImportRefusesASketchTheLayerDoesNotKeep) {
  const int64_t m = 16, n = 12;
  EmaCase setup = EmaSetup(m, n);
  FactorSketch s;
  std::vector<float> g(m * n, 0.f);
  for (int64_t i = 0; i < m * n; ++i) g[i] = InputValue(0, 0, i);
  UpdateFactorSketch(s, g, m, n, 3, setup.options.sketch);
  std::vector<LayerGeometryState> state(2);
  state[0].sketch = SerializeFactorSketch(s);
  std::vector<std::string> messages(1);
  const auto errors = RunRanks(1, [&](Communicator& comm) {
    ExchangeOptions instant = setup.options;
    instant.estimator = GeometryEstimator::kInstant;
    Exchanger ex(comm, setup.layers, instant, setup.schedule);
    try {
      ex.ImportGeometry(state);
    } catch (const std::exception& e) {
      messages[0] = e.what();
    }
    // kDropMismatched resets the layer instead.
    EXPECT_EQ(ex.ImportGeometry(state, GeometryImport::kDropMismatched), std::vector<uint32_t>{0});
    Exchanger ema(comm, setup.layers, setup.options, setup.schedule);
    std::vector<LayerGeometryState> wrong = state;
    FactorSketch other = s;
    other.m = 8;
    other.left.resize(size_t(8 * other.width));
    wrong[0].sketch = SerializeFactorSketch(other);
    try {
      ema.ImportGeometry(wrong);
      ADD_FAILURE() << "expected a shape error";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("sketch.shape: 8x12 but the layer is 16x12"),
                std::string::npos)
          << e.what();
    }
  });
  ASSERT_EQ(JoinErrors(errors), "");
  EXPECT_NE(messages[0].find("layer 0 'w': sketch: the layer keeps no sketch here (estimator "
                             "instant)"),
            std::string::npos)
      << messages[0];
}

}  // namespace
}  // namespace geofp8
