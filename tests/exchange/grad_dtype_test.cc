// bf16 and fp16 gradients through the exchange (grad_span.h): the conversions against the
// compiler's _Float16 and the F16C path, the plane's encode straight from bf16/fp16 against
// encoding the exactly converted floats, and all-reduce / reduce-scatter at 2-4 ranks against the
// same exchange of those floats (bit for bit, then rounded) and the exact fp64 average.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/codec/codec.h"
#include "kernels/exchange/chunking.h"
#include "kernels/exchange/data_plane.h"
#include "kernels/exchange/engine.h"
#include "kernels/exchange/grad_span.h"
#include "kernels/geometry/geometry.h"
#include "tests/exchange/exchange_harness.h"
#include "tests/exchange/rank_threads.h"

namespace geofp8::testing {
namespace {

uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }

// The float patterns the rounding tests sweep: a stride through all 2^32, and every half's and
// bf16's neighbourhood of ties (the midpoints and one float either side).
std::vector<float> RoundingSweep() {
  std::vector<float> v;
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 4099)
    v.push_back(std::bit_cast<float>(uint32_t(u)));
  for (uint32_t h = 0; h < 0x7C00u; ++h) {
    for (uint32_t s : {0u, 0x8000u}) {
      const double a = HalfToFloat(uint16_t(h | s)), b = HalfToFloat(uint16_t((h + 1) | s));
      const float mid = static_cast<float>((a + b) / 2);  // 12 significant bits: exact
      for (float x : {mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e30f),
                      std::nextafter(mid, -1e30f)}) {
        v.push_back(x);
      }
    }
  }
  for (uint32_t hi = 0; hi < 0x10000u; hi += 3) {
    for (uint32_t lo : {0x7FFFu, 0x8000u, 0x8001u})
      v.push_back(std::bit_cast<float>((hi << 16) | lo));
  }
  return v;
}

TEST(GradDtype, HalfConversionsMatchTheCompilersFloat16) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float want = static_cast<float>(std::bit_cast<_Float16>(uint16_t(h)));
    const float got = HalfToFloat(uint16_t(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << h;
    } else {
      ASSERT_EQ(Bits(got), Bits(want)) << std::hex << h;
    }
  }
  for (float f : RoundingSweep()) {
    const uint16_t want = std::bit_cast<uint16_t>(static_cast<_Float16>(f));
    const uint16_t got = FloatToHalf(f);
    if (std::isnan(f)) {
      ASSERT_EQ(got & 0x7E00u, 0x7E00u) << std::hex << Bits(f) << ": a NaN stays a quiet NaN";
    } else {
      ASSERT_EQ(got, want) << std::hex << Bits(f);
    }
  }
}

TEST(GradDtype, VectorPassesGiveTheScalarBits) {
  // Every half, through the load with the divisors of 1, 3 and 4 ranks.
  std::vector<uint16_t> halfs(0x10000);
  for (uint32_t h = 0; h < halfs.size(); ++h) halfs[h] = uint16_t(h);
  for (GradDtype d : {GradDtype::kFp16, GradDtype::kBf16}) {
    const GradSpan in(halfs.data(), halfs.size(), d);
    for (float divisor : {1.f, 3.f, 4.f}) {
      std::vector<float> got(halfs.size()), want(halfs.size());
      const bool bad = LoadDivided(in, divisor, got);
      EXPECT_TRUE(bad);  // infinities and NaNs are among them
      for (size_t i = 0; i < halfs.size(); ++i) want[i] = LowpToFloat(halfs[i], d) / divisor;
      for (size_t i = 0; i < halfs.size(); ++i) {
        if (std::isnan(want[i])) {
          ASSERT_TRUE(std::isnan(got[i]));
          continue;
        }
        ASSERT_EQ(Bits(got[i]), Bits(want[i])) << GradDtypeName(d) << " " << i << " / " << divisor;
      }
      std::vector<float> scalar(halfs.size());
      detail::LoadDividedScalarForTest(in, divisor, scalar);
      ASSERT_EQ(std::memcmp(scalar.data(), got.data(), got.size() * 4), 0);
    }
    std::vector<uint16_t> finite(halfs.begin(), halfs.begin() + 0x7C00);  // positive, finite
    std::vector<float> out(finite.size());
    EXPECT_FALSE(LoadDivided(GradSpan(finite.data(), finite.size(), d), 2.f, out));
  }
  // Every sweep float (NaNs included), rounded by the pass and by the element function.
  std::vector<float> x = RoundingSweep();
  for (uint32_t nan : {0x7F800001u, 0xFFC00000u, 0x7FBFFFFFu, 0x7FFFE000u}) {
    x.push_back(std::bit_cast<float>(nan));
  }
  for (GradDtype d : {GradDtype::kFp16, GradDtype::kBf16}) {
    std::vector<uint16_t> got(x.size()), scalar(x.size());
    StoreRounded(x, GradSpan(got.data(), got.size(), d));
    detail::StoreRoundedScalarForTest(x, GradSpan(scalar.data(), scalar.size(), d));
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_EQ(got[i], FloatToLowp(x[i], d)) << GradDtypeName(d) << std::hex << " " << Bits(x[i]);
      ASSERT_EQ(scalar[i], got[i]) << GradDtypeName(d) << std::hex << " " << Bits(x[i]);
    }
  }
}

// Layer values in `d`, from the exchange tests' inputs (exact in fp32 afterwards).
std::vector<uint16_t> LowpInput(GradDtype d, int rank, uint32_t layer, size_t n,
                                uint64_t step = 0) {
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = FloatToLowp(InputValue(rank, layer, i, step), d);
  return v;
}

std::vector<float> ToFloat(const std::vector<uint16_t>& v, GradDtype d) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = LowpToFloat(v[i], d);
  return f;
}

std::vector<uint16_t> Rounded(const std::vector<float>& v, GradDtype d) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FloatToLowp(v[i], d);
  return out;
}

// The plane's stages on a bf16/fp16 layer give exactly what they give on the converted floats:
// the encode (with its division, error feedback and a rotation), and the decodes, rounded once.
TEST(GradDtype, PlaneEncodesStraightFromLowpAsFromTheConvertedFloats) {
  const std::vector<LayerPolicy> policies = {
      Policy(Format::kFp8E4M3, Scaling::kBlock, 32), Policy(Format::kFp8E4M3, Scaling::kTensor, 0),
      Policy(Format::kNvfp4, Scaling::kBlock, 16), Policy(Format::kMxfp8, Scaling::kBlock, 32),
      Policy(Format::kFp8E5M2, Scaling::kBlock, 64, Rounding::kStochastic)};
  for (GradDtype d : {GradDtype::kBf16, GradDtype::kFp16}) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{5}, size_t{160}, size_t{4099}}) {
      for (size_t p = 0; p < policies.size(); ++p) {
        for (float divisor : {1.f, 3.f, 4.f}) {
          for (bool feedback : {false, true}) {
            SCOPED_TRACE(GradDtypeName(d) + " n=" + std::to_string(n) + " policy " +
                         std::to_string(p) + " divisor " + std::to_string(divisor) +
                         (feedback ? " feedback" : ""));
            std::vector<uint16_t> bits = LowpInput(d, 1, uint32_t(p), n);
            std::vector<float> floats = ToFloat(bits, d);
            std::vector<float> residual(n), lost_lowp(n, 7.f), lost_f32(n, 7.f);
            for (size_t i = 0; i < n; ++i) residual[i] = 1e-3f * InputValue(2, 9, i);
            const ChunkRange c{n / 3, n};
            const CodecOptions o = LayerCodecOptions(policies[p], 11, 3, uint32_t(p), 1, 1, 0);
            BucketLayer lowp, f32;
            lowp.policy = f32.policy = policies[p];
            lowp.in = lowp.out = GradSpan(bits.data(), n, d);
            f32.in = f32.out = std::span<float>(floats);
            if (feedback) {
              lowp.residual_in = f32.residual_in = residual.data();
              lowp.residual_out = lost_lowp.data();
              f32.residual_out = lost_f32.data();
            }
            HostPlane a, b;
            std::vector<uint8_t> got(EncodedBytes(o, c.size())), want(got.size());
            a.EncodeChunk(lowp, c, divisor, o, got);
            b.EncodeChunk(f32, c, divisor, o, want);
            ASSERT_EQ(got, want);
            ASSERT_EQ(std::memcmp(lost_lowp.data(), lost_f32.data(), n * 4), 0);
            EXPECT_EQ(a.TakeFlags(), b.TakeFlags());
            // Decode and DecodeSum into the bf16/fp16 output: the fp32 result, rounded once.
            a.Decode(lowp, c, got);
            b.Decode(f32, c, want);
            ASSERT_EQ(bits, Rounded(floats, d));
            const std::span<const uint8_t> parts[2] = {got, want};
            a.DecodeSum(lowp, c, parts);
            b.DecodeSum(f32, c, parts);
            ASSERT_EQ(bits, Rounded(floats, d));
          }
        }
      }
    }
  }
}

TEST(GradDtype, TransformedLayersAreReadIntoTheirWorkMemory) {
  for (GradDtype d : {GradDtype::kBf16, GradDtype::kFp16}) {
    const size_t n = 64 * 9;
    std::vector<uint16_t> bits = LowpInput(d, 0, 3, n);
    std::vector<float> floats = ToFloat(bits, d), work(n);
    const std::vector<uint16_t> original = bits;
    const CodecOptions o =
        LayerCodecOptions(Policy(Format::kFp8E4M3, Scaling::kBlock, 32), 1, 0, 3, 0, 1, 0);
    BucketLayer lowp, f32;
    lowp.policy = f32.policy = Policy(Format::kFp8E4M3, Scaling::kBlock, 32);
    lowp.hadamard_block = f32.hadamard_block = 32;
    lowp.hadamard_seed = f32.hadamard_seed = 99;
    lowp.in = GradSpan(bits.data(), n, d);
    lowp.work = work;
    lowp.out = std::span<float>(work);
    f32.in = f32.out = std::span<float>(floats);
    HostPlane a, b;
    a.DivideTransform(lowp, 3.f);
    b.DivideTransform(f32, 3.f);
    ASSERT_EQ(std::memcmp(work.data(), floats.data(), n * 4), 0);
    EXPECT_EQ(bits, original) << "the bf16/fp16 gradient itself is not written";
    std::vector<uint8_t> got(EncodedBytes(o, n)), want(got.size());
    a.EncodeChunk(lowp, {0, n}, 3.f, o, got);
    b.EncodeChunk(f32, {0, n}, 3.f, o, want);
    EXPECT_EQ(got, want);
    BucketLayer no_work = lowp;
    no_work.work = {};
    EXPECT_THROW(a.DivideTransform(no_work, 3.f), Error);
  }
}

// ---- exchanges at 2-4 ranks ----

struct Layer {
  const char* name;
  int64_t rows, cols;
  LayerPolicy policy;
};

std::vector<Layer> Model(bool with_rotation) {
  LayerPolicy diag = Policy(Format::kFp8E4M3, Scaling::kBlock, 32);
  diag.geometry = GeometryMode::kDiag;
  diag.error_feedback = true;
  LayerPolicy lowrank = Policy(Format::kNvfp4, Scaling::kBlock, 16);
  lowrank.geometry = GeometryMode::kLowRank;
  lowrank.rank = 2;
  LayerPolicy rotated = Policy(Format::kFp8E4M3, Scaling::kBlock, 32);
  rotated.hadamard = true;
  std::vector<Layer> m = {{"diag", 24, 40, diag},
                          {"lowrank", 16, 48, lowrank},
                          {"fp8", 13, 40, Policy(Format::kFp8E4M3, Scaling::kBlock, 32)},
                          {"nvfp4", 20, 10, Policy(Format::kNvfp4, Scaling::kBlock, 16)},
                          {"bias", 37, 1, Policy(Format::kMxfp8, Scaling::kBlock, 32)}};
  if (with_rotation) m.push_back({"rotated", 8, 64, rotated});
  return m;
}

// Geometries for the diag and lowrank layers, estimated once from a fixed matrix.
std::vector<LayerGeometryState> Geometries(const std::vector<Layer>& m) {
  std::vector<LayerGeometryState> out(m.size());
  for (size_t l = 0; l < m.size(); ++l) {
    if (m[l].policy.geometry == GeometryMode::kNone) continue;
    std::vector<float> g(static_cast<size_t>(m[l].rows * m[l].cols));
    for (int64_t i = 0; i < m[l].rows; ++i) {
      for (int64_t j = 0; j < m[l].cols; ++j) {
        g[i * m[l].cols + j] = float(4 * std::sin(0.37 * i + l) * std::cos(0.21 * j) +
                                     0.3 * InputValue(7, uint32_t(l), size_t(i * m[l].cols + j)));
      }
    }
    GeometryOptions o;
    o.mode = m[l].policy.geometry;
    o.rank = m[l].policy.rank;
    Geometry geo = EstimateGeometry(g, m[l].rows, m[l].cols, o, nullptr).geometry;
    geo.version = 1;
    out[l].active = SerializeGeometry(geo);
  }
  return out;
}

// Every rank's result of each layer: `lowp` the bf16/fp16 exchange's, `f32` the same exchange of
// the exactly converted floats (the oracle), both this rank's rows under a reduce-scatter.
struct Results {
  std::vector<std::vector<std::vector<uint16_t>>> lowp;  // [rank][layer]
  std::vector<std::vector<std::vector<float>>> f32;      // [rank][layer]
};

Results Run(int n, Algorithm algorithm, GradDtype d, bool scatter, uint64_t steps) {
  const std::vector<Layer> model = Model(!scatter);
  Results res;
  res.lowp.resize(n);
  res.f32.resize(n);
  const auto errors = RunRanks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    std::vector<EngineLayer> layers;
    EnginePolicy policy;
    std::vector<uint32_t> ids;
    for (size_t l = 0; l < model.size(); ++l) {
      layers.push_back({model[l].name, model[l].rows, model[l].cols});
      policy.layers.push_back(model[l].policy);
      ids.push_back(uint32_t(l));
    }
    policy.options.algorithm = algorithm;
    ExchangeEngine lowp_engine(comm, EngineOptions{.seed = 3}),
        f32_engine(comm, EngineOptions{.seed = 3});
    for (ExchangeEngine* e : {&lowp_engine, &f32_engine}) {
      e->SetLayers(layers);
      e->SetPolicy(policy);
      e->ImportGeometry(Geometries(model));
    }
    for (uint64_t s = 0; s < steps; ++s) {
      std::vector<std::vector<uint16_t>> bits(model.size()), bits_out(model.size());
      std::vector<std::vector<float>> floats(model.size()), floats_out(model.size());
      GradSpans grads, grads_f32, outs, outs_f32;
      for (size_t l = 0; l < model.size(); ++l) {
        const size_t count = static_cast<size_t>(model[l].rows * model[l].cols);
        bits[l] = LowpInput(d, r, uint32_t(l), count, s);
        floats[l] = ToFloat(bits[l], d);
        const size_t mine = RowChunkOf(count, size_t(model[l].cols), n, r).size();
        bits_out[l].assign(mine, 0xFFFF);
        floats_out[l].assign(mine, -1.f);
        grads.emplace_back(bits[l].data(), count, d);
        grads_f32.emplace_back(std::span<float>(floats[l]));
        outs.emplace_back(bits_out[l].data(), mine, d);
        outs_f32.emplace_back(std::span<float>(floats_out[l]));
      }
      if (scatter) {
        lowp_engine.ReduceScatter(s, ids, grads, outs);
        f32_engine.ReduceScatter(s, ids, grads_f32, outs_f32);
        res.lowp[r] = bits_out;
        res.f32[r] = floats_out;
      } else {
        lowp_engine.Exchange(s, ids, grads);
        f32_engine.Exchange(s, ids, grads_f32);
        res.lowp[r] = bits;
        res.f32[r] = floats;
      }
    }
  });
  EXPECT_EQ(JoinErrors(errors), "");
  return res;
}

// The exchange of bf16/fp16 gradients is the exchange of their floats, rounded once at the end,
// and (layers without a transform) within the codec's bound of the exact fp64 average plus that
// final rounding: half an ulp, 2^-8 (bf16) or 2^-11 (fp16) relative, and for fp16 half its
// smallest subnormal, 2^-25.
void CheckAgainstReferences(int n, Algorithm algorithm, GradDtype d, bool scatter) {
  SCOPED_TRACE("N=" + std::to_string(n) + " " + std::string(AlgorithmName(algorithm)) + " " +
               GradDtypeName(d) + (scatter ? " reduce-scatter" : " all-reduce"));
  // Two steps: the second carries the first's error-feedback residuals.
  const uint64_t step = 1;
  const Results res = Run(n, algorithm, d, scatter, step + 1);
  const std::vector<Layer> model = Model(!scatter);
  const double round = d == GradDtype::kBf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  const double floor = d == GradDtype::kBf16 ? 0.0 : std::ldexp(1.0, -25);
  for (int r = 0; r < n; ++r) {
    for (size_t l = 0; l < model.size(); ++l) {
      ASSERT_EQ(res.lowp[r][l], Rounded(res.f32[r][l], d)) << "rank " << r << " layer " << l;
      if (!scatter && r > 0) {
        ASSERT_EQ(res.lowp[r][l], res.lowp[0][l]) << "layer " << l;
      }
    }
  }
  for (size_t l = 0; l < model.size(); ++l) {
    const LayerPolicy& p = model[l].policy;
    if (p.geometry != GeometryMode::kNone || p.hadamard || p.error_feedback) continue;
    const size_t count = static_cast<size_t>(model[l].rows * model[l].cols);
    std::vector<double> exact(count, 0.0);
    double sum_amax = 0.0;
    for (int src = 0; src < n; ++src) {
      const std::vector<float> x = ToFloat(LowpInput(d, src, uint32_t(l), count, step), d);
      double amax = 0.0;
      for (size_t i = 0; i < count; ++i) {
        exact[i] += double(x[i]) / n;
        amax = std::max(amax, std::fabs(double(x[i]) / n));
      }
      sum_amax += amax;
    }
    for (int r = 0; r < n; ++r) {
      const ChunkRange mine =
          scatter ? RowChunkOf(count, size_t(model[l].cols), n, r) : ChunkRange{0, count};
      const std::vector<float> got = ToFloat(res.lowp[r][l], d);
      double out_amax = 0.0;
      for (float v : got) out_amax = std::max(out_amax, std::fabs(double(v)));
      // One quantization per rank, and two_phase's requantization of the sum (not under a
      // reduce-scatter), each within the format's relative step of its block's amax.
      const int quantizations = algorithm == Algorithm::kTwoPhase && !scatter ? 2 : 1;
      const double codec = FormatRelStep(p.format) * quantizations * (sum_amax + out_amax);
      for (size_t k = 0; k < got.size(); ++k) {
        const double e = std::fabs(got[k] - exact[mine.begin + k]);
        ASSERT_LE(e, codec + round * std::fabs(got[k]) + floor)
            << "rank " << r << " layer " << l << " element " << k;
      }
    }
  }
}

TEST(GradDtype, AllReduceMatchesTheFp32ExchangeRoundedAndTheFp64Average) {
  for (int n : {2, 3, 4}) {
    for (Algorithm a : {Algorithm::kTwoPhase, Algorithm::kAllGather}) {
      for (GradDtype d : {GradDtype::kBf16, GradDtype::kFp16})
        CheckAgainstReferences(n, a, d, false);
    }
  }
}

TEST(GradDtype, ReduceScatterMatchesTheFp32ExchangeRoundedAndTheFp64Average) {
  for (int n : {2, 3, 4}) {
    for (GradDtype d : {GradDtype::kBf16, GradDtype::kFp16}) {
      CheckAgainstReferences(n, Algorithm::kTwoPhase, d, true);
    }
  }
}

TEST(GradDtype, BaselinesTakeLowpGradients) {
  for (Algorithm a : {Algorithm::kFp32, Algorithm::kBf16}) {
    for (bool scatter : {false, true}) {
      const int n = 3;
      const auto errors = RunRanks(n, [&](Communicator& comm) {
        const int r = comm.rank();
        ExchangeEngine lowp(comm, EngineOptions{}), f32(comm, EngineOptions{});
        EnginePolicy policy;
        policy.layers = {LayerPolicy{}, LayerPolicy{}};
        policy.options.algorithm = a;
        for (ExchangeEngine* e : {&lowp, &f32}) {
          e->SetLayers({{"w", 9, 7}, {"b", 5, 1}});
          e->SetPolicy(policy);
        }
        std::vector<uint16_t> g0 = LowpInput(GradDtype::kBf16, r, 0, 63),
                              g1 = LowpInput(GradDtype::kBf16, r, 1, 5);
        std::vector<float> f0 = ToFloat(g0, GradDtype::kBf16), f1 = ToFloat(g1, GradDtype::kBf16);
        const GradSpans grads = {GradSpan(g0.data(), 63, GradDtype::kBf16),
                                 GradSpan(g1.data(), 5, GradDtype::kBf16)};
        if (!scatter) {
          lowp.Exchange(0, {0, 1}, grads);
          f32.Exchange(0, {0, 1}, {std::span<float>(f0), std::span<float>(f1)});
          EXPECT_EQ(g0, Rounded(f0, GradDtype::kBf16));
          EXPECT_EQ(g1, Rounded(f1, GradDtype::kBf16));
          return;
        }
        const size_t m0 = RowChunkOf(63, 7, n, r).size(), m1 = RowChunkOf(5, 1, n, r).size();
        std::vector<uint16_t> o0(m0), o1(m1);
        std::vector<float> p0(m0), p1(m1);
        lowp.ReduceScatter(
            0, {0, 1}, grads,
            {GradSpan(o0.data(), m0, GradDtype::kBf16), GradSpan(o1.data(), m1, GradDtype::kBf16)});
        f32.ReduceScatter(0, {0, 1}, {std::span<float>(f0), std::span<float>(f1)},
                          {std::span<float>(p0), std::span<float>(p1)});
        EXPECT_EQ(o0, Rounded(p0, GradDtype::kBf16));
        EXPECT_EQ(o1, Rounded(p1, GradDtype::kBf16));
      });
      EXPECT_EQ(JoinErrors(errors), "") << AlgorithmName(a) << (scatter ? " reduce-scatter" : "");
    }
  }
}

// Geometry refreshes on bf16 gradients, both estimators (the ema one deferred to the engine's
// thread), read the rounded average; every step refreshes, so the reduce-scatter all-reduces the
// layer and hands out the all-reduce's rows, rounded.
TEST(GradDtype, GeometryRefreshesReadTheRoundedAverage) {
  const int n = 2;
  const int64_t rows = 32, cols = 24;
  const size_t count = static_cast<size_t>(rows * cols);
  for (GeometryEstimator est : {GeometryEstimator::kFactorEma, GeometryEstimator::kInstant}) {
    std::vector<std::vector<uint16_t>> all_reduced(n), scattered(n);
    std::vector<size_t> refreshes(n, 0);
    const auto errors = RunRanks(n, [&](Communicator& comm) {
      const int r = comm.rank();
      EnginePolicy policy;
      LayerPolicy p = Policy(Format::kFp8E4M3, Scaling::kBlock, 32);
      p.geometry = GeometryMode::kLowRank;
      p.rank = 2;
      policy.layers = {p};
      policy.options.estimator = est;
      policy.schedule = {RefreshSchedule{0, 1, 0}};
      ExchangeEngine ar(comm, EngineOptions{.seed = 1}), rs(comm, EngineOptions{.seed = 1});
      for (ExchangeEngine* e : {&ar, &rs}) {
        e->SetLayers({{"w", rows, cols}});
        e->SetPolicy(policy);
      }
      const ChunkRange mine = RowChunkOf(count, size_t(cols), n, r);
      for (uint64_t s = 0; s < 4; ++s) {
        std::vector<uint16_t> g = LowpInput(GradDtype::kBf16, r, 0, count, s), h = g;
        std::vector<uint16_t> out(mine.size());
        const StepResult a = ar.Exchange(s, {0}, {GradSpan(g.data(), count, GradDtype::kBf16)});
        rs.ReduceScatter(s, {0}, {GradSpan(h.data(), count, GradDtype::kBf16)},
                         {GradSpan(out.data(), out.size(), GradDtype::kBf16)});
        refreshes[r] += a.refreshes.size();
        ASSERT_EQ(out, std::vector<uint16_t>(g.begin() + mine.begin, g.begin() + mine.end))
            << "step " << s;
        all_reduced[r] = g;
      }
      ar.Drain();
      rs.Drain();
      EXPECT_GT(ar.ExportGeometry()[0].active.size(), 0u) << "a refreshed geometry is active";
    });
    ASSERT_EQ(JoinErrors(errors), "");
    EXPECT_GT(refreshes[0], 0u);
    EXPECT_EQ(all_reduced[0], all_reduced[1]);
    // The last step's average against fp64, through the active geometry: within fp8's error.
    std::vector<double> exact(count, 0.0);
    for (int src = 0; src < n; ++src) {
      const std::vector<float> x =
          ToFloat(LowpInput(GradDtype::kBf16, src, 0, count, 3), GradDtype::kBf16);
      for (size_t i = 0; i < count; ++i) exact[i] += double(x[i]) / n;
    }
    const std::vector<float> got = ToFloat(all_reduced[0], GradDtype::kBf16);
    double e = 0, w = 0;
    for (size_t i = 0; i < count; ++i) {
      e += (got[i] - exact[i]) * (got[i] - exact[i]);
      w += exact[i] * exact[i];
    }
    EXPECT_LT(std::sqrt(e / w), 2 * FormatRelStep(Format::kFp8E4M3) + std::ldexp(1.0, -8));
  }
}

}  // namespace
}  // namespace geofp8::testing
