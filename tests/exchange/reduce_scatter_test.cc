// Reduce-scatter mode (AlgorithmOptions::reduce_scatter, ExchangeEngine::ReduceScatter):
// two_phase's first half over FSDP's dim-0 chunks. Checked against references built here from the
// codec alone (each source's chunk encoded and decoded, summed in rank order: the same bits) and
// the exact fp64 average, over the loopback Gloo communicator, with uneven rows (m % N != 0, m <
// N), the lowrank geometry under sharding against the all-reduce path, and error feedback across
// steps. No timing assumptions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/codec/codec.h"
#include "kernels/exchange/algorithms.h"
#include "kernels/exchange/chunking.h"
#include "kernels/exchange/engine.h"
#include "kernels/geometry/geometry.h"
#include "tests/exchange/exchange_harness.h"
#include "tests/exchange/rank_threads.h"

namespace geofp8::testing {
namespace {

struct Shape {
  int64_t rows, cols;
};

// Rank r's gradient of layer l: a strong rank-2 part shared by every rank plus per-rank noise.
std::vector<float> Grad(int rank, uint32_t l, Shape s, uint64_t step = 0, double lowrank = 4.0) {
  std::vector<float> g(static_cast<size_t>(s.rows * s.cols));
  for (int64_t i = 0; i < s.rows; ++i) {
    for (int64_t j = 0; j < s.cols; ++j) {
      const double a = std::sin(0.37 * i + l) * std::cos(0.21 * j) * lowrank +
                       std::cos(0.11 * i) * std::sin(0.5 * j + l) * lowrank * 0.5;
      g[i * s.cols + j] =
          static_cast<float>(a + 0.3 * InputValue(rank, l, size_t(i * s.cols + j), step));
    }
  }
  return g;
}

// The exact average over ranks in fp64 of rows [r0, r1).
std::vector<double> ExactRows(int n, uint32_t l, Shape s, ChunkRange c, uint64_t step = 0) {
  std::vector<double> out(c.size(), 0.0);
  for (int r = 0; r < n; ++r) {
    const std::vector<float> g = Grad(r, l, s, step);
    for (size_t k = 0; k < c.size(); ++k) out[k] += g[c.begin + k];
  }
  for (double& v : out) v /= n;
  return out;
}

double RelErr(const std::vector<float>& got, const std::vector<double>& want) {
  double e = 0, w = 0;
  for (size_t k = 0; k < got.size(); ++k) {
    e += (got[k] - want[k]) * (got[k] - want[k]);
    w += want[k] * want[k];
  }
  return w > 0 ? std::sqrt(e / w) : std::sqrt(e);
}

// One reduce-scatter (or, with reduce_scatter false, an all-reduce whose own rows are kept) of
// `shapes` on this rank; returns each layer's own rows.
std::vector<std::vector<float>> Scatter(Communicator& comm, Algorithm alg,
                                        const std::vector<Shape>& shapes, const LayerPolicy& policy,
                                        bool reduce_scatter,
                                        const std::vector<Geometry>* geometry = {},
                                        uint64_t step = 0, uint64_t* bytes = nullptr) {
  const int n = comm.size(), r = comm.rank();
  std::vector<std::vector<float>> in(shapes.size()), out(shapes.size());
  std::vector<BucketLayer> layers;
  for (uint32_t l = 0; l < shapes.size(); ++l) {
    in[l] = Grad(r, l, shapes[l], step);
    const ChunkRange mine = RowChunkOf(in[l].size(), shapes[l].cols, n, r);
    out[l].assign(reduce_scatter ? mine.size() : in[l].size(), 0.f);
    BucketLayer b;
    b.layer = l;
    b.policy = policy;
    b.in = in[l];
    b.out = out[l];
    b.cols = shapes[l].cols;
    if (geometry && !(*geometry)[l].is_identity()) b.geometry = &(*geometry)[l];
    layers.push_back(b);
  }
  AlgorithmOptions ao;
  ao.seed = 5;
  ao.step = step;
  ao.divisor = static_cast<float>(n);
  ao.reduce_scatter = reduce_scatter;
  const uint64_t before = comm.stats().bytes_sent;
  EXPECT_EQ(ExchangeBucketData(comm, alg, ao, layers), 0u);
  if (bytes) *bytes = comm.stats().bytes_sent - before;
  if (!reduce_scatter) {
    for (uint32_t l = 0; l < shapes.size(); ++l) {
      const ChunkRange mine = RowChunkOf(in[l].size(), shapes[l].cols, n, r);
      out[l] = std::vector<float>(out[l].begin() + mine.begin, out[l].begin() + mine.end);
    }
  }
  return out;
}

// Uneven rows: 7 and 5 rows over 3 and 4 ranks, 2 rows over 4 ranks (two ranks own none), a 1-D
// layer, and a layer whose row length is odd (nvfp4 packs two elements a byte).
const std::vector<Shape> kShapes = {{7, 12}, {5, 9}, {2, 16}, {33, 1}, {13, 7}};

TEST(ReduceScatter, EachOwnerGetsTheRankOrderSumOfEveryRanksEncodedChunk) {
  for (int n : {2, 3, 4}) {
    for (Format f : {Format::kFp8E4M3, Format::kNvfp4}) {
      const LayerPolicy policy = Policy(f, Scaling::kBlock, f == Format::kNvfp4 ? 16 : 32);
      const auto errors = RunRanks(n, [&](Communicator& comm) {
        const int r = comm.rank();
        const auto got = Scatter(comm, Algorithm::kTwoPhase, kShapes, policy, true);
        for (uint32_t l = 0; l < kShapes.size(); ++l) {
          const size_t count = static_cast<size_t>(kShapes[l].rows * kShapes[l].cols);
          const ChunkRange mine = RowChunkOf(count, kShapes[l].cols, n, r);
          // The reference: every source's chunk for rank r, divided and encoded with the
          // stream that source uses, decoded and summed in rank order from zero.
          std::vector<float> want(mine.size(), 0.f);
          for (int src = 0; src < n; ++src) {
            const std::vector<float> g = Grad(src, l, kShapes[l]);
            std::vector<float> x(mine.size());
            for (size_t k = 0; k < x.size(); ++k) x[k] = g[mine.begin + k] / float(n);
            const CodecOptions o = LayerCodecOptions(policy, 5, 0, l, src, 1, r);
            std::vector<uint8_t> enc(EncodedBytes(o, x.size()));
            Encode(x, o, enc);
            DecodeAccumulate(enc, want);
          }
          ASSERT_EQ(got[l].size(), want.size()) << "layer " << l;
          EXPECT_TRUE(SameBytes(got[l], want)) << "N=" << n << " layer " << l << " rank " << r;
          // And within one quantization of the exact average: 2^-4 (e4m3), 2^-2 (e2m1).
          if (!want.empty()) {
            EXPECT_LT(RelErr(got[l], ExactRows(n, l, kShapes[l], mine)),
                      f == Format::kNvfp4 ? 0.25 : 0.0625);
          }
        }
      });
      EXPECT_EQ(JoinErrors(errors), "") << "N=" << n;
    }
  }
}

TEST(ReduceScatter, Fp32BaselineIsTheRankOrderSumOfTheDividedInputs) {
  for (int n : {2, 3}) {
    const auto errors = RunRanks(n, [&](Communicator& comm) {
      const int r = comm.rank();
      uint64_t bytes = 0;
      const auto got =
          Scatter(comm, Algorithm::kFp32, kShapes, LayerPolicy{}, true, nullptr, 0, &bytes);
      size_t payload = 0;
      for (uint32_t l = 0; l < kShapes.size(); ++l) {
        const size_t count = static_cast<size_t>(kShapes[l].rows * kShapes[l].cols);
        const ChunkRange mine = RowChunkOf(count, kShapes[l].cols, n, r);
        std::vector<float> want(mine.size(), 0.f);
        for (int src = 0; src < n; ++src) {
          const std::vector<float> g = Grad(src, l, kShapes[l]);
          for (size_t k = 0; k < want.size(); ++k) want[k] += g[mine.begin + k] / float(n);
        }
        EXPECT_TRUE(SameBytes(got[l], want)) << "N=" << n << " layer " << l;
        payload += count - RowChunkOf(count, kShapes[l].cols, n, r).size();
      }
      // An fp32 reduce-scatter's bytes (what this rank sends to others) plus headers and flags.
      EXPECT_GE(bytes, payload * 4);
      EXPECT_LE(bytes, payload * 4 + 512 * kShapes.size() * n);
    });
    EXPECT_EQ(JoinErrors(errors), "");
  }
}

// A lowrank geometry (estimated from the exact average) under sharding: the owner's rows through
// the k x n all-reduce of U^T D are the whole inverse's rows (fp32: to float round-off), and its
// relative error against Euclidean is printed beside the all-reduce path's.
TEST(ReduceScatter, LowRankGeometryUnderShardingMatchesTheAllReducePath) {
  const std::vector<Shape> shapes = {{96, 64}, {50, 40}};
  for (int n : {2, 3}) {
    std::vector<Geometry> geometry, diag;
    for (uint32_t l = 0; l < shapes.size(); ++l) {
      const size_t count = static_cast<size_t>(shapes[l].rows * shapes[l].cols);
      const std::vector<double> avg = ExactRows(n, l, shapes[l], {0, count});
      const std::vector<float> g(avg.begin(), avg.end());
      GeometryOptions o;
      o.rank = 4;
      geometry.push_back(EstimateGeometry(g, shapes[l].rows, shapes[l].cols, o, nullptr).geometry);
      o.mode = GeometryMode::kDiag;
      diag.push_back(EstimateGeometry(g, shapes[l].rows, shapes[l].cols, o, nullptr).geometry);
    }
    const auto errors = RunRanks(n, [&](Communicator& comm) {
      const int r = comm.rank();
      // fp32: the transforms alone, exact up to float round-off times the inverse's condition.
      const auto f32 = Scatter(comm, Algorithm::kFp32, shapes, LayerPolicy{}, true, &geometry);
      const LayerPolicy fp8 = Policy(Format::kFp8E4M3, Scaling::kTensor, 0);
      uint64_t b_none = 0, b_lr = 0;
      const auto none = Scatter(comm, Algorithm::kTwoPhase, shapes, fp8, true, nullptr, 0, &b_none);
      const auto rs = Scatter(comm, Algorithm::kTwoPhase, shapes, fp8, true, &geometry, 0, &b_lr);
      const auto ar = Scatter(comm, Algorithm::kTwoPhase, shapes, fp8, false, &geometry);
      const auto ar_none = Scatter(comm, Algorithm::kTwoPhase, shapes, fp8, false);
      const auto rs_diag = Scatter(comm, Algorithm::kTwoPhase, shapes, fp8, true, &diag);
      // The sharded inverse adds one all-reduce of every layer's k x cols share of W, as bf16 for
      // an fp8 layer: the bytes of that collective on its own, measured here.
      size_t w_elements = 0;
      for (uint32_t l = 0; l < shapes.size(); ++l) {
        w_elements += size_t(ShardProductRows(geometry[l])) * size_t(shapes[l].cols);
      }
      std::vector<uint16_t> w_bf16(w_elements, 0);
      const uint64_t before_w = comm.stats().bytes_sent;
      comm.AllReduceSumBf16(w_bf16);
      EXPECT_EQ(b_lr - b_none, comm.stats().bytes_sent - before_w)
          << "the sharded inverse's extra bytes are not one bf16 all-reduce of W (" << w_elements
          << " elements)";
      const auto ar_diag = Scatter(comm, Algorithm::kTwoPhase, shapes, fp8, false, &diag);
      // Per layer, summed over the owners with one small all-reduce: squared errors and norms.
      std::vector<float> sums;
      for (uint32_t l = 0; l < shapes.size(); ++l) {
        const size_t count = static_cast<size_t>(shapes[l].rows * shapes[l].cols);
        const ChunkRange mine = RowChunkOf(count, shapes[l].cols, n, r);
        const std::vector<double> want = ExactRows(n, l, shapes[l], mine);
        for (const auto* v : {&f32, &none, &rs, &ar, &ar_none, &rs_diag, &ar_diag}) {
          double e = 0, w = 0;
          for (size_t k = 0; k < want.size(); ++k) {
            e += ((*v)[l][k] - want[k]) * ((*v)[l][k] - want[k]);
            w += want[k] * want[k];
          }
          sums.push_back(static_cast<float>(e));
          sums.push_back(static_cast<float>(w));
        }
      }
      comm.AllReduceSum(sums);
      for (uint32_t l = 0; l < shapes.size(); ++l) {
        auto rel = [&](int v) {
          const size_t at = (l * 7 + v) * 2;
          return std::sqrt(double(sums[at]) / double(sums[at + 1]));
        };
        EXPECT_LT(rel(0), 1e-4) << "fp32 through the sharded lowrank inverse, layer " << l;
        const double ratio_rs = rel(2) / rel(1), ratio_ar = rel(3) / rel(4);
        const double diag_rs = rel(5) / rel(1), diag_ar = rel(6) / rel(4);
        // The reduce-scatter quantizes once with per-chunk scales over row blocks; the all-reduce
        // path twice (the requantized sum) over its own chunks, so their ratios are reported,
        // not held to each other (docs/pytorch.md). The geometry must still pay under sharding.
        EXPECT_LT(ratio_rs, 0.8) << "layer " << l << " N=" << n;
        // The extra traffic: the k x n fp32 all-reduce against the layer's compressed bytes.
        if (r == 0) {
          std::printf(
              "N=%d layer %u (%lldx%lld, k=4): relF/Euclidean lowrank rs %.4f ar %.4f, diag rs "
              "%.4f ar %.4f; extra bytes %.1f%% of the reduce-scatter's\n",
              n, l, (long long)shapes[l].rows, (long long)shapes[l].cols, ratio_rs, ratio_ar,
              diag_rs, diag_ar, 100.0 * (double(b_lr) - double(b_none)) / double(b_none));
        }
      }
    });
    EXPECT_EQ(JoinErrors(errors), "") << "N=" << n;
  }
}

TEST(ReduceScatter, TheHadamardRotationIsRefusedNamingTheLayer) {
  const auto errors = RunRanks(2, [&](Communicator& comm) {
    ExchangeEngine engine(comm, EngineOptions{});
    engine.SetLayers({{"blocks.0.wq", 8, 16}});
    EnginePolicy p;
    LayerPolicy lp = Policy(Format::kFp8E4M3, Scaling::kBlock, 32);
    lp.hadamard = true;
    lp.hadamard_block = 16;
    p.layers = {lp};
    p.options.algorithm = Algorithm::kTwoPhase;
    engine.SetPolicy(p);
    std::vector<float> g(128, 1.f), out(64);
    engine.ReduceScatter(0, {0}, {g}, {out});
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("blocks.0.wq"), std::string::npos) << e;
    EXPECT_NE(e.find("Hadamard"), std::string::npos) << e;
  }
}

// The engine over steps: error feedback keeps the sum of the outputs within one step's error of
// the sum of the exact averages (without it, the same rounding adds up step after step), and a
// lowrank layer refreshed every other step (its ema sketch fed from the owners' rows, the
// sharded inverse every step) stays within the format's bound.
TEST(ReduceScatter, EngineErrorFeedbackAcrossStepsAndRefreshedGeometry) {
  const std::vector<Shape> shapes = {{21, 24}, {40, 32}, {9, 1}};
  const int n = 3, steps = 8;
  for (bool feedback : {false, true}) {
    const auto errors = RunRanks(n, [&](Communicator& comm) {
      const int r = comm.rank();
      EngineOptions eo;
      eo.seed = 3;
      ExchangeEngine engine(comm, eo);
      engine.SetLayers({{"a", 21, 24}, {"w", 40, 32}, {"b", 9, 1}});
      EnginePolicy p;
      LayerPolicy a = Policy(Format::kNvfp4, Scaling::kBlock, 16);
      a.error_feedback = feedback;
      LayerPolicy w = Policy(Format::kFp8E4M3, Scaling::kBlock, 32);
      w.geometry = GeometryMode::kLowRank;
      w.rank = 3;
      w.error_feedback = feedback;
      p.layers = {a, w, LayerPolicy{}};
      p.options.algorithm = Algorithm::kTwoPhase;
      p.options.estimator = GeometryEstimator::kFactorEma;
      p.options.sketch.width = 4;
      p.schedule = {{0, 1, 0}, {0, 2, 0}, {0, 1, 0}};
      engine.SetPolicy(p);
      std::vector<std::vector<double>> got_sum(3), want_sum(3);
      size_t refreshes = 0;
      for (int s = 0; s < steps; ++s) {
        std::vector<std::vector<float>> in(3), out(3);
        std::vector<std::span<float>> gi, go;
        for (uint32_t l = 0; l < 3; ++l) {
          in[l] = Grad(r, l, shapes[l]);  // the same gradients every step
          const ChunkRange mine = RowChunkOf(in[l].size(), shapes[l].cols, n, r);
          out[l].assign(mine.size(), 0.f);
          gi.push_back(in[l]);
          go.push_back(out[l]);
        }
        const StepResult res = engine.ReduceScatter(s, {0, 1, 2}, gi, go);
        ASSERT_FALSE(res.skipped);
        refreshes += res.refreshes.size();
        for (uint32_t l = 0; l < 3; ++l) {
          const ChunkRange mine = RowChunkOf(in[l].size(), shapes[l].cols, n, r);
          const std::vector<double> want = ExactRows(n, l, shapes[l], mine);
          got_sum[l].resize(want.size());
          want_sum[l].resize(want.size());
          for (size_t k = 0; k < want.size(); ++k) {
            got_sum[l][k] += out[l][k];
            want_sum[l][k] += want[k];
          }
          if (l == 1) {
            std::vector<float> e = out[l];
            EXPECT_LT(RelErr(e, want), 0.125) << "step " << s << " rank " << r;
          }
        }
      }
      engine.Drain();
      EXPECT_GT(refreshes, 0u);
      // Layer 0 (nvfp4): the error of the sum over steps, relative to one step's average.
      double e = 0, norm = 0;
      for (size_t k = 0; k < got_sum[0].size(); ++k) {
        e += (got_sum[0][k] - want_sum[0][k]) * (got_sum[0][k] - want_sum[0][k]);
        norm += want_sum[0][k] * want_sum[0][k] / (steps * steps);
      }
      std::vector<float> t = {static_cast<float>(e), static_cast<float>(norm)};
      comm.AllReduceSum(t);
      const double rel = std::sqrt(double(t[0]) / double(t[1]));
      if (r == 0)
        std::printf("error feedback %d: accumulated error %.4f over %d steps\n", int(feedback), rel,
                    steps);
      // One nvfp4 quantization is at most 2^-2 relative; without feedback the same rounding
      // repeats every step, so the accumulated error is `steps` times one step's.
      if (feedback) {
        EXPECT_LT(rel, 0.5);
      } else {
        EXPECT_GT(rel, 0.5);
      }
      // The residual is full-size per rank (every layer's input) in fp32.
      const auto res = engine.ExportResiduals();
      if (feedback)
        EXPECT_EQ(res[0].local.size(), static_cast<size_t>(shapes[0].rows * shapes[0].cols));
    });
    EXPECT_EQ(JoinErrors(errors), "") << "feedback " << feedback;
  }
}

// A layer refreshed every step under the ema estimator stays a reduce-scatter: the sketch reads
// the owners' rows through ShardedGradient (its collectives give every rank the same sketch; the
// fingerprint's geometry digest would refuse a step otherwise). In fp32 both paths average
// exactly up to summation order, so the geometry equals the all-reduce engine's to round-off, and
// a step moves fewer bytes than the all-reduce's.
TEST(ReduceScatter, EveryStepEmaRefreshesReadTheShardsAndMatchTheAllReducesGeometry) {
  const Shape shape{96, 64};
  const int n = 3, steps = 4;
  std::vector<std::vector<LayerGeometryState>> geometry(2);
  std::vector<uint64_t> bytes(2, 0);
  for (int scatter = 0; scatter < 2; ++scatter) {
    const auto errors = RunRanks(n, [&](Communicator& comm) {
      const int r = comm.rank();
      EngineOptions eo;
      eo.seed = 3;
      ExchangeEngine engine(comm, eo);
      engine.SetLayers({{"w", shape.rows, shape.cols}});
      EnginePolicy p;
      LayerPolicy w = Policy(Format::kFp32, Scaling::kNone, 0);
      w.geometry = GeometryMode::kLowRank;
      w.rank = 3;
      p.layers = {w};
      p.options.algorithm = Algorithm::kTwoPhase;
      p.options.estimator = GeometryEstimator::kFactorEma;
      p.options.sketch.width = 4;
      p.schedule = {{0, 1, 0}};
      engine.SetPolicy(p);
      size_t refreshes = 0;
      for (int s = 0; s < steps; ++s) {
        std::vector<float> in = Grad(r, 0, shape, s);
        const ChunkRange mine = RowChunkOf(in.size(), shape.cols, n, r);
        std::vector<float> out(mine.size());
        const StepResult res =
            scatter ? engine.ReduceScatter(s, {0}, {in}, {out}) : engine.Exchange(s, {0}, {in});
        ASSERT_FALSE(res.skipped);
        refreshes += res.refreshes.size();
        if (r == 0 && s == steps - 1) bytes[scatter] = res.bytes_sent;
      }
      engine.Drain();
      EXPECT_EQ(refreshes, size_t(steps - 1)) << "the last step's refresh is deferred";
      if (r == 0) geometry[scatter] = engine.ExportGeometry();
    });
    ASSERT_EQ(JoinErrors(errors), "") << (scatter ? "reduce-scatter" : "all-reduce");
  }
  const Geometry ar = DeserializeGeometry(geometry[0][0].active);
  const Geometry rs = DeserializeGeometry(geometry[1][0].active);
  ASSERT_FALSE(ar.is_identity());
  // Float round-off of a 96x64 average over the relative eigengap of a rank-2-plus-noise
  // gradient: far below 1e-3.
  EXPECT_LT(SubspaceDrift(ar, rs), 1e-3);
  EXPECT_EQ(ar.version, rs.version);
  // The all-reduce moves the layer twice ((N-1)/N each way); the reduce-scatter once, plus the
  // sketch's thin products and the inverse's W, a few columns of m and n.
  EXPECT_LT(bytes[1], bytes[0] * 3 / 4)
      << "reduce-scatter " << bytes[1] << ", all-reduce " << bytes[0];
  std::printf("bytes of a refreshing step: reduce-scatter %llu, all-reduce %llu\n",
              (unsigned long long)bytes[1], (unsigned long long)bytes[0]);
}

}  // namespace
}  // namespace geofp8::testing
