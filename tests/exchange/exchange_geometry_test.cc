// Geometry inside the exchange: the owner rank refreshes a layer's basis from the averaged
// gradient on its schedule, every rank activates it at the announced step, and the exchanged
// result equals the reference (Apply, two_phase quantization, Invert) bit for bit on every rank
// and is within quantization error of the exact average under a float64 reference geometry.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "kernels/geometry/hadamard.h"
#include "tests/exchange/exchange_harness.h"
#include "tests/geometry/reference_geometry.h"

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

// Independent of the library's ApplyGeometry/InvertGeometry: the float64 map P = P_L . P_R of
// DESIGN.md section 2 (tests/geometry/reference_geometry.h), built from the geometry's basis and
// sigma, takes the exchanged result back to the coordinates where it was quantized. There it may
// differ from P(exact average) only by what two_phase's quantization allows (allgather's single
// quantization allows less), per element i of an E4M3 block of 128 with block amax A:
//   each rank's y_r = P(G_r / N): 2^-4 |y_r,i| + 2^-10 A_r / 448 (half a normal step, or half the
//   smallest subnormal step in input units; the scale is 448 / A, at most one ulp less);
//   the fp32 sum and its requantization: 2^-4 |sum_i| + 2^-10 A_sum / 448 with
//   |sum_i| <= (1 + 2^-4) sum_r |y_r,i| + rank-count * 2^-24 of the same;
//   the float transforms themselves: testing::RoundTripBound(1, K) of the norms involved.
// A library transform that disagreed with the design (other factors, a missing side) would leave
// quantization noise in directions P shrinks and fail this elementwise bound.
void ExpectWithinQuantizationOfExact(const Geometry& g, const std::vector<float>& out,
                                     const std::vector<double>& exact, int N, int64_t m, int64_t n,
                                     int step) {
  const ReferenceSide left = MakeReferenceSide(g, true, m), right = MakeReferenceSide(g, false, n);
  const std::vector<double> out_d(out.begin(), out.end());
  const std::vector<double> y_out = Sandwich(left.p, out_d, right.p, m, n);
  const std::vector<double> y_exact = Sandwich(left.p, exact, right.p, m, n);
  std::vector<double> abs_sum(m * n, 0.0), sub_floor(m * n, 0.0);
  double norms = 0;
  const double kBlock = 128, kHalfStep = 1.0 / 16, kSubnormal = std::ldexp(1.0, -10) / 448;
  for (int r = 0; r < N; ++r) {
    std::vector<double> x(m * n);
    const std::vector<float> gr = LowRankish(r, step, m, n);
    double nr = 0;
    for (int64_t i = 0; i < m * n; ++i) {
      x[i] = double(gr[i]) / N;
      nr += x[i] * x[i];
    }
    norms += std::sqrt(nr);
    const std::vector<double> y = Sandwich(left.p, x, right.p, m, n);
    for (int64_t b = 0; b < m * n; b += kBlock) {
      double amax = 0;
      for (int64_t i = b; i < std::min<int64_t>(m * n, b + kBlock); ++i)
        amax = std::max(amax, std::abs(y[i]));
      for (int64_t i = b; i < std::min<int64_t>(m * n, b + kBlock); ++i) {
        abs_sum[i] += std::abs(y[i]);
        sub_floor[i] += kSubnormal * amax;
      }
    }
  }
  double out_norm = 0;
  for (double v : out_d) out_norm += v * v;
  norms += std::sqrt(out_norm);
  // In these coordinates the inverse's round-off is not amplified: what it scales up by 1/f in
  // the top directions, P scales back down, so kappa = 1 here.
  const double transform = RoundTripBound(1.0, std::max<int64_t>({m, n, 2 * g.k})) * norms;
  const double sum_growth = 1 + kHalfStep + N * std::ldexp(1.0, -24);
  for (int64_t b = 0; b < m * n; b += kBlock) {
    double sum_amax = 0;
    for (int64_t i = b; i < std::min<int64_t>(m * n, b + kBlock); ++i)
      sum_amax = std::max(sum_amax, sum_growth * abs_sum[i]);
    for (int64_t i = b; i < std::min<int64_t>(m * n, b + kBlock); ++i) {
      const double bound = kHalfStep * abs_sum[i] + sub_floor[i] +
                           kHalfStep * sum_growth * abs_sum[i] + kSubnormal * sum_amax + transform;
      ASSERT_LE(std::abs(y_out[i] - y_exact[i]), bound)
          << "step " << step << " element " << i << " version " << g.version;
    }
  }
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
    ExpectWithinQuantizationOfExact(g, outputs[0][s], exact, N, m, n, s);
  }
}

// The block random Hadamard rotation in the exchange: alone (fp8 blocks of 128 with a tail,
// nvfp4 at its block of 16, a smaller block inside fp8's) and after an owner-refreshed lowrank
// geometry. Reference, written from the documented order without the engine: divide by N,
// ApplyGeometry with the step's active basis, rotate with the GEOFP8_HD reference under
// HadamardLayerSeed(seed, layer), the quantization math, then the inverse rotation and
// InvertGeometry. 1-D layers are not rotated (as they get no geometry).
TEST_P(GeometryAlgorithms, HadamardRotationMatchesTheReference) {
  const int N = 3;
  LayerPolicy both;
  both.geometry = GeometryMode::kLowRank;
  both.rank = 4;
  both.hadamard = true;  // block 128, the codec's
  LayerPolicy fp8 = both;
  fp8.geometry = GeometryMode::kNone;
  LayerPolicy fp8_small = fp8;
  fp8_small.hadamard_block = 32;
  LayerPolicy nv = fp8;
  nv.format = Format::kNvfp4;
  const std::vector<LayerSpec> layers = {{"w", 64, 48, both},
                                         {"h", 33, 40, fp8},
                                         {"s", 8, 96, fp8_small},
                                         {"v", 16, 20, nv},
                                         {"b", 48, 1, fp8}};
  const std::vector<uint32_t> blocks = {128, 128, 32, 16, 0};
  const std::vector<RefreshSchedule> schedule = {
      {1, 2, 0}, {0, 1, 0}, {0, 1, 0}, {0, 1, 0}, {0, 1, 0}};
  ExchangeOptions options;
  options.seed = 5;
  options.algorithm = GetParam();
  const int steps = 3;
  auto input = [&](int r, int s, size_t l) {
    const LayerSpec& spec = layers[l];
    if (l == 0) return LowRankish(r, s, spec.rows, spec.cols);
    std::vector<float> x(spec.count());
    for (size_t i = 0; i < x.size(); ++i) x[i] = InputValue(r, uint32_t(l), i, s);
    x[x.size() / 3] *= 40.f;  // an outlier for the rotation to spread
    return x;
  };
  std::vector<std::vector<std::vector<float>>> outputs(N);  // [rank][step * L + l]
  std::vector<std::vector<uint8_t>> active(steps);          // rank 0's basis of layer w
  const auto errors = RunRanks(N, [&](Communicator& comm) {
    const int r = comm.rank();
    Exchanger ex(comm, layers, options, schedule);
    for (int s = 0; s < steps; ++s) {
      std::vector<std::vector<float>> g;
      std::vector<std::span<float>> spans;
      for (size_t l = 0; l < layers.size(); ++l) g.push_back(input(r, s, l));
      for (auto& v : g) spans.emplace_back(v);
      ex.Exchange(s, spans);
      // After the step: the basis it used (a refresh activates at a later step's first bucket).
      if (r == 0) active[s] = SerializeGeometry(ex.active_geometry(0));
      for (auto& v : g) outputs[r].push_back(v);
    }
  });
  ASSERT_EQ(JoinErrors(errors), "");
  for (int s = 0; s < steps; ++s) {
    const Geometry g = DeserializeGeometry(active[s]);
    if (s == 2) {
      EXPECT_GE(g.version, 1u) << "the lowrank basis never activated";
    }
    for (size_t l = 0; l < layers.size(); ++l) {
      const size_t idx = size_t(s) * layers.size() + l;
      std::vector<std::vector<float>> transformed(N);
      for (int r = 0; r < N; ++r) {
        transformed[r] = input(r, s, l);
        for (float& v : transformed[r]) v /= static_cast<float>(N);
        if (l == 0) ApplyGeometry(g, transformed[r]);
        if (blocks[l]) {
          HadamardForward(transformed[r], int(blocks[l]), HadamardLayerSeed(options.seed, l), 0,
                          /*reference=*/true);
        }
      }
      std::vector<float> ref =
          options.algorithm == Algorithm::kTwoPhase
              ? ReferenceTwoPhase(transformed, layers[l].policy, options.seed, s, uint32_t(l))
              : ReferenceAllGather(transformed, layers[l].policy, options.seed, s, uint32_t(l));
      if (blocks[l]) {
        HadamardInverse(ref, int(blocks[l]), HadamardLayerSeed(options.seed, l), 0, true);
      }
      if (l == 0) InvertGeometry(g, ref);
      for (int r = 0; r < N; ++r) {
        ASSERT_TRUE(SameBytes(outputs[r][idx], ref))
            << "rank " << r << " step " << s << " layer " << layers[l].name
            << ": first difference at " << FirstBitDifference(outputs[r][idx], ref);
      }
    }
  }
}

TEST(ExchangeGeometry, HadamardBlockIsValidatedAndPartOfTheFingerprint) {
  LayerPolicy p;
  p.hadamard = true;
  p.format = Format::kNvfp4;
  p.hadamard_block = 32;
  EXPECT_EQ(ValidateLayerPolicy({"w", 16, 16, p}),
            "layer 'w': hadamard_block: must divide the codec's scale block 16 (32)");
  p.hadamard_block = 12;
  EXPECT_EQ(ValidateLayerPolicy({"w", 16, 16, p}),
            "layer 'w': hadamard_block: must be a power of two in [2, 4096] (12)");
  p = LayerPolicy{};
  p.hadamard = true;
  p.block = 96;  // the default rotation block would be 96
  EXPECT_EQ(ValidateLayerPolicy({"w", 16, 16, p}),
            "layer 'w': hadamard_block: must be a power of two in [2, 4096] (96) (the default, "
            "from the codec's block)");
  // Ranks that disagree on the rotation are stopped before any data moves, naming it.
  const std::vector<std::string> errors = RunRanks(2, [&](Communicator& comm) {
    LayerPolicy q;
    q.hadamard = true;
    q.hadamard_block = comm.rank() == 0 ? 64 : 128;
    Exchanger ex(comm, {{"w", 16, 16, q}}, ExchangeOptions{});
    std::vector<float> w(256, 1.f);
    ex.Exchange(0, {std::span<float>(w)});
  });
  EXPECT_NE(JoinErrors(errors).find("hadamard_block"), std::string::npos) << JoinErrors(errors);
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

// Export after a step whose refresh is still pending, import into a fresh engine: the next
// steps are bit for bit those of the engine that never stopped. Without the import they differ.
TEST(ExchangeGeometry, ExportImportContinuesExactly) {
  const int N = 2;
  const int64_t m = 40, n = 24;
  LayerPolicy lowrank;
  lowrank.geometry = GeometryMode::kLowRank;
  lowrank.rank = 3;
  const std::vector<LayerSpec> layers = {{"w", m, n, lowrank}, {"b", 24, 1, lowrank}};
  const std::vector<RefreshSchedule> schedule = {{1, 2, 0}, {0, 1, 0}};
  ExchangeOptions options;
  options.seed = 7;
  const int cut = 3, steps = 6;  // refresh at step 2, active from 3: pending across the cut
  std::vector<std::vector<std::vector<float>>> straight(N), resumed(N), cold(N);
  std::vector<std::vector<LayerGeometryState>> saved(N);
  const auto errors = RunRanks(N, [&](Communicator& comm) {
    const int r = comm.rank();
    auto run = [&](Exchanger& ex, int from, int to, std::vector<std::vector<float>>& out) {
      for (int s = from; s < to; ++s) {
        auto w = LowRankish(r, s, m, n);
        std::vector<float> b(24, 0.25f * (r + s));
        ex.Exchange(s, {std::span<float>(w), std::span<float>(b)});
        out.push_back(w);
      }
    };
    {
      Exchanger ex(comm, layers, options, schedule);
      run(ex, 0, steps, straight[r]);
    }
    {
      Exchanger ex(comm, layers, options, schedule);
      std::vector<std::vector<float>> unused;
      run(ex, 0, cut, unused);
      saved[r] = ex.ExportGeometry();
    }
    {
      Exchanger ex(comm, layers, options, schedule);
      EXPECT_TRUE(ex.ImportGeometry(saved[r]).empty());
      EXPECT_EQ(ex.active_geometry(0).version, 1u);  // from step 0's refresh; step 2's waits
      run(ex, cut, steps, resumed[r]);
    }
    {
      Exchanger ex(comm, layers, options, schedule);
      run(ex, cut, steps, cold[r]);
    }
  });
  ASSERT_EQ(JoinErrors(errors), "");
  for (int r = 0; r < N; ++r) {
    ASSERT_EQ(saved[r].size(), 2u);
    EXPECT_EQ(saved[r][0].active, saved[0][0].active) << "rank " << r;
    EXPECT_FALSE(saved[r][0].pending.empty()) << "rank " << r;
    EXPECT_EQ(saved[r][0].pending_from, uint64_t(cut));
    EXPECT_TRUE(saved[r][1].active.empty() && saved[r][1].pending.empty());  // 1-D layer
    ASSERT_EQ(resumed[r].size(), size_t(steps - cut));
    for (int s = 0; s < steps - cut; ++s) {
      EXPECT_TRUE(SameBytes(resumed[r][s], straight[r][cut + s]))
          << "rank " << r << " step " << cut + s << " first difference at "
          << FirstBitDifference(resumed[r][s], straight[r][cut + s]);
    }
    // The control: a fresh engine without the state quantizes differently.
    EXPECT_FALSE(SameBytes(cold[r][0], straight[r][cut])) << "rank " << r;
  }
}

// Bad state is refused naming the layer and the field, and leaves the engine unchanged.
TEST(ExchangeGeometry, ImportValidatesAgainstTheLayers) {
  const int64_t m = 20, n = 12;
  LayerPolicy lowrank;
  lowrank.geometry = GeometryMode::kLowRank;
  lowrank.rank = 2;
  const std::vector<LayerSpec> layers = {{"w", m, n, lowrank}};
  const auto errors = RunRanks(1, [&](Communicator& comm) {
    std::vector<LayerGeometryState> good;
    {
      Exchanger ex(comm, layers, {}, {{0, 1, 0}});
      for (int s = 0; s < 2; ++s) {
        auto w = LowRankish(0, s, m, n);
        ex.Exchange(s, {std::span<float>(w)});
      }
      good = ex.ExportGeometry();
    }
    ASSERT_FALSE(good[0].active.empty());
    ASSERT_FALSE(good[0].pending.empty());
    auto expect_error = [&](Exchanger& ex, const std::vector<LayerGeometryState>& state,
                            const std::string& needle) {
      try {
        ex.ImportGeometry(state);
        ADD_FAILURE() << "expected an error containing '" << needle << "'";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
      EXPECT_EQ(ex.active_geometry(0).version, 0u);  // unchanged
    };
    Exchanger same(comm, layers, {}, {{0, 1, 0}});
    expect_error(same, {}, "0 layer states for 1 layers");
    auto corrupt = good;
    corrupt[0].active[30] ^= 0x40;
    expect_error(same, corrupt, "layer 0 'w': active: ");
    auto no_step = good;
    no_step[0].pending_from = 0;
    expect_error(same, no_step, "layer 0 'w': pending_from: must be >= 1 (0)");
    auto stale = good;
    std::swap(stale[0].active, stale[0].pending);
    expect_error(same, stale, "pending.version: must be newer than active.version");
    auto dangling = good;
    dangling[0].pending.clear();
    expect_error(same, dangling, "pending_from: set without a pending geometry");

    std::vector<LayerSpec> wider = layers;
    wider[0].cols = n + 1;
    Exchanger shape(comm, wider, {}, {{0, 1, 0}});
    expect_error(shape, good, "active.shape: 20x12 but the layer is 20x13");

    std::vector<LayerSpec> rank4 = layers;
    rank4[0].policy.rank = 4;
    Exchanger other_rank(comm, rank4, {}, {{0, 1, 0}});
    expect_error(other_rank, good, "active.rank: k = 2 but the policy's rank 4 gives k = 4");
    // A policy change drops such a layer to warm-up instead.
    EXPECT_EQ(other_rank.ImportGeometry(good, GeometryImport::kDropMismatched),
              std::vector<uint32_t>{0});
    EXPECT_EQ(other_rank.active_geometry(0).version, 0u);
    EXPECT_TRUE(other_rank.ExportGeometry()[0].pending.empty());

    std::vector<LayerSpec> none = layers;
    none[0].policy.geometry = GeometryMode::kNone;
    Exchanger plain(comm, none, {}, {});
    expect_error(plain, good, "active.geometry: the layer uses none here (policy geometry none)");

    std::vector<LayerSpec> diag = layers;
    diag[0].policy.geometry = GeometryMode::kDiag;
    Exchanger other_mode(comm, diag, {}, {{0, 1, 0}});
    expect_error(other_mode, good, "active.mode: lowrank but the policy says diag");

    EXPECT_TRUE(same.ImportGeometry(good).empty());
    const auto back = same.ExportGeometry();
    EXPECT_EQ(back[0].active, good[0].active);
    EXPECT_EQ(back[0].pending, good[0].pending);
    EXPECT_EQ(back[0].pending_from, good[0].pending_from);
  });
  ASSERT_EQ(JoinErrors(errors), "");
}

}  // namespace
}  // namespace geofp8
